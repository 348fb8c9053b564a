"""A run directory has an owner (rlsched.rundir.lock): real `rlsched train` processes on one run directory.

A live run is held still with SIGSTOP while the others try its directory (a stopped process keeps its lock, and
no timing decides the outcome), then let go with SIGCONT."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_stopping import _Run as _CliRun

from rlsched.rundir.lock import LOCK_NAME, RunDirLocked, RunLock, read_holder

ROOT = Path(__file__).resolve().parents[1]


def _train(out: Path, model: Path, steps: int, *extra: str) -> list[str]:
    sets = [f"experiment.output_dir={out}", f"tasks.0.model.path={model}", f"tasks.0.steps={steps}",
            "tasks.0.checkpoint_every=1", "tasks.0.grpo.prompts_per_step=4", "tasks.0.grpo.num_generations=4",
            "tasks.0.grpo.mini_batch_size=16", "tasks.0.rollout.max_batch_size=16"]
    args = [sys.executable, "-m", "rlsched.cli", "train", "configs/demo_addition.yaml", "--in-process"]
    for s in sets:
        args += ["--set", s]
    return [*args, *extra]


class _Run(_CliRun):
    """A CLI run read as it comes (tests/test_stopping.py); one the test stopped with SIGSTOP is continued before
    it is killed."""

    def finish(self, timeout: float = 240) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.kill()
        self._reader.join(10)
        return code, "".join(self.lines)


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "tasks" / "addition" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_live_run_owns_its_directory_against_a_second_train_resume_and_overwrite(tmp_path, tiny_model_dir):
    out, steps = tmp_path / "out", 4
    run_dir = out / "demo-addition"
    first = _Run(_train(out, tiny_model_dir, steps))
    try:
        first.wait_for("[addition] step    1/")
        os.kill(first.proc.pid, signal.SIGSTOP)  # alive, holding its lock, writing nothing
        holder = read_holder(run_dir)
        assert holder["pid"] == first.proc.pid and holder["host"] == socket.gethostname(), holder
        # A plain second train, one that resumes (which would append its own rows) and an overwrite (which would
        # delete the directory under the first): each refused, exit 2, one line naming the owner and the way out.
        for extra, words in (((), "a second run would write into it"), (("--resume",), "a second run would write"),
                             (("--overwrite",), "--overwrite would delete it under that run")):
            second = subprocess.run(_train(out, tiny_model_dir, steps, *extra), cwd=ROOT, capture_output=True,
                                    text=True, timeout=240)
            assert second.returncode == 2, (extra, second.stdout[-2000:], second.stderr[-2000:])
            errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr[-2000:]
            assert f"is in use by a live run: pid {first.proc.pid} on host {socket.gethostname()}" in errors[0]
            assert words in errors[0] and f"`kill {first.proc.pid}`" in errors[0], errors[0]
            assert "[addition] step" not in second.stdout, second.stdout[-2000:]
        assert (run_dir / "tasks" / "addition" / "checkpoints").is_dir()  # the overwrite deleted nothing
    finally:
        os.kill(first.proc.pid, signal.SIGCONT)
    code, text = first.finish()
    assert code == 0, text[-3000:]
    assert _steps(run_dir) == list(range(1, steps + 1)), text[-3000:]  # one row per step: no second writer
    assert read_holder(run_dir) == {}  # ended cleanly: the lock file is empty, the directory free
    again = subprocess.run(_train(out, tiny_model_dir, steps + 1, "--resume"), cwd=ROOT, capture_output=True,
                           text=True, timeout=240)
    assert again.returncode == 0 and "takes it over" not in again.stdout, again.stderr[-2000:]
    assert _steps(run_dir) == list(range(1, steps + 2))


@pytest.mark.slow
def test_the_lock_of_a_killed_run_is_taken_over_with_a_note(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    run_dir = out / "demo-addition"
    killed = _Run(_train(out, tiny_model_dir, 50))
    killed.wait_for("[addition] step    1/")
    killed.proc.kill()  # SIGKILL: no handler runs, its record stays in run.lock; the kernel drops the flock
    killed.finish()
    assert read_holder(run_dir)["pid"] == killed.proc.pid
    after = subprocess.run(_train(out, tiny_model_dir, 2, "--overwrite"), cwd=ROOT, capture_output=True, text=True,
                           timeout=240)
    assert after.returncode == 0, after.stderr[-2000:]
    notes = [line for line in after.stdout.splitlines() if "takes it over" in line]
    assert len(notes) == 1 and f"pid {killed.proc.pid} on host" in notes[0] and "no longer running" in notes[0], \
        after.stdout[-2000:]
    assert _steps(run_dir) == [1, 2]
    assert (run_dir / LOCK_NAME).is_file() and read_holder(run_dir) == {}


def test_one_process_holds_the_lock_and_a_removed_directory_is_locked_anew(tmp_path):
    """In-process mechanics: a second holder is refused, release frees it, and a lock file deleted under a holder
    does not let two processes believe they own one path."""
    run_dir = tmp_path / "run"
    with RunLock(run_dir, command="first"):
        # flock is per open file description: a second open in this same process conflicts like another process
        with pytest.raises(RunDirLocked, match=rf"pid {os.getpid()} on host .* \(`first`\)") as refused:
            RunLock(run_dir, overwrite=True).acquire()
        assert refused.value.holder["command"] == "first"
        assert "--overwrite would delete it" in str(refused.value)
    notes: list[str] = []
    with RunLock(run_dir, echo=notes.append):
        assert notes == []  # a clean release leaves nothing to take over
    held = RunLock(run_dir, command="old").acquire()
    (run_dir / LOCK_NAME).unlink()  # someone removed the file (or the directory) under the holder
    with RunLock(run_dir, command="new"):  # locks the file the path names now
        assert read_holder(run_dir)["command"] == "new"
    held.release()
