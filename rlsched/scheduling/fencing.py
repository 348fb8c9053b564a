"""Fencing: a task's role processes are stopped, and known to be gone, before its lock or its memory passes
to anyone else.

    target = role.fence_target()                  # registered with the scheduler when the task starts
    left = await stop([target, ...])              # in the scheduler, when a lease expires or a driver dies
    left = await confirm(left)                    # later, until nothing is left: is what was not seen gone gone now?

Design decisions (and why):
- **Stop, then hand over.** A lease that expires, a driver that dies or an eviction that fails leaves a task
  whose roles may still run on the devices: the next holder would share them with it (two tasks in one
  phase) or be given memory that is not free. So the scheduler stops them first, and waits until Ray
  reports each process dead, and only then lets the policy count the lock and bytes free.
- **What stopping means depends on where the role lives.** A role in a process of its own: `ray.kill` and
  wait for the process to be gone. A role held by a device-group process (rlsched.cluster.group_process) with no call
  running: the host drops it and refuses its later calls. One with a call running (the hung call that let its lease
  expire) cannot be stopped as a thread: the host's process is ended (`ray.kill`, Ray restarts it on the same
  devices) and the stop is done once the old process is gone (the host answers from a new pid). A host that
  does not answer within `ASK_S` is taken to be stuck, and ended the same way. Every other task of that host
  loses its roles there and rebuilds them (rlsched.run.task); `on_end(target)` is told first, so the scheduler
  can tell them the death was not theirs.
- A role of a device group across hosts (one JAX job) with a call running cannot be ended alone: the whole job is
  ended, every host's process, for good (a new process cannot rejoin a JAX job; every task of the group loses its
  roles there, as when a host dies).
- **Bounded, and what is not confirmed is said.** A process not seen gone within `timeout_s`, or a host that
  could not be asked, is returned as `Unconfirmed`, not waited for forever; the scheduler then takes the device
  group out of service and asks `confirm` again now and then until every one is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

ASK_S = 5.0  # how long a device-group process has to answer whether a role is idle before it is taken to be stuck


@dataclasses.dataclass(frozen=True)
class Target:
    """One role to stop: a Ray actor of its own (`key` None) or a role `key` held by host actor `handle`, whose
    process is `pid` (None: a host of a group across hosts, which cannot be ended alone)."""

    role: str
    handle: Any
    key: str | None = None
    pid: int | None = None


@dataclasses.dataclass(frozen=True)
class Unconfirmed:
    """A target not confirmed stopped, and why: its process may still run a call and hold its bytes."""

    target: Target | None  # None: a stop that raised before it named any target
    why: str

    def __str__(self) -> str:
        return self.why if self.target is None else f"{self.target.role}: {self.why}"


async def stop(targets: list[Target], timeout_s: float = 30.0, on_end=None) -> list[Unconfirmed]:
    """Stop every target; return those that could not be confirmed stopped (empty when all are gone). `on_end(target)`
    is called before a device-group process is ended for a target."""
    import ray

    for t in targets:
        if t.key is None:
            with contextlib.suppress(Exception):  # gone already
                ray.kill(t.handle, no_restart=True)
    deadline = time.monotonic() + timeout_s
    problems, ended, job = [], [], []
    for t in targets:
        if t.key is None:
            if not await _gone(t.handle, deadline):
                problems.append(Unconfirmed(t, f"its process was not seen gone {timeout_s:g} s after ray.kill"))
            continue
        try:
            idle = await asyncio.wait_for(_as_future(t.handle.drop_if_idle.remote(t.key)),
                                          max(0.1, min(ASK_S, deadline - time.monotonic())))
        except ray.exceptions.RayActorError:
            continue  # the host is gone, and the role's arrays with it
        except TimeoutError:
            idle = False  # a host that cannot answer is stuck: only ending it stops what runs there
        except Exception as err:  # noqa: BLE001 - reported, never raised into the lock
            problems.append(Unconfirmed(t, f"its host did not drop it ({type(err).__name__}: {err})"))
            continue
        if idle or any(t.handle == e.handle and t.pid == e.pid for e in ended):
            continue
        if t.pid is None:  # a call runs in a group across hosts: only ending the whole job stops it
            job.append(t)
            continue
        ended.append(t)
        if on_end is not None:
            on_end(t)
        if not await _ended(t.handle, t.pid, deadline):
            problems.append(Unconfirmed(t, f"its device group's process (pid {t.pid}) was not seen gone "
                                           f"{timeout_s:g} s after ray.kill"))
    if job:
        # Every host of the job: the task's role across hosts has a target on each (GroupProcessesRole.fence_target)
        members = [t for t in targets if t.key is not None and t.pid is None]
        for t in members:
            if on_end is not None:
                on_end(t)
            with contextlib.suppress(Exception):  # gone already
                ray.kill(t.handle, no_restart=True)
        for t in members:
            if not await _gone(t.handle, deadline):
                problems.append(Unconfirmed(t, f"a call of it ran in a device group across hosts, whose job was "
                                               f"ended; this host's process was not seen gone {timeout_s:g} s after "
                                               "ray.kill"))
    return problems


async def confirm(left: list[Unconfirmed], timeout_s: float = 30.0) -> list[Unconfirmed]:
    """Ask again whether each target `stop` could not confirm is gone now; return those still not seen gone. A
    process of its own, or a host of a job across hosts, is killed again (for good) and must be reported dead. A
    device-group process on one host is gone once it answers from another pid (Ray restarted it, empty) or is dead;
    one that still answers from its old pid is killed again. One that does not answer is not killed again: it may
    be the new process starting."""
    import ray

    deadline = time.monotonic() + timeout_s
    still = []
    for u in left:
        t = u.target
        if t.pid is None:
            with contextlib.suppress(Exception):  # gone already
                ray.kill(t.handle, no_restart=True)
            if not await _gone(t.handle, deadline):
                still.append(u)
            continue
        try:
            where = await asyncio.wait_for(_as_future(t.handle.where.remote()), max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            continue
        except Exception:  # noqa: BLE001 - not answering (starting, or stuck): not confirmed, asked again later
            still.append(u)
            continue
        if where["pid"] == t.pid:
            with contextlib.suppress(Exception):
                ray.kill(t.handle, no_restart=False)
            still.append(u)
    return still


async def _ended(handle, pid: int, deadline: float) -> bool:
    """End a device-group process `pid` (Ray restarts it, empty, on the same devices); True once it is
    gone: the host answers from another process, or is dead for good."""
    import ray

    with contextlib.suppress(Exception):
        ray.kill(handle, no_restart=False)
    while time.monotonic() < deadline:
        try:
            where = await asyncio.wait_for(_as_future(handle.where.remote()), max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return True
        except TimeoutError:
            return False
        if where["pid"] != pid:
            return True
        await asyncio.sleep(0.05)
    return False


async def _gone(handle, deadline: float) -> bool:
    """Wait until calls to `handle` fail because its process died (what Ray says once the kill is done)."""
    import ray

    while time.monotonic() < deadline:
        try:
            await asyncio.wait_for(_as_future(handle.__ray_ready__.remote()), max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return True
        except TimeoutError:
            return False
        await asyncio.sleep(0.05)
    return False


def _as_future(ref):
    """An ObjectRef as an asyncio future (awaitable in the scheduler's event loop)."""
    return asyncio.wrap_future(ref.future()) if hasattr(ref, "future") else asyncio.ensure_future(ref)
