"""Co-batched ROLLOUT and TRAIN in the pure policy: a base group's waiting tasks share one hold, charged by rows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsched.scheduling.policy import CoBatch, GroupSpec, Phase, Policy, PolicyError, Resource, Role
from tests.test_policy import drain

R, T = Phase.ROLLOUT, Phase.TRAIN
ROLLOUT = Resource("g0", R)


def lora_group(names="abc", *, rows=4, capacity=8, budget=None, order="fifo", extra=(), engine=1):
    """LoRA tasks of one base group (engine bytes `engine`: the adapter), then `extra` full-weight tasks."""
    policy = Policy({"g0": GroupSpec.colocated(budget)}, order=order)
    for name in names:
        policy.register(name, "g0", engine, 1, cobatch=CoBatch("base", rows, capacity))
    for name, engine_bytes, actor_bytes in extra:
        policy.register(name, "g0", engine_bytes, actor_bytes)
    return policy


def test_waiting_tasks_of_a_base_group_share_one_hold_up_to_the_engines_batch():
    p = lora_group("abc", rows=4, capacity=8, extra=[("full", 1, 1)])
    ids = {t: p.request(t, R, 0.0) for t in ("a", "full", "b", "c")}
    grants = p.grant(0.0)
    # a is served first (fifo); b joins (4 + 4 rows <= 8), c would make 12; full is of no base group
    assert [(g.task, g.cohort, g.hold) for g in grants] == [("a", ("a", "b"), ids["a"]), ("b", ("a", "b"), ids["a"])]
    assert p.holders(ROLLOUT) == ["a", "b"] and p.holder(ROLLOUT) == "a"
    assert p.queue(ROLLOUT) == ["full", "c"]
    assert p.snapshot()["holders"] == {"g0/rollout": "a,b"}
    # the lock is free only when both let go
    p.release("a", R, 1.0)
    assert p.grant(1.0) == [] and p.holders(ROLLOUT) == ["b"]
    p.release("b", R, 1.0)
    assert [(g.task, g.cohort) for g in p.grant(1.0)] == [("full", ())]  # alone: no cohort


def test_a_hold_is_charged_to_its_members_by_their_share_of_the_rows():
    p = Policy({"g0": GroupSpec.colocated(None)}, order="fair")
    p.register("a", "g0", 1, 1, cobatch=CoBatch("base", 12, 16))
    p.register("b", "g0", 1, 1, cobatch=CoBatch("base", 4, 16), weight=2.0)
    p.request("a", R, 0.0)
    p.request("b", R, 0.0)
    assert [g.task for g in p.grant(0.0)] == ["a", "b"]
    p.release("a", R, 8.0)
    p.release("b", R, 8.0)
    usage = p.snapshot()["tasks"]
    # 8 s of hold: a ran 12 of 16 rows (6 s), b 4 of 16 (2 s) at weight 2 (1 s per weight)
    assert usage["a"]["lock_s_per_weight"]["rollout"] == pytest.approx(6.0)
    assert usage["b"]["lock_s_per_weight"]["rollout"] == pytest.approx(1.0)


def test_joiners_follow_the_order_and_a_request_during_a_hold_waits_for_the_next():
    p = Policy({"g0": GroupSpec.colocated(None)}, order="priority")
    for t, prio in (("a", 0), ("b", 1), ("c", 5), ("d", 3)):
        p.register(t, "g0", 1, 1, priority=prio, cobatch=CoBatch("base", 4, 8))
    for t in "abc":
        p.request(t, R, 0.0)
    assert [g.task for g in p.grant(0.0)] == ["c", "b"]  # c leads, b outranks a for the second place
    p.request("d", R, 0.5)
    assert p.grant(0.5) == [] and p.holders(ROLLOUT) == ["c", "b"]  # d does not join a hold under way
    p.release("c", R, 1.0)
    p.release("b", R, 1.0)
    assert [g.task for g in p.grant(1.0)] == ["d", "a"]


def test_different_bases_and_the_train_phase_never_share():
    p = Policy({"g0": GroupSpec.colocated(None)})
    p.register("a", "g0", 1, 1, cobatch=CoBatch("base-1", 4, 64))
    p.register("b", "g0", 1, 1, cobatch=CoBatch("base-2", 4, 64))
    p.register("c", "g0", 1, 1, cobatch=CoBatch("base-1", 4, 64))
    for t in "ab":
        p.request(t, R, 0.0)
    assert [g.task for g in p.grant(0.0)] == ["a"]
    p.release("a", R, 1.0)
    p.request("a", T, 1.0)
    assert [g.task for g in p.grant(1.0)] == ["b", "a"]
    p.release("b", R, 2.0)
    p.request("c", R, 2.0)
    p.release("a", T, 2.0)
    p.request("a", R, 2.0)
    p.request("b", T, 2.0)
    grants = p.grant(2.0)
    assert {(g.task, g.phase, g.cohort) for g in grants} == {("c", R, ("c", "a")), ("a", R, ("c", "a")),
                                                           ("b", T, ())}


def test_a_joiner_is_admitted_for_memory_like_any_grant_and_never_evicts_a_members_engine():
    p = Policy({"g0": GroupSpec.colocated(7)})
    for t in "ab":
        p.register(t, "g0", 1, 1, cobatch=CoBatch("base", 4, 16))
    p.register("full", "g0", 3, 0)
    p.register("c", "g0", 1, 1, cobatch=CoBatch("base", 4, 16))  # registered last: created on host
    assert not p.resident("c", Role.ENGINE)
    for t in "abc":
        p.request(t, R, 0.0)
    grants = p.grant(0.0)
    assert [g.task for g in grants] == ["a", "b", "c"]
    assert grants[2].moves[-1].task == "c" and str(grants[2].moves[-1].action) == "onload"
    assert all(m.role is not Role.ENGINE or m.task not in "abc" for m in grants[2].moves[:-1])
    assert all(p.resident(t, Role.ENGINE) for t in "abc") and p.used_bytes("g0/shared") <= 7


def test_a_joiner_that_does_not_fit_in_memory_is_left_for_the_next_hold():
    p = Policy({"g0": GroupSpec.colocated(2)})  # two adapters fit; the members' engines are protected
    for t in "abc":
        p.register(t, "g0", 1, 0, cobatch=CoBatch("base", 4, 16))
    for t in "abc":
        p.request(t, R, 0.0)
    assert [(g.task, g.cohort) for g in p.grant(0.0)] == [("a", ("a", "b")), ("b", ("a", "b"))]
    assert p.queue(ROLLOUT) == ["c"]
    p.release("a", R, 1.0)
    p.release("b", R, 1.0)
    (g,) = p.grant(1.0)
    assert g.task == "c" and [(m.task, str(m.action)) for m in g.moves] == [("a", "offload"), ("c", "onload")]


def test_a_failed_or_expired_member_lets_the_others_keep_the_hold():
    p = lora_group("abc", rows=2, capacity=8)
    for t in "abc":
        p.request(t, R, 0.0)
    assert len(p.grant(0.0)) == 3
    assert sorted(p.expired(10.0, 5.0)) == ["a", "b", "c"]
    p.fail("b")
    assert p.holders(ROLLOUT) == ["a", "c"] and p.grant(1.0) == []
    p.release("a", R, 1.0)
    p.release("c", R, 1.0)
    assert p.holders(ROLLOUT) == []


def test_train_holds_are_shared_by_their_own_key_and_capacity_and_charged_by_rows():
    """TRAIN co-batches by its own key (tasks whose update is the same program): a task may share rollouts with
    its whole base group and train with only some of it."""
    p = Policy({"g0": GroupSpec.colocated(None)}, order="fair")
    trains = {"a": CoBatch("same-update", 8, 16, T), "b": CoBatch("same-update", 8, 16, T),
              "c": CoBatch("other-lr", 8, 16, T), "d": CoBatch("same-update", 8, 16, T)}
    for t in "abcd":
        p.register(t, "g0", 1, 1, cobatch=(CoBatch("base", 4, 64), trains[t]))
    for t in "abcd":
        p.request(t, R, 0.0)
    assert {g.cohort for g in p.grant(0.0)} == {("a", "b", "c", "d")}  # one rollout hold: the whole base group
    for t in "abcd":
        p.release(t, R, 1.0)
        p.request(t, T, 1.0)
    grants = p.grant(1.0)
    # a leads; b joins (8 + 8 <= 16); d would make 24; c's update is another program
    assert [(g.task, g.cohort) for g in grants] == [("a", ("a", "b")), ("b", ("a", "b"))]
    assert p.holders(Resource("g0", T)) == ["a", "b"]
    p.release("a", T, 5.0)
    p.release("b", T, 5.0)
    usage = p.snapshot()["tasks"]
    assert usage["a"]["lock_s_per_weight"]["train"] == pytest.approx(2.0)  # 4 s, half the rows each
    assert usage["a"]["cobatch"] == {"rollout": "base", "train": "same-update"}
    assert [g.task for g in p.grant(5.0)] == ["c"]  # the fairest next (fair order: c and d have 0 s; c is older)


def test_cobatch_is_checked():
    with pytest.raises(PolicyError, match="rows and capacity must be positive"):
        CoBatch("base", 0, 8)
    p = Policy({"g0": GroupSpec.colocated(None)})
    with pytest.raises(PolicyError, match="at most one CoBatch per phase"):
        p.register("a", "g0", 1, 1, cobatch=(CoBatch("x", 1, 2), CoBatch("y", 1, 2)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=60),
       st.integers(2, 6), st.sampled_from(["fifo", "priority", "fair"]), st.one_of(st.none(), st.integers(3, 8)))
def test_random_schedules_keep_holds_within_one_base_group_and_the_batch(steps, capacity, order, budget):
    """Tasks of two base groups and full-weight ones cycle ROLLOUT -> TRAIN at random: a hold of several is one base
    group's rollout within the batch, or one train key's update within its capacity; every holder's role is
    resident, budgets hold, and the schedule drains."""
    p = Policy({"g0": GroupSpec.colocated(budget)}, order=order)
    kinds = {"a": "x", "b": "x", "c": "x", "d": "y", "e": "y", "f": None}
    trains = {"a": "x1", "b": "x1", "c": "x2", "d": "y1", "e": "y1"}  # c's update differs from a's and b's
    for t, key in kinds.items():
        batches = () if key is None else (CoBatch(key, 1 + ord(t) % 2, capacity),
                                          CoBatch(trains[t], 1 + ord(t) % 2, capacity, T))
        p.register(t, "g0", 1 if key else 2, 1, priority=ord(t) % 3, cobatch=batches)
    holding, now = {}, 0.0
    for i, action in steps:
        now += 1
        task = "abcdef"[i]
        if task in holding and action:
            phase = holding.pop(task)
            p.release(task, phase, now)
        elif task not in holding and p.snapshot()["tasks"][task]["waiting"] is None:
            p.request(task, R if action % 2 else T, now)
        for g in p.grant(now):
            holding[g.task] = g.phase
        for r in p.resources():
            members = p.holders(r)
            if len(members) > 1:
                keys = {(kinds if r.phase is R else trains).get(m) for m in members}
                assert len(keys) == 1 and None not in keys
                assert sum(1 + ord(m) % 2 for m in members) <= capacity
            for m in members:
                assert holding[m] is r.phase and p.resident(m, r.phase.role)
        used, limit = p.used_bytes("g0/shared"), p.budget("g0/shared")
        assert limit is None or used <= limit
    drain(p)
