"""Offload/onload of arrays: the device bytes are really freed, values come back bit for bit."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workers import offload as O


@pytest.mark.parametrize("pinned", [True, False])
def test_offload_frees_device_bytes_and_onload_restores_exactly(monkeypatch, pinned):
    if not pinned:  # a backend without a pinned_host memory kind: host numpy
        monkeypatch.setattr(O, "_host_kind", lambda leaves: None)
    # Placed from numpy: jnp constructors may share cached constant buffers, which would blur the count.
    host = {"w": np.arange(1 << 18, dtype=np.float32).reshape(512, 512), "b": np.ones(512, jnp.bfloat16),
            "step": np.zeros((), np.int32)}
    tree = {k: jax.device_put(v) for k, v in host.items()}
    expected = {k: np.asarray(v) for k, v in tree.items()}
    shardings = {k: v.sharding for k, v in tree.items()}
    size = sum(x.nbytes for x in tree.values())
    assert size == 512 * 512 * 4 + 512 * 2 + 4  # float32 matrix + bfloat16 vector + int32 scalar
    gc.collect()
    before = O.device_bytes()
    off = O.offload(tree)
    offloaded = O.device_bytes()
    assert off.memory_kind == ("pinned_host" if pinned else "numpy")
    assert before - offloaded >= size  # the device copy is gone, not just unreferenced
    assert all(x.is_deleted() for x in tree.values())
    back = O.onload(off)
    assert O.device_bytes() - offloaded == size  # exactly the tree comes back, nothing doubled
    for k, value in expected.items():
        assert back[k].dtype == value.dtype and np.array_equal(np.asarray(back[k]), value)
        assert back[k].sharding == shardings[k] and O.on_device(back[k])


def test_an_array_deleted_by_another_thread_while_bytes_are_counted_holds_nothing(monkeypatch):
    """In a device group's process roles of several tasks run at once: a train step donates (deletes) its state
    while another role's memory probe walks `jax.live_arrays()`. An array deleted between being listed and having
    its shards read counts 0 bytes, instead of failing the probing role's phase ("Array has been deleted")."""
    from rlsched.observe import memprobe

    kept, gone = jnp.ones((64, 8), jnp.float32), jnp.ones((3,), jnp.int32)
    gone.delete()
    # the race, made certain: the deleted array passes the liveness check, as it did just before its deletion
    monkeypatch.setattr(O, "on_device", lambda x: True)
    assert O.device_shards(gone) == []
    assert sum(O.bytes_by_device([kept, gone]).values()) == 64 * 8 * 4
    monkeypatch.setattr(jax, "live_arrays", lambda: [kept, gone])
    assert sum(memprobe._live_bytes_by_device(jax).values()) == 64 * 8 * 4


def test_an_array_deleted_inside_jaxs_own_read_of_its_shards_holds_nothing(monkeypatch):
    """The same race one step later: the array is deleted after `addressable_shards` checked it was not, while it
    walks the buffer list (None once deleted): TypeError, not RuntimeError (a resumed task's rollout failed with
    "'NoneType' object is not iterable" in a device group's process as another task's roles left it)."""
    from jax._src import array as jax_array

    gone = jnp.ones((3,), jnp.int32)
    gone.delete()
    # the race, made certain: JAX's check passes, as it did just before the deletion
    monkeypatch.setattr(jax_array.ArrayImpl, "_check_if_deleted", lambda self: None)
    with pytest.raises(TypeError, match="'NoneType' object is not iterable"):
        gone.addressable_shards  # noqa: B018 - what the probe meets
    assert O.device_shards(gone) == []


class _Donating:
    """An array in the window of its donation to another thread's program: its buffers are taken (reading them
    raises XLA's error) while `is_deleted()` does not say so yet."""

    def is_deleted(self) -> bool:
        return False

    @property
    def addressable_shards(self):
        raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: Buffer has been deleted or donated.")


def test_an_array_being_donated_by_another_thread_while_bytes_are_counted_holds_nothing():
    """The donation's window (seen in an engine's memory probe at the end of its rollout, beside another task's
    train step in one device group's process): the array counts 0 bytes, the probing phase goes on; any other error
    reading an array still raises."""
    assert O.device_shards(_Donating()) == []

    class _Broken(_Donating):
        @property
        def addressable_shards(self):
            raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):
        O.device_shards(_Broken())


class _Device:
    """A device as `room_for` reads it: its platform and its allocator's statistics (None: it keeps none)."""

    def __init__(self, platform: str, stats: dict | None):
        self.platform, self._stats = platform, stats

    def memory_stats(self):
        return self._stats


def test_room_for_a_second_version_keeps_a_tenth_of_each_device_free():
    gpu = _Device("gpu", {"bytes_limit": 1000, "bytes_in_use": 500})
    assert O.room_for({gpu: 400})  # 1000 - 500 - 400 = 100 left: a tenth of the limit, just
    assert not O.room_for({gpu: 401})  # 99 left
    assert O.room_for({gpu: 450}, reserve=0.05)  # 50 left: a twentieth
    # Every device must have room: a mesh's one full device refuses it
    assert not O.room_for({gpu: 100, _Device("gpu", {"bytes_limit": 1000, "bytes_in_use": 950}): 100})
    # No statistics: CPU device memory is host memory (a host copy would take the same bytes), elsewhere unknown
    assert O.room_for({_Device("cpu", None): 10**15})
    assert not O.room_for({_Device("gpu", None): 1})
    assert not O.room_for({_Device("tpu", {"bytes_in_use": 0}): 1})  # no limit reported: unknown too
    assert O.room_for({d: 1 for d in jax.devices()[:2]})  # this machine's CPU devices


def test_layout_bytes_count_what_the_live_buffers_hold():
    from workers.models import sharding as S

    mesh = S.mesh({"fsdp": 4, "tp": 2}, jax.devices()[:8])
    split = jax.device_put(np.zeros((8, 6), np.float32), S.named(mesh, ("fsdp", "tp")))  # (2, 3) shards: 24 bytes
    whole = jax.device_put(np.zeros(5, np.int32), S.named(mesh, ()))  # 20 bytes on every device
    expected = {d: 24 + 20 for d in mesh.devices.flat}
    assert O.layout_bytes([split, whole]) == O.bytes_by_device([split, whole]) == expected
    assert O.shard_bytes(split) == 24 and O.shard_bytes(whole) == 20
