"""What a person sees at a terminal: `rlsched train configs/demo_multitask.yaml` in a real pseudo-terminal,
two small steps of each task. A live row per task, the tasks' lines above it, and nothing else: no Ray
process tags, no warnings, no traceback."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
TASKS = ("addition", "subtraction")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


def _in_a_terminal(args: list[str], timeout: float) -> tuple[int, str]:
    """Run `args` with stdin, stdout and stderr on a 160x50 pseudo-terminal; (exit code, what it showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "NO_COLOR", "TERM")} | {"TERM": "xterm-256color"}
    proc = subprocess.Popen(args, cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks, end = [], time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=max(1.0, end - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return code, b"".join(chunks).decode(errors="replace")


def test_a_run_at_a_terminal_shows_live_rows_and_nothing_but_the_tasks_lines(tmp_path):
    sets = [f"experiment.output_dir={tmp_path}"]
    for i, name in enumerate(TASKS):
        sets += [f"tasks.{i}.{k}" for k in ("steps=2", "grpo.prompts_per_step=4", "grpo.num_generations=4",
                                            "grpo.mini_batch_size=8", "rollout.max_batch_size=16", "eval=null")]
        sets += [f"tasks.{i}.model.path={tmp_path / 'models' / name}"]
    args = [sys.executable, "-m", "rlsched.cli", "train", "configs/demo_multitask.yaml"]
    for s in sets:
        args += ["--set", s]
    code, shown = _in_a_terminal(args, timeout=420)
    text = ANSI.sub("", shown)
    assert code == 0, text[-4000:]
    # The live table: its header and a finished row per task (rich redraws it; the last drawing stays)
    assert re.search(r"task\s+state\s+step\s+reward\s+phase\s+step time\s+ETA", text), text[-4000:]
    for name in TASKS:
        assert re.search(rf"{name}\s+ended\s+2/2\s", text), (name, text[-4000:])
        assert f"[{name}] step    2/2  reward" in text  # the plain lines, printed above the table
    # Nothing a person should not have to read
    for noise in ("pid=", "(raylet)", "(TaskDriver", "Traceback", "arning", "os.fork", "blocking ray.get",
                  "Started a local Ray instance"):
        assert noise not in text, (noise, text[-4000:])
    run = tmp_path / "demo-multitask"
    summary = json.loads((run / "summary.json").read_text())["tasks"]
    assert {name: summary[name]["status"] for name in TASKS} == dict.fromkeys(TASKS, "ok")
    for name in TASKS:
        assert len((run / "tasks" / name / "metrics.jsonl").read_text().splitlines()) == 2
    log = (run / "run.log").read_text()  # the same lines, timed, in the run's log
    assert all(f"[{name}] step    2/2  reward" in log for name in TASKS)
