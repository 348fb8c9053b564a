"""Compiling a program once: across processes (a shared compile), and within one (a shared executable).

Several tasks with the same model shapes and batch settings (the demo's four, a sweep over seeds or learning
rates) lower the same programs in different processes at the same moment. JAX's persistent compilation cache
would let all but one load the program, but only if the others wait for the first to write it: compiling
them all at once costs every core N times over. `compile_once` holds an exclusive lock per program (a file
named by the hash of its StableHLO, in the cache directory) around the compile: the first process compiles
and writes the cache entry, the others then find it. Without a local persistent cache it simply compiles.
A process that dies holding a lock releases it (flock).

Within one process (a device group's, holding several tasks' roles) the same program need not even be traced
again: `shared(key, build)` keeps the executable under a key naming everything it depends on (architecture,
settings, mesh, shapes), so the second task with that key takes the first one's executable. Tracing and lowering a
program is ~0.2-0.4 s of Python per program on the demo's model, on the GIL the process's other roles share.
A task that waited for another's build spent that time on a compile all the same: `waits()` tells its caller how
long, so that the task's trace shows it as a compile (rlsched.run.roles), not as a gap before its lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

_EXECUTABLES: dict[Hashable, Any] = {}
_BUILDING: dict[Hashable, threading.Lock] = {}
_GUARD = threading.Lock()
BUILD_WAIT_S = 3600.0  # longest wait for another caller's build of the same program (a compile that hangs)
_WAITS = threading.local()  # .seconds: this thread's waits for another caller's build, while `waits()` counts


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


def shared(key: Hashable, build: Callable[[], Any]) -> tuple[Any, bool]:
    """The executable this process holds under `key`, built by `build()` (trace, lower, compile) the first time;
    (executable, whether this call built it). Two roles asking for one key at once build it once: the second
    waits for the first. `key` must name all the program depends on: equal keys share one executable.
    A build that raises stores nothing under `key`; the next caller builds it again."""
    with _GUARD:
        if key in _EXECUTABLES:
            return _EXECUTABLES[key], False
        lock = _BUILDING.setdefault(key, threading.Lock())
    asked = time.perf_counter()
    if not lock.acquire(timeout=BUILD_WAIT_S):
        raise TimeoutError(f"the build of program {key!r} by another role of this process did not finish in "
                           f"{BUILD_WAIT_S:.0f} s (a compile that hangs)")
    with contextlib.ExitStack() as held:
        held.callback(lock.release)
        if key in _EXECUTABLES:  # built while this caller waited
            record = getattr(_WAITS, "record", None)
            if record is not None:
                record["seconds"] += time.perf_counter() - asked
            return _EXECUTABLES[key], False
        executable = build()
        with _GUARD:
            _EXECUTABLES[key] = executable
            _BUILDING.pop(key, None)
        return executable, True


def forget() -> int:
    """Drop every executable `shared` keeps (returns how many): the next caller of a key builds it again. Each
    compiled program holds a few memory maps of JIT code until it is freed, and a process has a bounded number
    (Linux's vm.max_map_count, 65530 by default): a process that compiles without end (the test suite) forgets
    what it no longer runs, with jax.clear_caches()."""
    with _GUARD:
        n = len(_EXECUTABLES)
        _EXECUTABLES.clear()
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
