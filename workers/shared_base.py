"""One frozen base model per process, shared read-only by every LoRA actor and engine of its base group.

    lease = shared_base.acquire(path, dtype="float32", mesh=mesh)   # loads on the first acquire of this key
    ActorWorker(None, settings, mesh=mesh, lora=spec, base=lease)    # the same device arrays in every holder
    lease.release()                                                  # the last release of a key frees the base

A base group is the LoRA tasks whose model.path (resolved), model.dtype and mesh (the same devices, the same axis
sizes) agree: their actors and engines lay the base out alike (workers.models.sharding.state_shardings of one mesh),
so one copy serves them all.

Design decisions:
- **Read-only by contract, not by copy.** JAX arrays are immutable; what could break a shared base is a holder
  that donates, deletes or offloads its buffers. A holder of a lease never does: a LoRA actor's programs take the
  base as a non-donated argument, its offload moves its adapter only, and a shared engine never swaps or offloads
  its weights. `Lease.params` is the one tree every holder reads.
- **Refcounted per key, freed by the last release.** `release` is idempotent, and a lease that is garbage
  collected without one (a role a fence dropped without closing it) releases itself, so a base never outlives its
  last holder and never leaks into the next task's memory.
- **Thread-safe.** A device group's process runs its roles' calls on threads (rlsched.cluster.group_process): two
  tasks starting at once load the base once, the second waiting for the first's load.
- Pure JAX/Flax: no Ray, no control plane.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from workers.models import sharding as S
from workers.offload import per_device_bytes


def base_key(path: str | Path, dtype: str | None, mesh) -> tuple:
    """What makes two LoRA tasks' bases one: the resolved directory, the dtype, the mesh's devices and axis sizes."""
    return (str(Path(path).resolve()), dtype, tuple(int(d.id) for d in mesh.devices.flat),
            tuple((str(k), int(v)) for k, v in mesh.shape.items()))


@dataclass
class Base:
    """A loaded base: its graph, its params on the mesh (an nnx.State, never donated or deleted by a holder) and
    their shardings."""

    key: tuple
    config: Any  # workers.models.config.ModelConfig
    graphdef: Any
    params: Any
    shardings: Any
    mesh: Any
    holders: int = 0

    def nbytes(self) -> int:
        """Bytes per device (a mesh holds a share of the base on each of its devices)."""
        return per_device_bytes(self.params)


_LOCK = threading.Lock()
_BASES: dict[tuple, Base] = {}
_LOADING: dict[tuple, threading.Event] = {}  # a key being loaded: other acquirers wait for it


class Lease:
    """One holder's claim on a shared base; `release()` (or garbage collection) gives it back."""

    def __init__(self, base: Base):
        self._base: Base | None = base
        self.key = base.key
        self._finalizer = weakref.finalize(self, _release, base.key)

    @property
    def base(self) -> Base:
        if self._base is None:
            raise RuntimeError(f"the lease on base {self.key[0]} was released")
        return self._base

    # The base's parts, read through the lease
    config = property(lambda self: self.base.config)
    graphdef = property(lambda self: self.base.graphdef)
    params = property(lambda self: self.base.params)
    shardings = property(lambda self: self.base.shardings)
    mesh = property(lambda self: self.base.mesh)

    def nbytes(self) -> int:
        return self.base.nbytes()

    def release(self) -> None:
        """Give the base back (idempotent); the last holder's release frees its device buffers."""
        self._base = None
        self._finalizer()  # runs _release once, whichever of release() and garbage collection comes first

    @property
    def released(self) -> bool:
        return self._base is None


def acquire(path: str | Path, *, dtype: str | None, mesh) -> Lease:
    """A lease on the base at `path` in `dtype` laid out on `mesh`, loaded now if no holder in this process has it."""
    key = base_key(path, dtype, mesh)
    while True:
        with _LOCK:
            base = _BASES.get(key)
            if base is not None:
                base.holders += 1
                return Lease(base)
            loading = _LOADING.get(key)
            if loading is None:
                _LOADING[key] = threading.Event()
                break
        loading.wait()  # another thread loads it: take a lease on its result (or load it ourselves if it failed)
    try:
        base = _load(key, path, dtype, mesh)
        with _LOCK:
            _BASES[key] = base
            base.holders = 1
        return Lease(base)
    finally:
        with _LOCK:
            _LOADING.pop(key).set()


def _load(key: tuple, path, dtype, mesh) -> Base:
    from workers.models import load_pretrained

    model, _ = load_pretrained(path, dtype=dtype, with_tokenizer=False)
    graphdef, params = nnx.split(model)
    shardings = S.state_shardings(params, mesh, kv_heads=model.config.num_key_value_heads)
    params = jax.device_put(params, shardings)  # freshly loaded host arrays: the registry owns these buffers
    return Base(key, model.config, graphdef, params, shardings, mesh)


def _release(key: tuple) -> None:
    with _LOCK:
        base = _BASES.get(key)
        if base is None:
            return
        base.holders -= 1
        if base.holders > 0:
            return
        del _BASES[key]
    # The last holder: free the device buffers now rather than at the next collection (no holder reads them)
    for leaf in jax.tree.leaves(base.params):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def held() -> dict[tuple, int]:
    """{key: holders} of the bases loaded in this process (for tools and tests)."""
    with _LOCK:
        return {key: base.holders for key, base in _BASES.items()}
