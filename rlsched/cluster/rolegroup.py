"""A role whose mesh spans hosts: one Ray actor per host, joined into one JAX job, called SPMD.

    group = RoleGroup.launch(ActorRole, spec, channel=channel, sites=where, take_port=locks.take_port)
    metrics = group.train(batch, rewards, step)   # every member runs train(...) on the same arguments;
                                                  # the value is member 0's
    group.terminate()                             # every member's process ends

Design decisions (and why):
- **Ray places, JAX joins.** Each member is a Ray actor on its own host's bundle of the device group's
  placement group (one bundle per host, STRICT_SPREAD, rlsched.cluster.ray_cluster). Once placed, every member calls
  `jax.distributed.initialize` with the group's coordinator on member 0's host; only then does JAX start in
  them, so the role's mesh sees every member's devices (rlsched.run.roles.role_mesh) and its programs are one SPMD
  program. On CPU the processes talk through gloo.
- **A coordinator port per group from the scheduler.** The port comes from the scheduler's allocator
  (rlsched.scheduling.ports), so no two groups share one; member 0 checks that its host can bind it, and binds only its
  node's address (the one the other members reach it on), never every interface.
- **SPMD calls.** Every member gets the same method and arguments in the same order, and the driver waits
  for all of them: a collective needs everyone. Results are replicated (metrics, checksums) or only member 0
  produces them (a weight message, files: workers.multihost.is_primary), so member 0's result is the value.
- **A member's failure is the role's.** A member that dies fails the call at once (its peers would block in
  the next collective): every member is killed and the call raises `RoleDied` naming the member, its host and
  the call. A member still running `hang_timeout_s` after another finished the same call is stuck in a
  collective whose peer is gone or wedged; it is treated the same way. Both end this task only. A call that no
  member answers in `call_timeout_s` (cluster.call_timeout_s) fails naming it, as a role in a process of its own
  does (rlsched.run.roles.RemoteRole).
- Ray and JAX are imported inside the functions: the control plane imports this module for free.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any

from rlsched.base.errors import RoleDied, TaskError
from rlsched.base.waits import answer, no_answer
from rlsched.cluster import exits
from rlsched.cluster import pinning as pin

HANG_TIMEOUT_S = 120.0  # a member this long behind a peer on the same call is stuck in a collective
JOIN_TIMEOUT_S = 120  # jax.distributed.initialize: every member must reach the coordinator within this
PORT_CHECK_TIMEOUT_S = 30.0  # member 0's answer to whether its host can bind a port (a socket bind: instant)


class JobMember:
    """What every process that joins a JAX job across hosts can do: say where it runs, check a port, join.
    A role group's member (below) and a device group's process across hosts (rlsched.cluster.group_process) are both
    one."""

    def node(self) -> dict[str, Any]:
        """Where this member runs: Ray node id, the node's address, the process id."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "host": ray.util.get_node_ip_address(),
                "pid": os.getpid()}

    def port_free(self, host: str, port: int) -> bool:
        """Whether this host can bind `port` on `host` now (the coordinator will bind it next)."""
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
        return True

    def join(self, coordinator: str, num_processes: int, process_id: int, timeout_s: int) -> dict[str, Any]:
        """Join the group's JAX job (member 0 serves its coordinator on `coordinator`, its own address)."""
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only; accelerators use their own
        bind = coordinator if process_id == 0 else None
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=int(timeout_s), coordinator_bind_address=bind)
        return {"process_index": jax.process_index(), "local": len(jax.local_devices()), "global": len(jax.devices())}


class RoleMember(JobMember):
    """One host's process of a role group (a Ray actor): joins the group's JAX job, then holds the role."""

    def __init__(self, cores: pin.CoreShare | list[int] | None = None, env: dict[str, str] | None = None):
        from rlsched.cluster.ray_cluster import enter_role_env

        enter_role_env(env)  # before anything reads it: JAX, and exits.watch
        exits.watch()  # a death is told by how it happened (rlsched.cluster.exits)
        if cores:
            pin.pin_process(cores)  # before JAX creates its thread pools: this host's share, as a role would
        self.role = None

    def build(self, cls, spec, channel) -> bool:
        """Build the role; in a member other than 0, first put the run's files under the guard (only process 0
        writes them; every process writes its shards of the task's checkpoints). Whether the guard is on."""
        from workers.multihost import guard_run_files

        shared = [spec.checkpoint_dir] + ([spec.compile_cache] if spec.compile_cache else [])
        guarded = guard_run_files([spec.run_dir], shared=shared)
        self.role = cls(spec, channel=channel)
        return guarded

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        if self.role is None:
            raise TaskError(f"{method}() called before the role was built in this member")
        return getattr(self.role, method)(*args, **kwargs)


class RoleGroup:
    """A role held by one process per host, called like a local one: each method runs on every member."""

    def __init__(self, members: list, kind: str, nodes: list[dict[str, Any]], *,
                 hang_timeout_s: float = HANG_TIMEOUT_S, call_timeout_s: float):
        self.members, self.kind, self.nodes, self.hang_timeout_s = members, kind, nodes, hang_timeout_s
        self.call_timeout_s = call_timeout_s  # the longest wait for the first member's answer to a call
        self.coordinator: str | None = None  # "host:port" of member 0's JAX coordinator, once joined
        self.guarded: list[bool] = []  # per member: whether its run-file guard is on (workers.multihost)

    @classmethod
    def launch(cls, role_cls, spec, *, channel, sites, take_port, bundles: list[int],
               hang_timeout_s: float = HANG_TIMEOUT_S) -> RoleGroup:
        """Start one member per bundle in `bundles` (one per host), join them into a JAX job, build the role."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlsched.cluster.ray_cluster import own_process_resources, role_env

        resource = sites.resource
        members = []
        for bundle in bundles:
            options: dict[str, Any] = {
                "max_restarts": 0, "num_cpus": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(sites.placement_group,
                                                                        placement_group_bundle_index=bundle)}
            options |= own_process_resources(resource, sites.bundle_devices[role_cls.kind])  # as a role's own
            # Each member sees its own host's devices; the mesh over all of them comes from the JAX job.
            env = role_env(spec.num_devices, resource, shares_devices=spec.shares_devices)
            members.append(ray.remote(RoleMember).options(**options).remote(sites.cores[role_cls.kind], env))
        group = cls(members, role_cls.kind, [{} for _ in members], hang_timeout_s=hang_timeout_s,
                    call_timeout_s=spec.call_timeout_s)
        try:
            group.nodes, group.coordinator = join_job(members, role_cls.kind, take_port, group._gather)
            group.guarded = group._gather([m.build.remote(role_cls, spec, channel) for m in members], "__init__")
        except BaseException:
            group.terminate()
            raise
        return group

    # ---- calls --------------------------------------------------------------------------------------------

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            return self._gather(self._send(name, args, kwargs), name)[0]

        return call

    def _send(self, method: str, args: tuple, kwargs: dict) -> list:
        """Send every member the role's `method` call; their refs, in member order (rlsched.cluster.group_process sends
        it as a turn of a device group's processes)."""
        return [m.call.remote(method, args, kwargs) for m in self.members]

    def _end(self) -> None:
        """End the group after a member died or hung: every member's process (their JAX job is broken)."""
        import ray

        for m in self.members:
            with contextlib.suppress(Exception):  # gone already
                ray.kill(m, no_restart=True)

    def _died(self, message: str) -> RoleDied:
        return RoleDied(message, self.kind)

    def _member(self, i: int) -> str:
        return describe_member(i, self.members, self.nodes)

    def _gather(self, refs: list, name: str) -> list[Any]:
        """Every member's result of one call, in member order; a death or a hang ends the group (see module)."""
        import ray

        index = {ref: i for i, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending, first_done, error = list(refs), None, None
        sent = time.monotonic()
        while pending:
            timeout = max(0.0, (sent + self.call_timeout_s if first_done is None
                                else first_done + self.hang_timeout_s) - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done and first_done is None:  # no member answered: the call hangs everywhere (or is too long)
                raise no_answer(f"its {self.kind} group's {name}() on {len(refs)} member(s) ({self._member(0)}, ...)",
                                self.call_timeout_s, "cluster.call_timeout_s: its processes may hang; raise the "
                                "timeout if the call is a compile of a large model")
            if not done:  # peers finished hang_timeout_s ago: the rest are stuck in a collective
                stuck = ", ".join(self._member(index[r]) for r in pending)
                self._end()
                raise self._died(f"its {self.kind} group's {stuck} did not finish {name}() "
                                 f"{self.hang_timeout_s:.0f} s after the other members did (stuck in a collective); "
                                 "every member was stopped")
            first_done = first_done or time.monotonic()
            i = index[done[0]]
            try:
                results[i] = ray.get(done[0])
            except ray.exceptions.RayActorError as err:
                self._end()  # its peers would block in the next collective
                raise self._died(f"{self._member(i)} of its {self.kind} group died during {name}(): "
                                 f"{exits.death_cause(err)}; every member was stopped") from err
            except Exception as err:  # noqa: BLE001 - raised in the role: every member raises it alike, the
                error = error or err  # same inputs giving the same error; wait for the others, then raise it
        if error is not None:
            raise error
        return [results[i] for i in range(len(refs))]

    # ---- what a driver asks of a role's process -------------------------------------------------------------

    def where(self) -> dict[str, Any]:
        """Member 0's place, with every member's host, node and pid (the task's sites line and timeline)."""
        first = self._gather(self._send("where", (), {}), "where")[0]
        return {**first, "members": [dict(n, guarded=g) for n, g in zip(self.nodes, self.guarded, strict=True)],
                "coordinator": self.coordinator}

    @property
    def handle(self):
        return self.members[0]

    def fence_target(self) -> list:
        """What the scheduler stops if it must fence this role's task: every member's process."""
        from rlsched.scheduling.fencing import Target

        return [Target(f"{self.kind}[{i}]", m) for i, m in enumerate(self.members)]

    def terminate(self) -> None:
        """End every member's process now."""
        self._end()



def describe_member(i: int, members: list, nodes: list[dict[str, Any]]) -> str:
    """"member i of n (host, pid, node)": how errors name a member of a group across hosts."""
    node = nodes[i] if i < len(nodes) else {}
    return (f"member {i} of {len(members)} (host {node.get('host', '?')}, pid {node.get('pid', '?')}, "
            f"node {str(node.get('node_id', '?'))[:8]})")

def join_job(members: list, kind: str, take_port, gather) -> tuple[list[dict[str, Any]], str]:
    """Join `members` (JobMember actors, one per host, in host order) into one JAX job: find where each runs,
    take a coordinator port on member 0's host from the scheduler's allocator (`take_port(kind, host, busy)`,
    skipping ports that host finds busy), and have every member initialize. `gather(refs, call)` waits for
    every member (RoleGroup._gather). Returns (each member's node, "host:port" of the coordinator)."""

    nodes = gather([m.node.remote() for m in members], "node")
    host = nodes[0]["host"]
    busy: list[int] = []
    port = take_port(kind, host, busy)
    while not answer(members[0].port_free.remote(host, port), timeout_s=PORT_CHECK_TIMEOUT_S,
                     what=f"port_free({host}:{port}) of {kind}'s first process (pid {nodes[0].get('pid', '?')})",
                     check="that process may hang; its log is in Ray's worker logs"):
        busy.append(port)
        port = take_port(kind, host, busy)
    coordinator = f"{host}:{port}"
    gather([m.join.remote(coordinator, len(members), i, JOIN_TIMEOUT_S) for i, m in enumerate(members)],
           "jax.distributed.initialize")
    return nodes, coordinator


def spans_hosts(spec, kind: str) -> bool:
    """Whether `spec`'s role `kind` needs a group: its mesh has more devices than one host (cluster.hosts > 1)."""
    from workers.models import sharding

    if getattr(spec, "hosts", 1) <= 1 or kind != "actor":
        return False
    return sharding.num_devices(spec.config.actor.mesh.as_dict()) > spec.num_devices
