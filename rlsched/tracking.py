"""Per-task metric trackers. Today: metrics.jsonl (always) and a no-op twin; W&B joins later.

A tracker is append-only and crash-safe: each line is written and flushed whole, and a resumed
run first drops the lines written after its checkpoint, so metrics continue exactly.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def finish(self) -> None: ...


class NoopTracker:
    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def finish(self) -> None:
        pass


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)  # JSON has no NaN/inf; keep them visible
    return value


class JsonlTracker:
    """One JSON object per step in `path`; `truncate_after(step)` for resume."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        line = json.dumps({"step": step, **{k: _json_safe(v) for k, v in metrics.items()}}, sort_keys=False)
        self._file.write(line + "\n")
        self._file.flush()

    def finish(self) -> None:
        self._file.close()

    def truncate_after(self, step: int) -> None:
        """Keep only lines with step <= `step` (rewrite atomically)."""
        self._file.close()
        kept = [line for line in read_metrics(self.path) if line["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(line) + "\n" for line in kept))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
