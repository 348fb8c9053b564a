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
from typing import Any

from rlsched.config import ConfigError, ExperimentConfig, dump_resolved, load_configs


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


def select_tasks(cfg: ExperimentConfig, names: Sequence[str] | None) -> ExperimentConfig:
    if not names:
        return cfg
    known = [t.name for t in cfg.tasks]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"--tasks: no task named {', '.join(map(repr, unknown))}; this experiment has {known}")
    # Pin each task's seed to its place in the full experiment, so a subset computes what it would
    # have computed as part of the whole.
    seed = cfg.experiment.seed
    kept = [t.model_copy(update={"seed": t.resolved_seed(seed, i)}) for i, t in enumerate(cfg.tasks) if t.name in names]
    return cfg.model_copy(update={"tasks": kept})


def train(configs: str | Path | Sequence[str | Path], *, overrides: Sequence[str] = (), resume: bool = False,
          overwrite: bool = False, tasks: Sequence[str] | None = None, in_process: bool = True,
          address: str | None = None, echo=print) -> dict[str, Any]:
    """Validate, prepare runs/<experiment>/, run the tasks.

    in_process=True runs the tasks one after another in this process and returns
    {task: [metrics per step]}; otherwise they run concurrently under the Ray scheduler and the
    result is {task: {"status": "ok" | "failed", ...}}.
    """
    paths = [configs] if isinstance(configs, str | Path) else list(configs)
    cfg = select_tasks(load_configs(paths, overrides), tasks)
    for task in cfg.tasks:
        echo(task.batch_plan().describe())
    run_dir = prepare_run_dir(cfg, resume=resume, overwrite=overwrite)
    echo(f"run directory: {run_dir}")
    if not in_process:
        from rlsched.experiment import run_experiment

        return run_experiment(cfg, resume=resume, address=address, echo=echo)

    from rlsched.trainer import TaskRunner  # after validation: a config typo should not wait for JAX

    return {task.name: TaskRunner(cfg, i, resume=resume, echo=echo).run() for i, task in enumerate(cfg.tasks)}
