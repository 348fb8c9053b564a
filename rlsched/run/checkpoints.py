"""Task checkpoints: the actor's TrainState plus a small JSON of where the run stands.

    <checkpoint_dir>/<step>/state.bin     every leaf's bytes, one after another
                          /index.json    each leaf's key path, dtype, shape and offset, and the run's meta

Design decisions (and why):
- **Off the step's path.** `save` returns once the arrays are copied to host; one background thread writes
  the files while the task goes on, and its devices may be given to another task at once. A task never has
  two saves in flight: the next save, a restore and `close` first wait for the one being written.
- **Cheap per save.** One file of raw bytes and one JSON, written with plain file calls: a save of the demo's
  model costs a few ms of CPU. Orbax cost ~140 ms of CPU per save whatever the size (its per-save and
  per-leaf machinery), which on a small model doubled the step with a checkpoint every step
  (benchmarks/checkpoint.py). Orbax is still what a state that no single process holds whole (a role across
  hosts) is saved with, and what such a checkpoint is restored with.
- **Atomic.** A step is written into a hidden temporary directory renamed into place when complete (a rename
  is atomic), so a crash mid-write leaves the previous checkpoint the latest: resume never picks a half one.
  Temporary directories a killed process left are removed when the next checkpointer opens the directory.
- **Checked on load.** The key paths, dtypes and shapes must be the restoring state's, and the bytes must add
  up, or the restore fails naming the difference.
- **Never non-finite.** The params are checked (one reduction on the devices) before anything is written.
- `keep_last` checkpoints are kept; older ones go once a newer one is complete.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlsched.base.errors import CheckpointError
from workers.multihost import is_primary

log = logging.getLogger(__name__)
_TMP = ".tmp-"  # prefix of a step being written


class TaskCheckpointer:
    def __init__(self, directory: str | Path, *, max_to_keep: int = 2, background: bool = True):
        self.directory = Path(directory).absolute()
        self.background, self.max_to_keep = background, max_to_keep
        self.directory.mkdir(parents=True, exist_ok=True)
        if is_primary():  # one process of a role across hosts tidies (they share the directory)
            for stale in self.directory.glob(f"{_TMP}*"):  # a write a killed process never finished
                shutil.rmtree(stale, ignore_errors=True)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self._pending: concurrent.futures.Future | None = None
        self._orbax = None  # the manager for states no process holds whole (made when first needed)

    def latest_step(self) -> int | None:
        """The latest complete checkpoint (one being written counts once it is)."""
        self.wait()
        steps = self._steps()
        return steps[-1] if steps else None

    def save(self, step: int, train_state: Any, meta: dict[str, Any]) -> None:
        """Save after `step` GRPO steps: returns once the state is copied to host, the write goes on in the
        background (`wait` for it). Refuses params that are not all finite."""
        if not bool(_all_finite(train_state.params)):
            raise CheckpointError(f"refusing to write checkpoint {step}: the params contain NaN or inf")
        self.wait()  # never two in flight
        leaves, _ = jax.tree_util.tree_flatten_with_path(train_state)
        if not all(getattr(x, "is_fully_addressable", True) for _, x in leaves):
            self._orbax_manager().save(step, args=_orbax_args(train_state, meta))
        else:
            arrays = jax.device_get([x for _, x in leaves])  # the copy to host: all leaves' transfers at once
            host = [(jax.tree_util.keystr(path), np.asarray(a)) for (path, _), a in zip(leaves, arrays, strict=True)]
            self._pending = self._writer.submit(self._write, step, host, dict(meta))
        if not self.background:
            self.wait()

    def _write(self, step: int, leaves: list[tuple[str, np.ndarray]], meta: dict[str, Any]) -> None:
        tmp = self.directory / f"{_TMP}{step}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        index, offset = [], 0
        with open(tmp / "state.bin", "wb") as f:
            for key, array in leaves:
                data = np.ascontiguousarray(array).tobytes()
                f.write(data)
                index.append({"key": key, "dtype": str(array.dtype), "shape": list(array.shape), "offset": offset,
                              "nbytes": len(data)})
                offset += len(data)
            f.flush()
            os.fsync(f.fileno())
        (tmp / "index.json").write_text(json.dumps({"leaves": index, "meta": meta}))
        final = self.directory / str(step)
        shutil.rmtree(final, ignore_errors=True)  # a step saved again (a resumed run redoes it) replaces it
        os.rename(tmp, final)
        for old in self._steps()[: -self.max_to_keep]:
            shutil.rmtree(self.directory / str(old), ignore_errors=True)

    def wait(self) -> None:
        """Until the save being written (if any) is complete on disk; raises its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        if self._orbax is not None:
            self._orbax.wait_until_finished()

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """(train_state shaped and laid out like `like`, meta) of `step` (default: the latest)."""
        self.wait()
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory} to resume from")
        where = self.directory / str(step)
        if not (where / "index.json").is_file():  # written by orbax (a state no process held whole)
            restored = self._orbax_manager().restore(step, args=_orbax_restore_args(like))
            return restored.state, restored.meta
        saved = json.loads((where / "index.json").read_text())
        wanted, treedef = jax.tree_util.tree_flatten_with_path(like)
        entries = saved["leaves"]
        keys = [jax.tree_util.keystr(path) for path, _ in wanted]
        if [e["key"] for e in entries] != keys:
            raise CheckpointError(f"checkpoint {where} holds other arrays than this state: saved "
                                  f"{[e['key'] for e in entries][:5]}..., wanted {keys[:5]}...")
        blob = (where / "state.bin").read_bytes()
        leaves = []
        for entry, (_, target) in zip(entries, wanted, strict=True):
            dtype, shape = jnp.dtype(entry["dtype"]), tuple(entry["shape"])
            if dtype != target.dtype or shape != tuple(target.shape):
                raise CheckpointError(f"checkpoint {where}: {entry['key']} is {entry['dtype']}{list(shape)}, this "
                                      f"state's is {target.dtype}{list(target.shape)}")
            data = blob[entry["offset"] : entry["offset"] + entry["nbytes"]]
            if len(data) != entry["nbytes"]:
                raise CheckpointError(f"checkpoint {where} is truncated at {entry['key']}")
            array = np.frombuffer(data, dtype=dtype).reshape(shape).copy()  # owned: its buffer may be donated
            sharding = getattr(target, "sharding", None)
            leaves.append(jax.device_put(array, sharding) if sharding is not None else jnp.asarray(array))
        return jax.tree_util.tree_unflatten(treedef, leaves), saved["meta"]

    def close(self) -> None:
        """Finish the write in flight, then close."""
        self.wait()
        self._writer.shutdown()
        if self._orbax is not None:
            self._orbax.close()

    def _steps(self) -> list[int]:
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir())

    def _orbax_manager(self):
        import orbax.checkpoint as ocp

        if self._orbax is None:
            self._orbax = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
                max_to_keep=self.max_to_keep, enable_async_checkpointing=self.background))
        return self._orbax


def _orbax_args(train_state: Any, meta: dict[str, Any]):
    import orbax.checkpoint as ocp

    return ocp.args.Composite(state=ocp.args.StandardSave(train_state), meta=ocp.args.JsonSave(meta))


def _orbax_restore_args(like: Any):
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())


@jax.jit
def _all_finite(params) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))
