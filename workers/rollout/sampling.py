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
    A sampled token is `jax.random.categorical`'s (the Gumbel-max of the row's key), a greedy one `argmax(logits)`,
    the same bits; either comes out of one pass over the vocabulary with the max of its log-softmax (`_pick`).
    """
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    if nucleus is None:
        filtered = jax.lax.cond(top_p < 1.0, nucleus_filter, lambda s, _: s, scaled, top_p)
    else:
        filtered = nucleus_filter(scaled, top_p) if nucleus else scaled
    # what jax.random.categorical adds to a row before its argmax (vmapped over the rows' keys: the same bits)
    noise = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], logits.dtype))(keys)
    # the one distribution the row's token comes from (greedy is one scalar for all rows): its log-softmax at the token
    dist = jnp.where(greedy, logits, filtered)
    tokens, top = _pick(jnp.where(greedy, logits, noise + filtered), dist)
    # log_softmax(dist) at the token, as jax.nn.log_softmax computes it (the same bits)
    total = jnp.sum(jnp.exp(dist - top[:, None]), axis=-1)
    logprobs = (jnp.take_along_axis(dist, tokens[:, None], axis=-1)[:, 0] - top) - jnp.log(total)
    return tokens, logprobs


def _pick(scores: jax.Array, dist: jax.Array):
    """scores, dist (B, V) float32 -> the argmax of scores (B,) int32 (the first of equals; a NaN counts as the
    largest, as in jnp.argmax) and the max of dist (B,), in one pass over the vocabulary.

    Why: at a decode step of batch 128 and Qwen3's 151,936 tokens each pass over the float32 logits reads 74 MiB;
    the argmax of the Gumbel-perturbed scores, the greedy argmax and log_softmax's max were three of its four
    (benchmarks/decode_cost.py). The sum of log_softmax stays a pass of its own: an online sum, rescaled as partial
    maxima meet, would save one more but rounds worse on a CPU's sequential reduction (2e-4 off float64 at 151,936
    tokens, where the two-pass sum is 6e-7)."""
    index = jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)

    def combine(a, b):
        a_score, a_index, a_top = a
        b_score, b_index, b_top = b
        pick_a = (a_score > b_score) | (a_score != a_score)  # noqa: PLR0124 - NaN test
        pick_a_index = pick_a | ((a_score == b_score) & (a_index < b_index))
        return jnp.where(pick_a, a_score, b_score), jnp.where(pick_a_index, a_index, b_index), jnp.maximum(a_top, b_top)

    inf = jnp.array(-jnp.inf, scores.dtype)
    _, tokens, top = jax.lax.reduce((scores, index, dist), (inf, jnp.int32(0), inf), combine, (1,))
    return tokens, top
