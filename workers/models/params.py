"""Flat parameter dicts: the one weight format that crosses worker boundaries.

A model's parameters travel between workers (actor -> rollout engine) as a flat mapping from the
nnx state path of `CausalLM`, dot-joined, to an array: Hugging Face names, except that
projection matrices are `<name>.kernel` of shape (in, out) where HF has `<name>.weight` (out, in).
`to_hf` / `from_hf` convert at the checkpoint boundary; nothing else renames. Experts of a MoE layer are
one stacked array per projection, `<layer>.mlp.experts.<proj>.kernel` (E, in, out), where checkpoints hold
`<layer>.mlp.experts.<e>.<proj>.weight` (out, in) per expert.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx

FlatParams = dict[str, jax.Array | np.ndarray]


class WeightMismatchError(ValueError):
    """Incoming weights do not match the model they are loaded into (names, shapes or dtypes)."""


def name_of(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def to_flat(state: nnx.State) -> FlatParams:
    """nnx state -> {hf_name: array}, in a stable (sorted) order."""
    return {name_of(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def host_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """A model's parameters as host numpy arrays by flat name: what `update_weights` takes."""
    return {k: np.asarray(v) for k, v in to_flat(nnx.state(model, nnx.Param)).items()}


def from_flat(template: nnx.State, flat: Mapping[str, object], *, source: str = "weights") -> nnx.State:
    """A new state shaped like `template` holding the arrays of `flat`.

    Every name, shape and dtype must match `template` exactly: a silent cast or a missing tensor
    here would mean generating with weights other than the ones the actor trained.
    """
    items = list(nnx.to_flat_state(template))
    expected = {name_of(path) for path, _ in items}
    missing, unexpected = sorted(expected - flat.keys()), sorted(flat.keys() - expected)
    if missing or unexpected:
        raise WeightMismatchError(
            f"{source}: tensor names differ from the model's: missing {missing[:5]}"
            f"{'…' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{'…' if len(unexpected) > 5 else ''}")
    out = []
    for path, var in items:
        name, new = name_of(path), flat[name_of(path)]
        old = var.get_value()
        if tuple(new.shape) != tuple(old.shape) or np.dtype(new.dtype) != np.dtype(old.dtype):
            raise WeightMismatchError(
                f"{source}: {name} is {np.dtype(new.dtype).name}{tuple(new.shape)}, "
                f"the model expects {np.dtype(old.dtype).name}{tuple(old.shape)}")
        out.append((path, var.replace(new)))
    return nnx.from_flat_state(out)


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")  # one expert's matrix in a checkpoint


def to_hf(flat: Mapping[str, object]) -> dict[str, object]:
    """rlsched flat params -> Hugging Face safetensors dict (kernels transposed to torch's (out, in), stacked
    experts split into one tensor per expert)."""
    out: dict[str, object] = {}
    for k, v in flat.items():
        if not k.endswith(".kernel"):
            out[k] = v
        elif ".experts." in k and len(v.shape) == 3:
            prefix, proj = k[: -len(".kernel")].rsplit(".", 1)
            out |= {f"{prefix}.{e}.{proj}.weight": v[e].T for e in range(v.shape[0])}
        else:
            out[k[: -len(".kernel")] + ".weight"] = v.T
    return out


def from_hf(tensors: Mapping[str, object], expected: set[str]) -> dict[str, object]:
    """Hugging Face tensors -> rlsched flat params for a model whose param names are `expected`."""
    out, experts = {}, {}
    for k, v in tensors.items():
        match = _EXPERT.fullmatch(k)
        stacked = f"{match[1]}.{match[3]}.kernel" if match else None
        if stacked in expected:
            experts.setdefault(stacked, {})[int(match[2])] = v.T
            continue
        kernel = k[: -len(".weight")] + ".kernel" if k.endswith(".weight") else None
        out[kernel if kernel in expected else k] = v.T if kernel in expected else v
    for name, parts in experts.items():
        missing = sorted(set(range(max(parts) + 1)) - parts.keys())
        if missing:
            raise WeightMismatchError(f"{name}: the checkpoint lacks experts {missing[:8]}")
        arrays = [parts[e] for e in range(len(parts))]
        out[name] = (jax.numpy.stack if isinstance(arrays[0], jax.Array) else np.stack)(arrays)
    return out


def checksum(flat: Mapping[str, object]) -> str:
    """Hash of a flat parameter dict's *logical* values (names, dtypes, shapes, every element in its place),
    whatever the layout: the same for host numpy, one device, or any sharding of the same values.

    Used to prove that an engine holds exactly the weights its actor published. Device arrays are hashed
    where they lie (`_digest_device`: each device reduces its own shard, then four bytes per tensor
    cross): nothing is gathered to one device or copied to the host; arrays in host memory are hashed there.
    Per tensor, the element bits are
    reduced one dimension at a time, innermost first, each weighted by an odd number that depends on the
    dimension and the position, mod 2**32: changing any one element always changes the result (odd
    weights are invertible), and a transposed or reordered tensor hashes differently (each dimension has
    its own weights). It detects corruption and mix-ups, not an adversary. One pass over the bytes.
    """
    from workers.offload import on_device as in_device_memory

    # Arrays in host memory (an offloaded actor's published weights) are hashed on the host: device programs
    # cannot take them as they lie.
    on_device = {k: v for k, v in flat.items() if isinstance(v, jax.Array) and in_device_memory(v)}
    # One uint32 per tensor comes back, all in one transfer: a model's few hundred tensors are one read, not hundreds
    sums = dict(zip(sorted(on_device), map(int, jax.device_get(_digest_device(on_device))), strict=True)) \
        if on_device else {}
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(flat):
        arr = flat[name]
        digest = sums[name] if name in sums else _digest_host(np.asarray(arr))
        h.update(f"{name}|{np.dtype(arr.dtype).name}|{tuple(arr.shape)}|{digest:08x}|".encode())
    return h.hexdigest()


_UINT = {1: "uint8", 2: "uint16", 4: "uint32"}
_DIM_MULT = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646C, 0xFD7046C5, 0xB55A4F09)


def _check_itemsize(dtype) -> int:
    size = np.dtype(dtype).itemsize
    if size not in _UINT:
        raise ValueError(f"no checksum for {np.dtype(dtype).name} parameters (1-, 2- or 4-byte elements only)")
    return size


def _weights(n: int, dim: int, xp):
    """The odd weight of each position along dimension `dim` (its own multiplier and offset: no symmetry
    between dimensions, so a transpose changes the hash)."""
    k = xp.arange(n, dtype=xp.uint32)
    return (k * xp.uint32(_DIM_MULT[dim % len(_DIM_MULT)]) + xp.uint32(dim + 1)) * xp.uint32(2) + xp.uint32(1)


def _digest_host(a: np.ndarray) -> int:
    """One array in host memory; equal to `_digest_device` of the same values."""
    h = np.asarray(a, order="C").view(_UINT[_check_itemsize(a.dtype)]).astype(np.uint32)  # keeps 0-d arrays 0-d
    for d in reversed(range(a.ndim)):
        h = np.sum(h * _weights(a.shape[d], d, np), axis=-1, dtype=np.uint32)
    return int(h)


@jax.jit
def _digest_device(flat: dict) -> jax.Array:
    """(len(flat),) uint32, one per device array in sorted name order, computed where they lie: uint32 sums wrap
    identically in any order, so every sharding gives the same."""
    import jax.numpy as jnp
    from jax import lax

    def one(x):
        size = _check_itemsize(x.dtype)
        h = (x.astype(jnp.uint32) if x.dtype == jnp.bool_
             else lax.bitcast_convert_type(x, jnp.dtype(_UINT[size])).astype(jnp.uint32))
        for d in reversed(range(x.ndim)):
            h = jnp.sum(h * _weights(x.shape[d], d, jnp), axis=-1, dtype=jnp.uint32)
        return h

    return jnp.stack([one(flat[k]) for k in sorted(flat)])


def num_bytes(flat: Mapping[str, object]) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in flat.values())
