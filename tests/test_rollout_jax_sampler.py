"""jax_sampler against transformers' greedy generate and against the model's own log-softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from workers.models import load_pretrained
from workers.models import params as P
from workers.models.checkpoint import abstract_model
from workers.rollout import EngineOffloadedError, FinishReason, RolloutInputError, SamplingParams
from workers.rollout.jax_sampler import JaxSampler

PROMPTS = ["Hello", "What is 12 + 30?", "a", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module")
def engine(tiny_model):
    model, _ = tiny_model
    return JaxSampler(model, max_prompt_len=64, max_new_tokens=32)


@pytest.fixture(scope="module")
def prompt_ids(tiny_model):
    _, tok = tiny_model
    return [tok.encode(p) for p in PROMPTS]


@nnx.jit
def _full_logits(model, ids):
    return model(ids)


def _model_log_softmax_at(model, prompt, completion, temperature=1.0):
    """Reference: log-softmax of the uncached full-sequence forward at each completion token."""
    full = np.concatenate([prompt, completion]).astype(np.int32)[None]
    logits = np.asarray(_full_logits(model, jnp.asarray(full)))[0] / temperature
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    steps = np.arange(len(prompt) - 1, len(full[0]) - 1)
    return logp[steps, completion]


def test_greedy_matches_transformers_generate(engine, prompt_ids, tiny_model_dir, tiny_model):
    _, tok = tiny_model
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = engine.generate(prompt_ids, SamplingParams(temperature=0, max_new_tokens=24,
                                                     stop_token_ids=(tok.eos_token_id,)))
    assert [s.prompt_index for s in out.samples] == list(range(len(PROMPTS)))
    for ids, sample in zip(prompt_ids, out.samples, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=24, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        assert sample.token_ids.tolist() == ref
        expected = FinishReason.STOP if ref[-1] == tok.eos_token_id else FinishReason.LENGTH
        assert sample.finish_reason == expected


def test_greedy_logprobs_are_the_models_log_softmax(engine, prompt_ids, tiny_model):
    model, _ = tiny_model
    out = engine.generate(prompt_ids, SamplingParams(temperature=0, max_new_tokens=12))
    for ids, s in zip(prompt_ids, out.samples, strict=True):
        np.testing.assert_allclose(s.logprobs, _model_log_softmax_at(model, np.array(ids), s.token_ids), atol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_under_the_sampling_distribution(engine, prompt_ids, tiny_model, temperature):
    model, _ = tiny_model
    out = engine.generate(prompt_ids, SamplingParams(n=2, temperature=temperature, max_new_tokens=12, seed=5))
    for s in out.samples:
        ref = _model_log_softmax_at(model, np.array(prompt_ids[s.prompt_index]), s.token_ids, temperature)
        np.testing.assert_allclose(s.logprobs, ref, atol=1e-4)


def test_top_p_logprobs_are_renormalised_over_the_nucleus(engine, prompt_ids, tiny_model):
    model, _ = tiny_model
    top_p = 0.5
    out = engine.generate(prompt_ids[:2], SamplingParams(n=2, temperature=1.0, top_p=top_p, max_new_tokens=8, seed=1))
    for s in out.samples:
        prompt = np.array(prompt_ids[s.prompt_index])
        full = np.concatenate([prompt, s.token_ids]).astype(np.int32)[None]
        logits = np.asarray(_full_logits(model, jnp.asarray(full)))[0].astype(np.float64)
        for k, (tok, lp) in enumerate(zip(s.token_ids, s.logprobs, strict=True)):
            p = np.exp(logits[len(prompt) - 1 + k] - logits[len(prompt) - 1 + k].max())
            p /= p.sum()
            order = np.argsort(-p)
            mass_before = np.cumsum(p[order]) - p[order]
            nucleus = order[mass_before < top_p]
            assert tok in nucleus  # never sampled outside the nucleus
            np.testing.assert_allclose(lp, np.log(p[tok] / p[nucleus].sum()), atol=1e-4)


def test_seed_reproduces_and_samples_differ(engine, prompt_ids):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=123)
    a, b = engine.generate(prompt_ids, params), engine.generate(prompt_ids, params)
    for x, y in zip(a.samples, b.samples, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
    for i in range(len(PROMPTS)):
        group = {tuple(s.token_ids) for s in a.samples[i * 4 : (i + 1) * 4]}
        assert len(group) == 4, f"the 4 samples of prompt {i} are not all different"
    other = engine.generate(prompt_ids, SamplingParams(n=4, temperature=1.0, max_new_tokens=16, seed=124))
    assert any(not np.array_equal(x.token_ids, y.token_ids) for x, y in zip(a.samples, other.samples, strict=True))
    unseeded = [engine.generate(prompt_ids[:1], SamplingParams(temperature=1.0, max_new_tokens=16)) for _ in range(2)]
    assert not np.array_equal(unseeded[0].samples[0].token_ids, unseeded[1].samples[0].token_ids)


def test_results_do_not_depend_on_batching(tiny_model, prompt_ids):
    model, _ = tiny_model
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=7)
    big = JaxSampler(model, max_prompt_len=64, max_new_tokens=16, max_batch_size=16).generate(prompt_ids, params)
    small = JaxSampler(model, max_prompt_len=64, max_new_tokens=16, max_batch_size=2).generate(prompt_ids, params)
    for x, y in zip(big.samples, small.samples, strict=True):
        assert x.prompt_index == y.prompt_index
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_decoding_in_segments_gives_the_tokens_of_one_loop(tiny_model, prompt_ids, monkeypatch):
    """A GPU's generate program decodes in SEGMENTS["default"] loops, each attending to the cache slots it can have
    written (the CPU's in one): run here in 4, greedy and sampled tokens are those of one loop over the whole cache,
    their log-probs within float rounding, their finish reasons the same."""
    from workers.rollout import jax_sampler

    model, tok = tiny_model
    runs = {}
    for segments in (1, 4):
        monkeypatch.setitem(jax_sampler.SEGMENTS, "cpu", segments)
        engine = JaxSampler(model, max_prompt_len=64, max_new_tokens=32)
        runs[segments] = [engine.generate(prompt_ids, p) for p in (
            SamplingParams(temperature=0, max_new_tokens=32, stop_token_ids=(tok.eos_token_id,)),
            SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=3))]
    assert jax_sampler._segment_ends(32, 4) == [8, 16, 24, 32]
    for one, four in zip(runs[1], runs[4], strict=True):
        for x, y in zip(one.samples, four.samples, strict=True):
            np.testing.assert_array_equal(x.token_ids, y.token_ids)
            assert x.finish_reason == y.finish_reason
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_compiles_a_handful_of_programs_not_one_per_request(tiny_model):
    model, tok = tiny_model
    engine = JaxSampler(model, max_prompt_len=64, max_new_tokens=32, max_batch_size=4)
    programs_before = engine.programs_compiled()
    rng = np.random.default_rng(0)
    for _ in range(24):
        prompts = [rng.integers(0, 256, size=rng.integers(1, 14)).tolist() for _ in range(rng.integers(1, 4))]
        engine.generate(prompts, SamplingParams(max_new_tokens=int(rng.integers(1, 17))))
    # 24 requests of arbitrary sizes, but only batch {1,2,4} x prompt {8,16} x new-token {8,16} buckets.
    assert {b for b, _, _, _ in engine.compiled_shapes} <= {1, 2, 4}
    assert {p for _, p, _, _ in engine.compiled_shapes} <= {8, 16}
    assert {n for _, _, n, _ in engine.compiled_shapes} <= {8, 16}
    assert len(engine.compiled_shapes) <= 12
    assert engine.programs_compiled() - programs_before <= len(engine.compiled_shapes)


def test_max_prompt_padding_gives_the_bucket_padding_greedy_tokens(tiny_model, prompt_ids):
    """prompt_padding="max" left-pads every prompt to max_prompt_len (64) where "bucket" pads these three (at most
    16 tokens) to 16: the padding is masked and RoPE positions start at each row's first token, so greedy decoding
    gives the same tokens, and the same log-probs to float rounding (the programs' shapes differ)."""
    model, tok = tiny_model
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(tok.eos_token_id,))
    runs = {}
    for padding in ("bucket", "max"):
        engine = JaxSampler(model, max_prompt_len=64, max_new_tokens=16, prompt_padding=padding)
        runs[padding] = engine.generate(prompt_ids[:3], params)
        assert {p for _, p, _, _ in engine.compiled_shapes} == {16 if padding == "bucket" else 64}
    for x, y in zip(runs["bucket"].samples, runs["max"].samples, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match=r"prompt_padding='longest'; choose one of \('bucket', 'max'\)"):
        JaxSampler(model, prompt_padding="longest")


def test_prepare_compiles_ahead_without_the_weights_and_generate_then_compiles_nothing(tiny_model, prompt_ids):
    """What a task does before asking for the rollout lock: compile this request's programs while its weights
    are on host (another task may hold the device). The generate that follows runs those executables (jit
    compiles nothing) and gives exactly what an engine that compiled on first use gives."""
    model, _ = tiny_model
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=3, seed=7)
    plain = JaxSampler(model, max_prompt_len=64, max_new_tokens=16, max_batch_size=4).generate(prompt_ids, params)
    engine = JaxSampler(model, max_prompt_len=48, max_new_tokens=16, max_batch_size=4)
    engine.offload()
    shapes = {key for key, _ in engine._chunks(prompt_ids, params, 0)}  # chunks of the same shape share one
    assert engine.prepare(prompt_ids, params) == len(shapes) >= 1
    assert engine.prepare(prompt_ids, params) == 0  # ready: nothing to do
    engine.onload()
    jit = engine._jitted()
    before = jit._cache_size()
    out = engine.generate(prompt_ids, params)
    assert jit._cache_size() == before  # nothing compiled on the way
    for x, y in zip(plain.samples, out.samples, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)  # other prompt padding: rounding only


def test_stop_token_ends_the_sample_and_is_included(engine, prompt_ids):
    greedy = engine.generate(prompt_ids[:1], SamplingParams(temperature=0, max_new_tokens=16)).samples[0]
    stop = int(greedy.token_ids[5])
    first = int(np.flatnonzero(greedy.token_ids == stop)[0])
    s = engine.generate(prompt_ids[:1], SamplingParams(temperature=0, max_new_tokens=16,
                                                      stop_token_ids=(stop,))).samples[0]
    assert s.finish_reason == FinishReason.STOP
    np.testing.assert_array_equal(s.token_ids, greedy.token_ids[: first + 1])
    assert greedy.finish_reason == FinishReason.LENGTH and len(greedy.token_ids) == 16


def test_release_and_resume_keep_the_weights(tiny_model, prompt_ids):
    model, _ = tiny_model
    engine = JaxSampler(model, max_prompt_len=64, max_new_tokens=16)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    before, checksum = engine.generate(prompt_ids, params), engine.weight_checksum
    programs = engine.programs_compiled()
    engine.offload()
    assert engine.offloaded
    with pytest.raises(EngineOffloadedError, match="onload"):
        engine.generate(prompt_ids, params)
    engine.onload()
    after = engine.generate(prompt_ids, params)
    assert engine.weight_checksum == checksum
    assert engine.programs_compiled() == programs  # an onload must not cost a recompile
    for x, y in zip(before.samples, after.samples, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)


def test_update_weights_swaps_in_another_models_weights(tiny_model_dir, prompt_ids):
    model_a, _ = load_pretrained(tiny_model_dir)
    cfg = model_a.config
    model_b = abstract_model(cfg, seed=42)
    flat_b = P.host_params(model_b)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    expected = JaxSampler(model_b, max_prompt_len=64, max_new_tokens=16).generate(prompt_ids, params)

    engine = JaxSampler(model_a, max_prompt_len=64, max_new_tokens=16)
    assert engine.weight_version == 0
    engine.update_weights(flat_b, version=3)
    assert engine.weight_version == 3 and engine.weight_checksum == P.checksum(flat_b)
    got = engine.generate(prompt_ids, params)
    assert got.weight_version == 3
    for x, y in zip(expected.samples, got.samples, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)

    wrong = dict(flat_b)
    wrong["model.norm.weight"] = np.ones(cfg.hidden_size + 1, np.float32)
    with pytest.raises(P.WeightMismatchError, match=r"model\.norm\.weight is float32\(65,\)"):
        engine.update_weights(wrong, version=4)
    missing = {k: v for k, v in flat_b.items() if k != "model.norm.weight"}
    with pytest.raises(P.WeightMismatchError, match="missing"):
        engine.update_weights(missing, version=4)
    assert engine.weight_version == 3  # a rejected update changes nothing
    again = engine.generate(prompt_ids, params)
    np.testing.assert_array_equal(again.samples[0].token_ids, expected.samples[0].token_ids)


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ([[1] * 65], SamplingParams(max_new_tokens=8), "65 tokens, more than this engine's max_prompt_len=64"),
        ([], SamplingParams(max_new_tokens=8), "non-empty list"),
        ([[1], []], SamplingParams(max_new_tokens=8), "prompt 1 is empty"),
        ([[1, 999]], SamplingParams(max_new_tokens=8), "outside the vocabulary"),
        ([[1]], SamplingParams(max_new_tokens=33), "exceeds this engine's max_new_tokens=32"),
        ("hello", SamplingParams(max_new_tokens=8), "tokenize text first"),
    ],
)
def test_bad_requests_are_rejected_with_a_clear_error(engine, prompts, params, match):
    with pytest.raises(RolloutInputError, match=match):
        engine.generate(prompts, params)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(n=0), r"SamplingParams\.n must be an integer >= 1, got 0"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    ],
)
def test_bad_sampling_params_are_rejected(kwargs, match):
    with pytest.raises(RolloutInputError, match=match):
        SamplingParams(**kwargs)


def _published(model) -> dict:
    """A model's weights as an actor in this process publishes them: device arrays, with their checksum."""
    flat = {k: jnp.asarray(v) for k, v in P.host_params(model).items()}
    return flat, P.checksum(flat)


def _no_room(monkeypatch):
    """The devices have no room for a second version: the swap keeps its undo copy in host memory."""
    from workers.rollout import jax_sampler

    monkeypatch.setattr(jax_sampler, "room_for", lambda nbytes: False)


def test_a_sync_with_room_moves_no_weight_byte_to_host_and_serves_the_published_bits(
        tiny_model_dir, prompt_ids, host_transfers, monkeypatch):
    """Actor and engine in one process, the devices with room for both versions (on CPU always: device memory is
    host memory): the new weights are copied device to device beside the old ones, hashed on the devices, and the
    old ones freed. The only bytes read on the host are the checksum's, one uint32 a tensor. With no room, the old
    weights go to host memory as the undo copy: the counter sees every one of their bytes (it would catch them)."""
    model_a, _ = load_pretrained(tiny_model_dir)
    model_b = abstract_model(model_a.config, seed=42)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    expected = JaxSampler(model_b, max_prompt_len=64, max_new_tokens=16).generate(prompt_ids, params)
    flat, checksum = _published(model_b)
    engine = JaxSampler(model_a, max_prompt_len=64, max_new_tokens=16)
    old = jax.tree.leaves(engine._state)
    with host_transfers() as seen:
        stats = engine.update_weights(flat, 1, checksum=checksum)
    assert {(shape, dtype) for _, shape, dtype, _ in seen} == {((len(flat),), "uint32")}  # the digests alone
    assert (engine.weight_version, engine.weight_checksum) == (1, checksum)
    served = P.to_flat(engine._state)
    for name, leaf in served.items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(flat[name]))  # bit for bit
        assert leaf.unsafe_buffer_pointer() != flat[name].unsafe_buffer_pointer()  # the engine's own buffers
    assert not any(x.is_deleted() for x in flat.values()) and all(x.is_deleted() for x in old)
    nbytes = P.num_bytes(flat)  # one device: the whole model
    assert stats == {"params_bytes": nbytes, "largest_leaf_bytes": max(x.nbytes for x in flat.values()),
                     "peak_extra_bytes": nbytes, "undo_host_bytes": 0}  # both versions at once, none on host
    got = engine.generate(prompt_ids, params)
    for x, y in zip(expected.samples, got.samples, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)

    _no_room(monkeypatch)
    back, checksum_a = _published(model_a)
    with host_transfers() as seen:
        stats = engine.update_weights(back, 2, checksum=checksum_a)
    assert (engine.weight_version, engine.weight_checksum) == (2, checksum_a)
    moved = sum(n for how, _, _, n in seen if how == "device_put to host memory")
    assert moved == stats["undo_host_bytes"] == nbytes  # each old leaf, once
    assert 0 <= stats["peak_extra_bytes"] <= stats["largest_leaf_bytes"]  # one leaf at a time


@pytest.mark.parametrize("room", [True, False], ids=["beside", "host-undo"])
def test_a_failed_sync_leaves_the_old_version_whole(tiny_model_dir, prompt_ids, monkeypatch, room):
    """A tensor that fails half way through, or weights that land but hash unlike the sender's: the engine keeps
    serving its previous version, whole, on either path, and holds no more than it did."""
    from workers.offload import bytes_by_device

    if not room:
        _no_room(monkeypatch)
    model_a, _ = load_pretrained(tiny_model_dir)
    engine = JaxSampler(model_a, max_prompt_len=64, max_new_tokens=16)
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    before, checksum = engine.generate(prompt_ids, greedy), engine.weight_checksum
    flat, published = _published(abstract_model(model_a.config, seed=7))
    resident = bytes_by_device()  # the engine's weights and the published ones
    broken = dict(flat)
    victim = sorted(broken)[len(broken) // 2]
    broken[victim] = jnp.copy(broken[victim])
    broken[victim].delete()  # its transfer fails after half the leaves have landed
    with pytest.raises(RuntimeError, match="deleted"):
        engine.update_weights(broken, 1, checksum=published)
    wrong = {k: v * 1.01 if v.ndim else v for k, v in flat.items()}  # lands whole, but is not what was sent
    with pytest.raises(P.WeightMismatchError, match="keeping v0"):
        engine.update_weights(wrong, 1, checksum=published)
    del broken, wrong
    assert (engine.weight_version, engine.weight_checksum, P.checksum(P.to_flat(engine._state))) == (0, checksum,
                                                                                                     checksum)
    assert bytes_by_device() == resident  # nothing of the refused versions is left on the device
    after = engine.generate(prompt_ids, greedy)
    for x, y in zip(before.samples, after.samples, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
