"""The pure scheduling policy: hand-written scenarios, then a state machine over random schedules."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rlsched.scheduling.policy import Action, GroupSpec, Move, Phase, Policy, PolicyError, Resource, Role

R, T = Phase.ROLLOUT, Phase.TRAIN
ENGINE, ACTOR = Role.ENGINE, Role.ACTOR


def offload(task, role):
    return Move(task, role, Action.OFFLOAD)


def onload(task, role):
    return Move(task, role, Action.ONLOAD)


def colocated(budget=None, tasks=(("a", 10, 10),), resident=True):
    policy = Policy({"g0": GroupSpec.colocated(budget)})
    for name, engine, actor in tasks:
        policy.register(name, "g0", engine, actor, resident=resident)
    return policy


def granted(policy, now=0.0):
    return [(g.task, g.phase) for g in policy.grant(now)]


# ---- locks --------------------------------------------------------------------------------------------


def test_fifo_per_resource_and_phases_overlap():
    p = colocated(tasks=[("a", 1, 1), ("b", 1, 1), ("c", 1, 1)])
    for task in "abc":
        p.request(task, R, 0.0)
    assert granted(p) == [("a", R)]
    assert p.queue(Resource("g0", R)) == ["b", "c"]
    p.release("a", R, 1.0)
    p.request("a", T, 1.0)
    # a trains while b rolls out: the overlap the two slots exist for
    assert granted(p) == [("b", R), ("a", T)]
    p.release("b", R, 2.0)
    assert granted(p) == [("c", R)]


def test_a_task_never_holds_or_queues_two_phases():
    p = colocated(tasks=[("a", 1, 1), ("b", 1, 1)])
    p.request("a", R, 0.0)
    with pytest.raises(PolicyError, match="while its rollout request is queued"):
        p.request("a", T, 0.0)
    with pytest.raises(PolicyError, match="queued"):
        p.request("a", R, 0.0)
    p.grant(0.0)
    with pytest.raises(PolicyError, match="while holding rollout"):
        p.request("a", T, 0.0)
    with pytest.raises(PolicyError, match="holds rollout"):
        p.release("a", T, 0.0)
    with pytest.raises(PolicyError, match="holds nothing"):
        p.release("b", R, 0.0)
    with pytest.raises(PolicyError, match="unknown task"):
        p.request("zz", R, 0.0)


def test_expired_after_timeout():
    p = colocated(tasks=[("a", 1, 1), ("b", 1, 1)])
    p.request("a", R, 0.0)
    p.request("b", T, 5.0)
    p.grant(10.0)
    assert p.expired(15.0, timeout=5.0) == []  # exactly the timeout is not more than it
    assert sorted(p.expired(15.5, timeout=5.0)) == ["a", "b"]
    p.release("a", R, 16.0)
    assert p.expired(100.0, timeout=5.0) == ["b"]


def test_fail_drops_lease_and_queue_and_memory_and_lets_the_next_waiter_in():
    p = colocated(budget=20, tasks=[("a", 10, 10), ("b", 10, 10), ("c", 10, 10)], resident=False)
    ids = {t: p.request(t, R, 0.0) for t in "abc"}
    assert granted(p) == [("a", R)]
    p.fail("a")
    assert p.holder(Resource("g0", R)) is None and not p.resident("a", ENGINE)
    assert p.used_bytes("g0/shared") == 0
    assert granted(p) == [("b", R)]
    p.fail("c")  # a queued waiter fails: its request goes, the scheduler can still map the id to it
    assert p.queue(Resource("g0", R)) == [] and p.request_task(ids["c"]) == "c"
    with pytest.raises(PolicyError, match="has failed"):
        p.request("a", R, 1.0)
    p.fail("a")  # idempotent


def test_an_ended_task_is_forgotten_and_its_name_registers_again_but_a_live_one_is_not():
    """A long-lived scheduler (rlsched.service.server): a cancelled task resubmitted under its name starts afresh."""
    p = colocated(budget=20, tasks=[("a", 10, 10), ("b", 5, 5)])
    p.request("a", R, 0.0)
    assert granted(p) == [("a", R)]
    with pytest.raises(PolicyError, match="is live"):
        p.forget("a")
    with pytest.raises(PolicyError, match="already registered"):
        p.register("a", "g0", 10, 10)
    p.fail("a")
    p.forget("a")
    assert p.tasks() == ["b"] and p.used_bytes("g0/shared") == 0  # b was registered on host: a filled the pool
    p.request("b", R, 1.0)
    assert granted(p) == [("b", R)] and p.used_bytes("g0/shared") == 5
    assert p.register("a", "g0", 10, 10) == [offload("a", ACTOR)]  # 10 + 10 beside b's 5: the actor waits on host
    assert p.snapshot()["tasks"]["a"]["failed"] is False


# ---- memory ---------------------------------------------------------------------------------------------


def test_no_eviction_when_everything_fits():
    p = colocated(budget=40, tasks=[("a", 10, 10), ("b", 10, 10)])
    for task in "ab":
        p.request(task, R, 0.0)
        (g,) = p.grant(0.0)
        assert g.moves == ()  # already resident since register, and it stays so
        p.release(task, R, 1.0)
        p.request(task, T, 1.0)
        assert p.grant(1.0)[0].moves == ()
        p.release(task, T, 2.0)
    assert all(p.resident(t, r) for t in "ab" for r in Role)


def test_eviction_picks_the_least_recently_used_idle_role_of_any_task():
    p = colocated(budget=30, tasks=[("a", 10, 10), ("b", 10, 10), ("c", 10, 10)], resident=False)
    for task in "abc":  # a's, then b's, then c's engine come on: 30 bytes, full
        p.request(task, R, 0.0)
        assert p.grant(0.0)[0].moves == (onload(task, ENGINE),)
        p.release(task, R, 0.0)
    p.request("b", T, 1.0)
    assert p.grant(1.0)[0].moves == (offload("a", ENGINE), onload("b", ACTOR))
    p.request("a", R, 1.0)  # b holds TRAIN: its actor is protected, its idle engine is not
    assert p.grant(1.0)[0].moves == (offload("b", ENGINE), onload("a", ENGINE))
    assert p.used_bytes("g0/shared") == 30


def test_a_lone_task_evicts_its_own_idle_engine_to_train():
    # engine + actor > budget: without evicting its own engine the only task could never train
    p = colocated(budget=12, tasks=[("a", 8, 8)])
    assert p.resident("a", ENGINE) and not p.resident("a", ACTOR)
    p.request("a", R, 0.0)
    assert p.grant(0.0)[0].moves == ()
    p.release("a", R, 1.0)
    p.request("a", T, 1.0)
    assert p.grant(1.0)[0].moves == (offload("a", ENGINE), onload("a", ACTOR))


def test_a_request_waits_for_memory_and_blocks_its_queue_but_not_the_other_slot():
    p = colocated(budget=20, tasks=[("a", 5, 15), ("b", 15, 5), ("c", 5, 5)], resident=False)
    p.request("a", T, 0.0)
    assert p.grant(0.0)[0].moves == (onload("a", ACTOR),)  # 15 used, protected by a's lease
    p.request("b", R, 1.0)  # needs 15, only 5 free, nothing idle to evict: waits
    p.request("c", R, 2.0)  # would fit, but FIFO: behind b on the rollout slot
    assert p.grant(2.0) == []
    assert p.queue(Resource("g0", R)) == ["b", "c"]
    p.release("a", T, 3.0)  # a's actor becomes idle, evictable: b goes, then c behind it
    assert p.grant(3.0)[0].moves == (offload("a", ACTOR), onload("b", ENGINE))
    p.release("b", R, 4.0)
    assert p.grant(4.0)[0].moves == (onload("c", ENGINE),)


def test_heads_of_a_shared_pool_are_tried_oldest_first():
    p = colocated(budget=10, tasks=[("a", 6, 6), ("b", 6, 6)], resident=False)
    p.request("a", T, 0.0)
    p.request("b", R, 1.0)  # only one of the two fits; a asked first, so a goes and b waits for a's release
    assert granted(p) == [("a", T)]
    p.release("a", T, 2.0)
    assert p.grant(2.0)[0].moves == (offload("a", ACTOR), onload("b", ENGINE))


def test_disaggregated_pools_count_separately():
    p = Policy({"g0": GroupSpec.disaggregated(rollout_budget=10, train_budget=20)})
    p.register("a", "g0", 10, 20)
    p.register("b", "g0", 10, 20)  # neither fits beside a's: told to offload both
    assert p.pool("a", ENGINE) == "g0/rollout-pool" and p.pool("a", ACTOR) == "g0/train-pool"
    assert p.used_bytes("g0/rollout-pool") == 10 and p.used_bytes("g0/train-pool") == 20
    p.request("a", T, 0.0)
    p.request("b", R, 0.0)  # evicts a's engine only: a's actor lives in another pool
    grants = {g.task: g.moves for g in p.grant(0.0)}
    assert grants == {"a": (), "b": (offload("a", ENGINE), onload("b", ENGINE))}


def test_register_offloads_what_does_not_fit_and_rejects_impossible_roles():
    p = colocated(budget=25, tasks=[("a", 10, 10)])
    assert p.register("b", "g0", 5, 10) == [offload("b", ACTOR)]  # engine first: ROLLOUT comes first
    assert p.used_bytes("g0/shared") == 25
    assert p.register("c", "g0", 1, 1, resident=False) == []
    with pytest.raises(PolicyError, match=r"task 'd': actor needs 26 B .* 'g0/shared' .* only 25 B;"):
        p.register("d", "g0", 1, 26)
    with pytest.raises(PolicyError, match="already registered"):
        p.register("a", "g0", 1, 1)
    with pytest.raises(PolicyError, match="unknown device group 'g9'"):
        p.register("e", "g9", 1, 1)
    with pytest.raises(PolicyError, match="non-negative int"):
        p.register("f", "g0", -1, 1)
    with pytest.raises(PolicyError, match="train_budget=5 is not used by a colocated group"):
        GroupSpec("colocated", train_budget=5)


def test_snapshot_is_json_safe():
    import json

    p = colocated(budget=25, tasks=[("a", 10, 10)])
    p.request("a", R, 0.0)
    p.grant(0.0)
    snap = json.loads(json.dumps(p.snapshot()))
    assert snap["holders"] == {"g0/rollout": "a"}
    assert snap["tasks"]["a"]["resident"] == ["engine", "actor"]
    assert snap["pools"]["g0/shared"] == {"budget": 25, "used": 20}


# ---- orders: priority and weighted fair share ---------------------------------------------------------------


def _contend(policy: Policy, tasks: list[str], grants: int, hold: float = 1.0) -> list[str]:
    """Every task asks for the rollout lock again as soon as it lets go; each hold lasts `hold` seconds.
    Returns who got the lock, grant by grant."""
    now, order = 0.0, []
    for t in tasks:
        policy.request(t, R, now)
    while len(order) < grants:
        (g,) = policy.grant(now)
        order.append(g.task)
        now += hold
        policy.release(g.task, R, now)
        policy.request(g.task, R, now)
    return order


def test_priority_serves_the_highest_waiting_task_at_the_next_phase_boundary_never_mid_phase():
    p = Policy({"g0": GroupSpec.colocated()}, order="priority")
    for name, prio in (("low", 0), ("mid", 1), ("high", 5)):
        p.register(name, "g0", 1, 1, priority=prio)
    p.request("low", R, 0.0)
    assert [g.task for g in p.grant(0.0)] == ["low"]
    p.request("mid", R, 1.0)
    p.request("high", R, 2.0)
    assert p.grant(2.0) == [] and p.holder(Resource("g0", R)) == "low"  # the holder keeps its phase
    assert p.candidate(Resource("g0", R)) == "high"
    p.release("low", R, 3.0)
    assert [g.task for g in p.grant(3.0)] == ["high"]  # asked after mid, served first
    p.release("high", R, 4.0)
    assert [g.task for g in p.grant(4.0)] == ["mid"]


def test_fair_share_gives_lock_time_in_proportion_to_weights_and_a_late_arrival_starts_level():
    p = Policy({"g0": GroupSpec.colocated()}, order="fair")
    p.register("a", "g0", 1, 1, weight=1.0)
    p.register("b", "g0", 1, 1, weight=3.0)
    order = _contend(p, ["a", "b"], 40)
    assert (order.count("a"), order.count("b")) == (10, 30)  # 1 : 3, as the weights
    # A task arriving later starts level with the least served task, not at zero: after a and b held the lock
    # 5 s each, a newcomer at zero would take the next 5 grants running; level, it takes its third.
    p2 = Policy({"g0": GroupSpec.colocated()}, order="fair")
    for name in "ab":
        p2.register(name, "g0", 1, 1)
    _contend(p2, ["a", "b"], 10)
    p2.register("c", "g0", 1, 1)
    later = []
    now = 100.0
    p2.request("c", R, now)
    for _ in range(6):
        (g,) = p2.grant(now)
        later.append(g.task)
        now += 1
        p2.release(g.task, R, now)
        p2.request(g.task, R, now)
    assert later.count("c") == 2 and later.count("a") == 2 and later.count("b") == 2


def test_no_order_starves_a_waiting_task_beyond_the_stated_bound():
    """Two high-priority tasks hand the lock to each other; the low one is served after being passed over
    starvation_limit times (bound: limit + N - 1 grants)."""
    for order in ("priority", "fair"):
        p = Policy({"g0": GroupSpec.colocated()}, order=order, starvation_limit=3)
        p.register("h1", "g0", 1, 1, priority=9, weight=100.0)
        p.register("h2", "g0", 1, 1, priority=9, weight=100.0)
        p.register("low", "g0", 1, 1, priority=0, weight=0.01)
        p.request("h1", R, 0.0)
        p.grant(0.0)
        p.request("low", R, 0.0)
        seen = _contend_from_held(p, "h1", 10)
        assert seen.index("low") <= 3 + 3 - 1, (order, seen)


def _contend_from_held(policy: Policy, holder: str, grants: int) -> list[str]:
    now, order = 0.0, []
    policy.request("h2", R, now)
    while len(order) < grants:
        now += 1
        policy.release(holder, R, now)
        if holder != "low":
            policy.request(holder, R, now)
        (g,) = policy.grant(now)
        order.append(g.task)
        holder = g.task
    return order


def test_orders_and_weights_are_checked():
    with pytest.raises(PolicyError, match="unknown order 'lottery'"):
        Policy({"g0": GroupSpec.colocated()}, order="lottery")
    p = Policy({"g0": GroupSpec.colocated()}, order="fair")
    with pytest.raises(PolicyError, match="weight must be > 0"):
        p.register("a", "g0", 1, 1, weight=0)


# ---- random schedules -------------------------------------------------------------------------------------


def drain(policy: Policy) -> None:
    """Release every holder and grant until nothing is queued: must terminate with all requests granted."""
    queued = lambda: [r for r in policy.resources() if policy.queue(r)]  # noqa: E731
    for _ in range(2 * len(policy.tasks()) + 2):  # each round grants >= 1 request when none is held
        for r in policy.resources():
            for holder in policy.holders(r):  # every member of a co-batched hold
                policy.release(holder, r.phase, 0.0)
        policy.grant(0.0)
        if not queued():
            return
    raise AssertionError(f"deadlock: {policy.snapshot()}")


def budgets(roles: list[int]) -> st.SearchStrategy[int | None]:
    """None (1 in 4), or the largest role plus a little (constant eviction; in a colocated pool a holder's
    role blocks big onloads), plus up to another role's worth, or plus up to everything resident at once."""
    top, rest = max(roles), sum(roles) - max(roles)
    extra = st.one_of(st.integers(0, 10), st.integers(0, top), st.integers(0, rest))
    return st.one_of(st.none(), *[extra.map(lambda e: top + e)] * 3)


class Schedules(RuleBasedStateMachine):
    """1-8 tasks in 1-3 random groups cycle ROLLOUT -> release -> TRAIN -> release under random budgets.

    The model beside the policy keeps: each task's next phase, queued request ids per resource in
    arrival order, grants per resource, residency rebuilt only from the moves grants return, and (for the
    priority and fair orders) each task's priority, weight and lock seconds per phase, from which it
    predicts every grant's request on its own (`expected`)."""

    ORDER = "fifo"

    @initialize(data=st.data())
    def setup(self, data):
        n_groups = data.draw(st.sampled_from([1, 1, 2, 3]), label="groups")  # mostly one: crowded pools
        n_tasks = data.draw(st.integers(1, 8), label="tasks")
        sizes = st.integers(0, 100)
        self.tasks = {f"t{i}": (f"g{data.draw(st.integers(0, n_groups - 1))}", data.draw(sizes), data.draw(sizes))
                      for i in range(n_tasks)}
        groups = {}
        for g in (f"g{i}" for i in range(n_groups)):
            engines = [e for grp, e, _ in self.tasks.values() if grp == g] or [0]
            actors = [a for grp, _, a in self.tasks.values() if grp == g] or [0]
            # colocated twice as often: only a shared pool makes one slot's holder block the other slot
            if data.draw(st.sampled_from([True, True, False]), label=f"{g} colocated"):
                groups[g] = GroupSpec.colocated(data.draw(budgets(engines + actors)))
            else:
                groups[g] = GroupSpec.disaggregated(data.draw(budgets(engines)), data.draw(budgets(actors)))
        self.limit = data.draw(st.integers(1, 4), label="starvation limit") if self.ORDER != "fifo" else 8
        self.policy = Policy(groups, order=self.ORDER, starvation_limit=self.limit)
        self.resident = set()
        # (task, role) -> tick of its last grant or release: the LRU order evictions must follow
        self.tick, self.last_use = 0, {}
        self.priority = {t: data.draw(st.integers(0, 2), label=f"{t} priority") for t in self.tasks}
        self.weight = {t: data.draw(st.sampled_from([0.5, 1.0, 3.0]), label=f"{t} weight") for t in self.tasks}
        self.usage = {t: dict.fromkeys(Phase, 0.0) for t in self.tasks}
        for name, (g, e, a) in self.tasks.items():
            moves = self.policy.register(name, g, e, a, resident=data.draw(st.booleans()),
                                         priority=self.priority[name], weight=self.weight[name])
            for role in (r for r in Role if self.policy.resident(name, r)):
                self.resident.add((name, role))
                self.touch(name, role)
            assert all(m.task == name and m.action == Action.OFFLOAD for m in moves)
        self.next_phase = dict.fromkeys(self.tasks, R)
        self.queued = {r: [] for r in self.policy.resources()}  # request ids in arrival order
        self.requested = {}  # request id -> (task, resource, grants made on the resource when it arrived)
        self.grants = dict.fromkeys(self.policy.resources(), 0)
        self.holding = {}  # task -> phase
        self.granted_at = {}  # task -> time of its current lease
        self.failed = set()
        self.now = 0

    def touch(self, task, role):
        self.tick += 1
        self.last_use[task, role] = self.tick

    def idle(self):
        waiting = {self.requested[rid][0] for q in self.queued.values() for rid in q}
        return [t for t in self.tasks if t not in self.failed and t not in self.holding and t not in waiting]

    # Time moves in whole seconds, so leases reach exactly the timeout (the boundary `expired` must get right).
    @precondition(lambda self: self.idle())
    @rule(i=st.integers(0, 7), dt=st.integers(0, 3))
    def request(self, i, dt):
        self.now += dt
        idle = self.idle()
        self._request(idle[i % len(idle)])

    @precondition(lambda self: len(self.idle()) > 1)
    @rule(order=st.randoms(use_true_random=False))
    def request_all(self, order):
        """Every idle task asks at once: queues build up, so slots and memory are contended."""
        idle = self.idle()
        order.shuffle(idle)
        for task in idle:
            self._request(task)

    def _request(self, task):
        phase = self.next_phase[task]
        rid = self.policy.request(task, phase, self.now)
        resource = self.policy.resource(task, phase)
        self.queued[resource].append(rid)
        self.requested[rid] = (task, resource, self.grants[resource])

    @precondition(lambda self: self.holding)
    @rule(i=st.integers(0, 7), dt=st.integers(0, 3))
    def release(self, i, dt):
        self.now += dt
        task = sorted(self.holding)[i % len(self.holding)]
        phase = self.holding.pop(task)
        self.policy.release(task, phase, self.now)
        self.usage[task][phase] += max(0.0, self.now - self.granted_at[task]) / self.weight[task]
        self.touch(task, phase.role)
        self.next_phase[task] = T if phase is R else R

    def used(self, pool):
        return sum(self.policy.nbytes(t, r) for t, r in self.resident if self.policy.pool(t, r) == pool)

    @rule()
    def grant(self):
        grants = self.policy.grant(self.now)
        for g in grants:
            assert self.expected(g.resource) == g.request_id, f"{self.ORDER}: granted another request first"
            self.queued[g.resource].remove(g.request_id)
            self.grants[g.resource] += 1
            assert g.task not in self.holding and self.next_phase[g.task] is g.phase
            self.holding[g.task] = g.phase
            self.granted_at[g.task] = self.now
            needed = (g.task, g.phase.role)
            *evictions, last = g.moves or (None,)
            if g.moves:
                assert last == Move(g.task, g.phase.role, Action.ONLOAD) and needed not in self.resident
                pool = self.policy.pool(g.task, g.phase.role)
                budget = self.policy.budget(pool)
                protected = {(t, ph.role) for t, ph in self.holding.items() if t != g.task}
                used, need = self.used(pool), self.policy.nbytes(*needed)
                freed = sum(self.policy.nbytes(m.task, m.role) for m in evictions[:-1])
                assert not evictions or used - freed + need > budget, "needless eviction"
                lru = sorted((k for k in self.resident if k not in protected and self.policy.pool(*k) == pool
                              and self.policy.nbytes(*k) > 0),  # a role of no bytes makes no room
                             key=self.last_use.__getitem__)
                assert [(m.task, m.role) for m in evictions] == lru[:len(evictions)], "not least recently used"
                for m in evictions:  # only idle roles of the same pool, and only when needed to fit
                    key = (m.task, m.role)
                    assert m.action == Action.OFFLOAD and key in self.resident and key not in protected
                    assert self.policy.pool(m.task, m.role) == pool
                    self.resident.remove(key)
                self.resident.add(needed)
            else:
                assert needed in self.resident
            self.touch(*needed)
        self.check_maximal()
        # Across a pool's two slots: a candidate left waiting for memory was never passed by a younger request.
        for r, q in self.queued.items():
            if q and self.policy.holder(r) is None:
                head = self.expected(r)
                pool = self.policy.pool(self.requested[head][0], r.phase.role)
                assert all(g.request_id < head for g in grants if self.policy.pool(g.task, g.phase.role) == pool)

    def expected(self, resource):
        """The request the order serves next on `resource`: starving ones (passed over `limit` times) oldest
        first, else the oldest (fifo), the highest priority (priority), the least lock time per weight (fair)."""
        q = self.queued[resource]
        starving = [rid for rid in q if self.grants[resource] - self.requested[rid][2] >= self.limit]
        if starving or self.ORDER == "fifo":
            return (starving or q)[0]
        task = lambda rid: self.requested[rid][0]  # noqa: E731
        if self.ORDER == "priority":
            return min(q, key=lambda rid: (-self.priority[task(rid)], rid))
        return min(q, key=lambda rid: (self.usage[task(rid)][resource.phase], rid))

    def check_maximal(self):
        """After grant(), no free resource's head could have been admitted."""
        protected = {(t, ph.role) for t, ph in self.holding.items()}
        for r, q in self.queued.items():
            if q and self.policy.holder(r) is None:
                task, role = self.requested[self.expected(r)][0], r.phase.role
                assert self.policy.candidate(r) == task
                pool = self.policy.pool(task, role)
                budget = self.policy.budget(pool)
                idle = sum(self.policy.nbytes(t, ro) for t, ro in self.resident
                           if (t, ro) not in protected and self.policy.pool(t, ro) == pool)
                assert (task, role) not in self.resident and budget is not None
                assert self.used(pool) - idle + self.policy.nbytes(task, role) > budget

    @precondition(lambda self: len(self.failed) < len(self.tasks) - 1)
    @rule(i=st.integers(0, 7), coin=st.integers(0, 4))
    def fail(self, i, coin):
        if coin:  # failures are rare in practice; keep most of the schedule about locks and memory
            return
        task = sorted(self.tasks)[i % len(self.tasks)]
        self.policy.fail(task)
        self.failed.add(task)
        self.holding.pop(task, None)
        self.resident -= {(task, r) for r in Role}
        for q in self.queued.values():
            q[:] = [rid for rid in q if self.requested[rid][0] != task]

    @rule(timeout=st.integers(0, 10))
    def expired(self, timeout):
        expected = {t for t in self.holding if self.now - self.granted_at[t] > timeout}
        assert set(self.policy.expired(self.now, timeout)) == expected

    @invariant()
    def budgets_and_accounting(self):
        for pool in self.policy.pools():
            budget = self.policy.budget(pool)
            used = self.policy.used_bytes(pool)
            assert budget is None or used <= budget, f"{pool}: {used} > {budget}"
            assert used == sum(self.policy.nbytes(t, r) for t, r in self.resident if self.policy.pool(t, r) == pool)
        assert self.resident == {(t, r) for t in self.tasks for r in Role if self.policy.resident(t, r)}

    @invariant()
    def locks(self):
        holders = [self.policy.holder(r) for r in self.policy.resources()]
        held = [h for h in holders if h is not None]
        assert len(held) == len(set(held)), "a task holds two locks"
        assert sorted(held) == sorted(self.holding)
        for task, phase in self.holding.items():
            assert self.policy.holder(self.policy.resource(task, phase)) == task
            assert (task, phase.role) in self.resident, "a holder's role was evicted"
        for r, q in self.queued.items():
            assert self.policy.queue(r) == [self.requested[rid][0] for rid in q]

    @invariant()
    def bounded_waiting(self):
        """The stated bound (rlsched/scheduling/policy.py): FIFO overtaken fewer than N times; any order, at most
        starvation_limit + N - 1 times."""
        n = len(self.tasks)
        bound = n if self.ORDER == "fifo" else self.limit + n
        for q in self.queued.values():
            for rid in q:
                _, resource, at = self.requested[rid]
                assert self.grants[resource] - at < bound, f"a request was overtaken {bound} times or more"

    @invariant()
    def no_deadlock(self):
        drain(copy.deepcopy(self.policy))


class PrioritySchedules(Schedules):
    ORDER = "priority"


class FairSchedules(Schedules):
    ORDER = "fair"


TestSchedules = Schedules.TestCase
TestSchedules.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
TestPrioritySchedules = PrioritySchedules.TestCase
TestPrioritySchedules.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestFairSchedules = FairSchedules.TestCase
TestFairSchedules.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
