"""The decoder of every supported family in Flax NNX (`CausalLM`), numerically faithful to Hugging Face's
`Qwen3ForCausalLM`, `Qwen2ForCausalLM` and `Qwen3MoeForCausalLM`.

The config (workers.models.config.ModelConfig and its families) says which parts a model has: q/k norms
(Qwen3, Qwen3-MoE; not Qwen2), biases per projection (Qwen2: q, k, v), and per layer a dense MLP or a
mixture of experts (workers.models.moe). Everything that uses a model (the actor, both rollout engines,
weight sync, offload, sharding) goes through this one class and the config's `param_shapes()`.

Design decisions:
- Parameter paths follow Hugging Face names, but projection matrices are stored (in, out) as
  `...q_proj.kernel` rather than torch's (out, in) `...q_proj.weight`: XLA:CPU runs x @ W at
  decode batch sizes ~1.4x faster than x @ W^T (measured on the `small` preset, batch 8), and it is
  the layout sglang-jax uses too. checkpoint.py transposes once at load and save; norms and the
  embedding keep HF's `.weight` and shape.
- One forward serves three callers: an unpadded batch (`model(input_ids)`), a padded training
  batch (explicit `positions` + `attention_mask`), and the rollout engine's KV-cached prefill and
  decode (`model.forward(..., cache=, cache_index=)`).
- Compute follows the parameter dtype (float32 or bfloat16); RMSNorm statistics, softmax and the
  returned logits are float32, as in the reference implementation.
- RoPE uses the config's `rope_theta` (a known JAX port hard-codes 1e6; Qwen3 presets differ).
- Rematerialisation (`remat="layers"`, training forwards only): without it autodiff keeps every layer's internals
  for the backward, attention's float32 (B, N, T, T) scores and probabilities the largest (~15 GiB for a 16 x 512
  micro-batch of Qwen3-0.6B). With it the forward keeps each layer's input alone and the backward recomputes one
  layer at a time (one more forward of FLOPs): the same computation, the same values. `jax.checkpoint` alone does
  not do it: XLA's scheduler is free to run every layer's recompute as soon as its inputs exist, before the
  backward reaches it (on CPU: 195 MiB of temporaries for 2 layers of 8 x 512 with it, 198 without, 107 here), so the
  backward recomputes a layer only once the gradient of its output has arrived (`_remat`).
- A forward traces its layers once: each layer runs through functions jitted on its structure (`_layer_run`,
  `_layer_vjp` for a rematerialised backward, `_layer_step` with a KV cache), which like layers share, its adapters
  under one name every layer shares. Tracing and lowering are Python before every first step, warm cache or not;
  XLA inlines the calls, so XLA:GPU compiles the program tracing each layer gave (the same ops and bytes: a
  Qwen3-0.6B gradient's trace 2.1 -> 0.9 s, a LoRA actor's 5.6 -> 1.3 s, generate's 1.5 -> 0.4 s). float32 gives
  the same bits; XLA:CPU's bfloat16 normalisation rounds where its fusions fall, which moved some bfloat16 values
  by a rounding there (docs/performance.md).
- LoRA adapters (workers.models.lora.AdapterBatch) are an explicit argument of every call, passed down to the
  projections they target (no module state), the output head's included (`logits(hidden, adapters)`): one
  program serves any adapters and any row -> adapter mix, and `adapters=None` traces exactly the program without
  them.

Shapes: B batch, T query tokens, S key slots, H hidden, N query heads, K kv heads, D head_dim, V vocab.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from workers.models.config import ModelConfig
from workers.models.decode_attention import attend
from workers.models.lora import HEAD
from workers.models.lora_batch import AdapterBatch, check_modules
from workers.models.moe import MoeBlock, load_balancing_loss

_NEG_INF = -1e30  # finite: a fully masked row (padding query) must not produce NaN

REMAT = ("layers", "off")  # `CausalLM.forward(remat=)`: see `_remat`


def _dtype(cfg: ModelConfig) -> jnp.dtype:
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


class LayerCache(NamedTuple):
    """KV cache of one layer. Slots are shared by all rows: row b's token at slot s is valid iff
    the caller's `kv_mask[b, s]` is true (left-padded prompts make slot indices line up)."""

    k: jax.Array  # (B, K, S, D): a head's slots contiguous, as the decode kernel reads them (decode_attention)
    v: jax.Array  # (B, K, S, D)


def init_cache(cfg: ModelConfig, batch: int, slots: int) -> list[LayerCache]:
    shape = (batch, cfg.num_key_value_heads, slots, cfg.head_dim)
    dt = _dtype(cfg)
    return [LayerCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(cfg.num_hidden_layers)]


class Linear(nnx.Module):
    """y = x K (+ b) (+ delta), K stored (in, out): the transpose of torch's weight. `delta` (..., out): what
    LoRA adapters add (AdapterBatch.delta), already in x's dtype."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = _dtype(cfg)
        init = jax.nn.initializers.normal(cfg.initializer_range)
        self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), jnp.float32).astype(dt))
        self.bias = nnx.Param(jnp.zeros((d_out,), dt)) if bias else None

    def __call__(self, x: jax.Array, delta: jax.Array | None = None) -> jax.Array:
        y = jnp.einsum("...i,io->...o", x, self.kernel[...])
        y = y + self.bias[...] if self.bias is not None else y
        return y + delta if delta is not None else y


def _delta(adapters: AdapterBatch | None, module: str, x: jax.Array) -> jax.Array | None:
    return None if adapters is None else adapters.delta(module, x)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, cfg: ModelConfig):
        self.weight = nnx.Param(jnp.ones((dim,), _dtype(cfg)))
        self.eps = cfg.rms_norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # Statistics in float32, then cast back before the scale: the reference's order of rounding.
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, "rotate half" convention.  x: (B, T, heads, D), positions: (B, T) int."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # (D/2,)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, T, D/2)
    emb = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # (B, T, 1, D)
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, n, k, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        self.q_proj = Linear(h, n * d, bias=cfg.proj_bias("q"), cfg=cfg, rngs=rngs)
        self.k_proj = Linear(h, k * d, bias=cfg.proj_bias("k"), cfg=cfg, rngs=rngs)
        self.v_proj = Linear(h, k * d, bias=cfg.proj_bias("v"), cfg=cfg, rngs=rngs)
        self.o_proj = Linear(n * d, h, bias=cfg.proj_bias("o"), cfg=cfg, rngs=rngs)
        self.q_norm = RMSNorm(d, cfg=cfg) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg=cfg) if cfg.qk_norm else None

    def __call__(self, x, positions, mask, cache: LayerCache | None, cache_index,
                 adapters: AdapterBatch | None = None, prefix: str = "", span: tuple | None = None):
        """x: (B, T, H); positions: (B, T); mask: (B, T, S) bool -> (B, T, H), updated cache. `prefix`: this
        module's path (`model.layers.<i>.self_attn`), naming its projections in `adapters`. `span`: (impl, first
        (B,), end (B,), the cache's sharding or None) where a decode kernel attends (workers.models.decode_attention:
        row b's slots [first, end) of the cache, whatever the mask's length), None for XLA's attention over the mask
        (CausalLM.forward)."""
        cfg = self.cfg
        b, t, _ = x.shape
        n, k, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = self.q_proj(x, _delta(adapters, f"{prefix}.q_proj", x)).reshape(b, t, n, d)
        kk = self.k_proj(x, _delta(adapters, f"{prefix}.k_proj", x)).reshape(b, t, k, d)
        if self.q_norm is not None:
            q, kk = self.q_norm(q), self.k_norm(kk)
        v = self.v_proj(x, _delta(adapters, f"{prefix}.v_proj", x)).reshape(b, t, k, d)
        q, kk = rope(q, positions, cfg.rope_theta), rope(kk, positions, cfg.rope_theta)
        # Grouped-query attention without materialising repeated kv heads: q -> (B, T, K, G, D).
        q = q.reshape(b, t, k, n // k, d)
        slots = "bskd"  # where kk and v keep their slots: (B, S, K, D) without a cache
        if cache is not None:
            slots = "bksd"  # the cache's layout
            kk, v = kk.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, K, T, D)
            # All rows write the same slots: the caller aligns rows by left padding.
            kk = jax.lax.dynamic_update_slice_in_dim(cache.k, kk, cache_index, axis=2)
            v = jax.lax.dynamic_update_slice_in_dim(cache.v, v, cache_index, axis=2)
            cache = LayerCache(kk, v)
            if span is not None:
                impl, first, end, sharding = span
                out = attend(q[:, 0], kk, v, first, end, impl=impl, sharding=sharding)
                out = out.astype(v.dtype).reshape(b, t, n * d)
                return self.o_proj(out, _delta(adapters, f"{prefix}.o_proj", out)), cache
            # Attend to the slots the mask covers, the cache's first S: a decode step reads the slots written so far,
            # not the whole cache (the KV cache, not the weights, is most of a large batch's bytes per step)
            kk, v = kk[:, :, : mask.shape[-1]], v[:, :, : mask.shape[-1]]
        scores = jnp.einsum(f"btkgd,{slots}->bkgts", q, kk, preferred_element_type=jnp.float32) * d**-0.5
        scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        if cache is None:
            out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
        else:  # the heads first, as the cache's (XLA:CPU's matmul library takes it so, ~8 x faster than the above)
            out = jnp.einsum("bkgts,bksd->bkgtd", probs, v).transpose(0, 3, 1, 2, 4)
        out = out.reshape(b, t, n * d)
        return self.o_proj(out, _delta(adapters, f"{prefix}.o_proj", out)), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, bias=False, cfg=cfg, rngs=rngs)
        self.up_proj = Linear(h, i, bias=False, cfg=cfg, rngs=rngs)
        self.down_proj = Linear(i, h, bias=False, cfg=cfg, rngs=rngs)

    def __call__(self, x, adapters: AdapterBatch | None = None, prefix: str = ""):
        """x (B, T, H) -> (B, T, H); `prefix`: this module's path (`model.layers.<i>.mlp`)."""
        gate = self.gate_proj(x, _delta(adapters, f"{prefix}.gate_proj", x))
        h = jax.nn.silu(gate) * self.up_proj(x, _delta(adapters, f"{prefix}.up_proj", x))  # (B, T, I)
        return self.down_proj(h, _delta(adapters, f"{prefix}.down_proj", h))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg=cfg)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg=cfg)
        self.moe = cfg.moe_layer(layer)
        self.mlp = MoeBlock(cfg, rngs, _dtype(cfg)) if self.moe else MLP(cfg, rngs)

    def __call__(self, x, positions, mask, cache, cache_index, router_logits=None,
                 adapters: AdapterBatch | None = None, prefix: str = "", span: tuple | None = None, rows=None):
        """`prefix`: this layer's path (`model.layers.<i>`), naming its projections in `adapters` (the MLP
        projections of a MoE layer are never adapted: lora.check_modules refuses them). `rows`: the layout the
        residual stream (B, T, H) keeps in and out of the layer (CausalLM.forward)."""
        x = _keep(x, rows)
        attn, cache = self.self_attn(self.input_layernorm(x), positions, mask, cache, cache_index, adapters,
                                     f"{prefix}.self_attn", span)
        x = x + attn
        h = self.post_attention_layernorm(x)
        out = x + (self.mlp(h, router_logits) if self.moe else self.mlp(h, adapters, f"{prefix}.mlp"))
        return _keep(out, rows), cache


def _keep(x: jax.Array, rows) -> jax.Array:
    """x laid out as `rows` (a NamedSharding), where one is given."""
    return x if rows is None else jax.lax.with_sharding_constraint(x, rows)


class Embedding(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(cfg.initializer_range)
        shape = (cfg.vocab_size, cfg.hidden_size)
        self.weight = nnx.Param(init(rngs.params(), shape, jnp.float32).astype(_dtype(cfg)))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


class DecoderModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.embed_tokens = Embedding(cfg, rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg=cfg)


class CausalLM(nnx.Module):
    """A causal LM of any supported family (its config says which).

    Calling conventions:
    - `model(input_ids)`: input_ids int32 (B, T), an unpadded batch -> float32 logits (B, T, V).
    - `model(input_ids, positions=, attention_mask=)`: a padded batch. `attention_mask` (B, T) marks
      real tokens; `positions` (B, T) are each token's index within its own sequence
      (for left padding: `cumsum(mask) - 1`). Logits at padding positions are meaningless.
    - `model.forward(input_ids, positions, kv_mask, cache, cache_index)`: KV-cached step used by the
      rollout engine. Writes the T new tokens' keys/values at slots [cache_index, cache_index + T)
      of every row and returns final hidden states (B, T, H) plus the new cache; `kv_mask` (B, S)
      marks valid slots among the cache's first S, the only ones attended (S may be less than the
      cache's slots). Apply `model.logits(hidden, adapters)` to the positions you need (with the same
      adapters: an adapter on the output head acts there).
    - `model.with_router_loss(...)`: see there.
    - Every call takes `adapters=` (workers.models.lora.AdapterBatch, one adapter index per batch row, -1 for
      the base): the LoRA adapters each row runs with. None (the default) is the base model.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = DecoderModel(cfg, rngs)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, cfg=cfg, rngs=rngs)

    def __call__(self, input_ids, *, positions=None, attention_mask=None,
                 adapters: AdapterBatch | None = None) -> jax.Array:
        positions, mask = self._defaults(input_ids, positions, attention_mask)
        hidden, _ = self.forward(input_ids, positions, mask, None, 0, adapters=adapters)
        return self.logits(hidden, adapters)

    def with_router_loss(self, input_ids, *, positions=None, attention_mask=None,
                         adapters: AdapterBatch | None = None) -> tuple[jax.Array, jax.Array]:
        """As `model(...)`, plus the load-balancing loss of its MoE layers over the real tokens
        (workers.models.moe.load_balancing_loss): (float32 logits (B, T, V), float32 scalar; 0 without experts)."""
        positions, mask = self._defaults(input_ids, positions, attention_mask)
        collected: list = []
        hidden, _ = self.forward(input_ids, positions, mask, None, 0, router_logits=collected, adapters=adapters)
        k = getattr(self.config, "num_experts_per_tok", 1)
        return self.logits(hidden, adapters), load_balancing_loss(collected, k, mask)

    def hidden_states(self, input_ids, *, attention_mask=None, adapters: AdapterBatch | None = None,
                      router_loss: bool = False, remat: str = "off", rows=None) -> tuple[jax.Array, jax.Array]:
        """The final hidden states (B, T, H) of a padded batch (before the output head: `logits` of a slice of them
        gives what `model(...)` would there), and the MoE load-balancing loss with `router_loss` (else 0). `remat`:
        what each layer keeps for a backward (REMAT); `rows`: the residual stream's layout (`forward`)."""
        positions, mask = self._defaults(input_ids, None, attention_mask)
        collected: list | None = [] if router_loss else None
        hidden, _ = self.forward(input_ids, positions, mask, None, 0, router_logits=collected, adapters=adapters,
                                 remat=remat, rows=rows)
        if not router_loss:
            return hidden, jnp.zeros((), jnp.float32)
        return hidden, load_balancing_loss(collected, getattr(self.config, "num_experts_per_tok", 1), mask)

    @staticmethod
    def _defaults(input_ids, positions, attention_mask):
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), dtype=bool)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        return positions, attention_mask.astype(bool)

    def forward(self, input_ids, positions, kv_mask, cache: list[LayerCache] | None, cache_index,
                router_logits: list | None = None, adapters: AdapterBatch | None = None, remat: str = "off",
                decode_attention: str = "xla", live: jax.Array | None = None, kv_sharding=None, rows=None):
        """input_ids, positions: (B, T); kv_mask: (B, S) -> hidden (B, T, H), cache. MoE layers append their
        router logits (B, T, E) to `router_logits` when given. `adapters.rows` (B,): each row's adapter. `remat`
        (REMAT, without a cache only): what each layer keeps for a backward; `off`, all of it. `decode_attention`
        (workers.models.decode_attention.IMPLS): how a one-token step with a cache attends; all but `xla` read row
        b's slots from its first valid one in kv_mask to cache_index, so its valid slots must be one run there
        (left-padded prompts); S may then be less than the slots written. `live` (B,): the rows still decoding; the
        others' attention, with a kernel, reads nothing and is zero (their outputs are the caller's to drop).
        `kv_sharding`: the cache's NamedSharding on a mesh of several devices, where a kernel runs on each device's
        shard (decode_attention.attend). `rows`: a NamedSharding of the residual stream (B, T, H), rows over the
        batch's mesh axes, that every layer keeps in and out (an actor on a mesh that splits rows: without it, XLA's
        partitioner met the batch and the weights' hidden dimension both split over fsdp and gathered activations
        over the batch inside the layers, 229 all-to-alls and 5.8 GiB of temporaries in a Qwen3-0.6B gradient on
        fsdp 2 where the weights' gathers need 2.3: benchmarks/gpu_memory.py --fsdp)."""
        if remat not in REMAT:
            raise ValueError(f"remat {remat!r}: one of {sorted(REMAT)}")
        if remat != "off" and cache is not None:
            raise ValueError(f"remat {remat!r} is for training forwards: a KV-cached call has no backward")
        if adapters is not None:
            check_modules(self.config, adapters, input_ids.shape[0])
        t = input_ids.shape[1]
        s = kv_mask.shape[1]
        # Causal in slot space: query i (at slot cache_index + i) sees slots <= its own.
        query_slot = cache_index + jnp.arange(t)
        causal = jnp.arange(s)[None, :] <= query_slot[:, None]  # (T, S)
        mask = causal[None] & kv_mask[:, None, :]  # (B, T, S)
        span = None  # where a decode kernel attends, found once for every layer
        if cache is not None and t == 1 and decode_attention != "xla":
            # each row from its first valid slot (left padding contiguous before it) to the one written now; a
            # finished row, nothing
            first = jnp.argmax(kv_mask, axis=-1)
            end = jnp.full_like(first, cache_index + 1) if live is None else jnp.where(live, cache_index + 1, first)
            span = (decode_attention, first, end, kv_sharding)
        x = self.model.embed_tokens(input_ids)
        new_cache = [] if cache is not None else None
        for i, layer in enumerate(self.model.layers):
            if cache is None:  # a training forward
                x = _layer(layer, x, positions, mask, router_logits, adapters, f"model.layers.{i}", rows,
                           remat=remat != "off")
                continue
            x, layer_cache = _cached_layer(layer, x, positions, mask, cache[i], cache_index, router_logits, adapters,
                                           f"model.layers.{i}", span, rows)
            new_cache.append(layer_cache)
        return self.model.norm(x), new_cache

    def logits(self, hidden: jax.Array, adapters: AdapterBatch | None = None) -> jax.Array:
        """hidden (B, ..., H) -> float32 logits (B, ..., V), plus what adapters on the output head ("lm_head") add
        to row b (adapters.rows (B,)), in float32."""
        if self.lm_head is None:  # tied: the (V, H) embedding doubles as the head
            out = jnp.einsum("...h,vh->...v", hidden, self.model.embed_tokens.weight[...],
                             preferred_element_type=jnp.float32)
        else:
            out = jnp.einsum("...h,hv->...v", hidden, self.lm_head.kernel[...], preferred_element_type=jnp.float32)
        if adapters is None or HEAD not in adapters.a:
            return out
        check_modules(self.config, adapters, hidden.shape[0])
        b, h = hidden.shape[0], hidden.shape[-1]
        # delta takes (B, T, in) and returns x's dtype: given float32, the head's delta stays float32
        delta = adapters.delta(HEAD, hidden.reshape(b, -1, h).astype(jnp.float32))
        return out + delta.reshape(out.shape)


def _layer(layer: DecoderLayer, x, positions, mask, router_logits: list | None, adapters: AdapterBatch | None,
           prefix: str, rows=None, *, remat: bool = False) -> jax.Array:
    """`layer`'s output (B, T, H) for x (B, T, H) without a cache (`remat`: rematerialised, `_remat`), traced once
    for all like layers: by functions jitted on the layer's structure (`_layer_run`, `_layer_vjp`), which like layers
    share, a layer's adapters passed under one name every layer shares (AdapterBatch.renamed); so the 28 layers of
    a Qwen3-0.6B are one trace, not 28 (XLA inlines the calls). A MoE layer's router logits are appended to
    `router_logits`."""
    graphdef, params = nnx.split(layer)
    own = None if adapters is None else adapters.renamed(prefix, _LAYER)
    run = _remat if remat else _layer_run
    y, collected = run(graphdef, router_logits is not None, rows, (params, x, positions, mask, own))
    if router_logits is not None:
        router_logits.extend(collected)
    return y


def _cached_layer(layer: DecoderLayer, x, positions, mask, cache: LayerCache, cache_index,
                  router_logits: list | None, adapters: AdapterBatch | None, prefix: str, span: tuple | None,
                  rows=None) -> tuple[jax.Array, LayerCache]:
    """`layer`'s KV-cached call (CausalLM.forward's), by `_layer_step`: traced once for all like layers (a prefill's
    and a decode step's each). A `cache_index` given as a Python int (a prefill's 0) stays a constant of the program.
    A MoE layer's router logits are appended to `router_logits`."""
    graphdef, params = nnx.split(layer)
    own = None if adapters is None else adapters.renamed(prefix, _LAYER)
    impl, first, end, sharding = span if span is not None else (None, None, None, None)
    fixed = cache_index if isinstance(cache_index, int) else None
    index = None if fixed is not None else cache_index
    y, collected, cache = _layer_step(graphdef, router_logits is not None, rows, impl, sharding, fixed,
                                      (params, x, positions, mask, cache, index, first, end, own))
    if router_logits is not None:
        router_logits.extend(collected)
    return y, cache


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _layer_step(graphdef, collect: bool, rows, impl: str | None, kv_sharding, fixed_index: int | None, inputs):
    """A decoder layer's KV-cached call: (y (B, T, H), its router logits or None, its updated cache). `impl` and
    `kv_sharding`: the decode kernel's, with `first` and `end` of `inputs` (CausalLM.forward's span), or None."""
    params, x, positions, mask, cache, index, first, end, adapters = inputs
    span = None if impl is None else (impl, first, end, kv_sharding)
    collected = [] if collect else None
    y, cache = nnx.merge(graphdef, params)(x, positions, mask, cache, index if fixed_index is None else fixed_index,
                                           collected, adapters, _LAYER, span, rows)
    return y, collected, cache


_LAYER = "layer"  # the module path a layer's adapters go by inside `_layer_run`, the same for every layer


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _layer_run(graphdef, collect: bool, rows, inputs):
    """A decoder layer's forward without a cache: (y (B, T, H), its router logits (a list) or None)."""
    params, x, positions, mask, adapters = inputs
    collected = [] if collect else None
    y, _ = nnx.merge(graphdef, params)(x, positions, mask, None, 0, collected, adapters, _LAYER, None, rows)
    return y, collected


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _layer_vjp(graphdef, collect: bool, rows, inputs, cotangent):
    """The cotangent of `_layer_run`'s inputs, its forward recomputed."""
    return jax.vjp(functools.partial(_layer_run, graphdef, collect, rows), inputs)[1](cotangent)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _remat(graphdef, collect: bool, rows, inputs):
    """`_layer_run` rematerialised: the forward keeps its inputs (x, the layer's params, the mask, the adapters), and
    the backward recomputes the layer's forward from them only after the cotangent of its output exists, so one
    layer's internals are alive at a time (and, on fsdp, one layer's gathered weights: `rows`)."""
    return _layer_run(graphdef, collect, rows, inputs)


def _remat_forward(graphdef, collect: bool, rows, inputs):
    return _layer_run(graphdef, collect, rows, inputs), inputs


def _remat_backward(graphdef, collect: bool, rows, inputs, cotangent):
    # The recompute waits for the cotangent: x + 0 x (one of its values), x itself for a finite cotangent (a
    # non-finite one makes the gradient non-finite either way). XLA:CPU drops optimization barriers before it
    # schedules; a data dependency holds on every backend, and no compiler may fold it (0 x NaN is NaN).
    # On a mesh that splits rows (fsdp), the layer's weight shards wait for it too: their gathers in the recompute
    # are then gathers of other values than the forward's, which XLA would otherwise merge into one, keeping
    # every layer's gathered weights from the forward to the backward (a Qwen3-4B gradient for 4 H100s: 8.6 GiB
    # of temporaries, 3.3 with each layer gathered again in its recompute; benchmarks/gpu_memory.py --fsdp).
    params, x, positions, mask, adapters = inputs
    zero = 0 * cotangent[0].ravel()[0]
    x = x + zero.astype(x.dtype)
    if rows is not None:
        params = jax.tree.map(lambda p: p + zero.astype(p.dtype), params)
    return _layer_vjp(graphdef, collect, rows, (params, x, positions, mask, adapters), cotangent)


_remat.defvjp(_remat_forward, _remat_backward)
