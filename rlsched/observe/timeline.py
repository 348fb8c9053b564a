"""Timelines: spans and counters from every process of a run, one Chrome trace per run.

    tl = Timeline("driver", task="addition")
    with tl.span("ROLLOUT", phase="rollout", resource="g0/rollout"):
        with tl.span("generate", phase="rollout", resource="g0/rollout") as s:
            s["tokens"] = 1024                       # known only at the end
    write_chrome_trace(run_dir / "timeline.json", tl.events() + other_processes_events)

Design decisions (and why):
- **Events are plain JSON-safe dicts**, so a role in another process ships its spans back with the
  result of a call (`drain()`), and the driver merges them (`extend()`): no gaps across processes.
  A span: {kind: "span", task, name, phase, resource, device, start, end, bytes, args}; a counter:
  {kind: "counter", task, name, ts, values}.
- **One clock: wall time.** Processes on one node share it; each recorder anchors `time.time()` once
  and advances it with `perf_counter()`, so spans are precise and comparable across processes. The
  anchor is the tightest of a few (counter, wall, counter) readings: a process preempted between the
  two clock reads (4 tasks' processes starting on 2 cores) would otherwise shift all its spans by
  the preemption, and a role's last span would end after the lock hold the driver records around it.
- **A span is recorded even when its body raises** (with `args.error`), so a failed phase shows.
- **The trace is the evidence.** A lock hold is one complete event named `ROLLOUT` or `TRAIN` with
  `args.task` and `args.resource` (the resource's identity across tasks), on the resource's track,
  and the phase's finer spans (onload, sync_weights, verify, generate, train, publish, offload)
  nest inside it. So lock exclusivity and overlap can be checked from the file alone
  (`check_lock_exclusivity`, `overlaps`), and `read_trace` rebuilds the events from it.
- **Export and summaries are pure functions of the events** (`chrome_trace`, `summarize`); the
  picture is rlsched.observe.gantt. `NullTimeline` is the no-op twin with the same API.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlsched.rundir.files import json_safe, write_atomic

LOCKS = ("ROLLOUT", "TRAIN")  # the names of lock-hold spans
SWITCH = ("onload", "offload", "sync_weights", "verify")  # what multiplexing costs a task
# The phase of a task's start (its roles built: imports, devices, the model read and placed) and a role's restart:
# what comes before its first step, apart from the run's steady time (its wall time and busy fractions)
STARTUP = "startup"



def event_end(event: dict[str, Any]) -> float:
    """When an event ended (a counter: when it was taken), as the timeline orders and forgets them."""
    return event.get("end", event.get("ts", 0.0))

class TimelineError(ValueError):
    """A file is not a timeline this module wrote."""


class Timeline:
    """Records spans and counters of one process (`process`: "driver", "actor", "engine", "scheduler")."""

    def __init__(self, process: str, task: str | None = None):
        self.process, self.task = process, task
        self._anchor_wall, self._anchor_perf = clock_anchor()
        self._events: list[dict[str, Any]] = []

    def now(self) -> float:
        """Wall-clock seconds, advanced with the high-resolution counter."""
        return self._anchor_wall + (time.perf_counter() - self._anchor_perf)

    @contextlib.contextmanager
    def span(self, name: str, *, phase: str | None = None, resource: str | None = None, device: str | None = None,
             bytes: int | None = None, **args: Any) -> Iterator[dict[str, Any]]:  # noqa: A002 - the field's name
        """Time the body. Yields a dict: keys set in it become args (`"bytes"` sets the span's bytes)."""
        late: dict[str, Any] = {}
        start = self.now()
        try:
            yield late
        except BaseException as err:
            late.setdefault("error", type(err).__name__)
            raise
        finally:
            nbytes = late.pop("bytes", bytes)
            self.add_span(name, start, self.now(), phase=phase, resource=resource, device=device, bytes=nbytes,
                          **args, **late)

    def add_span(self, name: str, start: float, end: float, *, phase: str | None = None, resource: str | None = None,
                 device: str | None = None, bytes: int | None = None, task: str | None = None,  # noqa: A002
                 **args: Any) -> None:
        """Record a span measured elsewhere (e.g. a lock wait, from request to grant)."""
        self._events.append({
            "kind": "span", "task": task if task is not None else self.task, "process": self.process, "name": name,
            "phase": None if phase is None else str(phase), "resource": resource, "device": device,
            "start": float(start), "end": float(max(end, start)), "bytes": None if bytes is None else int(bytes),
            "args": {k: json_safe(v) for k, v in args.items()}})

    def counter(self, name: str, values: dict[str, float], ts: float | None = None) -> None:
        self._events.append({"kind": "counter", "task": self.task, "process": self.process, "name": name,
                             "ts": self.now() if ts is None else float(ts),
                             "values": {str(k): float(v) for k, v in values.items()}})

    def events(self, since: float | None = None) -> list[dict[str, Any]]:
        """The events recorded, or those that end at or after `since` (wall-clock seconds)."""
        if since is None:
            return list(self._events)
        return [e for e in self._events if event_end(e) >= since]

    def forget_before(self, t: float) -> int:
        """Drop the events that ended before `t` (a long-lived process keeps only what a live run may still ask
        for); returns how many are kept."""
        self._events = [e for e in self._events if event_end(e) >= t]
        return len(self._events)

    def drain(self) -> list[dict[str, Any]]:
        out, self._events = self._events, []
        return out

    def extend(self, events: list[dict[str, Any]]) -> None:
        self._events.extend(events)


def clock_anchor(samples: int = 7) -> tuple[float, float]:
    """(wall, counter) read at the same instant, to within the tightest of `samples` bracketing reads."""
    best = None
    for _ in range(samples):
        before, wall, after = time.perf_counter(), time.time(), time.perf_counter()
        if best is None or after - before < best[0]:
            best = (after - before, wall, (before + after) / 2)
    return best[1], best[2]


class NullTimeline(Timeline):
    """Records nothing; same API."""

    def __init__(self, process: str = "null", task: str | None = None):
        super().__init__(process, task)

    def add_span(self, *args: Any, **kwargs: Any) -> None:
        pass

    def counter(self, *args: Any, **kwargs: Any) -> None:
        pass

    def extend(self, events: list[dict[str, Any]]) -> None:
        pass


# ---- Chrome trace -------------------------------------------------------------------------------------------

def _spans(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("kind") == "span"]


def chrome_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Chrome-trace JSON (opens in Perfetto): a process row per task ("scheduler" for task None), a
    track per resource (spans without one on "host"), complete events ("X") in microseconds from the
    earliest event, counters ("C"). Each event's own fields ride in `args` so `read_trace` can rebuild it."""
    times = [e["start"] for e in _spans(events)] + [e["ts"] for e in events if e.get("kind") == "counter"]
    t0 = min(times) if times else 0.0
    tasks = sorted({e.get("task") for e in events}, key=lambda t: (t is None, t or ""))
    pid = {t: i + 1 for i, t in enumerate(tasks)}
    tids: dict[tuple[Any, str], int] = {}
    out: list[dict[str, Any]] = []
    for t in tasks:
        out.append({"ph": "M", "name": "process_name", "pid": pid[t], "tid": 0,
                    "args": {"name": "scheduler" if t is None else f"task {t}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid[t], "tid": 0, "args": {"sort_index": pid[t]}})

    def tid(task: Any, track: str) -> int:
        if (task, track) not in tids:
            tids[(task, track)] = n = 1 + sum(1 for k in tids if k[0] == task)
            out.append({"ph": "M", "name": "thread_name", "pid": pid[task], "tid": n, "args": {"name": track}})
        return tids[(task, track)]

    # Within a track, parents before children: sort by start, then the longer span first, so that
    # viewers nest equal-start spans correctly.
    for e in sorted(_spans(events), key=lambda e: (e["start"], -(e["end"] - e["start"]))):
        args = {**e.get("args", {}), "task": e.get("task"), "phase": e.get("phase"), "resource": e.get("resource"),
                "device": e.get("device"), "bytes": e.get("bytes"), "process": e.get("process"),
                "_event": {k: v for k, v in e.items() if k != "args"}, "_args": e.get("args", {})}
        out.append({"ph": "X", "name": e["name"], "cat": e.get("phase") or "host",
                    "pid": pid[e.get("task")], "tid": tid(e.get("task"), e.get("resource") or "host"),
                    "ts": round((e["start"] - t0) * 1e6, 3), "dur": round((e["end"] - e["start"]) * 1e6, 3),
                    "args": args})
    for e in events:
        if e.get("kind") == "counter":
            out.append({"ph": "C", "name": e["name"], "pid": pid[e.get("task")], "tid": 0,
                        "ts": round((e["ts"] - t0) * 1e6, 3), "args": dict(e["values"])})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"clock": "unix seconds", "t0": t0}}


def write_chrome_trace(path: str | Path, events: list[dict[str, Any]]) -> Path:
    """Write the trace atomically (a reader sees the old file or the new one, never half)."""
    return write_atomic(path, json.dumps(chrome_trace(events)))


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events a trace was written from."""
    path = Path(path)
    if not path.is_file():
        raise TimelineError(f"{path} does not exist: a run writes it when it ends (`rlsched train CONFIG` or "
                            "`rlsched demo`); pass the run directory runs/<experiment>")
    try:
        trace = json.loads(path.read_text())
        raw = trace["traceEvents"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise TimelineError(f"{path} is not a Chrome trace written by rlsched ({type(err).__name__}: {err})") from err
    t0 = float(trace.get("otherData", {}).get("t0", 0.0))
    task_of = {e["pid"]: (None if e["args"]["name"] == "scheduler" else e["args"]["name"].removeprefix("task "))
               for e in raw if e.get("ph") == "M" and e.get("name") == "process_name"}
    events = []
    for e in raw:
        if e.get("ph") == "X" and "_event" in e.get("args", {}):
            events.append({**e["args"]["_event"], "args": e["args"].get("_args", {})})
        elif e.get("ph") == "C":
            events.append({"kind": "counter", "task": task_of.get(e["pid"]), "name": e["name"],
                           "ts": t0 + e["ts"] / 1e6, "values": dict(e["args"])})
    return events


# ---- checks and summaries ----------------------------------------------------------------------------------

def lock_spans(events: list[dict]) -> list[dict]:
    return [e for e in _spans(events) if e["name"] in LOCKS]


def check_lock_exclusivity(events: list[dict]) -> list[str]:
    """Violations: two tasks' lock holds overlapping on one resource (empty = the lock held).

    Each hold is checked against every earlier hold still open when it starts, not only its
    predecessor: a long hold can outlast several short ones that start inside it."""
    by_resource: dict[str, list[dict]] = {}
    for e in lock_spans(events):
        by_resource.setdefault(e["resource"], []).append(e)
    problems = []
    for resource, spans in by_resource.items():
        spans.sort(key=lambda e: e["start"])
        open_holds: list[dict] = []
        for b in spans:
            open_holds = [a for a in open_holds if a["end"] > b["start"]]
            problems += [f"{resource}: {a['task']} {a['name']} [{a['start']:.6f}, {a['end']:.6f}] overlaps "
                         f"{b['task']} {b['name']} [{b['start']:.6f}, {b['end']:.6f}]"
                         for a in open_holds if a["task"] != b["task"]]
            open_holds.append(b)
    return problems


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def overlaps(events: list[dict], a_task: str, a_phase: str, b_task: str, b_phase: str) -> float:
    """Seconds during which `a_task` held its `a_phase` lock while `b_task` held its `b_phase` lock."""
    def holds(task: str, phase: str) -> list[tuple[float, float]]:
        return _union([(e["start"], e["end"]) for e in lock_spans(events)
                       if e["task"] == task and e["name"] == phase.upper()])

    total = 0.0
    for s1, e1 in holds(a_task, a_phase):
        for s2, e2 in holds(b_task, b_phase):
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per task: wall, seconds holding each lock, lock wait, switch overhead, reward, compile (its roles'
    programs, compiled outside the locks: never inside a phase's time), startup (its start and its roles', STARTUP:
    before the run's steady time, which wall and busy fractions count from); per resource: busy fraction (union of
    lock holds / the run's wall time)."""
    every = _spans(events)
    spans = [e for e in every if e.get("phase") != STARTUP]
    if not spans:
        return {"wall_s": 0.0, "tasks": {}, "resources": {}}
    t0, t1 = min(e["start"] for e in spans), max(e["end"] for e in spans)
    wall = t1 - t0
    tasks: dict[str, Any] = {}
    for task in sorted({e["task"] for e in spans if e["task"] is not None}):
        mine = [e for e in spans if e["task"] == task]

        def total(names: tuple[str, ...], mine=mine) -> float:
            return sum(e["end"] - e["start"] for e in mine if e["name"] in names)

        tasks[task] = {
            "wall_s": max(e["end"] for e in mine) - min(e["start"] for e in mine),
            "rollout_s": total(("ROLLOUT",)), "train_s": total(("TRAIN",)),
            "lock_wait_s": total(("lock_wait",)), "switch_s": total(SWITCH), "reward_s": total(("reward",)),
            # the wall time its step waited on compiles: a task's roles compile at once (rlsched.run.task.prepare)
            "compile_s": _length(_union([(e["start"], e["end"]) for e in mine if e["name"] == "compile"])),
            "startup_s": _length(_union([(e["start"], e["end"]) for e in every
                                         if e["task"] == task and e.get("phase") == STARTUP])),
            "steps": sum(1 for e in mine if e["name"] == "TRAIN"),
        }
    resources = {}
    for resource in sorted({e["resource"] for e in lock_spans(spans)}):
        held = _union([(e["start"], e["end"]) for e in lock_spans(spans) if e["resource"] == resource])
        resources[resource] = {"busy_s": _length(held), "busy_fraction": _length(held) / wall if wall else 0.0}
    return {"wall_s": wall, "tasks": tasks, "resources": resources}


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"run wall time {summary['wall_s']:.2f}s", "",
             f"{'task':<16} {'steps':>5} {'wall s':>8} {'ROLLOUT s':>10} {'TRAIN s':>8} {'lock wait s':>11} "
             f"{'switch s':>9} {'reward s':>9} {'compile s':>10} {'start s':>8}"]
    for task, t in summary["tasks"].items():
        lines.append(f"{task:<16} {t['steps']:>5} {t['wall_s']:>8.2f} {t['rollout_s']:>10.2f} {t['train_s']:>8.2f} "
                     f"{t['lock_wait_s']:>11.2f} {t['switch_s']:>9.2f} {t['reward_s']:>9.2f} "
                     f"{t['compile_s']:>10.2f} {t['startup_s']:>8.2f}")
    lines += ["", f"{'resource':<24} {'busy s':>8} {'busy':>6}"]
    for resource, r in summary["resources"].items():
        lines.append(f"{resource:<24} {r['busy_s']:>8.2f} {r['busy_fraction']:>6.0%}")
    return "\n".join(lines)
