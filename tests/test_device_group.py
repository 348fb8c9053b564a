"""The device group's process (`cluster.processes: per_device_group`, what `auto` is on every platform): tasks
that evict each other every step under a memory budget still sync exactly the weights their actor published,
through the command line as a user runs it."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from rlsched.cli import main

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

STEPS = 4
SMALL = ["grpo.prompts_per_step=4", "grpo.num_generations=4", "grpo.mini_batch_size=8", "rollout.max_batch_size=16",
         f"steps={STEPS}", "eval=null"]  # the steps alone: demo_multitask's evaluation adds rows before and after


def _sets(config: str, tasks: list[str], out: Path, models: Path, **per_task: object) -> list[str]:
    """`--set` arguments: small batches and STEPS steps for `tasks` of `config`, their models under `models`."""
    from rlsched.config.loading import load_config

    names = [t.name for t in load_config(ROOT / config).tasks]
    sets = [f"experiment.output_dir={out}"]
    for task in tasks:
        i = names.index(task)
        sets += [f"tasks.{i}.{s}" for s in [*SMALL, f"model.path={models / task}",
                                            *(f"{k}={v}" for k, v in per_task.items())]]
    return [a for s in sets for a in ("--set", s)]


def _budget_gb(config: str, tasks: list[str], out: Path, models: Path) -> float:
    """Room for one task of these (conftest.one_task_fits_gb): two never fit, so they evict each other all along."""
    from conftest import one_task_fits_gb

    from rlsched.config.loading import load_config

    overrides = _sets(config, tasks, out, models)[1::2]
    return one_task_fits_gb(next(t for t in load_config(ROOT / config, overrides).tasks if t.name == tasks[0]))


def _metrics(run_dir: Path, task: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "tasks" / task / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "mem/"))} for r in rows]


def _assert_close(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for k, v in w.items():
            assert g[k] == pytest.approx(v, rel=1e-6, abs=1e-6), (g["step"], k, g[k], v)


@pytest.fixture(scope="module")
def solo(ray_session, tmp_path_factory):
    """Each task of the tests below alone, in this process (= under Ray, bit for bit: the isolation test)."""
    root = tmp_path_factory.mktemp("solo")
    runs = {}
    for config, task in [("configs/demo_multitask.yaml", t) for t in ("addition", "subtraction")] + \
                        [("configs/demo_4tasks.yaml", t) for t in ("add-b", "sub-a", "sub-b")]:
        out = root / task
        assert main(["train", str(ROOT / config), "--in-process", "--tasks", task,
                     *_sets(config, [task], out, root / "models")]) == 0
        runs[task] = _metrics(next(out.iterdir()), task)
    return runs


@pytest.mark.parametrize("config, tasks, checkpoint_every", [
    ("configs/demo_multitask.yaml", ["addition", "subtraction"], 0),
    ("configs/demo_4tasks.yaml", ["add-b", "sub-a", "sub-b"], 1),
])
def test_tasks_evicted_every_step_sync_what_their_actor_published(solo, tmp_path, capsys, config, tasks,
                                                                  checkpoint_every):
    """per_device_group, colocated, a budget with room for one task: each task's actor is offloaded between the
    TRAIN that publishes and the ROLLOUT that syncs, and its engine takes the published weights from their host
    copies (the `receive` span says so). Every task computes what it does alone."""
    models = tmp_path / "models"
    budget = _budget_gb(config, tasks, tmp_path, models)
    code = main(["train", str(ROOT / config), "--tasks", ",".join(tasks),
                 *_sets(config, tasks, tmp_path, models, checkpoint_every=checkpoint_every),
                 "--set", "cluster.processes=per_device_group", "--set", "cluster.placement=colocated",
                 "--set", f"cluster.memory_budget_gb={budget}"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert "roles held by 1 device-group process(es)" in out
    run_dir = next(tmp_path.glob("demo-*"))
    trace = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    spans = [e for e in trace if e.get("ph") == "X"]
    for task in tasks:
        mine = [e for e in spans if e["args"].get("task") == task]
        offloads = [e for e in mine if e["name"] == "offload" and e["args"].get("role") == "actor"]
        assert len(offloads) >= STEPS - 1, f"{task}'s actor was not evicted every step: {len(offloads)} offloads"
        received = [e["args"]["from"] for e in mine if e["name"] == "receive"]
        assert "host" in received, f"{task}'s engine never synced from an offloaded actor: {received}"
        # The engine's old weights never went to host for a sync: they waited there since its own eviction, or
        # beside the new ones on the device (workers.rollout.jax_sampler.update_weights)
        undo = [e["args"]["undo_host_bytes"] for e in mine if e["name"] == "sync_weights"]
        assert len(undo) == STEPS and set(undo) == {0}, undo
        _assert_close(_metrics(run_dir, task), solo[task])
        if checkpoint_every:
            assert (run_dir / "tasks" / task / "checkpoints" / str(STEPS)).is_dir()


def test_a_hung_task_is_fenced_by_ending_the_shared_process_and_the_other_is_rebuilt_uncharged(solo, tmp_path,
                                                                                                   capsys):
    """Both tasks' roles in one device-group process. addition's engine hangs in its third generate (a thread that
    cannot be stopped); its lease expires after 8 s and the scheduler ends the process (Ray restarts it) before
    the lock passes on. subtraction lost its roles with it and is rebuilt from its last checkpoint: with
    `max_restarts: 0` (stricter than any budget: a restart it did not cause is not counted), it finishes with
    what it computes alone. The trace never shows two holders of a phase, and it ends well before the stall."""
    from rlsched.observe.timeline import check_lock_exclusivity, read_trace

    config = "configs/demo_multitask.yaml"
    t0 = time.monotonic()
    code = main(["train", str(ROOT / config), *_sets(config, ["addition", "subtraction"], tmp_path, tmp_path / "m"),
                 "--set", "cluster.processes=per_device_group", "--set", "cluster.lease_timeout_s=8",
                 "--set", "tasks.0.rollout.engine=fake",
                 "--set", "tasks.0.rollout.engine_args={stall_on_call: 3, stall_seconds: 600}",
                 "--set", "tasks.1.max_restarts=0", "--set", "tasks.1.checkpoint_every=1"])
    seconds = time.monotonic() - t0
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert code == 1 and seconds < 150, out[-3000:]
    assert re.search(r"error: task addition failed: lease expired after [89] s in phase rollout "
                     r"\(cluster\.lease_timeout_s=8\)", out), out[-3000:]
    assert "error: task subtraction failed" not in out, out[-3000:]
    assert re.search(r"\[subtraction\] step \d: the device group's process was ended to fence task addition "
                     r"\(lease expired .*; restarting its actor and engine \(not counted against max_restarts",
                     out), out[-3000:]
    run_dir = tmp_path / "demo-multitask"
    rows = _metrics(run_dir, "subtraction")
    assert rows[-1]["fault/restarts"] == 1 and rows[-1]["fault/restarts_charged"] == 0
    _assert_close([{k: v for k, v in r.items() if not k.startswith("fault/")} for r in rows],
                  [{k: v for k, v in r.items() if not k.startswith("fault/")} for r in solo["subtraction"]])
    events = read_trace(run_dir / "timeline.json")
    assert check_lock_exclusivity(events) == []
    assert [e["task"] for e in events if e["kind"] == "span" and e["name"] == "fence"] == ["addition"]
    restarts = [e for e in events if e["kind"] == "span" and e["name"] == "restart"]
    assert {(e["task"], e["args"]["role"], e["args"]["charged"]) for e in restarts} == {("subtraction", "actor", False),
                                                                          ("subtraction", "engine", False)}
