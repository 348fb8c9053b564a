"""Placement on this machine's devices. On CPU a "device" is a core: pinning a phase to its cores is
what makes a rollout on one device and a training step on another really run side by side, so
benchmarks measure scheduling rather than two processes fighting over the same cores.

colocated:     both phases use every device of the group.
disaggregated: the rollout pool is the first half of the devices, the train pool the second half.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

from rlsched.scheduling.policy import Phase


def visible_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def phase_cores(placement: str, phase: Phase, cores: list[int]) -> list[int]:
    if placement == "colocated" or len(cores) < 2:
        return list(cores)
    half = len(cores) // 2
    return cores[:half] if Phase(phase) is Phase.ROLLOUT else cores[half:]


@dataclasses.dataclass(frozen=True)
class CoreShare:
    """The cores a role's process is pinned to, as a share of its own node's (phase_cores of that node's visible
    cores), worked out in that process: core ids read on the launcher's node mean nothing on another node (an
    actor's member on another host, a cluster given with --address), where the cores may number otherwise."""

    placement: str  # "colocated" / "disaggregated"
    phase: str  # "rollout" (the engine's) / "train" (the actor's)

    def cores(self) -> list[int]:
        return phase_cores(self.placement, Phase(self.phase), visible_cores())


def pin_process(cores: list[int] | CoreShare, *, xla_threads: int = 1) -> None:
    """Pin every thread of this process (XLA's pools included) to `cores`.

    sched_setaffinity(pid) affects one thread on Linux, so each thread id is set in turn; threads
    started later inherit the affinity of the thread that starts them.

    xla_threads: the fewest threads XLA's CPU pool must have. JAX sizes that pool from the process's
    affinity when its backends start, so pinning first caps the pool at len(cores) — what we want,
    except for a worker that needs more (sglang-jax's CPU sampler calls back into Python from inside
    its jitted step and deadlocks on a one-thread pool). Then JAX starts first, on `cores` plus
    enough other visible cores, and only after that is every thread pinned to `cores` (the extra
    pool threads share them: the worker still runs on its own devices).
    """
    if isinstance(cores, CoreShare):
        cores = cores.cores()
    if xla_threads > len(cores):
        extra = [c for c in visible_cores() if c not in cores][: xla_threads - len(cores)]
        os.sched_setaffinity(0, [*cores, *extra])
        import jax

        jax.devices()  # starts the backends, sizing XLA's CPU pool from the affinity just set
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cores)
