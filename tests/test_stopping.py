"""Stopping a run as a user does: real signals sent to a real `rlsched train` process (the two-task demo
under its own Ray), and what it leaves behind: exit code, no traceback, outputs, a resume that computes
what the uninterrupted run did."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

STEPS = 5
SMALL = [f"tasks.{i}.{k}" for i in (0, 1) for k in (
    f"steps={STEPS}", "checkpoint_every=0", "grpo.prompts_per_step=4", "grpo.num_generations=4",
    "grpo.mini_batch_size=8", "rollout.max_batch_size=16", "eval=null")]


def _overrides(out: Path, models: Path) -> list[str]:
    return [*SMALL, f"experiment.output_dir={out}", f"tasks.0.model.path={models / 'a'}",
            f"tasks.1.model.path={models / 's'}"]


def _args(out: Path, models: Path, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "rlsched.cli", "train", "configs/demo_multitask.yaml"]
    for s in _overrides(out, models):
        args += ["--set", s]
    return [*args, *extra]


class _Run:
    """A CLI run whose output is read as it comes (a thread drains it), so a test can wait for a line."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")))
        self._reader.start()

    def wait_for(self, text: str, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, "".join(self.lines)[-3000:]
            assert time.monotonic() < end, f"no line with {text!r} in {timeout} s:\n" + "".join(self.lines)[-3000:]
            time.sleep(0.05)

    def finish(self, timeout: float) -> tuple[int, str, float]:
        t0 = time.monotonic()
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self._reader.join(10)
        return code, "".join(self.lines), time.monotonic() - t0


def _metrics(out: Path, task: str) -> list[dict]:
    path = out / "demo-multitask" / "tasks" / task / "metrics.jsonl"
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "mem/"))}
            for line in path.read_text().splitlines()]


def test_sigterm_stops_after_the_step_in_progress_and_resume_computes_the_uninterrupted_run(tmp_path):
    models, out = tmp_path / "models", tmp_path / "stopped"
    run = _Run(_args(out, models, "--overwrite"))
    run.wait_for("[addition] step    2/")
    run.proc.send_signal(signal.SIGTERM)
    code, text, seconds = run.finish(timeout=120)
    assert code == 143, text[-3000:]
    assert seconds < 60 and "Traceback" not in text, text[-3000:]
    assert "SIGTERM: every task finishes the step it is in and saves a checkpoint there" in text
    # The tasks' lines as the command prints them: no Ray process tags, nothing a worker printed besides
    assert "[addition] step    1/5  reward" in text and "pid=" not in text, text[-3000:]
    assert "--resume" in text and "Continue with:" in text
    run_dir = out / "demo-multitask"
    for name in ("summary.json", "timeline.json", "timeline.png"):
        assert (run_dir / name).is_file(), name
    summary = json.loads((run_dir / "summary.json").read_text())["tasks"]
    for task in ("addition", "subtraction"):
        done = len(_metrics(out, task))
        assert summary[task]["status"] == ("ok" if done == STEPS else "stopped"), summary
        assert 2 <= done <= STEPS
        if done < STEPS:  # a checkpoint at the last completed step, though checkpoint_every is 0
            assert summary[task]["steps"] == done
            assert (run_dir / "tasks" / task / "checkpoints" / str(done)).is_dir(), text[-3000:]

    resumed = subprocess.run(_args(out, models, "--resume"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    # The uninterrupted run: `rlsched train --in-process` as a function in this process (no process of its own to
    # start: seconds of imports)
    from rlsched.run.experiment import train

    whole = train(ROOT / "configs" / "demo_multitask.yaml", overrides=_overrides(tmp_path / "whole", models),
                  in_process=True)
    assert {r["status"] for r in whole.values()} == {"ok"}, whole
    for task in ("addition", "subtraction"):
        got, expected = _metrics(out, task), _metrics(tmp_path / "whole", task)
        assert [m["step"] for m in got] == list(range(1, STEPS + 1))  # no step twice, none missing
        for g, e in zip(got, expected, strict=True):
            assert g.keys() == e.keys()
            for k, v in e.items():
                assert g[k] == pytest.approx(v, rel=1e-6, abs=1e-6), (task, g["step"], k)


def test_ctrl_c_once_stops_like_sigterm_with_exit_130(tmp_path):
    """SIGINT (Ctrl-C) takes the SIGTERM path above (the resume is shared); what differs is the exit code."""
    out = tmp_path / "out"
    run = _Run(_args(out, tmp_path / "models", "--overwrite"))
    run.wait_for("[addition] step    1/")
    run.proc.send_signal(signal.SIGINT)
    code, text, seconds = run.finish(timeout=120)
    assert code == 130 and seconds < 60 and "Traceback" not in text, text[-3000:]
    assert "SIGINT: every task finishes the step it is in and saves a checkpoint there" in text
    assert "Continue with:" in text and "--resume" in text
    summary = json.loads((out / "demo-multitask" / "summary.json").read_text())["tasks"]
    assert {summary[t]["status"] for t in ("addition", "subtraction")} <= {"ok", "stopped"}, summary
    assert (out / "demo-multitask" / "timeline.png").is_file()


def test_a_second_sigint_stops_at_once(tmp_path):
    run = _Run(_args(tmp_path / "out", tmp_path / "models", "--overwrite"))
    run.wait_for("[addition] actor on devices")  # running, before its first step (no need to wait for it)
    run.proc.send_signal(signal.SIGINT)
    run.wait_for("SIGINT: every task finishes")
    run.proc.send_signal(signal.SIGINT)
    code, text, seconds = run.finish(timeout=60)
    assert code == 130, text[-3000:]
    assert seconds < 30 and "Traceback" not in text, text[-3000:]
    assert "stopped at once by a second SIGINT" in text and "--resume" in text
