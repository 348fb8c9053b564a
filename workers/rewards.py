"""Reward functions: pure `fn(completion, answer) -> float`, registered by name, scored under an error policy.

Design decisions:
- A reward is a pure function of two strings: the decoded completion (special tokens already stripped)
  and the dataset's ground-truth answer. No tokenizer, no model, no config: easy to test by hand and
  safe to run on the host between ROLLOUT and TRAIN, outside any lock.
- Numbers compare as `Decimal`, not float: "10.00" equals "10" exactly and large GSM8K answers
  (109,200,000) never meet float rounding.
- `gsm8k` is strict (only the last `#### N` counts), the format GSM8K answers use; `gsm8k_flexible`
  takes the last number anywhere, for models that were never taught the format. Strict is the
  default recipe: it rewards the format the answers are checked in, not a lucky trailing number.
- Synthetic tasks (`addition`, `subtraction`) share `numeric_match`: 1.0 for an exact match, otherwise
  at most 0.5 of shaping, so stopping exactly after the answer always pays more than any near miss. A tiny
  model that starts from random weights almost never hits the exact answer (one digit of a 384-row vocabulary),
  so the shaping gives GRPO a gradient from step one. It is 0.4 x the share of the answer's characters the
  completion starts with (its common prefix: "1" for "12" earns 0.2, "12=" 0.4) plus 0.1 x the closeness of
  the leading integer. The prefix pays only the answer's own digits in their places; closeness alone (0.5 x
  it, the first design) is maximised on average by one constant near the middle of the answers, and the demo's
  models learned to answer "9" to every problem (0/100 exact). Credit for the right digits anywhere would pay
  the wrong number that holds them. Any partial credit still has a best constant (here the commonest leading
  digit, "1" for 45 of the 100 sums): a model that cannot yet tell prompts apart collapses onto it, which a KL
  term (grpo.beta) delays; the credit only makes the constant worth less than the answer. Over the tiny-digits
  preset's 16 tokens a random policy hits exact answers (~1 sample in 100 at the demo's two new tokens), and with
  beta 0.1 the demo's models learn the operations from this reward (configs/demo_multitask.yaml).
- `score` runs a reward over a batch under an explicit error policy: "fail" raises `RewardError`
  naming the task, reward, sample and completion; "zero" scores the sample 0.0 and counts it, so one
  odd completion cannot kill a long multi-task run while the count still shows up in the metrics.
  Either way the message ends with the file:line that raised, in the reward's own file where it has one.
- A `Reward` is what `score` calls: a built-in (`builtin(name)`) or the user's own function
  (workers.reward_loader). A batch reward (`batch=True`) is called once per step with every completion,
  `fn(completions, answers) -> list[float]`: for rewards that pay per call (a judge model, a sandbox).
  A batch that returns the wrong number of values is a bug in the function, refused whatever on_error says.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
import traceback
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Literal

import numpy as np

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}

# A number after "$" is removed: an optional sign, either comma-grouped thousands ("1,000") or plain
# digits, and an optional decimal part. It must start with a digit, so "72." ends a sentence, not a number.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_STRICT_RE = re.compile(r"####\s*(" + _NUMBER + ")")
_LEADING_INT_RE = re.compile(r"-?\d+")
_MAX_REPR = 80  # longest completion repr an error message quotes


class RewardError(RuntimeError):
    """A reward function failed (or returned a non-finite / non-number value) under on_error="fail"."""


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: add `fn` to REWARDS under `name` (names are unique)."""

    def add(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = fn
        return fn

    return add


def get_reward(name: str) -> RewardFn:
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; known rewards: {sorted(REWARDS)}") from None


# ---------------------------------------------------------------- number extraction


def _clean(text: str) -> str:
    # "$" never changes a value and may sit between the sign and the digits ("-$5").
    return text.replace("$", "")


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last `#### ` in text, commas and "$" stripped ("#### $1,000" -> "1000"); None if absent."""
    matches = _STRICT_RE.findall(_clean(text))
    return matches[-1].replace(",", "") if matches else None


def extract_last_number(text: str) -> str | None:
    """The last number anywhere in text, commas and "$" stripped ("so $1,000." -> "1000"); None if none."""
    matches = _NUMBER_RE.findall(_clean(text))
    return matches[-1].replace(",", "") if matches else None


def parse_number(text: str) -> Decimal | None:
    """A whole string as a number ("1,000", "$10.00", " -3 "), or None if it is not exactly one number."""
    s = _clean(text).strip()
    if not re.fullmatch(_NUMBER, s):
        return None
    try:
        return Decimal(s.replace(",", ""))
    except InvalidOperation:  # unreachable for strings matching _NUMBER, kept as a guard
        return None


def gsm8k_target(answer: str) -> Decimal:
    """The ground-truth number: a full GSM8K answer text ending in `#### N`, or a bare number."""
    found = extract_gsm8k_answer(answer) if "####" in answer else answer
    value = parse_number(found) if found is not None else None
    if value is None:
        raise ValueError(f"answer {answer[-40:]!r} is neither a bare number nor text ending in '#### <number>'")
    return value


def _equal(pred: str | None, answer: str) -> float:
    return 1.0 if pred is not None and Decimal(pred) == gsm8k_target(answer) else 0.0


@register("gsm8k")
def gsm8k(completion: str, answer: str) -> float:
    return _equal(extract_gsm8k_answer(completion), answer)


@register("gsm8k_flexible")
def gsm8k_flexible(completion: str, answer: str) -> float:
    return _equal(extract_last_number(completion), answer)


# ---------------------------------------------------------------- synthetic arithmetic


def numeric_match(completion: str, answer: str) -> float:
    """1.0 when the stripped completion is exactly the answer; else 0.4 * prefix + 0.1 * closeness (< 0.5).

    prefix = (characters the completion shares with the answer from the start) / len(answer), in [0, 1];
    closeness = max(0, 1 - |pred - answer| / max(1, |answer|)) of the completion's leading integer, 0 when it
    does not start with one. Relative error keeps the scale sensible across answer sizes; max(1, .) avoids /0.
    """
    text, target = completion.strip(), answer.strip()
    true = int(target)  # first: a non-integer answer is a data bug that score() must report on every sample
    if text == target:
        return 1.0
    prefix = len(os.path.commonprefix([text, target])) / len(target)
    m = _LEADING_INT_RE.match(text)
    closeness = 0.0 if m is None else max(0.0, 1.0 - abs(int(m.group()) - true) / max(1, abs(true)))
    return 0.4 * prefix + 0.1 * closeness


@register("addition")
def addition(completion: str, answer: str) -> float:
    return numeric_match(completion, answer)


@register("subtraction")
def subtraction(completion: str, answer: str) -> float:
    return numeric_match(completion, answer)


# ---------------------------------------------------------------- batch scoring


@dataclasses.dataclass(frozen=True)
class Reward:
    """A reward function as `score` calls it."""

    fn: Callable  # per sample: fn(completion, answer[, prompt=]) -> float; batch: fn(completions, answers[, prompts=])
    label: str  # how messages name it: "'gsm8k'", or "'exact' (/home/me/rewards.py)"
    batch: bool = False  # called once with every completion of the step, returning one number per completion
    passes_prompt: bool = False  # fn declares `prompt` (`prompts` when batch): the question text is passed too
    file: str | None = None  # the file fn is defined in: a raising frame there is the one an error names


def builtin(name: str) -> Reward:
    """The registered reward `name` (ValueError naming the known ones otherwise)."""
    fn = get_reward(name)
    return Reward(fn=fn, label=repr(name), file=getattr(getattr(fn, "__code__", None), "co_filename", None))


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    rewards: np.ndarray  # float32 (N,), one per completion; 0.0 where the reward failed under on_error="zero"
    num_errors: int  # samples whose reward raised or returned a non-finite / non-number value
    first_error: str | None  # message of the first such failure, None when num_errors == 0


def _short_repr(text: str) -> str:
    r = repr(text)
    return r if len(r) <= _MAX_REPR else r[: _MAX_REPR - 3] + "..."


def _check_value(value: object) -> float:
    # bool is an int subclass, but a reward returning True is almost surely a missing float(): reject it.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"reward returned {type(value).__name__} {value!r}, not a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"reward returned non-finite value {out}")
    return out


def raised_at(err: BaseException, file: str | None = None) -> str | None:
    """'path:line' of the frame that raised `err`: the innermost frame in `file` when one is, else the innermost
    frame of all (the reward's own line is more use to its author than one deep inside a library it called)."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return None
    own = [f for f in frames if file is not None and f.filename == file]
    frame = (own or frames)[-1]
    return f"{frame.filename}:{frame.lineno}"


def _failure(err: Exception, reward: Reward) -> str:
    where = raised_at(err, reward.file)
    return f"{type(err).__name__}: {err}" + (f" (at {where})" if where else "")


def score(reward: str | Reward, completions: Sequence[str], answers: Sequence[str], *, task: str,
          on_error: Literal["fail", "zero"] = "fail", prompts: Sequence[str] | None = None) -> ScoreResult:
    """Score completions[i] against answers[i] (and prompts[i], the question, for a reward that asks for it)
    with a reward (a `Reward`, or a built-in's name) under an error policy (see module doc)."""
    if on_error not in ("fail", "zero"):
        raise ValueError(f"on_error must be 'fail' or 'zero', got {on_error!r}")
    if len(completions) != len(answers) or (prompts is not None and len(prompts) != len(completions)):
        given = "" if prompts is None else f" and {len(prompts)} prompts"
        raise ValueError(f"task {task!r}: {len(completions)} completions but {len(answers)} answers{given}")
    reward = builtin(reward) if isinstance(reward, str) else reward
    if reward.passes_prompt and prompts is None:
        raise ValueError(f"task {task!r}: reward {reward.label} takes the prompts, and none were given")
    n = len(completions)
    rewards = np.zeros(n, dtype=np.float32)
    num_errors, first_error = 0, None

    def failed(i: int, err: Exception) -> None:
        nonlocal num_errors, first_error
        msg = (f"task {task!r}: reward {reward.label} failed on sample {i} (completion "
               f"{_short_repr(completions[i])}): {_failure(err, reward)}")
        if on_error == "fail":
            raise RewardError(msg) from err
        num_errors += 1
        first_error = first_error or msg

    if reward.batch:
        values, error = _call_batch(reward, completions, answers, prompts, task=task, on_error=on_error)
        if error is not None:  # the call raised, under on_error="zero": every sample scores 0
            return ScoreResult(rewards=rewards, num_errors=n, first_error=error)
        for i, value in enumerate(values):
            try:
                rewards[i] = _check_value(value)
            except Exception as e:  # noqa: BLE001 - the policy decides
                failed(i, e)
        return ScoreResult(rewards=rewards, num_errors=num_errors, first_error=first_error)
    for i, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
        try:
            extra = {"prompt": prompts[i]} if reward.passes_prompt else {}
            rewards[i] = _check_value(reward.fn(completion, answer, **extra))
        except Exception as e:  # noqa: BLE001 - any failure of user reward code is handled by the policy
            failed(i, e)
    return ScoreResult(rewards=rewards, num_errors=num_errors, first_error=first_error)


def _call_batch(reward: Reward, completions: Sequence[str], answers: Sequence[str], prompts: Sequence[str] | None,
                *, task: str, on_error: str) -> tuple[Sequence, str | None]:
    """A batch reward's values, checked to be one per completion; or, when it raised under on_error="zero",
    ([], the message)."""
    n = len(completions)
    try:
        extra = {"prompts": list(prompts)} if reward.passes_prompt else {}
        values = reward.fn(list(completions), list(answers), **extra)
    except Exception as e:  # noqa: BLE001 - the policy decides
        msg = f"task {task!r}: reward {reward.label} failed on the batch of {n} samples: {_failure(e, reward)}"
        if on_error == "fail":
            raise RewardError(msg) from e
        return [], msg
    if isinstance(values, np.ndarray):
        values = values.tolist() if values.ndim == 1 else values
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise RewardError(f"task {task!r}: batch reward {reward.label} returned {type(values).__name__}, not a list "
                          f"of {n} numbers (one per completion, in order)")
    if len(values) != n:
        raise RewardError(f"task {task!r}: batch reward {reward.label} returned {len(values)} values for {n} "
                          "completions; it must return one number per completion, in order")
    return values, None
