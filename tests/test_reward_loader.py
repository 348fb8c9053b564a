"""Your own reward (reward.function / reward.file): loading, the checks a config gets before anything runs, the
error policy at run time, and the config's paths. Real files in tmp_path, no mocks."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from rlsched.config.loading import load_config, load_configs
from rlsched.config.preflight import check_reward
from rlsched.config.schema import ConfigError
from rlsched.service.client import service_config
from workers.reward_loader import RewardLoadError, load_reward
from workers.rewards import RewardError, score

ROOT = Path(__file__).resolve().parents[1]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


GOOD = """
def exact(completion, answer):
    return float(completion.strip() == answer)


def longer(completion, answer, prompt):
    # the prompt is passed because the function asks for it
    return len(prompt) + len(completion) / 4


def batched(completions, answers):
    return [float(c == a) for c, a in zip(completions, answers)]
"""


def test_a_function_from_a_file_scores_like_a_builtin(tmp_path):
    path = _write(tmp_path / "rewards.py", GOOD)
    reward = load_reward(function="exact", file=path)
    assert reward.file == str(path) and not reward.batch and not reward.passes_prompt
    result = score(reward, ["8", " 7 ", "x"], ["8", "7", "8"], task="t")
    np.testing.assert_array_equal(result.rewards, np.array([1, 1, 0], np.float32))

    prompted = load_reward(function="longer", file=path)
    assert prompted.passes_prompt
    # len("3+5=") + len("abcd") / 4 = 4 + 1 = 5;  len("10+10=") + len("") / 4 = 6 + 0 = 6
    result = score(prompted, ["abcd", ""], ["8", "20"], task="t", prompts=["3+5=", "10+10="])
    np.testing.assert_array_equal(result.rewards, np.array([5, 6], np.float32))

    batch = load_reward(function="batched", file=path, batch=True)
    np.testing.assert_array_equal(score(batch, ["1", "2", "3"], ["1", "0", "3"], task="t").rewards, [1, 0, 1])


def test_a_function_from_an_importable_module(tmp_path, monkeypatch):
    _write(tmp_path / "myrewards/__init__.py", "")
    _write(tmp_path / "myrewards/scoring.py", GOOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = load_reward(function="myrewards.scoring:exact")
    assert reward.file == str(tmp_path / "myrewards/scoring.py")
    np.testing.assert_array_equal(score(reward, ["1", "2"], ["1", "1"], task="t").rewards, [1, 0])
    with pytest.raises(RewardLoadError, match=r"reward module 'nosuchpkg.scoring' cannot be imported: "
                                              r"ModuleNotFoundError: No module named 'nosuchpkg'; install it or put"):
        load_reward(function="nosuchpkg.scoring:exact")
    with pytest.raises(RewardLoadError, match=r"reward module 'myrewards.scoring' \(.*scoring.py\) has no attribute "
                                              r"'nope'"):
        load_reward(function="myrewards.scoring:nope")


def test_a_syntax_error_names_the_file_and_line(tmp_path):
    path = _write(tmp_path / "rewards.py", """
        def exact(completion, answer):
            return 1.0
        def broken(completion, answer)
            return 0.0
        """)
    with pytest.raises(RewardLoadError) as info:
        load_reward(function="exact", file=path)
    assert str(info.value) == f"reward file {path} line 3: SyntaxError: expected ':'"


def test_an_error_while_importing_the_file_names_its_line(tmp_path):
    path = _write(tmp_path / "rewards.py", """
        import math

        TABLE = {"a": 1}
        SCALE = TABLE["b"]
        """)
    with pytest.raises(RewardLoadError) as info:
        load_reward(function="exact", file=path)
    assert str(info.value) == f"reward file {path} line 4: KeyError: 'b'"
    with pytest.raises(RewardLoadError, match=r"reward file .*missing.py does not exist"):
        load_reward(function="exact", file=tmp_path / "missing.py")
    with pytest.raises(RewardLoadError, match=r"reward file .* is a directory, not a Python file"):
        load_reward(function="exact", file=tmp_path)


def test_a_missing_or_uncallable_name_lists_what_the_file_defines(tmp_path):
    path = _write(tmp_path / "rewards.py", GOOD + "\nWEIGHT = 2\n")
    with pytest.raises(RewardLoadError) as info:
        load_reward(function="exacct", file=path)
    assert str(info.value) == f"reward file {path} has no function 'exacct'; it defines: batched, exact, longer"
    with pytest.raises(RewardLoadError, match=r"'WEIGHT' is a int, not a function"):
        load_reward(function="WEIGHT", file=path)


@pytest.mark.parametrize("source, batch, expected", [
    ("def f(completion):\n    return 1.0\n", False,
     r"reward function f\(completion\) \(.*rewards.py line 1\) cannot be called as f\(completion, answer\): "
     r"too many positional arguments; a reward is fn\(completion: str, answer: str\) -> float"),
    ("def f(completion, answer, weight):\n    return 1.0\n", False,
     r"f\(completion, answer, weight\) .* missing a required argument: 'weight'"),
    ("def f(completion, answer, prompt):\n    return 1.0\n", True,  # batch: it is `prompts`, so `prompt` is unmet
     r"cannot be called as f\(completions, answers\): missing a required argument: 'prompt'"),
    ("async def f(completion, answer):\n    return 1.0\n", False, r"'f' is an async function"),
])
def test_wrong_arity_names_the_function_and_its_signature(tmp_path, source, batch, expected):
    path = _write(tmp_path / "rewards.py", source)
    with pytest.raises(RewardLoadError, match=expected):
        load_reward(function="f", file=path, batch=batch)


RAISES = """
def flaky(completion, answer):
    if completion == "boom":
        return 1 / 0
    return 1.0


def short(completions, answers):
    return [1.0] * (len(completions) - 1)


def not_a_list(completions, answers):
    return 1.0


def batch_raises(completions, answers):
    raise RuntimeError("judge offline")
"""


def test_a_reward_that_raises_is_handled_by_on_error_and_names_the_line(tmp_path):
    path = _write(tmp_path / "rewards.py", RAISES)
    reward = load_reward(function="flaky", file=path)
    with pytest.raises(RewardError) as info:
        score(reward, ["ok", "boom"], ["1", "1"], task="t", on_error="fail")
    assert str(info.value) == (f"task 't': reward 'flaky' ({path}) failed on sample 1 (completion 'boom'): "
                               f"ZeroDivisionError: division by zero (at {path}:3)")
    result = score(reward, ["ok", "boom", "boom", "ok"], ["1"] * 4, task="t", on_error="zero")
    np.testing.assert_array_equal(result.rewards, [1, 0, 0, 1])
    assert result.num_errors == 2 and result.first_error == str(info.value)

    batch = load_reward(function="batch_raises", file=path, batch=True)
    result = score(batch, ["a", "b", "c"], ["1"] * 3, task="t", on_error="zero")
    np.testing.assert_array_equal(result.rewards, [0, 0, 0])
    assert result.num_errors == 3
    assert result.first_error == (f"task 't': reward 'batch_raises' ({path}) failed on the batch of 3 samples: "
                                  f"RuntimeError: judge offline (at {path}:16)")


def test_a_batch_of_the_wrong_length_or_type_is_refused_whatever_on_error_says(tmp_path):
    path = _write(tmp_path / "rewards.py", RAISES)
    for policy in ("fail", "zero"):
        with pytest.raises(RewardError, match=r"batch reward 'short' .* returned 2 values for 3 completions; it must "
                                              "return one number per completion, in order"):
            score(load_reward(function="short", file=path, batch=True), ["a", "b", "c"], ["1"] * 3, task="t",
                  on_error=policy)
        with pytest.raises(RewardError, match=r"batch reward 'not_a_list' .* returned float, not a list of 3 numbers"):
            score(load_reward(function="not_a_list", file=path, batch=True), ["a", "b", "c"], ["1"] * 3, task="t",
                  on_error=policy)


# ---------------------------------------------------------------- the config


CONFIG = """
experiment: {{name: custom, output_dir: {out}}}
tasks:
  - name: addition
    model: {{path: {model}}}
    data: {{kind: addition, template: plain}}
    reward: {reward}
    grpo: {{prompts_per_step: 2, num_generations: 2, max_prompt_len: 16, max_new_tokens: 4}}
    steps: 3
"""


def _config(path: Path, reward: str, model: Path, out: Path) -> Path:
    return _write(path, CONFIG.format(reward=reward, model=model, out=out))


def test_a_relative_file_is_relative_to_the_config_not_the_working_directory(tmp_path, tiny_model_dir, monkeypatch):
    _write(tmp_path / "conf/rewards.py", GOOD)
    path = _config(tmp_path / "conf/exp.yaml", "{file: rewards.py, function: exact}", tiny_model_dir, tmp_path)
    monkeypatch.chdir(tmp_path)  # elsewhere: the file is found beside the config all the same
    cfg = load_config("conf/exp.yaml")
    assert cfg.tasks[0].reward.file == str(tmp_path / "conf/rewards.py")
    check_reward(cfg.tasks[0], 0)
    # two configs: each task's file relative to its own config's directory
    _write(tmp_path / "other/rewards.py", GOOD)
    _config(tmp_path / "other/exp.yaml", "{file: rewards.py, function: exact}", tiny_model_dir, tmp_path)
    both = load_configs(["conf/exp.yaml", "other/exp.yaml"], ["tasks.1.name=second"])
    assert [t.reward.file for t in both.tasks] == [str(tmp_path / d / "rewards.py") for d in ("conf", "other")]
    # an absolute path stays as it is; the resolved config round-trips
    absolute = tmp_path / "other/rewards.py"
    cfg = load_config(path, [f"tasks.0.reward.file={absolute}"])
    assert cfg.tasks[0].reward.file == str(absolute)


@pytest.mark.parametrize("reward, expected", [
    ("{name: addition, function: 'a:b'}", "tasks.0.reward.name: give reward.name or reward.function, not both"),
    ("{on_error: zero}", "tasks.0.reward.function: give reward.name (a built-in: addition"),
    ("{name: addition, file: r.py}", "tasks.0.reward.file: reward.file goes with reward.function, not a built-in"),
    ("{function: exact}", "tasks.0.reward.function: must be 'pkg.module:fn' (an importable module), or a function"),
    ("{function: 'a:b', file: r.py}", "tasks.0.reward.function: with reward.file, the name of a function"),
])
def test_the_reward_section_takes_a_name_or_a_function(tmp_path, reward, expected):
    path = _config(tmp_path / "exp.yaml", reward, tmp_path, tmp_path)
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        load_config(path)


def test_submit_checks_the_reward_on_the_client_side(tmp_path, tiny_model_dir):
    """`rlsched submit` refuses it before anything is sent (service_config is submit's check; no service needed)."""
    _write(tmp_path / "rewards.py", "def one(completion):\n    return 1.0\n")
    path = _config(tmp_path / "exp.yaml", "{file: rewards.py, function: one}", tiny_model_dir, tmp_path / "runs")
    with pytest.raises(ConfigError) as info:
        service_config([path], [], None, {})
    assert str(info.value).startswith(f"tasks.0.reward.function: reward function one(completion) ({tmp_path}/"
                                      "rewards.py line 1) cannot be called as one(completion, answer)")
    assert not (tmp_path / "runs").exists()


def test_train_refuses_a_broken_reward_file_before_ray_starts(tmp_path, tiny_model_dir):
    """The CLI in a real process: one line naming file and line, exit 2, no run directory."""
    import subprocess
    import sys

    reward = _write(tmp_path / "rewards.py", "def exact(completion, answer):\n    return (1.0\n")
    path = _config(tmp_path / "exp.yaml", "{file: rewards.py, function: exact}", tiny_model_dir, tmp_path / "runs")
    out = subprocess.run([sys.executable, "-m", "rlsched.cli", "train", str(path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, env={**os.environ, "RLSCHED_HOME": str(tmp_path / "home")})
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (f"error: tasks.0.reward.file: reward file {reward} line 2: "
                                                   "SyntaxError: '(' was never closed")
    assert "Traceback" not in out.stderr and not (tmp_path / "runs").exists()
    assert yaml.safe_load(path.read_text())["tasks"][0]["reward"]["file"] == "rewards.py"  # the config is untouched
