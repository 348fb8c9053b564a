"""The scheduler: an asyncio object wrapping the pure Policy, made a Ray actor in one place.

Design decisions:
- Callers `await acquire(task, phase)`; nobody polls. Each request gets an asyncio future that the
  dispatcher resolves when the policy grants it, so a grant costs one actor round trip.
- A grant is a **lease**. A holder loses it when it releases, when it overstays `lease_timeout_s` (any hold,
  the first too: programs compile before the lock is asked for, rlsched.run.task), or when the process holding it
  dies: every task registers a *lifeline* (an actor method that
  never returns); Ray fails that call the moment the actor dies, and the scheduler marks the task
  failed and hands its lock to the next waiter. No heartbeats, no polling of liveness.
- **Fenced before anything passes on** (rlsched.scheduling.fencing). When the scheduler takes a lease away (it
  expired, its driver died) or an eviction fails, the task's role processes are stopped and known gone
  before its lock and memory go to another task: never two holders of one phase, never memory counted
  free that a live process still holds. An eviction that fails fails the evicted task, not the waiter. A fenced
  holder whose driver lives also gets to end its phase first (it sees its call fail and lets go; LET_GO_S at
  most): its phase's span ends before the next holder's begins. A device group's process ended by a fence is
  recorded (`collateral`): its other tasks rebuild their roles without counting a restart of their own.
- **An unconfirmed fence never passes a lock.** A stop that cannot be confirmed (a process not seen gone in time, a
  stop that raised) takes the task's device group out of service (`fenced_groups`): every task of it is fenced and
  fails with the cause, none of its locks is granted and no task is admitted to it (Policy.close), and the scheduler
  asks again every `recover_s` whether what was not seen gone is gone (fencing.confirm); only then does the group
  go back in service. Its locks and bytes never pass to another task while the old holder's call may still run.
- **Evictions are ordered against the victim's own moves.** The victim's driver offloads its role on the
  scheduler's request, a round trip after the policy decided it; the victim's next grant (which may onload
  that role again) is handed over only once that offload is done.
- Drivers reach it through a lock provider (`SchedulerLocks`); `FreeLocks` is the always-free twin
  that an in-process run plugs into the same step loop (rlsched.run.task).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from typing import Any

from rlsched.base.errors import TaskError, cause_of
from rlsched.scheduling.memory import MemoryPool
from rlsched.scheduling.policy import Phase, Policy, Role


@dataclasses.dataclass(frozen=True)
class Lease:
    id: int  # request id, unique per scheduler
    task: str
    phase: Phase
    resource: str  # e.g. "g0/rollout": the lock's identity across tasks
    moves: tuple  # residency moves the holder must perform before working (see policy.Move)
    granted_at: float  # scheduler clock (time.monotonic) at grant
    waited_s: float  # time between request and grant
    cohort: tuple[str, ...] = ()  # a co-batched hold's tasks (this one included); () alone
    hold: int = 0  # that hold's id (its first grant's request id); 0 alone

    def together(self):
        """The hold as the shared engine knows it (workers.rollout.base.Together), or None alone."""
        from workers.rollout.base import Together  # a dataclass; no JAX

        return Together(self.hold, len(self.cohort)) if len(self.cohort) > 1 else None


ASK_TIMEOUT_S = 300.0  # longest wait for the scheduler's answer to a call that waits for no one (not acquire)
GRANT_LOG_LEN = 1000  # grants kept in Scheduler.grant_log
LET_GO_S = 10.0  # how long a fenced holder's driver has to end its phase once its roles are stopped
RECOVER_S = 5.0  # how often a device group out of service asks again whether its unconfirmed stops are done


class LeaseLost(RuntimeError):
    """The task's lease was revoked (timeout or failure) or the task is marked failed."""


class Scheduler:
    def __init__(self, policy: Policy, *, lease_timeout_s: float = 600.0, stop=None, confirm=None,
                 let_go_s: float = LET_GO_S, recover_s: float = RECOVER_S, grant_log_len: int = GRANT_LOG_LEN):
        """`stop`: async (targets, on_end) -> [fencing.Unconfirmed], how a task's roles are stopped (default
        rlsched.scheduling.fencing.stop); `confirm`: async ([Unconfirmed]) -> those still not seen gone (default
        fencing.confirm), asked every `recover_s` while a device group is out of service; `let_go_s`: how long a
        fenced holder's driver has to end its phase; `grant_log_len`: how many of the last grants `grant_log` keeps."""
        from rlsched.scheduling import fencing

        stop = stop or fencing.stop
        self._confirm = confirm or fencing.confirm
        self.recover_s = recover_s
        # Device group out of service -> {"cause", "task" (whose fence could not be confirmed), "since" (wall clock),
        # "left" (fencing.Unconfirmed not seen gone yet), "tries"}
        self._out: dict[str, dict[str, Any]] = {}
        self._fencing: dict[str, int] = {}  # device group -> fences of its tasks in flight (it reopens after them)
        self.policy = policy
        self.lease_timeout_s, self.let_go_s = lease_timeout_s, let_go_s
        self._waiters: dict[int, tuple[asyncio.Future, float]] = {}
        self._failed: dict[str, str] = {}  # task -> cause
        self._fenced: dict[str, str] = {}  # task -> cause, for the tasks the scheduler itself stopped
        self._targets: dict[str, list] = {}  # task -> its roles to stop when fenced (rlsched.scheduling.fencing.Target)
        self._letting_go: dict[str, asyncio.Event] = {}  # fenced holder -> set when its driver has let go
        self._ended: dict[tuple[Any, int], str] = {}  # (host, pid) of a device-group process ended to fence a task
        # -> why: the other tasks there lost their roles to it (`collateral`)
        self._stop = stop
        self._watchdog: asyncio.Task | None = None
        self.watchdog_errors, self.watchdog_error = 0, None  # the lease watchdog's failed passes, and the last one
        self.watchdog_failing: dict[str, Any] | None = None  # {"since", "cause", "failures"} until a pass succeeds
        self._drivers: dict[str, Any] = {}  # task -> driver handle, to evict its idle roles
        self._evicting: dict[str, set[asyncio.Task]] = {}  # task -> offloads of its roles still in flight
        # The last grants, (time, task, phase, resource), for a look at what happened lately; bounded, as a service's
        # scheduler lives for weeks. `grants` counts them all.
        self.grant_log: collections.deque[tuple[float, str, str, str]] = collections.deque(maxlen=grant_log_len)
        self.grants = 0
        from rlsched.scheduling.ports import PortAllocator

        self.ports = PortAllocator()  # coordinator ports of role groups across hosts (rlsched.cluster.rolegroup)
        # Measured bytes per pool, as the tasks' residency moves report them (the policy decides on
        # its own estimates; these are what the workers really hold, shown side by side).
        self.measured = {name: MemoryPool(name, policy.budget(name)) for name in policy.pools()}
        from rlsched.observe.timeline import Timeline

        self.timeline = Timeline("scheduler")  # counters: lock queue lengths, measured memory per pool

    # ---- locks ------------------------------------------------------------------------------------

    async def acquire(self, task: str, phase: str) -> Lease:
        self._ensure_watchdog()
        if task in self._failed:
            raise LeaseLost(f"task {task} was marked failed: {self._failed[task]}")
        now = time.monotonic()
        request_id = self.policy.request(task, Phase(phase), now)
        future = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = (future, now)
        self._dispatch()
        self._count_queues()
        return await future

    async def release(self, task: str, phase: str) -> None:
        if task in self._failed:
            if task in self._letting_go:
                self._letting_go[task].set()  # a fenced holder's driver let go: its lock can pass on now
            return  # its lease is already gone
        self.policy.release(task, Phase(phase), time.monotonic())
        self._dispatch()
        self._count_queues()

    def _count_queues(self) -> None:
        for resource in self.policy.resources():
            self.timeline.counter(f"queue/{resource.id}", {"waiting": len(self.policy.queue(resource))})

    async def admit(self, task: str, group: str, engine_bytes: int, actor_bytes: int, *, priority: int = 0,
                    weight: float = 1.0, cobatch=None, bases=()) -> list[tuple[str, str]]:
        """A task arriving at a running scheduler (rlsched.service.server): registered with the policy as created on
        device, returning the offloads it must do at once ((role, action) pairs). A task of the same name that
        ended before is forgotten first, with what the scheduler knew of it. `cobatch`: its base group's
        co-batched phases (rlsched.scheduling.policy.CoBatch), whose holds it may share. `bases`: the shared bases
        its roles read, (key, role, bytes), pinned once (Policy.register): when a new one evicts idle roles of
        other tasks, this returns once they are offloaded, so the task's roles load its base into the room made."""
        if task in self.policy.tasks():
            self.forget_task(task)  # refuses a live one (PolicyError)
        moves = self.policy.register(task, group, engine_bytes, actor_bytes, priority=priority, weight=weight,
                                     cobatch=cobatch, bases=tuple((k, Role(r), int(n)) for k, r, n in bases))
        evictions = [self._evict(m, task) for m in moves if m.task != task]
        await asyncio.gather(*evictions, return_exceptions=True)  # each settles its own failure (`_offload`)
        return [(str(m.role), str(m.action)) for m in moves if m.task == task]

    def locks(self) -> dict[str, dict[str, Any]]:
        """Per lock: its holder and for how long, and its waiters with how long each has waited (seconds)."""
        now = time.monotonic()
        waited = {self.policy.request_task(rid): now - at for rid, (_, at) in self._waiters.items()}
        out = {}
        for resource in self.policy.resources():
            holder = self.policy.holder(resource)
            lease = None if holder is None else self.policy.lease_of(holder)
            queue = [{"task": t, "waited_s": waited.get(t)} for t in self.policy.queue(resource)]
            out[resource.id] = {"holder": holder, "holders": self.policy.holders(resource),
                                "held_s": None if lease is None else now - lease[1], "waiting": queue}
        return out

    def take_port(self, task: str, role: str, host: str, skip: list[int]) -> int:
        """A coordinator port on `host` for `task`'s `role` group, held by no other group (rlsched.scheduling.ports)."""
        return self.ports.take(f"{task}/{role}", host, skip)

    def register_driver(self, task: str, handle: Any) -> None:
        self._drivers[task] = handle

    def register_roles(self, task: str, targets: list) -> None:
        """What to stop if this task must be fenced (rlsched.scheduling.fencing.Target per role)."""
        self._targets[task] = list(targets)

    def _dispatch(self) -> None:
        now = time.monotonic()
        for grant in self.policy.grant(now):
            future, requested_at = self._waiters.pop(grant.request_id)
            lease = Lease(grant.request_id, grant.task, grant.phase, grant.resource.id, tuple(grant.moves), now,
                          now - requested_at, grant.cohort, grant.hold)
            self.grant_log.append((now, grant.task, str(grant.phase), grant.resource.id))
            self.grants += 1
            # The policy counts an eviction done when it decides it, but the victim's driver does it later. A
            # grant to the victim waits for it: its own onload must come after, or the offload would land on
            # the state its phase is about to use.
            before = [t for t in self._evicting.get(grant.task, ()) if not t.done()]
            evictions = [self._evict(m, grant.task) for m in grant.moves if m.task != grant.task]
            if before or evictions:
                asyncio.get_running_loop().create_task(self._grant_after(before + evictions, future, lease))
            elif not future.done():
                future.set_result(lease)

    def _evict(self, move, for_task: str) -> asyncio.Task:
        """Start offloading another task's idle role to make room for `for_task` (its driver does it: it holds no
        lease, so nothing of its own runs on those buffers); the victim's next grant waits for it."""
        evicting = asyncio.get_running_loop().create_task(self._offload(move, for_task))
        pending = self._evicting.setdefault(move.task, set())
        pending.add(evicting)
        evicting.add_done_callback(pending.discard)
        return evicting

    async def _offload(self, move, for_task: str) -> None:
        if move.task in self._failed:
            return  # fenced (or failed) already: its processes, and their bytes, are gone
        try:
            if move.task not in self._drivers:
                raise LeaseLost(f"no driver registered for task {move.task}")
            await self._drivers[move.task].move.remote(str(move.role), str(move.action))
        except Exception as err:  # noqa: BLE001 - the evicted task pays for it, never the waiter
            # Its role may still hold the bytes: stopping it is what frees them for the waiter.
            await self.fail(move.task, f"its {move.role} could not be offloaded to make room for task "
                                       f"{for_task}: {cause_of(err)}", fence=True)

    async def _grant_after(self, moves: list[asyncio.Task], future: asyncio.Future, lease: Lease) -> None:
        await asyncio.gather(*moves, return_exceptions=True)  # each settles its own failure (`_offload`)
        if future.done():
            return
        if lease.task in self._failed:  # its own eviction failed meanwhile: it was fenced
            future.set_exception(LeaseLost(f"task {lease.task} failed: {self._failed[lease.task]}"))
        else:
            future.set_result(lease)

    async def fail(self, task: str, cause: str, *, fence: bool = False, driver_alive: bool = True) -> None:
        """Mark a task failed: its queued request is refused (LeaseLost), and its lease and memory pass on.
        `fence`: the scheduler is taking them away from a task that may still run (its lease expired, its
        driver died, its eviction failed), so its roles are stopped first (rlsched.scheduling.fencing); until they are,
        its lock and bytes stay its own, and a holder's lock waits (LET_GO_S at most) for its driver, which sees its
        call fail, to end its phase (`driver_alive` False: the driver died, nothing to wait for). A task that failed
        by itself has stopped its roles already."""
        if task in self._failed:
            if task in self._letting_go:
                self._letting_go[task].set()  # the fenced task's driver reports its failure: it has let go
            return
        if task not in self.policy.tasks():  # retired (its driver's end, seen after): nothing of it is left to fail
            return
        self._failed[task] = cause
        for request_id, (future, _) in list(self._waiters.items()):
            if not future.done() and self.policy.request_task(request_id) == task:
                future.set_exception(LeaseLost(f"task {task} failed: {cause}"))
                del self._waiters[request_id]
        group = self.policy.group(task)
        try:
            if fence:
                await self._fence(task, cause, holding=driver_alive and self.policy.lease_of(task) is not None)
        finally:  # the task is out of the books; its lock passes on unless its group is out of service (`_fence`)
            self.policy.fail(task)
            self.ports.release(task)
            self._dispatch()
        out = self._out.get(group)
        if out is not None and out["task"] == task:  # its fence closed the group: every other task there is fenced
            why = f"device group {group} was taken out of service: task {task}'s fence could not be confirmed " \
                  f"({self._failed[task]})"
            others = [t for t in self.policy.tasks() if self.policy.group(t) == group and t not in self._failed]
            await asyncio.gather(*(self.fail(t, why, fence=True, driver_alive=t in self._drivers) for t in others),
                                 return_exceptions=True)
            asyncio.get_running_loop().create_task(self._recover(group))

    async def _fence(self, task: str, cause: str, *, holding: bool) -> None:
        """Stop `task`'s roles (rlsched.scheduling.fencing) and, if it holds a lock and its driver lives, give the
        driver LET_GO_S to end its phase: it sees its call fail once its roles are stopped, and no one's phase
        starts before the fenced one's has ended."""
        self._fenced[task] = cause
        # Held here, not looked up after the stop: the driver may let go and retire (dropping the books' entry)
        # while the roles are being stopped.
        let_go = self._letting_go[task] = asyncio.Event() if holding else None
        t0 = self.timeline.now()

        def ended(target) -> None:  # before the host's process is ended: its other tasks will ask
            self._ended[target.handle, target.pid] = f"the device group's process was ended to fence task " \
                                                     f"{task} ({cause})"

        from rlsched.scheduling.fencing import Unconfirmed

        group = self.policy.group(task)
        # A process a fence ended already is not ended again: gone, or (not seen gone) among its group's `left`
        targets = [t for t in self._targets.get(task, []) if t.pid is None or (t.handle, t.pid) not in self._ended]
        self._fencing[group] = self._fencing.get(group, 0) + 1
        try:
            problems = await self._stop(targets, on_end=ended)
        except Exception as err:  # noqa: BLE001 - a stop that raised is a fence that could not confirm itself
            problems = [Unconfirmed(t, f"the stop raised {type(err).__name__}: {err}") for t in targets]
            problems = problems or [Unconfirmed(None, f"the stop raised {type(err).__name__}: {err}")]
        finally:
            self._fencing[group] -= 1
        self.timeline.add_span("fence", t0, self.timeline.now(), task=task, cause=cause)
        if problems:
            left = [p for p in problems if p.target is not None]  # a stop that raised on no target: nothing to ask
            if group in self._out:
                self._out[group]["left"] += left
                self._failed[task] = self._fenced[task] = f"{cause}; fencing: {'; '.join(map(str, problems))}"
            else:
                self._failed[task] = self._fenced[task] = (f"{cause}; fencing: {'; '.join(map(str, problems))}; device "
                                                           f"group {group} is out of service until they are gone")
                self._out[group] = {"cause": self._failed[task], "task": task, "since": time.time(), "left": left,
                                    "tries": 0, "t0": self.timeline.now()}
                self.policy.close(group, self._failed[task])
        if let_go is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(let_go.wait(), self.let_go_s)

    async def _recover(self, group: str) -> None:
        """A device group out of service: every `recover_s`, ask whether the fenced processes not seen gone are gone
        now (fencing.confirm); once none is left and no fence of its tasks is in flight, it goes back in service."""
        out = self._out[group]
        while out["left"] or self._fencing.get(group):
            await asyncio.sleep(self.recover_s)
            asked = list(out["left"])
            try:
                still = await self._confirm(asked)
            except Exception as err:  # noqa: BLE001 - asked again next time; the group stays out of service
                still = asked
                out["error"] = f"{type(err).__name__}: {err}".splitlines()[0]
            out["left"] = list(still) + [u for u in out["left"] if all(u is not a for a in asked)]
            out["tries"] += 1
        del self._out[group]
        self.timeline.add_span("out_of_service", out["t0"], self.timeline.now(), task=out["task"], group=group,
                               cause=out["cause"], tries=out["tries"])
        self.policy.reopen(group)
        self._dispatch()

    def fenced_groups(self) -> dict[str, dict[str, Any]]:
        """The device groups out of service (a fence there could not be confirmed), each with its cause, the task whose
        fence it was, since when (wall-clock seconds), what is not seen gone yet and how often that was asked. A group
        leaves this once its fenced processes are gone (a restarted device-group process answers from a new pid)."""
        return {g: {"cause": o["cause"], "task": o["task"], "since": o["since"], "left": [str(u) for u in o["left"]],
                    "tries": o["tries"], **({"error": o["error"]} if "error" in o else {})}
                for g, o in self._out.items()}

    async def retire(self, task: str) -> None:
        """`task` finished and its roles were stopped: the memory it held is free now and it takes no more locks;
        the measured pools and its roles' handles drop it. Its place in the policy's books (as ended) and why it
        failed (`failed`, `fenced`) stay until `forget_task`: whoever reports the task's end (summary.json, the
        service) reads them after its driver has retired it. Idempotent."""
        if task not in self._failed and task in self.policy.tasks():
            self.policy.fail(task)  # the policy's word for "gone": no lease, no request, no memory
        for known in (self._targets, self._drivers, self._evicting, self._letting_go):
            known.pop(task, None)
        self.ports.release(task)
        for pool in self.measured.values():
            pool.clear(task)
        self._dispatch()

    def forget_task(self, task: str) -> None:
        """Drop everything the scheduler knows of a task that ended (retired or failed), once its end has been
        reported: its place in the policy's books (a live task is refused: PolicyError), why it failed or was fenced,
        its roles' handles, its measured memory. A scheduler that outlives many tasks (rlsched up) does not grow
        with them, and a task of the same name can be admitted afresh."""
        if task in self.policy.tasks():
            self.policy.forget(task)
        for known in (self._failed, self._fenced, self._targets, self._drivers, self._evicting, self._letting_go):
            known.pop(task, None)
        for pool in self.measured.values():
            pool.clear(task)

    def events_since(self, since: float | None = None) -> list[dict]:
        """The scheduler's timeline events that end at or after `since` (wall-clock seconds; all when None)."""
        return self.timeline.events(since)

    def forget_events_before(self, t: float) -> int:
        """Drop timeline events that ended before `t` (no live run will ask for them); returns how many are kept."""
        return self.timeline.forget_before(t)

    def sizes(self) -> dict[str, float]:
        """How much the scheduler keeps (a service's soak checks these stay flat). Its timeline events are kept for
        a time (a service moves them to disk every few seconds), so their count follows the event rate; what is
        bounded is their age: `scheduler events age s`, seconds since the oldest one held ended (0: none)."""
        from rlsched.observe.timeline import event_end

        events = self.timeline.events()
        oldest = min(map(event_end, events), default=None)
        return {"scheduler events": len(events),
                "scheduler events age s": 0.0 if oldest is None else round(max(0.0, time.time() - oldest), 1),
                "grant log": len(self.grant_log), "policy tasks": len(self.policy.tasks()),
                "failed": len(self._failed), "targets": len(self._targets)}

    def failed(self) -> dict[str, str]:
        return dict(self._failed)

    def collateral(self, host: Any, pid: int) -> str | None:
        """Why device-group process `host`'s process `pid` was ended by a fence of another task, or None (it died by
        itself): a task that lost its roles there rebuilds them without counting it as a restart of its own."""
        return self._ended.get((host, pid))

    def fenced(self) -> dict[str, str]:
        """The tasks the scheduler stopped itself, with why (their own error, if any, came after)."""
        return dict(self._fenced)

    # ---- liveness ---------------------------------------------------------------------------------

    async def watch(self, task: str, lifeline: list) -> None:
        """Await a task's lifeline call ([ObjectRef] that never resolves while the task lives)."""
        try:
            await lifeline[0]
        except Exception as err:  # noqa: BLE001 - any way the holder dies is a death
            await self.fail(task, f"its process died ({type(err).__name__})", fence=True, driver_alive=False)

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._expire_leases())

    async def _expire_leases(self) -> None:
        """The lease watchdog, supervised: a pass that raises is printed with its traceback (the scheduler's
        worker log) and kept for `state()`, and the next pass runs as usual: one error must not stop every lease
        from ever expiring again."""
        import traceback

        period = min(1.0, self.lease_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                now = time.monotonic()
                for task in self.policy.expired(now, self.lease_timeout_s):
                    phase, since = self.policy.lease_of(task)
                    await self.fail(task, f"lease expired after {now - since:.0f} s in phase {phase} "
                                          f"(cluster.lease_timeout_s={self.lease_timeout_s:g})", fence=True)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - logged and kept; the watchdog goes on
                self.watchdog_errors += 1
                self.watchdog_error = f"{type(err).__name__}: {err}".splitlines()[0]
                failing = self.watchdog_failing or {"since": time.time(), "failures": 0}
                self.watchdog_failing = {**failing, "cause": self.watchdog_error, "failures": failing["failures"] + 1}
                print(f"rlsched scheduler: the lease watchdog's pass failed ({self.watchdog_errors} so far):\n"
                      f"{traceback.format_exc()}", flush=True)
            else:
                self.watchdog_failing = None

    # ---- memory ---------------------------------------------------------------------------------------

    def report_memory(self, task: str, role: str, sizes: dict[str, int]) -> None:
        """Record what `task`'s `role` holds now, by kind ({} after an offload)."""
        pool = self.measured[self.policy.pool(task, Role(role))]
        pool.clear(task, role)
        for kind, nbytes in sizes.items():
            pool.report(task, role, kind, int(nbytes))
        self.timeline.counter(f"memory/{pool.name}", {t: pool.total(task=t) for t in self.policy.tasks()})

    def events(self) -> list[dict]:
        return self.timeline.events()

    # ---- introspection ------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """What fails now: {"watchdog": {"since", "cause", "failures"} while the lease watchdog's passes fail in a row,
        else None} (a service's `status` shows it; `state()` counts every failure ever)."""
        return {"watchdog": None if self.watchdog_failing is None else dict(self.watchdog_failing)}

    def state(self) -> dict[str, Any]:
        return {"failed": dict(self._failed), "fenced_groups": self.fenced_groups(), "grants": self.grants,
                "watchdog_errors": self.watchdog_errors,
                "watchdog_error": self.watchdog_error, "snapshot": self.policy.snapshot(),
                "measured": {name: pool.snapshot() for name, pool in self.measured.items()}}


# ---- lock providers: what a task's step loop holds its phases with ------------------------------------------


class SchedulerLocks:
    """The scheduler actor, called from a task driver's loop thread (blocking calls; nobody polls).

    A release is sent without waiting for its answer, so the host work after a phase (rewards, the
    metrics line) overlaps its round trip; the next acquire waits for that answer before it is sent.
    It must: the scheduler is an async actor, and Ray does not keep one caller's calls to such an
    actor in order, so an acquire sent while a release is in flight can be served first and be
    refused ("requested train while holding rollout")."""

    def __init__(self, scheduler, task: str):
        self.scheduler, self.task = scheduler, task
        self._released: list = []  # refs of releases sent, until their answers are checked

    def _ask(self, ref, what: str):
        """The scheduler's answer to a call that never waits for others (all but `acquire`), within
        ASK_TIMEOUT_S; a scheduler that does not answer is an error naming the call."""
        import ray

        try:
            return ray.get(ref, timeout=ASK_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise TaskError(f"task {self.task}: the scheduler did not answer {what} in "
                            f"{ASK_TIMEOUT_S:.0f} s") from None

    def _settle(self) -> None:
        """Wait for every release sent; raise its error if one came back."""

        released, self._released = self._released, []
        self._ask(released, "its lock releases")

    def acquire(self, phase: Phase) -> Lease:
        import ray

        self._settle()
        return ray.get(self.scheduler.acquire.remote(self.task, str(phase)))

    def release(self, phase: Phase) -> None:
        self._released.append(self.scheduler.release.remote(self.task, str(phase)))

    def fail(self, cause: str) -> None:

        self._ask(self.scheduler.fail.remote(self.task, cause), "fail()")

    def report_memory(self, role: str, sizes: dict[str, int]) -> None:
        self.scheduler.report_memory.remote(self.task, role, sizes)  # accounting, not control: no wait

    def revoked(self) -> str | None:
        """Why the scheduler failed this task (it fenced it, e.g. its lease expired), or None."""

        return self._ask(self.scheduler.failed.remote(), "failed()").get(self.task)

    def collateral(self, host, pid: int) -> str | None:
        """Why device-group process `host`'s process `pid` was ended to fence another task, or None."""

        return self._ask(self.scheduler.collateral.remote(host, pid), "collateral()")

    def take_port(self, role: str, host: str, skip: list[int]) -> int:
        """A coordinator port on `host` for this task's `role` group (the scheduler's allocator)."""

        return self._ask(self.scheduler.take_port.remote(self.task, role, host, list(skip)), "take_port()")

    def register_roles(self, targets: list) -> None:
        """What the scheduler stops if it must fence this task (rlsched.scheduling.fencing)."""

        self._ask(self.scheduler.register_roles.remote(self.task, targets), "register_roles()")

    def close(self) -> None:
        """The task's roles are stopped: tell the scheduler their memory is free."""

        self._settle()
        self._ask(self.scheduler.retire.remote(self.task), "retire()")


class FreeLocks:
    """Always free, nothing to move: one task alone in this process (`rlsched train --in-process`)."""

    def __init__(self, task: str):
        self.task = task
        self._ids = 0

    def acquire(self, phase: Phase) -> Lease:
        self._ids += 1
        return Lease(self._ids, self.task, Phase(phase), f"local/{Phase(phase)}", (), time.monotonic(), 0.0)

    def release(self, phase: Phase) -> None:
        pass

    def fail(self, cause: str) -> None:
        pass

    def report_memory(self, role: str, sizes: dict[str, int]) -> None:
        pass

    def revoked(self) -> str | None:
        return None

    def collateral(self, host, pid: int) -> str | None:
        return None

    take_port = None  # no role group here: roles.spawn refuses a mesh across hosts in-process before asking a port

    def register_roles(self, targets: list) -> None:
        pass

    def close(self) -> None:
        pass
