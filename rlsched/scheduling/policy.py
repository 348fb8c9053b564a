"""Pure scheduling decisions: who gets which lock, in what order, and what must move in memory first.

No Ray, no JAX, no IO: the scheduler actor wraps a `Policy`, calls it with the time, and executes
the `Move`s it returns. Everything here is decided by plain data, so it is unit- and property-tested.

Design decisions (and why):
- **Two phases, one lock each.** A task's step is ROLLOUT then TRAIN; each phase takes exactly one
  resource, its group's rollout slot or train slot. A phase never needs two locks (three phases
  deadlocked in the field), and a task has at most one request or lease in flight at a time: its
  phases are sequential, and a queued request for its next phase would hold a FIFO place it can't use.
- **An order per resource, head-of-line blocking.** Each free resource serves one candidate of its
  queue (`ORDERS`): `fifo` the oldest request; `priority` the highest task priority (then the oldest);
  `fair` the task with the least lock time on that phase per unit of weight (weighted fair share, then
  the oldest). If the candidate can't be admitted for memory, the queue behind it waits. Candidates of
  different resources are tried oldest first, so a request blocked for memory gets the first claim on
  the devices when they free up (no starvation by a busy neighbouring slot).
- **A starvation bound in every order.** A queued request passed over `starvation_limit` times (its
  resource granted to another request while it waited) is *starving*, and starving requests are served
  before any other, oldest first. So a request is granted within `starvation_limit + N - 1` grants of its
  resource, N the tasks that share it (at most N - 1 older requests can be starving before it); FIFO
  within N - 1. Grants happen only at phase boundaries (a lock is never taken from a holder), so a higher
  priority waits for the phase in progress, never longer. The property tests hold every order to this.
- **Memory-aware residency.** A role stays resident after its lease is released; nothing is
  offloaded while everything fits (offload made small tasks 7x slower in the field). An onload that
  would exceed its pool's budget first evicts idle resident roles, least recently used first. Idle =
  not the role of a held lease: a TRAIN holder protects its actor, not its engine. The grantee's own
  other role is idle too and may be evicted (colocated, engine + actor > budget: otherwise one task
  alone could never train); being just used, it is naturally the last candidate.
- **Moves are decisions.** `grant` updates the accounting as if its moves were done; the holder
  executes them (offloads first, its onload last) before working, through `memory.Residency`.
- **Co-batched ROLLOUT and TRAIN** (LoRA tasks of one base group, `CoBatch`, one per phase). Their engines are
  slots of one sampler over one resident base, so one program run can serve all their rows at once; their actors
  read that base too, and tasks whose update is the same program run their optimizer steps as one. When a phase's
  lock goes to such a task, the other queued requests of that phase and key join the hold, in the order's
  preference, while their rows fit the phase's capacity (and their roles fit in memory). The lock is free again
  when every member has released it; each is charged the hold's time by its share of the rows (fair share stays
  per task), and a joiner's own lock time ends when it releases. A hold grows only when it is granted: a request
  that arrives during a hold waits for the next one.
- **Shared bases are pinned** (`register(..., bases=)`). A LoRA task's roles read its base group's one copy of the
  base, which stays on the devices while any live task reads it: it is counted once in its pool from the first
  reader's registration to the last reader's end, never evicted, and a role must fit beside the pool's bases. A
  new base that does not fit in the free room evicts idle roles when it is registered (their OFFLOAD moves come
  first in `register`'s result), since it is loaded with the task's roles.
- **A device group can be closed** (`close`): the scheduler takes it out of service when a fence could not confirm
  that a task's roles stopped there. Nothing of it is granted and no task is registered on it until `reopen`: a lock
  or bytes that a live call may still use are never handed to anyone.
- **Failure frees memory.** `fail` drops a task's lease and queued request and forgets its memory:
  its process died or, on lease expiry, is being killed by the caller.

Deadlock freedom: (1) a lease holder waits for nothing (one lock, its role already resident), so
every lease ends (release, fail or expiry). (2) A pool serves at most two slots (colocated: its
group's rollout and train; disaggregated: one), so a head at a free slot can only be blocked by the
role the other slot's holder protects; once that holder releases, nothing in the pool is protected
and, every budget being >= each of its roles plus its pinned bases (checked at register), evicting idle
roles makes room.
(3) The oldest head is tried first and each queue is FIFO, so every queued request is granted.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from enum import StrEnum
from typing import Any

from rlsched.base.units import format_bytes


class PolicyError(Exception):
    """A caller broke the protocol (double request, release without lease, ...) or a config can't work."""


class Phase(StrEnum):
    ROLLOUT = "rollout"
    TRAIN = "train"

    @property
    def role(self) -> Role:
        """The role this phase needs resident: ROLLOUT generates with the engine, TRAIN updates the actor."""
        return Role.ENGINE if self is Phase.ROLLOUT else Role.ACTOR


class Role(StrEnum):
    ENGINE = "engine"  # rollout weights + KV cache
    ACTOR = "actor"  # params + optimizer state + reference params


class Order(StrEnum):
    FIFO = "fifo"  # oldest request first
    PRIORITY = "priority"  # highest task priority first, then oldest
    FAIR = "fair"  # least lock seconds on the phase per unit of task weight first, then oldest


ORDERS = tuple(str(o) for o in Order)


class Placement(StrEnum):
    COLOCATED = "colocated"  # engine and actor share the same devices: one pool, one budget
    DISAGGREGATED = "disaggregated"  # a rollout pool (engines) and a train pool (actors)


class Action(StrEnum):
    ONLOAD = "onload"  # host -> device
    OFFLOAD = "offload"  # device -> host


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One device group. Budgets are bytes per pool; None = unlimited.

    Colocated groups use `budget` (one pool for both roles); disaggregated groups use
    `rollout_budget` (engines) and `train_budget` (actors). Prefer the two constructors.
    """

    placement: Placement = Placement.COLOCATED
    budget: int | None = None
    rollout_budget: int | None = None
    train_budget: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", Placement(self.placement))
        unused = ("rollout_budget", "train_budget") if self.placement is Placement.COLOCATED else ("budget",)
        for name in unused:
            if getattr(self, name) is not None:
                raise PolicyError(f"GroupSpec: {name}={getattr(self, name)!r} is not used by a {self.placement} group")
        for name in ("budget", "rollout_budget", "train_budget"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise PolicyError(f"GroupSpec: {name} must be a non-negative int of bytes or None, got {value!r}")

    @classmethod
    def colocated(cls, budget: int | None = None) -> GroupSpec:
        return cls(Placement.COLOCATED, budget=budget)

    @classmethod
    def disaggregated(cls, rollout_budget: int | None = None, train_budget: int | None = None) -> GroupSpec:
        return cls(Placement.DISAGGREGATED, rollout_budget=rollout_budget, train_budget=train_budget)

    def pools(self, group: str) -> dict[str, int | None]:
        """Pool id -> budget: `<group>/shared`, or `<group>/rollout-pool` and `<group>/train-pool`."""
        if self.placement is Placement.COLOCATED:
            return {f"{group}/shared": self.budget}
        return {f"{group}/rollout-pool": self.rollout_budget, f"{group}/train-pool": self.train_budget}

    def pool_of(self, group: str, role: Role) -> str:
        if self.placement is Placement.COLOCATED:
            return f"{group}/shared"
        return f"{group}/rollout-pool" if role is Role.ENGINE else f"{group}/train-pool"


@dataclasses.dataclass(frozen=True)
class Resource:
    """A lock: one phase's slot of one device group."""

    group: str
    phase: Phase

    @property
    def id(self) -> str:
        return f"{self.group}/{self.phase}"  # e.g. "g0/rollout"

    def __str__(self) -> str:
        return self.id


@dataclasses.dataclass(frozen=True)
class Move:
    task: str
    role: Role
    action: Action


@dataclasses.dataclass(frozen=True)
class CoBatch:
    """A task's place in a base group whose `phase` can be co-batched: tasks of one `key` (in one device group)
    share a hold of that phase while their `rows` add up to at most `capacity`. ROLLOUT: prompts x generations per
    step against the shared engine's batch; TRAIN: micro-batch rows against the co-batched update's."""

    key: str
    rows: int
    capacity: int
    phase: Phase = Phase.ROLLOUT

    def __post_init__(self) -> None:
        if not isinstance(self.rows, int) or not isinstance(self.capacity, int) or self.rows < 1 or self.capacity < 1:
            raise PolicyError(f"CoBatch {self.key!r}: rows and capacity must be positive ints, got {self.rows!r} "
                              f"and {self.capacity!r}")


@dataclasses.dataclass(frozen=True)
class Grant:
    request_id: int
    task: str
    phase: Phase
    resource: Resource
    moves: tuple[Move, ...]  # evictions (offloads) first, then the grantee's onload; execute in order
    cohort: tuple[str, ...] = ()  # a co-batched ROLLOUT hold's tasks (this one included); () alone
    hold: int = 0  # the hold's id (its first grant's request id); 0 alone


@dataclasses.dataclass
class _Base:
    """A shared base pinned in a pool: counted once while any live task reads it."""

    nbytes: int
    readers: set[str]


@dataclasses.dataclass
class _Request:
    id: int
    task: str
    phase: Phase
    resource: Resource
    passed: int = 0  # grants of its resource to other requests while this one waited


@dataclasses.dataclass
class _Task:
    name: str
    group: str
    nbytes: dict[Role, int]
    resident: dict[Role, bool]
    last_used: dict[Role, int]  # LRU clock ticks (a counter, not time: equal timestamps still order)
    request: _Request | None = None  # the queued request, if any
    holding: Phase | None = None
    granted_at: float = 0.0
    failed: bool = False
    priority: int = 0
    weight: float = 1.0
    cobatch: dict[Phase, CoBatch] = dataclasses.field(default_factory=dict)  # the phases it may share a hold of
    share: float = 1.0  # of the hold it holds: its rows / the cohort's rows (1 alone)
    usage: dict[Phase, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(Phase, 0.0))  # s / weight


class Policy:
    """Locks, ordered queues and memory admission for all device groups. Single-threaded by contract."""

    def __init__(self, groups: dict[str, GroupSpec], *, order: str = "fifo", starvation_limit: int = 8):
        if not groups:
            raise PolicyError("Policy needs at least one device group")
        if order not in ORDERS:
            raise PolicyError(f"unknown order {order!r}; choose one of {ORDERS}")
        if not isinstance(starvation_limit, int) or starvation_limit < 1:
            raise PolicyError(f"starvation_limit must be a positive int, got {starvation_limit!r}")
        self.order, self.starvation_limit = Order(order), starvation_limit
        self._groups = dict(groups)
        self._budgets: dict[str, int | None] = {}
        for name, spec in self._groups.items():
            self._budgets.update(spec.pools(name))
        self._used = dict.fromkeys(self._budgets, 0)
        self._queues = {Resource(g, p): deque() for g in self._groups for p in Phase}
        self._holders: dict[Resource, list[str]] = {}  # a co-batched ROLLOUT hold has several
        self._tasks: dict[str, _Task] = {}
        self._bases: dict[tuple[str, str], _Base] = {}  # (pool, key) -> a shared base pinned there
        self._request_tasks: dict[int, str] = {}  # queued or dropped request id -> task
        self._closed: dict[str, str] = {}  # device group out of service -> why (`close`)
        self._next_id = 0
        self._tick = 0

    # ---- tasks ------------------------------------------------------------------------------------

    def register(self, task: str, group: str, engine_bytes: int, actor_bytes: int, *, resident: bool = True,
                 priority: int = 0, weight: float = 1.0, cobatch: CoBatch | tuple[CoBatch, ...] | None = None,
                 bases: tuple[tuple[str, Role, int], ...] = ()) -> list[Move]:
        """Add a task. `resident=True`: its roles were created on device; those that fit in the pools'
        free room stay (engine first: ROLLOUT comes first) and the returned OFFLOAD moves must be done
        at once. Registering never evicts other tasks. `resident=False`: created on host, returns [].
        `priority` (order "priority": higher first) and `weight` (order "fair": its share of lock time); `cobatch`:
        its base group's co-batched phases (one CoBatch per phase), whose holds it may share. `bases`: the shared
        bases its roles read, (key, role, bytes per device), left out of `engine_bytes` / `actor_bytes`: each is
        pinned once in its role's pool while a live task reads it; a new one that does not fit in the free room
        evicts idle roles of other tasks (their OFFLOAD moves come first in the result: do them before the task's
        roles are created)."""
        if task in self._tasks:
            raise PolicyError(f"task {task!r} is already registered")
        if not isinstance(weight, int | float) or not weight > 0:
            raise PolicyError(f"task {task!r}: weight must be > 0, got {weight!r}")
        if group not in self._groups:
            raise PolicyError(f"task {task!r}: unknown device group {group!r} (known: {sorted(self._groups)})")
        if group in self._closed:
            raise PolicyError(f"task {task!r}: device group {group!r} is out of service ({self._closed[group]}); "
                              "submit it again once the group is back in service")
        nbytes = {Role.ENGINE: engine_bytes, Role.ACTOR: actor_bytes}
        pinned = {}  # (pool, key) -> bytes: the pools' bases once this task is registered
        for key, role, n in bases:
            if not isinstance(n, int) or n < 0:
                raise PolicyError(f"task {task!r}: shared base {key!r} bytes must be a non-negative int, got {n!r}")
            pinned[self._groups[group].pool_of(group, Role(role)), key] = n
        for (pool, key), b in self._bases.items():
            pinned.setdefault((pool, key), b.nbytes)
        for role, n in nbytes.items():
            if not isinstance(n, int) or n < 0:
                raise PolicyError(f"task {task!r}: {role} bytes must be a non-negative int, got {n!r}")
            pool = self._groups[group].pool_of(group, role)
            budget = self._budgets[pool]
            held = sum(b for (p, _), b in pinned.items() if p == pool)
            if budget is not None and n + held > budget:
                shown = (n, budget)
                beside = f" beside {format_bytes(held)} of shared bases that never offload" if held else ""
                raise PolicyError(f"task {task!r}: {role} needs {format_bytes(n, like=shown)}{beside} but pool "
                                  f"{pool!r} has a budget of only {format_bytes(budget, like=shown)}; no amount of "
                                  "offloading can make it fit")
        batches = (cobatch,) if isinstance(cobatch, CoBatch) else tuple(cobatch or ())
        if len({b.phase for b in batches}) != len(batches):
            raise PolicyError(f"task {task!r}: give at most one CoBatch per phase, got {batches}")
        state = _Task(task, group, nbytes, dict.fromkeys(Role, False), dict.fromkeys(Role, 0),
                      priority=int(priority), weight=float(weight), cobatch={b.phase: b for b in batches})
        # A task arriving late starts level with the least served live task of its group, not at zero: a
        # newcomer does not get the lock until it has caught up with tasks that ran for hours.
        peers = [t for t in self._tasks.values() if t.group == group and not t.failed]
        if peers:
            state.usage = {ph: min(t.usage[ph] for t in peers) for ph in Phase}
        self._tasks[task] = state
        moves = self._pin(state, bases)
        for role in (Role.ENGINE, Role.ACTOR) if resident else ():
            pool = self._pool(state, role)
            budget = self._budgets[pool]
            if budget is None or self._used[pool] + nbytes[role] <= budget:
                self._set_resident(state, role, True)
                self._touch(state, role)  # registration order breaks LRU ties between never-used roles
            else:
                moves.append(Move(task, role, Action.OFFLOAD))
        return moves

    def _pin(self, state: _Task, bases) -> list[Move]:
        """Count `state`'s shared bases as read by it; a base new to its pool is pinned there, evicting idle roles
        (least recently used first) while it does not fit the free room. Returns those evictions."""
        moves = []
        for key, role, n in bases:
            pool = self._pool(state, Role(role))
            if (pool, key) in self._bases:
                self._bases[pool, key].readers.add(state.name)
                continue
            budget = self._budgets[pool]
            idle = sorted((other.last_used[r], other.name, r) for other in self._tasks.values() for r in Role
                          if other.resident[r] and self._pool(other, r) == pool and other.nbytes[r] > 0
                          and not (other.holding is not None and other.holding.role is r))
            for _, name, r in idle:
                if budget is None or self._used[pool] + n <= budget:
                    break
                self._set_resident(self._tasks[name], r, False)
                moves.append(Move(name, r, Action.OFFLOAD))
            self._bases[pool, key] = _Base(n, {state.name})
            self._used[pool] += n  # held roles that do not fit beside it are over until they release (then evicted)
        return moves

    def _unpin(self, state: _Task) -> None:
        """`state` reads its bases no more: a base with no live reader left is no longer counted."""
        for (pool, key), b in list(self._bases.items()):
            b.readers.discard(state.name)
            if not b.readers:
                self._used[pool] -= b.nbytes
                del self._bases[pool, key]

    def fail(self, task: str) -> None:
        """The task died or lost its lease: drop its lease and queued request, forget its memory (a shared base
        it was the last to read included). Idempotent."""
        state = self._task(task)
        if state.holding is not None:
            self._let_go(state)
        if state.request is not None:
            self._queues[state.request.resource].remove(state.request)
            state.request = None
        for role in Role:
            self._set_resident(state, role, False)
        self._unpin(state)
        state.failed = True

    def forget(self, task: str) -> None:
        """Drop a task that ended (failed or retired) from the books, so a task of that name can be registered
        again (a cancelled task resubmitted to a long-lived scheduler). A live task cannot be forgotten."""
        state = self._task(task)
        if not state.failed:
            raise PolicyError(f"task {task!r} is live; only a task that ended can be forgotten")
        del self._tasks[task]

    def close(self, group: str, why: str) -> None:
        """Take `group` out of service: none of its locks is granted and no task is registered on it until `reopen`
        (its tasks' books stay as they are: the caller fails them)."""
        if group not in self._groups:
            raise PolicyError(f"unknown device group {group!r} (known: {sorted(self._groups)})")
        self._closed.setdefault(group, why)

    def reopen(self, group: str) -> None:
        """Put `group` back in service (what held its devices is known gone). Idempotent."""
        self._closed.pop(group, None)

    def closed(self) -> dict[str, str]:
        """The device groups out of service, with why."""
        return dict(self._closed)

    # ---- locks ------------------------------------------------------------------------------------

    def request(self, task: str, phase: Phase, now: float) -> int:
        """Queue `task` for `phase`'s resource; returns the request id. `now` is accepted for symmetry."""
        state = self._task(task)
        phase = Phase(phase)
        if state.failed:
            raise PolicyError(f"task {task!r} has failed and can't request {phase}")
        if state.holding is not None:
            raise PolicyError(f"task {task!r} requested {phase} while holding {state.holding}: release it first")
        if state.request is not None:
            raise PolicyError(f"task {task!r} requested {phase} while its {state.request.phase} request is queued")
        self._next_id += 1
        req = _Request(self._next_id, task, phase, Resource(state.group, phase))
        self._queues[req.resource].append(req)
        self._request_tasks[req.id] = task
        state.request = req
        return req.id

    def grant(self, now: float) -> list[Grant]:
        """Every grant possible now. One pass over the candidates of free resources, oldest first, suffices:
        a grant takes a lock and protects bytes but never frees any room an earlier candidate could use."""
        heads = sorted((self._candidate(q) for r, q in self._queues.items()
                        if q and r not in self._holders and r.group not in self._closed), key=lambda q: q.id)
        grants = []
        for req in heads:
            moves = self._admit(req)
            if moves is None:
                continue  # head-of-line: this resource's queue waits behind its candidate
            queue = self._queues[req.resource]
            cohort = [(req, moves), *self._joiners(req, queue)]
            for other in queue:
                if all(other is not r for r, _ in cohort):
                    other.passed += 1
            rows = [self._tasks[r.task].cobatch[r.phase].rows if len(cohort) > 1 else 1 for r, _ in cohort]
            tasks = tuple(r.task for r, _ in cohort) if len(cohort) > 1 else ()
            for (r, m), n in zip(cohort, rows, strict=True):
                self._hand(r, now, share=n / sum(rows))
                grants.append(Grant(r.id, r.task, r.phase, r.resource, m, tasks, req.id if tasks else 0))
        return grants

    def _hand(self, req: _Request, now: float, *, share: float) -> None:
        """The lock to `req` (its moves already admitted): out of its queue, among its resource's holders."""
        state = self._tasks[req.task]
        self._queues[req.resource].remove(req)
        del self._request_tasks[req.id]
        self._holders.setdefault(req.resource, []).append(req.task)
        state.request, state.holding, state.granted_at, state.share = None, req.phase, now, share
        self._touch(state, req.phase.role)

    def _joiners(self, lead: _Request, queue: deque[_Request]) -> list[tuple[_Request, tuple]]:
        """The requests of `lead`'s phase and co-batch key that share its hold: in the order's preference, while their
        rows fit the capacity and their roles fit in memory (each admitted as it joins; a joiner's onload never
        evicts a member's role of the phase, which its hold protects)."""
        mine = self._tasks[lead.task].cobatch.get(lead.phase)
        if mine is None:
            return []
        rows, members, out = mine.rows, [lead.task], []
        for req in sorted(queue, key=self._preference):
            other = self._tasks[req.task].cobatch.get(req.phase)
            if req is lead or other is None or other.key != mine.key or rows + other.rows > mine.capacity:
                continue
            moves = self._admit(req, members=members)
            if moves is not None:
                rows += other.rows
                members.append(req.task)
                out.append((req, moves))
        return out

    def release(self, task: str, phase: Phase, now: float) -> None:
        """Free the lock. Residency stays (memory-aware); the role becomes the most recently used."""
        state = self._task(task)
        phase = Phase(phase)
        if state.holding is not phase:
            raise PolicyError(f"task {task!r} released {phase} but holds {state.holding or 'nothing'}")
        self._let_go(state)
        # A co-batched hold's time is charged by each member's share of its rows
        state.usage[phase] += max(0.0, now - state.granted_at) * state.share / state.weight
        self._touch(state, phase.role)

    def _let_go(self, state: _Task) -> None:
        resource = Resource(state.group, state.holding)
        holders = self._holders[resource]
        holders.remove(state.name)
        if not holders:  # the last member of a hold frees the lock
            del self._holders[resource]
        state.holding = None

    def lease_of(self, task: str) -> tuple[Phase, float] | None:
        """The phase `task` holds and when it was granted, or None."""
        state = self._task(task)
        return None if state.holding is None else (state.holding, state.granted_at)

    def expired(self, now: float, timeout: float) -> list[str]:
        """Tasks whose current lease was granted more than `timeout` seconds before `now`."""
        return [t for ts in self._holders.values() for t in ts if now - self._tasks[t].granted_at > timeout]

    def candidate(self, resource: Resource) -> str | None:
        """The task the resource's queue would serve next (memory permitting), or None when it is empty."""
        queue = self._queues[resource]
        return self._candidate(queue).task if queue else None

    def _candidate(self, queue: deque[_Request]) -> _Request:
        """Starving requests first, oldest first; otherwise the order's choice."""
        return min(queue, key=self._preference)

    def _preference(self, req: _Request) -> tuple:
        """Sort key of a queue's requests, most preferred first: starving (oldest first), then the order's."""
        if req.passed >= self.starvation_limit:
            return (0, req.id)
        if self.order is Order.FIFO:
            return (1, req.id)  # ids are in arrival order
        if self.order is Order.PRIORITY:
            return (1, -self._tasks[req.task].priority, req.id)
        return (1, self._tasks[req.task].usage[req.phase], req.id)

    # ---- memory admission ---------------------------------------------------------------------------

    def _admit(self, req: _Request, members: list[str] | tuple = ()) -> tuple[Move, ...] | None:
        """The moves that make room for the request's role, or None if even evicting every idle role can't.
        `members`: the tasks of the hold it joins, not yet among the holders: their roles of its phase are not idle."""
        state = self._tasks[req.task]
        role = req.phase.role
        if state.resident[role]:
            return ()
        pool = self._pool(state, role)
        budget, need = self._budgets[pool], state.nbytes[role]
        free = None if budget is None else budget - self._used[pool]
        victims: list[tuple[_Task, Role]] = []
        if free is not None and need > free:
            protected = {(holder, r.phase.role) for r, holders in self._holders.items() for holder in holders}
            protected |= {(member, role) for member in members}
            idle = [(other.last_used[r], other.name, r) for other in self._tasks.values() for r in Role
                    if other.resident[r] and self._pool(other, r) == pool and (other.name, r) not in protected
                    and other.nbytes[r] > 0]  # moving nothing would make no room
            for _, name, r in sorted(idle):
                if need <= free:
                    break
                victims.append((self._tasks[name], r))
                free += self._tasks[name].nbytes[r]
            if need > free:
                return None
        for victim, r in victims:
            self._set_resident(victim, r, False)
        self._set_resident(state, role, True)
        return (*(Move(v.name, r, Action.OFFLOAD) for v, r in victims), Move(req.task, role, Action.ONLOAD))

    def _set_resident(self, state: _Task, role: Role, resident: bool) -> None:
        if state.resident[role] != resident:
            self._used[self._pool(state, role)] += state.nbytes[role] if resident else -state.nbytes[role]
            state.resident[role] = resident

    def _touch(self, state: _Task, role: Role) -> None:
        self._tick += 1
        state.last_used[role] = self._tick

    def _pool(self, state: _Task, role: Role) -> str:
        return self._groups[state.group].pool_of(state.group, role)

    def _task(self, task: str) -> _Task:
        if task not in self._tasks:
            raise PolicyError(f"unknown task {task!r} (registered: {sorted(self._tasks)})")
        return self._tasks[task]

    # ---- introspection ------------------------------------------------------------------------------

    def resources(self) -> list[Resource]:
        return list(self._queues)

    def resource(self, task: str, phase: Phase) -> Resource:
        return Resource(self._task(task).group, Phase(phase))

    def group(self, task: str) -> str:
        return self._task(task).group

    def pool(self, task: str, role: Role) -> str:
        return self._pool(self._task(task), Role(role))

    def holder(self, resource: Resource) -> str | None:
        """The task holding `resource` (a co-batched hold's first member), or None."""
        return self._holders.get(resource, [None])[0]

    def holders(self, resource: Resource) -> list[str]:
        """Every task holding `resource` (several: a co-batched ROLLOUT hold)."""
        return list(self._holders.get(resource, []))

    def holding(self, task: str) -> Phase | None:
        return self._task(task).holding

    def queue(self, resource: Resource) -> list[str]:
        return [req.task for req in self._queues[resource]]

    def request_task(self, request_id: int) -> str | None:
        """The task of a queued (or dropped by `fail`) request; None once granted or never issued."""
        return self._request_tasks.get(request_id)

    def resident(self, task: str, role: Role) -> bool:
        return self._task(task).resident[Role(role)]

    def nbytes(self, task: str, role: Role) -> int:
        return self._task(task).nbytes[Role(role)]

    def tasks(self) -> list[str]:
        return list(self._tasks)

    def used_bytes(self, pool: str) -> int:
        return self._used[pool]

    def budget(self, pool: str) -> int | None:
        return self._budgets[pool]

    def pools(self) -> list[str]:
        return list(self._budgets)

    def snapshot(self) -> dict[str, Any]:
        """JSON-safe state for logs and timelines."""
        return {
            "order": str(self.order), "starvation_limit": self.starvation_limit, "closed": dict(self._closed),
            "pools": {p: {"budget": self._budgets[p], "used": self._used[p],
                          **({"bases": {k: b.nbytes for (q, k), b in self._bases.items() if q == p}}
                             if any(q == p for q, _ in self._bases) else {})} for p in self._budgets},
            "holders": {r.id: ",".join(ts) for r, ts in self._holders.items()},
            "queues": {r.id: [req.task for req in q] for r, q in self._queues.items() if q},
            "tasks": {t.name: {"group": t.group, "bytes": {str(r): n for r, n in t.nbytes.items()},
                               "resident": [str(r) for r in Role if t.resident[r]],
                               "holding": t.holding and str(t.holding),
                               "waiting": t.request and str(t.request.phase), "failed": t.failed,
                               "priority": t.priority, "weight": t.weight,
                               **({"cobatch": {str(p): b.key for p, b in t.cobatch.items()}} if t.cobatch else {}),
                               "lock_s_per_weight": {str(ph): u for ph, u in t.usage.items()}}
                      for t in self._tasks.values()},
        }
