"""Fencing: a task's role processes are stopped, and known to be gone, before its lock or its memory passes
to anyone else.

    target = role.fence_target()                  # registered with the scheduler when the task starts
    problems = await stop([target, ...])          # in the scheduler, when a lease expires or a driver dies

Design decisions (and why):
- **Stop, then hand over.** A lease that expires, a driver that dies or an eviction that fails leaves a task
  whose roles may still run on the devices: the next holder would share them with it (two tasks in one
  phase) or be given memory that is not free. So the scheduler stops them first, and waits until Ray
  reports each process dead, and only then lets the policy count the lock and bytes free.
- **What stopping means depends on where the role lives.** A role in a process of its own: `ray.kill` and
  wait for the process to be gone. A role held by a device-group host (rlsched.hosts): the host drops it;
  its arrays go when no call of its is running any more (a thread cannot be killed; a host whose call is
  stuck is a host to restart, which ends every task there).
- **Bounded.** A process that does not die within `timeout_s` is reported, not waited for forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any


@dataclasses.dataclass(frozen=True)
class Target:
    """One role to stop: a Ray actor of its own (`key` None) or a role `key` held by host actor `handle`."""

    role: str
    handle: Any
    key: str | None = None


async def stop(targets: list[Target], timeout_s: float = 30.0) -> list[str]:
    """Stop every target; return what could not be confirmed stopped (empty when all are gone)."""
    import ray

    for t in targets:
        if t.key is None:
            with contextlib.suppress(Exception):  # gone already
                ray.kill(t.handle, no_restart=True)
    deadline = time.monotonic() + timeout_s
    problems = []
    for t in targets:
        if t.key is not None:
            try:
                await asyncio.wait_for(_as_future(t.handle.drop.remote(t.key)), max(0.1, deadline - time.monotonic()))
            except ray.exceptions.RayActorError:
                pass  # the host is gone, and the role's arrays with it
            except Exception as err:  # noqa: BLE001 - a timeout or an error: reported, never raised into the lock
                problems.append(f"{t.role}: its host did not drop it ({type(err).__name__})")
        elif not await _gone(t.handle, deadline):
            problems.append(f"{t.role}: its process still answered {timeout_s:.0f} s after ray.kill")
    return problems


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
