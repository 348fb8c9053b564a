"""Reward functions: hand-computed scores, GSM8K self-consistency on the real train set, the error policy."""

from __future__ import annotations

import json

import numpy as np
import pytest

from workers import rewards as R
from workers.datasets import GSM8K_TRAIN
from workers.rewards import RewardError, ScoreResult, extract_gsm8k_answer, extract_last_number, get_reward, score


def test_registry_has_the_promised_rewards_and_names_them_on_a_miss():
    assert {"gsm8k", "gsm8k_flexible", "addition", "subtraction"} <= set(R.REWARDS)
    assert get_reward("gsm8k") is R.gsm8k
    with pytest.raises(ValueError, match=r"unknown reward 'gsm8k_strict'; known rewards: \[.*'addition'.*'gsm8k'"):
        get_reward("gsm8k_strict")
    with pytest.raises(ValueError, match="already registered"):
        R.register("gsm8k")(lambda c, a: 0.0)


@pytest.mark.parametrize("text, strict, last", [
    ("so she sold 72 clips.\n#### 72", "72", "72"),
    ("#### 1,000", "1000", "1000"),
    ("#### $10.00", "10.00", "10.00"),
    ("#### -$5 in debt", "-5", "-5"),
    ("#### 3\nwait, no\n#### 4 then 5", "4", "5"),  # the last "####" wins; flexible takes the very last number
    ("The answer is 72.", None, "72"),  # the sentence's full stop is not a decimal point
    ("paid $1,234,567.5 total", None, "1234567.5"),
    ("no numbers here ####", None, None),
])
def test_extractors(text, strict, last):
    assert extract_gsm8k_answer(text) == strict
    assert extract_last_number(text) == last


@pytest.mark.parametrize("completion, answer, strict, flexible", [
    ("The answer is 72", "72", 0.0, 1.0),  # no "####": strict refuses what flexible accepts
    ("#### 1,000", "1000", 1.0, 1.0),  # thousands separator stripped
    ("#### $10.00", "10", 1.0, 1.0),  # "$" stripped, 10.00 == 10 as Decimals
    ("#### 10", "Weng earns 12/60 = $0.2 per minute.\n#### 10", 1.0, 1.0),  # full GSM8K answer text -> 10
    ("#### -3", "-3", 1.0, 1.0),
    ("#### 3", "-3", 0.0, 0.0),
    ("#### 72 and then 8 more", "72", 1.0, 0.0),  # flexible takes the trailing 8
    ("#### 7\n#### 72", "72", 1.0, 1.0),
    ("", "72", 0.0, 0.0),
])
def test_gsm8k_strict_vs_flexible(completion, answer, strict, flexible):
    assert R.gsm8k(completion, answer) == strict
    assert R.gsm8k_flexible(completion, answer) == flexible


def test_gsm8k_rejects_an_answer_without_a_number():
    with pytest.raises(ValueError, match="neither a bare number nor text ending in '#### <number>'"):
        R.gsm8k("#### 1", "seventy-two")


def test_gsm8k_train_set_scores_its_own_answers_as_correct():
    # Self-consistency on the real data (read in place, never copied): 7,473 records, each answer
    # reduces to a number, and the strict reward gives every record's own full answer text 1.0.
    records = [json.loads(line) for line in GSM8K_TRAIN.read_text().splitlines() if line.strip()]
    assert len(records) == 7473
    answers = [r["answer"] for r in records]
    assert all(extract_gsm8k_answer(a) is not None for a in answers)
    result = score("gsm8k", answers, answers, task="gsm8k-selfcheck")
    assert result.num_errors == 0 and result.first_error is None
    np.testing.assert_array_equal(result.rewards, np.ones(7473, np.float32))


@pytest.mark.parametrize("completion, answer, expected", [
    ("8", "8", 1.0),  # exact match
    ("  8\n", "8", 1.0),  # surrounding whitespace is stripped
    ("7", "8", 0.0875),  # prefix 0; 0.1 * (1 - 1/8)
    ("9", "8", 0.0875),  # prefix 0; 0.1 * (1 - 1/8), symmetric
    ("8 because", "8", 0.5),  # right number, extra text: 0.4 * 1/1 + 0.1 * 1, still below exact
    ("12=", "12", 0.5),  # 0.4 * 2/2 + 0.1 * 1
    ("1", "12", 0.4 * 1 / 2 + 0.1 * (1 - 11 / 12)),  # 0.2083...: the first digit of two
    ("10", "18", 0.4 * 1 / 2 + 0.1 * (1 - 8 / 18)),  # 0.2555...
    ("15", "18", 0.4 * 1 / 2 + 0.1 * (1 - 3 / 18)),  # 0.2833...
    ("21", "12", 0.1 * (1 - 9 / 12)),  # 0.025: the right digits in the wrong places earn no prefix
    ("12", "4", 0.0),  # prefix 0; 0.1 * max(0, 1 - 8/4) = 0
    ("1", "0", 0.0),  # prefix 0; 0.1 * max(0, 1 - 1/max(1, 0)) = 0
    ("0x", "0", 0.5),  # 0.4 * 1/1 + 0.1 * (1 - 0/1)
    ("-2", "2", 0.0),  # prefix 0; 0.1 * max(0, 1 - 4/2) = 0
    ("8x8", "88", 0.4 * 1 / 2 + 0.1 * (1 - 80 / 88)),  # 0.2090...: leading integer 8
    ("eight", "8", 0.0),  # no leading integer, no common prefix
    ("", "8", 0.0),
    ("x8", "8", 0.0),  # the number must start the completion
])
def test_numeric_match_shaping(completion, answer, expected):
    assert R.numeric_match(completion, answer) == pytest.approx(expected, rel=1e-12)
    assert R.addition(completion, answer) == R.subtraction(completion, answer) == R.numeric_match(completion, answer)


def test_shaping_is_always_below_exact_match():
    for answer in range(0, 19):
        for pred in range(-5, 40):
            exact, trailing = R.numeric_match(str(pred), str(answer)), R.numeric_match(f"{pred}=", str(answer))
            assert exact == 1.0 if pred == answer else 0.0 <= exact <= 0.5
            assert 0.0 <= trailing <= 0.5  # extra text is never an exact match, however right the number


def test_score_returns_float32_rewards_in_order():
    result = score("addition", ["8", "7", "x"], ["8", "8", "8"], task="add")
    assert isinstance(result, ScoreResult)
    assert result.rewards.dtype == np.float32 and result.rewards.shape == (3,)
    np.testing.assert_array_equal(result.rewards, np.array([1.0, 0.0875, 0.0], np.float32))
    assert (result.num_errors, result.first_error) == (0, None)


def test_score_argument_checks():
    with pytest.raises(ValueError, match="task 'add': 2 completions but 1 answers"):
        score("addition", ["1", "2"], ["1"], task="add")
    with pytest.raises(ValueError, match="on_error must be 'fail' or 'zero', got 'skip'"):
        score("addition", ["1"], ["1"], task="add", on_error="skip")
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        score("nope", ["1"], ["1"], task="add")


@pytest.fixture
def flaky_reward():
    """Registers a reward that fails in three ways; removed again afterwards."""

    def flaky(completion: str, answer: str):
        if completion == "boom":
            raise KeyError("missing")
        if completion == "nan":
            return float("nan")
        if completion == "text":
            return "1.0"
        return 1.0

    R.register("_flaky")(flaky)
    yield "_flaky"
    del R.REWARDS["_flaky"]


def test_on_error_fail_names_task_reward_sample_and_completion(flaky_reward):
    with pytest.raises(RewardError, match=r"task 'gsm8k-a': reward '_flaky' failed on sample 1 \(completion 'boom'\): "
                                          r"KeyError: 'missing'"):
        score(flaky_reward, ["ok", "boom"], ["1", "1"], task="gsm8k-a", on_error="fail")
    with pytest.raises(RewardError, match=r"sample 0 .*ValueError: reward returned non-finite value nan"):
        score(flaky_reward, ["nan"], ["1"], task="t")
    with pytest.raises(RewardError, match=r"sample 0 .*TypeError: reward returned str '1.0', not a number"):
        score(flaky_reward, ["text"], ["1"], task="t")


def test_on_error_fail_truncates_the_completion_repr():
    completion = "z" * 500
    with pytest.raises(RewardError) as info:
        score("addition", [completion], ["not a number"], task="t")  # int("not a number") raises
    quoted = str(info.value).split("(completion ", 1)[1].split("): ", 1)[0]
    assert quoted == repr(completion)[:77] + "..." and len(quoted) == 80
    assert "invalid literal for int()" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)


def test_on_error_zero_scores_zero_counts_and_keeps_the_first_message(flaky_reward):
    result = score(flaky_reward, ["ok", "boom", "nan", "text", "ok"], ["1"] * 5, task="t", on_error="zero")
    np.testing.assert_array_equal(result.rewards, np.array([1, 0, 0, 0, 1], np.float32))
    assert result.num_errors == 3
    assert result.first_error.startswith("task 't': reward '_flaky' failed on sample 1 (completion 'boom')")


def test_bool_is_not_a_reward():
    R.register("_bool")(lambda c, a: c == a)
    try:
        with pytest.raises(RewardError, match="reward returned bool True, not a number"):
            score("_bool", ["1"], ["1"], task="t")
    finally:
        del R.REWARDS["_bool"]
