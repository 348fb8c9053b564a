"""`decode_attention`: one decode step's attention over a KV cache, reading only each row's filled slots.

    attend(q (B, K, G, D), k (B, K, S, D), v (B, K, S, D), first (B,), end () or (B,), impl=, sharding=)
        -> (B, K, G, D) float32

Row b attends to the slots [first[b], end[b]) of its cache: the sampler's prompts are left-padded, so a row's valid
slots are one contiguous run, from its first prompt token to the slot written last; a row that has finished
decoding gets an empty run, and the kernel reads none of its slots. K KV heads, G query heads per
KV head (grouped-query attention), S slots, D the head's width.

Why a kernel: at batch 128 a decode step's bytes are mostly the KV cache (docs/performance.md), and XLA's attention
reads the slots it is given, a static prefix: every left-padding slot before a row's prompt (`prompt_padding: max`
pads GSM8K's ~96-token prompts to 256) and every slot not yet written. `pallas` reads from the block holding
`first[b]` to the block holding `end - 1`, whatever the step, so one decode loop serves the whole generation (XLA
needs a loop per static prefix it attends to: workers.rollout.jax_sampler's segments).

Implementations (`IMPLS`), one contract:
- `xla`: the masked softmax in jnp (the reference; what every platform can run).
- `pallas`: a Pallas kernel, one program per (row, KV head): an online softmax (flash-decoding without splits:
  at batch 128 x 8 KV heads there are 1,024 programs, enough to fill a GPU, and no partial results to write and
  combine), the G query heads of the KV head each a vector (a dot product per slot: memory-bound, no tensor core
  needed, and G need not be a power of two). Lowered by Triton on a GPU (named: JAX's default GPU backend may be
  Mosaic GPU, which stages a program's whole blocks in shared memory).
- `interpret`: that kernel under Pallas's interpreter, on any platform: the same kernel body, for the CPU's tests,
  slowly.

On a mesh of several devices (`sharding`: the KV cache's, workers.models.sharding.kv_cache_sharding) the kernel
runs on each device's shard under `jax.shard_map`: rows split as the cache's rows (dp x fsdp x ep), KV heads as its
heads (tp, or whole where tp does not divide them). A row's attention needs only its own KV heads' slots, so no
device reads another's cache; XLA cannot partition a kernel it does not see into, and would gather the whole cache
onto every device around it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

IMPLS = ("xla", "pallas", "interpret")
# The kernel's tiling, untuned (no GPU has run it yet; benchmarks/gpu.py's probe times it at other values too)
BLOCK = 32  # most slots a kernel iteration reads: the granularity of what `pallas` skips
NUM_WARPS = 4


def attend(q: jax.Array, k: jax.Array, v: jax.Array, first: jax.Array, end, *, impl: str, block: int = BLOCK,
           num_warps: int = NUM_WARPS, sharding=None) -> jax.Array:
    """q (B, K, G, D), k/v (B, K, S, D), first (B,) int, end () or (B,) int -> (B, K, G, D) float32: softmax(q k^T /
    sqrt(D)) v over slots [first[b], end[b]) of row b. A row with no slot in that range gets zeros. `block`,
    `num_warps`: the kernel's tiling (a power of two; the block is at most the largest power of two dividing S).
    `sharding`: the cache's NamedSharding where it lies on several devices (the kernel then runs on each one's
    shard; q and the output split alike); None on one device."""
    if impl not in IMPLS:
        raise ValueError(f"decode attention {impl!r}: one of {IMPLS}")
    if impl == "xla":
        return reference(q, k, v, first, end)
    kernel = functools.partial(_pallas, interpret=impl == "interpret", block=block, num_warps=num_warps)
    first = first.astype(jnp.int32)
    ends = jnp.broadcast_to(jnp.asarray(end, jnp.int32), first.shape)
    if sharding is not None and sharding.mesh.size > 1:
        kernel = partitioned(kernel, sharding)
    return kernel(q, k, v, first, ends)


def partitioned(kernel, sharding):
    """`kernel(q, k, v, first, end)` on each device's shard of a cache laid out as `sharding` (B, K, S, D): q and
    the output (B, K, G, D) split as the cache's rows and heads, first and end (B,) as its rows. The slots and the
    head's width are never split (workers.models.sharding.KV_CACHE), so each shard is a whole attention."""
    from jax.sharding import PartitionSpec as P

    spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
    if spec[2] is not None or spec[3] is not None:
        raise ValueError(f"decode attention on a cache split along its slots or head width ({sharding.spec}): the "
                         f"kernel attends over a head's slots whole")
    heads, rows = P(spec[0], spec[1], None, None), P(spec[0])
    # check_vma off: JAX cannot see into a Pallas call to tell which mesh axes its output varies over
    return jax.shard_map(kernel, mesh=sharding.mesh, in_specs=(heads, heads, heads, rows, rows), out_specs=heads,
                         check_vma=False)


def reference(q, k, v, first, end) -> jax.Array:
    """The contract in jnp: a masked softmax, float32 scores, probabilities in v's dtype (as the decoder's own
    attention rounds them)."""
    d = q.shape[-1]
    scores = jnp.einsum("bkgd,bksd->bkgs", q, k, preferred_element_type=jnp.float32) * d**-0.5
    slot = jnp.arange(k.shape[2])
    end = jnp.broadcast_to(end, first.shape)
    valid = (slot[None, :] >= first[:, None]) & (slot[None, :] < end[:, None])  # (B, S)
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.where(valid[:, None, None, :], jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    probs = (weights / jnp.where(total > 0, total, 1.0)).astype(v.dtype)
    return jnp.einsum("bkgs,bksd->bkgd", probs, v, preferred_element_type=jnp.float32)


def unsupported(head_dim: int) -> str | None:
    """Why the kernel cannot attend over heads this wide, or None: Triton's blocks are powers of two."""
    if head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two (the Pallas kernel's blocks must be)"
    return None


def unavailable() -> str | None:
    """Why this JAX cannot lower the kernel for a GPU (its Pallas lacks the Triton backend's parameters), or None."""
    try:
        from jax.experimental.pallas import triton as pl_triton

        pl_triton.CompilerParams  # noqa: B018 - what _pallas names
    except (ImportError, AttributeError) as e:
        return f"this JAX's Pallas has no Triton backend to name ({type(e).__name__}: {e})"
    return None


def resolve(requested: str, *, platform: str, head_dim: int) -> str:
    """The implementation a generate program uses: `auto` is `pallas` on GPUs (one or a mesh of them: `attend`
    partitions it as the cache) where the kernel can run, `xla` elsewhere; an explicit choice is checked."""
    choices = ("auto", *IMPLS)
    if requested not in choices:
        raise ValueError(f"decode_attention={requested!r}: one of {choices}")
    why = unsupported(head_dim) or (unavailable() if requested != "interpret" and platform == "gpu" else None)
    if requested == "auto":
        return "pallas" if platform == "gpu" and why is None else "xla"
    if requested == "xla":
        return requested
    if why:
        raise ValueError(f"decode_attention={requested!r}: {why}; use 'xla'")
    if requested == "pallas" and platform != "gpu":
        raise ValueError(f"decode_attention='pallas' lowers for a GPU (this platform: {platform}); 'interpret' runs "
                         f"the kernel here under Pallas's interpreter, 'xla' the jnp attention")
    return requested


def _pallas(q, k, v, first, end, *, interpret: bool, block: int, num_warps: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    b, kv, g, d = q.shape
    s = k.shape[2]
    why = unsupported(d)
    if why:
        raise ValueError(f"decode attention: {why}; use 'xla'")
    block = math.gcd(block, s & -s)  # a power of two dividing S (the sampler's are a sum of two powers of two)
    kernel = functools.partial(_kernel, groups=g, block=block, scale=d**-0.5)
    return pl.pallas_call(
        kernel,
        grid=(b, kv),
        in_specs=[
            pl.BlockSpec((None, None, g, d), lambda i, j: (i, j, 0, 0)),  # q: this row's KV head's G heads
            pl.BlockSpec((None, None, s, d), lambda i, j: (i, j, 0, 0)),  # k: its slots (read by blocks, in part)
            pl.BlockSpec((None, None, s, d), lambda i, j: (i, j, 0, 0)),  # v
            pl.BlockSpec((1,), lambda i, j: (i,)),  # first
            pl.BlockSpec((1,), lambda i, j: (i,)),  # end
        ],
        out_specs=pl.BlockSpec((None, None, g, d), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kv, g, d), jnp.float32),
        # Triton, named: where JAX's default GPU backend is Mosaic GPU, it stages a program's whole blocks (all of
        # its S slots of k and v) in shared memory, more than an H100 has at 512 slots of 128
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="rlsched_decode_attention",
    )(q, k, v, first, end)


def _kernel(q_ref, k_ref, v_ref, first_ref, end_ref, o_ref, *, groups: int, block: int, scale: float):
    """One (row, KV head): an online softmax over the blocks from the one holding `first` to the one holding
    `end - 1`, a running max, sum and weighted sum of v per query head, all float32."""
    from jax.experimental import pallas as pl

    first, end = first_ref[0], end_ref[0]
    qs = [q_ref[h, :].astype(jnp.float32) * scale for h in range(groups)]  # G x (D,)
    offsets = jnp.arange(block)

    def step(i, carry):
        start = i * block
        k = k_ref[pl.ds(start, block), :].astype(jnp.float32)  # (block, D)
        v = v_ref[pl.ds(start, block), :].astype(jnp.float32)
        slot = start + offsets
        valid = (slot >= first) & (slot < end)
        out = []
        for h in range(groups):
            top, total, acc = carry[h]
            scores = jnp.where(valid, jnp.sum(k * qs[h][None, :], axis=1), -jnp.inf)  # (block,)
            new_top = jnp.maximum(top, jnp.max(scores))
            weights = jnp.where(valid, jnp.exp(scores - new_top), 0.0)
            rescale = jnp.exp(top - new_top)
            out.append((new_top, total * rescale + jnp.sum(weights),
                        acc * rescale + jnp.sum(weights[:, None] * v, axis=0)))
        return tuple(out)

    init = tuple((jnp.float32(-1e30), jnp.float32(0.0), jnp.zeros(q_ref.shape[-1], jnp.float32))
                 for _ in range(groups))
    lo = first // block
    hi = (end + block - 1) // block
    result = jax.lax.fori_loop(lo, hi, step, init)
    for h in range(groups):
        _, total, acc = result[h]
        o_ref[h, :] = acc / jnp.where(total > 0, total, 1.0)
