"""What the scheduler service keeps of each task's submission, so that `rlsched resume TASK` continues exactly that
run, from any directory.

    given = Given.of(cfg, configs=[...], overrides=[...], cwd="/home/me/exp")   # at submit (rlsched.service.server)
    cfg = given.config({"num_devices": 1, ...})     # at resume: that config under the running service's settings
    last_checkpoint(spec.checkpoint_dir)            # -> the step of the task's latest checkpoint, or None

Design decisions (and why):
- **The config as it ran, not the file it came from.** The file may have been edited or removed since, and its
  relative paths meant the directory `submit` ran in; what is kept is the validated config with absolute paths,
  as the service ran it, whole: a task's seed and checkpoint offset depend on its place among the submission's
  tasks, so a resumed task is run from the same experiment, not from a one-task copy of it. The file paths,
  the `--set` overrides and the working directory are kept beside it, to say where it came from.
- **The running service's cluster settings win.** A service started again (`rlsched up` with other options)
  runs a resumed task under its own devices, placement and budget, as it runs every submission.
- **Kept in tasks.json beside the records** (a few KiB per task): a service that died leaves them for the next
  one, whose FAILED tasks then resume as the cancelled ones do. `rlsched forget TASK` drops them.
- No jax, no ray: the service reads checkpoint directories by name (a step's directory appears whole, by rename,
  in rlsched.run.checkpoints), without loading them.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from rlsched.config.loading import validate
from rlsched.config.schema import ExperimentConfig


@dataclasses.dataclass(frozen=True)
class Given:
    """One task's submission, as `rlsched resume` needs it."""

    resolved: dict[str, Any]  # the submission's ExperimentConfig (model_dump, mode json): absolute paths, all tasks
    configs: list[str]  # the config files named to `submit`, absolute
    overrides: list[str]  # its `--set`s, as given
    cwd: str | None  # where `submit` ran (relative paths were resolved against it)
    run_dir: str  # runs/<experiment>, absolute

    @classmethod
    def of(cls, cfg: ExperimentConfig, *, configs=(), overrides=(), cwd: str | None = None) -> Given:
        return cls(cfg.model_dump(mode="json"), [str(c) for c in configs], list(overrides), cwd, str(cfg.run_dir))

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Given:
        return cls(**{f.name: row.get(f.name) for f in dataclasses.fields(cls)})

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config(self, settings: dict[str, Any]) -> ExperimentConfig:
        """The submission's config with `settings` (the running service's cluster keys) put in; ConfigError if it
        does not validate under them."""
        raw = copy.deepcopy(self.resolved)
        raw.setdefault("cluster", {}).update(settings)
        return validate(raw, label=f"the config submitted from {self.cwd or 'an unknown directory'}")

    def describe(self) -> str:
        """'configs/a.yaml --set x=1, submitted from /home/me/exp' (what a resume message repeats)."""
        sets = "".join(f" --set {o}" for o in self.overrides)
        return f"{' '.join(self.configs) or 'its config'}{sets}, submitted from {self.cwd or 'an unknown directory'}"


def last_checkpoint(directory: str | Path) -> int | None:
    """The step of the latest checkpoint in a task's checkpoints/ directory, or None when it holds none."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir()]
    return max(steps, default=None)


def resume_notes(cfg: ExperimentConfig) -> list[str]:
    """One line per task of a `--resume` submission: where it continues from, said on the command's own output
    (a task without a checkpoint starts from step 0; one at its last step has nothing left to run)."""
    notes = []
    for spec in cfg.task_specs():
        step = last_checkpoint(spec.checkpoint_dir)
        if step is None:
            notes.append(f"{spec.name}: --resume found no checkpoint in {spec.checkpoint_dir}; it starts from step 0")
        elif step >= spec.config.steps:
            notes.append(f"{spec.name}: its last checkpoint is step {step} of {spec.config.steps}: nothing is left to "
                         "run (a larger `steps` trains on)")
        else:
            notes.append(f"{spec.name}: resumes after step {step} (checkpoint in {spec.checkpoint_dir})")
    return notes
