"""A run directory's owner: the live process that writes into it holds `<run_dir>/run.lock`.

    with RunLock(cfg.run_dir, echo=log, overwrite=overwrite):   # `rlsched train`, around the whole run
        ...                                                      # a second train on it: RunDirLocked (exit 2)

Design decisions (and why):
- **An OS lock, not a pid file.** `fcntl.flock` on the open lock file: the kernel drops it when the process
  ends, however it ends (Ctrl-C, kill -9, a crash), so a dead run never leaves a live-looking lock and there is
  no pid to probe (a pid may be reused; a pid on another host cannot be probed at all).
- **The file says who.** The holder writes its pid, host, start time and command line into the file it locked,
  so a refused run names them and how to stop the holder. A holder that ends cleanly empties the file; one
  that crashed leaves its record, and the next owner says it took the lock over.
- **The file is never replaced or removed.** A lock lives on an inode: writing the record with `write_atomic`
  (a new inode) or unlinking the file would let a second process lock a different inode under the same name.
  The record is written in place; `--overwrite` clears the run directory around the lock file
  (rlsched.rundir.files.prepare_run_dir). After locking, the path is checked to still name the inode locked (a
  user who deleted the directory meanwhile), and the lock is taken again if not.
- The descriptor is opened close-on-exec, so processes this run starts (Ray's, the role processes) never hold
  it: the lock ends with the process that owns the run.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

LOCK_NAME = "run.lock"


class RunDirLocked(ValueError):
    """The run directory belongs to a live run (`holder`: its record, {} when unreadable)."""

    def __init__(self, message: str, holder: dict[str, Any]):
        super().__init__(message)
        self.holder = holder


def holder_text(holder: dict[str, Any]) -> str:
    """'pid 123 on host h since 2025-01-01 12:00:00 (`rlsched train ...`)' of a lock record."""
    if not holder.get("pid"):
        return "a process whose record could not be read"
    text = f"pid {holder['pid']} on host {holder.get('host', '?')}"
    if holder.get("started"):
        text += f" since {holder['started']}"
    return text + (f" (`{holder['command']}`)" if holder.get("command") else "")


def _read(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    try:
        record = json.loads(data) if data.strip() else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def read_holder(run_dir: str | Path) -> dict[str, Any]:
    """The record in `run_dir/run.lock` ({} when there is none or it is being written)."""
    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        return _read(fd)
    finally:
        os.close(fd)


class RunLock:
    """Hold `run_dir/run.lock` for this process (creating the directory); see the module docstring.

    `acquire` raises RunDirLocked (a ValueError: exit 2 in the CLI) when a live process holds it; `overwrite`
    only changes the words of that refusal. A record left by a process that is gone is reported through
    `echo` and replaced."""

    def __init__(self, run_dir: str | Path, *, echo=print, overwrite: bool = False, command: str | None = None,
                 stop: str | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.echo, self.overwrite = echo, overwrite
        self.command = command if command is not None else shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
        self.stop = stop  # how to stop this holder, for the refusal another process prints (default: Ctrl-C / kill)
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._holder(fd)
                os.close(fd)
                raise RunDirLocked(self._refusal(holder), holder) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the file was removed or replaced after we opened it: lock the one the path names now
        previous = _read(fd)
        if previous.get("pid"):  # a clean holder empties the file: this one ended without releasing
            self.echo(f"note: {self.run_dir}'s lock was held by {holder_text(previous)}, which is no longer "
                      "running; this run takes it over")
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                  "command": self.command, **({"stop": self.stop} if self.stop else {})}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        with contextlib.suppress(OSError):  # emptied: the next owner sees a clean hand-over, not a crash
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _holder(self, fd: int) -> dict[str, Any]:
        """The holder's record; it may be writing it right now (the lock comes before the record): wait briefly."""
        for _ in range(20):
            holder = _read(fd)
            if holder.get("pid"):
                return holder
            time.sleep(0.05)
        return {}

    def _refusal(self, holder: dict[str, Any]) -> str:
        what = "--overwrite would delete it under that run" if self.overwrite else "a second run would write into it"
        pid = holder.get("pid")
        if holder.get("stop"):
            stop = f"stop it first ({holder['stop']})"
        elif pid and holder.get("host") == socket.gethostname():
            stop = f"stop it first (Ctrl-C in its terminal, or `kill {pid}`)"
        elif pid:
            stop = f"stop it first (Ctrl-C in its terminal, or `kill {pid}` on {holder.get('host')})"
        else:
            stop = "stop it first"
        return (f"{self.run_dir} is in use by a live run: {holder_text(holder)}; {what}. {stop}, or choose another "
                "name with --set experiment.name=...")
