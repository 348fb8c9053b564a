"""Reading an experiment: YAML files (with YAML 1.2 floats), `--set` overrides, validation into
`rlsched.config.schema.ExperimentConfig`, and every problem as one `ConfigError` line per field.

Design decisions:
- YAML is read with YAML 1.2 float rules so `lr: 1e-6` is a float; PyYAML's default (YAML 1.1) reads it as
  the string "1e-6".
- Every error line reads `<file>: <field.path>: <message> (got <value>)`: the path is what you would pass to
  `--set`, so the fix is one edit away.
- Overrides (`--set tasks.0.grpo.beta=0.04`) edit the raw YAML dict before validation, so an overridden value
  goes through exactly the same checks and messages as one from the file. `*` for a list index sets every item
  (`--set tasks.*.steps=10`); a key no task has is then reported once per task, each line naming the override.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from rlsched.config.schema import ConfigError, ExperimentConfig, _FieldError


def with_absolute_paths(cfg: ExperimentConfig, base: str | Path) -> ExperimentConfig:
    """`cfg` with its relative paths (experiment.output_dir, each task's model.path and data.path) made
    absolute against `base`: what a process with another working directory (the scheduler service) is handed."""
    def absolute(path: str | None) -> str | None:
        return None if path is None else str((Path(base) / path).absolute())

    tasks = [t.model_copy(update={"model": t.model.model_copy(update={"path": absolute(t.model.path)}),
                                  "data": t.data.model_copy(update={"path": absolute(t.data.path)})})
             for t in cfg.tasks]
    experiment = cfg.experiment.model_copy(update={"output_dir": absolute(cfg.experiment.output_dir)})
    return cfg.model_copy(update={"tasks": tasks, "experiment": experiment})


def select_tasks(cfg: ExperimentConfig, names: Sequence[str] | None) -> ExperimentConfig:
    """`--tasks a,b`: only these tasks, each keeping the seed it has in the whole experiment."""
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


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats: `1e-6` and `3E5` are numbers, not strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _apply_override(raw: dict, override: str) -> list[str]:
    """Set one `a.b.0.c=value` in the raw dict; returns the dotted path(s) it set. A `*` in place of a list index
    sets the key in every item of that list (`tasks.*.steps=10`: every task's steps)."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} is malformed; expected path.to.key=value, "
                          "e.g. tasks.0.grpo.beta=0.04 or tasks.*.steps=10")
    try:
        value = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: value {text!r} is not valid YAML: {e}") from None
    return _set(raw, key.strip().split("."), 0, value, override)


def _set(node: Any, parts: list[str], depth: int, value: Any, override: str) -> list[str]:
    """Set parts[depth:] under `node` (reached by parts[:depth]) to `value`; the dotted paths set."""
    part, last, here = parts[depth], depth == len(parts) - 1, ".".join(parts[:depth]) or "the top level"
    if isinstance(node, dict):
        if part == "*":
            raise ConfigError(f"override {override!r}: {here} is a mapping; '*' stands for every item of a list "
                              "(e.g. tasks.*.steps=10); name the key instead")
        # A new key is allowed: validation then reports it as unknown, with a suggestion.
        if last:
            node[part] = _unshare(value)  # a mapping set under `*` is each item's own
            return [".".join(parts)]
        if node.get(part) is None:
            node[part] = {}  # absent, or `section:` left empty in the YAML
        return _set(node[part], parts, depth + 1, value, override)
    if isinstance(node, list):
        if part == "*":
            if not node:
                raise ConfigError(f"override {override!r}: {here} is an empty list; '*' has no item to set")
            indices = range(len(node))
        elif part.isdigit() and int(part) < len(node):
            indices = [int(part)]
        else:
            raise ConfigError(f"override {override!r}: {here} is a list of {len(node)} items; index {part!r} "
                              f"is out of range (use 0..{len(node) - 1}, or * for every item)")
        paths = []
        for i in indices:
            concrete = [*parts[:depth], str(i), *parts[depth + 1:]]
            if last:
                node[i] = _unshare(value)
                paths.append(".".join(concrete))
            else:
                paths += _set(node[i], concrete, depth + 1, value, override)
        return paths
    raise ConfigError(f"override {override!r}: {here} is {node!r}, not a mapping or list, so it has no "
                      f"key {part!r}")


def _model_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model class that validates the mapping at `loc`, for unknown-key suggestions."""
    cls: type[BaseModel] = ExperimentConfig
    for part in loc:
        if isinstance(part, int):
            continue  # list element: the annotation below was already unwrapped
        field = cls.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        while get_origin(ann) in (list, Union, types.UnionType):
            ann = next(a for a in get_args(ann) if a is not type(None))
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _format_error(err: dict, label: str, overridden: dict[str, str]) -> str:
    loc, value, msg, suffix = tuple(err["loc"]), err.get("input"), err["msg"], ""
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, _FieldError):
        loc, value, msg = loc + cause.field, cause.value, str(cause)
    elif err["type"] == "value_error":
        msg = str(cause)  # without pydantic's "Value error, " prefix
    elif err["type"] == "extra_forbidden":
        cls = _model_at(loc[:-1])
        names = list(cls.model_fields) if cls else []
        close = difflib.get_close_matches(str(loc[-1]), names, n=1)
        msg = "unknown key"
        suffix = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}" if names else ""
    path = ".".join(str(p) for p in loc) or "<top level>"
    quoted = "" if err["type"] == "missing" else f" (got {_short_repr(value)})"  # a missing key has no value
    line = f"{label}: {path}: {msg}{quoted}{suffix}"
    for prefix, override in overridden.items():
        if path == prefix or path.startswith(prefix + "."):
            line += f" [from override {override!r}]"
    return line


def read_raw(path: str | Path) -> dict:
    """The YAML mapping of a config file, before validation; syntax errors name file:line:col."""
    path = Path(path)
    if not path.is_file():
        what = "does not exist" if not path.exists() else "is a directory" if path.is_dir() else "is not a file"
        raise ConfigError(f"config file {path} {what}; name an experiment YAML (see configs/)")
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from None
    if not isinstance(raw, dict):
        got = "an empty file" if raw is None else f"a {type(raw).__name__}"
        raise ConfigError(f"{path}: the top level must be a mapping with experiment:, tasks: and cluster: (got {got})")
    return raw


def _unshare(node: Any) -> Any:
    """A copy in which no mapping or list appears twice. YAML anchors (`rollout: *rollout`) load as one shared
    object; an override of `tasks.1.rollout` must not also change every task that names the same anchor."""
    if isinstance(node, dict):
        return {k: _unshare(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_unshare(v) for v in node]
    return node


def _reward_files_absolute(raw: dict, task_dirs: Sequence[Path]) -> None:
    """Each task's relative `reward.file` made absolute against its config file's directory (task_dirs[i]), so
    any process, started anywhere, loads the same file."""
    tasks = raw.get("tasks")
    for i, task in enumerate(tasks if isinstance(tasks, list) else []):
        reward = task.get("reward") if isinstance(task, dict) else None
        file = reward.get("file") if isinstance(reward, dict) else None
        if isinstance(file, str) and file:
            base = task_dirs[i] if i < len(task_dirs) else Path.cwd()
            reward["file"] = str((base / Path(file).expanduser()).absolute())  # an absolute path stays itself


def validate(raw: dict, overrides: Sequence[str] = (), *, label: str = "config",
             task_dirs: Sequence[Path] = ()) -> ExperimentConfig:
    """Apply `--set` overrides to a raw mapping and validate it; every problem is a `ConfigError`.
    `task_dirs[i]`: the directory of the file task i came from (a relative reward.file is relative to it; to the
    working directory when not given)."""
    raw = _unshare(raw)
    overridden = {path: o for o in overrides for path in _apply_override(raw, o)}
    _reward_files_absolute(raw, [Path(d).absolute() for d in task_dirs])
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        lines = [_format_error(err, label, overridden) for err in e.errors()]
        raise ConfigError("\n".join(lines)) from None


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read, override and validate an experiment config; every problem is a `ConfigError`."""
    raw = read_raw(path)
    tasks = raw.get("tasks")
    return validate(raw, overrides, label=str(path),
                    task_dirs=[Path(path).parent] * (len(tasks) if isinstance(tasks, list) else 0))


def load_configs(paths: Sequence[str | Path], overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Several configs as one experiment: tasks concatenated in order (`tasks.N` overrides index the
    combined list); experiment: and cluster: come from the first file."""
    if len(paths) == 1:
        return load_config(paths[0], overrides)
    raws = [read_raw(p) for p in paths]
    merged = dict(raws[0])
    merged["tasks"] = [t for raw in raws for t in (raw.get("tasks") or [])]
    dirs = [Path(p).parent for p, raw in zip(paths, raws, strict=True) for _ in (raw.get("tasks") or [])]
    return validate(merged, overrides, label="+".join(str(p) for p in paths), task_dirs=dirs)


def dump_resolved(cfg: ExperimentConfig) -> str:
    """The config with every default filled in, as YAML; `load_config` of it gives back `cfg`."""
    header = "# Resolved by rlsched: every default filled in. This file is a valid config on its own.\n"
    return header + yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
