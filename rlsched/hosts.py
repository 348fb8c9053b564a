"""Device-group hosts: one process per host that holds every role of a device group (`cluster.processes:
per_device_group`), and the handle through which a task's driver calls its roles there.

    host = start_host(where, "actor", num_devices=8)           # a Ray actor on the group's bundle
    actor = HostedRole.launch(host, ActorRole, spec, channel)  # the role is built in the host's process
    actor.train(batch, rewards, step)                          # one round trip, as with a role's own process

Design decisions (and why):
- **What real hardware needs.** A TPU chip is opened by one process, and a GPU's memory freed in one JAX
  process is kept in that process's pool; so tasks that time-share a device group can only swap their
  state through one process that owns the devices. The host holds each task's actor and engine (their
  device arrays and host copies) and the scheduler's locks decide whose arrays are on the devices, exactly
  as with roles in processes of their own: the roles are the same classes, only their process differs.
- **Both roles of a task in one host talk through a local channel** (rlsched.comm.LocalChannel): weights go
  from the actor's mesh to the engine's device to device, and the message the driver forwards carries no
  arrays.
- **A threaded actor.** Each task's driver blocks in its own call; the locks already order what touches the
  devices, while one task's host-side work (a memory probe, a checkpoint write) runs beside another's phase.
- **Collateral is the price.** A role that kills its process (a segfault, an out-of-memory kill) ends every
  role of the host; every task there fails with `RoleDied` naming the host. That is how a TPU host behaves
  anyway; on CPU the default stays a process per role.
- Ray is imported inside the functions: importing this module costs nothing without Ray.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any

from rlsched import placement as pin
from rlsched.errors import RoleDied, TaskError
from rlsched.exits import death_cause


class RoleHost:
    """The process that holds every role of one device group on this host (run as a threaded Ray actor)."""

    def __init__(self, cores: list[int] | None = None):
        from rlsched import exits

        exits.watch()  # a death is told by how it happened (rlsched.exits)
        if cores:
            pin.pin_process(cores)  # before JAX creates its thread pools: the group's cores, as a role would
        self.roles: dict[str, Any] = {}

    def start(self, key: str, cls, spec, channel) -> None:
        """Build role `cls` (rlsched.roles.ActorRole / EngineRole) for task `spec` here, under `key`."""
        if key in self.roles:
            raise TaskError(f"{key} is held by this host already (a task started twice?)")
        self.roles[key] = cls(spec, channel=channel)

    def call(self, key: str, method: str, args: tuple, kwargs: dict) -> Any:
        role = self.roles.get(key)
        if role is None:
            raise TaskError(f"{key} is not held by this host (it was dropped, or never started)")
        return getattr(role, method)(*args, **kwargs)

    def drop(self, key: str) -> None:
        """Forget a role (its driver closed it first): its arrays are freed with its last reference."""
        if self.roles.pop(key, None) is not None:
            gc.collect()  # device buffers go now, not at the next collection

    def where(self) -> dict[str, Any]:
        """This process, the devices it sees and those each role's mesh uses (for tools and tests)."""
        import jax

        return {"pid": os.getpid(), "devices": [d.id for d in jax.local_devices()],
                "roles": {key: role.device_ids() for key, role in self.roles.items()}}


def start_host(placement, kind: str, *, num_devices: int, max_tasks: int):
    """Start the host of `kind`'s device group ("actor": train, "engine": rollout; one host for both when
    colocated) on its bundle of `placement` (rlsched.cluster.RolePlacement), seeing the pool's devices."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlsched.cluster import role_env

    resource = placement.resource
    options: dict[str, Any] = {"max_restarts": 0, "num_cpus": 0, "max_concurrency": 4 * max_tasks + 4,
                               "scheduling_strategy": PlacementGroupSchedulingStrategy(
                                   placement.placement_group, placement_group_bundle_index=placement.bundles[kind]),
                               "runtime_env": {"env_vars": role_env(num_devices, resource, shares_devices=False)}}
    # The one process that uses the group's accelerators takes them all, so Ray makes them visible to it.
    devices = placement.bundle_devices[kind]
    if resource == "GPU":
        options["num_gpus"] = devices
    elif resource == "CPU":
        options["num_cpus"] = 0.01  # nominal: the bundle reserves the core, the pinning uses it
    else:
        options["resources"] = {resource: devices}
    return ray.remote(RoleHost).options(**options).remote(placement.cores[kind])


class HostedRole:
    """A role held by a device-group host, called like a local one: each method is one blocking round trip."""

    def __init__(self, host, key: str, kind: str):
        self._host, self.key, self.kind = host, key, kind

    @classmethod
    def launch(cls, host, role_cls, spec, channel) -> HostedRole:
        role = cls(host, f"{spec.name}/{role_cls.kind}", role_cls.kind)
        role._get(host.start.remote(role.key, role_cls, spec, channel), "__init__")
        return role

    def _get(self, ref, name: str):
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as err:
            cause = death_cause(err)
            raise RoleDied(f"the device group's host process holding its {self.kind} died during {name}(): "
                           f"{cause}", self.kind, shared=True) from err

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            return self._get(self._host.call.remote(self.key, name, args, kwargs), name)

        return call

    @property
    def handle(self):
        return self._host

    def fence_target(self):
        """What the scheduler stops if it must fence this role's task: the role, dropped by its host."""
        from rlsched.fencing import Target

        return Target(self.kind, self._host, self.key)

    def terminate(self) -> None:
        """Free the role's arrays in the host (the host goes on for the other tasks)."""
        import ray

        with contextlib.suppress(ray.exceptions.RayActorError):  # a dead host: the role's memory went with it
            ray.get(self._host.drop.remote(self.key))
