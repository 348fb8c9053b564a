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
