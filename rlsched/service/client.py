"""The user's side of the scheduler service: what `rlsched submit / status / logs / cancel / resume / forget / locks`
do before and after they talk to it (rlsched.service.server), and how their answers are shown.

    names = submit(["configs/demo_multitask.yaml"], overrides=[], tasks=None, priority=None, weight=None)
    print(render_status(status()))

Design decisions (and why):
- **Validated where the user is.** `submit` loads, overrides and checks the config here, with the service's
  cluster settings put in (its devices, placement, budget and policy decide for every task it runs), runs
  the same preflight as `train`, and refuses a run directory that holds a run unless `--resume`: every
  config error is printed before anything is sent. A cluster key the config set otherwise is named.
- **Paths resolve where `submit` ran.** The config's relative paths (output_dir, model and data paths) are
  made absolute against this directory, so the outputs land in its runs/<experiment>/ as `train` writes them.
  The service keeps that config with the files, overrides and directory it came from: `resume TASK` sends
  only the task's name, and works the same from any directory.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlsched.base.errors import UsageError
from rlsched.base.units import format_bytes
from rlsched.config.loading import load_configs, select_tasks, with_absolute_paths
from rlsched.config.schema import ConfigError, ExperimentConfig
from rlsched.service import daemon
from rlsched.service.server import SETTINGS_KEYS, TERMINAL


def service_config(paths: Sequence[str | Path], overrides: Sequence[str], tasks: Sequence[str] | None,
                   settings: dict[str, Any], *, priority: int | None = None, weight: float | None = None,
                   echo=print) -> ExperimentConfig:
    """The config as the service will run it, validated (ConfigError otherwise), with absolute paths."""
    from rlsched.config.preflight import preflight

    given = load_configs(paths, overrides)
    if given.cluster.hosts > 1:
        raise ConfigError(f"cluster.hosts is {given.cluster.hosts}: the scheduler service runs device groups of one "
                          "host so far; run a task across hosts with `rlsched train CONFIG --address ADDR`")
    for key in SETTINGS_KEYS:
        mine, theirs = getattr(given.cluster, key), settings.get(key)
        if key in given.cluster.model_fields_set and mine != theirs:
            echo(f"note: cluster.{key} is {theirs!r} in the running scheduler (`rlsched up` set it); the config's "
                 f"{mine!r} does not apply")
    forced = [f"cluster.{k}={json.dumps(settings[k])}" for k in SETTINGS_KEYS if k in settings]
    cfg = select_tasks(load_configs(paths, [*overrides, *forced]), tasks)
    update = {k: v for k, v in (("priority", priority), ("weight", weight)) if v is not None}
    if update:
        cfg = cfg.model_copy(update={"tasks": [t.model_copy(update=update) for t in cfg.tasks]})
    preflight(cfg)
    return with_absolute_paths(cfg, Path.cwd())


def submit(paths: Sequence[str | Path], *, overrides: Sequence[str] = (), tasks: Sequence[str] | None = None,
           priority: int | None = None, weight: float | None = None, resume: bool = False, request: str | None = None,
           echo=print, note=None) -> list[str]:
    """Validate, send, return the task names (their ids in the service). UsageError if the service refused.
    `request`: the request's id (default: a new one); a request repeated with its id changes nothing.
    `note`: where the service's notes go (with `resume`: where each task continues from; default stderr)."""
    import sys

    service, info = daemon.connect()
    cfg = service_config(paths, overrides, tasks, info["settings"], priority=priority, weight=weight, echo=echo)
    origin = {"configs": [str(Path(p).absolute()) for p in paths], "overrides": list(overrides), "cwd": str(Path.cwd())}
    # A task directory that holds a run is refused by the service, after it has looked the request id up: a
    # retry of a submission it accepted finds the directories that submission made.
    answer = daemon.call(service.submit, request or daemon.request_id(), cfg, resume, origin)
    if "error" in answer:
        raise UsageError(f"the scheduler refused the submission: {answer['error']}")
    for line in answer.get("notes", []):
        (note or (lambda text: print(text, file=sys.stderr)))(line)
    return answer["tasks"]


def resume(task: str, *, fresh: bool = False, request: str | None = None) -> dict[str, Any]:
    """Continue a CANCELLED or FAILED task as it was submitted (rlsched.service.server.Service.resume); UsageError, with
    the one-line reason, if it cannot be (it is live or finished, or it has no checkpoint and not `fresh`)."""
    service, _ = daemon.connect()
    answer = daemon.call(service.resume, request or daemon.request_id(), task, fresh)
    if "error" in answer:
        raise UsageError(answer["error"])
    return answer


def forget(task: str, request: str | None = None) -> dict[str, Any]:
    """Drop an ended task's record from the service (its files stay); UsageError for a live one."""
    service, _ = daemon.connect()
    answer = daemon.call(service.forget, request or daemon.request_id(), task)
    if "error" in answer:
        raise UsageError(answer["error"])
    return answer


def status() -> dict[str, Any]:
    service, info = daemon.connect()
    report = daemon.call(service.status)
    report["auth"] = {"mode": info.get("auth"), "enforced": info.get("auth_enforced")}  # as checked at `up`
    return report


def sizes() -> dict[str, Any]:
    """The service's process id and how many records it keeps of each kind (Service.sizes)."""
    service, _ = daemon.connect()
    return daemon.call(service.sizes)


def cancel(task: str, request: str | None = None) -> dict[str, Any]:
    service, _ = daemon.connect()
    answer = daemon.call(service.cancel, request or daemon.request_id(), task)
    if "error" in answer:
        raise UsageError(answer["error"])
    return answer


def follow_logs(task: str, *, follow: bool, echo=print, period_s: float = 0.5) -> str:
    """Print the task's lines (all of them, then, with `follow`, new ones until it ends); returns its state."""
    service, _ = daemon.connect()
    offset = 0
    while True:
        answer = daemon.call(service.logs, task, offset)
        if "error" in answer:
            raise UsageError(answer["error"])
        for line in answer["lines"]:
            echo(line)
        offset = answer["next"]
        if not follow or answer["state"] in TERMINAL:
            return answer["state"]
        time.sleep(period_s)


def locks(release: str | None = None) -> dict[str, Any]:
    service, _ = daemon.connect()
    if release is not None:
        answer = daemon.call(service.release, release, timeout_s=180)
        if "error" in answer:
            raise UsageError(answer["error"])
    return daemon.call(service.locks)


# ---- what the commands print ---------------------------------------------------------------------------------

_COLUMNS = ("TASK", "STATE", "STEP", "REWARD", "PHASE", "LOCK", "DEVICES", "WHY")


def render_status(report: dict[str, Any]) -> str:
    rows = [_row(t) for t in report["tasks"]]
    if not rows:
        return "\n".join(["no tasks yet; `rlsched submit CONFIG` sends some", *_service_lines(report)])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(_COLUMNS, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    used, budget = report["used_bytes"], report["budget_bytes"]
    shown = (used,) if budget is None else (used, budget)  # one unit for both, neither reading 0.00
    lines.append(f"memory per device: {format_bytes(used, like=shown)} admitted"
                 + ("" if budget is None else f" of {format_bytes(budget, like=shown)}")
                 + f"; policy {report['settings']['policy']}")
    return "\n".join(lines + _service_lines(report))


def _service_lines(report: dict[str, Any]) -> list[str]:
    """The device group's processes, the service's own health and its authentication (as checked at `up`)."""
    lines = []
    for part, d in (report.get("degraded") or {}).items():  # the monitor, the scheduler's lease watchdog
        since = "" if d["since"] is None else f" since {time.strftime('%H:%M:%S', time.localtime(d['since']))}"
        count = "" if d["failures"] is None else f" {d['failures']} time(s) in a row"
        lines.append(f"service DEGRADED{since}: its {part} failed{count} ({d['cause']}); it retries ({d['log']} has "
                     "more)")
    for group, f in (report.get("fenced_groups") or {}).items():  # Scheduler.fenced_groups
        lines.append(f"device group {group}: {f}" if group == "error" else
                     f"device group {group} FENCED since {time.strftime('%H:%M:%S', time.localtime(f['since']))}: "
                     f"out of service until {'; '.join(f['left']) or 'its fences end'} ({f['cause']}); asked "
                     f"{f['tries']} time(s) so far, nothing starts there meanwhile")
    auth = report.get("auth") or {}
    if auth.get("mode") is not None:
        lines.append(f"Ray's token authentication: {auth['mode']}; at start a client without the token was "
                     + {True: "refused", False: "LET IN", None: "neither let in nor refused"}[auth.get("enforced")])
    for process in report.get("group_processes", []):  # cluster.processes: per_device_group
        lines.append(f"device-group process: {process['error']}" if "error" in process else
                     f"device-group process pid {process['pid']}: {len(process['roles'])} role(s), "
                     f"{format_bytes(process['device_bytes'])} on its devices, {process['programs']} compiled "
                     f"program(s) kept" + (f", {process['memory_maps']} memory maps"
                                           if process.get("memory_maps") is not None else "")
                     + (f", {format_bytes(process['heap_bytes'])} in its C heap"
                        if process.get("heap_bytes") is not None else ""))
    return lines


def _row(t: dict[str, Any]) -> list[str]:
    devices = ",".join(f"{role}:{'/'.join(map(str, p.get('devices', [])))}" for role, p in (t["devices"] or {}).items())
    reward = "-" if t["reward"] is None else f"{t['reward']:.3f}"
    return [t["name"], t["state"], f"{t['step']}/{t['steps']}", reward, t["phase"] or "-", t.get("lock") or "-",
            devices or "-", t["reason"] or ""]


def render_locks(report: dict[str, Any]) -> str:
    """One line per lock: `free` or its holder(s) and for how long, then its waiters (rlsched.scheduling.scheduler's
    `locks`: a free lock's holder and held_s are None)."""
    lines = []
    for resource, lock in report.items():
        if lock["holder"] is None:
            held = "free"
        else:
            holders = ", ".join(lock.get("holders") or [lock["holder"]])  # several: a co-batched rollout
            held = f"held by {holders}" + ("" if lock["held_s"] is None else f" for {lock['held_s']:.1f}s")
        waiting = ", ".join(f"{w['task']} ({w['waited_s']:.1f}s)" if w["waited_s"] is not None else w["task"]
                            for w in lock["waiting"]) or "nobody"
        lines.append(f"{resource}: {held}; waiting: {waiting}")
    return "\n".join(lines)
