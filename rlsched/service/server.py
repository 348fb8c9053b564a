"""The long-lived scheduler: tasks are submitted, admitted, run, cancelled and reported while it lives.

    rlsched up                       rlsched.service.daemon starts Ray and this actor ("service", namespace "rlsched")
    service.submit.remote(request_id, cfg, resume=False, origin)    -> {"tasks": ["addition", ...], "notes": [...]}
    service.status.remote() / logs.remote(task, offset) / cancel.remote(request_id, task) / locks.remote()
    service.resume.remote(request_id, task, fresh=False) / forget.remote(request_id, task)

A submission is one validated experiment config (rlsched.config.schema) whose paths are absolute: its tasks run
exactly as `rlsched train` runs them (a TaskDriver actor per task over the scheduler's locks, roles in the
service's device group, outputs in the config's runs/<experiment>/), except that they arrive and leave
while others run.

Its parts, one file each: the task records and the files that keep them (rlsched.service.records), admission by
memory (rlsched.service.admission), the live submissions and their drivers (rlsched.service.runs), the monitor's
supervised loop (rlsched.service.monitor); this file holds the actor: what clients call, and the monitor's pass.

Design decisions (and why):
- **One scheduler, one device group, for the service's life.** The Scheduler actor and its pure Policy are
  made once; an arriving task is registered with them (`Scheduler.admit`) and a task that ended is retired,
  so its name can be resumed or submitted again. The service's cluster settings (devices,
  placement, budget, policy) are fixed by `rlsched up`; `submit` validates a config against them.
- **Requests carry ids.** A submit or cancel repeated with the same id (a client that timed out and tried
  again) returns the first answer and changes nothing.
- **Threads, not asyncio.** A monitor thread polls the drivers (their progress lines and rows, as the
  `train` command does), finishes the tasks that ended and admits pending ones; calls from clients take
  other threads of the actor and share its state under one lock.
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from rlsched.cluster import ray_cluster
from rlsched.config.loading import dump_resolved
from rlsched.config.schema import ConfigError, ExperimentConfig
from rlsched.rundir.files import write_atomic
from rlsched.rundir.lock import RunLock
from rlsched.service.admission import Admission, GiB, check_task_dirs
from rlsched.service.bounded import RecentAnswers, TailLines
from rlsched.service.monitor import Monitor
from rlsched.service.records import (
    CANCELLED,
    FAILED,
    FINISHED,
    PENDING,
    RUNNING,
    TERMINAL,
    TaskBook,
    TaskRecord,
    status_rows,
)
from rlsched.service.runs import Runs
from rlsched.service.spool import SPOOL_EVERY_S
from rlsched.service.submissions import Given, last_checkpoint, resume_notes

__all__ = ["CANCELLED", "FAILED", "FINISHED", "LIMITS", "NAME", "NAMESPACE", "PENDING", "RUNNING", "SETTINGS_KEYS",
           "TERMINAL", "Service", "TaskRecord", "check_task_dirs", "status_rows"]

NAME, NAMESPACE = "service", "rlsched"  # the actor's name and Ray namespace

# What `rlsched up` fixes for every task the service runs: the config keys `submit` sets from it.
SETTINGS_KEYS = ("num_devices", "placement", "memory_budget_gb", "policy", "starvation_limit", "lease_timeout_s",
                 "processes")
# Bounds of what the service keeps in memory (it lives for weeks; rlsched.service.bounded); settings["limits"] may lower
# them (benchmarks/soak.py does, to reach them within a short soak).
LIMITS = {
    "requests": 1000,  # request ids answered, for a client that retries (within minutes)
    "lines": 1000,  # lines per task for `rlsched logs` (all of them are in the run's run.log)
    "finished": 100,  # finished tasks shown in `status`; older ones are in <state dir>/history.jsonl
    "unfinished": 100,  # cancelled and failed tasks shown in `status`; older ones: history.jsonl, still resumable
    "grants": 1000,  # the scheduler's log of its last grants
    "spool_s": SPOOL_EVERY_S,  # seconds between moves of the scheduler's events to live submissions' spools
}
MAX_TASKS = 16  # tasks a device group's process has threads for at once (4 each); more tasks' calls wait for one


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
        self.book = TaskBook(self.state_dir, self.limits)  # every task's record, lines and config
        self.admission = Admission(self.settings)
        self._requests = RecentAnswers(self.limits["requests"])  # request id -> its answer
        self._dirs: dict[str, RunLock] = {}  # run directory -> the lock this service holds on it (rlsched.rundir.lock)
        self._closing = threading.Event()
        self._group_fenced = False  # the device group was out of service at the last admission (fenced_groups)
        self.book.load_previous()
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
        self.runs = Runs(self.book, self.scheduler, self._lock, state_dir=self.state_dir, where=self.where,
                         processes=self.processes)
        self._next_spool = time.monotonic() + self.limits["spool_s"]
        self._remove_old_spool()
        self.book.save()
        self.monitor = Monitor(self._tick, log=self.book.log, lock=self._lock)
        self.monitor.start()

    def _remove_old_spool(self) -> None:
        """A dead service's spool files go: its runs' timelines are gone with it. What cannot be removed is said."""
        left: list[str] = []
        spool = self.state_dir / "spool"
        if spool.exists():
            shutil.rmtree(spool, onerror=lambda _, path, info: left.append(f"{path} ({info[1]})"))
        if left:
            self.book.log(f"a dead service's spool was not removed whole: {len(left)} path(s) left, the first "
                          f"{left[0]}")

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

    def _watchdog_health(self) -> dict[str, Any] | None:
        """The scheduler's lease watchdog while its passes fail (Scheduler.health), or None; a scheduler that does not
        answer is failing too."""
        import ray

        log = "the Scheduler actor's worker log (Ray's session logs)"
        try:
            failing = ray.get(self.scheduler.health.remote(), timeout=30)["watchdog"]
        except Exception as err:  # noqa: BLE001 - shown in `status`, not raised
            cause = f"the scheduler did not answer: {type(err).__name__}: {err}".splitlines()[0]
            return {"since": None, "cause": cause, "failures": None, "log": log}
        return None if failing is None else {**failing, "log": log}

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
            tasks = self.book.tasks
            live = [t.name for t in cfg.tasks if t.name in tasks and tasks[t.name].state not in TERMINAL]
            if live:
                answer = {"error": f"task(s) {', '.join(live)} already submitted and not ended; a task's name is its "
                                   "id in the service: cancel it, or rename the new one (tasks.N.name)"}
                return self._requests.setdefault(request_id, answer)
            kept = self.book.kept_error(cfg, resume)
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
                self.book.tasks.pop(task.name, None)  # an ended task of that name: the new one replaces its record
                self.book.lines[task.name] = TailLines(self.limits["lines"])
                self.book.given[task.name] = given
            self._queue(request_id, cfg, [t.name for t in cfg.tasks], resume=resume)
            answer = self._requests[request_id] = {"tasks": [t.name for t in cfg.tasks], "notes": notes}
            self._admit()
            self.book.save()
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
            record, given = self.book.tasks.get(task), self.book.given.get(task)
            if record is None:  # summarised into history.jsonl (records.TaskBook.retire_old), or never known
                record, given = self.book.summarised(task) or (None, None)
            if record is None:
                return {"error": self.book.unknown(task)}
            error = self.book.not_resumable(record, given)
            if error is None:
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
            if task not in self.book.tasks:  # back from history: its record and config, until it ends again
                self.book.tasks[task], self.book.given[task] = record, given
            self.book.say(task, f"[{task}] resumed by request: " + (f"continues after step {step}" if step is not None
                                                                     else "no checkpoint, starts again from step 0"))
            self._queue(request_id, cfg, [task], resume=True)
            answer = self._requests[request_id] = {"task": task, "after_step": step, "steps": spec.config.steps,
                                                   "checkpoint_dir": str(spec.checkpoint_dir),
                                                   "run_dir": str(cfg.run_dir), "given": given.describe()}
            self._admit()
            self.book.save()
            return answer

    def forget(self, request_id: str, task: str) -> dict[str, Any]:
        """Drop an ended task's record (and what it was submitted with), in memory or summarised in history.jsonl;
        its files stay. A live one is refused."""
        with self._lock:
            if request_id in self._requests:
                return self._requests[request_id]
            if task not in self.book.tasks:  # summarised into history.jsonl, or never known
                record = self.book.forget_summarised(task)
                if record is None:
                    return {"error": self.book.unknown(task)}
                answer = {"task": task, "state": record.state, "run_dir": record.run_dir}
                return self._requests.setdefault(request_id, answer)
            record = self.book.tasks[task]
            if record.state not in TERMINAL:
                return {"error": f"task {task} is {record.state}: `rlsched cancel {task}` first, then forget it"}
            del self.book.tasks[task]
            self.book.lines.pop(task, None)
            self.book.given.pop(task, None)  # (its submission goes once its outputs are written: _complete)
            self.book.forget_summarised(task)  # an earlier run of the name, summarised: `resume` must not find it
            self.book.save()
            answer = {"task": task, "state": record.state, "run_dir": record.run_dir}
            return self._requests.setdefault(request_id, answer)

    def status(self) -> dict[str, Any]:
        """Every task's row (its phase and lock from one poll of its driver: status_rows), the device-group
        processes' and the pools' bytes, and the service's own health (`degraded`: {part: {"since", "cause",
        "failures", "log"}} for each part failing now, the monitor and the scheduler's lease watchdog, or None). The
        scheduler's own view of the locks is `locks` (`rlsched locks`)."""
        with self._lock:
            rows = status_rows([t.row() for t in self.book.tasks.values()], time.time())
            monitor = None if self.monitor.degraded is None else {**self.monitor.degraded, "log": "service.log"}
        parts = {"monitor": monitor, "lease watchdog": self._watchdog_health()}
        degraded = {part: failing for part, failing in parts.items() if failing is not None} or None
        return {"tasks": rows, "settings": self.settings, "group_processes": self._group_process_bytes(),
                "used_bytes": self.admission.used_bytes(self.book.tasks), "budget_bytes": self.admission.budget_bytes(),
                "degraded": degraded, "fenced_groups": self._fenced_groups()}

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
            records = {"tasks": len(self.book.tasks), "log lines": sum(t.kept for t in self.book.lines.values()),
                       "requests": len(self._requests), "submissions": len(self.runs.subs),
                       "submission events": sum(len(s.events) for s in self.runs.subs.values()),
                       "kept configs": len(self.book.given), "drivers": len(self.runs.drivers),
                       "run dirs held": len(self._dirs)}
        records |= ray.get(self.scheduler.sizes.remote(), timeout=30)
        return {"pid": os.getpid(), "records": records}

    def logs(self, task: str, offset: int = 0) -> dict[str, Any]:
        """The task's progress lines from `offset` on, and its state (a follower stops at a terminal one)."""
        with self._lock:
            if task not in self.book.tasks:
                return {"error": self.book.unknown(task)}
            kept = self.book.lines.get(task) or TailLines(self.limits["lines"])
            lines, skipped = kept.read(offset)
            if skipped:  # fell out of memory: all of them are in the run's run.log
                lines = [f"({skipped} earlier line(s): see {Path(self.book.tasks[task].run_dir) / 'run.log'})", *lines]
            return {"lines": lines, "next": len(kept), "state": self.book.tasks[task].state}

    def cancel(self, request_id: str, task: str) -> dict[str, Any]:
        """A RUNNING task stops at its next phase boundary after saving a checkpoint, then is CANCELLED; a
        PENDING one is CANCELLED at once. An ended task, or a repeated request, changes nothing."""
        with self._lock:
            if request_id in self._requests:
                return self._requests[request_id]
            if task not in self.book.tasks:
                return {"error": self.book.unknown(task)}
            record = self.book.tasks[task]
            if record.state in TERMINAL:
                answer = {"state": record.state, "note": f"task {task} had ended already ({record.state})"}
            elif record.state == PENDING:
                self.book.end(task, CANCELLED, "cancelled before it started")
                sub = self.runs.subs.get(record.request)
                if sub is not None and self.runs.ended(sub):  # the last of its submission: its outputs, then it goes
                    self.runs.complete_later(record.request, sub)
                answer = {"state": CANCELLED}
            else:
                record.cancel_requested = True
                self.runs.drivers[task].request_stop.remote()
                self.book.say(task, f"[{task}] cancel requested: it stops after its step in progress and saves it")
                answer = {"state": RUNNING, "note": "stops at its next phase boundary, after saving a checkpoint; "
                                                   f"`rlsched resume {task}` continues it"}
            self.book.save()
            return self._requests.setdefault(request_id, answer)

    def locks(self) -> dict[str, Any]:
        import ray

        return ray.get(self.scheduler.locks.remote(), timeout=30)

    def release(self, task: str) -> dict[str, Any]:
        """Force a stuck holder's lock free: the task is failed with that reason, its roles stopped first."""
        import ray

        with self._lock:
            if task not in self.book.tasks:
                return {"error": self.book.unknown(task)}
            if self.book.tasks[task].state != RUNNING:
                return {"error": f"task {task} is {self.book.tasks[task].state}: it holds no lock"}
        cause = "its lock was released by an operator (rlsched locks --release)"
        ray.get(self.scheduler.fail.remote(task, cause, fence=True), timeout=120)
        return {"released": task, "cause": cause}

    def shutdown(self, force: bool = False, timeout_s: float = 600.0) -> dict[str, Any]:
        """Graceful: PENDING tasks are cancelled, RUNNING ones stop after saving their step, and this waits
        for them; `force`: nothing waits (the caller then ends every process)."""
        with self._lock:
            self._closing.set()
            for name, record in list(self.book.tasks.items()):  # end() may move older records to history
                if record.state == PENDING:
                    self.book.end(name, CANCELLED, "the scheduler was shut down before it started")
                elif record.state == RUNNING and not force:
                    record.cancel_requested = True
                    self.runs.drivers[name].request_stop.remote()
            self.book.save()
        deadline = time.monotonic() + timeout_s
        while not force and time.monotonic() < deadline:
            with self._lock:
                if not any(t.state == RUNNING for t in self.book.tasks.values()):  # each one's end is recorded
                    break
            time.sleep(0.2)
        if not force:  # the runs' outputs (timeline, summary) of the tasks that ended: written before the service goes
            due = self.runs.settle(max(0.0, deadline - time.monotonic()))
            if due:
                self.book.log(f"shutdown: {due} run(s) had not written their outputs in time; they are missing")
        with self._lock:
            for name, record in list(self.book.tasks.items()):
                if record.state == RUNNING:  # force, or it did not stop in time
                    self.book.end(name, FAILED, "the scheduler was shut down (rlsched down --force) while it ran; "
                                            f"`rlsched resume {name}` continues it from its last checkpoint")
            self.book.save()
            return {"tasks": {n: t.state for n, t in self.book.tasks.items()}}

    # ---- admission -------------------------------------------------------------------------------------

    def _queue(self, request_id: str, cfg: ExperimentConfig, names: list[str], *, resume: bool) -> None:
        """PENDING records for the tasks `names` of `cfg`, last in submission order (an ended record of the same
        name is replaced; its log lines stay), and the submission they start from."""
        from rlsched.run.experiment import estimate_bytes, shared_bytes

        for task in (t for t in cfg.tasks if t.name in names):
            counted = self._bases(cfg, task.name)
            engine, actor = estimate_bytes(task, shared_bytes(counted, task.name))
            bases = {repr(b.key): b.nbytes for b in counted}
            self.book.tasks.pop(task.name, None)
            self.book.tasks[task.name] = TaskRecord(task.name, cfg.experiment.name, request_id, str(cfg.run_dir),
                                                    task.steps, priority=task.priority, weight=task.weight,
                                                    needs_bytes=self.admission.needs(engine, actor), bases=bases)
            self.book.lines.setdefault(task.name, TailLines(self.limits["lines"]))
            self.book.say(task.name, f"[{task.name}] submitted ({cfg.experiment.name}, {task.steps} steps"
                                     + (", resuming from its last checkpoint" if resume else "") + ")")
        self.runs.add(request_id, cfg, names, resume=resume)

    def _bases(self, cfg: ExperimentConfig, name: str) -> list:
        """The shared bases a LoRA task reads in this service's device group's process, counted once per base group
        for the service's own admission. Colocated and without --overcommit only: with --overcommit the scheduler's
        policy admits (it pins each base once, Policy.register); disaggregated, each task counts its own copy here
        (more than it holds, never less)."""
        from rlsched.run.experiment import task_bases

        if self.settings["placement"] != "colocated" or self.settings.get("overcommit"):
            return []
        return task_bases(cfg, name, self.processes)

    def _admit(self) -> None:
        """Start pending tasks in submission order while they fit (rlsched.service.admission); none while the device
        group is out of service (fenced_groups), and the monitor admits again each pass meanwhile (_tick)."""
        fenced = self._fenced_groups().get(ray_cluster.GROUP)
        self._group_fenced = fenced is not None
        if fenced is not None:
            for record in self.book.tasks.values():
                if record.state == PENDING:
                    record.reason = f"device group {ray_cluster.GROUP} is out of service: {fenced['cause']}"
            return
        for name in self.admission.startable(self.book.tasks):
            self.runs.start(name, self.admission.need_now(self.book.tasks[name], self.book.tasks))

    # ---- the monitor's pass ----------------------------------------------------------------------------

    def _tick(self) -> None:
        """One pass of the monitor (rlsched.service.monitor): poll the running drivers, finish the tasks that ended,
        admit pending ones, let go of run directories no live task uses."""
        import ray

        with self._lock:
            refs = list(self.runs.refs)
        if refs:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0.5)
        else:
            done = []
            time.sleep(0.5)
        with self._lock:
            running = [n for ref, n in self.runs.refs.items() if ref not in done]
        for name in running:
            self.runs.poll(name)
        for ref in done:
            self.runs.finish(ref)
        with self._lock:
            if (done or self._group_fenced) and not self._closing.is_set():
                self._admit()
            if done:
                self.book.save()
            self._release_idle_dirs()
        if time.monotonic() >= self._next_spool:
            self.runs.spool_events()
            self._next_spool = time.monotonic() + self.limits["spool_s"]

    # ---- run directories -------------------------------------------------------------------------------

    def _hold_dir(self, run_dir: Path) -> None:
        """This service holds `run_dir`'s lock (rlsched.rundir.lock) while a task of it may write there: a `rlsched
        train` on it is refused, and one that holds it refuses this submission (RunDirLocked)."""
        key = str(run_dir)
        if key not in self._dirs:
            self._dirs[key] = RunLock(run_dir, echo=lambda line: self.book.log(line), command="rlsched up (the "
                                      "scheduler service)", stop="`rlsched cancel TASK` for its tasks there").acquire()

    def _release_idle_dirs(self) -> None:
        """Let go of the run directories no live task and no submission awaiting its outputs uses."""
        used = {t.run_dir for t in self.book.tasks.values() if t.state not in TERMINAL}
        used |= {str(s.cfg.run_dir) for s in self.runs.subs.values()}
        for key in [k for k in self._dirs if k not in used]:
            self._dirs.pop(key).release()
