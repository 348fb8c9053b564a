"""A LoRA task's engine (workers.rollout.adapter_engine): a sync moves the adapter alone, is verified by
checksum, refuses what is not the adapter, and generates what the merged model generates."""

from __future__ import annotations

import numpy as np
import pytest

from workers.models import load_pretrained
from workers.models import lora as L
from workers.models import params as P
from workers.rollout.adapter_engine import AdapterEngine
from workers.rollout.base import SamplingParams
from workers.rollout.jax_sampler import JaxSampler

SPEC = L.LoraSpec(rank=4, alpha=8.0, targets=("q", "v", "o", "down"))
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [40, 41]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, n=1, seed=0)


def _adapter(cfg, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0, 0.3, s).astype(np.float32) for n, s in L.adapter_shapes(cfg, SPEC).items()}


def _tokens(output) -> list[list[int]]:
    return [[int(t) for t in s.token_ids] for s in output.samples]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    sampler = JaxSampler.from_pretrained(tiny_model_dir, max_prompt_len=16, max_new_tokens=8)
    return AdapterEngine(sampler, SPEC)


def test_a_synced_adapter_generates_what_the_merged_model_generates(engine, tiny_model_dir):
    assert engine.prepare(PROMPTS, GREEDY) >= 1  # before any sync: the zero adapter stands in with its shapes
    compiled = engine.sampler.programs_compiled()
    adapter = _adapter(engine.config, seed=1)
    stats = engine.update_weights(adapter, 3, checksum=P.checksum(adapter))
    assert engine.weight_version == 3 and engine.weight_checksum == P.checksum(adapter)
    assert stats["params_bytes"] == engine.memory_bytes()["params"]
    output = engine.generate(PROMPTS, GREEDY)
    assert output.weight_version == 3 and engine.sampler.programs_compiled() == compiled  # prepared: no compile
    model, _ = load_pretrained(tiny_model_dir)
    merged = L.merged(P.host_params(model), adapter, SPEC)
    reference = JaxSampler(model, max_prompt_len=16, max_new_tokens=8)
    reference.update_weights(merged, 1)
    expected = reference.generate(PROMPTS, GREEDY)
    assert _tokens(output) == _tokens(expected)
    for got, want in zip(output.samples, expected.samples, strict=True):
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    base = JaxSampler.from_pretrained(tiny_model_dir, max_prompt_len=16, max_new_tokens=8).generate(PROMPTS, GREEDY)
    assert _tokens(output) != _tokens(base)  # the adapter is not a no-op


def test_a_sync_that_is_not_the_adapter_or_does_not_verify_changes_nothing(engine):
    first = _adapter(engine.config, seed=2)
    engine.update_weights(first, 5, checksum=P.checksum(first))
    before = _tokens(engine.generate(PROMPTS, GREEDY))
    other = _adapter(engine.config, seed=3)
    with pytest.raises(P.WeightMismatchError, match="hashes to .* the sender's to .*; keeping v5"):
        engine.update_weights(other, 6, checksum=P.checksum(first))  # what landed is not what was sent
    missing = {n: a for n, a in other.items() if ".down_proj." not in n}
    with pytest.raises(P.WeightMismatchError, match=r"not this engine's LoRA adapter .*missing \['model\.layers\.0"
                                                    r"\.mlp\.down_proj\.lora_a'"):
        engine.update_weights(missing, 6)
    full = {"model.embed_tokens.weight": np.zeros((384, 64), np.float32)}
    with pytest.raises(P.WeightMismatchError, match=r"unexpected \['model\.embed_tokens\.weight'\]"):
        engine.update_weights(full, 6)  # full weights sent to a LoRA engine: refused, never half-applied
    assert engine.weight_version == 5 and engine.weight_checksum == P.checksum(first)
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == before


def test_a_sync_that_moved_nothing_is_an_error(engine, monkeypatch):
    """The known LoRA-sync bug, a swap that silently keeps the old adapter: the checksum is of what the sampler
    serves, read back after the swap, so it fails the sync instead of rolling out with stale weights."""
    first = _adapter(engine.config, seed=5)
    engine.update_weights(first, 8, checksum=P.checksum(first))
    monkeypatch.setattr(engine.sampler, "set_adapters", lambda *_: None)  # the swap that does nothing
    newer = _adapter(engine.config, seed=6)
    with pytest.raises(P.WeightMismatchError, match="keeping v8"):
        engine.update_weights(newer, 9, checksum=P.checksum(newer))
    assert engine.weight_version == 8


def test_offload_and_onload_keep_the_adapter(engine):
    adapter = _adapter(engine.config, seed=4)
    engine.update_weights(adapter, 7, checksum=P.checksum(adapter))
    before = _tokens(engine.generate(PROMPTS, GREEDY))
    engine.offload()
    assert engine.offloaded and engine.memory_bytes()["params"] == 0
    engine.onload()
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == before and engine.weight_checksum == P.checksum(adapter)
