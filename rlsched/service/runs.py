"""The service's live submissions and the drivers of their running tasks: a task admitted is started (a TaskDriver
actor over the scheduler's locks, as `rlsched train` runs it), polled, and finished when its run returns; a
submission whose tasks have all ended writes its run's outputs (timeline, summary) and goes.

    runs = Runs(book, scheduler, lock, state_dir=..., where=..., processes=...)
    runs.add(request_id, cfg, names, resume=False)   # the submission its tasks start from
    runs.start(name, admitted_bytes)                 # RUNNING; its driver's run is in runs.refs
    runs.poll(name); runs.finish(ref)                # the monitor's pass (rlsched.service.server._tick)
    runs.settle(timeout_s)                           # the outputs being written, done (a graceful shutdown)

Design decisions (and why):
- **A long submission does not grow the service.** A run's timeline holds every scheduler event of its time, so
  the scheduler kept all events since the oldest live submission began: a task training for a week kept a week of
  every task's events in memory. The monitor moves the events older than a few seconds to each live submission's
  spool file every `spool_s` (rlsched.service.spool); the run's outputs read it back when its last task ends.
- **Outputs are written beside the monitor, not on it.** Writing a long run's timeline and drawing its Gantt takes
  seconds; on the monitor's thread it held up the pass that admits the tasks waiting for what the run freed and
  reads the other tasks' progress. The service's writer thread writes them (`complete_later`), and a graceful shutdown
  waits for it (`settle`): before, `down` returned once its tasks had ended, and the service ended while
  the monitor still wrote the outputs of the runs it had stopped (they were lost).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import queue
import threading
import time
from pathlib import Path
from typing import Any

from rlsched.base.units import format_bytes
from rlsched.cluster import ray_cluster
from rlsched.config.schema import ExperimentConfig
from rlsched.observe.timeline import event_end
from rlsched.service.records import CANCELLED, FAILED, FINISHED, RUNNING, TERMINAL, TaskBook
from rlsched.service.spool import SPOOL_MARGIN_S, EventSpool


@dataclasses.dataclass
class Submission:
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


@functools.cache
def _driver_class():
    """The Ray actor class of a task's driver, made once per process. Why: each `ray.remote(TaskDriver)` is a class of
    its own to Ray (its descriptor holds a random hash), and Ray keeps the methods and signatures it reads from each
    for the process's life (ray.actor._ActorClassMethodMetadata's cache): ~33 KiB per task started, measured, for
    as long as the service lives."""
    import ray

    from rlsched.run.task import TaskDriver

    return ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)(TaskDriver)


class Runs:
    """The live submissions, their running tasks' drivers, and the scheduler's events of their time (see the module
    docstring). Shares the service's lock and task records."""

    def __init__(self, book: TaskBook, scheduler, lock: threading.RLock, *, state_dir: Path, where, processes: str):
        self.book = book
        self.scheduler = scheduler
        self._lock = lock
        self.state_dir = Path(state_dir)
        self.where = where  # rlsched.cluster.ray_cluster.role_sites of the service's device group
        self.processes = processes
        self.subs: dict[str, Submission] = {}  # request id -> a submission not yet complete
        self.drivers: dict[str, Any] = {}  # running task -> driver handle
        self.refs: dict[Any, str] = {}  # driver.run ref -> task
        self.spooling = threading.Lock()  # one spool pass at a time, and none while a run's outputs read a spool
        self._to_write: queue.SimpleQueue = queue.SimpleQueue()  # (request, submission) whose outputs are due
        self._writing = 0  # submissions handed to the writer and not yet complete (`complete_later`, `settle`)
        self._written = threading.Condition(lock)
        self._writer: threading.Thread | None = None

    def add(self, request_id: str, cfg: ExperimentConfig, names: list[str], *, resume: bool) -> None:
        self.subs[request_id] = Submission(cfg, resume, list(names),
                                           spool=EventSpool(self.state_dir / "spool" / f"{request_id}.jsonl"))

    def start(self, name: str, admitted: int) -> None:
        """Start the admitted task `name` (`admitted`: the bytes per device its admission counted)."""
        import dataclasses as dc

        import ray

        from rlsched.observe.progress import LineBuffer
        from rlsched.run.experiment import cobatches, estimate_bytes, shared_bytes, task_bases, train_cohorts
        from rlsched.scheduling.scheduler import SchedulerLocks

        record = self.book.tasks[name]
        sub = self.subs[record.request]
        spec = next(s for s in sub.cfg.task_specs() if s.name == name)
        spec = dc.replace(spec, processes=self.processes, shares_devices=True)  # tasks come and go beside it
        task = spec.config
        try:
            bases = task_bases(sub.cfg, name, self.processes)
            # A shared base is the policy's to count, once, pinned while any task reads it (Policy.register); the
            # task's own bytes leave it out
            engine, actor = estimate_bytes(task, shared_bytes(bases, name))
            pinned = [(repr(b.key), role, b.nbytes) for b in bases for t, role in b.roles if t == name]
            # A LoRA task rolls out (and trains) together with waiting tasks of its base group, whichever submission
            # they came in
            cobatch = cobatches(sub.cfg, bases).get(name)
            # its actor compiles the joint updates of its submission's partners ahead (others that come later join
            # them where their count fits; a count past it compiles in the hold, once)
            spec = dc.replace(spec, train_cohort=train_cohorts(sub.cfg, bases).get(name, 1))
            moves = ray.get(self.scheduler.admit.remote(name, ray_cluster.GROUP, engine, actor, priority=task.priority,
                                                        weight=task.weight, cobatch=cobatch, bases=pinned), timeout=60)
        except Exception as err:  # noqa: BLE001 - the policy refused it: this task fails, nothing else
            self.book.end(name, FAILED, f"the scheduler refused it: {err}")
            return
        driver = _driver_class().remote(spec, SchedulerLocks(self.scheduler, name), sites=self.where,
                                   resume=sub.resume, initial_moves=moves, echo=LineBuffer())
        self.scheduler.watch.remote(name, [driver.lifeline.remote()])
        self.scheduler.register_driver.remote(name, driver)
        self.drivers[name] = driver
        self.refs[driver.run.remote()] = name
        record.state, record.reason, record.started_at = RUNNING, None, time.time()
        shared = " (its base is held once for its base group, already running)" if \
            record.bases and admitted == record.needs_bytes else ""
        self.book.say(name, f"[{name}] admitted: {format_bytes(admitted)} per device{shared}; starting its roles")

    def poll(self, name: str) -> dict[str, Any] | None:
        import ray

        try:
            poll = ray.get(self.drivers[name].poll.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, KeyError):
            return None
        with self._lock:
            record = self.book.tasks[name]
            for line in poll["lines"]:
                self.book.say(name, line)
            # phase and lock of one moment of the driver's (TaskDriver.poll), replaced together under our lock
            record.step, record.phase, record.lock, record.devices = (poll["step"], poll["phase"], poll.get("lock"),
                                                                      poll["roles"])
            record.driver_pid = poll.get("pid", record.driver_pid)
            record.reward = poll.get("reward", record.reward)
        return poll

    def finish(self, ref) -> None:
        """A driver's run returned or raised: its state, its events, its driver ended, the submission's
        outputs written once all of its tasks have ended."""
        import ray

        from rlsched.run.experiment import _result

        with self._lock:
            name = self.refs.pop(ref)
            request = self.book.tasks[name].request
        last = self.poll(name)
        sub = self.subs[request]
        result = _result(name, ref, self.scheduler, sub.cfg)
        if last is not None:
            result["roles"] = last["roles"]
            if result["status"] == "ok" and last["state"] == "stopped":
                result.update(status="stopped", steps=last["step"])
        try:
            sub.events += ray.get(self.drivers[name].events.remote(), timeout=60)
        except Exception as err:  # noqa: BLE001 - said, not raised: the run's timeline lacks the task's own events
            self.book.log(f"task {name}: its driver's events were not read ({type(err).__name__}: {err}); the run's "
                          "timeline lacks them")
        try:
            ray.get(self.scheduler.retire.remote(name), timeout=60)
            ray.get(self.scheduler.forget_task.remote(name), timeout=60)  # its cause is in `result` now
        except Exception as err:  # noqa: BLE001 - said, not raised: the task's own end is recorded all the same
            self.book.log(f"task {name}: the scheduler did not retire it ({type(err).__name__}: {err}); its memory "
                          "may still count as held until it is submitted again")
        with self._lock:
            ray.kill(self.drivers.pop(name))  # its roles go with it
            sub.results[name] = result
            if result["status"] == "ok":
                self.book.end(name, FINISHED, None)
                self.book.given.pop(name, None)  # a finished task is not resumed: its config need not be kept
            elif result["status"] == "stopped":
                self.book.end(name, CANCELLED, f"cancelled after step {result['steps']} (its checkpoint is saved; "
                                               f"`rlsched resume {name}` continues it)")
            else:
                self.book.end(name, FAILED, result["error"])
                if "traceback_file" in result:
                    self.book.say(name, f"[{name}] its traceback: {result['traceback_file']}")
                self.book.say(name, f"[{name}] `rlsched resume {name}` continues it from its last checkpoint, as it "
                                    "was submitted (once the cause is fixed)")
            if self.ended(sub):  # not on the monitor's thread (drawing a long run's Gantt takes seconds); counted
                self.complete_later(request, sub)  # as being written from the moment its last task has ended

    def complete_later(self, request: str, sub: Submission) -> None:
        """`complete` on the service's output writer, a thread of its own: the monitor's next pass (admitting the tasks
        that waited for what this submission freed, reading the others' progress) does not wait for its outputs, nor
        do status or cancel (the lock is not held while they are written). `settle` waits for it. Called under the
        lock that ends the submission's last task, so that no one sees every task ended before the writing is
        counted. One writer for the service's life, not a thread per run: a thread per run grew the service's RSS by
        ~2.5-7.5 MiB a run (benchmarks/soak.py: 174 -> 233 MiB over 17 cycles; one writer: 171 -> 174 MiB), each new
        thread's allocations in a glibc arena of its own, the arenas kept."""
        with self._lock:
            self._writing += 1
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="rlsched-outputs", daemon=True)
                self._writer.start()
        self._to_write.put((request, sub))

    def _write_loop(self) -> None:
        while True:
            request, sub = self._to_write.get()
            try:
                self.complete(request, sub)
            except Exception as err:  # noqa: BLE001 - said, not raised: the writer goes on with the next run
                self.book.log(f"the outputs of {sub.cfg.experiment.name} were not all written: "
                              f"{type(err).__name__}: {err}")
            finally:
                with self._written:
                    self._writing -= 1
                    self._written.notify_all()

    def settle(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the outputs handed to the writer (`complete_later`); how many are still due."""
        with self._written:
            self._written.wait_for(lambda: self._writing == 0, timeout=timeout_s)
            return self._writing

    def complete(self, request: str, sub: Submission) -> None:
        """Every task of `sub` ended: its run's outputs are written (if any task of it ran), then it is dropped."""
        if sub.results:
            self._write_outputs(sub)
        with self.spooling, self._lock:  # a spool pass appends to live submissions' files only
            sub.spool.remove()
            self.subs.pop(request, None)  # nothing more is asked of it
        # What writing its outputs left is freed now, not at Python's next full collection: the timeline's drawing
        # leaves a web of reference cycles (matplotlib's figure: ~5,500 objects, ~4 MiB), which outlives the young
        # collections, and in this process (~130,000 objects kept) the first full one came after 16 cycles of the
        # soak, its RSS ~3 MiB higher each cycle until then (benchmarks/soak.py).
        gc.collect()

    def ended(self, sub: Submission) -> bool:
        """Whether every task of `sub` has ended (those cancelled before they started included) and no driver of
        it is still being finished."""
        records = [self.book.tasks.get(n) for n in sub.tasks]
        return (all(r is None or r.state in TERMINAL for r in records)
                and not any(n in sub.tasks for n in self.refs.values()))

    def _write_outputs(self, sub: Submission) -> None:
        import ray

        from rlsched.run.experiment import write_run_outputs

        def say(line: str) -> None:
            with self._lock:
                self.book.say(sub.tasks[0], line)

        try:  # the scheduler's events of this submission's time only (spooled, then those since), and its tasks'
            with self.spooling:  # not while a spool pass moves events out of the scheduler
                events = sub.spool.read() + list(ray.get(self.scheduler.events_since.remote(sub.spooled),
                                                         timeout=60))
            state = ray.get(self.scheduler.state.remote(), timeout=60)
            write_run_outputs(sub.cfg, events + sub.events, sub.results, state, echo=say)
        except Exception as err:  # noqa: BLE001 - the tasks' own files are written; say what is missing
            say(f"the run's timeline and summary were not written: {type(err).__name__}: {err}")
        with self._lock:
            live = [s.spooled for s in self.subs.values() if s is not sub]
        try:  # the events no live submission needs go
            ray.get(self.scheduler.forget_events_before.remote(min(live, default=time.time())), timeout=60)
        except Exception as err:  # noqa: BLE001 - said, not raised: the next spool pass forgets them (spool_events)
            self.book.log(f"the scheduler did not forget the events of {sub.cfg.experiment.name}'s time "
                          f"({type(err).__name__}: {err}); the next spool pass does")

    def spool_events(self) -> None:
        """Move the scheduler's events that ended before the cut (SPOOL_MARGIN_S ago) to the spool of each live
        submission whose time they fall in, then let the scheduler forget them: its memory holds a few seconds of
        events, not the age of the oldest live submission (rlsched.service.spool)."""
        import ray

        with self.spooling:
            cut = time.time() - SPOOL_MARGIN_S
            with self._lock:
                live = [s for s in self.subs.values() if s.spooled < cut]
            if not live:
                return
            events = [e for e in ray.get(self.scheduler.events_since.remote(min(s.spooled for s in live)),
                                         timeout=60) if event_end(e) < cut]
            for sub in live:
                sub.spool.append(e for e in events if event_end(e) >= sub.spooled)
                sub.spooled = cut
            with self._lock:
                oldest = min((s.spooled for s in self.subs.values()), default=cut)
            ray.get(self.scheduler.forget_events_before.remote(oldest), timeout=60)
