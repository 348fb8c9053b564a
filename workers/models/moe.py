"""A sparse mixture-of-experts MLP (Qwen3-MoE's): a softmax router picks k experts per token, each a SwiGLU MLP.

    block = MoeBlock(cfg, rngs)                   # cfg: workers.models.qwen3_moe.Qwen3MoeConfig
    y = block(x, router_logits=collected)          # x (B, T, H) -> (B, T, H); appends (B, T, E) logits

Design decisions:
- **Exact dispatch, no capacity.** Every token gets exactly its k experts, combined with its router weights,
  as transformers computes it; nothing is dropped when an expert is popular, so logits match the reference
  and a token's output never depends on the other tokens of the batch. Here each expert runs on every token
  and a (B, T, E) combine matrix, zero off the k chosen, weights the results: E / k times the expert FLOPs
  of a sorted (ragged) dispatch, and simple for XLA to shard: with the experts over the `ep` mesh axis
  each device computes its own experts for all tokens and the combine sums over ep. A ragged dispatch with
  an all-to-all over ep is what large MoE runs need (Qwen3-30B-A3B: 128 experts, k = 8, so 16x the expert
  FLOPs here); it is future work, and the logits it must produce are these.
- **Router in float32.** The router logits come from the compute dtype's matmul, the softmax, top-k and the
  renormalisation (`norm_topk_prob`) in float32, the weights cast back, as the reference does.
- **Experts stacked.** Each projection is one (E, in, out) array, so sharding is one rule per projection
  (experts over ep, the intermediate dimension over tp, the hidden one over fsdp).

Shapes: B batch, T tokens, H hidden, E experts, I expert width, k experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Experts(nnx.Module):
    """E SwiGLU MLPs, stacked: gate/up_proj.kernel (E, H, I), down_proj.kernel (E, I, H)."""

    def __init__(self, cfg, rngs: nnx.Rngs, dtype):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = jax.nn.initializers.normal(cfg.initializer_range)
        self.gate_proj = _Stacked(init(rngs.params(), (e, h, i), jnp.float32).astype(dtype))
        self.up_proj = _Stacked(init(rngs.params(), (e, h, i), jnp.float32).astype(dtype))
        self.down_proj = _Stacked(init(rngs.params(), (e, i, h), jnp.float32).astype(dtype))

    def __call__(self, x: jax.Array, combine: jax.Array) -> jax.Array:
        """x (B, T, H), combine (B, T, E) -> sum_e combine[..., e] * expert_e(x)  (B, T, H)."""
        gate = jnp.einsum("bth,ehi->btei", x, self.gate_proj.kernel[...])
        up = jnp.einsum("bth,ehi->btei", x, self.up_proj.kernel[...])
        hidden = jax.nn.silu(gate) * up * combine[..., None].astype(x.dtype)  # weight before the down projection
        return jnp.einsum("btei,eih->bth", hidden, self.down_proj.kernel[...])


class _Stacked(nnx.Module):
    def __init__(self, value: jax.Array):
        self.kernel = nnx.Param(value)


def route(logits: jax.Array, k: int, *, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits (..., E) -> (weights (..., k) float32, expert indices (..., k) int32), highest first."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, index = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, index


class MoeBlock(nnx.Module):
    """Router (`gate.kernel`, (H, E)) + experts."""

    def __init__(self, cfg, rngs: nnx.Rngs, dtype):
        init = jax.nn.initializers.normal(cfg.initializer_range)
        self.gate = _Stacked(init(rngs.params(), (cfg.hidden_size, cfg.num_experts), jnp.float32).astype(dtype))
        self.experts = Experts(cfg, rngs, dtype)
        self.k, self.normalize, self.num_experts = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.num_experts

    def __call__(self, x: jax.Array, router_logits: list | None = None) -> jax.Array:
        logits = jnp.einsum("bth,he->bte", x, self.gate.kernel[...])  # (B, T, E), the compute dtype's matmul
        if router_logits is not None:
            router_logits.append(logits)
        weights, index = route(logits, self.k, normalize=self.normalize)
        # The reference casts the k weights to the compute dtype before combining.
        weights = weights.astype(x.dtype)
        combine = jnp.sum(jax.nn.one_hot(index, self.num_experts, dtype=x.dtype) * weights[..., None], axis=-2)
        return self.experts(x, combine)


def load_balancing_loss(router_logits: list[jax.Array], k: int, mask: jax.Array | None = None) -> jax.Array:
    """Switch-style auxiliary loss over all MoE layers, as transformers' `load_balancing_loss_func`:
    E * sum_e f_e * P_e, where f_e is the share of (token, choice) assignments to expert e (summing to k) and
    P_e its mean router probability, over the tokens `mask` (B, T) marks. Each logits (B, T, E) -> scalar."""
    if not router_logits:
        return jnp.zeros((), jnp.float32)
    e = router_logits[0].shape[-1]
    m = jnp.ones(router_logits[0].shape[:-1], jnp.float32) if mask is None else mask.astype(jnp.float32)
    counts, probs_sum, rows = jnp.zeros((e,), jnp.float32), jnp.zeros((e,), jnp.float32), 0.0
    for logits in router_logits:
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        _, index = jax.lax.top_k(probs, k)
        counts = counts + jnp.sum(jax.nn.one_hot(index, e, dtype=jnp.float32) * m[..., None, None], axis=(0, 1, 2))
        probs_sum = probs_sum + jnp.sum(probs * m[..., None], axis=(0, 1))
        rows = rows + jnp.sum(m)
    return e * jnp.sum((counts / rows) * (probs_sum / rows))
