"""The service's task records: what `status` shows of each task, its last lines for `logs`, what it was submitted
with, and the files that keep them across services. Plain Python (no Ray): rlsched.service.server holds one book.

    book = TaskBook(state_dir, limits)       # limits: rlsched.service.server.LIMITS
    book.load_previous()                     # a dead service's records: its live tasks are FAILED now
    book.tasks[name] = TaskRecord(...); book.say(name, "[name] submitted"); book.end(name, FINISHED, None)
    book.save()                              # <state dir>/tasks.json, atomically

Design decisions (and why):
- **States are kept on disk** (`<state dir>/tasks.json`, atomically after every change): a service that
  dies leaves its tasks' records, and the next one marks what was PENDING or RUNNING as FAILED with that
  reason; each such task resumes from its last checkpoint with `rlsched resume TASK`.
- **A task that ended is kept until forgotten.** A CANCELLED or FAILED task stays in `status`, with what it
  was submitted with (rlsched.service.submissions), until `rlsched forget TASK`: `rlsched resume TASK` continues it from
  any directory, exactly as it was submitted. Its name cannot be submitted anew meanwhile, nor `--resume`d in
  another run directory (that would resume some other run under its name). A FINISHED task's name is free.
- **Ended records are bounded.** The newest limits["finished"] FINISHED tasks stay in `status`, and the newest
  limits["unfinished"] CANCELLED and FAILED ones; older ones move to `<state dir>/history.jsonl`, one row each, their
  lines and kept configs leaving memory with them: a service that ran (or saw cancelled) thousands of tasks keeps
  no more of them in memory. A CANCELLED or FAILED task's row keeps what it was submitted with, so `rlsched resume
  TASK` still continues it from its run directory (`summarised`); a new submission may take its name meanwhile.
  `rlsched forget TASK` drops its rows there too (`forget_summarised`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from rlsched.config.schema import ExperimentConfig
from rlsched.rundir.files import json_safe, write_atomic
from rlsched.service.bounded import RecentAnswers, TailLines
from rlsched.service.submissions import Given

PENDING, RUNNING, FINISHED, FAILED, CANCELLED = "PENDING", "RUNNING", "FINISHED", "FAILED", "CANCELLED"
TERMINAL = (FINISHED, FAILED, CANCELLED)


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


class TaskBook:
    """Every task the service knows (see the module docstring), its lines and what it was submitted with."""

    def __init__(self, state_dir: Path, limits: dict[str, Any]):
        self.state_dir = Path(state_dir)
        self.limits = limits
        self.tasks: dict[str, TaskRecord] = {}  # in submission order
        self.lines: dict[str, TailLines] = {}  # task -> its last lines (all of them are in its run.log)
        self.given: dict[str, Given] = {}  # task -> what it was submitted with (kept until forgotten)
        self._said = RecentAnswers(limits["requests"])  # failures `log_once` has logged (bounded: a service lives long)

    def end(self, name: str, state: str, reason: str | None) -> None:
        record = self.tasks[name]
        record.state, record.reason, record.ended_at, record.phase, record.lock = state, reason, time.time(), None, None
        self.say(name, f"[{name}] {state}" + (f": {reason}" if reason else ""))
        self.retire_old()

    def retire_old(self) -> None:
        """Keep the newest limits["finished"] FINISHED tasks and limits["unfinished"] CANCELLED or FAILED ones;
        older ones move to `history.jsonl` in the state directory, one row each (with what a CANCELLED or FAILED one
        was submitted with, for `rlsched resume`), their lines and kept configs dropped from memory."""
        old = []
        for states, limit in (((FINISHED,), self.limits["finished"]),
                              ((CANCELLED, FAILED), self.limits["unfinished"])):
            ended = sorted((t for t in self.tasks.values() if t.state in states), key=lambda t: t.ended_at or 0)
            old += ended[:max(len(ended) - limit, 0)]
        if not old:
            return
        with open(self.state_dir / "history.jsonl", "a", encoding="utf-8") as f:
            for record in old:
                given = self.given.get(record.name) if record.state != FINISHED else None
                f.write(json.dumps({**record.row(), **({"given": given.row()} if given else {})}) + "\n")
        for record in old:
            del self.tasks[record.name]
            self.lines.pop(record.name, None)
            self.given.pop(record.name, None)

    def summarised(self, name: str) -> tuple[TaskRecord, Given | None] | None:
        """The last row of task `name` in history.jsonl (a record `retire_old` moved there), with what it was
        submitted with if it was CANCELLED or FAILED; None when it has none. Read from the file on each call (only
        `rlsched resume` of a task no longer in `status` asks): memory holds none of it."""
        path = self.state_dir / "history.jsonl"
        if not path.exists():
            return None
        found, start = None, _row_start(name)
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith(start):
                    found = line
        if found is None:
            return None
        row = json.loads(found)
        given = row.pop("given", None)
        return _record(row), (None if given is None else Given.from_row(given))

    def forget_summarised(self, name: str) -> TaskRecord | None:
        """Drop every row of task `name` from history.jsonl (rewritten atomically; the other rows as they were), so
        `rlsched resume` no longer finds it; its last record, or None when it has none there."""
        path, start = self.state_dir / "history.jsonl", _row_start(name)
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []
        ours = [line for line in lines if line.startswith(start)]
        if not ours:
            return None
        write_atomic(path, "".join(line for line in lines if not line.startswith(start)))
        return _record(json.loads(ours[-1]))  # (its "given" is not a record's field)

    def kept_error(self, cfg: ExperimentConfig, resume: bool) -> str | None:
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

    @staticmethod
    def not_resumable(record: TaskRecord, given: Given | None) -> str | None:
        """Why `resume` refuses the task of `record`, submitted with `given` (one line), or None."""
        task = record.name
        if record.state in (PENDING, RUNNING):
            return f"task {task} is {record.state}: there is nothing to resume (`rlsched cancel {task}` stops it)"
        if record.state == FINISHED:
            return (f"task {task} is FINISHED (step {record.step} of {record.steps}): there is nothing to resume; "
                    f"`rlsched forget {task}` drops its record")
        if given is None:
            return (f"task {task} was submitted to a scheduler that kept no config for it: submit it again from its "
                    "directory with `rlsched submit CONFIG ... --resume`")
        return None

    def log(self, line: str) -> None:
        """A line of the service's own (not a task's) in service.log, timed. One that cannot be written there goes
        to the actor's stderr (Ray's worker log), once."""
        try:
            with open(self.state_dir / "service.log", "a", encoding="utf-8") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} service: {line}\n")
        except OSError as err:
            if "service.log" not in self._said:
                self._said["service.log"] = True
                print(f"rlsched service: service.log cannot be written ({err}); its lines are lost from here on, "
                      f"starting with: {line}", file=sys.stderr, flush=True)

    def log_once(self, key: str, line: str) -> None:
        """`log(line)` the first time a failure `key` is met (a clean-up that fails again and again is said once)."""
        if key not in self._said:
            self._said[key] = True
            self.log(line)

    def say(self, name: str, line: str) -> None:
        """A task's line: kept for `logs`, and appended, timed, to its experiment's run.log."""
        if name in self.tasks:  # a task forgotten meanwhile keeps no lines (its run.log has them)
            self.lines.setdefault(name, TailLines(self.limits["lines"])).append(line)
        record = self.tasks.get(name)
        if record is not None:
            path = Path(record.run_dir) / "run.log"
            try:
                with open(path, "a", encoding="utf-8") as f:
                    f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
            except OSError as err:  # a run directory removed under a live task: `logs` still has its lines
                self.log_once(f"unwritable {path}", f"task {name}: {path} cannot be written ({err}); its lines "
                                                       "are kept for `rlsched logs` only")

    def unknown(self, task: str) -> str:
        known = ", ".join(self.tasks) or "none yet"
        return f"no task {task!r} in this scheduler (tasks: {known}); `rlsched status` lists them"

    def save(self) -> None:
        write_atomic(self.state_dir / "tasks.json",
                     json.dumps({"tasks": [t.row() for t in self.tasks.values()],
                                 "given": {name: g.row() for name, g in self.given.items()}}, indent=1) + "\n")

    def load_previous(self) -> None:
        """The records of a service that died: what was PENDING or RUNNING then is FAILED now, with why."""
        path = self.state_dir / "tasks.json"
        if not path.exists():
            return
        saved = json.loads(path.read_text())
        self.given = {name: Given.from_row(row) for name, row in saved.get("given", {}).items()}  # older: none
        for row in saved["tasks"]:
            record = _record(row)
            self.tasks[record.name] = record
            self.lines[record.name] = TailLines(self.limits["lines"])
            if record.state not in TERMINAL:
                self.end(record.name, FAILED, f"the scheduler service stopped while the task was {record.state} "
                                              f"(its process died); `rlsched resume {record.name}` continues it "
                                              "from its last checkpoint")
        self.retire_old()  # a service with lower limits than the last one's


def _row_start(name: str) -> str:
    """How every history.jsonl row of task `name` starts: '{"name": "<name>",' (its first key, written whole)."""
    return "{" + json.dumps({"name": name})[1:-1] + ","


def _record(row: dict[str, Any]) -> TaskRecord:
    """A TaskRecord from its row (TaskRecord.row()); keys of other versions are left out."""
    fields = {f.name for f in dataclasses.fields(TaskRecord)}
    return TaskRecord(**{k: v for k, v in row.items() if k in fields})


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
