"""Offload (device -> host) and onload (host -> device) of a pytree of arrays, and what is on the device.

Design decisions (and why):
- **Real memory kinds where the backend has them.** If the arrays' devices offer a `pinned_host`
  memory (GPU, TPU, and JAX's CPU backend too), an offloaded array stays a `jax.Array` with the same
  sharding in pinned host memory: onload is one DMA per buffer, no Python-side copy, and shardings
  survive multi-device meshes. Otherwise it becomes host numpy (`jax.device_get`).
- **The device buffers are deleted at offload**, so the bytes are really freed (the field's "offload
  freed far less than expected"); nothing keeps a reference to them.
- **Across processes too.** A role across hosts (rlsched.cluster.rolegroup) offloads in every process at once, each its
  own shards: a memory-kind move is per shard already; the numpy fallback keeps each process's shards
  (`_Shards`) where `device_get` would need the whole array in one process.
- **Room is the allocator's word** (`room_for`): bytes_limit - bytes_in_use from `device.memory_stats()`, with a
  reserve for the process's other roles. The CPU backend keeps no statistics; its device memory is host memory,
  so a second copy "on the device" takes what a host copy would: there is room.
- **"On the device" means the device memory kind.** Pinned-host arrays are live JAX arrays too, so
  counting bytes counts only arrays whose memory kind is the device's default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass
class _Shards:
    """This process's shards of an array that spans processes, in host numpy (the numpy fallback)."""

    shape: tuple[int, ...]
    data: list[tuple[Any, np.ndarray]]  # (device, its shard)


@dataclasses.dataclass
class Offloaded:
    tree: Any  # host copies: pinned_host jax.Arrays, or numpy arrays
    shardings: Any  # the device shardings to come back to
    memory_kind: str  # "pinned_host" or "numpy"


def _host_kind(leaves: list[jax.Array]) -> str | None:
    if not leaves:
        return None
    device = next(iter(leaves[0].sharding.device_set))
    kinds = {m.kind for m in device.addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else None


def offload(tree: Any) -> Offloaded:
    """Copy `tree` to host memory and delete its device buffers."""
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    shardings = jax.tree.map(lambda x: x.sharding, tree)
    kind = _host_kind(leaves)
    if kind is not None:
        host = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), tree)
        jax.block_until_ready(host)
    elif all(x.is_fully_addressable for x in leaves):
        host, kind = jax.device_get(tree), "numpy"
    else:  # a role across hosts: every process keeps its own shards
        host, kind = jax.tree.map(_own_shards, tree), "numpy"
    for x in leaves:
        x.delete()
    return Offloaded(host, shardings, kind)


def onload(off: Offloaded) -> Any:
    """Bring an offloaded tree back to its devices (and free the host copies of pinned arrays)."""
    if any(isinstance(x, _Shards) for x in jax.tree.leaves(off.tree)):
        tree = jax.tree.map(_from_shards, off.tree, off.shardings)
    else:
        tree = jax.device_put(off.tree, off.shardings)
    jax.block_until_ready(tree)
    if off.memory_kind != "numpy":
        for x in jax.tree.leaves(off.tree):
            x.delete()
    return tree


def _own_shards(x: Any) -> Any:
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return jax.device_get(x)
    return _Shards(x.shape, [(s.device, np.asarray(s.data)) for s in x.addressable_shards])


def _from_shards(host: Any, sharding: Any) -> Any:
    if not isinstance(host, _Shards):
        return jax.device_put(host, sharding)
    return jax.make_array_from_single_device_arrays(
        host.shape, sharding, [jax.device_put(data, device) for device, data in host.data])


def on_device(x: jax.Array) -> bool:
    """Whether `x` occupies device memory (not a deleted array, not a host-memory array)."""
    if x.is_deleted():
        return False
    kind = x.sharding.memory_kind
    return kind is None or kind == next(iter(x.sharding.device_set)).default_memory().kind


def device_bytes() -> int:
    """Bytes of this process's live JAX arrays in device memory, over all its devices."""
    return sum(bytes_by_device().values())


def bytes_by_device(arrays=None) -> dict[Any, int]:
    """{device: bytes} of `arrays` (default: this process's live arrays) in device memory, shard by shard.

    Each buffer counts once: a sharded array's per-device pieces (`addressable_shards`) are live arrays
    too, over the same buffers."""
    out: dict[Any, int] = {}
    seen: set[tuple[Any, int]] = set()
    for x in jax.live_arrays() if arrays is None else arrays:
        if isinstance(x, jax.Array) and on_device(x):
            for device, pointer, nbytes in device_shards(x):
                if (device, pointer) not in seen:
                    seen.add((device, pointer))
                    out[device] = out.get(device, 0) + nbytes
    return out


def device_shards(x: jax.Array) -> list[tuple[Any, int, int]]:
    """(device, buffer pointer, bytes) of each of `x`'s shards in this process; [] when `x` was deleted. Another
    thread may delete an array at any moment (a donated train state in a device group's process, where roles of
    several tasks run at once): one deleted between `jax.live_arrays()` and the read of its shards holds nothing.
    So does one being donated: while another thread's program takes its buffers, reading them raises "Buffer has
    been deleted or donated" before `is_deleted()` says so (an engine's memory probe at the end of its rollout
    failed the rollout that way, beside another task's train step). One deleted between JAX's own deletion check
    and its walk of the buffers raises TypeError ("'NoneType' object is not iterable": the buffer list is gone),
    seen as a resumed task's failed rollout while another task's roles left the process."""
    try:
        return [(s.device, s.data.unsafe_buffer_pointer(), s.data.nbytes) for s in x.addressable_shards]
    except RuntimeError as err:
        if x.is_deleted() or DONATED in str(err):  # deleted meanwhile ("Array has been deleted"), or being donated
            return []
        raise
    except TypeError:
        if x.is_deleted():
            return []
        raise


DONATED = "has been deleted or donated"  # XLA's INVALID_ARGUMENT for a buffer a program has taken (or freed)


def shard_bytes(x: jax.Array) -> int:
    """The bytes of one of `x`'s shards, from its shape and sharding alone (no buffer is read)."""
    return int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * np.dtype(x.dtype).itemsize


def layout_bytes(arrays) -> dict[Any, int]:
    """{device: bytes} that `arrays` take on this process's devices, from their shapes and shardings: what
    `bytes_by_device` counts for arrays of their own (not sharing buffers), without touching a shard (a
    model's few hundred leaves in well under a millisecond)."""
    out: dict[Any, int] = {}
    for x in arrays:
        nbytes = shard_bytes(x)
        for device in x.sharding.addressable_devices:
            out[device] = out.get(device, 0) + nbytes
    return out


ROOM_RESERVE = 0.10  # of each device's limit, left free by `room_for` for what the process's other roles allocate


def room_for(nbytes: Mapping[Any, int], reserve: float = ROOM_RESERVE) -> bool:
    """Whether each device can take `nbytes[device]` more bytes now and still keep `reserve` of its limit free
    (the allocator's bytes_limit - bytes_in_use, `device.memory_stats()`). The reserve is for what other roles of
    a device group's process may allocate meanwhile (another task's train step between two micro-batches): an
    allocation taken now is not visible to them until it fails.
    A device without allocator statistics: on the CPU backend its memory is the process's host memory, so room
    for a second copy on the "device" is room for it on the host: yes. Any other backend without them: no (the
    caller takes its path that needs no room)."""
    for device, extra in nbytes.items():
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            if device.platform == "cpu":
                continue
            return False
        limit = int(stats["bytes_limit"])
        if limit - int(stats["bytes_in_use"]) - int(extra) < reserve * limit:
            return False
    return True


def reserved_bytes(off: Offloaded) -> int:
    """The most bytes an offloaded tree takes on any one device once it is back (from its shardings)."""
    out: dict[Any, int] = {}
    for x, sharding in zip(jax.tree.leaves(off.tree), jax.tree.leaves(off.shardings), strict=True):
        shard = int(np.prod(sharding.shard_shape(x.shape), dtype=np.int64)) * np.dtype(x.dtype).itemsize
        for device in sharding.device_set:
            out[device] = out.get(device, 0) + shard
    return max(out.values(), default=0)


def per_device_bytes(tree: Any) -> int:
    """The most bytes `tree` holds on any one device (on one device: all of it). Memory budgets are per
    device, and a role on a mesh holds its share on each."""
    return max(bytes_by_device(jax.tree.leaves(tree)).values(), default=0)
