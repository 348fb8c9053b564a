"""Device-group processes: the one process per host that holds every role of a device group (`cluster.processes:
per_device_group`), and the handle through which a task's driver calls its roles there. ("Host" is a machine
here, as in `cluster.hosts`; the process is the device group's.)

    process = start_group_process(where, "actor", num_devices=8)      # a Ray actor on the group's bundle
    actor = GroupProcessRole.launch(process, ActorRole, spec, channel)  # the role is built in that process
    actor.train(batch, rewards, step)                                   # one round trip, as with a role's own process

Design decisions (and why):
- **What real hardware needs.** A TPU chip is opened by one process, and a GPU's memory freed in one JAX
  process is kept in that process's pool; so tasks that time-share a device group can only swap their
  state through one process that owns the devices. That process holds each task's actor and engine (their
  device arrays and host copies) and the scheduler's locks decide whose arrays are on the devices, exactly
  as with roles in processes of their own: the roles are the same classes, only their process differs.
- **Both roles of a task in one process talk through a local channel** (rlsched.cluster.comm.LocalChannel): weights go
  from the actor's mesh to the engine's device to device, and the message the driver forwards carries no
  arrays.
- **A threaded actor, one call per role at a time.** Each task's driver blocks in its own call; the locks already
  order what touches the devices, while one task's host-side work (a memory probe, a checkpoint write) runs beside
  another's phase. A role's own calls run one after another, as in a process of its own (an eviction's offload of
  a role waits for the call of it in progress), which is what the drivers and the scheduler were built against.
- **Collateral is the price.** A role that kills its process (a segfault, an out-of-memory kill) ends every
  role of the process; every task there gets `RoleDied(shared=True)` naming it. That is how a TPU host
  behaves anyway, and what a fence does on purpose: a role whose call outlives its lease cannot be stopped as a
  thread, so the scheduler ends the process (rlsched.scheduling.fencing) and the other tasks there are rebuilt, a
  restart they did not cause and that their `max_restarts` does not count (rlsched.run.task).
- **A dead process comes back** when a task there has `max_restarts`: Ray restarts it (the actor's
  own `max_restarts`, the most any of its tasks allows), on the same bundle and devices, empty. Each task with
  restarts left builds its roles there again (rlsched.run.task: its actor from the last checkpoint, its engine fed
  the actor's weights); one without fails. A task that learns of it later, at its next call, is told by the new
  process (`call`: a role missing from a restarted process is a death, not a bug). Not across hosts: there a new
  process would have to rejoin a broken JAX job.
- **Across hosts** (`cluster.hosts` > 1): one such process per host, all joined into one JAX job
  (`start_group_across_hosts`, `GroupProcesses`). A task's actor whose mesh spans the hosts is built in each and
  called SPMD (`GroupProcessesRole`); everything within one host lives in the first host's process. Every process
  must enter collectives in the same order while several drivers call them at once, so each SPMD call takes a turn from
  the first host and every host runs the turns in order (`GroupProcess.in_turn`).
- **Programs go with their roles.** The process lives as long as the scheduler service and sees every task
  shape and setting submitted there; each compiled program holds memory maps of JIT code, and a process has a
  bounded number (workers.compiling). A role's programs are shared with the roles of the same shapes and settings
  and go with the last of them (workers.compiling.shared); whenever the last role leaves and none is being built,
  the process also drops what it keeps for roles to come (`workers.compiling.forget`). The next task's programs
  come from JAX's persistent compilation cache, as in a new process.
- Ray is imported inside the functions: importing this module costs nothing without Ray.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import os
import sys
import threading
from typing import Any

from rlsched.base.errors import RoleDied, TaskError
from rlsched.cluster import pinning as pin
from rlsched.cluster.exits import death_cause
from rlsched.cluster.rolegroup import HANG_TIMEOUT_S, JOIN_TIMEOUT_S, JobMember, RoleGroup, describe_member, join_job

# A role's drop (its arrays freed, the heap trimmed, the programs of an emptied process dropped) takes a second or
# two; a process that does not answer in this long hangs (a call of another task holding it?).
DROP_TIMEOUT_S = 60.0
# Host buffers this large or larger are mapped on their own and go back to the OS when freed (`_fix_mmap_threshold`)
MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
# A device group's new process answers where it runs once Ray started it (it imports no JAX before it joins).
START_TIMEOUT_S = 180.0


class GroupProcess(JobMember):
    """The process that holds every role of one device group on this host (run as a threaded Ray actor). Across
    hosts (cluster.hosts > 1) the group's processes first join one JAX job (`JobMember.join`, by
    `start_group_across_hosts`)."""

    def __init__(self, cores: pin.CoreShare | list[int] | None = None, env: dict[str, str] | None = None):
        from rlsched.cluster import exits
        from rlsched.cluster.ray_cluster import enter_role_env

        _fix_mmap_threshold()  # before the first large buffer: the heap then stays as small as what lives in it
        enter_role_env(env)  # before anything reads it: JAX, and exits.watch
        exits.watch()  # a death is told by how it happened (rlsched.cluster.exits)
        if cores:
            pin.pin_process(cores)  # before JAX creates its thread pools: the group's cores, as a role would
        import ray

        self.roles: dict[str, Any] = {}
        self._calls: dict[str, int] = {}  # role key -> its calls running or waiting (a fence drops an idle role only)
        self._turns_of: dict[str, threading.Lock] = {}  # role key -> held by the one call of it that runs
        self._dropped: set[str] = set()  # keys a fence dropped: a late call on one is refused, not run
        # Role key being built now (`start`) -> whether a fence or its driver dropped it meanwhile (`drop_if_idle`,
        # `drop`): the process is not empty while one is, and a dropped one is dropped when its start returns
        self._builds: dict[str, bool] = {}
        self._calls_lock = threading.Lock()
        # Ray restarted this process after it died (start_group_process's max_restarts): every role it held is gone.
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._guard: tuple[set, set] = (set(), set())  # run directories, and the subtrees every process writes
        # SPMD turns across hosts (see `in_turn`): the first host hands them out, every host runs them in order.
        self._turns = itertools.count()
        self._order = threading.Condition()
        self._next_turn = 0  # the turn this host runs next
        self._arrived: set[int] = set()  # turns whose call has reached this host and waits or runs

    def start(self, key: str, cls, spec, channel) -> bool:
        """Build role `cls` (rlsched.run.roles.ActorRole / EngineRole) for task `spec` here, under `key`. Returns
        whether this process writes under the run-file guard (a host other than the first of a group across
        hosts: only process 0 writes run files, workers.multihost)."""
        with self._calls_lock:
            if key in self.roles or key in self._builds:
                raise TaskError(f"{key} is held by this process already (a task started twice?)")
            self._builds[key] = False
        guarded = False
        if spec.hosts > 1:
            from workers.multihost import guard_run_files

            roots, shared = self._guard  # every task's run directory so far: the guard takes them all at once
            roots.add(str(spec.run_dir))
            shared.update(str(d) for d in [spec.checkpoint_dir, spec.compile_cache] if d)
            guarded = guard_run_files(sorted(roots), shared=sorted(shared))
        dropped = True  # a build that raised leaves nothing
        try:
            role = cls(spec, channel=channel)  # built outside the lock: a role's start loads its model
            with self._calls_lock:  # other tasks' threads read self.roles meanwhile (`where`, `held`, `call`)
                dropped = self._builds[key]
                if not dropped:
                    self.roles[key] = role
            del role  # a dropped role's arrays go with this last reference (`_let_go`)
        finally:
            with self._calls_lock:
                del self._builds[key]
            if dropped:
                self._let_go()  # a start that failed or was dropped leaves the process as it found it
        if dropped:
            raise TaskError(f"{key} was dropped while it was being built (its task was fenced or ended meanwhile); "
                            "its arrays are freed")
        return guarded

    def call(self, key: str, method: str, args: tuple, kwargs: dict) -> Any:
        with self._calls_lock:
            role = self.roles.get(key)
            if role is not None:
                self._calls[key] = self._calls.get(key, 0) + 1
                turn = self._turns_of.setdefault(key, threading.Lock())
        if role is None and method == "close" and (self.restarted or key in self._dropped):
            return None  # a role that went with the old process, or that a fence dropped: nothing left to close
        if role is None and self.restarted and key not in self._dropped:
            kind = key.rpartition("/")[2]
            raise RoleDied(f"the device group's process holding its {kind} died before {method}(); Ray "
                           f"restarted it (pid {os.getpid()}) without its roles", kind, shared=True)
        if role is None:
            raise TaskError(f"{key} is not held by this process (it was dropped, or never started)")
        try:
            # One call of a role at a time, as in a process of its own (a Ray actor runs one call after another):
            # e.g. an eviction's offload of a role waits for the role's call in progress; roles of other tasks, and
            # the other role of the same task, run beside it.
            with turn:
                return getattr(role, method)(*args, **kwargs)
        finally:
            with self._calls_lock:
                self._calls[key] -= 1

    def drop_if_idle(self, key: str) -> bool:
        """Fencing (rlsched.scheduling.fencing): drop role `key` if none of its calls runs now, and refuse any later
        one; False when one runs or the role is being built (a thread cannot be stopped: then only ending this process
        stops it; a role being built is dropped when its start returns, should the process live on)."""
        with self._calls_lock:
            if key in self._builds:  # being built: dropped when its start returns, but the build runs until then
                self._builds[key] = True
                return False
            if self._calls.get(key, 0):
                return False
            self._dropped.add(key)
            dropped = self.roles.pop(key, None) is not None
        if dropped:
            self._let_go()
        return True

    def ticket(self) -> int:
        """The next SPMD turn of the device group (asked of the first host only)."""
        with self._order:
            return next(self._turns)

    def in_turn(self, turn: int, method: str, *args) -> Any:
        """Run `method` (start or call) as SPMD turn `turn`: after every earlier turn, alone.

        Why: every host of a JAX job must enter collectives in the same order, but the tasks' drivers call the
        hosts concurrently, and a threaded Ray actor runs calls in no set order. So each call a role across the
        hosts makes takes a turn from the first host first, and every host runs the turns in order. A turn that
        never reaches this host (its caller died between taking it and sending it) stops the queue; after
        HANG_TIMEOUT_S without it the host says so, rather than waiting for ever."""
        with self._order:
            self._arrived.add(turn)
            while self._next_turn != turn:
                waiting = self._next_turn
                if not self._order.wait(timeout=HANG_TIMEOUT_S) and self._next_turn == waiting \
                        and waiting not in self._arrived:
                    raise TaskError(f"SPMD turn {waiting} never reached this host in {HANG_TIMEOUT_S:.0f} s (its "
                                    "caller died before sending it?); the device group's processes cannot go on "
                                    "in step")
        try:
            return getattr(self, method)(*args)
        finally:
            with self._order:
                self._arrived.discard(turn)
                self._next_turn += 1
                self._order.notify_all()

    def drop(self, key: str) -> None:
        """Forget a role (its driver closed it first): its arrays are freed with its last reference. One being built
        (its driver ended while its start ran) is dropped when its start returns."""
        with self._calls_lock:
            if key in self._builds:
                self._builds[key] = True
            dropped = self.roles.pop(key, None) is not None
        if dropped:
            self._let_go()

    def _let_go(self) -> None:
        """After a role left: its device buffers go now, not at the next collection; a process left without roles
        drops its programs (`_forget_if_empty`); and the heap its host arrays used goes back to the OS. glibc keeps
        freed memory in its arenas: measured, this process grew 717 -> 1035 MiB over 24 tasks that came and went
        one after another on a service, and 378 -> 436 MiB with the trim."""
        gc.collect()
        self._forget_if_empty()
        _trim_heap()

    def _forget_if_empty(self) -> None:
        """No role held and none being built: drop every program this process keeps (see the module's notes). Under
        the book's lock, so that a role's start waits for it rather than have its programs dropped half built."""
        from workers import compiling

        with self._calls_lock:
            if not self.roles and not self._builds:
                compiling.forget()
                gc.collect()  # the executables' memory maps go now

    def held(self) -> dict[str, Any]:
        """This process's pid, the roles it holds, the bytes of its live arrays on its devices, the programs it
        keeps (workers.compiling.programs) and its memory maps (None where the OS does not say): what a task that
        ended leaves here is nothing (`rlsched status`)."""
        from workers import compiling

        with self._calls_lock:
            roles = sorted(self.roles)
        kept = {"programs": compiling.programs(), "memory_maps": _memory_maps(), "heap_bytes": _heap_in_use()}
        if not roles and "jax" not in sys.modules:  # nothing started JAX here yet
            return {"pid": os.getpid(), "roles": roles, "device_bytes": 0, **kept}
        from workers.offload import device_bytes

        return {"pid": os.getpid(), "roles": roles, "device_bytes": device_bytes(), **kept}

    def where(self) -> dict[str, Any]:
        """This process, the devices it sees and those each role's mesh uses (for tools and tests)."""
        import jax

        with self._calls_lock:  # a copy: other tasks start roles from their threads meanwhile (every role's start
            roles = dict(self.roles)  # asks `where`, so 32 tasks starting at once iterated a dict that grew)
        return {"pid": os.getpid(), "devices": [d.id for d in jax.local_devices()],
                "roles": {key: role.device_ids() for key, role in roles.items()}}


def _fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> None:
    """Host buffers of `nbytes` or more get pages of their own (mmap), which go back to the OS when they are freed;
    nothing where the C library is not glibc.

    Why: glibc starts at 128 KiB, but each time it frees such a buffer it raises its threshold to that buffer's size
    (up to 32 MiB), so after the first large host array of a task is freed, the next tasks' host arrays up to 32 MiB
    (a real model's weights loaded or offloaded layer by layer, its batches) are carved from the heap, whose freed
    space the process keeps: malloc_trim gives back only free pages at the heap's top. A threshold that is set
    stays where it is (tests/test_group_process_threads.py).

    What it does not change, measured on the soak's tiny model (benchmarks/soak.py: a resident task and tasks that
    come and go; its buffers are all below 1 MiB): malloc's bytes in use stay flat (161 -> 167 MiB over 14 tasks)
    while the free bytes it keeps between live ones grow (299 -> 374 MiB), and the RSS with them, ever more slowly
    (~2 MiB a task at first): the heap's fragmentation, not memory that is held. Fewer arenas (mallopt M_ARENA_MAX
    2) did not change it either."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, nbytes)


def _trim_heap() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim); nothing where the C library has none. The
    symbol is looked up in this process (CDLL(None)), not by ctypes.util.find_library, which runs ldconfig in a
    subprocess: a fork on every role's drop, from a process whose JAX threads a fork may deadlock."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (malloc.h, glibc >= 2.33): every field a size_t."""
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_in_use() -> int | None:
    """The bytes this process's C heap holds for live allocations, over all of malloc's arenas: glibc's mallinfo2
    `uordblks` (in use in the arenas) + `hblkhd` (mmapped blocks); None where the C library has no mallinfo2.
    Unlike the RSS, it does not count the free space a fragmented heap keeps between live blocks (_lower_mmap_
    threshold's notes), so a leak shows in it and fragmentation does not (benchmarks/soak.py judges it)."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _memory_maps() -> int | None:
    """This process's memory mappings (Linux: lines of /proc/self/maps; the cap is vm.max_map_count), else None."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def start_group_process(sites, kind: str, *, num_devices: int, max_tasks: int, bundle: int | None = None,
               max_restarts: int = 0, shares_devices: bool = False):
    """Start the process of `kind`'s device group ("actor": train, "engine": rollout; one process for both when
    colocated) on its bundle of `sites` (rlsched.cluster.ray_cluster.RoleSites; `bundle` another host's), seeing
    the pool's devices. Ray restarts its process up to `max_restarts` times after a death (empty: the tasks
    with restarts left build their roles there again; -1: always). `shares_devices`: a role of another process
    (an engine of its own process) uses these devices too."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlsched.cluster.ray_cluster import role_env

    resource = sites.resource
    bundle = sites.bundles[kind] if bundle is None else bundle
    options: dict[str, Any] = {"max_restarts": max_restarts, "num_cpus": 0, "max_concurrency": 4 * max_tasks + 4,
                               "scheduling_strategy": PlacementGroupSchedulingStrategy(
                                   sites.placement_group, placement_group_bundle_index=bundle)}
    # The one process that uses the group's accelerators takes them all, so Ray makes them visible to it.
    devices = sites.bundle_devices[kind]  # on each host, when the group spans hosts
    if resource == "GPU":
        options["num_gpus"] = devices
    elif resource == "CPU":
        options["num_cpus"] = 0.01  # nominal: the bundle reserves the core, the pinning uses it
    else:
        options["resources"] = {resource: devices}
    # Sharing: an engine of its own process (sglang-jax) beside this one on its devices (GPU: then this process must
    # free what it offloads, not keep it in JAX's pool).
    env = role_env(num_devices, resource, shares_devices=shares_devices)
    return ray.remote(GroupProcess).options(**options).remote(sites.cores[kind], env)


def start_group_processes(sites, *, colocated: bool, **sizes) -> dict[str, Any]:
    """{role: its device group's process} on one host: one process for both roles when `colocated`, else one for the
    rollout group and one for the train group (`start_group_process`'s arguments in `sizes`)."""
    engine = start_group_process(sites, "engine", **sizes)
    return {"engine": engine, "actor": engine if colocated else start_group_process(sites, "actor", **sizes)}


class GroupProcessRole:
    """A role held by a device-group process, called like a local one: each method is one blocking round trip."""

    def __init__(self, process, key: str, kind: str, timeout_s: float | None = None,
                 group: GroupProcesses | None = None, built=None):
        self._process, self.key, self.kind = process, key, kind
        self.pid: int | None = None  # the process's pid when the role was built there
        self._timeout_s = timeout_s  # cluster.call_timeout_s: no call waits longer
        self._group = group  # the device group across hosts whose first host holds this role, if any
        # The refs of the role's build (`start`) and of the process's `where` while the build may still run
        # (`launch`); the first call waits for them. `_never_built`: the build raised, and said so then.
        self._built, self._never_built = built, False

    @classmethod
    def launch(cls, process, role_cls, spec, channel, group: GroupProcesses | None = None) -> GroupProcessRole:
        """Start building role `role_cls` of task `spec` in `process` and return at once: the build runs there in
        the background, as a role in a process of its own is built (rlsched.run.roles.spawn), so a task's engine is
        built beside its actor; the first call waits for it (`wait_built`) and raises its error."""
        key = f"{spec.name}/{role_cls.kind}"
        built = (process.start.remote(key, role_cls, spec, channel), process.where.remote())
        return cls(process, key, role_cls.kind, timeout_s=spec.call_timeout_s, group=group, built=built)

    def wait_built(self) -> None:
        """Wait for the role's build in its process (if it may still run); raise its error, once."""
        import ray

        if self._built is None:
            return
        (start, where), self._built = self._built, None
        try:
            self._get(start, "__init__")
        except ray.exceptions.RayTaskError:
            self._never_built = True
            raise
        self.pid = self._get(where, "__init__")["pid"]  # the process a fence would end

    def _get(self, ref, name: str):
        import ray

        try:
            return ray.get(ref, timeout=self._timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TaskError(f"its {self.kind}'s {name}() in the device group's process did not answer in "
                            f"{self._timeout_s:g} s (cluster.call_timeout_s): that process may hang; raise the "
                            "timeout if the call is a compile of a large model") from None
        except ray.exceptions.RayActorError as err:
            cause = death_cause(err)
            raise RoleDied(f"the device group's process holding its {self.kind} died during {name}(): "
                           f"{cause}", self.kind, shared=True) from err
        except ray.exceptions.RayTaskError as err:
            dead = self._dead_host()
            if dead is not None:  # what failed here was the broken JAX job's doing, not this role's
                member, cause = dead
                raise RoleDied(f"{member} of its device group's processes died ({cause}), breaking their JAX job, "
                               f"while its {self.kind} ran {name}() on the first host "
                               f"({type(getattr(err, 'cause', err)).__name__} there)", self.kind, shared=True) from err
            raise

    def _dead_host(self, timeout_s: float = 10.0) -> tuple[str, str] | None:
        """After a call failed in a device group across hosts: the first other host found dead ("member i of n
        (host, pid, node)", how it died), else None. A host's death breaks the job's collectives and frees what the
        job shared, so a call on the first host may fail with any error (an XLA one, a deleted buffer) before the
        group is stopped; the death is the cause its task reports, as its peers' tasks do (GroupProcessesRole)."""
        import ray

        if self._group is None:
            return None
        for i, member in enumerate(self._group.members[1:], start=1):
            try:
                ray.get(member.where.remote(), timeout=timeout_s)
            except ray.exceptions.RayActorError as err:
                return describe_member(i, self._group.members, self._group.nodes), death_cause(err)
            except ray.exceptions.GetTimeoutError:
                continue  # busy, not known dead
        return None

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            import ray

            if name == "close":  # a role whose build raised holds nothing: its error was told already
                with contextlib.suppress(ray.exceptions.RayTaskError, RoleDied, TaskError):
                    self.wait_built()
                if self._never_built:
                    return None
            self.wait_built()
            if self._never_built:
                raise TaskError(f"its {self.kind} was never built: its build in the device group's process raised "
                                "(the error before this)")
            return self._get(self._process.call.remote(self.key, name, args, kwargs), name)

        return call

    @property
    def handle(self):
        return self._process

    def fence_target(self):
        """What the scheduler stops if it must fence this role's task: the role, dropped by its process if it is idle,
        else the process itself (`pid`), which Ray restarts for the other tasks there."""
        from rlsched.scheduling.fencing import Target

        self.wait_built()  # its process's pid
        return Target(self.kind, self._process, self.key, pid=self.pid)

    def terminate(self, timeout_s: float = DROP_TIMEOUT_S) -> None:
        """Free the role's arrays in the process (it goes on for the other tasks), within `timeout_s`."""
        import ray

        from rlsched.base.waits import answer

        with contextlib.suppress(ray.exceptions.RayActorError):  # a dead process: the role's memory went with it
            answer(self._process.drop.remote(self.key), timeout_s=timeout_s,
                   what=f"{self.key}'s drop() in the device group's process (pid {self.pid})",
                   check="that process may hang; `rlsched status` shows the roles it holds and its device bytes")


class GroupProcesses:
    """A device group across hosts held by one process per host (`cluster.processes: per_device_group` with
    `cluster.hosts` > 1): the hosts, in host order, joined into one JAX job whose coordinator is on the first.

    What real hardware needs: a TPU host's chips open in one process, so every role that uses them, of every
    task, is held by that host's process, and a mesh over several hosts is one JAX job of those processes. A
    task's actor whose mesh spans the hosts is built in every host and called SPMD (`GroupProcessesRole`); an
    engine, and an actor within one host, are held by the first host alone (`GroupProcessRole`), on its own devices.
    A host that dies breaks the JAX job: every host is stopped and every task of the group fails, as a device
    group's one process does on one host."""

    def __init__(self, members: list, nodes: list[dict[str, Any]], coordinator: str):
        self.members, self.nodes, self.coordinator = members, nodes, coordinator

    @property
    def first(self):
        return self.members[0]


def start_group_across_hosts(sites, *, num_devices: int, max_tasks: int, take_port,
                     hang_timeout_s: float = HANG_TIMEOUT_S) -> GroupProcesses:
    """Start one device-group process per host bundle of `sites` and join them into one JAX job; the port of
    its coordinator comes from `take_port(kind, host, busy)` (the scheduler's allocator)."""
    members = [start_group_process(sites, "actor", num_devices=num_devices, max_tasks=max_tasks, bundle=b)
               for b in sites.host_bundles]
    probe = GroupProcessesRole(GroupProcesses(members, [{} for _ in members], ""), "", "device group",
                               hang_timeout_s=hang_timeout_s, call_timeout_s=JOIN_TIMEOUT_S + START_TIMEOUT_S)
    try:
        nodes, coordinator = join_job(members, "device-group", take_port, probe._gather)
    except BaseException:
        probe._end()
        raise
    return GroupProcesses(members, nodes, coordinator)


class GroupProcessesRole(RoleGroup):
    """A task's role whose mesh spans the hosts of a `GroupProcesses`: built in every host under one key, each method
    called SPMD on every host (member 0's value), a host's death or hang ending the group as a RoleGroup's does,
    except that the hosts are the device group's: every task there fails with it (`RoleDied(shared=True)`)."""

    def __init__(self, group: GroupProcesses, key: str, kind: str, *, hang_timeout_s: float = HANG_TIMEOUT_S,
                 call_timeout_s: float):
        super().__init__(list(group.members), kind, list(group.nodes), hang_timeout_s=hang_timeout_s,
                         call_timeout_s=call_timeout_s)
        self.key, self.coordinator = key, group.coordinator

    @classmethod
    def launch(cls, group: GroupProcesses, role_cls, spec, channel) -> GroupProcessesRole:
        role = cls(group, f"{spec.name}/{role_cls.kind}", role_cls.kind, call_timeout_s=spec.call_timeout_s)
        turn = role._ticket("__init__")
        role.guarded = role._gather([m.in_turn.remote(turn, "start", role.key, role_cls, spec, channel)
                                     for m in role.members], "__init__")
        return role

    def _ticket(self, name: str) -> int:
        """An SPMD turn from the first host (GroupProcess.in_turn), right before the call is sent to every host."""
        return self._gather([self.members[0].ticket.remote()], name)[0]

    def _send(self, method: str, args: tuple, kwargs: dict) -> list:
        turn = self._ticket(method)
        return [m.in_turn.remote(turn, "call", self.key, method, args, kwargs) for m in self.members]

    def _died(self, message: str) -> RoleDied:
        return RoleDied(message.replace(f"its {self.kind} group", f"its device group's processes (holding its "
                                        f"{self.kind})"), self.kind, shared=True)

    def fence_target(self) -> list:
        """What the scheduler stops if it must fence this role's task: the role, dropped by every host."""
        from rlsched.scheduling.fencing import Target

        return [Target(f"{self.kind}[{i}]", m, self.key) for i, m in enumerate(self.members)]

    def terminate(self, timeout_s: float = DROP_TIMEOUT_S) -> None:
        """Free the role's arrays in every host (the hosts go on for the other tasks), within `timeout_s`: every
        host is asked at once, and those that did not answer are named."""
        import ray

        from rlsched.base.waits import no_answer

        refs = [m.drop.remote(self.key) for m in self.members]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        silent = []
        for i, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                pass  # a dead process: the role's memory went with it
            except ray.exceptions.GetTimeoutError:
                silent.append(self._member(i))
        if silent:
            raise no_answer(f"{self.key}'s drop() in the device group's {', '.join(silent)}", timeout_s,
                            "those processes may hang; `rlsched status` shows the roles each holds")
