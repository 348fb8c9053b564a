"""The Ray cluster an experiment runs on: connect to it (or start an embedded one), what a device is
there, and the placement group that reserves a device group's devices.

Ray is imported inside the functions: importing this module costs nothing where Ray is not used
(`--in-process` runs of jax_sampler tasks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
from typing import Any

from rlsched.cluster import exits
from rlsched.cluster.pinning import CoreShare
from rlsched.scheduling.policy import Phase

GROUP = "g0"  # one device group per experiment for now: every task shares it


def init_ray(address: str | None = None, *, log_to_driver: bool = True, namespace: str | None = None,
             probe: bool = True) -> bool:
    """Connect to the Ray cluster at `address`, or start an embedded local one (no dashboard); True when this
    call started or joined one (False: this process was connected already, and whoever connected it ends it).

    Ray's token authentication is on for a new local cluster, its token the user's alone (rlsched.cluster.security:
    only clients holding it can connect, and Ray's servers listen on every interface); a cluster the user
    brings keeps what it has, its token read by Ray from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token. `log_to_driver=False`: what worker processes print stays in Ray's
    log files (/tmp/ray/session_latest/logs), not on this process's terminal. `namespace`: Ray's namespace for
    named actors (rlsched.service.server). `probe=False`: the address is known good (a record rlsched wrote itself),
    so the reachability probe (`check_reachable`, a subprocess) is skipped."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return False
    if address is not None and probe:
        check_reachable(address)
    if address is None:  # a cluster of our own: its token the user's alone, authentication never off unasked
        from rlsched.cluster.security import prepare_embedded_cluster

        prepare_embedded_cluster(echo=lambda line: print(line, file=sys.stderr, flush=True))
    # Ray's start-up chatter ("Started a local Ray instance", and a note that suggests turning token
    # authentication off, which rlsched never does) is not for a user: only Ray's errors show while it starts.
    loggers = [logging.getLogger(name) for name in _RAY_STARTUP_LOGGERS]
    for logger in loggers:
        logger.addFilter(_errors_only)
    try:
        local = {"num_cpus": max(4, 2 * os.cpu_count())} if address is None else {}
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=log_to_driver,
                 namespace=namespace, **local)
    finally:
        for logger in loggers:
            logger.removeFilter(_errors_only)
    return True


@contextlib.contextmanager
def shutting_down(connected: bool):
    """Inside: Ray is being shut down in a background thread (when `connected`, what `init_ray` returned), while
    the body does work that needs no Ray (a run's outputs). Ray stops its daemons one after another, each given up
    to a second to exit (~1.4 s here), and drawing the Gantt takes ~0.6 s: side by side, a run's command returns
    sooner. Leaving the block waits for both."""
    import threading

    import ray

    thread = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True) if connected else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        if thread is not None:
            thread.join()


def worker_log_dir() -> str | None:
    """Where Ray writes its processes' stdout and stderr on this node (each node has its own), or None."""
    import ray

    try:
        return os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")  # no public API
    except Exception:  # noqa: BLE001 - a Ray without it (or a client connection): the line is left out
        return None


# The loggers of Ray's start-up messages (a logger's filter sees the records it creates itself).
_RAY_STARTUP_LOGGERS = ("ray._private.worker", "ray._private.authentication.authentication_token_setup")


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


PROBE_TIMEOUT_S = 15.0
_probed: set[str] = set()  # addresses found to be Ray clusters of our versions (train and init_ray both ask)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast, naming `address`, where Ray itself would retry for minutes or fail with a traceback: nothing
    listens there; something listens that is no Ray cluster; a cluster of other Ray or Python versions. Only
    a `host:port` address is probed ("auto", "local" and ray:// client addresses go to Ray as they are)."""
    import socket
    import subprocess
    import sys

    from rlsched.base.errors import ClusterUnreachable

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address or address in _probed:
        return
    start = ("start one with `ray start --head` and pass the address it prints, or leave --address out for an "
             "embedded local Ray")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except OSError as err:
        raise ClusterUnreachable(f"--address {address}: no Ray cluster answers there ({err.strerror or err}); "
                                 f"{start}") from None
    try:
        probe = subprocess.run([sys.executable, "-m", "rlsched.cluster.gcsprobe", address], capture_output=True,
                               text=True, timeout=PROBE_TIMEOUT_S, env=os.environ | {"RAY_USAGE_STATS_ENABLED": "0"})
    except subprocess.TimeoutExpired:
        raise ClusterUnreachable(f"--address {address}: something listens there, but no Ray cluster answered in "
                                 f"{PROBE_TIMEOUT_S:.0f} s (a wrong port? Ray's GCS listens on 6379 unless "
                                 f"`ray start --head --port` said otherwise); {start}") from None
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ClusterUnreachable(f"--address {address}: the Ray cluster there could not be asked for its "
                                 f"versions: {last}")
    check_versions(address, json.loads(probe.stdout))
    _probed.add(address)


def check_versions(address: str, metadata: dict) -> None:
    """The cluster at `address` runs the Ray and Python this process runs, as `ray.init` requires (its own
    check, made into one line)."""
    import platform

    import ray
    from ray._private.utils import check_version_info

    from rlsched.base.errors import ClusterUnreachable

    try:
        check_version_info(metadata, f"rlsched at {address}", raise_on_mismatch=True)
    except RuntimeError:
        raise ClusterUnreachable(
            f"--address {address}: the cluster runs Ray {metadata.get('ray_version')} on Python "
            f"{metadata.get('python_version')}, this rlsched Ray {ray.__version__} on Python "
            f"{platform.python_version()}; run rlsched with the cluster's versions, or start the cluster from this "
            "environment") from None


HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def role_env(num_devices: int, resource: str, *, shares_devices: bool) -> dict[str, str]:
    """The environment a role's process starts with (set before JAX starts there).

    - CPU: `num_devices` XLA host devices (the experiment's device pool; each role's mesh takes its devices
      from it). Harmless elsewhere: the flag only shapes the CPU backend.
    - GPU, when roles of several processes share a device (colocated, or several tasks' roles on one group):
      no preallocation (JAX takes 75 % of a GPU at start by default) and the platform allocator (JAX's pool
      keeps freed buffers, so an offload would free nothing for the other process).
    """
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(HOST_DEVICES_FLAG)]
    # exits.ENV: the role's process records how it ends (rlsched.cluster.exits), for the error its task ends with
    env = {"XLA_FLAGS": " ".join([*flags, f"{HOST_DEVICES_FLAG}={num_devices}"]), exits.ENV: "1"}
    if resource == "GPU" and shares_devices:
        env |= {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
    return env


def own_process_resources(resource: str, devices: int) -> dict[str, Any]:
    """The Ray resources of a role in a process of its own (`cluster.processes: per_role`) on a bundle of
    `devices` devices of `resource`. GPU: a nominal share (1/100 of one GPU): roles time-share the device under
    the locks, and Ray gives a fractional share exactly one device. TPU: the bundle's chips, whole: a chip opens
    in one process, so a process that did not ask for them would not see them (the config refuses per_role
    where two role processes would share one). CPU: nominal; the bundle reserves the cores, the pinning uses them."""
    if resource == "GPU":
        return {"num_gpus": 0.01}
    if resource == "TPU":
        return {"num_cpus": 0, "resources": {"TPU": devices}}
    return {"num_cpus": 0.01}


def enter_role_env(env: dict[str, str] | None) -> None:
    """Put `role_env`'s variables into this role process's environment, first thing in its constructor (None: a
    role built in the caller's process, which keeps its own). Given to the constructor rather than as Ray's
    runtime_env, which starts every process through an extra Python (Ray's setup_worker: ~0.7 s of CPU and
    ~0.3 s more per role process, measured here) and keeps it from taking an idle worker Ray has started.
    Everything these variables shape is read when JAX starts its backend; one started already in this process
    (a pooled worker reused after a task that used JAX) is refused, as the variables would not take effect."""
    if env is None:
        return
    import sys

    if "jax" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized() and any(os.environ.get(k) != v for k, v in env.items()):
            raise RuntimeError("this role's process started JAX before rlsched could set its environment (Ray "
                               "reused a worker whose earlier work used JAX); run JAX work in actors of its own")
    os.environ.update(env)


def use_host_devices(num_devices: int) -> None:
    """This process will hold roles itself (`--in-process`): give it the pool's XLA host devices, if JAX has
    not started yet (if it has, a role whose mesh needs more devices than it sees says so)."""
    import sys

    if "jax" not in sys.modules:
        env = role_env(num_devices, "CPU", shares_devices=False)
        env.pop(exits.ENV)  # this process is the driver: its end is no role's death to explain
        os.environ.update(env)


def device_resource() -> str:
    """The Ray resource a device is: TPU or GPU where the cluster has them, else a CPU core."""
    import ray

    have = ray.cluster_resources()
    return next((r for r in ("TPU", "GPU") if have.get(r, 0) > 0), "CPU")


ONE_DEVICE_EACH = {"engine": 1, "actor": 1}  # a group's devices when none are given: one per role's group


@dataclasses.dataclass(frozen=True)
class RoleSites:
    """Where a task's roles start: a bundle of the device group's placement group and the cores (on CPU,
    the devices) each role's process is pinned to. `None` as a placement means: in this process."""

    placement_group: Any  # ray.util.placement_group.PlacementGroup
    bundles: dict[str, int]  # role ("actor" / "engine") -> bundle index
    cores: dict[str, CoreShare]  # role -> the share of its node's cores its process is pinned to
    resource: str = "CPU"  # the Ray resource a device is ("TPU", "GPU" or "CPU")
    bundle_devices: dict[str, int] = dataclasses.field(default_factory=lambda: dict(ONE_DEVICE_EACH))
    processes: dict[str, Any] | None = None  # role -> its device group's process (rlsched.cluster.group_process),
                                         # per_device_group only
    host_bundles: tuple[int, ...] = (0,)  # the group's bundle on each host, in host order (rlsched.cluster.rolegroup)

    @property
    def one_process(self) -> bool:
        """Both roles of a task in one process: a colocated group's process."""
        return self.processes is not None and self.bundles["engine"] == self.bundles["actor"]


def group_devices(placement: str, num_devices: int, rollout_devices: int) -> dict[str, int]:
    """Devices of each role's group: colocated, the whole pool for both; disaggregated, the rollout group is
    the pool's first `rollout_devices` (the largest rollout mesh) and the train group the rest."""
    if placement == "colocated":
        return {"engine": num_devices, "actor": num_devices}
    return {"engine": rollout_devices, "actor": num_devices - rollout_devices}


def bundle_shapes(placement: str, resource: str, devices: dict[str, int]) -> list[dict[str, float]]:
    """The placement group's bundles: one (colocated) or rollout then train (disaggregated). On an accelerator
    a bundle reserves its group's devices; on CPU a device is an XLA host device of each process, and a
    bundle reserves one core (the pinning decides which cores a group uses)."""
    kinds = ["engine"] if placement == "colocated" else ["engine", "actor"]
    return [{resource: 1 if resource == "CPU" else devices[k]} for k in kinds]


def make_placement_group(experiment: str, placement: str, resource: str, devices: dict[str, int] | None = None,
                         *, hosts: int = 1):
    """One placement group for the device group (see `bundle_shapes`). Every task's roles are placed in it, so
    they land on the group's devices. `hosts` > 1: one bundle per host, each on a node of its own (STRICT_SPREAD),
    each holding that host's devices (`devices["actor"]` per host); checked against the live cluster first."""
    import ray
    from ray.util.placement_group import placement_group

    if hosts > 1:
        per_host = (devices or ONE_DEVICE_EACH)["actor"]
        bundle = {resource: 1 if resource == "CPU" else per_host}
        check_hosts(resource, bundle[resource], hosts, per_host)
        pg = placement_group([dict(bundle) for _ in range(hosts)], strategy="STRICT_SPREAD",
                             name=f"{experiment}/{GROUP}")
    else:
        bundles = bundle_shapes(placement, resource, devices or ONE_DEVICE_EACH)
        pg = placement_group(bundles, strategy="STRICT_PACK", name=f"{experiment}/{GROUP}")
    try:
        ray.get(pg.ready(), timeout=60)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group

        from rlsched.base.errors import ClusterTooSmall

        remove_placement_group(pg)
        raise ClusterTooSmall(f"the device group ({hosts} host(s)) could not be placed on the cluster in 60 s: "
                              f"its resources are taken by something else (`ray status` shows what)") from None
    return pg


def check_hosts(resource: str, need: float, hosts: int, per_host: int) -> None:
    """Refuse, with the numbers, a device group of `hosts` hosts where fewer live nodes have `need` of
    `resource` (on CPU a host's devices are XLA host devices of its processes, and a node needs one core)."""
    import ray

    from rlsched.base.errors import ClusterTooSmall

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fit = [n for n in nodes if n.get("Resources", {}).get(resource, 0) >= need]
    if len(fit) < hosts:
        raise ClusterTooSmall(f"cluster.hosts is {hosts}, but the Ray cluster has {len(fit)} node(s) with {need:g} "
                              f"{resource} free to give ({len(nodes)} alive in all; {per_host} devices per host); "
                              "add nodes with `ray start --address ...` or lower cluster.hosts")


def role_sites(pg, placement: str, resource: str, devices: dict[str, int] | None = None, *,
                   hosts: int = 1) -> RoleSites:
    """Disaggregated: the engine on the rollout bundle and cores, the actor on the train ones;
    colocated: both on the one bundle and every core. `hosts` > 1 (colocated): the engine and the actor's first
    member on host 0's bundle, the actor's other members on the next hosts'. Each process works out its cores
    from its own node's (CoreShare)."""
    actor = 0 if placement == "colocated" else 1
    return RoleSites(pg, {"engine": 0, "actor": actor},
                         {"engine": CoreShare(placement, str(Phase.ROLLOUT)),
                          "actor": CoreShare(placement, str(Phase.TRAIN))}, resource,
                         dict(devices or ONE_DEVICE_EACH), host_bundles=tuple(range(hosts)) if hosts > 1 else (actor,))
