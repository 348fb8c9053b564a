"""Flat parameter dicts: the one weight format that crosses worker boundaries.

A model's parameters travel between workers (actor -> rollout engine) as a flat mapping from the
nnx state path of `Qwen3ForCausalLM`, dot-joined, to an array: Hugging Face names, except that
projection matrices are `<name>.kernel` of shape (in, out) where HF has `<name>.weight` (out, in).
`to_hf` / `from_hf` convert at the checkpoint boundary; nothing else renames.
"""

from __future__ import annotations

import hashlib
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


def to_hf(flat: Mapping[str, object]) -> dict[str, object]:
    """rlsched flat params -> Hugging Face safetensors dict (kernels transposed to torch's (out, in))."""
    return {(k[: -len(".kernel")] + ".weight" if k.endswith(".kernel") else k): (v.T if k.endswith(".kernel") else v)
            for k, v in flat.items()}


def from_hf(tensors: Mapping[str, object], expected: set[str]) -> dict[str, object]:
    """Hugging Face tensors -> rlsched flat params for a model whose param names are `expected`."""
    out = {}
    for k, v in tensors.items():
        kernel = k[: -len(".weight")] + ".kernel" if k.endswith(".weight") else None
        out[kernel if kernel in expected else k] = v.T if kernel in expected else v
    return out


def checksum(flat: Mapping[str, object]) -> str:
    """Content hash of a flat parameter dict (names, dtypes, shapes and bytes), order independent.

    Used to prove that an engine holds exactly the weights its actor published.
    """
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(flat):
        arr = np.asarray(jax.device_get(flat[name]))
        h.update(f"{name}|{arr.dtype.name}|{arr.shape}|".encode())
        h.update(np.ascontiguousarray(arr).view(np.uint8).tobytes())
    return h.hexdigest()


def num_bytes(flat: Mapping[str, object]) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in flat.values())
