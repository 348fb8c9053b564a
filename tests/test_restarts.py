"""Automatic restarts (`max_restarts`), under real Ray with real roles: processes killed with SIGKILL from
outside, as `kill -9` or the kernel's OOM killer ends them. A dead engine is replaced and its step redone;
a dead actor is replaced from the last checkpoint. Every task still computes what it computes alone."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import yaml

from rlsched.config.loading import validate
from rlsched.observe.timeline import check_lock_exclusivity, read_trace
from rlsched.observe.tracking import read_metrics
from rlsched.run.experiment import run_experiment, run_in_process
from rlsched.rundir.files import prepare_run_dir

pytestmark = pytest.mark.slow
STEPS = 5
TASKS = {"addition": "addition", "subtraction": "subtraction", "add2": "addition"}


def _experiment(tmp_path, model_dir, name, max_restarts=3, cluster=None, restarts_of=None):
    grpo = {"prompts_per_step": 4, "num_generations": 4, "max_prompt_len": 16, "max_new_tokens": 4,
            "mini_batch_size": 8}
    raw = {"experiment": {"name": name, "output_dir": str(tmp_path), "seed": 0},
           "tasks": [{"name": t, "seed": 100 + i, "model": {"path": str(model_dir)},
                      "data": {"kind": kind, "template": "plain"}, "reward": {"name": kind}, "grpo": grpo,
                      "optim": {"lr": 3e-3}, "steps": STEPS, "checkpoint_every": 1,
                      "max_restarts": (restarts_of or {}).get(t, max_restarts)}
                     for i, (t, kind) in enumerate(TASKS.items())]}
    if cluster:
        raw["cluster"] = cluster
    cfg = validate(yaml.safe_load(yaml.safe_dump(raw)))
    prepare_run_dir(cfg, resume=False, overwrite=True)
    return cfg


@pytest.fixture(scope="module")
def alone(tmp_path_factory, tiny_model_dir):
    """Each task alone in this process, nothing killed: what every run here must compute."""
    reference = _experiment(tmp_path_factory.mktemp("alone"), tiny_model_dir, "alone")
    run_in_process(reference, echo=lambda *_: None)
    return reference


def _metrics(cfg, task):
    """What a task computed: its metrics lines without timings, memory and fault counts."""
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "mem/", "fault/"))}
            for m in read_metrics(cfg.run_dir / "tasks" / task / "metrics.jsonl")]


def _assert_same(got, want):
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for k in w:
            assert g[k] == pytest.approx(w[k], rel=1e-6, abs=1e-6), (g["step"], k, g[k], w[k])


class _Chaos:
    """Kills role processes by pid when a task's metrics file reaches a number of lines, one after another."""

    def __init__(self, cfg, plan):
        self.cfg, self.plan, self.killed, self.errors = cfg, list(plan), [], []

    def start(self, drivers):
        self.drivers = drivers
        threading.Thread(target=self._run, daemon=True).start()

    def _pid(self, task, role):
        """The pid of the role's live process, or None while the task still holds a process killed earlier: a
        kill can land after the next step's rollout, so the task notices the death (and replaces the role) only
        a step later, and a metrics line can come first."""
        import ray

        handle = ray.get(self.drivers[task].role_handles.remote())[role]
        try:
            return ray.get(handle.where.remote(), timeout=60)["pid"]
        except ray.exceptions.RayActorError:
            return None

    def _run(self):
        try:
            for task, role, lines in self.plan:
                path = self.cfg.run_dir / "tasks" / task / "metrics.jsonl"
                deadline = time.time() + 300
                while time.time() < deadline:
                    if len(read_metrics(path)) >= lines:
                        before = [pid for t, r, pid in self.killed if (t, r) == (task, role)]
                        pid = self._pid(task, role)  # the role's current process (a new one after a restart)
                        if pid is not None and pid not in before:
                            os.kill(pid, signal.SIGKILL)
                            self.killed.append((task, role, pid))
                            break
                    time.sleep(0.05)
                else:
                    raise TimeoutError(f"{task} never wrote {lines} lines")
        except Exception as err:  # noqa: BLE001 - the test reports it
            self.errors.append(err)


def test_chaos_three_tasks_survive_killed_engines_and_actors_and_compute_what_they_do_alone(
        ray_session, tmp_path, tiny_model_dir, alone):
    """addition's engine is SIGKILLed after its step 1, subtraction's actor after its step 2, addition's new
    engine after its step 3. With max_restarts 3 every task finishes; a dead engine's step is redone with the
    actor's live weights, a dead actor goes back to its last checkpoint (checkpoint_every 1); each task's
    metrics equal its uninterrupted run; the restarts are in the results, the metrics and the trace."""
    # A process per role: each kill ends one role (a device group's process is test_a_dead_device_group_process_...).
    cfg = _experiment(tmp_path / "chaos", tiny_model_dir, "chaos", cluster={"processes": "per_role"})
    chaos = _Chaos(cfg, [("addition", "engine", 1), ("subtraction", "actor", 2), ("addition", "engine", 3)])
    lines = []
    results = run_experiment(cfg, echo=lines.append, on_started=chaos.start)
    assert chaos.errors == [] and len(chaos.killed) == 3, (chaos.errors, chaos.killed)
    assert {t: r["status"] for t, r in results.items()} == dict.fromkeys(TASKS, "ok"), results
    assert [len(results[t].get("restarts", [])) for t in TASKS] == [2, 1, 0], results
    assert all("killed by signal 9 (SIGKILL)" in cause for t in ("addition", "subtraction")
               for cause in results[t]["restarts"]), results
    assert any(line.startswith("[subtraction] actor restarted") for line in lines), lines

    for task in TASKS:
        _assert_same(_metrics(cfg, task), _metrics(alone, task))
    last = {t: read_metrics(cfg.run_dir / "tasks" / t / "metrics.jsonl")[-1]["fault/restarts"] for t in TASKS}
    assert last == {"addition": 2, "subtraction": 1, "add2": 0}

    events = read_trace(cfg.run_dir / "timeline.json")
    assert check_lock_exclusivity(events) == []
    restarts = sorted((e["task"], e["args"]["role"]) for e in events if e["kind"] == "span" and e["name"] == "restart")
    assert restarts == [("addition", "engine"), ("addition", "engine"), ("subtraction", "actor")]


def test_without_restarts_left_the_task_fails_with_every_cause(ray_session, tmp_path, tiny_model_dir):
    """max_restarts 1: the first death is survived, the second fails the task with both causes listed; the
    other tasks finish."""
    cfg = _experiment(tmp_path, tiny_model_dir, "one-restart", max_restarts=1, cluster={"processes": "per_role"})
    chaos = _Chaos(cfg, [("addition", "engine", 1), ("addition", "engine", 2)])
    results = run_experiment(cfg, echo=lambda *_: None, on_started=chaos.start)
    assert chaos.errors == [] and len(chaos.killed) == 2, (chaos.errors, chaos.killed)
    assert results["subtraction"]["status"] == results["add2"]["status"] == "ok", results
    error = results["addition"]["error"]
    assert results["addition"]["status"] == "failed", results
    assert error.startswith("RoleDied: its engine process died during"), error
    assert "after 1 restart(s) (max_restarts=1): step " in error and error.count("killed by signal 9") == 2, error


def test_a_dead_device_group_process_comes_back_and_its_tasks_compute_what_they_do_alone(
        ray_session, tmp_path, tiny_model_dir, alone):
    """cluster.processes: per_device_group (the default): one process holds every task's actor and
    engine. SIGKILL it after addition's step 2: Ray restarts it, addition and subtraction (max_restarts 1) build
    both their roles there again, each actor from its last checkpoint, and finish with the metrics of their
    uninterrupted runs; add2 (max_restarts 0) fails naming the host. Both roles' restarts are in the trace."""
    import ray

    cfg = _experiment(tmp_path / "group", tiny_model_dir, "group", max_restarts=1, restarts_of={"add2": 0},
                      cluster={"processes": "per_device_group", "placement": "colocated"})
    killed, errors, lines = [], [], []

    def kill(drivers):
        def run():
            try:
                path = cfg.run_dir / "tasks" / "addition" / "metrics.jsonl"
                while len(read_metrics(path)) < 2:
                    time.sleep(0.05)
                host = ray.get(drivers["addition"].role_handles.remote())["actor"]
                killed.append(ray.get(host.where.remote(), timeout=60)["pid"])
                os.kill(killed[0], signal.SIGKILL)
            except Exception as err:  # noqa: BLE001 - the test reports it
                errors.append(err)

        threading.Thread(target=run, daemon=True).start()

    results = run_experiment(cfg, echo=lines.append, on_started=kill)
    assert errors == [] and len(killed) == 1, (errors, killed)
    assert {t: r["status"] for t, r in results.items()} == {"addition": "ok", "subtraction": "ok",
                                                            "add2": "failed"}, results
    assert "device group's process" in results["add2"]["error"], results["add2"]["error"]
    for task in ("addition", "subtraction"):
        (cause,) = results[task]["restarts"]
        assert "device group's process" in cause, cause
        assert any(line.startswith(f"[{task}] actor and engine restarted") for line in lines), lines
        assert results[task]["roles"]["actor"]["pid"] == results[task]["roles"]["engine"]["pid"] != killed[0]

    for task in ("addition", "subtraction"):
        _assert_same(_metrics(cfg, task), _metrics(alone, task))
    events = read_trace(cfg.run_dir / "timeline.json")
    assert check_lock_exclusivity(events) == []
    restarts = sorted((e["task"], e["args"]["role"]) for e in events if e["kind"] == "span" and e["name"] == "restart")
    assert restarts == [("addition", "actor"), ("addition", "engine"), ("subtraction", "actor"),
                        ("subtraction", "engine")]
