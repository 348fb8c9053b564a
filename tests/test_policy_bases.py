"""Shared bases pinned in the policy (Policy.register(..., bases=)): a LoRA base group's one copy of its base is
counted once while any live task reads it, never evicted, and a new one makes room for itself when it arrives."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsched.scheduling.policy import GroupSpec, Phase, Policy, PolicyError, Role
from rlsched.scheduling.scheduler import Scheduler
from tests.test_policy import drain

R, T = Phase.ROLLOUT, Phase.TRAIN
POOL = "g0/shared"


def reads(key="base", n=4):
    """A colocated LoRA task's engine and actor both read base `key` (one copy: one pool)."""
    return ((key, Role.ENGINE, n), (key, Role.ACTOR, n))


def test_a_base_group_s_base_is_counted_once_and_survives_the_eviction_of_every_reader():
    p = Policy({"g0": GroupSpec.colocated(10)})
    for t in "ab":
        p.register(t, "g0", 1, 1, bases=reads())
    assert p.used_bytes(POOL) == 4 + 2 * 2  # the base once, each task's adapters
    assert p.snapshot()["pools"][POOL]["bases"] == {"base": 4}
    p.register("full", "g0", 6, 0)  # 8 + 6 > 10: created on host
    assert not p.resident("full", Role.ENGINE)
    p.request("full", R, 0.0)
    (g,) = p.grant(0.0)
    # every LoRA role goes (4 bytes of them), and 4 + 6 fit: the base's 4 bytes were never the policy's to free
    assert sorted((m.task, str(m.role)) for m in g.moves[:-1]) == [("a", "actor"), ("a", "engine"),
                                                                   ("b", "actor"), ("b", "engine")]
    assert p.used_bytes(POOL) == 4 + 6 <= 10


def test_a_role_must_fit_beside_the_pool_s_bases():
    p = Policy({"g0": GroupSpec.colocated(10)})
    p.register("a", "g0", 1, 1, bases=reads(n=4))
    with pytest.raises(PolicyError, match="engine needs 7 B beside 4 B of shared bases that never offload"):
        p.register("full", "g0", 7, 0)
    with pytest.raises(PolicyError, match="beside 8 B of shared bases"):  # a second base leaves 2 bytes
        p.register("c", "g0", 3, 1, bases=reads("other", n=4))
    assert "c" not in p.tasks() and p.used_bytes(POOL) == 6  # a refused task leaves nothing counted


def test_a_new_base_evicts_idle_roles_and_never_a_held_one():
    p = Policy({"g0": GroupSpec.colocated(10)})
    p.register("f1", "g0", 3, 3)
    p.register("f2", "g0", 2, 2)
    p.request("f1", T, 0.0)
    assert [g.task for g in p.grant(0.0)] == ["f1"]  # f1's actor is held
    moves = p.register("a", "g0", 1, 1, bases=reads(n=4))
    # 10 used, the base needs 4: idle roles go, least recently used first (f1's actor is protected)
    assert [(m.task, str(m.role), str(m.action)) for m in moves[:2]] == [("f1", "engine", "offload"),
                                                                         ("f2", "engine", "offload")]
    assert p.resident("f1", Role.ACTOR) and p.used_bytes(POOL) <= 10


def test_the_last_reader_s_end_unpins_the_base():
    p = Policy({"g0": GroupSpec.colocated(None)})
    p.register("a", "g0", 1, 1, bases=reads())
    p.register("b", "g0", 1, 1, bases=reads())
    p.fail("a")
    assert p.used_bytes(POOL) == 4 + 2
    p.fail("b")
    assert p.used_bytes(POOL) == 0 and "bases" not in p.snapshot()["pools"][POOL]
    p.forget("b")
    p.register("b", "g0", 1, 1, bases=reads())  # a reader again: pinned again
    assert p.used_bytes(POOL) == 4 + 2


def test_disaggregated_bases_are_pinned_in_their_role_s_pool():
    p = Policy({"g0": GroupSpec.disaggregated(10, 10)})
    p.register("a", "g0", 1, 1, bases=(("engine-base", Role.ENGINE, 3), ("actor-base", Role.ACTOR, 5)))
    snap = p.snapshot()["pools"]
    assert {pool: s.get("bases") for pool, s in snap.items()} == {"g0/rollout-pool": {"engine-base": 3},
                                                                  "g0/train-pool": {"actor-base": 5}}
    assert p.used_bytes("g0/rollout-pool") == 4 and p.used_bytes("g0/train-pool") == 6


def test_the_scheduler_admits_a_task_whose_new_base_evicts_once_the_victims_have_offloaded():
    """rlsched.service.server admits a LoRA task with its bases: `admit` returns after the evicted roles' drivers
    offloaded them, so the task's roles load its base into the room made."""
    log = []

    class Driver:
        def __init__(self, name):
            class _Move:
                @staticmethod
                async def remote(role, action):
                    await asyncio.sleep(0.05)
                    log.append((name, role, action))

            self.move = _Move

    async def scenario():
        policy = Policy({"g0": GroupSpec.colocated(10)})
        policy.register("full", "g0", 4, 4)
        s = Scheduler(policy)
        s.register_driver("full", Driver("full"))
        own = await s.admit("a", "g0", 1, 1, bases=[("base", "engine", 4), ("base", "actor", 4)])
        assert log == [("full", "engine", "offload")]  # done before admit returned
        assert own == []  # a's adapters fit beside the base
        assert policy.used_bytes(POOL) == 4 + 4 + 2

    asyncio.run(scenario())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), min_size=1, max_size=60),
       st.sampled_from(["fifo", "priority", "fair"]), st.one_of(st.none(), st.integers(7, 12)))
def test_random_schedules_count_each_base_once_and_stay_within_the_budget(steps, order, budget):
    """LoRA tasks of two bases and a full-weight one cycle ROLLOUT -> TRAIN: the pool's bytes are every resident
    role's plus each base read by a live task, once; the budget holds; the schedule drains; ending a task unpins
    its base when it was the last reader."""
    p = Policy({"g0": GroupSpec.colocated(budget)}, order=order)
    base_of = {"a": "x", "b": "x", "c": "y", "d": "y", "e": None}
    size = {"x": 3, "y": 2}
    for t, key in base_of.items():
        p.register(t, "g0", 1 if key else 2, 1, bases=reads(key, size[key]) if key else ())
    holding, live, now = {}, set(base_of), 0.0
    for i, action in steps:
        now += 1
        task = "abcde"[i]
        if task not in live:
            continue
        if task in holding and action == 3:
            p.release(task, holding.pop(task), now)
            p.fail(task)  # it ended
            live.discard(task)
        elif task in holding and action:
            p.release(task, holding.pop(task), now)
        elif task not in holding and p.snapshot()["tasks"][task]["waiting"] is None:
            p.request(task, R if action % 2 else T, now)
        for g in p.grant(now):
            holding[g.task] = g.phase
        roles = sum(p.nbytes(t, r) for t in live for r in Role if p.resident(t, r))
        bases = sum(size[k] for k in {base_of[t] for t in live} if k)
        assert p.used_bytes(POOL) == roles + bases
        assert budget is None or p.used_bytes(POOL) <= budget
    drain(p)
