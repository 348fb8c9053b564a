"""The run directory and the files in it: one atomic write, one JSON encoder, one layout.

    runs/<experiment>/config.yaml                 resolved config (prepare_run_dir)
    runs/<experiment>/tasks/<task>/               metrics.jsonl, hparams.json, summary.json, checkpoints/,
                                                  traceback.txt (a task that failed: where it raised)
    runs/<experiment>/timeline.json|.png          Chrome trace and Gantt (rlsched.observe: timeline, gantt)
    runs/<experiment>/summary.json                per-task status, phase times, scheduler state
    runs/<experiment>/run.lock                    the live run's pid, host and start time (rlsched.rundir.lock)

Design decisions (and why):
- **One `write_atomic`** for every file a run or a benchmark leaves (text or bytes): a temporary file in
  the same directory, flushed and fsynced, then `os.replace`d over the target, so a reader or a resumed
  run sees the old file or the new one, never half of one. Mode 0644: results are for everyone to read.
- **One `json_safe`**: numpy/JAX scalars become Python numbers, NaN becomes null and ±inf the string
  "inf"/"-inf" (JSON has neither; the value stays visible), mappings and sequences recurse, anything
  else becomes its `str`. Metrics, hparams and timeline args all go through it.
- No jax, no ray: the control plane writes these files.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlsched.config.loading import dump_resolved
from rlsched.config.schema import ExperimentConfig


class RunDirError(ValueError):
    """The run directory cannot be used as asked (it holds a run and neither --resume nor --overwrite)."""


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Replace `path` with `data` (text or bytes) atomically; creates the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def json_safe(value: Any) -> Any:
    """`value` as something `json.dumps` writes without a `default=` (see the module docstring)."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy / jax scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return str(value)


TRACEBACK_FILE = "traceback.txt"  # in a failed task's directory: the whole traceback behind its one-line cause


def task_dir(run_dir: str | Path, task: str) -> Path:
    """`runs/<experiment>/tasks/<task>`: everything one task writes."""
    return Path(run_dir) / "tasks" / task


def prepare_run_dir(cfg: ExperimentConfig, *, resume: bool, overwrite: bool) -> Path:
    """Make `cfg.run_dir` ready for a run and write its resolved config.yaml.

    A directory that already holds a run is refused unless the run is resumed (kept) or overwritten
    (its contents removed first, all but the lock file: the caller holds it, rlsched.rundir.lock)."""
    from rlsched.rundir.lock import LOCK_NAME

    run_dir = cfg.run_dir
    has_run = (run_dir / "tasks").exists()
    if has_run and not (resume or overwrite):
        raise RunDirError(
            f"{run_dir} already holds a run; pass --resume to continue it, --overwrite to replace it, "
            f"or choose another name with --set experiment.name=...")
    if has_run and overwrite and not resume:
        for entry in run_dir.iterdir():
            if entry.name == LOCK_NAME:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    write_atomic(run_dir / "config.yaml", dump_resolved(cfg))
    return run_dir


def run_summary(experiment: str, placement: str, results: Mapping[str, Mapping[str, Any]],
                timeline: Mapping[str, Any], scheduler_state: Mapping[str, Any] | None) -> dict[str, Any]:
    """What runs/<experiment>/summary.json holds: each task's result (status, steps or error; no traceback),
    the timeline's summary and the scheduler's state.

    The scheduler's policy calls every task that left its books `failed`, a task that finished included (it
    is retired the same way); here each task's flag says its outcome instead: true only for a task whose
    status is "failed". A task the scheduler knows without a result here (another submission's, beside it
    in the service) keeps no flag: its outcome is not known from this run."""
    scheduler = json_safe(scheduler_state or {})
    for name, task in scheduler.get("snapshot", {}).get("tasks", {}).items():
        task.pop("failed", None)
        if name in results:
            task["failed"] = results[name]["status"] == "failed"
    return {"experiment": experiment, "placement": placement,
            "tasks": {name: {k: v for k, v in r.items() if k != "traceback"} for name, r in results.items()},
            "timeline": timeline, "scheduler": scheduler}
