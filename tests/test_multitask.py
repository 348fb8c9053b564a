"""Several tasks under the Ray scheduler: isolation, faults, outputs. Real Ray actors, tiny models."""

from __future__ import annotations

import time

import pytest
import yaml

from rlsched.config.loading import select_tasks, validate
from rlsched.observe.tracking import read_metrics
from rlsched.run.experiment import run_experiment
from rlsched.rundir.files import prepare_run_dir

pytestmark = pytest.mark.slow
PER_ROLE = {"processes": "per_role"}  # for the tests about a role's own process


def _experiment(tmp_path, model_dir, name, tasks, steps=3, cluster=None, tracking=None, checkpoint_every=0):
    base = {"grpo": {"prompts_per_step": 4, "num_generations": 4, "max_prompt_len": 16, "max_new_tokens": 4,
                     "mini_batch_size": 8},
            "optim": {"lr": 3e-3}, "steps": steps, "checkpoint_every": checkpoint_every}
    kinds = {"addition": "addition", "subtraction": "subtraction", "add2": "addition", "sub2": "subtraction"}
    raw = {"experiment": {"name": name, "output_dir": str(tmp_path), "seed": 0, "tracking": tracking or {}},
           "cluster": cluster or {},
           "tasks": [{"name": t, "seed": 100 + i, "model": {"path": str(model_dir)},
                      "data": {"kind": kinds[t], "template": "plain"}, "reward": {"name": kinds[t]}, **base}
                     for i, t in enumerate(tasks)]}
    cfg = validate(yaml.safe_load(yaml.safe_dump(raw)))
    prepare_run_dir(cfg, resume=False, overwrite=True)
    return cfg


def _metrics(cfg, task):
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "mem/"))}
            for m in read_metrics(cfg.run_dir / "tasks" / task / "metrics.jsonl")]


def test_isolation_a_task_computes_the_same_alone_in_process_or_with_three_others_under_ray(
        ray_session, tmp_path, tiny_model_dir):
    """Multiplexing changes when things run, never what they compute; and the one step loop computes the
    same in-process (always-free locks, roles here) as under Ray (the scheduler's locks, roles in their own
    processes), bit for bit. Under Ray the task drivers never import JAX (on a TPU host such a process
    would claim the chips)."""
    from rlsched.run.experiment import run_in_process

    names = ["addition", "subtraction", "add2", "sub2"]
    together = _experiment(tmp_path, tiny_model_dir, "together", names)
    seen: dict[str, list[str]] = {}
    probes = []

    def probe(drivers):
        probes.extend(_modules_after_first_step(drivers, together, seen))

    results = run_experiment(together, echo=lambda *_: None, on_started=probe)
    for thread in probes:
        thread.join(timeout=60)
    assert {r["status"] for r in results.values()} == {"ok"}
    assert seen == {name: [] for name in names}, f"task drivers imported {seen}"
    _check_trace(together.run_dir / "timeline.json", names, steps=3)
    alone = select_tasks(_experiment(tmp_path, tiny_model_dir, "alone", names), ["addition"])
    run_in_process(alone, echo=lambda *_: None)
    solo, shared = _metrics(alone, "addition"), _metrics(together, "addition")
    assert len(solo) == 3 and solo == shared
    assert _metrics(together, "add2") != shared  # a different seed really is a different run


def _modules_after_first_step(drivers, cfg, seen: dict, timeout: float = 120.0):
    """In threads, one per task: once the task has logged a step, record which JAX/torch modules its driver
    process holds (or why the probe failed, so a failure says what happened)."""
    import threading

    import ray

    def probe(name, driver):
        path = cfg.run_dir / "tasks" / name / "metrics.jsonl"
        deadline = time.time() + timeout
        while time.time() < deadline and not (path.exists() and path.read_text().count("\n") >= 1):
            time.sleep(0.02)
        try:
            seen[name] = ray.get(driver.__ray_call__.remote(lambda _self: sorted(
                # a copy: the driver's other threads may import while we look
                m for m in list(__import__("sys").modules) if m.split(".")[0] in ("jax", "jaxlib", "flax", "torch"))))
        except Exception as err:  # noqa: BLE001 - reported by the assertion on `seen`
            seen[name] = [f"probe failed: {type(err).__name__}: {err}"]

    threads = [threading.Thread(target=probe, args=item, daemon=True) for item in drivers.items()]
    for thread in threads:
        thread.start()
    return threads


def test_a_tight_memory_budget_evicts_idle_roles_without_changing_results(ray_session, tmp_path, tiny_model_dir):
    """Colocated, with room for one task's engine + actor but not two: the scheduler evicts idle roles
    (LRU) before each onload; every move is a span in the trace; results equal the task run alone. Every
    step saves a checkpoint, under the TRAIN lock: no eviction can empty the actor mid-save."""
    import json

    from conftest import one_task_fits_gb

    budget_gb = one_task_fits_gb(_experiment(tmp_path, tiny_model_dir, "probe", ["addition"]).tasks[0])
    cluster = {"placement": "colocated", "memory_budget_gb": budget_gb}
    cfg = _experiment(tmp_path, tiny_model_dir, "tight", ["addition", "subtraction"], cluster=cluster,
                      checkpoint_every=1)
    results = run_experiment(cfg, echo=lambda *_: None)
    assert {r["status"] for r in results.values()} == {"ok"}, results
    summary = json.loads((cfg.run_dir / "summary.json").read_text())
    trace = json.loads((cfg.run_dir / "timeline.json").read_text())["traceEvents"]
    moves = [e for e in trace if e.get("ph") == "X" and e["name"] in ("onload", "offload")]
    assert {e["name"] for e in moves} == {"onload", "offload"}, "roles were never swapped out and back"
    assert summary["tasks"]["addition"]["status"] == "ok"
    measured = summary["scheduler"]["measured"]["g0/shared"]
    assert measured["budget"] == int(budget_gb * 2**30)
    alone = select_tasks(_experiment(tmp_path, tiny_model_dir, "tight-solo", ["addition", "subtraction"],
                                     cluster=cluster), ["addition"])
    from rlsched.run.experiment import run_in_process  # = under Ray, bit for bit (the isolation test)

    run_in_process(alone, echo=lambda *_: None)
    assert _metrics(cfg, "addition") == _metrics(alone, "addition")  # offload -> onload changed nothing
    for task in ("addition", "subtraction"):
        assert sorted(p.name for p in (cfg.run_dir / "tasks" / task / "checkpoints").iterdir()) == ["2", "3"]  # keeps 2


def _check_trace(path, tasks, steps):
    """What a user can verify from timeline.json alone: the locks held, phases overlapped, nothing missing."""
    import json

    from rlsched.observe.timeline import check_lock_exclusivity, overlaps, read_trace

    assert json.loads(path.read_text())["traceEvents"], "not a Chrome trace"
    events = read_trace(path)
    assert check_lock_exclusivity(events) == []  # per resource, no two tasks' phases ever overlap
    locks = [e for e in events if e["kind"] == "span" and e["name"] in ("ROLLOUT", "TRAIN")]
    for task in tasks:
        mine = [e for e in locks if e["task"] == task]
        assert sorted(e["name"] for e in mine) == ["ROLLOUT"] * steps + ["TRAIN"] * steps
        for lock in mine:  # every phase's work is inside its lock hold, on the lock's resource
            inner = [e for e in events if e["kind"] == "span" and e["task"] == task and e is not lock
                     and e["resource"] == lock["resource"] and lock["start"] <= e["start"] and e["end"] <= lock["end"]]
            want = {"generate", "verify"} if lock["name"] == "ROLLOUT" else {"train", "publish", "update"}
            assert want <= {e["name"] for e in inner}, (lock, inner)
    # Programs compile before a lock is asked for, never while one is held (issue 18): both roles' programs compile
    # in the first steps, outside the compiling task's lock spans (like tasks in one device group's process share
    # them: the first to ask compiles, workers.compiling).
    compiles = [e for e in events if e["kind"] == "span" and e["name"] == "compile"]
    assert {e["process"] for e in compiles} >= {"engine", "actor"}, compiles
    for task in tasks:
        for c in (e for e in compiles if e["task"] == task):
            assert c.get("resource") is None and not any(
                lock["start"] < c["end"] and c["start"] < lock["end"] for lock in locks if lock["task"] == task), c
    # One task's rollout overlapped another's training: the point of the scheduler.
    assert max(overlaps(events, a, "rollout", b, "train") for a in tasks for b in tasks if a != b) > 0


@pytest.fixture(scope="module")
def solo_addition(ray_session, tmp_path_factory, tiny_model_dir):
    """The addition task of the fault tests' experiment, alone: what it must compute whatever befalls the
    other task (run once for both fault tests; the experiment's name does not enter the numbers)."""
    from rlsched.run.experiment import run_in_process  # = under Ray, bit for bit (the isolation test)

    cfg = select_tasks(_experiment(tmp_path_factory.mktemp("solo"), tiny_model_dir, "fault-solo",
                                   ["addition", "subtraction"], steps=6), ["addition"])
    run_in_process(cfg, echo=lambda *_: None)
    return _metrics(cfg, "addition")


def test_killed_task_is_reported_and_the_others_finish_unchanged(ray_session, tmp_path, tiny_model_dir,
                                                                 solo_addition):
    # A process per role: the point is that a killed task takes nobody with it (in a device group's process the
    # others lose their roles to the fence and rebuild them: tests/test_device_group.py).
    cfg = _experiment(tmp_path, tiny_model_dir, "fault", ["addition", "subtraction"], steps=6, cluster=PER_ROLE)
    metrics_path = cfg.run_dir / "tasks" / "subtraction" / "metrics.jsonl"
    results = run_experiment(cfg, echo=lambda *_: None,
                             on_started=lambda drivers: _kill_after_first_step(drivers["subtraction"], metrics_path))
    assert results["addition"]["status"] == "ok", results
    assert results["subtraction"]["status"] == "failed", results
    assert "its process died" in results["subtraction"]["error"]
    assert 1 <= len(read_metrics(metrics_path)) < 6
    assert _metrics(cfg, "addition") == solo_addition


def test_killed_engine_process_fails_its_task_with_the_cause(ray_session, tmp_path, tiny_model_dir, solo_addition):
    """A role dies mid-run (here: the engine, killed from outside with SIGKILL, as `kill -9` or the OOM
    killer ends it): its task fails with a cause that names the role and how it died, releases its lease,
    and the other task computes what it would alone."""
    import os
    import signal

    import ray

    cfg = _experiment(tmp_path, tiny_model_dir, "engine-fault", ["addition", "subtraction"], steps=6,
                      tracking={"wandb": True, "mode": "offline"}, cluster=PER_ROLE)  # a role process of its own
    metrics_path = cfg.run_dir / "tasks" / "subtraction" / "metrics.jsonl"

    def kill_engine(drivers):
        engine = ray.get(drivers["subtraction"].role_handles.remote())["engine"]
        pid = ray.get(engine.where.remote())["pid"]
        _kill_after_first_step(engine, metrics_path, kill=lambda _: os.kill(pid, signal.SIGKILL))

    results = run_experiment(cfg, echo=lambda *_: None, on_started=kill_engine)
    assert results["addition"]["status"] == "ok", results
    assert results["subtraction"]["status"] == "failed", results
    assert "its engine process died during" in results["subtraction"]["error"]
    assert "killed by signal 9 (SIGKILL)" in results["subtraction"]["error"], results["subtraction"]["error"]
    assert "task subtraction, step " in results["subtraction"]["error"]  # where it happened, beside the cause
    # One W&B run per task and one for the scheduler, each finished, the failed task's as failed.
    assert _wandb_exit(cfg.run_dir / "tasks" / "addition") == 0
    assert _wandb_exit(cfg.run_dir / "tasks" / "subtraction") == 1
    assert _wandb_exit(cfg.run_dir / "scheduler") == 1
    assert _metrics(cfg, "addition") == solo_addition


def _wandb_exit(run_dir):
    from rlsched.observe.tracking import read_wandb_log

    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")  # exactly one run per task, never shared
    exits = [r.exit.exit_code for r in read_wandb_log(log) if r.WhichOneof("record_type") == "exit"]
    return exits[-1] if exits else None


def _kill_after_first_step(actor, metrics_path, timeout=120.0, kill=None):
    import threading

    import ray

    kill = kill or ray.kill

    def watch():
        deadline = time.time() + timeout
        while time.time() < deadline:
            if metrics_path.exists() and metrics_path.read_text().count("\n") >= 1:
                kill(actor)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread

