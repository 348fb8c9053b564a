"""Trackers: two tasks' W&B offline runs stay apart and finish, fan-out and finish-on-error, atomic JSON
files, memory probes on CPU, and the config's tracking section.

W&B runs offline under tmp_path; the runs are checked by reading their transaction logs
(`run-<id>.wandb`), the files `wandb sync` would upload.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlsched.config.loading import load_config
from rlsched.config.schema import ConfigError, TrackingSection
from rlsched.observe.tracking import (
    JsonlTracker,
    MultiTracker,
    NoopTracker,
    WandbTracker,
    make_trackers,
    read_metrics,
    read_wandb_log,
    resolve_wandb_mode,
)


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B with no network and no files outside tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    return tmp_path


def run_contents(run_path: Path) -> dict:
    """What one offline run recorded: run record, history rows by step, summary and config keys, exit record."""
    (log,) = run_path.glob("run-*.wandb")
    out: dict = {"run": None, "history": {}, "summary": {}, "config": {}, "exit": None}
    for r in read_wandb_log(log):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["run"] = r.run
            out["config"].update({u.key: json.loads(u.value_json) for u in r.run.config.update})
        elif kind == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in r.config.update})
        elif kind == "history":
            out["history"][r.history.step.num] = {
                (i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        elif kind == "summary":
            out["summary"].update({(u.key or "/".join(u.nested_key)): json.loads(u.value_json)
                                   for u in r.summary.update})
        elif kind == "exit":
            out["exit"] = r.exit
    return out


def user_keys(row: dict) -> set[str]:
    return {k for k in row if not k.startswith("_")}


# --- W&B ------------------------------------------------------------------------------------------------------


STEPS = 300  # enough rows that each run's transaction log spans several blocks


def test_two_tasks_get_separate_complete_wandb_runs(offline_wandb):
    exp_dir = offline_wandb / "runs" / "exp"
    a = WandbTracker(project="rlsched", experiment="exp", name="a", run_dir=exp_dir / "tasks" / "a",
                     config={"lr": 1e-3}, tags=("demo",))
    b = WandbTracker(project="rlsched", experiment="exp", name="b", run_dir=exp_dir / "tasks" / "b",
                     config={"lr": 2e-3})
    assert a.mode == b.mode == "offline"
    for step in range(STEPS):  # interleaved, as two tasks in one process would log
        a.log(step, {"reward/mean": 0.25 * step, "a/only": step, "loss": float("nan")})
        b.log(step, {"reward/mean": 10.0 + step, "b/only": -step, "kl": float("inf")})
    a.summary({"final/reward": 0.5})
    b.hyperparameters({"beta": 0.04})
    a.finish()
    b.finish(exit_code=1)  # b failed: its run is still finished, and marked failed
    a.finish()
    b.finish(exit_code=1)  # idempotent

    assert a.finished and b.finished
    assert a.id != b.id
    assert a.path.parent == exp_dir / "tasks" / "a" / "wandb" and a.path.name.startswith("offline-run-")
    assert b.path.parent == exp_dir / "tasks" / "b" / "wandb"
    ra, rb = run_contents(a.path), run_contents(b.path)

    assert (ra["run"].display_name, ra["run"].run_group, ra["run"].job_type) == ("a", "exp", "task")
    assert (rb["run"].display_name, rb["run"].run_group) == ("b", "exp")
    assert list(ra["run"].tags) == ["demo"]
    assert ra["config"]["lr"] == 1e-3 and "beta" not in ra["config"]
    assert rb["config"]["lr"] == 2e-3 and rb["config"]["beta"] == 0.04

    # Complete: every step, with this task's values only (the log spans several 32 KiB blocks).
    assert (a.path / f"run-{a.id}.wandb").stat().st_size > 2 * 32768
    assert sorted(ra["history"]) == sorted(rb["history"]) == list(range(STEPS))
    for step in range(STEPS):
        assert user_keys(ra["history"][step]) == {"reward/mean", "a/only", "loss"}
        assert ra["history"][step]["reward/mean"] == 0.25 * step and ra["history"][step]["a/only"] == step
        assert math.isnan(ra["history"][step]["loss"])
        assert user_keys(rb["history"][step]) == {"reward/mean", "b/only", "kl"}
        assert rb["history"][step]["reward/mean"] == 10.0 + step and rb["history"][step]["kl"] == math.inf
    assert ra["summary"]["final/reward"] == 0.5 and "final/reward" not in rb["summary"]
    assert not any(k.startswith("b/") for k in ra["summary"]) and not any(k.startswith("a/") for k in rb["summary"])

    # Finished: the exit record is there, with the exit code given.
    assert ra["exit"] is not None and ra["exit"].exit_code == 0
    assert rb["exit"] is not None and rb["exit"].exit_code == 1

    with pytest.raises(RuntimeError, match="already finished"):
        a.log(STEPS, {"reward/mean": 1.0})


def test_wandb_log_reader_leaves_out_a_record_cut_short(offline_wandb):
    t = WandbTracker(project="p", experiment="exp", name="a", run_dir=offline_wandb / "a")
    t.log(0, {"x": 1.0})
    t.finish()
    log = t.path / f"run-{t.id}.wandb"
    whole = read_wandb_log(log)
    assert whole[-1].WhichOneof("record_type") == "exit"
    cut = offline_wandb / "cut.wandb"
    cut.write_bytes(log.read_bytes()[:-3])  # as if the writer were interrupted inside the exit record
    assert [r.WhichOneof("record_type") for r in read_wandb_log(cut)] == [
        r.WhichOneof("record_type") for r in whole[:-1]]


def test_wandb_mode_resolution(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert resolve_wandb_mode(None) == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode(None) == "disabled"
    assert resolve_wandb_mode("online") == "online"  # the config beats the environment


def test_disabled_wandb_writes_nothing(offline_wandb):
    t = WandbTracker(project="p", experiment="exp", name="a", run_dir=offline_wandb / "a", mode="disabled")
    t.log(0, {"x": float("nan")})
    t.summary({"best": 1.0})
    t.finish(1)
    assert t.finished and t.path is None and list((offline_wandb / "a").iterdir()) == []


def test_missing_wandb_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'wandb>=0\.19'.*tracking\.wandb: false"):
        WandbTracker(project="p", experiment="exp", name="a", run_dir=tmp_path)


def test_make_trackers_jsonl_always_wandb_when_enabled(offline_wandb):
    task_dir = offline_wandb / "runs" / "exp" / "tasks" / "a"
    plain = make_trackers(TrackingSection(), run_dir=task_dir, experiment="exp", task="a", hparams={"lr": 0.1})
    assert [type(t) for t in plain.trackers] == [JsonlTracker]
    plain.log(0, {"x": 1})
    plain.finish()
    assert read_metrics(task_dir / "metrics.jsonl") == [{"step": 0, "x": 1}]
    assert json.loads((task_dir / "hparams.json").read_text()) == {"lr": 0.1}

    sched_dir = offline_wandb / "runs" / "exp" / "scheduler"
    cfg = TrackingSection(wandb=True, project="proj", tags=["t1"])
    with make_trackers(cfg, run_dir=sched_dir, experiment="exp", task="scheduler", job_type="scheduler",
                       hparams={"tasks": 2}) as tracker:
        jsonl, wb = tracker.trackers
        assert isinstance(jsonl, JsonlTracker) and isinstance(wb, WandbTracker)
        tracker.log(0, {"lock/wait_s": 0.5})
        tracker.summary({"makespan_s": 12.0})
    assert wb.finished
    run = run_contents(wb.path)
    assert (run["run"].display_name, run["run"].job_type, run["run"].project) == ("scheduler", "scheduler", "proj")
    assert run["config"]["tasks"] == 2 and run["history"][0]["lock/wait_s"] == 0.5 and run["exit"].exit_code == 0
    assert read_metrics(sched_dir / "metrics.jsonl") == [{"step": 0, "lock/wait_s": 0.5}]
    assert json.loads((sched_dir / "summary.json").read_text()) == {"makespan_s": 12.0}


def test_with_block_that_raises_finishes_run_as_failed(offline_wandb):
    tracker = WandbTracker(project="p", experiment="exp", name="a", run_dir=offline_wandb / "a")
    with pytest.raises(ValueError, match="task died"), tracker:
        tracker.log(0, {"x": 1.0})
        raise ValueError("task died")
    assert tracker.finished and run_contents(tracker.path)["exit"].exit_code == 1


# --- fan-out --------------------------------------------------------------------------------------------------


class RecordingTracker(NoopTracker):
    """A fake that records its calls and can be told to fail one method."""

    def __init__(self, fail: str | None = None):
        self.calls: list[tuple] = []
        self.fail = fail

    def _call(self, name, *args):
        self.calls.append((name, *args))
        if name == self.fail:
            raise OSError(f"{name} failed")

    def log(self, step, metrics):
        self._call("log", step, dict(metrics))

    def hyperparameters(self, params):
        self._call("hyperparameters", dict(params))

    def summary(self, values):
        self._call("summary", dict(values))

    def finish(self, exit_code=0):
        self._call("finish", exit_code)


def test_multitracker_fans_out_every_call():
    a, b = RecordingTracker(), RecordingTracker()
    multi = MultiTracker([a, b])
    multi.hyperparameters({"lr": 1})
    multi.log(3, {"x": 2})
    multi.summary({"best": 4})
    multi.finish(1)
    assert a.calls == b.calls == [("hyperparameters", {"lr": 1}), ("log", 3, {"x": 2}), ("summary", {"best": 4}),
                                  ("finish", 1)]


def test_multitracker_finishes_every_child_then_reraises_first_error():
    first, ok, second = RecordingTracker(fail="finish"), RecordingTracker(), RecordingTracker(fail="finish")
    with pytest.raises(OSError, match="finish failed") as info:
        MultiTracker([first, ok, second]).finish(1)
    assert first.calls == ok.calls == second.calls == [("finish", 1)]
    assert info.value is not None and any("also failed" in note for note in info.value.__notes__)


def test_multitracker_log_error_does_not_cost_the_jsonl_line(tmp_path):
    jsonl = JsonlTracker(tmp_path / "metrics.jsonl")
    broken = RecordingTracker(fail="log")
    multi = MultiTracker([broken, jsonl])
    with pytest.raises(OSError, match="log failed"):
        multi.log(0, {"x": 1})
    multi.truncate_after(0)  # forwarded to the trackers that can rewind; the fake has no truncate_after
    multi.finish()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "x": 1}]


# --- metrics.jsonl and its JSON files -------------------------------------------------------------------------


def test_jsonl_hparams_and_summary_merge_and_are_json_safe(tmp_path):
    np = pytest.importorskip("numpy")
    t = JsonlTracker(tmp_path / "task" / "metrics.jsonl")
    t.hyperparameters({"grpo": {"beta": 0.04}, "path": Path("/m")})
    t.summary({"reward": np.float32(0.5), "loss": float("nan"), "kl": float("inf")})
    t.summary({"steps": 10})
    t.log(0, {"reward/mean": np.float64(0.25), "bad": float("nan")})
    t.finish()
    t.finish()  # idempotent
    assert json.loads((tmp_path / "task" / "hparams.json").read_text()) == {"grpo": {"beta": 0.04}, "path": "/m"}
    assert json.loads((tmp_path / "task" / "summary.json").read_text()) == {
        "reward": 0.5, "loss": None, "kl": "inf", "steps": 10}
    assert read_metrics(tmp_path / "task" / "metrics.jsonl") == [{"step": 0, "reward/mean": 0.25, "bad": None}]


def test_summary_is_replaced_atomically(tmp_path, monkeypatch):
    t = JsonlTracker(tmp_path / "metrics.jsonl")
    t.summary({"a": 1})

    # A crash just before the rename: the old file must be whole, and no temporary file left behind.
    def crash(src, dst):
        assert Path(src).parent == Path(dst).parent and json.loads(Path(src).read_text()) == {"a": 1, "b": 2}
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        t.summary({"b": 2})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "summary.json"]
    t.finish()


def test_truncate_after_keeps_resume_semantics(tmp_path):
    t = JsonlTracker(tmp_path / "metrics.jsonl")
    for step in range(4):
        t.log(step, {"x": step})
    t.truncate_after(1)
    t.log(2, {"x": 20})
    t.finish()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "x": 0}, {"step": 1, "x": 1}, {"step": 2, "x": 20}]


# --- memory probe ---------------------------------------------------------------------------------------------


def test_memory_metrics_on_cpu_count_live_arrays():
    import jax.numpy as jnp

    from rlsched.observe.memprobe import memory_metrics, phase_memory

    gc.collect()  # nothing from earlier tests may be freed between the two probes
    before = memory_metrics()
    x = jnp.ones((1 << 20,), jnp.float32).block_until_ready()  # 4 MiB = 2**20 * 4 bytes
    after = memory_metrics()
    assert after["mem/process/rss_bytes"] > 0
    assert after["mem/device0/bytes_in_use"] - before["mem/device0/bytes_in_use"] >= 4 << 20
    assert after["mem/device0/peak_bytes"] >= after["mem/device0/bytes_in_use"]
    del x
    freed = memory_metrics()
    assert freed["mem/device0/bytes_in_use"] <= after["mem/device0/bytes_in_use"] - (4 << 20)
    assert freed["mem/device0/peak_bytes"] >= after["mem/device0/bytes_in_use"]  # the peak is remembered

    row = phase_memory("weights_swapped", 2)
    assert row["phase/name"] == "weights_swapped" and row["phase/idx"] == 2
    assert {"mem/process/rss_bytes", "mem/device0/bytes_in_use", "mem/device0/peak_bytes"} <= set(row)
    assert all(isinstance(v, int) for k, v in row.items() if k.startswith("mem/"))


def test_memory_metrics_counts_each_shard_on_its_own_device():
    # A fresh process: the device count is fixed when JAX starts.
    script = textwrap.dedent("""
        import json, jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from rlsched.observe.memprobe import memory_metrics
        before = memory_metrics()
        mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
        x = jax.device_put(jnp.ones((2 << 20,), jnp.float32), NamedSharding(mesh, P("x")))  # 8 MiB, 4 per device
        after = memory_metrics()
        print(json.dumps({k: after[k] - before[k] for k in after}))
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    grew = json.loads(out.stdout.strip().splitlines()[-1])
    # The unsharded 8 MiB source may or may not still be alive on device 0; each device holds its 4 MiB shard.
    assert grew["mem/device1/bytes_in_use"] == 4 << 20
    assert grew["mem/device0/bytes_in_use"] in (4 << 20, 12 << 20)


# --- config ---------------------------------------------------------------------------------------------------

CONFIG = """\
experiment:
  name: demo
{tracking}
tasks:
  - name: addition
    model: {{path: runs/demo/model, init_preset: tiny}}
    data: {{kind: addition}}
    reward: {{name: addition}}
    grpo: {{prompts_per_step: 2, num_generations: 2}}
    steps: 2
"""


def load(tmp_path, tracking: str):
    path = tmp_path / "demo.yaml"
    path.write_text(CONFIG.format(tracking=textwrap.indent(tracking, "  ")))
    return load_config(path)


def test_tracking_config_defaults_and_values(tmp_path):
    default = load(tmp_path, "").experiment.tracking
    assert (default.wandb, default.project, default.mode, default.tags) == (False, "rlsched", None, [])
    cfg = load(tmp_path, "tracking: {wandb: true, project: grpo, mode: online, tags: [a, b]}").experiment.tracking
    assert (cfg.wandb, cfg.project, cfg.mode, cfg.tags) == (True, "grpo", "online", ["a", "b"])


def test_tracking_config_typo_and_bad_mode(tmp_path):
    with pytest.raises(ConfigError, match=r"experiment\.tracking\.wandbb: unknown key .*did you mean 'wandb'\?"):
        load(tmp_path, "tracking: {wandbb: true}")
    with pytest.raises(ConfigError, match=r"experiment\.tracking\.mode: .*\(got 'dryrun'\)"):
        load(tmp_path, "tracking: {mode: dryrun}")
