"""Which pending tasks of the service start now: their roles' bytes per device against the memory budget. Plain
Python over the task records (rlsched.service.records); rlsched.service.server starts what this admits.

    admission = Admission(settings)                   # `rlsched up`'s settings: placement, budget, overcommit
    needs = admission.needs(engine_bytes, actor_bytes)  # a task's bytes on the group's busiest device
    for name in admission.startable(book.tasks): start(name)   # each started task is RUNNING before the next

Design decisions (and why):
- **Admission keeps every admitted task resident.** A task starts when its roles' bytes per device (the
  plan's estimate, as `train`'s admission uses) fit beside those of the tasks running; otherwise it is
  PENDING with the numbers, and it starts when room frees, in submission order (a task that fits never
  overtakes an older one that does not: the older one would starve). Offloading between tasks of a shared
  service would make every task pay for each newcomer (offload made small tasks 7x slower in the field);
  `rlsched up --overcommit` admits any task that fits alone and lets evictions swap roles, as `train` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rlsched.base.units import format_bytes
from rlsched.cluster import ray_cluster
from rlsched.config.schema import ExperimentConfig
from rlsched.rundir.files import RunDirError, task_dir
from rlsched.service.records import PENDING, RUNNING, TaskRecord

GiB = 2**30


class Admission:
    """The service's admission by memory (see the module docstring)."""

    def __init__(self, settings: dict[str, Any]):
        self.settings = settings

    def needs(self, engine: int, actor: int) -> int:
        if self.settings.get("overcommit"):
            return 0  # evictions make room (the policy's admission), as `train` does
        if self.settings["placement"] == "colocated":
            return engine + actor
        return max(engine, actor)  # one pool each; the budget is per device of either group

    def budget_bytes(self) -> int | None:
        budget = self.settings.get("memory_budget_gb")
        return None if budget is None else int(budget * GiB)

    def used_bytes(self, tasks: dict[str, TaskRecord]) -> int:
        running = [t for t in tasks.values() if t.state == RUNNING]
        return sum(t.needs_bytes for t in running) + sum(bases_of(running).values())

    def need_now(self, record: TaskRecord, tasks: dict[str, TaskRecord]) -> int:
        """What admitting `record` adds: its own bytes, and each shared base no running task reads yet (a LoRA task's
        base group shares one copy, rlsched.config.plan.SharedBase)."""
        held = bases_of([t for t in tasks.values() if t.state == RUNNING])
        return record.needs_bytes + sum(n for key, n in record.bases.items() if key not in held)

    def startable(self, tasks: dict[str, TaskRecord]) -> Iterator[str]:
        """Pending tasks in submission order while they fit (the oldest that does not fit blocks the rest, its
        reason set to the numbers). The caller starts each one before asking for the next."""
        budget = self.budget_bytes()
        for name, record in list(tasks.items()):
            if record.state != PENDING:
                continue
            used, need = self.used_bytes(tasks), self.need_now(record, tasks)
            if budget is not None and used + need > budget:
                free = max(budget - used, 0)
                shown = (need, free, budget)  # one unit for the three, none of them reading 0.00
                record.reason = (f"needs {format_bytes(need, like=shown)} per device, "
                                 f"{format_bytes(free, like=shown)} free in group {ray_cluster.GROUP} "
                                 f"(memory budget {format_bytes(budget, like=shown)} per device)")
                return
            yield name


def check_task_dirs(cfg: ExperimentConfig, *, resume: bool) -> None:
    """Tasks of one experiment may be submitted apart (`--tasks`), so a run is refused per task: one whose
    directory holds a run needs `--resume` (RunDirError otherwise)."""
    if resume:
        return
    held = [t.name for t in cfg.tasks if task_dir(cfg.run_dir, t.name).exists()]
    if held:
        raise RunDirError(f"{cfg.run_dir} already holds a run of task(s) {', '.join(held)}; pass --resume to continue, "
                          "or choose another name with --set experiment.name=...")


def bases_of(records) -> dict[str, int]:
    """The shared bases the tasks of `records` read, each once: {key: bytes per device}."""
    return {key: n for record in records for key, n in record.bases.items()}
