"""A forward traces its decoder layers once for all of them (workers.models.decoder: `_layer_run`, `_layer_vjp`,
`_layer_step`, jitted on the layer's structure, a layer's adapters under one name every layer shares): lowering a
gradient program, or a KV-cached prefill and decode step, runs a layer's Python the same number of times whatever
the number of layers, where it ran it per layer (twice in a gradient: the forward, then the backward's recompute).
Tracing and lowering are Python on the GIL before every first step, warm cache or not: a Qwen3-0.6B gradient's went
2.1 -> 0.8 s, a LoRA actor's 5.6 -> 1.0 s, generate's 1.9 -> 0.5 s (benchmarks/compile_cost.py). The values are
those of the layers traced one by one: float32 bit for bit (tests/test_models_reference.py, the sampler's and the
training tests hold the numbers)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from workers.models import lora_batch as LB
from workers.models.decoder import CausalLM, DecoderLayer, init_cache
from workers.models.lora import LoraSpec
from workers.models.presets import preset_config

SPEC = LoraSpec(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))


def _layer_calls(layers: int, remat: str, lora: bool, monkeypatch) -> int:
    """How many times lowering the gradient of a `layers`-layer model's loss runs DecoderLayer.__call__."""
    cfg = preset_config("tiny", vocab_size=64).replace(num_hidden_layers=layers)
    graphdef, params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0)))
    ids = jnp.ones((2, 8), jnp.int32)
    mask = jnp.ones((2, 8), bool)
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    adapters = LB.stack([LB.init_adapter(cfg, SPEC, jax.random.key(1))], [SPEC], np.zeros(2, np.int32), dense=True)

    def loss(params, a, b):
        model = nnx.merge(graphdef, params)
        batch = dataclasses.replace(adapters, a=a, b=b) if lora else None
        hidden, _ = model.forward(ids, positions, mask, None, 0, adapters=batch, remat=remat)
        return jnp.sum(model.logits(hidden, batch))

    calls = []
    call = DecoderLayer.__call__
    monkeypatch.setattr(DecoderLayer, "__call__", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
    jax.clear_caches()  # what an earlier test traced is not this one's count
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(params, adapters.a, adapters.b)
    return len(calls)


@pytest.mark.parametrize("remat", ["layers", "off"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_gradient_traces_a_layer_as_often_whatever_the_number_of_layers(remat, lora, monkeypatch):
    two, six = (_layer_calls(n, remat, lora, monkeypatch) for n in (2, 6))
    assert 1 <= two == six <= 2, (two, six)  # traced per layer, it was 2 x 2 and 2 x 6 with remat, 2 and 6 without


def _cached_layer_calls(layers: int, lora: bool, monkeypatch) -> int:
    """How many times lowering a KV-cached prefill and one decode step of a `layers`-layer model (as the sampler
    calls them: the prefill at slot 0, a Python int; the step at a traced slot) runs DecoderLayer.__call__."""
    cfg = preset_config("tiny", vocab_size=64).replace(num_hidden_layers=layers)
    graphdef, params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0)))
    adapters = LB.stack([LB.init_adapter(cfg, SPEC, jax.random.key(1))], [SPEC], np.zeros(2, np.int32))

    def generate(params, adapters, t):
        model = nnx.merge(graphdef, params)
        batch = adapters if lora else None
        ids, mask = jnp.ones((2, 8), jnp.int32), jnp.ones((2, 12), bool)
        positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
        hidden, cache = model.forward(ids, positions, mask[:, :8], init_cache(cfg, 2, 12), 0, adapters=batch)
        step, _ = model.forward(ids[:, :1], positions[:, :1] + t, mask[:, :9], cache, 7 + t, adapters=batch)
        return hidden, step

    calls = []
    call = DecoderLayer.__call__
    monkeypatch.setattr(DecoderLayer, "__call__", lambda self, *a, **k: calls.append(1) or call(self, *a, **k))
    jax.clear_caches()
    jax.jit(generate).lower(params, adapters, jnp.int32(1))
    return len(calls)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_kv_cached_prefill_and_step_trace_a_layer_as_often_whatever_the_number_of_layers(lora, monkeypatch):
    two, six = (_cached_layer_calls(n, lora, monkeypatch) for n in (2, 6))
    assert two == six == 2, (two, six)  # the prefill's and the step's; per layer it was 4 and 12
