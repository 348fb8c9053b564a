"""`fake`: a rollout engine with no model, for testing the scheduler's logic.

Lengths, tokens, logprobs and latency are drawn from a seeded generator (the logprobs of no model: the
actor-sampler gap a run on it logs, `train/logp_gap_*`, measures nothing), so scheduler tests are
deterministic and fast; everything else (validation, weight versions, checksums, release/resume)
follows the real contract, so a scheduler bug cannot hide behind a forgiving fake.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from workers.models import params as P
from workers.rollout.base import (
    EngineOffloadedError,
    FinishReason,
    RolloutOutput,
    Sample,
    SamplingParams,
    validate_request,
)
from workers.rollout.stamp import StampedWeights


class FakeEngine(StampedWeights):
    name = "fake"

    def __init__(self, *, vocab_size: int = 384, max_prompt_len: int = 512, max_new_tokens: int = 256,
                 seconds_per_token: float = 0.0, stop_probability: float = 0.5, seed: int = 0,
                 param_shapes: Mapping[str, tuple[int, ...]] | None = None, stall_on_call: int | None = None,
                 stall_seconds: float = 0.0, fail_offload_on_call: int | None = None, delay_start_s: float = 0.0):
        """`stall_on_call`/`stall_seconds`: the n-th generate (1-based) sleeps that long first, as a hung
        engine would; `fail_offload_on_call`: the n-th offload raises, as a failed offload would;
        `delay_start_s`: the first `prepare` sleeps that long, as a slow start would (a task that asks for its
        first lock after another's).
        Faults for the scheduler's tests (rollout.engine_args)."""
        self.vocab_size, self.max_prompt_len, self.max_new_tokens = vocab_size, max_prompt_len, max_new_tokens
        self.stall_on_call, self.stall_seconds, self.fail_offload_on_call = stall_on_call, stall_seconds, \
            fail_offload_on_call
        self.delay_start_s, self._prepared = delay_start_s, False
        self.offloads = 0
        self.seconds_per_token, self.stop_probability = seconds_per_token, stop_probability
        self._rng = np.random.default_rng(seed)
        # Optional expected weight layout, so update_weights can be checked like a real engine.
        self._shapes = dict(param_shapes) if param_shapes is not None else None
        self._version, self._checksum, self._released = 0, None, False
        self._params_bytes = 0
        self.calls = 0

    @classmethod
    def for_model(cls, model_path: str | None = None, *, weight_version: int = 0, dtype: str | None = None,
                  max_batch_size: int | None = None, **kwargs) -> FakeEngine:
        """Built where a real engine would be (rlsched.run.roles.EngineRole): tokens within the model's vocabulary
        (its config.json, when given); `dtype` and `max_batch_size` mean nothing without a model."""
        if model_path is not None and "vocab_size" not in kwargs:
            from workers.models.config import Qwen3Config  # config.json, read and checked as for a real engine

            kwargs["vocab_size"] = Qwen3Config.from_dir(model_path).vocab_size
        engine = cls(**kwargs)
        engine._version = int(weight_version)
        return engine


    @property
    def weight_checksum(self) -> str | None:
        return self._checksum  # a fake keeps no weights: the hash of the last ones it was sent (None before any)

    @property
    def offloaded(self) -> bool:
        return self._released

    def update_weights(self, flat_params: Mapping[str, object], version: int, *,
                       checksum: str | None = None) -> dict[str, int]:
        if self._released:
            raise EngineOffloadedError("the engine is offloaded; call onload() first")
        if self._shapes is not None:
            got = {k: tuple(np.shape(v)) for k, v in flat_params.items()}
            if got != self._shapes:
                raise P.WeightMismatchError(f"update_weights(version={version}): shapes differ from the engine's")
        digest = P.checksum(flat_params)
        refused = self._refusal(version, digest, checksum)
        if refused:
            raise refused
        self._version, self._checksum = int(version), digest
        self._params_bytes = int(sum(v.nbytes for v in flat_params.values()))
        largest = max((v.nbytes for v in flat_params.values()), default=0)
        return {"params_bytes": self._params_bytes, "largest_leaf_bytes": int(largest), "peak_extra_bytes": 0}

    def memory_bytes(self) -> dict[str, int]:
        """What a real engine would hold: the last weights installed (no device memory here)."""
        return {"params": 0 if self._released else self._params_bytes, "kv": 0}

    def offload(self) -> None:
        self.offloads += 1
        if self.offloads == self.fail_offload_on_call:
            raise RuntimeError(f"injected fault: offload call {self.offloads} fails")
        self._released = True

    def onload(self) -> None:
        self._released = False

    def prepare(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> int:
        if not self._prepared:
            self._prepared = True
            time.sleep(self.delay_start_s)
        return 0  # nothing to compile

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput:
        t0 = time.perf_counter()
        prompts = validate_request(prompt_ids, params, max_prompt_len=self.max_prompt_len,
                                   max_new_tokens=self.max_new_tokens, vocab_size=self.vocab_size)
        if self._released:
            raise EngineOffloadedError("the engine is offloaded; call onload() first")
        self.calls += 1
        if self.calls == self.stall_on_call:
            time.sleep(self.stall_seconds)  # an injected hang
        rng = np.random.default_rng(params.seed) if params.seed is not None else self._rng
        stop_ids = params.stop_token_ids
        filler = next(t for t in range(self.vocab_size) if t not in stop_ids)
        samples = []
        for i in range(len(prompts)):
            for _ in range(params.n):
                stops = bool(stop_ids) and rng.random() < self.stop_probability
                length = int(rng.integers(1, params.max_new_tokens + 1)) if stops else params.max_new_tokens
                tokens = rng.integers(0, self.vocab_size, size=length).astype(np.int32)
                tokens[np.isin(tokens, stop_ids)] = filler  # a stop token only ever ends a sample
                if stops:
                    tokens[-1] = stop_ids[0]
                logprobs = -rng.exponential(1.0, size=length).astype(np.float32)
                samples.append(Sample(i, tokens, logprobs, FinishReason.STOP if stops else FinishReason.LENGTH))
        total = sum(len(s.token_ids) for s in samples)
        if self.seconds_per_token:
            time.sleep(self.seconds_per_token * total / max(1, len(samples)))  # rows decode in parallel
        return RolloutOutput(samples=samples, weight_version=self._version, generate_seconds=time.perf_counter() - t0)
