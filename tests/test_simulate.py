"""The simulator, against makespans derived by hand (arithmetic in the comments). Pure: no Ray, no JAX.

Times are chosen as binary fractions (0.5, 0.125, ...) so the simulated sums are exact.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.simulate import (
    PUBLISHED,
    GiB,
    PhaseProfile,
    ideal_bound,
    main,
    measured_makespan,
    profile_from_metrics,
    project,
    simulate,
    validate,
)

BALANCED = PhaseProfile(rollout_s=1.0, train_s=1.0, lock_rtt_s=0.0)


def grants(result, resource: str) -> list[tuple[float, str]]:
    return [(e.time, e.task) for e in result.events if e.kind == "grant" and e.resource == resource]


# ---- one task ----------------------------------------------------------------------------------------------

def test_one_task_makespan_is_steps_times_the_solo_step():
    p = PhaseProfile(rollout_s=1.0, reward_s=0.5, train_s=2.0, sync_s=0.25, lock_rtt_s=0.125)
    r = simulate(p, 1, steps=3)
    # step = R + reward + T + 2 rtt = (1 + 0.25) + 0.5 + 2 + 2 * 0.125 = 4.0; step 1 skips the sync (the engine
    # starts with the actor's weights): 3 * 4.0 - 0.25 = 11.75
    assert p.step_s == 4.0
    assert r.makespan_s == pytest.approx(11.75)
    assert r.sequential_s == pytest.approx(11.75) and r.speedup == pytest.approx(1.0)
    assert r.lock_wait_s == 0.0 and r.moves == 0
    # rollout lock held per step: sync + generate + rtt/2 = (0 + 1 + 0.0625) + 2 * (0.25 + 1 + 0.0625) = 3.6875
    assert r.utilisation["g0/rollout"] == pytest.approx(3.6875 / 11.75)
    # train lock: 3 * (2 + 0.0625) = 6.1875
    assert r.utilisation["g0/train"] == pytest.approx(6.1875 / 11.75)


# ---- two tasks, disaggregated --------------------------------------------------------------------------------

def test_two_balanced_tasks_approach_2x():
    r = simulate(BALANCED, 2, steps=3)
    # A: roll [0,1] train [1,2] roll [2,3] train [3,4] roll [4,5] train [5,6] -> 6
    # B waits for the rollout slot: roll [1,2] train [2,3] ... train [6,7] -> 7
    assert r.finish_s == pytest.approx((6.0, 7.0))
    # sequential: 2 tasks x 3 steps x 2 s = 12 -> 12 / 7
    assert r.sequential_s == pytest.approx(12.0)
    assert r.speedup == pytest.approx(12 / 7)
    assert r.lock_wait_s == pytest.approx(1.0)  # only B's first rollout waited, 1 s
    # S steps: makespan 2S + 1, speedup 4S / (2S + 1) -> 2: 200 / 101 at S = 50
    assert simulate(BALANCED, 2, steps=50).speedup == pytest.approx(200 / 101)


def test_two_balanced_tasks_with_lock_round_trips():
    q = 1 / 16  # one message; rtt = 4q = 0.25
    r = simulate(dataclasses.replace(BALANCED, lock_rtt_s=4 * q), 2, steps=3)
    # A never waits: its period is the solo step 2 + 2 rtt = 2.5, so it ends at 3 * 2.5 = 7.5.
    # B's rollout is granted when A's release reaches the scheduler (1 + 3q) and from then on B runs
    # at the same period, shifted by A's rollout hold (1 + 2q): it ends at 7.5 + 1 + 2q = 8.625.
    assert r.finish_s == pytest.approx((7.5, 8.625))
    assert r.sequential_s == pytest.approx(15.0)  # 2 x 3 x 2.5


def test_reward_on_the_host_caps_two_tasks_at_n_over_step():
    p = PhaseProfile(rollout_s=1.0, reward_s=0.5, train_s=1.0, lock_rtt_s=0.0)
    r = simulate(p, 2, steps=3)
    # A: roll [0,1] reward [1,1.5] train [1.5,2.5], then every 2.5 s -> 7.5.
    # B: roll [1,2] reward -> 2.5 train [2.5,3.5], the same period, 1 s later -> 8.5
    assert r.finish_s == pytest.approx((7.5, 8.5))
    # bound: min(1 / max(R, T), N / (R + reward + T)) = min(1, 2 / 2.5) = 0.8 steps/s
    assert ideal_bound(p, 2) == pytest.approx(0.8)
    assert r.steps_per_s == pytest.approx(6 / 8.5) and r.steps_per_s < 0.8


def test_unbalanced_phases_are_capped_by_the_slower_resource():
    p = PhaseProfile(rollout_s=1.0, train_s=3.0, lock_rtt_s=0.0)
    r = simulate(p, 2, steps=3)
    # The train slot is busy from t = 1 on: 2 tasks x 3 steps x 3 s = 18 s -> makespan 1 + 18 = 19
    assert r.makespan_s == pytest.approx(19.0)
    assert r.utilisation["g0/train"] == pytest.approx(18 / 19)
    assert ideal_bound(p, 2) == pytest.approx(1 / 3)  # min(1 / 3, 2 / 4)
    assert r.steps_per_s == pytest.approx(6 / 19) and r.steps_per_s <= 1 / 3
    # More tasks do not help: 8 tasks still 1/3 steps/s at most
    big = simulate(p, 8, steps=5)
    assert big.steps_per_s <= 1 / 3 and big.efficiency > 0.95


def test_groups_add_throughput():
    # 4 tasks on 2 groups = 2 independent copies of the 2-task case: makespan 2S + 1 = 7
    r = simulate(BALANCED, 4, steps=3, groups=2)
    assert r.makespan_s == pytest.approx(7.0)
    assert sorted(r.utilisation) == ["g0/rollout", "g0/train", "g1/rollout", "g1/train"]
    assert ideal_bound(BALANCED, 4, groups=2) == pytest.approx(2 * 1.0)  # 2 x min(1/1, 2/2)


# ---- colocated --------------------------------------------------------------------------------------------------

def test_colocated_slots_share_the_devices():
    # shared_speed 0.5: while A trains and B rolls out, each goes at half speed.
    # A: roll [0,1]; then A train and B roll together [1,3]; A roll + B train [3,5]; ... A's 2S-th phase ends
    # at 1 + 2 (2S - 1) = 4S - 1 = 11 (S = 3); B's last train then runs alone [11,12]: 12 s, the same as
    # sequential (2 x 6): saturated shared devices gain nothing from overlap.
    r = simulate(BALANCED, 2, steps=3, placement="colocated")
    assert r.finish_s == pytest.approx((11.0, 12.0))
    assert r.speedup == pytest.approx(1.0)
    assert ideal_bound(BALANCED, 2, placement="colocated") == pytest.approx(0.5)  # 2 tasks / (2 s of work at 1x)
    # shared_speed 1.0: no contention, the same as disaggregated (2S + 1 = 7)
    assert simulate(BALANCED, 2, steps=3, placement="colocated", shared_speed=1.0).makespan_s == pytest.approx(7.0)


def test_colocated_tight_budget_forces_moves_and_charges_them():
    p = PhaseProfile(rollout_s=1.0, train_s=1.0, lock_rtt_s=0.0, engine_bytes=10, actor_bytes=10,
                     engine_onload_s=0.5, engine_offload_s=0.25, actor_onload_s=0.125, actor_offload_s=0.0625)
    free = simulate(p, 1, steps=3, placement="colocated")
    assert free.makespan_s == pytest.approx(6.0) and free.moves == 0
    r = simulate(p, 1, steps=3, placement="colocated", budget_bytes=15)
    # register: the engine fits (10 <= 15), the actor doesn't: offload actor 0.0625 before step 1.
    # step 1: rollout needs nothing; train evicts the idle engine 0.25 and onloads the actor 0.125.
    # steps 2, 3: rollout evicts actor 0.0625 + onloads engine 0.5; train 0.25 + 0.125 again.
    # moves: 1 + 2 + 2 x 4 = 11 (5 onloads, 6 offloads); added: 0.0625 + 0.375 + 2 x (0.5625 + 0.375) = 2.3125
    assert (r.moves, r.onloads, r.offloads) == (11, 5, 6)
    assert r.switch_s == pytest.approx(2.3125)
    assert r.makespan_s == pytest.approx(6.0 + 2.3125)
    moves = [(e.detail["role"], e.detail["action"]) for e in r.events if e.kind == "move"]
    assert moves[:3] == [("actor", "offload"), ("engine", "offload"), ("actor", "onload")]
    assert r.peak_used["g0/shared"] == 10


def test_simulate_never_exceeds_the_budget_and_evicts_other_tasks():
    sizes = [(6, 4), (5, 5), (3, 7), (8, 2)]  # (engine, actor) bytes; budget 12: at most ~2 roles resident
    profiles = [PhaseProfile(rollout_s=1.0 + i / 4, train_s=1.5 - i / 8, reward_s=0.25, lock_rtt_s=0.0,
                             engine_bytes=e, actor_bytes=a, engine_onload_s=0.125, engine_offload_s=0.0625,
                             actor_onload_s=0.125, actor_offload_s=0.0625) for i, (e, a) in enumerate(sizes)]
    for placement in ("colocated", "disaggregated"):
        budget = 12 if placement == "colocated" else 10
        r = simulate(profiles, 4, steps=6, placement=placement, budget_bytes=budget)
        checked = 0
        for e in r.events:
            if e.kind == "grant":
                assert all(used <= budget for used in e.detail["used"].values()), (placement, e)
                checked += 1
        assert checked == 2 * 4 * 6  # every grant of 4 tasks x 6 steps x 2 phases was checked
        assert max(r.peak_used.values()) <= budget
        evictions = [e for e in r.events if e.kind == "move" and e.detail["action"] == "offload"
                     and e.task != e.detail["grantee"]]
        assert evictions, placement  # memory pressure was real: other tasks' idle roles were evicted


# ---- FIFO --------------------------------------------------------------------------------------------------------

def test_grants_follow_request_order_per_resource():
    r = simulate(BALANCED, 3, steps=4)
    # All three ask for the rollout slot at t = 0, in task order: granted at 0, 1, 2.
    assert grants(r, "g0/rollout")[:3] == [(0.0, "t0"), (1.0, "t1"), (2.0, "t2")]
    for resource in ("g0/rollout", "g0/train"):
        requests = [e.task for e in r.events if e.kind == "request" and e.resource == resource]
        assert [task for _, task in grants(r, resource)] == requests  # FIFO: grant order = arrival order
        assert len(requests) == 12


# ---- profiles ------------------------------------------------------------------------------------------------------

def rows(rollout, reward, train, lock_wait, **extra):
    out = []
    for i in range(len(rollout)):
        row = {"time/rollout_s": rollout[i], "time/reward_s": reward[i], "time/train_s": train[i],
               "time/lock_wait_s": lock_wait[i]}
        out.append({**row, **{f"time/{k}": v[i] for k, v in extra.items()}})
    return out


def test_profile_from_metrics_takes_medians_after_warmup():
    metrics = rows(rollout=[90, 80, 0.5, 0.3, 0.4], reward=[5, 5, 0.05, 0.01, 0.03], train=[70, 60, 0.6, 0.8, 0.7],
                   lock_wait=[1, 1, 0.02, 0.02, 0.02], sync_s=[9, 9, 0.1, 0.1, 0.1])
    p = profile_from_metrics(metrics)  # steps 1-2 (compile) are left out
    assert p.lock_rtt_s == pytest.approx(0.02)  # alone, lock wait = the two acquires' halves = one rtt
    assert p.sync_s == pytest.approx(0.1)
    # rollout: median(0.5 - 0.1, 0.3 - 0.1, 0.4 - 0.1) = 0.3, minus the release's half round trip 0.01
    assert p.rollout_s == pytest.approx(0.29)
    assert p.train_s == pytest.approx(0.69)  # median(0.6, 0.8, 0.7) - 0.01
    assert p.reward_s == pytest.approx(0.03)
    with pytest.raises(ValueError, match="all within warmup=2"):
        profile_from_metrics(metrics[:2])


def test_profile_from_metrics_round_trips_the_solo_step():
    # A solo run measuring step = rollout + reward + train + lock wait = 0.4 + 0.03 + 0.7 + 0.32 = 1.45, where
    # the lock wait holds the acquires' round trip 0.02 and the task's moves (onload 0.3 split 2:1 by bytes)
    metrics = rows(rollout=[0.4] * 4, reward=[0.03] * 4, train=[0.7] * 4, lock_wait=[0.32] * 4,
                   onload_s=[0.3] * 4, offload_s=[0.0] * 4)
    p = profile_from_metrics(metrics, engine_bytes=2, actor_bytes=1)
    assert p.lock_rtt_s == pytest.approx(0.02)
    assert (p.engine_onload_s, p.actor_onload_s) == (pytest.approx(0.2), pytest.approx(0.1))
    # the simulator's solo step without moves: 1.45 - 0.3 of moves = 1.15
    assert p.step_s == pytest.approx(1.15)


def test_profile_from_metrics_keeps_the_drivers_other_work_and_a_task_alone_steps_at_its_measured_rate():
    # Steps end 1.5 s apart where their phases, rewards and lock waits add up to 0.4 + 0.03 + 0.7 + 0.02 = 1.15:
    # the driver's other 0.35 s a step (prompts, batches, metrics) is host_s, under no lock
    ends = [10.0, 11.5, 13.0, 14.5, 16.0, 17.5]
    metrics = rows(rollout=[0.4] * 6, reward=[0.03] * 6, train=[0.7] * 6, lock_wait=[0.02] * 6, end_unix=ends)
    p = profile_from_metrics(metrics)
    assert p.host_s == pytest.approx(0.35) and p.step_s == pytest.approx(1.5)
    assert simulate(p, 1, steps=20).steps_per_s == pytest.approx(1 / 1.5, rel=1e-6)
    # beside another task, the lock-free 0.35 s overlaps the other's phases: two tasks do more than one
    assert simulate(p, 2, steps=20, placement="disaggregated").steps_per_s > 1.2 / 1.5
    assert profile_from_metrics([{k: v for k, v in m.items() if k != "time/end_unix"} for m in metrics]).host_s == 0


def test_published_7b_profile_reproduces_the_published_run():
    p = PUBLISHED["field_7b"]
    # per step: 75.29 s of which switches (9.64 + 6.43 + 0.98 + 1.42) = 18.47: the notes' "~25 %"
    switch = p.engine_onload_s + p.engine_offload_s + p.actor_onload_s + p.actor_offload_s
    assert switch == pytest.approx(18.47)
    assert switch / (p.step_s - 2 * p.lock_rtt_s + switch) == pytest.approx(0.245, abs=0.001)
    # Colocated, 200 GiB: each role fits, both don't (114 + 113 GiB), so every phase moves, as they ran.
    # 10 steps: 753.0 minus what step 1 skips (engine onload 9.64, sync 0.63), plus 20 round trips
    r = simulate(p, 1, steps=10, placement="colocated", budget_bytes=200 * GiB)
    assert r.makespan_s == pytest.approx(753.0 - 9.64 - 0.63 + 20 * 0.003, abs=0.1)
    assert r.moves == 39  # 1 at registration + 2 in step 1 + 4 in each of steps 2-10


def test_profile_rejects_bad_values_by_name():
    with pytest.raises(ValueError, match=r"PhaseProfile.train_s .* got -1"):
        PhaseProfile(rollout_s=1.0, train_s=-1)


# ---- projection, validation, CLI -----------------------------------------------------------------------------------

def test_project_rows_stay_under_the_bound():
    table = project(PUBLISHED["tiny_cpu"], tasks=(1, 2, 8), steps=10)
    assert [r["tasks"] for r in table] == [1, 2, 8]
    assert table[0]["speedup"] == pytest.approx(1.0)
    for r in table[1:]:
        assert r["steps_per_s"] <= r["bound_steps_per_s"] * (1 + 1e-9)
    # tiny_cpu is train-bound: 8 tasks keep the train slot nearly always held
    assert table[-1]["train_busy"] > 0.95


def test_measured_makespan_cuts_the_warmup():
    a = [{"time/end_unix": 100.0 + i, "time/step_s": 1.0} for i in range(5)]  # steps end at 100..104
    b = [{"time/end_unix": 100.5 + i, "time/step_s": 1.0} for i in range(5)]
    # window: earliest start of step 3 (a: 102 - 1 = 101) to the last end (b: 104.5) = 3.5 s over 3 steps
    assert measured_makespan([a, b]) == (pytest.approx(3.5), 3)


def test_validate_computes_relative_error():
    # simulated: 1 task 3 steps x 2 s = 6; 2 tasks 2S + 1 = 7
    out = validate({1: 6.0, 2: 8.0}, BALANCED, steps=3)
    assert [r["simulated_s"] for r in out["rows"]] == [pytest.approx(6.0), pytest.approx(7.0)]
    assert [r["rel_error"] for r in out["rows"]] == [pytest.approx(0.0), pytest.approx(-0.125)]  # (7 - 8) / 8
    assert out["max_abs_rel_error"] == pytest.approx(0.125) and out["within_tolerance"] is False
    assert validate({2: 7.5}, BALANCED, steps=3)["within_tolerance"] is True  # |7 - 7.5| / 7.5 = 6.7 %


def test_cli_writes_report_and_results(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["--profile", "tiny_cpu", "--tasks", "1,2", "--steps", "5", "--measured", "1=1.0", "--out",
                 str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["tasks"] for r in results["rows"]] == [1, 2]
    assert results["rows"][0]["speedup"] == pytest.approx(1.0)
    assert results["profile"]["train_s"] == 0.110
    # tiny_cpu alone: 4 x 0.1783 + the first step (no sync to skip) = 5 x (0.06 + 0.0027 + 0.11 + 0.0056)
    simulated = results["validation"]["rows"][0]["simulated_s"]
    assert simulated == pytest.approx(5 * 0.1783)
    assert results["validation"]["rows"][0]["rel_error"] == pytest.approx(simulated - 1.0)
    report = (out / "report.md").read_text()
    assert report.startswith("# Multi-task scheduling simulation")
    assert "| 2 |" in report and "Validation against measured makespans" in report
    assert "| tasks | makespan (s)" in capsys.readouterr().out

