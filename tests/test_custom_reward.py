"""End to end: a reward of the user's own, in a file beside the config, drives `rlsched train` in a real process
(under Ray: the task's driver, another process in another working directory, loads the file), with prompts too
long for grpo.max_prompt_len skipped; both show, exactly, in metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlsched.observe.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]

REWARD = """
def by_answer(completion, answer, prompt):
    # A known function of the record, whatever the model writes: answer / 16, plus 0.5 when the prompt (the
    # question text) ends in "=". Multiples of 1/32 are exact in float32, so the logged means are exact too.
    return float(answer) / 16 + (0.5 if prompt.endswith("=") else 0.0)
"""

CONFIG = """
experiment: {{name: custom, output_dir: {out}}}
tasks:
  - name: sums
    model: {{path: {model}}}
    data: {{kind: jsonl, path: {data}, template: plain, shuffle: false, too_long: skip}}
    reward: {{file: rewards.py, function: by_answer}}
    grpo: {{prompts_per_step: 2, num_generations: 2, max_prompt_len: 8, max_new_tokens: 2}}
    steps: 3
"""

# One token per byte (the tiny preset's tokenizer); max_prompt_len 8: records 1 and 5 are too long.
RECORDS = [("1+1=", 2), ("what is 10 + 20?", 30), ("2+3=", 5), ("4+4=", 8), ("5+6=", 11),
           ("a long question here", 1), ("7+0=", 7)]


@pytest.mark.slow
def test_a_reward_from_a_file_beside_the_config_drives_a_run(tmp_path, tiny_model_dir):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "rewards.py").write_text(textwrap.dedent(REWARD).lstrip())
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in RECORDS))
    config = conf / "exp.yaml"
    config.write_text(CONFIG.format(out=tmp_path / "runs", model=tiny_model_dir, data=data))
    elsewhere = tmp_path / "elsewhere"  # neither the config's directory nor the repository
    elsewhere.mkdir()
    out = subprocess.run([sys.executable, "-m", "rlsched.cli", "train", str(config)], capture_output=True, text=True,
                         cwd=elsewhere, timeout=600,
                         env={**os.environ, "RLSCHED_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = read_metrics(tmp_path / "runs/custom/tasks/sums/metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # Unshuffled, 2 prompts a step, a too-long one replaced by the next record (wrapping into the next epoch):
    #   step 1: records 0, (1 skipped), 2  -> answers 2, 5   -> mean 0.5 + (2 + 5) / 32 = 0.71875, 1 skipped
    #   step 2: records 3, 4               -> answers 8, 11  -> mean 0.5 + (8 + 11) / 32 = 1.09375, 0 skipped
    #   step 3: (5 skipped), 6, 0          -> answers 7, 2   -> mean 0.5 + (7 + 2) / 32 = 0.78125, 1 skipped
    # Each prompt's 2 samples score alike, so the std is |a - b| / 32: 3/32, 3/32, 5/32.
    assert [m["reward/mean"] for m in metrics] == [0.71875, 1.09375, 0.78125]
    assert [m["reward/std"] for m in metrics] == [3 / 32, 3 / 32, 5 / 32]
    assert [m["reward/max"] for m in metrics] == [0.5 + 5 / 16, 0.5 + 11 / 16, 0.5 + 7 / 16]
    assert [m["data/skipped_too_long"] for m in metrics] == [1, 0, 1]
    assert [m["data/truncated"] for m in metrics] == [0, 0, 0]
    assert all(m["reward/errors"] == 0 for m in metrics)
