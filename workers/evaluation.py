"""Held-out evaluation: which problems score a task (its split), and what the score is.

Design decisions:
- **The evaluation split is disjoint from training by construction.** GSM8K scores on its test file (shipped
  with rlsched); a user's jsonl/parquet names its own file (`eval.path`); the arithmetic tasks hold one problem in
  ten out by a rule of the problem's text (workers.data.heldout), and their training draws never land on one.
- **A problem is solved when its reward reaches `correct`** (the reward's maximum: 1.0 for every built-in
  reward, whose shaping terms stay below it). Accuracy is the share of samples that are solved (with one greedy
  sample per problem, the share of problems); pass@n the share of problems with at least one of n solved; the
  mean reward is reported beside them because it is what training climbs.
- **The problems are a fixed list**: the split's order, or its first `limit` problems after a shuffle with a
  fixed seed, the same for every task, seed and run, so two runs' accuracies compare on the same problems.
- Host-side numpy only: the task's driver scores (it never imports JAX).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from workers import data as D

Split = Literal["test", "train", "all"]
_ORDER_SEED = 20_260_101  # the shuffle that picks `limit` problems: one fixed order for every run


def problems(kind: str, split: Split = "test", *, limit: int | None = None, path: str | None = None,
             train_path: str | None = None, max_operand: int = 9, question_field: str = "question",
             answer_field: str = "answer") -> D.PromptDataset:
    """The problems a task of data `kind` is scored on. `split` "test" is held out of training; "train" and "all"
    (both) score what it trained on, for a memorisation check. `path`: the held-out file of a jsonl/parquet task
    (for gsm8k, None is the shipped test split); `train_path`: its training file (data.path). `limit`: the first
    `limit` problems of a fixed shuffle (None: all of them)."""
    if kind in ("addition", "subtraction"):
        found = D.make_source(kind, max_operand=max_operand).problems(split)
    else:
        found = _files(kind, split, path, train_path, question_field, answer_field)
    if len(found) == 0:
        raise D.DataError(f"the {split} split of data kind {kind!r} holds no problem"
                          + (f" (max_operand {max_operand}: raise it)" if kind in ("addition", "subtraction") else ""))
    if limit is not None and limit < len(found):
        order = np.random.default_rng(_ORDER_SEED).permutation(len(found))[:limit]
        return D.PromptDataset([found[int(i)] for i in order], name=f"{found.name}[:{limit}]")
    return found


def _files(kind: str, split: Split, path: str | None, train_path: str | None, question_field: str,
           answer_field: str) -> D.PromptDataset:
    def load(file: str | None, which: str) -> D.PromptDataset:
        if kind == "gsm8k":
            from workers.datasets import GSM8K_TEST

            return D.load_gsm8k(GSM8K_TEST if file is None and which == "test" else file)
        if file is None:
            raise D.DataError(f"data kind {kind!r} has no built-in {which} split: name the held-out file in "
                              "eval.path (the same fields as data.path)")
        return D.make_source(kind, path=file, question_field=question_field, answer_field=answer_field)

    if split == "test":
        return load(path, "test")
    train = load(train_path, "train")
    if split == "train":
        return train
    test = load(path, "test")
    return D.PromptDataset(list(train) + list(test), name=f"{train.name}+{test.name}")


def scores(rewards: np.ndarray, samples: int, *, correct: float = 1.0) -> dict[str, Any]:
    """rewards (P * n,) problem-major, n = `samples` per problem -> the metrics of one evaluation:
    eval/accuracy (share of samples with reward >= `correct`), eval/pass@n (share of problems with at least one),
    eval/reward (mean), eval/problems (P)."""
    rewards = np.asarray(rewards, np.float64)
    if rewards.ndim != 1 or rewards.size == 0 or rewards.size % samples:
        raise ValueError(f"rewards must be (problems * {samples},), got shape {rewards.shape}")
    solved = (rewards >= correct).reshape(-1, samples)  # (P, n)
    return {"eval/accuracy": float(solved.mean()), f"eval/pass@{samples}": float(solved.any(axis=1).mean()),
            "eval/reward": float(rewards.mean()), "eval/problems": int(solved.shape[0])}
