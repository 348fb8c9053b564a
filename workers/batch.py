"""A GRPO step's training batch, built on the host (numpy only: the task's driver pads it before it
asks for the TRAIN lock, and the driver never imports JAX).

Sequences are right-padded [prompt, completion, pad] to a length bucket so a run compiles a few
programs, not one per step.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """Host arrays for one GRPO step. N samples, T = padded sequence length."""

    tokens: np.ndarray  # int32 (N, T): prompt, completion, then padding
    attention_mask: np.ndarray  # bool (N, T): real tokens
    loss_mask: np.ndarray  # float32 (N, T-1): 1 where target token t+1 is a completion token
    advantages: np.ndarray  # float32 (N,)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def with_advantages(self, advantages: np.ndarray) -> TrainBatch:
        return dataclasses.replace(self, advantages=np.asarray(advantages, np.float32))


def length_bucket(n: int) -> int:
    """Padded length for n tokens: a power of two up to 256 (at least 8), then multiples of 256.
    Few distinct shapes (few compiles) without doubling the work of long sequences."""
    if n <= 256:
        return max(8, 1 << (n - 1).bit_length())
    return math.ceil(n / 256) * 256


def build_train_batch(prompts: list[np.ndarray], completions: list[np.ndarray], advantages: np.ndarray | None = None,
                      *, pad_id: int) -> TrainBatch:
    """Right-pad [prompt + completion] rows to `length_bucket` of the longest. `advantages` (N,) may come
    later (`TrainBatch.with_advantages`): the actor computes them from the rewards."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    t = length_bucket(max(lengths))
    n = len(prompts)
    tokens = np.full((n, t), pad_id, np.int32)
    attn = np.zeros((n, t), bool)
    loss_mask = np.zeros((n, t - 1), np.float32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        tokens[i, : len(p)], tokens[i, len(p) : len(p) + len(c)] = p, c
        attn[i, : len(p) + len(c)] = True
        loss_mask[i, len(p) - 1 : len(p) + len(c) - 1] = 1.0  # position k predicts token k+1
    adv = np.zeros(n, np.float32) if advantages is None else np.asarray(advantages, np.float32)
    return TrainBatch(tokens, attn, loss_mask, adv)
