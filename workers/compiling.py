"""Compiling a lowered program once across processes: tasks of the same shapes share the compile.

Several tasks with the same model shapes and batch settings (the demo's four, a sweep over seeds or learning
rates) lower the same programs in different processes at the same moment. JAX's persistent compilation cache
would let all but one load the program, but only if the others wait for the first to write it: compiling
them all at once costs every core N times over. `compile_once` holds an exclusive lock per program (a file
named by the hash of its StableHLO, in the cache directory) around the compile: the first process compiles
and writes the cache entry, the others then find it. Without a local persistent cache it simply compiles.
A process that dies holding a lock releases it (flock).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path


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
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another process compiles this very program
        return lowered.compile()
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
