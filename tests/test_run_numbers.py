"""The numbers a run reports, read from what `rlsched train` leaves (one real run, as a user starts it): a
compile is its own metric and its own span, never inside the reward's or a phase's time; `rlsched timeline`
and timeline.png name it; summary.json flags only the task that failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlsched.observe.timeline import LOCKS, read_trace, summarize
from rlsched.observe.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    """The two-task demo for 3 steps on a fresh compilation cache: addition runs them; subtraction's data has an
    answer that is not a number ("two"), so its reward raises at step 1 and it fails (reward.on_error=fail)."""
    work = tmp_path_factory.mktemp("numbers")
    data = work / "bad.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": "two"}) + "\n" for i in range(4)))
    sets = [f"experiment.output_dir={work / 'runs'}"]
    for i in (0, 1):
        sets += [f"tasks.{i}.model.path={tiny_model_dir}", f"tasks.{i}.model.init_preset=null",
                 f"tasks.{i}.steps={STEPS}", f"tasks.{i}.checkpoint_every=0", f"tasks.{i}.grpo.prompts_per_step=4",
                 f"tasks.{i}.grpo.num_generations=4", f"tasks.{i}.grpo.mini_batch_size=8",
                 f"tasks.{i}.eval=null"]  # the demo's evaluation is no part of the numbers counted here
    sets += ["tasks.1.data.kind=jsonl", f"tasks.1.data.path={data}"]
    proc = subprocess.run([sys.executable, "-m", "rlsched.cli", "train", str(ROOT / "configs" / "demo_multitask.yaml"),
                           *[w for s in sets for w in ("--set", s)]], cwd=work, capture_output=True, text=True,
                          timeout=600, env=os.environ | {"RLSCHED_HOME": str(work / "home")})
    return proc, work / "runs" / "demo-multitask"


def _span_s(e: dict) -> float:
    return e["end"] - e["start"]


@pytest.mark.slow
def test_compile_is_its_own_metric_and_span_never_inside_reward_or_a_lock(run):
    proc, run_dir = run
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 1 and "[addition] ok" in proc.stdout, out  # one task failed, the other ran
    assert "[subtraction] failed: " in proc.stdout and "invalid literal for int()" in proc.stdout, out
    rows = read_metrics(run_dir / "tasks" / "addition" / "metrics.jsonl")
    assert [m["step"] for m in rows] == [1, 2, 3]
    events = [e for e in read_trace(run_dir / "timeline.json") if e["kind"] == "span" and e["task"] == "addition"]
    compiles = [e for e in events if e["name"] == "compile"]
    assert {e["process"] for e in compiles} == {"engine", "actor"}, compiles  # each role compiled for step 1
    first = rows[0]
    step2_start = rows[1]["time/end_unix"] - rows[1]["time/step_s"]
    in_step1 = [e for e in compiles if e["end"] <= step2_start]
    assert len(in_step1) == len(compiles)  # same shapes after step 1: nothing compiled again
    actor_compile = sum(_span_s(e) for e in compiles if e["process"] == "actor")
    # The actor compiled for step 1's batch at the same time as the engine for its prompts, before the ROLLOUT lock
    # (the batch's shape is the prompts'): the two spans overlap, and the step waited for the longer, not the sum.
    engine, actor = (next(e for e in in_step1 if e["process"] == p) for p in ("engine", "actor"))
    together = min(engine["end"], actor["end"]) - max(engine["start"], actor["start"])
    assert together > 0.5 * min(_span_s(engine), _span_s(actor)), (engine, actor)
    assert first["time/reward_s"] < actor_compile, (first, actor_compile)  # never counted as the reward's time
    covered = max(engine["end"], actor["end"]) - min(engine["start"], actor["start"])
    assert covered - 1e-3 <= first["time/compile_s"] < _span_s(engine) + _span_s(actor), first
    parts = sum(first[f"time/{k}_s"] for k in ("compile", "rollout", "reward", "train", "lock_wait"))
    assert parts <= first["time/step_s"] + 1e-6, first
    for m in rows[1:]:
        assert m["time/compile_s"] < 0.5 * actor_compile, m  # a round trip now: the shapes were seen
    # Compiles run outside every lock: no compile span overlaps one of the task's lock holds
    for c in compiles:
        for hold in (e for e in events if e["name"] in LOCKS):
            assert c["end"] <= hold["start"] or c["start"] >= hold["end"], (c, hold)
    # The progress line says it, beside the other times
    line = next(x for x in proc.stdout.splitlines() if x.startswith("[addition] step    1/3"))
    assert f"(compile {first['time/compile_s']:.2f} rollout {first['time/rollout_s']:.2f} " in line, line


@pytest.mark.slow
def test_the_timeline_table_and_picture_name_compile(run):
    from rlsched.observe.gantt import draw_gantt

    _, run_dir = run
    events = read_trace(run_dir / "timeline.json")
    compiles = sorted((e["start"], e["end"]) for e in events if e["kind"] == "span" and e["task"] == "addition"
                      and e["name"] == "compile")
    compile_s, reached = 0.0, float("-inf")  # the wall time they cover: the roles compile at once
    for start, end in compiles:
        compile_s += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    assert 0 < compile_s < sum(end - start for start, end in compiles)  # they overlapped
    assert summarize(events)["tasks"]["addition"]["compile_s"] == pytest.approx(compile_s)
    proc = subprocess.run([sys.executable, "-m", "rlsched.cli", "timeline", str(run_dir)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    header, row = (next(x for x in proc.stdout.splitlines() if x.startswith(w)) for w in ("task ", "addition "))
    assert header.split()[-4:] == ["compile", "s", "start", "s"], header
    assert float(row.split()[-2]) == pytest.approx(compile_s, abs=0.006)
    # the task's start: its driver's span (phase startup), which holds its roles' own (their imports, devices, model)
    starts = [e for e in events if e["kind"] == "span" and e["task"] == "addition" and e["phase"] == "startup"]
    (start,) = [e for e in starts if e["name"] == "start"]
    parts = {"imports", "devices", "load_model", "build_worker", "make_engine", "host_work"}
    assert parts <= {e["name"] for e in starts}, starts
    assert all(start["start"] <= e["start"] and e["end"] <= start["end"] for e in starts), starts
    part = {(e["process"], e["name"]): e for e in starts}  # the engine is built beside its actor, not after it
    assert part["engine", "imports"]["start"] < part["actor", "build_worker"]["end"], starts
    assert float(row.split()[-1]) == pytest.approx(start["end"] - start["start"], abs=0.006) and start["end"] <= min(
        e["start"] for e in events if e["kind"] == "span" and e["name"] in LOCKS)  # before its first lock
    fig = draw_gantt(events)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "compile" in labels and "startup" in labels and "other" not in labels, labels


@pytest.mark.slow
def test_summary_flags_only_the_task_that_failed(run):
    _, run_dir = run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tasks"]["addition"]["status"] == "ok" and summary["tasks"]["subtraction"]["status"] == "failed"
    assert "invalid literal for int()" in summary["tasks"]["subtraction"]["error"]
    flags = {name: t["failed"] for name, t in summary["scheduler"]["snapshot"]["tasks"].items()}
    assert flags == {"addition": False, "subtraction": True}
    assert list(summary["scheduler"]["failed"]) in ([], ["subtraction"])  # the scheduler's causes: failures only


# ---- the same, on events and states written by hand (fast) ----------------------------------------------------

def _span(name: str, start: float, end: float, resource: str | None = None) -> dict:
    return {"kind": "span", "task": "a", "process": "driver", "name": name, "phase": None, "resource": resource,
            "device": None, "start": start, "end": end, "bytes": None, "args": {}}


def test_the_gantt_draws_compile_in_its_own_colour_and_names_it():
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    from rlsched.observe.gantt import COLOURS, draw_gantt

    events = [_span("compile", 0.0, 2.0), _span("TRAIN", 2.0, 3.0, "g0/train"), _span("train", 2.0, 3.0, "g0/train"),
              _span("something_new", 3.0, 3.5)]
    fig = draw_gantt(events)
    try:
        ax = fig.axes[0]
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "compile" in labels and "train" in labels and "other" in labels, labels  # other: something_new
        [host_row] = [i for i, t in enumerate(ax.get_yticklabels()) if t.get_text() == "a · host"]
        filled = [c for c in ax.collections if len(c.get_facecolor())]  # lock holds are outlines only
        colour = COLOURS["compile"].lower()
        [bar] = [c.get_paths()[0].get_extents() for c in filled if to_hex(c.get_facecolor()[0]) == colour]
        assert (bar.x0, bar.x1) == (0.0, 2.0) and bar.y0 < host_row < bar.y1, bar  # 0-2 s on the host row
    finally:
        plt.close(fig)


def test_summary_flags_a_task_failed_only_when_its_status_says_so():
    from rlsched.rundir.files import run_summary

    # What the scheduler's state looks like after a run: the policy calls every task that left its books failed
    state = {"failed": {"b": "RewardError: ..."}, "grants": 6,
             "snapshot": {"tasks": {"a": {"group": "g0", "failed": True}, "b": {"group": "g0", "failed": True},
                                    "other": {"group": "g0", "failed": True}}}}
    results = {"a": {"task": "a", "status": "ok", "steps": 3},
               "b": {"task": "b", "status": "failed", "error": "RewardError: ...", "traceback": "Traceback ..."}}
    summary = run_summary("exp", "colocated", results, {"wall_s": 1.0}, state)
    tasks = summary["scheduler"]["snapshot"]["tasks"]
    assert (tasks["a"]["failed"], tasks["b"]["failed"]) == (False, True)
    assert "failed" not in tasks["other"]  # not this run's: its outcome is not known here
    assert summary["tasks"]["b"] == {"task": "b", "status": "failed", "error": "RewardError: ..."}  # no traceback
    assert state["snapshot"]["tasks"]["a"]["failed"] is True  # the caller's state is left as it was
