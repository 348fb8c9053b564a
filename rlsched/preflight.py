"""What could only fail later, checked before any process starts: one ConfigError line each, naming the key,
the value and what to change (the CLI prints it and exits 2).

    preflight(cfg)     # in `rlsched train`, after the config validated and before the run directory exists

- meshes that do not split the model, prompts + new tokens past its positions (rlsched.meshes.check_meshes);
- a memory budget smaller than one role on its own (rlsched.plan.check_budget);
- a reward name that is not registered (the known ones listed);
- a data file that is missing or whose first record lacks the named fields (only that record is read);
- an output directory that cannot be written.
Only config.json files and one record per data file are read; nothing imports JAX or Ray.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlsched.config import ConfigError, ExperimentConfig, TaskConfig
from rlsched.meshes import check_meshes
from rlsched.plan import check_budget


def preflight(cfg: ExperimentConfig) -> None:
    check_meshes(cfg)
    check_budget(cfg)
    for i, task in enumerate(cfg.tasks):
        check_reward(task, i)
        check_data(task, i)
    check_output_dir(cfg)


def check_reward(task: TaskConfig, index: int) -> None:
    from workers.rewards import REWARDS

    if task.reward.name not in REWARDS:
        raise ConfigError(f"tasks.{index}.reward.name: unknown reward {task.reward.name!r}; known rewards: "
                          f"{', '.join(sorted(REWARDS))}")


def check_data(task: TaskConfig, index: int) -> None:
    """The data file exists and its first record has the question and answer fields."""
    d = task.data
    if d.path is None:  # synthetic, or the GSM8K shipped with the package
        return
    path, key = Path(d.path), f"tasks.{index}.data.path"
    if not path.is_file():
        raise ConfigError(f"{key}: {path} does not exist (got {d.path!r})")
    fields = ("question", "answer") if d.kind == "gsm8k" else (d.question_field, d.answer_field)
    if d.kind == "parquet":
        import pyarrow.parquet as pq  # only parquet users pay for the import

        present = set(pq.read_schema(path).names)
    else:
        present = set(_first_record(path, key))
    missing = [f for f in fields if f not in present]
    if missing:
        raise ConfigError(f"{key}: the first record of {path} has no field {', '.join(map(repr, missing))} (it has "
                          f"{sorted(present)}); set tasks.{index}.data.question_field / answer_field")


def _first_record(path: Path, key: str) -> dict:
    from workers.data import DataError, jsonl_records

    try:
        for _, record in jsonl_records(path):
            return record
    except DataError as err:
        raise ConfigError(f"{key}: {err}") from None
    raise ConfigError(f"{key}: {path} has no records")


def check_output_dir(cfg: ExperimentConfig) -> None:
    """The run directory can be created and written: its nearest existing ancestor is a writable directory."""
    where = Path(cfg.experiment.output_dir).absolute()
    existing = next(p for p in (where, *where.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a directory" if not existing.is_dir() else "is not writable"
        raise ConfigError(f"experiment.output_dir: {existing} {what}, so {where} cannot hold the run "
                          f"(got {cfg.experiment.output_dir!r})")
