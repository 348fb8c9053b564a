"""How a role's process ended, told by what it left behind: "killed by signal 9 (SIGKILL)", "out of memory",
"crashed: Segmentation fault", instead of Ray's "the actor died unexpectedly".

    exits.watch()                # in the role's process, at start (a no-op unless rlsched started it)
    ...                          # the process dies
    exits.explain(actor_died)    # in whoever called it: "killed by signal 9 (SIGKILL)" or None

Design decisions (and why):
- **Nobody can wait() for a role.** Its parent is Ray's raylet, which reaps it and does not log how it
  ended; so the process records what it can while alive, in files on its node
  (`<tmp>/rlsched-<uid>/exits/<pid>.*`):
  - `<pid>.json` at start: its pid and the kernel's out-of-memory kill count then;
  - `<pid>.SIGTERM` (and SIGINT, SIGHUP, SIGQUIT): written by `faulthandler.register(..., chain=True)`
    when that signal arrives, from C, in the signal handler (async-signal safe, works while Python is
    blocked) before Ray's own handler runs as before;
  - `<pid>.fatal`: a crash (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) with its Python traceback, by
    `faulthandler.enable` (instead of Ray's worker log, where nobody would look);
  - `<pid>.exited`: the interpreter shut down (atexit).
- **SIGKILL cannot be caught**, so it is the one way a watched process ends with no record at all. The
  kernel's OOM killer uses it too: the kill count (the cgroup's, else the node's /proc/vmstat) that rose
  since the start tells the two apart. Ray's own memory monitor and `ray.kill` say so in Ray's message.
- **The record is on the role's node.** Read in place when the caller shares the node, else by a small Ray
  task pinned to it (a dead node is said to be gone).
- Records of processes gone for an hour are pruned when a new role starts (a death is explained within
  seconds of it).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import re
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from rlsched.base.errors import creation_error
from rlsched.cluster.security import open_private, private_dir
from rlsched.rundir.files import write_atomic

ENV = "RLSCHED_RECORD_EXIT"  # set in the environment of the role processes rlsched starts (cluster.role_env)
CAUGHT = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_open_files: list[Any] = []  # faulthandler writes to these until the process ends


def records_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"rlsched-{os.getuid()}" / "exits"


def watch(directory: Path | None = None) -> bool:
    """Record, from now on, how this process ends (when rlsched started it: `ENV` set, or `directory`
    given). True if it does."""
    if directory is None and os.environ.get(ENV) != "1":
        return False
    if _open_files:
        return True  # watched already (a device-group process and the roles it holds share the process)
    directory = private_dir(directory or records_dir())  # 0700: nobody else can plant a link to be written through
    _prune(directory)
    pid = os.getpid()
    for old in directory.glob(f"{pid}.*"):  # a record of an earlier process with this pid
        old.unlink(missing_ok=True)
    counter = oom_kill_counter()
    start = {"pid": pid, "started": time.time(),
             "oom": None if counter is None else {"path": counter[0], "count": counter[1]}}
    write_atomic(directory / f"{pid}.json", json.dumps(start))
    for name in CAUGHT:
        f = open_private(directory / f"{pid}.{name}")  # kept open for the signal handler
        faulthandler.register(getattr(signal, name), file=f, all_threads=False, chain=True)
        _open_files.append(f)
    f = open_private(directory / f"{pid}.fatal")
    faulthandler.enable(file=f, all_threads=True)
    _open_files.append(f)
    atexit.register(_exited, directory / f"{pid}.exited")
    return True


def _exited(path: Path) -> None:
    """At interpreter shutdown (sys.exit, a SystemExit from a signal handler)."""
    with contextlib.suppress(OSError), open_private(path) as f:
        f.write("exited")


def oom_kill_counter(pid: int | str = "self") -> tuple[str, int] | None:
    """(file, count) of out-of-memory kills in `pid`'s memory cgroup (v2 memory.events or v1
    memory.oom_control), else on the node (/proc/vmstat); None where none can be read."""
    candidates: list[Path] = []
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            if hierarchy == "0" and not controllers:
                candidates += [Path(root + path) / "memory.events"
                               for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")]
            elif "memory" in controllers.split(","):
                candidates += [Path("/sys/fs/cgroup/memory" + path) / "memory.oom_control"]
    for path in [*candidates, Path("/proc/vmstat")]:
        count = _oom_kills(path)
        if count is not None:
            return str(path), count
    return None


def _oom_kills(path: str | Path) -> int | None:
    """The `oom_kill <n>` line of a memory.events / memory.oom_control / vmstat file, or None."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return None


def read_record(pid: int, directory: Path | None = None) -> dict[str, Any] | None:
    """What process `pid` left behind: {"start", "signals": [...], "fatal": text, "exited", "oom_now"}; None
    if it left nothing (it was not watched)."""
    directory = directory or records_dir()
    try:
        start = json.loads((directory / f"{pid}.json").read_text())
    except (OSError, ValueError):
        return None
    signals = [name for name in CAUGHT if _size(directory / f"{pid}.{name}")]
    fatal = (directory / f"{pid}.fatal").read_text(errors="replace") if _size(directory / f"{pid}.fatal") else ""
    exited = (directory / f"{pid}.exited").exists()
    oom_now = _oom_kills(start["oom"]["path"]) if start.get("oom") else None
    return {"start": start, "signals": signals, "fatal": fatal, "exited": exited, "oom_now": oom_now}


def describe(record: dict[str, Any] | None, ray_message: str = "") -> str | None:
    """One phrase for how the process ended (pure: from its record and Ray's message); None if unknown."""
    if "ray.kill" in ray_message:
        return "ended by ray.kill()"
    if re.search(r"low on memory|OutOfMemoryError|memory monitor", ray_message):
        return "out of memory: Ray's memory monitor killed it (the node ran low on memory)"
    if record is None:
        return None
    if record["fatal"]:
        first = next((line for line in record["fatal"].splitlines() if line.strip()), "")
        frames = [line.strip() for line in record["fatal"].splitlines() if line.strip().startswith("File ")]
        return "crashed: " + first.removeprefix("Fatal Python error: ") + (f" ({frames[0]})" if frames else "")
    if record["signals"]:
        name = record["signals"][0]
        return f"killed by signal {int(getattr(signal, name))} ({name})"
    if record.get("exited"):
        return "exited: its Python interpreter shut down (sys.exit, or a SystemExit nobody caught)"
    oom = record["start"].get("oom")
    if oom is not None and record["oom_now"] is not None and record["oom_now"] > oom["count"]:
        return (f"out of memory: killed by the kernel's OOM killer (oom_kill in {oom['path']} rose from "
                f"{oom['count']} to {record['oom_now']} while it ran)")
    return f"killed by signal {int(signal.SIGKILL)} (SIGKILL): it ended without running any handler, " \
           "and no out-of-memory kill was counted"


def explain(err: BaseException) -> str | None:
    """How the process behind Ray error `err` (an ActorDiedError naming its pid and ip) ended, or None."""
    message = str(err)
    pid, ip = re.search(r"\bpid: (\d+)", message), re.search(r"\bip: (\S+)", message)
    record = None
    if pid is not None:
        try:
            record = _read_on(ip.group(1) if ip else None, int(pid.group(1)))
        except NodeGone as gone:
            return str(gone)
    return describe(record, message)


def death_cause(err: BaseException) -> str:
    """How it ended if known, else the first line of Ray's message (for RoleDied's text)."""
    created = creation_error(err)  # its constructor raised: that error, not the process's end, is the cause
    if created is not None:
        return f"its constructor raised {created}"
    text = str(err).strip()
    explained = explain(err)
    if explained is None and "The actor was restarted" in text:  # a call in flight when its process ended
        return "its process ended while the call ran, and Ray restarted it without its roles"
    return explained or (text.splitlines()[0] if text else type(err).__name__)


class NodeGone(RuntimeError):
    """The role's node left the cluster: its record went with it."""


def _read_on(ip: str | None, pid: int) -> dict[str, Any] | None:
    import ray

    local = read_record(pid)
    if local is not None or ip is None or not ray.is_initialized() or ip == ray.util.get_node_ip_address():
        return local
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("NodeManagerAddress") == ip]
    alive = [n for n in nodes if n.get("Alive")]
    if nodes and not alive:
        raise NodeGone(f"its node {ip} left the cluster (a lost node)")
    if not alive:
        return None
    ref = ray.remote(read_record).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        alive[0]["NodeID"], soft=False)).remote(pid)
    try:
        return ray.get(ref, timeout=30)
    except Exception:  # noqa: BLE001 - the explanation is a courtesy; the death itself is reported anyway
        return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _prune(directory: Path, older_than_s: float = 3600.0) -> None:
    """Drop records of processes that ended more than an hour ago (nobody asked how)."""
    now = time.time()
    for path in directory.glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(path.name.split(".")[0])
            if not Path(f"/proc/{pid}").exists() and now - path.stat().st_mtime > older_than_s:
                for p in directory.glob(f"{pid}.*"):
                    p.unlink(missing_ok=True)
