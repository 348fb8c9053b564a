"""The rollout engine interface: what every backend (jax_sampler, sglang_jax, fake) promises.

Contract (every implementation, tested in tests/test_rollout_contract.py):
- `generate(prompt_ids, params)` returns `len(prompt_ids) * params.n` samples, prompt-major: sample j
  of prompt i is `output.samples[i * n + j]`. Each sample's `logprobs[k]` is the log-probability of
  `token_ids[k]` under the distribution it was drawn from (temperature-scaled, top-p renormalised;
  for greedy, temperature 0, the model's own log-softmax), or NaN where the backend cannot compute
  it (sglang_jax: its `return_logprob` crashes 0.0.2's scheduler). Training's loss never reads them (the actor
  computes old and reference logprobs itself); the step logs their gap to the actor's (`train/logp_gap_mean`,
  `train/logp_gap_max`), which a NaN leaves unlogged. The caller chooses the stop tokens: every end token
  the model's files name (workers.rollout.stops). A stop token that ends a sample is
  included in `token_ids` (the policy must learn to emit it) and `finish_reason` is "stop";
  otherwise the sample has exactly `max_new_tokens` tokens and `finish_reason` is "length".
- Seeds: with `params.seed` set, the same prompts and weights give the same samples; the n samples
  of one prompt use different random streams. With `seed=None` every call draws fresh randomness.
- Weights: `update_weights(flat_params, version)` installs a full flat parameter dict (Hugging Face
  names, see workers.models.params) and records `weight_version` and `weight_checksum`. Names,
  shapes and dtypes must match the engine's model exactly, or it raises and keeps its old weights.
  It returns what the swap held on the devices ({"params_bytes", "largest_leaf_bytes",
  "peak_extra_bytes"}): where the devices lack room for two full copies of the params the peak over the
  steady state is at most one leaf (jax_sampler keeps its old version beside the new one only where they
  have room, workers.offload.room_for, and then moves no weight through host memory).
- `memory_bytes()` is {"params": bytes, "kv": bytes} the engine holds on its devices now, counted
  from its live arrays (on CPU there are no device memory statistics).
- Memory: `offload()` frees the engine's device memory (weights and KV cache);
  `onload()` takes it back. Whether weight *contents* survive is backend-specific (sglang
  releases rather than saves; jax_sampler keeps them on host and moves them back on first use, or
  never when `update_weights` replaces them first), so callers treat a resumed engine as unverified
  until its checksum is checked or weights are re-synced. `generate` on an offloaded engine raises EngineOffloadedError.
- Errors are raised before any work starts: empty prompt lists or prompts, prompts longer than
  `max_prompt_len`, token ids outside the vocabulary, and invalid sampling parameters.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token was generated (and is the last token)
    LENGTH = "length"  # max_new_tokens reached


class RolloutInputError(ValueError):
    """A generate() request that cannot be served; the message names the field and the fix."""


class EngineOffloadedError(RuntimeError):
    """generate() or update_weights() on an engine that is offloaded (call onload first)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    n: int = 1  # samples per prompt (GRPO's group size)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # generation of any of these ends a sample
    seed: int | None = None  # None: fresh randomness on every call

    def __post_init__(self) -> None:
        def bad(field: str, value, need: str):
            raise RolloutInputError(f"SamplingParams.{field} must be {need}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", self.n, "an integer >= 1")
        if not self.temperature >= 0:
            bad("temperature", self.temperature, ">= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad("max_new_tokens", self.max_new_tokens, "an integer >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", self.seed, "None or an integer >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt_index: int  # which prompt of the request this continues
    token_ids: np.ndarray  # int32 (L,), completion only, stop token included when finish_reason == "stop"
    logprobs: np.ndarray  # float32 (L,), log p(token_ids[k]) under the sampling distribution, or NaN (see above)
    finish_reason: FinishReason


@dataclasses.dataclass(frozen=True)
class RolloutOutput:
    samples: list[Sample]  # len(prompts) * n, prompt-major
    weight_version: int  # version of the weights that generated every sample
    generate_seconds: float  # wall time inside the engine, compile included
    cobatched: int = 1  # tasks whose rows ran in the same program run (a base group's co-batched ROLLOUT)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    def __reduce__(self):
        # Across a process boundary (a rollout role's result) the samples travel as a few flat arrays:
        # pickling hundreds of tiny arrays one by one cost ~4 ms per 256-sample step here.
        lengths = np.array([len(s.token_ids) for s in self.samples], np.int64)
        tokens = np.concatenate([s.token_ids for s in self.samples]) if self.samples else np.zeros(0, np.int32)
        logprobs = np.concatenate([s.logprobs for s in self.samples]) if self.samples else np.zeros(0, np.float32)
        meta = [(s.prompt_index, s.finish_reason) for s in self.samples]
        return _unpack_output, (tokens, logprobs, lengths, meta, self.weight_version, self.generate_seconds,
                                self.cobatched)


def _unpack_output(tokens, logprobs, lengths, meta, weight_version, generate_seconds, cobatched=1) -> RolloutOutput:
    bounds = np.cumsum(lengths)[:-1]
    pieces = zip(meta, np.split(tokens, bounds), np.split(logprobs, bounds), strict=True) if meta else ()
    return RolloutOutput([Sample(index, t, lp, reason) for (index, reason), t, lp in pieces], weight_version,
                         generate_seconds, cobatched)


@dataclasses.dataclass(frozen=True)
class Together:
    """One co-batched hold (rlsched.scheduling.policy.CoBatch): the scheduler granted a phase's lock to `tasks` tasks
    of one base group at once. ROLLOUT: their engines' generate calls within it run as one program run
    (workers.rollout.shared_engine); TRAIN: their actors' optimizer steps do (workers.actor). `hold` names the hold
    (the scheduler's id of its first grant)."""

    hold: int
    tasks: int


@runtime_checkable
class RolloutEngine(Protocol):
    max_prompt_len: int
    max_new_tokens: int

    @property
    def weight_version(self) -> int: ...

    @property
    def weight_checksum(self) -> str | None: ...

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput: ...

    def prepare(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> int:
        """Compile what `generate(prompt_ids, params)` will run, ahead of it, with the weights possibly on host
        (the caller holds no lock yet); how many programs were compiled now."""
        ...

    def update_weights(self, flat_params: Mapping[str, object], version: int, *,
                       checksum: str | None = None) -> dict[str, int]: ...

    def memory_bytes(self) -> dict[str, int]: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...


def validate_request(prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *, max_prompt_len: int,
                     max_new_tokens: int, vocab_size: int) -> list[np.ndarray]:
    """Shared input checks; returns the prompts as int32 arrays."""
    if not isinstance(params, SamplingParams):
        raise RolloutInputError(f"params must be a SamplingParams, got {type(params).__name__}")
    if isinstance(prompt_ids, str | bytes) or len(prompt_ids) == 0:
        raise RolloutInputError("prompt_ids must be a non-empty list of token-id lists (tokenize text first)")
    if params.max_new_tokens > max_new_tokens:
        raise RolloutInputError(
            f"SamplingParams.max_new_tokens={params.max_new_tokens} exceeds this engine's max_new_tokens="
            f"{max_new_tokens}; lower it or build the engine with a larger max_new_tokens")
    for t in params.stop_token_ids:
        if not 0 <= t < vocab_size:
            raise RolloutInputError(f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
    prompts = []
    for i, p in enumerate(prompt_ids):
        arr = np.asarray(p, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            raise RolloutInputError(f"prompt {i} is empty; every prompt needs at least one token")
        if arr.size > max_prompt_len:
            raise RolloutInputError(
                f"prompt {i} has {arr.size} tokens, more than this engine's max_prompt_len={max_prompt_len}; "
                "truncate it (e.g. task max_prompt_len) or build the engine with a larger max_prompt_len")
        if arr.min() < 0 or arr.max() >= vocab_size:
            raise RolloutInputError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size})")
        prompts.append(arr.astype(np.int32))
    return prompts
