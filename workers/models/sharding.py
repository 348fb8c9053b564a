"""How a model is laid out on a device mesh: one table, read top to bottom.

Every role runs on a mesh with four named axes, `dp` x `fsdp` x `ep` x `tp` (a rollout mesh is the same
with fsdp 1; ep is 1 unless the model has experts). Each array's dimensions carry a *logical* axis name;
the table `LOGICAL` maps a logical name to mesh axes, and `PARAMS` gives the logical names of every
parameter's dimensions, matched on its flat name (workers.models.params). A new model family adds rows to
`PARAMS`.

    parameter / array              logical dims            mesh axes
    embed_tokens.weight  (V, H)    vocab, embed            tp, fsdp
    lm_head.kernel       (H, V)    embed, vocab            fsdp, tp
    LoRA lora_a / lora_b (in, r) / (r, out)                as the kernel's in / out (tied head: the embedding's)
    q_proj.kernel        (H, N*D)  embed, heads            fsdp, tp     (column parallel)
    k_proj/v_proj.kernel (H, K*D)  embed, kv_heads         fsdp, tp     (tp replicated if it does not divide K)
    o_proj.kernel        (N*D, H)  heads, embed            tp, fsdp     (row parallel)
    gate/up_proj.kernel  (H, I)    embed, mlp              fsdp, tp     (column parallel)
    down_proj.kernel     (I, H)    mlp, embed              tp, fsdp     (row parallel)
    experts.gate/up_proj (E, H, I) expert, embed, mlp      ep, fsdp, tp (experts over ep, each column parallel)
    experts.down_proj    (E, I, H) expert, mlp, embed      ep, tp, fsdp
    mlp.gate.kernel      (H, E)    embed, router           fsdp, -      (the router: small, experts whole)
    *norm.weight         (H,)/(D,) norm                    replicated
    optimizer moments              as their parameter
    batch / activations  (B, ...)  batch, ...              (dp, fsdp, ep), replicated
    KV cache          (B, K, S, D) batch, kv_heads, -, -   (dp, fsdp, ep), tp, -, -

Design decisions:
- **Pure Python.** The control plane checks a config against this table (which axis fails to divide
  which parameter) before any process starts, and it never imports JAX; `shardings()` and `mesh()`
  import JAX only when a role builds its arrays.
- **KV heads replicate rather than fail.** Grouped-query models have few KV heads (the tiny preset
  has one); serving systems replicate them across tp when tp exceeds their count, and so do we: the
  k/v projections and the KV cache keep their head axis whole, everything else still splits.
- **Norm scales are replicated**: a few KB per layer, and splitting them would cost a gather per use.
- **ep splits the batch too.** Outside the MoE layers an ep group is data parallel (rows over ep), so no
  device repeats another's attention; inside them each device computes its experts (workers.models.moe).
- **tp innermost.** Devices fill the mesh in the order given, tp fastest: tp groups are neighbours
  (one NVLink island, one TPU ring), where the per-layer all-reduces go.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from workers.compiling import kept

AXES = ("dp", "fsdp", "ep", "tp")

# logical axis -> mesh axes (None: replicated)
LOGICAL: dict[str, tuple[str, ...] | None] = {
    "batch": ("dp", "fsdp", "ep"),
    "vocab": ("tp",),
    "embed": ("fsdp",),
    "heads": ("tp",),
    "kv_heads": ("tp",),
    "mlp": ("tp",),
    "expert": ("ep",),
    "router": None,
    "norm": None,
}

# parameter flat name (regex, full match) -> logical axis of each dimension
PARAMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"model\.embed_tokens\.weight", ("vocab", "embed")),
    (r"lm_head\.kernel", ("embed", "vocab")),
    (r".*\.q_proj\.kernel", ("embed", "heads")),
    (r".*\.q_proj\.bias", ("heads",)),
    (r".*\.(k|v)_proj\.kernel", ("embed", "kv_heads")),
    (r".*\.(k|v)_proj\.bias", ("kv_heads",)),
    (r".*\.o_proj\.kernel", ("heads", "embed")),
    (r".*\.o_proj\.bias", ("embed",)),
    (r".*\.experts\.(gate|up)_proj\.kernel", ("expert", "embed", "mlp")),
    (r".*\.experts\.down_proj\.kernel", ("expert", "mlp", "embed")),
    (r".*\.mlp\.gate\.kernel", ("embed", "router")),
    (r".*\.(gate|up)_proj\.kernel", ("embed", "mlp")),
    (r".*\.down_proj\.kernel", ("mlp", "embed")),
    (r".*norm\.weight", ("norm",)),
)

KV_CACHE = ("batch", "kv_heads", None, None)  # (B, K, S, D)


class ShardingError(ValueError):
    """A mesh that cannot lay out this model or batch; the message names the array, its shape and the axis."""


def mesh_shape(mesh: Mapping[str, int]) -> dict[str, int]:
    """{"dp":.., "fsdp":.., "ep":.., "tp":..} with every axis present (missing axes are 1)."""
    unknown = sorted(set(mesh) - set(AXES))
    if unknown:
        raise ShardingError(f"unknown mesh axes {unknown}; a mesh has axes {list(AXES)}")
    return {a: int(mesh.get(a, 1)) for a in AXES}


def num_devices(mesh: Mapping[str, int]) -> int:
    return _product(AXES, mesh_shape(mesh))


def batch_rows(mesh: Mapping[str, int]) -> int:
    """How many ways a batch's rows split: dp x fsdp x ep."""
    return _product(LOGICAL["batch"], mesh_shape(mesh))


def describe_rows(mesh: Mapping[str, int]) -> str:
    """'dp 2 x fsdp 2 = 4' (with ' x ep N' when ep > 1): the axes a batch's rows split over, and their product."""
    m = mesh_shape(mesh)
    return f"dp {m['dp']} x fsdp {m['fsdp']}" + (f" x ep {m['ep']}" if m["ep"] > 1 else "") + f" = {batch_rows(m)}"


def describe(mesh: Mapping[str, int]) -> str:
    """'fsdp 4 x tp 2' (axes of size 1 left out; '1 device' when all are)."""
    parts = [f"{a} {n}" for a, n in mesh_shape(mesh).items() if n > 1]
    return " x ".join(parts) if parts else "1 device"


def logical_axes(name: str) -> tuple[str, ...]:
    for pattern, axes in PARAMS:
        if re.fullmatch(pattern, name):
            return axes
    raise ShardingError(f"no sharding rule for parameter {name!r}; add a row to workers.models.sharding.PARAMS")


def _mesh_axes(logical: str | None, mesh: Mapping[str, int], *, kv_heads: int) -> tuple[str, ...]:
    """The mesh axes one dimension is split over ((): replicated), after the KV-head exception."""
    axes = tuple(a for a in (LOGICAL.get(logical) or ()) if mesh[a] > 1) if logical else ()
    if logical == "kv_heads" and axes and kv_heads % _product(axes, mesh):
        return ()  # tp exceeds (or does not divide) the KV heads: keep them whole on every device
    return axes


def _product(axes: Sequence[str], mesh: Mapping[str, int]) -> int:
    out = 1
    for a in axes:
        out *= mesh[a]
    return out


def spec(logical: Sequence[str | None], shape: Sequence[int], mesh: Mapping[str, int], *, kv_heads: int,
         what: str = "array") -> tuple[Any, ...]:
    """PartitionSpec entries for an array whose dimensions have these logical names.

    Raises ShardingError naming `what`, its shape and the axis when an axis does not divide a dimension."""
    mesh = mesh_shape(mesh)
    if len(logical) != len(shape):
        raise ShardingError(f"{what}: {len(shape)} dimensions {tuple(shape)} but {len(logical)} logical axes {logical}")
    out: list[Any] = []
    for dim, (name, size) in enumerate(zip(logical, shape, strict=True)):
        axes = _mesh_axes(name, mesh, kv_heads=kv_heads)
        n = _product(axes, mesh)
        if size % n:
            split = " x ".join(f"{a} {mesh[a]}" for a in axes)
            raise ShardingError(f"{what} {tuple(shape)}: dimension {dim} ({name}, {size}) does not split over "
                                f"{split} = {n}")
        out.append(_entry(axes))
    return tuple(out)


def param_specs(shapes: Mapping[str, Sequence[int]], mesh: Mapping[str, int], *, kv_heads: int) -> dict[str, tuple]:
    """{flat name: PartitionSpec entries} for every parameter; the first misfit raises ShardingError."""
    return {name: spec(logical_axes(name), shape, mesh, kv_heads=kv_heads, what=name)
            for name, shape in shapes.items()}


def check(shapes: Mapping[str, Sequence[int]], mesh: Mapping[str, int], *, kv_heads: int,
          batch_sizes: Mapping[str, int] = {}) -> None:
    """Every parameter and every named batch size splits over `mesh`, or ShardingError says which does not."""
    param_specs(shapes, mesh, kv_heads=kv_heads)
    rows = batch_rows(mesh)
    for key, size in batch_sizes.items():
        if size % rows:
            raise ShardingError(f"{key} = {size} does not split over {describe_rows(mesh)}")


def shard_bytes(shape: Sequence[int], entries: Sequence[Any], mesh: Mapping[str, int], itemsize: int) -> int:
    """Bytes one device holds of an array of `shape` laid out by PartitionSpec `entries`."""
    m = mesh_shape(mesh)
    count = 1
    for size, entry in zip(shape, entries, strict=True):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        count *= size // _product(axes, m)
    return count * itemsize


# ---- JAX side: only processes that hold arrays call these -------------------------------------------

def mesh(shape: Mapping[str, int], devices: Sequence[Any]):
    """A `jax.sharding.Mesh` over exactly `devices` (in order, tp fastest)."""
    import numpy as np
    from jax.sharding import Mesh

    m = mesh_shape(shape)
    need = num_devices(m)
    if len(devices) != need:
        raise ShardingError(f"mesh {describe(m)} needs {need} devices, got {len(devices)}")
    return Mesh(np.asarray(devices, dtype=object).reshape(*(m[a] for a in AXES)), AXES)


def named(mesh_, entries: Sequence[Any]):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh_, PartitionSpec(*entries))


def batch_sharding(mesh_, ndim: int, *, leading: int = 0):
    """Rows over dp x fsdp x ep, everything else replicated; `leading` unsplit dims first (e.g. accumulation)."""
    entry = _entry(_mesh_axes("batch", dict(mesh_.shape), kv_heads=0))
    return named(mesh_, (None,) * leading + (entry,) + (None,) * (ndim - leading - 1))


def residual_sharding(mesh_):
    """The residual stream (B, T, H) of an actor's forward, rows over dp x fsdp x ep, held in and out of every layer
    (workers.models.decoder's `rows`), where the mesh splits rows; None where it does not (nothing to hold)."""
    return batch_sharding(mesh_, 3) if batch_rows(dict(mesh_.shape)) > 1 else None


def replicated(mesh_):
    return named(mesh_, ())


def state_shardings(state, mesh_, *, kv_heads: int):
    """An nnx.State of NamedShardings mirroring `state` (parameters laid out by the table)."""
    from flax import nnx

    from workers.models.params import name_of

    shape = dict(mesh_.shape)
    out = []
    for path, var in nnx.to_flat_state(state):
        name, value = name_of(path), var.get_value()
        out.append((path, var.replace(named(mesh_, spec(logical_axes(name), value.shape, shape, kv_heads=kv_heads,
                                                         what=name)))))
    return nnx.from_flat_state(out)


def adapter_shardings(kernel_shardings: Mapping[str, Any], adapter: Mapping[str, Any]) -> dict[str, Any]:
    """A LoRA adapter's layout (workers.models.lora), following the projections it adapts: `<module>.lora_a`
    (in, r) splits its rows as the kernel (in, out) does, `<module>.lora_b` (r, out) its columns; the rank is
    never split. `kernel_shardings`: {flat name: NamedSharding} of the base (state_shardings, flattened). The head
    ("lm_head") of a model that ties its embeddings has no kernel: it follows the embedding (V, H), transposed."""
    out = {}
    for name in adapter:
        module, part = name.rsplit(".", 1)
        if module == "lm_head" and "lm_head.kernel" not in kernel_shardings:
            kernel = kernel_shardings["model.embed_tokens.weight"]
            spec = tuple(kernel.spec) + (None,) * (2 - len(kernel.spec))
            spec = (spec[1], spec[0])  # (vocab, embed) -> the head's (embed, vocab)
        else:
            kernel = kernel_shardings[f"{module}.kernel"]
            spec = tuple(kernel.spec) + (None,) * (2 - len(kernel.spec))
        out[name] = named(kernel.mesh, (spec[0], None) if part == "lora_a" else (None, spec[1]))
    return out


def kv_cache_sharding(mesh_, *, kv_heads: int):
    """(B, K, S, D): rows over dp x fsdp x ep, heads over tp (whole when tp does not divide them)."""
    shape = dict(mesh_.shape)
    return named(mesh_, tuple(_entry(_mesh_axes(name, shape, kv_heads=kv_heads)) for name in KV_CACHE))


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


_COPIES: dict = kept({})


def place(x, sharding, *, copy: bool):
    """`x` laid out as `sharding` (any devices of this process, any layout: device to device when `x` is on
    devices already). copy=True guarantees buffers `x` does not share: `jax.device_put(..., may_alias=False)`
    can hand back the source's own buffer on a device both layouts use (JAX 0.10), and freeing that would
    free the caller's array; a jitted copy never aliases its input, but needs both on the same devices."""
    import jax
    import jax.numpy as jnp

    if not copy or not isinstance(x, jax.Array):
        return jax.device_put(x, sharding, may_alias=not copy)
    from workers.offload import on_device

    if not on_device(x) and not x.is_deleted():  # in host memory (an offloaded actor's published weights): a
        return jax.device_put(x, sharding)  # transfer into new device buffers, which cannot alias the host ones
    if sharding not in _COPIES:
        _COPIES[sharding] = jax.jit(jnp.copy, out_shardings=sharding)
    if x.sharding.device_set == sharding.device_set:
        return _COPIES[sharding](x)
    y = jax.device_put(x, sharding, may_alias=False)  # onto other devices: a transfer, shard by shard
    theirs = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
    if any(s.data.unsafe_buffer_pointer() in theirs for s in y.addressable_shards):
        y = _COPIES[sharding](y)  # a shard came back shared: copy it out (y is on `sharding`'s devices now)
    return y


_COPY_ALL: dict = kept({})


def place_all(xs, shardings) -> list:
    """`place(x, sharding, copy=True)` of each pair, the leaves already on their target's devices in one program:
    one dispatch for a whole model (a few hundred leaves) instead of one per leaf, and the copies all exist at
    once (the caller has room for them). The others (host arrays, other devices) go leaf by leaf."""
    import jax
    import jax.numpy as jnp

    from workers.offload import on_device

    xs, shardings = list(xs), list(shardings)
    together = [i for i, (x, sh) in enumerate(zip(xs, shardings, strict=True))
                if isinstance(x, jax.Array) and on_device(x) and x.sharding.device_set == sh.device_set]
    out = [None] * len(xs)
    try:
        if together:
            key = tuple(shardings[i] for i in together)
            if key not in _COPY_ALL:
                _COPY_ALL[key] = jax.jit(lambda leaves: [jnp.copy(x) for x in leaves], out_shardings=list(key))
            for i, y in zip(together, _COPY_ALL[key]([xs[i] for i in together]), strict=True):
                out[i] = y
        for i, (x, sh) in enumerate(zip(xs, shardings, strict=True)):
            if out[i] is None:
                out[i] = place(x, sh, copy=True)
    except BaseException:  # a leaf that cannot be placed: free the copies made, or they live as long as the error
        for y in out:
            if y is not None and not y.is_deleted():
                y.delete()
        raise
    return out
