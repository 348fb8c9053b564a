"""Task checkpoints: the actor's TrainState (orbax) plus a small JSON of where the run stands.

Design decisions (and why):
- **Off the step's path.** `save` returns once the arrays are copied to host (orbax's asynchronous save);
  the files are written by a background thread while the task goes on, and its devices may be given to
  another task at once. A task never has two saves in flight: the next save, a restore and `close` first
  wait for the one being written.
- **Atomic.** Orbax writes each step into a temporary directory and renames it into place when complete,
  so a crash mid-write leaves the previous checkpoint as the latest one: resume never picks a half one.
- **Never non-finite.** The params are checked (one reduction on the devices) before anything is written.
- `keep_last` checkpoints are kept; older ones go once a newer one is complete.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from rlsched.errors import CheckpointError

log = logging.getLogger(__name__)


class TaskCheckpointer:
    def __init__(self, directory: str | Path, *, max_to_keep: int = 2, background: bool = True):
        self.directory = Path(directory).absolute()
        self.background = background
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=background),
        )

    def latest_step(self) -> int | None:
        """The latest complete checkpoint (one being written counts once it is)."""
        self.wait()
        return self._manager.latest_step()

    def save(self, step: int, train_state: Any, meta: dict[str, Any]) -> None:
        """Save after `step` GRPO steps: returns once the state is copied to host, the write goes on in the
        background (`wait` for it). Refuses params that are not all finite."""
        if not bool(_all_finite(train_state.params)):
            raise CheckpointError(f"refusing to write checkpoint {step}: the params contain NaN or inf")
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(train_state),
                                                         meta=ocp.args.JsonSave(meta)))
        if not self.background:
            self.wait()

    def wait(self) -> None:
        """Until the save being written (if any) is complete on disk."""
        self._manager.wait_until_finished()

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """(train_state shaped like `like`, meta) of `step` (default: the latest)."""
        self.wait()
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory} to resume from")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                       meta=ocp.args.JsonRestore()))
        return restored.state, restored.meta

    def close(self) -> None:
        """Finish the write in flight, then close."""
        self.wait()
        self._manager.close()


@jax.jit
def _all_finite(params) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))
