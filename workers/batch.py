"""A GRPO step's training batch, built on the host (numpy only: the task's driver pads it before it
asks for the TRAIN lock, and the driver never imports JAX).

Sequences are right-padded [prompt, completion, pad] to a length bucket so a run compiles a few
programs, not one per step. A run's batches (`max_new_tokens` given) take their length from the prompts alone:
the power-of-two bucket of the longest prompt (`prompt_bucket`, the rollout engine's: workers.rollout.jax_sampler)
plus max_new_tokens, so completions that end early never change the shape (the policy's lengths drift from step
to step; a new shape mid-run was a new compile: 16 s at Qwen3-0.6B's shape on an H100). With
prompt_padding="max" (grpo.prompt_padding) the prompts take max_prompt_len whatever their length: a step whose
longest prompt falls in another bucket (128 vs 256) compiled the update again (74 s at that shape, GSM8K prompts).

Such a batch also says where its completions can be: row i's completion tokens are targets of log-prob positions
[len(p_i) - 1, len(p_i) - 1 + len(c_i)), inside the window of max_new_tokens positions from `completion_start` =
len(p_i) - 1, and that window always fits (T - 1 >= the prompt bucket - 1 + max_new_tokens). The actor runs its
output head on those windows only (workers.actor: half of the head's positions at 256 prompt + 256 new positions).
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
    # float32 (N,), None until `with_advantages` sets them: zeros would train on nothing without a word
    advantages: np.ndarray | None
    # float32 (N, T-1), aligned with loss_mask: the rollout engine's log-prob of target token t+1 where it is a
    # completion token; NaN where the engine gave none (sglang_jax) and at every other position
    sampler_logp: np.ndarray
    # int32 (N,) or None: where each row's completion window of max_new_tokens log-prob positions starts (len(prompt)
    # - 1), set when the batch was built with max_new_tokens (module docstring); None: the completions may be anywhere
    completion_start: np.ndarray | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def with_advantages(self, advantages: np.ndarray) -> TrainBatch:
        advantages = np.asarray(advantages, np.float32)
        if advantages.shape != (self.size,):
            raise ValueError(f"advantages must be ({self.size},), one per sample, got shape {advantages.shape}")
        return dataclasses.replace(self, advantages=advantages)

    def arrays(self) -> dict[str, np.ndarray]:
        """What the actor's update reads, by its batch keys (completion_start where the batch has it); a batch without
        advantages is refused."""
        if self.advantages is None:
            raise ValueError("this TrainBatch has no advantages: compute them from the rewards "
                             "(workers.grpo.group_advantages) and set them with batch.with_advantages(...)")
        window = {} if self.completion_start is None else {"completion_start": self.completion_start}
        return {"tokens": self.tokens, "attention_mask": self.attention_mask, "loss_mask": self.loss_mask,
                "advantages": self.advantages, "sampler_logp": self.sampler_logp, **window}


def length_bucket(n: int) -> int:
    """Padded length for n tokens: a power of two up to 256 (at least 8), then multiples of 256.
    Few distinct shapes (few compiles) without doubling the work of long sequences."""
    if n <= 256:
        return max(8, 1 << (n - 1).bit_length())
    return math.ceil(n / 256) * 256


PROMPT_PADDINGS = ("bucket", "max")  # grpo.prompt_padding: the engine's and the train batch's (module docstring)


def prompt_bucket(n: int, max_prompt_len: int) -> int:
    """The padded length of prompts of at most n tokens: a power of two (at least 8), never above max_prompt_len.
    jax_sampler pads a chunk's prompts to it too, so a step's rows have one prompt length on both sides."""
    return min(max(8, 1 << (n - 1).bit_length()), max_prompt_len)


def run_batch_length(prompt_lengths: list[int], *, max_prompt_len: int, max_new_tokens: int,
                     prompt_padding: str = "bucket") -> int:
    """T of a run's batch (`build_train_batch` with max_new_tokens) for prompts of these lengths: the prompts'
    padded length + max_new_tokens, whatever the completions. The task's driver reads it before the rollout, to
    have the actor compile for it while the engine compiles (rlsched.run.task)."""
    if prompt_padding not in PROMPT_PADDINGS:
        raise ValueError(f"prompt_padding={prompt_padding!r}; choose one of {PROMPT_PADDINGS}")
    longest = max(prompt_lengths)
    cap = max(longest, max_prompt_len)
    return prompt_bucket(cap if prompt_padding == "max" else longest, cap) + max_new_tokens


def build_train_batch(prompts: list[np.ndarray], completions: list[np.ndarray], advantages: np.ndarray | None = None,
                      *, pad_id: int, logprobs: list[np.ndarray] | None = None, max_prompt_len: int | None = None,
                      max_new_tokens: int | None = None, prompt_padding: str = "bucket") -> TrainBatch:
    """Right-pad [prompt + completion] rows: to `prompt_bucket` of the longest prompt + max_new_tokens when
    max_new_tokens is given (a run's batches: the completions' lengths never change the shape), or to
    max_prompt_len + max_new_tokens with prompt_padding="max" (the prompts' lengths do not either), else to
    `length_bucket` of the longest row; with max_new_tokens, each row's `completion_start` too. `advantages` (N,)
    may come later (`TrainBatch.with_advantages`): the actor computes them from the rewards. `logprobs`: the engine's
    log-prob of each completion token (Sample.logprobs, one array per row), compared with the actor's."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    if max_new_tokens is None:
        t = length_bucket(max(lengths))
    else:
        if max_prompt_len is None:
            raise ValueError("give max_prompt_len with max_new_tokens (the prompt bucket never exceeds it)")
        t = run_batch_length([len(p) for p in prompts], max_prompt_len=max_prompt_len,
                             max_new_tokens=max_new_tokens, prompt_padding=prompt_padding)
        if max(len(c) for c in completions) > max_new_tokens:
            raise ValueError(f"a completion of {max(len(c) for c in completions)} tokens is longer than "
                             f"max_new_tokens {max_new_tokens}: pass the max_new_tokens the engine sampled with")
    n = len(prompts)
    tokens = np.full((n, t), pad_id, np.int32)
    attn = np.zeros((n, t), bool)
    loss_mask = np.zeros((n, t - 1), np.float32)
    sampler_logp = np.full((n, t - 1), np.nan, np.float32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        tokens[i, : len(p)], tokens[i, len(p) : len(p) + len(c)] = p, c
        attn[i, : len(p) + len(c)] = True
        loss_mask[i, len(p) - 1 : len(p) + len(c) - 1] = 1.0  # position k predicts token k+1
        if logprobs is not None:
            sampler_logp[i, len(p) - 1 : len(p) + len(c) - 1] = logprobs[i]
    # with max_new_tokens every completion lies in its row's window of max_new_tokens positions from len(p) - 1
    start = None if max_new_tokens is None else np.array([len(p) - 1 for p in prompts], np.int32)
    batch = TrainBatch(tokens, attn, loss_mask, None, sampler_logp, start)
    return batch if advantages is None else batch.with_advantages(advantages)
