"""Stopping a run when the user asks (Ctrl-C, SIGTERM): the first signal lets every task finish the step it
is in and save a checkpoint there; a second stops at once.

    with StopSignals(echo) as stop:          # in the main thread, around the wait for the tasks
        ...                                  # poll `stop.requested` (never call Ray from the handler)
    if stop.signum: raise Stopped(stop.signum, hint)

Design decisions (and why):
- **The handler only records.** A signal handler runs between two bytecodes of the main thread, which may
  be inside Ray's own wait; it sets a flag and prints one line, and the loop that waits for the tasks
  sends the stop requests. Only the second signal raises (`Interrupted`), to leave at once.
- **A step is the unit of work that is never cut.** A task stops at the end of the step in progress (its
  TRAIN hold saves a checkpoint there), so a resumed run redoes nothing and skips nothing: its metrics
  equal an uninterrupted run's. The wait is bounded by one step (plus its lock waits).
- **Exit codes as shells expect:** 128 + the signal (130 for SIGINT, 143 for SIGTERM), with no traceback.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A second signal: the run is being torn down now, without waiting for the tasks."""

    def __init__(self, signum: int):
        super().__init__(f"stopped at once by a second {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Stopped(Exception):
    """The run stopped on a signal after every task saved its last completed step; `results` as the run's."""

    def __init__(self, signum: int, results: dict, message: str):
        super().__init__(message)
        self.signum, self.results = signum, results

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """SIGINT and SIGTERM handlers for the duration of a `with` block (main thread only; elsewhere a no-op,
    as Python allows handlers in the main thread only). The previous handlers come back on exit."""

    def __init__(self, echo=print, *, raise_on_second: bool = True):
        """raise_on_second=False: a second signal only sets `interrupted`, for a loop that polls it (Ray turns
        an exception raised by a handler inside its own wait into a SystemError)."""
        self.echo, self.signum, self.raise_on_second = echo, None, raise_on_second
        self.interrupted: int | None = None  # the second signal, once it came
        self.on_request = None  # called by the first signal's handler: it must only set a flag (in-process runs)
        self._saved: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def check(self) -> None:
        """Raise `Interrupted` if a second signal came (for loops with raise_on_second=False)."""
        if self.interrupted is not None:
            raise Interrupted(self.interrupted)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            self.interrupted = signum
            if self.raise_on_second:
                raise Interrupted(signum)
            return
        self.signum = signum
        name = signal.Signals(signum).name
        self.echo(f"{name}: every task finishes the step it is in and saves a checkpoint there, then the run "
                  f"writes its outputs and stops ({name} again to stop at once, losing the steps since each "
                  "task's last checkpoint)")
        if self.on_request is not None:
            self.on_request()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._saved[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, previous in self._saved.items():
            signal.signal(s, previous)
        self._saved.clear()
