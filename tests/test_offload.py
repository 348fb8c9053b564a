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
