"""Compiling a program once: across processes (a shared compile), and within one (a shared executable).

Several tasks with the same model shapes and batch settings (the demo's four, a sweep over seeds or learning
rates) lower the same programs in different processes at the same moment. JAX's persistent compilation cache
would let all but one load the program, but only if the others wait for the first to write it: compiling
them all at once costs every core N times over. `compile_once` holds an exclusive lock per program (a file
named by the hash of its StableHLO, in the cache directory) around the compile: the first process compiles
and writes the cache entry, the others then find it. Without a local persistent cache it simply compiles.
A process that dies holding a lock releases it (flock).

Within one process (a device group's, holding several tasks' roles) the same program need not even be traced
again: `shared(key, build)` finds the executable under a key naming everything it depends on (architecture,
settings, mesh, shapes), so the second task with that key takes the first one's executable. Tracing and lowering a
program is ~0.2-0.4 s of Python per program on the demo's model, on the GIL the process's other roles share.
A task that waited for another's build spent that time on a compile all the same: `waits()` tells its caller how
long, so that the task's trace shows it as a compile (rlsched.run.roles), not as a gap before its lock.

The registry holds executables weakly: a program lives while a caller that asked for it holds it, and goes (with
its memory maps of JIT code) with the last one; a caller of `shared` keeps what it gets for as long as it runs it.
Why: a device group's process lives as long as the scheduler service, and a sweep's every learning rate is a new
update program there (the optimizer's settings are in its key; the loss's programs are shared). Held for ever, one
tiny actor's programs kept ~590 memory maps (measured on CPU), so ~100 tasks of a sweep would reach the process's
cap (Linux's vm.max_map_count, 65530 by default), where the next compile dies of a segfault.

What a process keeps for roles to come besides (other modules' caches registered with `kept`: the sampler's jitted
generate functions, the copy programs, the co-batching registries; JAX's own caches) it gives back when told:
`forget()`. A device group's process forgets whenever it holds no role (rlsched.cluster.group_process); the
next task's programs then come from JAX's persistent compilation cache, as in a new process.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

_EXECUTABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # while a caller holds it
_BUILDING: dict[Hashable, threading.Lock] = {}
_GUARD = threading.Lock()
BUILD_WAIT_S = 3600.0  # longest wait for another caller's build of the same program (a compile that hangs)
_WAITS = threading.local()  # .seconds: this thread's waits for another caller's build, while `waits()` counts
_KEPT: list[dict] = []  # other modules' caches of programs and registries for roles to come (`kept`)


def kept(cache: dict) -> dict:
    """Register `cache`, a module's own dict of what it keeps for roles to come (compiled programs, the jitted
    functions that build them, registries of groups): `forget` empties it too and `programs` counts it."""
    _KEPT.append(cache)
    return cache


@contextlib.contextmanager
def waits() -> Iterator[dict[str, float]]:
    """Inside: `shared` adds to the yielded {"seconds": s} the time this thread waited for a build another caller
    was doing (the other's compile, shared). Outside one, waits are not counted."""
    record = {"seconds": 0.0}
    outer, _WAITS.record = getattr(_WAITS, "record", None), record
    try:
        yield record
    finally:
        _WAITS.record = outer


def shapes_key(arrays: dict) -> tuple:
    """{name: (shape, dtype)} as a hashable part of a `shared` key."""
    import numpy as np

    return tuple(sorted((k, tuple(shape), np.dtype(dtype).str) for k, (shape, dtype) in arrays.items()))


def find(key: Hashable) -> Any | None:
    """The executable a caller of `shared(key, ...)` still holds, or None."""
    with _GUARD:
        return _EXECUTABLES.get(key)


def shared(key: Hashable, build: Callable[[], Any]) -> tuple[Any, bool]:
    """The executable another caller holds under `key`, else built by `build()` (trace, lower, compile; it must
    return an object a weak reference can point at, as JAX's executables are); (executable, whether this call built
    it). Two roles asking for one key at once build it once: the second waits for the first. `key` must name all
    the program depends on: equal keys share one executable. The caller keeps it for as long as it runs it: the
    registry forgets it when no caller holds it any more. A build that raises stores nothing under `key`; the next
    caller builds it again."""
    with _GUARD:
        executable = _EXECUTABLES.get(key)
        if executable is not None:
            return executable, False
        lock = _BUILDING.setdefault(key, threading.Lock())
    asked = time.perf_counter()
    if not lock.acquire(timeout=BUILD_WAIT_S):
        raise TimeoutError(f"the build of program {key!r} by another role of this process did not finish in "
                           f"{BUILD_WAIT_S:.0f} s (a compile that hangs)")
    with contextlib.ExitStack() as held:
        held.callback(lock.release)
        with _GUARD:
            executable = _EXECUTABLES.get(key)
        if executable is not None:  # built while this caller waited
            record = getattr(_WAITS, "record", None)
            if record is not None:
                record["seconds"] += time.perf_counter() - asked
            return executable, False
        executable = build()
        with _GUARD:
            _EXECUTABLES[key] = executable
            _BUILDING.pop(key, None)
        return executable, True


def at_once(calls: list[tuple], name: str = "at-once") -> list[tuple[Any, BaseException | None]]:
    """Each (function, *args) of `calls` run at once, one on this thread and the others on threads of their own; per
    call, in order, (its result, None) or (None, the error it raised): every call has ended when this returns. Daemon
    threads: a second Ctrl-C (rlsched.run.stopping) leaves without waiting for a compile to end."""
    outcomes: list[tuple[Any, BaseException | None]] = [(None, None)] * len(calls)

    def run(i: int) -> None:
        function, *args = calls[i]
        try:
            outcomes[i] = function(*args), None
        except BaseException as err:  # noqa: BLE001 - the caller raises it, once every call has ended
            outcomes[i] = None, err

    threads = [threading.Thread(target=run, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(1, len(calls))]
    for thread in threads:
        thread.start()
    if calls:
        run(0)
    for thread in threads:
        thread.join()
    return outcomes


def shared_at_once(builds: list[tuple[Hashable, Callable[[], Any]]]) -> list[tuple[Any, bool]]:
    """`shared(key, build)` of each (key, build) of `builds` at once, each on a thread of its own (the first on this
    one), in order. Their traces take turns on Python's lock; their compiles run in XLA, outside it, side by side: a
    role's programs take the longest compile rather than the sum, where the host has the cores. The waits of all
    count in this thread's `waits()`. The first error is raised once every build has ended."""
    caller = getattr(_WAITS, "record", None)
    waited = [0.0] * len(builds)

    def build(i: int) -> tuple[Any, bool]:
        outer = getattr(_WAITS, "record", None)
        _WAITS.record = record = {"seconds": 0.0}
        try:
            return shared(*builds[i])
        finally:
            waited[i], _WAITS.record = record["seconds"], outer

    outcomes = at_once([(build, i) for i in range(len(builds))], "compile")
    if caller is not None:
        caller["seconds"] += sum(waited)
    for _, err in outcomes:
        if err is not None:
            raise err
    return [result for result, _ in outcomes]


def programs() -> int:
    """How many entries this process keeps: the executables of `shared` some caller holds, and the entries of every
    `kept` cache."""
    with _GUARD:
        return len(_EXECUTABLES) + sum(len(cache) for cache in _KEPT)


def forget() -> int:
    """Drop everything this process keeps for roles to come (returns `programs()` as it was): the registry of
    `shared` (what callers still hold stays theirs), every `kept` cache, and JAX's own caches. The next caller of a
    key builds it again. Call it where no role of the process runs: a role that runs keeps working, but compiles
    again what it asks for next."""
    with _GUARD:
        n = len(_EXECUTABLES) + sum(len(cache) for cache in _KEPT)
        _EXECUTABLES.clear()
        for cache in _KEPT:
            cache.clear()
    if "jax" in sys.modules:  # nothing to clear in a process that never imported JAX
        sys.modules["jax"].clear_caches()
    return n


def compile_once(lowered):
    """`lowered.compile()`, one process at a time per program when JAX's persistent cache is a local directory."""
    import jax

    directory = jax.config.jax_compilation_cache_dir
    if not directory or "://" in str(directory):  # off, or a remote store (no flock there): just compile
        return lowered.compile()
    key = hashlib.sha256(lowered.as_text().encode()).hexdigest()[:40]
    lock = Path(directory) / "rlsched-compile-locks" / key
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:  # waits while another process compiles this very program (then finds it in the cache)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:  # that process hangs: the lock only saves a second compile
                    print(f"rlsched: another process has compiled program {key} for {BUILD_WAIT_S:.0f} s "
                          f"(lock {lock}); compiling it here without waiting", flush=True)
                    break
                time.sleep(0.05)
        return lowered.compile()
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
