"""A training forward traces its decoder layers once for all of them (workers.models.decoder: `_layer_run` and
`_layer_vjp`, jitted on the layer's structure, a layer's adapters under one name every layer shares): lowering a
gradient program runs a layer's Python the same number of times whatever the number of layers, where it ran it
twice per layer (the forward, then the backward's recompute). Tracing and lowering are Python on the GIL before
every first step, warm cache or not: a Qwen3-0.6B gradient's went 2.1 -> 0.9 s, a LoRA actor's 5.6 -> 1.3 s
(benchmarks/compile_cost.py). The values are those of the layers traced one by one: float32 bit for bit
(tests/test_models_reference.py and the training tests hold the numbers)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from workers.models import lora_batch as LB
from workers.models.decoder import CausalLM, DecoderLayer
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
