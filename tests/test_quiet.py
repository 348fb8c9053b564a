"""What the CLI does not say: no torch notice from transformers, no traceback when the reader of its output goes
away, and a directory where a file is expected named as such (not "does not exist")."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.data import DataError, load_jsonl

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "rlsched.cli"]


def test_a_closed_stdout_pipe_ends_the_command_silently_with_exit_0():
    # The read end is closed before the command starts, so its first write to stdout fails with EPIPE for certain
    # (`rlsched plan | head -0`, without the race of when head exits).
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([*CLI, "plan", "configs/demo_addition.yaml"], cwd=ROOT, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]


def test_a_broken_pipe_that_is_not_stdout_is_still_an_error(monkeypatch, capsys):
    from rlsched import cli

    def broken(argv):
        raise BrokenPipeError("a socket of its own")

    monkeypatch.setattr(cli, "_main", broken)
    with pytest.raises(BrokenPipeError, match="a socket of its own"):
        cli.main(["status"])


def test_a_directory_given_for_a_file_is_named_a_directory(tmp_path):
    folder = tmp_path / "prompts"
    folder.mkdir()
    with pytest.raises(DataError, match="is a directory"):
        load_jsonl(folder)
    # Through the CLI: a config path, and a data path (checked before anything starts), each one line, exit 2.
    done = subprocess.run([*CLI, "plan", str(folder)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == f"error: config file {folder} is a directory; name an " \
                                                            "experiment YAML (see configs/)", done.stderr
    done = subprocess.run([*CLI, "train", "configs/demo_addition.yaml", "--in-process",
                           "--set", "tasks.0.data.kind=jsonl", "--set", f"tasks.0.data.path={folder}",
                           "--set", f"experiment.output_dir={tmp_path / 'runs'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert f"tasks.0.data.path: {folder} is a directory" in errors[0] and "does not exist" not in errors[0]
    assert not (tmp_path / "runs").exists()


def test_transformers_torch_notice_is_dropped_and_its_other_records_pass():
    """The notice itself shows only where torch is absent: .ci/plain_stage.sh checks a plain install's commands
    for it; here the filter rlsched puts on transformers' logger is checked record by record."""
    import workers.models.tokenizer  # noqa: F401 - installs the filter

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    logger, keep = logging.getLogger("transformers"), Keep()
    logger.addHandler(keep)  # a logger's filters run before its handlers (transformers does not propagate)
    try:
        logger.warning("PyTorch was not found. Models won't be available and only tokenizers, configuration and "
                       "file/data utilities can be used.")
        logger.warning("something else transformers has to say")
    finally:
        logger.removeHandler(keep)
    assert keep.messages == ["something else transformers has to say"]
