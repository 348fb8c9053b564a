"""What a person watching `rlsched train` sees: every task's lines, printed by the command itself, and on a
terminal one live row per task.

    driver = TaskDriver(spec, locks, echo=LineBuffer())    # in the driver's Ray actor: lines wait to be pulled
    with ProgressView(echo) as view:                         # in the command's process
        view.show(ray.get(driver.poll.remote()))             # its new lines, then its row (state, step, ETA)

Design decisions (and why):
- **Pulled, not forwarded.** Drivers keep their lines until the command polls them (twice a second), and
  the command prints them as they are: no Ray process tags, in the same plain format everywhere
  (`[task] step    5/80  reward ...`). Ray's forwarding of worker output stays off, so what libraries
  print in role processes goes to Ray's log files, not over the progress (the command says where).
- **A live table on a terminal only.** With stdout a terminal, rich draws one row per task (state,
  step/steps, reward, phase or the lock waited for, step time, ETA) below the lines; otherwise (CI,
  files, `nohup`) the lines alone, one per task per step, as they always were.
"""

from __future__ import annotations

import sys
import threading
from typing import Any


class LineBuffer:
    """A driver's `echo` when the driver runs in a Ray actor: lines wait here until `drain`. Pickled empty
    (it crosses to the actor's process with the driver's arguments)."""

    def __init__(self):
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)

    def drain(self) -> list[str]:
        with self._lock:
            lines, self._lines = self._lines, []
        return lines

    def __getstate__(self):
        return {}

    def __setstate__(self, state) -> None:
        self.__init__()


def eta_s(done: int, total: int, seconds_per_step: float | None) -> float | None:
    """Seconds left at the mean step time so far; None before the first step."""
    if total and done >= total:
        return 0.0
    return None if seconds_per_step is None else (total - done) * seconds_per_step


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressView:
    """Prints polled lines; on a terminal (or `live=True`) also keeps a live table of the tasks' rows."""

    COLUMNS = ("task", "state", "step", "reward", "phase", "step time", "ETA")

    def __init__(self, echo=print, *, live: bool | None = None):
        self.echo = echo
        self.live = sys.stdout.isatty() if live is None else live
        self.rows: dict[str, dict[str, Any]] = {}
        self._live = None

    def __enter__(self) -> ProgressView:
        if self.live:
            from rich.live import Live

            self._live = Live(self._table(), refresh_per_second=4, transient=False, redirect_stdout=True,
                              redirect_stderr=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(*exc)
            self._live = None

    def show(self, task: str, poll: dict[str, Any]) -> None:
        """A driver's poll: print its new lines, then update its row."""
        for line in poll.get("lines", ()):
            self.echo(line)
        self.rows[task] = poll
        if self._live is not None:
            self._live.update(self._table())

    def row(self, task: str) -> tuple[str, ...]:
        p = self.rows.get(task, {})
        reward = p.get("reward")
        return (task, p.get("state", "starting"), f"{p.get('step', 0)}/{p.get('steps', '?')}",
                "-" if reward is None else f"{reward:.3f}", p.get("phase") or "-",
                "-" if p.get("step_s") is None else f"{p['step_s']:.2f}s",
                _clock(eta_s(p.get("step", 0), p.get("steps", 0), p.get("mean_step_s"))))

    def _table(self):
        from rich.table import Table

        table = Table(box=None, pad_edge=False)
        for column in self.COLUMNS:
            table.add_column(column, justify="right" if column in ("step", "reward", "step time", "ETA") else "left")
        for task in self.rows:
            table.add_row(*self.row(task))
        return table
