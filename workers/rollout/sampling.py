"""Token sampling from logits: temperature, nucleus (top-p), greedy. Pure jnp, jit-friendly.

Shapes: B rows, V vocab. `temperature` and `top_p` are traced scalars, so one compiled program serves every
temperature, and every top_p below 1 (`nucleus=True`) or the top_p 1 of most runs (`nucleus=False`: no sort of the
vocabulary, and no branch: XLA:GPU copied the (B, V) logits into and out of a `lax.cond` choosing it at run time,
148 MiB read and 74 MiB written a decode step at batch 128 and Qwen3's 151,936 tokens, benchmarks/decode_cost.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def nucleus_filter(scaled: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep the smallest set of tokens whose probability mass reaches top_p; others -> -inf.

    scaled: (B, V) temperature-scaled logits. A token is kept when the mass of the strictly more
    likely tokens is below top_p, so the most likely token is always kept.
    """
    probs = jax.nn.softmax(scaled, axis=-1)
    sorted_p = -jnp.sort(-probs, axis=-1)  # (B, V) descending
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    threshold = jnp.min(jnp.where(mass_before < top_p, sorted_p, jnp.inf), axis=-1, keepdims=True)  # (B, 1)
    return jnp.where(probs >= threshold, scaled, -jnp.inf)


def sample_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array,
                  nucleus: bool | None = None):
    """logits (B, V) float32, keys (B,) typed PRNG keys -> tokens (B,) int32, logprobs (B,) float32.

    logprobs are under the distribution sampled from; for greedy (temperature == 0) they are the
    model's own log-softmax, since greedy decoding has no other distribution. `nucleus` (static): whether top_p
    filters (the caller knows top_p < 1: True; top_p is 1: False), or None to decide from the traced top_p.
    """
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    if nucleus is None:
        filtered = jax.lax.cond(top_p < 1.0, nucleus_filter, lambda s, _: s, scaled, top_p)
    else:
        filtered = nucleus_filter(scaled, top_p) if nucleus else scaled
    sampled = jax.vmap(jax.random.categorical)(keys, filtered)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    # The log-softmax of the one distribution the row's token came from (greedy is one scalar for all rows), at
    # that token: one max and one sum over the vocabulary, where both distributions' log-softmax took two each
    dist = jnp.where(greedy, logits, filtered)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(dist, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
