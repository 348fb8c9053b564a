"""What could only fail later, checked before any process starts: one ConfigError line each, naming the key,
the value and what to change (the CLI prints it and exits 2).

    preflight(cfg)     # in `rlsched train`, after the config validated and before the run directory exists

- a model directory that is missing, or lacks config.json, its safetensors weights or tokenizer.json (unless
  model.init_preset will create it): only file names and the weight index are read, never the weights;
- meshes that do not split the model, prompts + new tokens past its positions (rlsched.config.meshes.check_meshes);
- a memory budget smaller than one role on its own (rlsched.config.plan.check_budget);
- a reward name that is not registered (the known ones listed), a reward function that does not import or
  cannot be called as a reward (file and line named);
- a data file that is missing or whose first record lacks the named fields (only that record is read);
- an output directory that cannot be written.
Only config.json files and one record per data file are read; nothing imports JAX or Ray.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlsched.config.meshes import check_meshes
from rlsched.config.plan import check_budget
from rlsched.config.schema import ConfigError, ExperimentConfig, TaskConfig


def preflight(cfg: ExperimentConfig) -> None:
    for i, task in enumerate(cfg.tasks):
        check_model_dir(task, i)  # first: the meshes and the budget read its config.json
    check_meshes(cfg)
    check_budget(cfg)
    for i, task in enumerate(cfg.tasks):
        check_reward(task, i)
        check_data(task, i)
    check_output_dir(cfg)


WEIGHT_INDEX = "model.safetensors.index.json"  # as workers.models.checkpoint reads it (that module imports JAX)


def check_model_dir(task: TaskConfig, index: int) -> None:
    """The model directory holds what the roles load: config.json, the safetensors weights (every file the index
    names) and tokenizer.json. A directory (or its config.json) that is absent is fine when model.init_preset
    will create it. Without this, a missing file is found only after Ray started, in a role's constructor."""
    m, key = task.model, f"tasks.{index}.model.path"
    path = Path(m.path)
    fix = (f"point it at a local Hugging Face model directory (--set {key}=DIR) or set tasks.{index}.model.init_preset "
           "to create a random one there; rlsched never downloads weights")
    if not path.exists():
        if m.init_preset is None:
            raise ConfigError(f"{key}: {path} does not exist; {fix}")
        return
    if not path.is_dir():
        raise ConfigError(f"{key}: {path} is a file, not a model directory (config.json, *.safetensors, "
                          f"tokenizer.json); {fix}")
    if not (path / "config.json").is_file():
        if m.init_preset is None:
            raise ConfigError(f"{key}: {path} has no config.json, so it is not a Hugging Face model directory; {fix}")
        return
    missing = _missing_weights(path, key)
    if missing:
        raise ConfigError(f"{key}: {path} has config.json but {missing}; rlsched reads safetensors weights only: copy "
                          "the model's *.safetensors (and model.safetensors.index.json) there, or save it with "
                          "transformers' save_pretrained(safe_serialization=True)")
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(f"{key}: {path} has no tokenizer.json; rlsched needs the fast (tokenizers) tokenizer saved "
                          "with the model (tokenizer.save_pretrained(DIR) writes it)")


def _missing_weights(path: Path, key: str) -> str | None:
    """What is missing of the weights (a phrase), or None: model.safetensors, or every file the index names."""
    import json

    index = path / WEIGHT_INDEX
    if not index.is_file():
        found = (path / "model.safetensors").is_file()
        return None if found else f"no weights (no model.safetensors nor {WEIGHT_INDEX})"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(f"{key}: {index} is not a safetensors index (a JSON object with a weight_map): "
                          f"{type(err).__name__}: {err}") from None
    absent = [f for f in files if not (path / f).is_file()]
    if not files or absent:
        return (f"{WEIGHT_INDEX} names no files" if not files else
                f"{len(absent)} of the {len(files)} weight files {WEIGHT_INDEX} names are absent (first: {absent[0]})")
    return None


def check_reward(task: TaskConfig, index: int) -> None:
    """A built-in's name is registered; a function of the user's imports and can be called as a reward (its file
    and module are run here, as the task's driver will run them again where it scores)."""
    from workers.reward_loader import RewardLoadError, load_reward
    from workers.rewards import REWARDS

    r = task.reward
    if r.name is not None and r.name not in REWARDS:
        raise ConfigError(f"tasks.{index}.reward.name: unknown reward {r.name!r}; known rewards: "
                          f"{', '.join(sorted(REWARDS))}")
    try:
        load_reward(name=r.name, function=r.function, file=r.file, batch=r.batch)
    except RewardLoadError as err:
        key = "file" if r.file is not None and str(err).startswith(f"reward file {r.file} ") else "function"
        raise ConfigError(f"tasks.{index}.reward.{key}: {err}") from None


def check_data(task: TaskConfig, index: int) -> None:
    """The data file exists and its first record has the question and answer fields."""
    d = task.data
    if d.path is None:  # synthetic, or the GSM8K shipped with the package
        return
    path, key = Path(d.path), f"tasks.{index}.data.path"
    if path.is_dir():
        raise ConfigError(f"{key}: {path} is a directory; data.path names a file (JSONL or parquet) (got {d.path!r})")
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
