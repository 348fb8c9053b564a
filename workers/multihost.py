"""A role whose mesh spans several JAX processes (one per host): the few things that differ from one process.

    if multihost.is_primary(): write(...)           # files, W&B, progress lines: process 0 only
    batch = multihost.global_array(rows, sharding)   # host numpy, the same on every process -> one global array
    values = multihost.host_value(logprobs)          # a global array's values, on every process (a collective)

Design decisions (and why):
- **SPMD.** Every process of a role runs the same calls in the same order with the same host inputs (the task
  driver sends each member the same call, rlsched.cluster.rolegroup); a program over a global mesh is then one program.
  So a host value that feeds a program is built on every process from the same numpy (`global_array`), and
  every process can read a program's result (`host_value`, a gather every member takes part in).
- **One writer, and a guard.** What leaves the role (files, metrics, log lines) is written by process 0 through
  `is_primary`. Every other process of a role group runs under `guard_run_files`: a Python
  write under the run's directories (open for writing, rename, remove, mkdir, rmtree) raises `RunFileWriteError`
  naming the file, except in the subtrees every process writes by design (orbax saves each process's shards
  under the task's checkpoints; each process keeps its own compiled programs). So a forgotten `is_primary`
  fails the task on its first write instead of two processes racing on one file; tests/test_multihost.py
  shows it in a real two-process JAX job. (Writes from native code, e.g. tensorstore, are not seen: those are
  orbax's, and allowed.)
- **Nothing changes on one process.** Every helper is the identity (or a plain `np.asarray`) when the arrays
  are fully addressable, so single-process roles take exactly their old path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np


def process_index() -> int:
    return jax.process_index()


def is_primary() -> bool:
    """Whether this process writes what the role writes once (process 0 of its JAX job)."""
    return jax.process_index() == 0


class RunFileWriteError(RuntimeError):
    """A process other than 0 of a role group wrote a run file. Not an OSError: code that tolerates a failed
    write (`suppress(OSError)`) must not hide it."""


# What the guard refuses, per process: (roots, shared) as absolute normalized paths; set by guard_run_files.
_GUARD: dict[str, tuple[str, ...]] = {}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
# event: (positions of its paths, positions of their dir_fd). os.replace raises os.rename, os.unlink os.remove.
_PATH_EVENTS = {"os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)),
                "shutil.rmtree": ((0,), (1,)), "os.truncate": ((0,), ()), "os.rename": ((0, 1), (2, 3))}


def guard_run_files(roots: Iterable[str | Path], shared: Iterable[str | Path] = ()) -> bool:
    """On a process other than 0: from now on a write under any of `roots`, outside `shared`, raises
    `RunFileWriteError` naming the path and the process. Returns whether the guard is on here (process 0 and
    single-process roles write as they always do). Calling it again replaces the directories."""
    if is_primary():
        return False
    _GUARD["roots"] = tuple(_norm(r) for r in roots)
    _GUARD["shared"] = tuple(_norm(s) for s in shared)
    if "installed" not in _GUARD:  # an audit hook cannot be removed: install one, steer it through _GUARD
        sys.addaudithook(_audit)
        _GUARD["installed"] = ()
    return True


def _norm(path: Any) -> str:
    return os.path.normpath(os.path.abspath(os.fsdecode(path)))


def _under(path: str, dirs: tuple[str, ...]) -> bool:
    return any(path == d or path.startswith(d + os.sep) for d in dirs)


def _audit(event: str, args: tuple) -> None:
    """The audit hook: runs on every audited event in this process, so it returns at once for the others."""
    if event == "open":
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)
        paths = (path,) if writes else ()
    elif event in _PATH_EVENTS:
        where, fds = _PATH_EVENTS[event]
        if any(i < len(args) and args[i] not in (None, -1) for i in fds):  # os.* say -1 for "no dir_fd"
            return  # relative to a directory fd (inside an rmtree, checked at its top): not a path on its own
        paths = tuple(args[i] for i in where)
    else:
        return
    for path in paths:
        if not isinstance(path, str | bytes | os.PathLike):  # an fd: opened (and checked) before
            continue
        full = _norm(path)
        shared = _GUARD.get("shared", ())
        if event == "os.mkdir" and any(d.startswith(full + os.sep) for d in shared):
            continue  # the way to a shared directory (mkdir parents=True): every process makes it (exist_ok)
        if _under(full, _GUARD.get("roots", ())) and not _under(full, shared):
            raise RunFileWriteError(
                f"process {jax.process_index()} of a role across hosts wrote {full} ({event}): run files are "
                "written once, by process 0; guard the write with workers.multihost.is_primary()")


def spans_processes(sharding) -> bool:
    """Whether a sharding's devices belong to more than this process."""
    return not sharding.is_fully_addressable


def global_array(x: np.ndarray, sharding) -> Any:
    """`x` (the same values on every process) laid out as `sharding`. On one process: `x` as it is, which jit
    lays out itself; across processes each one puts its own devices' slices (no communication)."""
    if not spans_processes(sharding):
        return x
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def host_value(x: Any) -> np.ndarray:
    """The whole of `x` as numpy on this process. A global array no process holds whole is gathered: every
    process of the job must call this, in the same order (it is a collective)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
