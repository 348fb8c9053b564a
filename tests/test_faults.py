"""Faults under real Ray with the fake engine (the scheduler's logic, not the model's): a lease that expires
fences its holder before the lock passes, and an eviction that fails fails the evicted task, never the one
waiting for the room. Each failing task is named with its cause; the other finishes (in a device group's process
it may lose its roles to the fence, and rebuilds them)."""

from __future__ import annotations

import re
import time

import pytest
import yaml

from rlsched.config.loading import validate
from rlsched.observe.timeline import check_lock_exclusivity, read_trace
from rlsched.observe.tracking import read_metrics
from rlsched.run.experiment import run_experiment
from rlsched.rundir.files import prepare_run_dir

pytestmark = pytest.mark.slow
STEPS = 4


def _experiment(tmp_path, model_dir, name, engine_args: dict[str, dict], cluster: dict):
    grpo = {"prompts_per_step": 4, "num_generations": 4, "max_prompt_len": 16, "max_new_tokens": 4,
            "mini_batch_size": 8}
    raw = {"experiment": {"name": name, "output_dir": str(tmp_path), "seed": 0}, "cluster": cluster,
           "tasks": [{"name": t, "seed": 100 + i, "model": {"path": str(model_dir)},
                      "data": {"kind": t, "template": "plain"}, "reward": {"name": t},
                      "rollout": {"engine": "fake", "engine_args": engine_args.get(t, {})}, "grpo": grpo,
                      "optim": {"lr": 3e-3}, "steps": STEPS, "checkpoint_every": 0}
                     for i, t in enumerate(("addition", "subtraction"))]}
    cfg = validate(yaml.safe_load(yaml.safe_dump(raw)))
    prepare_run_dir(cfg, resume=False, overwrite=True)
    return cfg


# How the hung engine's end reads: its own process killed, or the device group's process ended and restarted.
ENDED = {"per_role": r"RoleDied: its engine process died during rollout\(\): ended by ray\.kill\(\)",
         "per_device_group": r"RoleDied: the device group's process holding its engine died during rollout\(\): "
                             r"its process ended while the call ran, and Ray restarted it without its roles"}


@pytest.mark.parametrize("processes", sorted(ENDED))
def test_an_expired_lease_fences_its_holder_and_the_lock_passes_only_then(ray_session, tmp_path, tiny_model_dir,
                                                                          processes):
    """addition's engine hangs in its second generate: its lease expires, its roles are stopped (its process
    killed; or the device group's process ended, Ray restarting it, and subtraction's roles rebuilt there), then
    subtraction gets the lock; never two holders in the trace."""
    stall = {"addition": {"stall_on_call": 2, "stall_seconds": 300}}
    cfg = _experiment(tmp_path, tiny_model_dir, "lease", stall, {"placement": "colocated", "lease_timeout_s": 5,
                                                                 "processes": processes})
    t0 = time.monotonic()
    results = run_experiment(cfg, echo=lambda *_: None)
    assert time.monotonic() - t0 < 120  # the hung engine was stopped, not waited for
    assert results["subtraction"]["status"] == "ok", results
    assert results["addition"]["status"] == "failed", results
    error = results["addition"]["error"]
    # The watchdog looks every second: the lease is taken between 5 and 6 s after its grant
    assert re.match(r"lease expired after [56] s in phase rollout \(cluster\.lease_timeout_s=5\); its roles were "
                    rf"stopped, and then: {ENDED[processes]} \(task addition, step 2", error), error
    assert len(read_metrics(cfg.run_dir / "tasks" / "subtraction" / "metrics.jsonl")) == STEPS
    events = read_trace(cfg.run_dir / "timeline.json")
    assert check_lock_exclusivity(events) == []  # the holder's ROLLOUT ended before the next one began
    fences = [e for e in events if e["kind"] == "span" and e["name"] == "fence"]
    assert [e["task"] for e in fences] == ["addition"]


def test_an_eviction_that_fails_fails_the_evicted_task_not_the_waiter(ray_session, tmp_path, tiny_model_dir):
    """Room for one task's roles: every step evicts the other's. addition's engine fails its first offload;
    addition is fenced and fails with that cause, subtraction (which waited for the room) runs every step."""
    from conftest import one_task_fits_gb

    budget_gb = one_task_fits_gb(_experiment(tmp_path, tiny_model_dir, "probe", {}, {}).tasks[0])
    # addition asks for its first lock 3 s after subtraction: subtraction's first ROLLOUT evicts addition's
    # engine, whose offload is the one that fails (were addition first, its own move would fail, not an eviction)
    faults = {"addition": {"fail_offload_on_call": 1, "delay_start_s": 3}}
    cfg = _experiment(tmp_path, tiny_model_dir, "evict", faults, {"placement": "colocated",
                                                                  "memory_budget_gb": budget_gb})
    results = run_experiment(cfg, echo=lambda *_: None)
    assert results["subtraction"]["status"] == "ok", results
    assert results["addition"]["status"] == "failed", results
    assert results["addition"]["error"].startswith(
        "its engine could not be offloaded to make room for task subtraction: RuntimeError: injected fault: "
        "offload call 1 fails"), results["addition"]["error"]
    assert len(read_metrics(cfg.run_dir / "tasks" / "subtraction" / "metrics.jsonl")) == STEPS
    assert check_lock_exclusivity(read_trace(cfg.run_dir / "timeline.json")) == []
