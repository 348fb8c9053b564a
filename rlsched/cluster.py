"""The Ray cluster an experiment runs on: connect to it (or start an embedded one), what a device is
there, and the placement group that reserves a device group's devices.

Ray is imported inside the functions: importing this module costs nothing where Ray is not used
(`--in-process` runs of jax_sampler tasks).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rlsched.placement import phase_cores
from rlsched.policy import Phase

GROUP = "g0"  # one device group per experiment for now: every task shares it


def init_ray(address: str | None = None) -> None:
    """Connect to the Ray cluster at `address`, or start an embedded local one (no dashboard).

    Ray's token authentication stays as Ray sets it: on for a new local cluster (Ray generates the token
    into ~/.ray/auth_token, and only clients holding it can connect: Ray's servers listen on every
    interface), and whatever a cluster the user brings has, its token read by Ray from RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=True,
                 **({"num_cpus": max(4, 2 * os.cpu_count())} if address is None else {}))


HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def role_env(num_devices: int, resource: str, *, shares_devices: bool) -> dict[str, str]:
    """The environment a role's process starts with (set before JAX starts there).

    - CPU: `num_devices` XLA host devices (the experiment's device pool; each role's mesh takes its devices
      from it). Harmless elsewhere: the flag only shapes the CPU backend.
    - GPU, when roles of several processes share a device (colocated): no preallocation (JAX takes 75 % of
      a GPU at start by default) and the platform allocator (JAX's pool keeps freed buffers, so an offload
      would free nothing for the other process).
    """
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(HOST_DEVICES_FLAG)]
    env = {"XLA_FLAGS": " ".join([*flags, f"{HOST_DEVICES_FLAG}={num_devices}"])}
    if resource == "GPU" and shares_devices:
        env |= {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
    return env


def use_host_devices(num_devices: int) -> None:
    """This process will hold roles itself (`--in-process`): give it the pool's XLA host devices, if JAX has
    not started yet (if it has, a role whose mesh needs more devices than it sees says so)."""
    import sys

    if "jax" not in sys.modules:
        os.environ.update(role_env(num_devices, "CPU", shares_devices=False))


def device_resource() -> str:
    """The Ray resource a device is: GPU where the cluster has GPUs, else a CPU core."""
    import ray

    return "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU"


@dataclasses.dataclass(frozen=True)
class RolePlacement:
    """Where a task's roles start: a bundle of the device group's placement group and the cores (on CPU,
    the devices) each role's process is pinned to. `None` as a placement means: in this process."""

    placement_group: Any  # ray.util.placement_group.PlacementGroup
    bundles: dict[str, int]  # role ("actor" / "engine") -> bundle index
    cores: dict[str, list[int]]  # role -> cores its process is pinned to
    resource: str = "CPU"  # the Ray resource a device is ("GPU" or "CPU")


def make_placement_group(experiment: str, placement: str, resource: str):
    """One placement group for the device group: a rollout bundle and a train bundle (disaggregated)
    or one shared bundle (colocated). Every task's roles are placed in it, so they land on the
    group's devices; which device each uses is decided by pinning (see rlsched.placement)."""
    import ray
    from ray.util.placement_group import placement_group

    bundles = [{resource: 1}] if placement == "colocated" else [{resource: 1}, {resource: 1}]
    pg = placement_group(bundles, strategy="STRICT_PACK", name=f"{experiment}/{GROUP}")
    ray.get(pg.ready(), timeout=60)
    return pg


def role_placement(pg, placement: str, cores: list[int], resource: str) -> RolePlacement:
    """Disaggregated: the engine on the rollout bundle and cores, the actor on the train ones;
    colocated: both on the one bundle and every core."""
    return RolePlacement(pg, {"engine": 0, "actor": 0 if placement == "colocated" else 1},
                         {"engine": phase_cores(placement, Phase.ROLLOUT, cores),
                          "actor": phase_cores(placement, Phase.TRAIN, cores)}, resource)
