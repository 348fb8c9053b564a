"""runs/<experiment>/run.log: the run as it happened, timed, including what the terminal is spared.

    with RunLog(run_dir / "run.log", echo=print) as echo:   # `echo` prints a line and logs it
        echo("[addition] step    1/60 ...")
        echo.note("role processes' own output: ...")        # the log only

Design decisions (and why):
- **Everything the command prints, and what it keeps off the terminal.** Every printed line lands here
  with its wall-clock time; so do Python warnings and log records of this process (`logging.captureWarnings`
  and a root handler at WARNING), which otherwise would be printed between the progress lines. With this
  handler installed, Python's last-resort handler stays silent: the terminal shows only rlsched's lines.
- **Role processes keep their own logs.** What a library prints in a role's process goes to Ray's log
  files for that process; the run log says where they are (and summary.json's `roles` gives the pids).
- **Appended.** A resumed run adds to the log of the run it continues, after a header line.
- No jax, no ray.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path


class RunLog:
    """A line printer that also writes each line, and this process's warnings, to `path`."""

    def __init__(self, path: str | Path, echo=print):
        self.path = Path(path)
        self._echo = echo
        self._file = None
        self._handler: logging.Handler | None = None
        self._captured = False

    def __enter__(self) -> RunLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - closed in __exit__
        self.note(f"=== pid {os.getpid()}: {' '.join(sys.argv)}")
        self._handler = logging.StreamHandler(self._file)
        self._handler.setLevel(logging.WARNING)
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(self._handler)
        logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger -> this file
        self._captured = True
        return self

    def __exit__(self, *exc) -> None:
        if self._captured:
            logging.captureWarnings(False)
            self._captured = False
        if self._handler is not None:
            logging.getLogger().removeHandler(self._handler)
            self._handler = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __call__(self, line: str) -> None:
        self.note(line)
        self._echo(line)

    def note(self, line: str) -> None:
        """Into the log only."""
        if self._file is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            self._file.write("".join(f"{stamp} {part}\n" for part in str(line).splitlines() or [""]))
