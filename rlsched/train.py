"""`rlsched train`: load and check the config, prepare the run directory, run each task.

Tasks of one config run one after another in this process for now; the scheduler runs them
concurrently under Ray without changing this command.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rlsched.config import ExperimentConfig, dump_resolved, load_config


class RunDirError(ValueError):
    pass


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(text)
    os.replace(f.name, path)


def prepare_run_dir(cfg: ExperimentConfig, *, resume: bool, overwrite: bool) -> Path:
    run_dir = cfg.run_dir
    has_run = (run_dir / "tasks").exists()
    if has_run and not (resume or overwrite):
        raise RunDirError(
            f"{run_dir} already holds a run; pass --resume to continue it, --overwrite to replace it, "
            f"or choose another name with --set experiment.name=...")
    if has_run and overwrite and not resume:
        shutil.rmtree(run_dir)
    write_atomic(run_dir / "config.yaml", dump_resolved(cfg))
    return run_dir


def train(config: str | Path, *, overrides: Sequence[str] = (), resume: bool = False, overwrite: bool = False,
          echo=print) -> dict[str, list[dict]]:
    cfg = load_config(config, overrides)
    for task in cfg.tasks:
        echo(task.batch_plan().describe())
    run_dir = prepare_run_dir(cfg, resume=resume, overwrite=overwrite)
    echo(f"run directory: {run_dir}")

    from rlsched.trainer import TaskRunner  # after validation: a config typo should not wait for JAX

    histories = {}
    for index, task in enumerate(cfg.tasks):
        histories[task.name] = TaskRunner(cfg, index, resume=resume, echo=echo).run()
    return histories
