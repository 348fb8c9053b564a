"""Per-task metric trackers: metrics.jsonl (always), W&B (offline by default), a no-op twin and a fan-out.

Every tracker has the same four methods (`Tracker`): `log(step, metrics)`, `hyperparameters(params)`,
`summary(values)` and `finish(exit_code)`. An experiment has one tracker per task and one for the
scheduler (`make_trackers`), each with a directory of its own.

Design decisions:
- One W&B run per task, never a shared or global one: practitioners saw two tasks' W&B runs mixed
  into one (docs/design.md, "What the design answers"). `WandbTracker` logs through its own run object
  (`run.log`), never the global `wandb.log`; runs are created with `reinit="create_new"` so several coexist in one
  process; each run writes under its own directory; console capture is off, because in a process
  that hosts several tasks a printed line cannot be attributed to one of them.
- Offline by default: the explicit mode, else `WANDB_MODE`, else "offline"; `wandb sync` uploads later.
  Nothing here reads, logs or prints credentials.
- A run is always finished, also when its task fails (`finish(exit_code=1)` marks it failed), and
  finishing twice is harmless; a `with` block finishes with exit code 1 when it exits on an exception.
  W&B's `run.finish()` returns before its service has flushed the run's transaction log (it is written
  through a buffer and closed asynchronously; read right after, it can be empty), so an offline run's
  `finish` also waits until the exit record is on disk: the run is complete even if the process is
  killed next. (Online, `run.finish()` itself waits for the upload.)
  `MultiTracker` gives every child each call even if one raises, so a W&B failure never costs a
  metrics.jsonl line, then re-raises the first error.
- metrics.jsonl is append-only and crash-safe: each line is written and flushed whole, and a resumed
  run first drops the lines written after its checkpoint, so metrics continue exactly.
  `hparams.json` and `summary.json` sit beside it, updated like W&B's config and summary (keys
  merge) and replaced atomically, so a crash never leaves half a file.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlsched.base.errors import UsageError
from rlsched.rundir.files import json_safe, write_atomic

if TYPE_CHECKING:
    from rlsched.config.schema import TrackingSection

DEFAULT_WANDB_MODE = "offline"


class Tracker(Protocol):
    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step's metrics (step increases from call to call)."""

    def hyperparameters(self, params: Mapping[str, Any]) -> None:
        """Record the run's settings; keys merge with earlier calls."""

    def summary(self, values: Mapping[str, Any]) -> None:
        """Record end-of-run values (totals, best reward); keys merge with earlier calls."""

    def finish(self, exit_code: int = 0) -> None:
        """Close the tracker; a non-zero exit code marks the run failed. Idempotent."""


class _FinishOnExit:
    """`with tracker:` finishes it, with exit code 1 when the block raised."""

    def finish(self, exit_code: int = 0) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(0 if exc_type is None else 1)


class NoopTracker(_FinishOnExit):
    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        pass

    def hyperparameters(self, params: Mapping[str, Any]) -> None:
        pass

    def summary(self, values: Mapping[str, Any]) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass


# --- metrics.jsonl -------------------------------------------------------------------------------------------


def _scalar(value: Any) -> Any:
    # numpy and jax scalars (0-d arrays) become Python numbers; json and W&B both take those.
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def _update_json(path: Path, values: Mapping[str, Any]) -> None:
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update(json_safe(dict(values)))
    # default=str: settings such as paths or enums are recorded as text rather than refused.
    write_atomic(path, json.dumps(merged, indent=2, default=str) + "\n")


class JsonlTracker(_FinishOnExit):
    """One JSON object per step in `path`; `hparams.json` and `summary.json` beside it; `truncate_after(step)`
    for resume."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.hparams_path = self.path.with_name("hparams.json")
        self.summary_path = self.path.with_name("summary.json")
        self._file = self.path.open("a")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        line = json.dumps({"step": step, **{k: json_safe(v) for k, v in metrics.items()}}, sort_keys=False)
        self._file.write(line + "\n")
        self._file.flush()

    def hyperparameters(self, params: Mapping[str, Any]) -> None:
        _update_json(self.hparams_path, params)

    def summary(self, values: Mapping[str, Any]) -> None:
        _update_json(self.summary_path, values)

    def finish(self, exit_code: int = 0) -> None:
        self._file.close()  # closing twice is a no-op

    def truncate_after(self, step: int) -> None:
        """Keep only lines with step <= `step` (rewrite atomically)."""
        self._file.close()
        kept = [line for line in read_metrics(self.path) if line["step"] <= step]
        write_atomic(self.path, "".join(json.dumps(line) + "\n" for line in kept))
        self._file = self.path.open("a")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl, one per step: lines of one step are merged in order (a held-out evaluation
    logs its eval/* metrics in a line of its own after its step's line; step 0 is the evaluation before the
    first step). A last line cut short (its writer killed mid-line) is read as absent, with a line on stderr:
    that step is redone on resume. A bad line before the last is an error naming it."""
    path = Path(path)
    if not path.exists():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    rows: dict[Any, dict[str, Any]] = {}
    for n, line in lines:
        try:
            row = json.loads(line)
            rows.setdefault(row.get("step"), {}).update(row)
        except json.JSONDecodeError as err:
            if n != lines[-1][0]:
                raise UsageError(f"{path} line {n} is not JSON ({err.msg}); the file was changed by hand or "
                                 "damaged: remove that line (and the steps after it) to resume") from None
            print(f"{path}: its last line (line {n}) was cut short, e.g. by a kill mid-write; read as absent",
                  file=sys.stderr)
    return list(rows.values())


# --- W&B ------------------------------------------------------------------------------------------------------


def resolve_wandb_mode(mode: str | None) -> str:
    """The W&B mode a run uses: `mode` if given, else the `WANDB_MODE` environment variable, else offline."""
    return mode or os.environ.get("WANDB_MODE") or DEFAULT_WANDB_MODE


def _import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            "W&B tracking (experiment.tracking.wandb: true) needs the `wandb` package, which is not importable "
            f"here ({e}). Install it with `pip install 'wandb>=0.19'` (or reinstall rlsched, which depends on it), "
            "or set experiment.tracking.wandb: false to keep only metrics.jsonl"
        ) from e
    return wandb


_WANDB_LOG_BLOCK = 32768
_WANDB_LOG_HEADER = struct.Struct("<4sHB")  # b":W&B", magic 0xBEE1, version
_CHUNK_HEADER = struct.Struct("<IHB")  # masked crc32c, length, type: 0 padding, 1 full, 2 first, 3 middle, 4 last


def _wandb_log_payloads(data: bytes) -> Iterator[bytes]:
    """Serialized records of a W&B transaction log (LevelDB-log framing in 32 KiB blocks); a record whose
    last chunk is not written yet is left out."""
    if len(data) < _WANDB_LOG_HEADER.size:
        return
    ident, magic, _version = _WANDB_LOG_HEADER.unpack_from(data)
    if (ident, magic) != (b":W&B", 0xBEE1):
        raise ValueError("not a W&B transaction log (bad file header)")
    pos, parts = _WANDB_LOG_HEADER.size, []
    while pos + _CHUNK_HEADER.size <= len(data):
        left = _WANDB_LOG_BLOCK - pos % _WANDB_LOG_BLOCK
        if left < _CHUNK_HEADER.size:  # no room for a chunk header: the block's tail is padding
            pos += left
            continue
        _crc, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        parts.append(data[pos + _CHUNK_HEADER.size:pos + _CHUNK_HEADER.size + length])
        pos += _CHUNK_HEADER.size + length
        if kind in (1, 4) and pos <= len(data):
            yield b"".join(parts)
            parts = []


def read_wandb_log(path: str | Path) -> list[Any]:
    """The records (`wandb_internal_pb2.Record`) of a run's transaction log, `<run dir>/run-<id>.wandb`:
    what `wandb sync` uploads. For checking offline runs without a server."""
    from wandb.proto import wandb_internal_pb2 as pb

    records = []
    for payload in _wandb_log_payloads(Path(path).read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def _wandb_log_has_exit(path: Path) -> bool:
    from wandb.proto import wandb_internal_pb2 as pb

    last = list(_wandb_log_payloads(path.read_bytes()))[-4:]  # the exit record is the last one or close to it
    for payload in last:
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "exit":
            return True
    return False


class WandbTracker(_FinishOnExit):
    """One W&B run: a task's (job_type "task") or the scheduler's (job_type "scheduler"), grouped by experiment.

    Files go under `<run_dir>/wandb/`; give every run its own `run_dir`. `path` is the run's own
    directory there (`offline-run-*` or `run-*`; None when the mode is "disabled").
    """

    finish_timeout_s = 30.0
    """How long `finish` waits for W&B's service to write an offline run's exit record to disk."""

    def __init__(self, *, project: str, experiment: str, name: str, run_dir: str | Path, mode: str | None = None,
                 job_type: str = "task", tags: Sequence[str] = (), config: Mapping[str, Any] | None = None,
                 system_stats: bool = False):
        wandb = _import_wandb()
        self.name = name
        self.mode = resolve_wandb_mode(mode)
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project, group=experiment, name=name, job_type=job_type, tags=list(tags),
            config=dict(config or {}), dir=str(self.dir), mode=self.mode,
            reinit="create_new",  # several runs (tasks, scheduler) live in one process
            # Process-wide system stats would be copied into every task's run (and cost CPU): the scheduler's
            # run turns them on.
            settings=wandb.Settings(console="off", x_disable_stats=not system_stats),
        )
        self.id: str = self._run.id
        self.path: Path | None = None if self.mode == "disabled" else Path(self._run.dir).parent

    @property
    def finished(self) -> bool:
        return self._run is None

    def _live_run(self):
        if self._run is None:
            raise RuntimeError(f"W&B run {self.name!r} ({self.id}) is already finished")
        return self._run

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        # NaN and inf are fine here: W&B records them as NaN / Infinity.
        self._live_run().log({k: _scalar(v) for k, v in metrics.items()}, step=step)

    def hyperparameters(self, params: Mapping[str, Any]) -> None:
        self._live_run().config.update(dict(params), allow_val_change=True)

    def summary(self, values: Mapping[str, Any]) -> None:
        self._live_run().summary.update({k: _scalar(v) for k, v in values.items()})

    def finish(self, exit_code: int = 0) -> None:
        if self._run is None:
            return
        run, self._run = self._run, None  # a finish that raises is not retried
        run.finish(exit_code=exit_code)
        self._wait_for_log()

    def _wait_for_log(self) -> None:
        logs = list(self.path.glob("run-*.wandb")) if self.mode == "offline" and self.path is not None else []
        if not logs:
            return  # online (finish waited for the upload), disabled, or no transaction log: nothing to wait for
        deadline = time.monotonic() + self.finish_timeout_s
        while not _wandb_log_has_exit(logs[0]):
            if time.monotonic() > deadline:
                warnings.warn(f"W&B run {self.name!r} ({self.id}) finished, but its exit record was not on disk "
                              f"after {self.finish_timeout_s:.0f} s ({logs[0]}); it is written when the process "
                              "exits", RuntimeWarning, stacklevel=3)
                return
            time.sleep(0.05)


# --- fan-out ---------------------------------------------------------------------------------------------------


class MultiTracker(_FinishOnExit):
    """Gives every call to each of `trackers`, in order, even when one raises; then re-raises the first error
    (later ones are attached to it as notes)."""

    def __init__(self, trackers: Sequence[Tracker]):
        self.trackers: tuple[Tracker, ...] = tuple(trackers)

    def _each(self, method: str, *args: Any) -> None:
        first: BaseException | None = None
        for tracker in self.trackers:
            fn = getattr(tracker, method, None)
            if fn is None:
                continue  # optional methods (truncate_after) exist on some trackers only
            try:
                fn(*args)
            except Exception as e:
                if first is None:
                    first = e
                else:
                    first.add_note(f"{type(tracker).__name__}.{method} also failed: {type(e).__name__}: {e}")
        if first is not None:
            raise first

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._each("log", step, metrics)

    def hyperparameters(self, params: Mapping[str, Any]) -> None:
        self._each("hyperparameters", params)

    def summary(self, values: Mapping[str, Any]) -> None:
        self._each("summary", values)

    def finish(self, exit_code: int = 0) -> None:
        self._each("finish", exit_code)

    def truncate_after(self, step: int) -> None:
        """Resume: trackers that can rewind (metrics.jsonl) drop steps after `step`; a W&B run cannot, and
        a resumed process starts a new one."""
        self._each("truncate_after", step)


def make_trackers(tracking_cfg: TrackingSection | None, *, run_dir: str | Path, experiment: str, task: str,
                  metrics_path: str | Path | None = None, hparams: Mapping[str, Any] | None = None,
                  job_type: str = "task", system_stats: bool = False) -> MultiTracker:
    """The trackers of one run: metrics.jsonl always, W&B when `tracking_cfg.wandb`.

    `run_dir` is this run's own directory (a task's `runs/<exp>/tasks/<task>`, the scheduler's
    `runs/<exp>/scheduler`); `metrics_path` defaults to `run_dir/metrics.jsonl`; `task` names the run
    ("scheduler" for the scheduler's, with job_type "scheduler"); `hparams` are recorded at once.
    """
    run_dir = Path(run_dir)
    jsonl = JsonlTracker(metrics_path if metrics_path is not None else run_dir / "metrics.jsonl")
    trackers: list[Tracker] = [jsonl]
    try:
        if hparams is not None:
            jsonl.hyperparameters(hparams)
        if tracking_cfg is not None and tracking_cfg.wandb:
            trackers.append(WandbTracker(project=tracking_cfg.project, experiment=experiment, name=task,
                                         run_dir=run_dir, mode=tracking_cfg.mode, job_type=job_type,
                                         tags=tracking_cfg.tags, config=hparams, system_stats=system_stats))
    except BaseException:
        jsonl.finish(1)
        raise
    return MultiTracker(trackers)
