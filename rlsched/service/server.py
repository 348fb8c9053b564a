"""The long-lived scheduler: tasks are submitted, admitted, run, cancelled and reported while it lives.

    rlsched up                       rlsched.service.daemon starts Ray and this actor ("service", namespace "rlsched")
    service.submit.remote(request_id, cfg, resume=False, origin)    -> {"tasks": ["addition", ...], "notes": [...]}
    service.status.remote() / logs.remote(task, offset) / cancel.remote(request_id, task) / locks.remote()
    service.resume.remote(request_id, task, fresh=False) / forget.remote(request_id, task)

A submission is one validated experiment config (rlsched.config.schema) whose paths are absolute: its tasks run
exactly as `rlsched train` runs them (a TaskDriver actor per task over the scheduler's locks, roles in the
service's device group, outputs in the config's runs/<experiment>/), except that they arrive and leave
while others run.

Design decisions (and why):
- **One scheduler, one device group, for the service's life.** The Scheduler actor and its pure Policy are
  made once; an arriving task is registered with them (`Scheduler.admit`) and a task that ended is retired,
  so its name can be resumed or submitted again. The service's cluster settings (devices,
  placement, budget, policy) are fixed by `rlsched up`; `submit` validates a config against them.
- **Admission keeps every admitted task resident.** A task starts when its roles' bytes per device (the
  plan's estimate, as `train`'s admission uses) fit beside those of the tasks running; otherwise it is
  PENDING with the numbers, and it starts when room frees, in submission order (a task that fits never
  overtakes an older one that does not: the older one would starve). Offloading between tasks of a shared
  service would make every task pay for each newcomer (offload made small tasks 7x slower in the field);
  `rlsched up --overcommit` admits any task that fits alone and lets evictions swap roles, as `train` does.
- **Requests carry ids.** A submit or cancel repeated with the same id (a client that timed out and tried
  again) returns the first answer and changes nothing.
- **States are kept on disk** (`<state dir>/tasks.json`, atomically after every change): a service that
  dies leaves its tasks' records, and the next one marks what was PENDING or RUNNING as FAILED with that
  reason; each such task resumes from its last checkpoint with `rlsched resume TASK`.
- **A task that ended is kept until forgotten.** A CANCELLED or FAILED task stays in `status`, with what it
  was submitted with (rlsched.service.submissions), until `rlsched forget TASK`: `rlsched resume TASK` continues it from
  any directory, exactly as it was submitted. Its name cannot be submitted anew meanwhile, nor `--resume`d in
  another run directory (that would resume some other run under its name). A FINISHED task's name is free.
- **A long submission does not grow the service.** A run's timeline holds every scheduler event of its time, so
  the scheduler kept all events since the oldest live submission began: a task training for a week kept a week of
  every task's events in memory. The monitor moves the events older than a few seconds to each live submission's
  spool file every `spool_s` (rlsched.service.spool); the run's outputs read it back when its last task ends.
- **Threads, not asyncio.** A monitor thread polls the drivers (their progress lines and rows, as the
  `train` command does), finishes the tasks that ended and admits pending ones; calls from clients take
  other threads of the actor and share its state under one lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from rlsched.base.units import format_bytes
from rlsched.cluster import ray_cluster
from rlsched.config.loading import dump_resolved
from rlsched.config.schema import ConfigError, ExperimentConfig
from rlsched.rundir.files import RunDirError, json_safe, task_dir, write_atomic
from rlsched.rundir.lock import RunLock
from rlsched.service.bounded import RecentAnswers, TailLines
from rlsched.service.spool import SPOOL_EVERY_S, SPOOL_MARGIN_S, EventSpool, event_end
from rlsched.service.submissions import Given, last_checkpoint, resume_notes

NAME, NAMESPACE = "service", "rlsched"  # the actor's name and Ray namespace
PENDING, RUNNING, FINISHED, FAILED, CANCELLED = "PENDING", "RUNNING", "FINISHED", "FAILED", "CANCELLED"
TERMINAL = (FINISHED, FAILED, CANCELLED)
GiB = 2**30

# What `rlsched up` fixes for every task the service runs: the config keys `submit` sets from it.
SETTINGS_KEYS = ("num_devices", "placement", "memory_budget_gb", "policy", "starvation_limit", "lease_timeout_s",
                 "processes")
# Bounds of what the service keeps in memory (it lives for weeks; rlsched.service.bounded); settings["limits"] may lower
# them (benchmarks/soak.py does, to reach them within a short soak).
LIMITS = {
    "requests": 1000,  # request ids answered, for a client that retries (within minutes)
    "lines": 1000,  # lines per task for `rlsched logs` (all of them are in the run's run.log)
    "finished": 100,  # finished tasks shown in `status`; older ones are in <state dir>/history.jsonl
    "grants": 1000,  # the scheduler's log of its last grants
    "spool_s": SPOOL_EVERY_S,  # seconds between moves of the scheduler's events to live submissions' spools
}
MAX_TASKS = 16  # tasks a device group's process has threads for at once (4 each); more tasks' calls wait for one


@dataclasses.dataclass
class TaskRecord:
    """One task of the service, as `status` shows it."""

    name: str
    experiment: str
    request: str  # the submission's request id
    run_dir: str
    steps: int
    state: str = PENDING
    reason: str | None = None  # why it is PENDING, or why it FAILED
    priority: int = 0
    weight: float = 1.0
    needs_bytes: int = 0  # its roles' bytes on the group's busiest device (admission), a shared base left out
    bases: dict[str, int] = dataclasses.field(default_factory=dict)  # the shared bases it reads -> bytes per device
    step: int = 0
    reward: float | None = None
    phase: str | None = None  # "compiling", "rollout (g0/rollout)", "waiting for train", ...
    lock: dict[str, Any] | None = None  # the lock held or waited for, from the same poll as `phase` (status_rows)
    devices: dict[str, Any] = dataclasses.field(default_factory=dict)  # role -> {"pid", "devices"}
    driver_pid: int | None = None  # the process running its step loop (its roles may share a device group's)
    submitted_at: float = dataclasses.field(default_factory=time.time)
    started_at: float | None = None
    ended_at: float | None = None
    cancel_requested: bool = False

    def row(self) -> dict[str, Any]:
        return json_safe(dataclasses.asdict(self))


@dataclasses.dataclass
class _Submission:
    cfg: ExperimentConfig
    resume: bool
    tasks: list[str]
    results: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    events: list[dict] = dataclasses.field(default_factory=list)
    started: float = dataclasses.field(default_factory=time.time)  # wall clock: its timeline starts here
    spool: EventSpool | None = None  # the scheduler's events of its time so far, on disk (rlsched.service.spool)
    spooled: float = 0.0  # wall clock: its events that ended before this are in its spool (0: none yet)

    def __post_init__(self):
        self.spooled = self.spooled or self.started


class Service:
    """The detached actor behind `rlsched up` (see the module docstring)."""

    def __init__(self, settings: dict[str, Any], state_dir: str):
        import ray

        from rlsched.scheduling.policy import GroupSpec, Policy
        from rlsched.scheduling.scheduler import Scheduler

        self.settings = dict(settings)
        self.state_dir = Path(state_dir)
        self.limits = {**LIMITS, **(settings.get("limits") or {})}
        self._lock = threading.RLock()
        self.tasks: dict[str, TaskRecord] = {}
        self._lines: dict[str, TailLines] = {}  # task -> its last lines (all of them are in its run.log)
        self._requests = RecentAnswers(self.limits["requests"])  # request id -> its answer
        self._degraded: dict[str, Any] | None = None  # the monitor's last error, until a pass succeeds
        self._dirs: dict[str, RunLock] = {}  # run directory -> the lock this service holds on it (rlsched.rundir.lock)
        self._subs: dict[str, _Submission] = {}
        self._drivers: dict[str, Any] = {}  # running task -> driver handle
        self._runs: dict[Any, str] = {}  # driver.run ref -> task
        self.given: dict[str, Given] = {}  # task -> what it was submitted with (kept until forgotten)
        self._closing = threading.Event()
        self._group_fenced = False  # the device group was out of service at the last admission (fenced_groups)
        self._load_previous()
        budget = settings.get("memory_budget_gb")
        nbytes = None if budget is None else int(budget * GiB)
        spec = (GroupSpec.colocated(nbytes) if settings["placement"] == "colocated"
                else GroupSpec.disaggregated(nbytes, nbytes))
        policy = Policy({ray_cluster.GROUP: spec}, order=settings["policy"],
                        starvation_limit=settings["starvation_limit"])
        self.scheduler = ray.remote(num_cpus=0)(Scheduler).remote(policy, lease_timeout_s=settings["lease_timeout_s"],
                                                                  grant_log_len=self.limits["grants"])
        self.resource = ray_cluster.device_resource()
        self.devices = ray_cluster.group_devices(settings["placement"], settings["num_devices"],
                                                 settings.get("rollout_devices") or settings["num_devices"] // 2 or 1)
        self.pg = ray_cluster.make_placement_group("rlsched-service", settings["placement"], self.resource,
                                                   self.devices)
        self.where = ray_cluster.role_sites(self.pg, settings["placement"], self.resource,
                                                self.devices)
        from rlsched.config.meshes import resolve_processes

        self.processes = self.settings["processes"] = resolve_processes(settings.get("processes") or "auto",
                                                                        self.resource)
        self.group_processes: dict[str, Any] = {}  # role -> its device group's process, for the service's life
        if self.processes == "per_device_group":
            self.where = self._start_group_processes()
        self._spooling = threading.Lock()  # one spool pass at a time, and none while a run's outputs read a spool
        self._next_spool = time.monotonic() + self.limits["spool_s"]
        shutil.rmtree(self.state_dir / "spool", ignore_errors=True)  # a dead service's: its runs' timelines are gone
        self._save()
        self._monitor = threading.Thread(target=self._watch, name="rlsched-service-monitor", daemon=True)
        self._monitor.start()

    def _start_group_processes(self):
        """One process per device group (colocated: one) that holds every task's roles there for the service's
        life (rlsched.cluster.group_process). Ray restarts it whenever it dies (a fence ends it on purpose): the tasks
        there with restarts left, and those a fence of another task cost their roles, build them again in it."""
        from rlsched.cluster.group_process import start_group_processes

        # Sharing: an engine of a process of its own (sglang-jax) may come with any submission.
        self.group_processes = start_group_processes(
            self.where, colocated=self.settings["placement"] == "colocated", num_devices=self.settings["num_devices"],
            max_tasks=MAX_TASKS, max_restarts=-1, shares_devices=True)
        return dataclasses.replace(self.where, processes=self.group_processes)

    def _group_process_bytes(self) -> list[dict[str, Any]]:
        """Each device group's process: its pid, the roles it holds and its device bytes (live arrays)."""
        import ray

        out = []
        for process in {id(h): h for h in self.group_processes.values()}.values():
            try:
                out.append(ray.get(process.held.remote(), timeout=30))
            except Exception as err:  # noqa: BLE001 - a process restarting or gone: said, not raised
                out.append({"error": f"{type(err).__name__}: {err}".splitlines()[0]})
        return out

    # ---- what clients call ---------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        return {"settings": self.settings, "resource": self.resource, "devices": self.devices}

    def submit(self, request_id: str, cfg: ExperimentConfig, resume: bool = False,
               origin: dict[str, Any] | None = None) -> dict[str, Any]:
        """Queue every task of `cfg` (validated by the client against `info()["settings"]`, paths absolute);
        returns {"tasks": [names], "notes": [lines for the user]} or {"error": message}. `origin`: the config
        files, overrides and working directory it came from (kept for `resume`). A repeated request id returns
        the first answer."""
        from rlsched.config.meshes import check_platform

        with self._lock:
            if request_id in self._requests:
                return self._requests[request_id]
            if self._closing.is_set():
                return {"error": "the scheduler is shutting down (`rlsched down` is in progress)"}
            live = [t.name for t in cfg.tasks if t.name in self.tasks and self.tasks[t.name].state not in TERMINAL]
            if live:
                answer = {"error": f"task(s) {', '.join(live)} already submitted and not ended; a task's name is its "
                                   "id in the service: cancel it, or rename the new one (tasks.N.name)"}
                return self._requests.setdefault(request_id, answer)
            kept = self._kept_error(cfg, resume)
            if kept is not None:
                return self._requests.setdefault(request_id, {"error": kept})
            if self.resource == "TPU" and self.processes == "per_role":
                return {"error": "the scheduler service runs a process per role (rlsched up --processes per_role), "
                                 "and tasks of different submissions would open the same TPU chips from several "
                                 "processes (a chip opens in one); start it with --processes per_device_group"}
            try:
                check_platform(self.resource, cfg, self.processes)
                check_task_dirs(cfg, resume=resume)
                self._hold_dir(cfg.run_dir)  # a `rlsched train` writing there is refused, and refused in turn
            except (ConfigError, ValueError) as err:
                return self._requests.setdefault(request_id, {"error": str(err)})
            if not (cfg.run_dir / "config.yaml").exists():  # the experiment's first submission writes it
                write_atomic(cfg.run_dir / "config.yaml", dump_resolved(cfg))
            notes = resume_notes(cfg) if resume else []
            given = Given.of(cfg, **(origin or {}))
            for task in cfg.tasks:
                self.tasks.pop(task.name, None)  # an ended task of that name: the new one replaces its record
                self._lines[task.name] = TailLines(self.limits["lines"])
                self.given[task.name] = given
            self._queue(request_id, cfg, [t.name for t in cfg.tasks], resume=resume)
            answer = self._requests[request_id] = {"tasks": [t.name for t in cfg.tasks], "notes": notes}
            self._admit()
            self._save()
            return answer

    def resume(self, request_id: str, task: str, fresh: bool = False) -> dict[str, Any]:
        """Continue a CANCELLED or FAILED task from its last checkpoint, with the config, overrides and run directory
        it was submitted with (whoever asks, from wherever). No checkpoint: refused, unless `fresh` (then it starts
        again from step 0). Returns {"task", "after_step", "checkpoint_dir", "run_dir", "given"} or {"error"}."""
        with self._lock:
            if request_id in self._requests:
                return self._requests[request_id]
            if self._closing.is_set():
                return {"error": "the scheduler is shutting down (`rlsched down` is in progress)"}
            if task not in self.tasks:
                return {"error": self._unknown(task)}
            error = self._not_resumable(task)
            if error is None:
                given = self.given[task]
                try:
                    cfg = given.config({k: self.settings[k] for k in SETTINGS_KEYS if k in self.settings})
                except ValueError as err:
                    error = f"task {task}'s config does not validate under this scheduler's settings: {err}"
            if error is not None:
                return self._requests.setdefault(request_id, {"error": error})
            try:
                self._hold_dir(cfg.run_dir)
            except ValueError as err:
                return self._requests.setdefault(request_id, {"error": str(err)})
            spec = next(s for s in cfg.task_specs() if s.name == task)
            step = last_checkpoint(spec.checkpoint_dir)
            if step is None and not fresh:
                error = (f"task {task} has no checkpoint to resume from (none in {spec.checkpoint_dir}); "
                         f"`rlsched resume {task} --fresh` runs it again from step 0")
                return self._requests.setdefault(request_id, {"error": error})
            self._say(task, f"[{task}] resumed by request: " + (f"continues after step {step}" if step is not None
                                                                else "no checkpoint, starts again from step 0"))
            self._queue(request_id, cfg, [task], resume=True)
            answer = self._requests[request_id] = {"task": task, "after_step": step, "steps": spec.config.steps,
                                                   "checkpoint_dir": str(spec.checkpoint_dir),
                                                   "run_dir": str(cfg.run_dir), "given": given.describe()}
            self._admit()
            self._save()
            return answer

    def forget(self, request_id: str, task: str) -> dict[str, Any]:
        """Drop an ended task's record (and what it was submitted with); its files stay. A live one is refused."""
        with self._lock:
            if request_id in self._requests:
                return self._requests[request_id]
            if task not in self.tasks:
                return {"error": self._unknown(task)}
            record = self.tasks[task]
            if record.state not in TERMINAL:
                return {"error": f"task {task} is {record.state}: `rlsched cancel {task}` first, then forget it"}
            del self.tasks[task]
            self._lines.pop(task, None)
            self.given.pop(task, None)  # (its submission goes once its outputs are written: _complete)
            self._save()
            answer = {"task": task, "state": record.state, "run_dir": record.run_dir}
            return self._requests.setdefault(request_id, answer)

    def status(self) -> dict[str, Any]:
        """Every task's row (its phase and lock from one poll of its driver: status_rows), the device-group
        processes' and the pools' bytes, and the service's own health (`degraded`: the monitor's error, until it
        recovers). The scheduler's own view of the locks is `locks` (`rlsched locks`)."""
        with self._lock:
            rows = status_rows([t.row() for t in self.tasks.values()], time.time())
            degraded = None if self._degraded is None else dict(self._degraded)
        return {"tasks": rows, "settings": self.settings, "group_processes": self._group_process_bytes(),
                "used_bytes": self._used_bytes(), "budget_bytes": self._budget_bytes(), "degraded": degraded,
                "fenced_groups": self._fenced_groups()}

    def _fenced_groups(self) -> dict[str, Any]:
        """The device groups out of service (Scheduler.fenced_groups), or what kept the scheduler from saying."""
        import ray

        try:
            return ray.get(self.scheduler.fenced_groups.remote(), timeout=30)
        except Exception as err:  # noqa: BLE001 - shown, not raised: status must answer
            return {"error": f"{type(err).__name__}: {err}".splitlines()[0]}

    def sizes(self) -> dict[str, Any]:
        """How much the service keeps in memory, record by record (benchmarks/soak.py checks these stay flat),
        and its process id."""
        import os

        import ray

        with self._lock:
            records = {"tasks": len(self.tasks), "log lines": sum(t.kept for t in self._lines.values()),
                       "requests": len(self._requests), "submissions": len(self._subs),
                       "submission events": sum(len(s.events) for s in self._subs.values()),
                       "kept configs": len(self.given), "drivers": len(self._drivers), "run dirs held": len(self._dirs)}
        records |= ray.get(self.scheduler.sizes.remote(), timeout=30)
        return {"pid": os.getpid(), "records": records}

    def logs(self, task: str, offset: int = 0) -> dict[str, Any]:
        """The task's progress lines from `offset` on, and its state (a follower stops at a terminal one)."""
        with self._lock:
            if task not in self.tasks:
                return {"error": self._unknown(task)}
            kept = self._lines.get(task) or TailLines(self.limits["lines"])
            lines, skipped = kept.read(offset)
            if skipped:  # fell out of memory: all of them are in the run's run.log
                lines = [f"({skipped} earlier line(s): see {Path(self.tasks[task].run_dir) / 'run.log'})", *lines]
            return {"lines": lines, "next": len(kept), "state": self.tasks[task].state}

    def cancel(self, request_id: str, task: str) -> dict[str, Any]:
        """A RUNNING task stops at its next phase boundary after saving a checkpoint, then is CANCELLED; a
        PENDING one is CANCELLED at once. An ended task, or a repeated request, changes nothing."""
        with self._lock:
            if request_id in self._requests:
                return self._requests[request_id]
            if task not in self.tasks:
                return {"error": self._unknown(task)}
            record = self.tasks[task]
            if record.state in TERMINAL:
                answer = {"state": record.state, "note": f"task {task} had ended already ({record.state})"}
            elif record.state == PENDING:
                self._end(task, CANCELLED, "cancelled before it started")
                sub = self._subs.get(record.request)
                if sub is not None and self._ended(sub):  # the last of its submission: its outputs, then it goes
                    threading.Thread(target=self._complete, args=(record.request, sub), daemon=True).start()
                answer = {"state": CANCELLED}
            else:
                record.cancel_requested = True
                self._drivers[task].request_stop.remote()
                self._say(task, f"[{task}] cancel requested: it stops after its step in progress and saves it")
                answer = {"state": RUNNING, "note": "stops at its next phase boundary, after saving a checkpoint; "
                                                   f"`rlsched resume {task}` continues it"}
            self._save()
            return self._requests.setdefault(request_id, answer)

    def locks(self) -> dict[str, Any]:
        import ray

        return ray.get(self.scheduler.locks.remote(), timeout=30)

    def release(self, task: str) -> dict[str, Any]:
        """Force a stuck holder's lock free: the task is failed with that reason, its roles stopped first."""
        import ray

        with self._lock:
            if task not in self.tasks:
                return {"error": self._unknown(task)}
            if self.tasks[task].state != RUNNING:
                return {"error": f"task {task} is {self.tasks[task].state}: it holds no lock"}
        cause = "its lock was released by an operator (rlsched locks --release)"
        ray.get(self.scheduler.fail.remote(task, cause, fence=True), timeout=120)
        return {"released": task, "cause": cause}

    def shutdown(self, force: bool = False, timeout_s: float = 600.0) -> dict[str, Any]:
        """Graceful: PENDING tasks are cancelled, RUNNING ones stop after saving their step, and this waits
        for them; `force`: nothing waits (the caller then ends every process)."""
        with self._lock:
            self._closing.set()
            for name, record in self.tasks.items():
                if record.state == PENDING:
                    self._end(name, CANCELLED, "the scheduler was shut down before it started")
                elif record.state == RUNNING and not force:
                    record.cancel_requested = True
                    self._drivers[name].request_stop.remote()
            self._save()
        deadline = time.monotonic() + timeout_s
        while not force and time.monotonic() < deadline:
            with self._lock:
                if not any(t.state == RUNNING for t in self.tasks.values()):  # each one's end is recorded
                    break
            time.sleep(0.2)
        with self._lock:
            for name, record in self.tasks.items():
                if record.state == RUNNING:  # force, or it did not stop in time
                    self._end(name, FAILED, "the scheduler was shut down (rlsched down --force) while it ran; "
                                            f"`rlsched resume {name}` continues it from its last checkpoint")
            self._save()
            return {"tasks": {n: t.state for n, t in self.tasks.items()}}

    # ---- admission -------------------------------------------------------------------------------------

    def _needs(self, engine: int, actor: int) -> int:
        if self.settings.get("overcommit"):
            return 0  # evictions make room (the policy's admission), as `train` does
        if self.settings["placement"] == "colocated":
            return engine + actor
        return max(engine, actor)  # one pool each; the budget is per device of either group

    def _budget_bytes(self) -> int | None:
        budget = self.settings.get("memory_budget_gb")
        return None if budget is None else int(budget * GiB)

    def _used_bytes(self) -> int:
        running = [t for t in self.tasks.values() if t.state == RUNNING]
        return sum(t.needs_bytes for t in running) + sum(_bases_of(running).values())

    def _need_now(self, record: TaskRecord) -> int:
        """What admitting `record` adds: its own bytes, and each shared base no running task reads yet (a LoRA task's
        base group shares one copy, rlsched.config.plan.SharedBase)."""
        held = _bases_of([t for t in self.tasks.values() if t.state == RUNNING])
        return record.needs_bytes + sum(n for key, n in record.bases.items() if key not in held)

    def _admit(self) -> None:
        """Start pending tasks in submission order while they fit (the oldest that does not fit blocks the rest)."""
        budget = self._budget_bytes()
        fenced = self._fenced_groups().get(ray_cluster.GROUP)  # out of service: nothing starts there until it is back
        self._group_fenced = fenced is not None  # the monitor admits again each pass meanwhile (_tick)
        for name, record in list(self.tasks.items()):
            if record.state != PENDING:
                continue
            if fenced is not None:
                record.reason = f"device group {ray_cluster.GROUP} is out of service: {fenced['cause']}"
                continue
            used, need = self._used_bytes(), self._need_now(record)
            if budget is not None and used + need > budget:
                free = max(budget - used, 0)
                shown = (need, free, budget)  # one unit for the three, none of them reading 0.00
                record.reason = (f"needs {format_bytes(need, like=shown)} per device, "
                                 f"{format_bytes(free, like=shown)} free in group {ray_cluster.GROUP} "
                                 f"(memory budget {format_bytes(budget, like=shown)} per device)")
                return
            self._start(name)

    def _start(self, name: str) -> None:
        import dataclasses as dc

        import ray

        from rlsched.observe.progress import LineBuffer
        from rlsched.run.experiment import cobatches, estimate_bytes, shared_bytes, task_bases
        from rlsched.run.task import TaskDriver
        from rlsched.scheduling.scheduler import SchedulerLocks

        record = self.tasks[name]
        sub = self._subs[record.request]
        spec = next(s for s in sub.cfg.task_specs() if s.name == name)
        spec = dc.replace(spec, processes=self.processes, shares_devices=True)  # tasks come and go beside it
        task = spec.config
        admitted = self._need_now(record)
        try:
            bases = task_bases(sub.cfg, name, self.processes)
            # A shared base is the policy's to count, once, pinned while any task reads it (Policy.register); the
            # task's own bytes leave it out
            engine, actor = estimate_bytes(task, shared_bytes(bases, name))
            pinned = [(repr(b.key), role, b.nbytes) for b in bases for t, role in b.roles if t == name]
            # A LoRA task rolls out (and trains) together with waiting tasks of its base group, whichever submission
            # they came in
            cobatch = cobatches(sub.cfg, bases).get(name)
            moves = ray.get(self.scheduler.admit.remote(name, ray_cluster.GROUP, engine, actor, priority=task.priority,
                                                        weight=task.weight, cobatch=cobatch, bases=pinned), timeout=60)
        except Exception as err:  # noqa: BLE001 - the policy refused it: this task fails, nothing else
            self._end(name, FAILED, f"the scheduler refused it: {err}")
            return
        driver_cls = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)(TaskDriver)
        driver = driver_cls.remote(spec, SchedulerLocks(self.scheduler, name), sites=self.where,
                                   resume=sub.resume, initial_moves=moves, echo=LineBuffer())
        self.scheduler.watch.remote(name, [driver.lifeline.remote()])
        self.scheduler.register_driver.remote(name, driver)
        self._drivers[name] = driver
        self._runs[driver.run.remote()] = name
        record.state, record.reason, record.started_at = RUNNING, None, time.time()
        shared = " (its base is held once for its base group, already running)" if \
            record.bases and admitted == record.needs_bytes else ""
        self._say(name, f"[{name}] admitted: {format_bytes(admitted)} per device{shared}; starting its roles")

    # ---- the monitor -----------------------------------------------------------------------------------

    def _watch(self) -> None:
        """The monitor, supervised: a pass that raises is logged with its traceback (service.log), `status` shows
        the service as degraded with the cause, and the next pass comes after a pause that doubles up to 30 s;
        the first pass that succeeds clears it. Without this, one error would end the thread, and no task
        would ever be finished or admitted again while `status` still answered."""
        import traceback

        failures = 0
        while True:
            try:
                self._tick()
            except Exception as err:  # noqa: BLE001 - any error: logged, shown, and the loop goes on
                failures += 1
                cause = f"{type(err).__name__}: {err}".splitlines()[0]
                with self._lock:
                    since = self._degraded["since"] if self._degraded else time.time()
                    self._degraded = {"since": since, "cause": cause, "failures": failures}
                self._log(f"the monitor failed ({failures} in a row), retrying: {traceback.format_exc()}")
                time.sleep(min(30.0, 0.5 * 2**failures))
                continue
            if failures:
                with self._lock:
                    self._degraded = None
                self._log(f"the monitor recovered after {failures} failed pass(es)")
                failures = 0

    def _tick(self) -> None:
        """One pass of the monitor: poll the running drivers, finish the tasks that ended, admit pending ones,
        let go of run directories no live task uses."""
        import ray

        with self._lock:
            refs = list(self._runs)
        if refs:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0.5)
        else:
            done = []
            time.sleep(0.5)
        with self._lock:
            running = [n for ref, n in self._runs.items() if ref not in done]
        for name in running:
            self._poll(name)
        for ref in done:
            self._finish(ref)
        with self._lock:
            if (done or self._group_fenced) and not self._closing.is_set():
                self._admit()
            if done:
                self._save()
            self._release_idle_dirs()
        if time.monotonic() >= self._next_spool:
            self._spool_events()
            self._next_spool = time.monotonic() + self.limits["spool_s"]

    def _poll(self, name: str) -> dict[str, Any] | None:
        import ray

        try:
            poll = ray.get(self._drivers[name].poll.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, KeyError):
            return None
        with self._lock:
            record = self.tasks[name]
            for line in poll["lines"]:
                self._say(name, line)
            # phase and lock of one moment of the driver's (TaskDriver.poll), replaced together under our lock
            record.step, record.phase, record.lock, record.devices = (poll["step"], poll["phase"], poll.get("lock"),
                                                                      poll["roles"])
            record.driver_pid = poll.get("pid", record.driver_pid)
            record.reward = poll.get("reward", record.reward)
        return poll

    def _finish(self, ref) -> None:
        """A driver's run returned or raised: its state, its events, its driver ended, the submission's
        outputs written once all of its tasks have ended."""
        import ray

        from rlsched.run.experiment import _result

        with self._lock:
            name = self._runs.pop(ref)
            request = self.tasks[name].request
        last = self._poll(name)
        sub = self._subs[request]
        result = _result(name, ref, self.scheduler, sub.cfg)
        if last is not None:
            result["roles"] = last["roles"]
            if result["status"] == "ok" and last["state"] == "stopped":
                result.update(status="stopped", steps=last["step"])
        with contextlib.suppress(Exception):
            sub.events += ray.get(self._drivers[name].events.remote(), timeout=60)
        try:
            ray.get(self.scheduler.retire.remote(name), timeout=60)
            ray.get(self.scheduler.forget_task.remote(name), timeout=60)  # its cause is in `result` now
        except Exception as err:  # noqa: BLE001 - said, not raised: the task's own end is recorded all the same
            self._log(f"task {name}: the scheduler did not retire it ({type(err).__name__}: {err}); its memory may "
                      "still count as held until it is submitted again")
        with self._lock:
            ray.kill(self._drivers.pop(name))  # its roles go with it
            sub.results[name] = result
            record = self.tasks[name]
            if result["status"] == "ok":
                self._end(name, FINISHED, None)
                self.given.pop(name, None)  # a finished task is not resumed: its config need not be kept
            elif result["status"] == "stopped":
                self._end(name, CANCELLED, f"cancelled after step {result['steps']} (its checkpoint is saved; "
                                           f"`rlsched resume {name}` continues it)")
            else:
                self._end(name, FAILED, result["error"])
                self._say(name, f"[{name}] `rlsched resume {name}` continues it from its last checkpoint, as it was "
                                "submitted (once the cause is fixed)")
            del record  # (state set by _end)
            complete = self._ended(sub)
        if complete:  # outside the lock: drawing a long run's Gantt takes seconds, and status or cancel must not wait
            self._complete(request, sub)

    def _complete(self, request: str, sub: _Submission) -> None:
        """Every task of `sub` ended: its run's outputs are written (if any task of it ran), then it is dropped."""
        if sub.results:
            self._write_outputs(sub)
        with self._spooling, self._lock:  # a spool pass appends to live submissions' files only
            sub.spool.remove()
            self._subs.pop(request, None)  # nothing more is asked of it

    def _ended(self, sub: _Submission) -> bool:
        """Whether every task of `sub` has ended (those cancelled before they started included) and no driver of
        it is still being finished."""
        records = [self.tasks.get(n) for n in sub.tasks]
        return (all(r is None or r.state in TERMINAL for r in records)
                and not any(n in sub.tasks for n in self._runs.values()))

    def _write_outputs(self, sub: _Submission) -> None:
        import ray

        from rlsched.run.experiment import write_run_outputs

        def say(line: str) -> None:
            with self._lock:
                self._say(sub.tasks[0], line)

        try:  # the scheduler's events of this submission's time only (spooled, then those since), and its tasks'
            with self._spooling:  # not while a spool pass moves events out of the scheduler
                events = sub.spool.read() + list(ray.get(self.scheduler.events_since.remote(sub.spooled),
                                                         timeout=60))
            state = ray.get(self.scheduler.state.remote(), timeout=60)
            write_run_outputs(sub.cfg, events + sub.events, sub.results, state, echo=say)
        except Exception as err:  # noqa: BLE001 - the tasks' own files are written; say what is missing
            say(f"the run's timeline and summary were not written: {type(err).__name__}: {err}")
        with self._lock:
            live = [s.spooled for s in self._subs.values() if s is not sub]
        with contextlib.suppress(Exception):  # the events no live submission needs go
            ray.get(self.scheduler.forget_events_before.remote(min(live, default=time.time())), timeout=60)

    def _spool_events(self) -> None:
        """Move the scheduler's events that ended before the cut (SPOOL_MARGIN_S ago) to the spool of each live
        submission whose time they fall in, then let the scheduler forget them: its memory holds a few seconds of
        events, not the age of the oldest live submission (rlsched.service.spool)."""
        import ray

        with self._spooling:
            cut = time.time() - SPOOL_MARGIN_S
            with self._lock:
                live = [s for s in self._subs.values() if s.spooled < cut]
            if not live:
                return
            events = [e for e in ray.get(self.scheduler.events_since.remote(min(s.spooled for s in live)),
                                         timeout=60) if event_end(e) < cut]
            for sub in live:
                sub.spool.append(e for e in events if event_end(e) >= sub.spooled)
                sub.spooled = cut
            with self._lock:
                oldest = min((s.spooled for s in self._subs.values()), default=cut)
            ray.get(self.scheduler.forget_events_before.remote(oldest), timeout=60)

    # ---- records -------------------------------------------------------------------------------------

    def _queue(self, request_id: str, cfg: ExperimentConfig, names: list[str], *, resume: bool) -> None:
        """PENDING records for the tasks `names` of `cfg`, last in submission order (an ended record of the same
        name is replaced; its log lines stay), and the submission they start from."""
        from rlsched.run.experiment import estimate_bytes, shared_bytes

        for task in (t for t in cfg.tasks if t.name in names):
            counted = self._bases(cfg, task.name)
            engine, actor = estimate_bytes(task, shared_bytes(counted, task.name))
            bases = {repr(b.key): b.nbytes for b in counted}
            self.tasks.pop(task.name, None)
            self.tasks[task.name] = TaskRecord(task.name, cfg.experiment.name, request_id, str(cfg.run_dir),
                                               task.steps, priority=task.priority, weight=task.weight,
                                               needs_bytes=self._needs(engine, actor), bases=bases)
            self._lines.setdefault(task.name, TailLines(self.limits["lines"]))
            self._say(task.name, f"[{task.name}] submitted ({cfg.experiment.name}, {task.steps} steps"
                                 + (", resuming from its last checkpoint" if resume else "") + ")")
        self._subs[request_id] = _Submission(cfg, resume, list(names),
                                             spool=EventSpool(self.state_dir / "spool" / f"{request_id}.jsonl"))

    def _bases(self, cfg: ExperimentConfig, name: str) -> list:
        """The shared bases a LoRA task reads in this service's device group's process, counted once per base group
        for the service's own admission. Colocated and without --overcommit only: with --overcommit the scheduler's
        policy admits (it pins each base once, Policy.register); disaggregated, each task counts its own copy here
        (more than it holds, never less)."""
        from rlsched.run.experiment import task_bases

        if self.settings["placement"] != "colocated" or self.settings.get("overcommit"):
            return []
        return task_bases(cfg, name, self.processes)

    def _kept_error(self, cfg: ExperimentConfig, resume: bool) -> str | None:
        """Why a submission may not take the name of a CANCELLED or FAILED task (kept for `rlsched resume` until
        forgotten): it is new, or it would `--resume` another run directory than the kept task's."""
        for task in cfg.tasks:
            record = self.tasks.get(task.name)
            if record is None or record.state not in (CANCELLED, FAILED):
                continue
            kept = f"task {task.name} is {record.state} after step {record.step} in {record.run_dir}"
            if not resume:
                return (f"{kept}, kept until `rlsched forget {task.name}`: `rlsched resume {task.name}` continues it "
                        f"(as `submit ... --resume` from its directory does); forget it first to submit a new one")
            if record.run_dir != str(cfg.run_dir):
                return (f"{kept}, but this --resume would continue the run in {cfg.run_dir}: `rlsched resume "
                        f"{task.name}` continues the {record.state.lower()} one as it was submitted; "
                        f"`rlsched forget {task.name}` first to resume the other")
        return None

    def _not_resumable(self, task: str) -> str | None:
        """Why `resume` refuses the task (one line), or None."""
        record = self.tasks[task]
        if record.state in (PENDING, RUNNING):
            return f"task {task} is {record.state}: there is nothing to resume (`rlsched cancel {task}` stops it)"
        if record.state == FINISHED:
            return (f"task {task} is FINISHED (step {record.step} of {record.steps}): there is nothing to resume; "
                    f"`rlsched forget {task}` drops its record")
        if task not in self.given:
            return (f"task {task} was submitted to a scheduler that kept no config for it: submit it again from its "
                    "directory with `rlsched submit CONFIG ... --resume`")
        return None

    def _end(self, name: str, state: str, reason: str | None) -> None:
        record = self.tasks[name]
        record.state, record.reason, record.ended_at, record.phase, record.lock = state, reason, time.time(), None, None
        self._say(name, f"[{name}] {state}" + (f": {reason}" if reason else ""))
        if state == FINISHED:
            self._retire_old_finished()

    def _retire_old_finished(self) -> None:
        """Keep the newest limits["finished"] finished tasks in `status`; older ones move to `history.jsonl` in the
        state directory, one row each (a service that ran thousands of tasks keeps no more of them in memory).
        CANCELLED and FAILED tasks stay until forgotten: they may be resumed."""
        finished = sorted((t for t in self.tasks.values() if t.state == FINISHED), key=lambda t: t.ended_at or 0)
        old = finished[:max(len(finished) - self.limits["finished"], 0)]
        if not old:
            return
        with open(self.state_dir / "history.jsonl", "a", encoding="utf-8") as f:
            f.writelines(json.dumps(t.row()) + "\n" for t in old)
        for record in old:
            del self.tasks[record.name]
            self._lines.pop(record.name, None)

    def _hold_dir(self, run_dir: Path) -> None:
        """This service holds `run_dir`'s lock (rlsched.rundir.lock) while a task of it may write there: a `rlsched
        train` on it is refused, and one that holds it refuses this submission (RunDirLocked)."""
        key = str(run_dir)
        if key not in self._dirs:
            self._dirs[key] = RunLock(run_dir, echo=lambda line: self._log(line), command="rlsched up (the scheduler "
                                      "service)", stop="`rlsched cancel TASK` for its tasks there").acquire()

    def _release_idle_dirs(self) -> None:
        """Let go of the run directories no live task and no submission awaiting its outputs uses."""
        used = {t.run_dir for t in self.tasks.values() if t.state not in TERMINAL}
        used |= {str(s.cfg.run_dir) for s in self._subs.values()}
        for key in [k for k in self._dirs if k not in used]:
            self._dirs.pop(key).release()

    def _log(self, line: str) -> None:
        """A line of the service's own (not a task's) in service.log, timed."""
        with contextlib.suppress(OSError), open(self.state_dir / "service.log", "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} service: {line}\n")

    def _say(self, name: str, line: str) -> None:
        """A task's line: kept for `logs`, and appended, timed, to its experiment's run.log."""
        if name in self.tasks:  # a task forgotten meanwhile keeps no lines (its run.log has them)
            self._lines.setdefault(name, TailLines(self.limits["lines"])).append(line)
        record = self.tasks.get(name)
        if record is not None:
            with contextlib.suppress(OSError), open(Path(record.run_dir) / "run.log", "a", encoding="utf-8") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")

    def _unknown(self, task: str) -> str:
        known = ", ".join(self.tasks) or "none yet"
        return f"no task {task!r} in this scheduler (tasks: {known}); `rlsched status` lists them"

    def _save(self) -> None:
        write_atomic(self.state_dir / "tasks.json",
                     json.dumps({"tasks": [t.row() for t in self.tasks.values()],
                                 "given": {name: g.row() for name, g in self.given.items()}}, indent=1) + "\n")

    def _load_previous(self) -> None:
        """The records of a service that died: what was PENDING or RUNNING then is FAILED now, with why."""
        path = self.state_dir / "tasks.json"
        if not path.exists():
            return
        fields = {f.name for f in dataclasses.fields(TaskRecord)}
        saved = json.loads(path.read_text())
        self.given = {name: Given.from_row(row) for name, row in saved.get("given", {}).items()}  # older: none
        for row in saved["tasks"]:
            record = TaskRecord(**{k: v for k, v in row.items() if k in fields})
            self.tasks[record.name] = record
            self._lines[record.name] = TailLines(self.limits["lines"])
            if record.state not in TERMINAL:
                self._end(record.name, FAILED, f"the scheduler service stopped while the task was {record.state} "
                                               f"(its process died); `rlsched resume {record.name}` continues it "
                                               "from its last checkpoint")


def check_task_dirs(cfg: ExperimentConfig, *, resume: bool) -> None:
    """Tasks of one experiment may be submitted apart (`--tasks`), so a run is refused per task: one whose
    directory holds a run needs `--resume` (RunDirError otherwise)."""
    if resume:
        return
    held = [t.name for t in cfg.tasks if task_dir(cfg.run_dir, t.name).exists()]
    if held:
        raise RunDirError(f"{cfg.run_dir} already holds a run of task(s) {', '.join(held)}; pass --resume to continue, "
                          "or choose another name with --set experiment.name=...")


def status_rows(records: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """`status`'s rows from the tasks' records (TaskRecord.row()), each row's "lock" as text: 'holds g0/train 3.2s'
    or 'waits for g0/rollout 1.0s' (seconds to `now`, unix). Both PHASE and LOCK come from the record's `phase`
    and `lock`, which one poll of the driver set together: read from two sources (the scheduler's locks and the
    last poll, up to 0.5 s apart), they contradicted each other in about half the samples of a run of short
    steps."""
    rows = []
    for record in records:
        lock, text = record.get("lock"), None
        if lock is not None:
            where = lock["resource"] or lock["phase"]  # the resource is named once a grant has named it
            seconds = max(now - lock["since"], 0.0)
            text = f"{'holds' if lock['holds'] else 'waits for'} {where} {seconds:.1f}s"
        rows.append({**record, "lock": text})
    return rows


def _bases_of(records) -> dict[str, int]:
    """The shared bases the tasks of `records` read, each once: {key: bytes per device}."""
    return {key: n for record in records for key, n in record.bases.items()}
