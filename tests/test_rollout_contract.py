"""The RolloutEngine contract (workers/rollout/base.py), checked on every implementation."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from workers.models import params as P
from workers.rollout import EngineOffloadedError, FinishReason, RolloutEngine, SamplingParams, make_engine
from workers.rollout.fake import FakeEngine
from workers.rollout.jax_sampler import JaxSampler

STOP = 258  # <|im_end|> in the byte tokenizer


@pytest.fixture(params=["jax_sampler", "fake"])
def engine(request, tiny_model):
    model, _ = tiny_model
    if request.param == "jax_sampler":
        return JaxSampler(model, max_prompt_len=32, max_new_tokens=16)
    shapes = {k: tuple(v.shape) for k, v in P.to_flat(nnx.state(model, nnx.Param)).items()}
    return FakeEngine(vocab_size=model.config.vocab_size, max_prompt_len=32, max_new_tokens=16, seed=0,
                      param_shapes=shapes)


PROMPTS = [[72, 105], [50, 43, 50, 61], [1]]


def test_is_a_rollout_engine(engine):
    assert isinstance(engine, RolloutEngine)


def test_samples_are_prompt_major_and_end_as_promised(engine):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, stop_token_ids=(STOP,), seed=0)
    out = engine.generate(PROMPTS, params)
    assert [s.prompt_index for s in out.samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for s in out.samples:
        assert s.token_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
        assert s.token_ids.shape == s.logprobs.shape and np.all(s.logprobs <= 0)
        assert STOP not in s.token_ids[:-1].tolist()  # a stop token only ever ends a sample
        if s.finish_reason == FinishReason.STOP:
            assert s.token_ids[-1] == STOP and 1 <= len(s.token_ids) <= 12
        else:
            assert len(s.token_ids) == 12
    assert out.num_tokens == sum(len(s.token_ids) for s in out.samples)


def test_seed_reproduces(engine):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, stop_token_ids=(STOP,), seed=9)
    a, b = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert [s.token_ids.tolist() for s in a.samples] == [s.token_ids.tolist() for s in b.samples]


def test_weight_version_and_checksum_follow_updates(engine, tiny_model):
    model, _ = tiny_model
    flat = P.host_params(model)
    engine.update_weights(flat, version=5)
    assert engine.weight_version == 5 and engine.weight_checksum == P.checksum(flat)
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=2)).weight_version == 5
    with pytest.raises(P.WeightMismatchError):
        engine.update_weights({**flat, "model.norm.weight": np.ones(3, np.float32)}, version=6)
    assert engine.weight_version == 5


def test_released_engine_refuses_to_generate(engine):
    engine.offload()
    with pytest.raises(EngineOffloadedError):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    engine.onload()
    assert len(engine.generate(PROMPTS, SamplingParams(max_new_tokens=2)).samples) == 3


def test_make_engine_by_name(tiny_model_dir):
    assert isinstance(make_engine("fake"), FakeEngine)
    assert isinstance(make_engine("jax_sampler", str(tiny_model_dir), max_prompt_len=16, max_new_tokens=8), JaxSampler)
    with pytest.raises(ValueError, match="unknown rollout engine 'vllm'"):
        make_engine("vllm")


def test_fake_engine_latency_is_seeded_and_applied():
    engine = FakeEngine(seconds_per_token=0.002, max_new_tokens=20)
    out = engine.generate([[1, 2]], SamplingParams(n=2, max_new_tokens=20))
    assert out.generate_seconds >= 0.002 * 20  # no stop ids: every sample has 20 tokens, rows in parallel


def test_an_output_crosses_a_process_boundary_unchanged():
    """A rollout role's output is pickled as a few flat arrays; every sample comes back exactly: lengths
    (an empty completion too), token ids, logprobs (NaN included), prompt index, finish reason, order."""
    import pickle

    from workers.rollout import RolloutOutput, Sample

    rng = np.random.default_rng(0)
    lengths = [3, 0, 5, 1]
    logprobs = [rng.standard_normal(n).astype(np.float32) for n in lengths]
    logprobs[2][1] = np.nan
    samples = [Sample(i // 2, rng.integers(0, 384, n).astype(np.int32), lp, "stop" if i % 2 else "length")
               for i, (n, lp) in enumerate(zip(lengths, logprobs, strict=True))]
    out = RolloutOutput(samples, weight_version=7, generate_seconds=0.25)
    back = pickle.loads(pickle.dumps(out))
    assert (back.weight_version, back.generate_seconds, back.num_tokens) == (7, 0.25, 9)
    for a, b in zip(out.samples, back.samples, strict=True):
        assert (a.prompt_index, a.finish_reason) == (b.prompt_index, b.finish_reason)
        assert a.token_ids.dtype == b.token_ids.dtype and a.logprobs.dtype == b.logprobs.dtype
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)  # NaN == NaN here
    assert pickle.loads(pickle.dumps(RolloutOutput([], 0, 0.0))).samples == []
