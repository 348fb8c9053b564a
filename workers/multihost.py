"""A role whose mesh spans several JAX processes (one per host): the few things that differ from one process.

    if multihost.is_primary(): write(...)           # files, W&B, progress lines: process 0 only
    batch = multihost.global_array(rows, sharding)   # host numpy, the same on every process -> one global array
    values = multihost.host_value(logprobs)          # a global array's values, on every process (a collective)

Design decisions (and why):
- **SPMD.** Every process of a role runs the same calls in the same order with the same host inputs (the task
  driver sends each member the same call, rlsched.rolegroup); a program over a global mesh is then one program.
  So a host value that feeds a program is built on every process from the same numpy (`global_array`), and
  every process can read a program's result (`host_value`, a gather every member takes part in).
- **One writer.** What leaves the role (files, metrics, log lines) is written by process 0 through
  `is_primary`; tests/test_multihost_guard.py fails on a run file written from another process.
- **Nothing changes on one process.** Every helper is the identity (or a plain `np.asarray`) when the arrays
  are fully addressable, so single-process roles take exactly their old path.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def process_index() -> int:
    return jax.process_index()


def is_primary() -> bool:
    """Whether this process writes what the role writes once (process 0 of its JAX job)."""
    return jax.process_index() == 0


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
