"""Checkpoints off the step's path (rlsched.run.checkpoints): `save` returns once the state is on host, the files
are written in the background, and neither an offload right after nor a kill mid-write can leave a checkpoint
that resume would pick and fail on. Real files, real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

from rlsched.run.checkpoints import TaskCheckpointer
from workers.train_step import TrainState


def _state(n: int, value: float) -> TrainState:
    params = {"w": jnp.full((n,), value, jnp.float32), "b": jnp.arange(7, dtype=jnp.float32) * value}
    return TrainState(step=jnp.asarray(3, jnp.int32), params=params, opt_state={"mu": params["w"] * 2})


def test_a_save_is_written_in_the_background_and_survives_an_offload_right_after(tmp_path):
    ckpt = TaskCheckpointer(tmp_path / "ckpt", max_to_keep=2)
    state = _state(1_000_000, 1.5)
    expected = jax.tree.map(np.asarray, state)
    ckpt.save(1, state, {"step": 1, "version": 1})
    for leaf in jax.tree.leaves(state):  # what an eviction does to the actor's device arrays at once
        leaf.delete()
    ckpt.save(2, _state(1_000_000, 2.5), {"step": 2, "version": 2})  # waits for 1, never two in flight
    like = _state(1_000_000, 0.0)
    restored, meta = ckpt.restore(like, step=1)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert meta == {"step": 1, "version": 1} and ckpt.latest_step() == 2
    ckpt.save(3, _state(1_000_000, 3.5), {"step": 3, "version": 3})
    ckpt.close()  # finishes the write in flight
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["2", "3"]  # keep_last 2


def test_a_kill_while_a_save_is_written_leaves_the_previous_checkpoint_the_latest(tmp_path):
    """A process saves step 1 completely, starts the background write of a large step 2 and is SIGKILLed as
    soon as `save` returns: resume sees step 1, complete and readable, and no trace of a half step 2 is
    taken for a checkpoint."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.getcwd()!r})
        from tests.test_checkpoints import _state
        from rlsched.run.checkpoints import TaskCheckpointer
        ckpt = TaskCheckpointer({str(tmp_path / "ckpt")!r})
        ckpt.save(1, _state(1000, 1.0), {{"step": 1}})
        ckpt.wait()
        ckpt.save(2, _state(100_000_000, 2.0), {{"step": 2}})   # 800 MB: seconds to write
        print("saving", flush=True)
        os.kill(os.getpid(), {int(signal.SIGKILL)})
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL and "saving" in done.stdout, done.stderr[-2000:]
    ckpt = TaskCheckpointer(tmp_path / "ckpt")
    assert ckpt.latest_step() == 1
    restored, meta = ckpt.restore(_state(1000, 0.0))
    assert meta == {"step": 1} and float(restored.params["w"][0]) == 1.0
    ckpt.save(2, _state(1000, 2.0), {"step": 2})  # the resumed run saves step 2 again, over the half one
    assert ckpt.latest_step() == 2 and ckpt.restore(_state(1000, 0.0))[1] == {"step": 2}
    ckpt.close()


def test_a_checkpoint_is_checked_against_the_state_it_restores_into(tmp_path):
    """The files say what they hold (key paths, dtypes, shapes, offsets): another state, or a cut file, is
    refused with what differs, never loaded into the wrong arrays."""
    import pytest

    from rlsched.base.errors import CheckpointError

    ckpt = TaskCheckpointer(tmp_path / "ckpt")
    ckpt.save(1, _state(1000, 1.0), {"step": 1})
    ckpt.wait()
    assert sorted(p.name for p in (tmp_path / "ckpt" / "1").iterdir()) == ["index.json", "state.bin"]
    with pytest.raises(CheckpointError, match=r"\.params\['w'\] is float32\[1000\], this state's is float32\[999\]"):
        ckpt.restore(_state(999, 0.0))
    other = TrainState(step=jnp.asarray(3, jnp.int32), params={"w": jnp.zeros(1000)}, opt_state={})
    with pytest.raises(CheckpointError, match="holds other arrays than this state"):
        ckpt.restore(other)
    blob = tmp_path / "ckpt" / "1" / "state.bin"
    blob.write_bytes(blob.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="is truncated at"):
        ckpt.restore(_state(1000, 0.0))
    ckpt.close()
