"""Task checkpoints: the actor's TrainState (orbax) plus a small JSON of where the run stands.

Orbax writes each step into a temporary directory and renames it into place when complete, so a
crash mid-save leaves the previous checkpoint as the latest one. We never write non-finite params.
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
    def __init__(self, directory: str | Path, *, max_to_keep: int = 2):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, train_state: Any, meta: dict[str, Any]) -> None:
        """Save after `step` GRPO steps. Refuses params that are not all finite."""
        if not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(train_state.params)):
            raise CheckpointError(f"refusing to write checkpoint {step}: the params contain NaN or inf")
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(train_state),
                                                         meta=ocp.args.JsonSave(meta)))
        self._manager.wait_until_finished()

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """(train_state shaped like `like`, meta) of `step` (default: the latest)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory} to resume from")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                       meta=ocp.args.JsonRestore()))
        return restored.state, restored.meta

    def close(self) -> None:
        self._manager.close()
