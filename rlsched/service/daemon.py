"""`rlsched up` and `rlsched down`: the scheduler service's process, the Ray cluster it starts or joins, and
how the other commands find it.

    info = up({"num_devices": 1, "placement": "colocated", ...})   # returns once the service answers
    service, info = connect()                                       # any later command, any terminal
    down(force=False)                                               # tasks checkpoint, every process ends

The state directory ($RLSCHED_HOME, else ~/.rlsched) holds:
    service.json   pid of the service process, the Ray address, settings (written once the service answers)
    service.log    what the service process printed
    tasks.json     every task's record (rlsched.service.server), kept across services

Design decisions (and why):
- **A process of its own, in a session of its own.** `up` starts `python -m rlsched.service.daemon` detached from
  the terminal (setsid), so closing the terminal ends nothing. That process is the Ray driver that started
  the embedded cluster (or joined `--address`); the service itself is a detached named actor in the
  "rlsched" namespace, which every other command reaches with one `ray.get_actor`.
- **Only its owner gets in.** Ray's servers listen on every interface of the machine (the pinned Ray turns a
  127.0.0.1 node address into the machine's own), so what keeps others out is Ray's token authentication:
  on, with the token the owner's alone (rlsched.cluster.security), and checked at start by a client without the token
  that must be refused; `status` says what was found. Off only with `--insecure`, and then every command
  says so. Clients are told the mode (never the token itself: Ray reads it from its file).
- **`down` stops only what `up` started.** The record holds the service process's pid, its start time and
  its command line; when the process with that pid now is another one (after a crash or a reboot), nothing
  is signalled and the record is cleared.
- **`down` signals, the process cleans up.** SIGTERM: the service cancels pending tasks and stops running
  ones after they save their step, then the process kills the actor and shuts Ray down (which ends every
  process the embedded cluster started). SIGUSR1 (`--force`): the same without waiting for any task. A
  process that does not end in time is killed with its whole process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from rlsched.rundir.files import write_atomic
from rlsched.service.server import NAME, NAMESPACE

READY_TIMEOUT_S = 180.0
SHUTDOWN_GRACE_S = 600.0  # a graceful `down`: running tasks' time to save their step and stop (Service.shutdown)
SHUTDOWN_ANSWER_S = 60.0  # beyond that (from the start, with --force), the longest wait for the service's answer
# (`down` itself waits 900 s, longer than both, before it kills the process group)


class NoService(RuntimeError):
    """No scheduler service is running (or the one recorded has gone)."""


class ServiceError(RuntimeError):
    """The service could not be started, reached or stopped; the message says what happened."""


def state_dir() -> Path:
    return Path(os.environ.get("RLSCHED_HOME") or Path.home() / ".rlsched")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie (exited, not yet reaped) is not running
        if Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z"):
            return False
    return True


def process_identity(pid: int) -> dict[str, Any] | None:
    """What tells process `pid` apart from a later one given the same pid: its start time (clock ticks since
    boot) and command line, from /proc; None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return {"start_ticks": int(stat.rsplit(") ", 1)[-1].split()[19]),  # field 22 of proc(5), after the name
            "cmdline": [w.decode(errors="replace") for w in cmdline if w]}


def read_info() -> dict[str, Any] | None:
    """The running service's record, or None (none was started, or its process is gone). A record whose pid
    now belongs to another process (the service died, its pid was given again) is cleared, with a line on stderr:
    `down` must never signal that process."""
    path = state_dir() / "service.json"
    if not path.exists():
        return None
    info = json.loads(path.read_text())
    if not _alive(info["pid"]):
        return None
    recorded, now = info.get("identity"), process_identity(info["pid"])
    if recorded is not None and now is not None and recorded != now:
        print(f"the scheduler recorded in {path} (pid {info['pid']}) is gone; pid {info['pid']} is now another "
              f"process ({' '.join(now['cmdline'])[:80]}), left alone; the record is cleared", file=sys.stderr)
        path.unlink(missing_ok=True)
        return None
    return info


def up(settings: dict[str, Any], *, address: str | None = None, echo=print) -> dict[str, Any]:
    """Start the service (and an embedded Ray unless `address`) in a detached process; return its record once it
    answers. One already running is returned as it is, with a line saying so."""
    info = read_info()
    if info is not None:
        echo(f"a scheduler is running already (pid {info['pid']}, Ray at {info['address']}); "
             "`rlsched status` shows its tasks, `rlsched down` stops it")
        return info
    from rlsched.cluster.security import private_dir

    where = private_dir(state_dir())  # 0700: its records name configs, directories and commands
    (where / "service.json").unlink(missing_ok=True)  # a dead service's record
    if address is not None:
        from rlsched.cluster.ray_cluster import check_reachable

        check_reachable(address)
    log = where / "service.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rlsched.service.daemon", json.dumps({"settings": settings,
                                                                                     "address": address})],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=where)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        info = read_info()
        if info is not None and info["pid"] == proc.pid:
            return info
        if proc.poll() is not None:
            raise ServiceError(f"the scheduler service exited (code {proc.returncode}) before it answered; the end "
                               f"of {log}:\n" + _tail(log))
        time.sleep(0.2)
    proc.kill()
    raise ServiceError(f"the scheduler service did not answer in {READY_TIMEOUT_S:.0f} s; the end of {log}:\n"
                       + _tail(log))


def _tail(path: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no output)"


def connect():
    """(service actor handle, its record), from any process; NoService when none runs."""
    info = read_info()
    if info is None:
        raise NoService("no scheduler running; start one with `rlsched up`")
    if info.get("auth") == "token":  # before Ray is imported: it reads the mode once (the token from its own file)
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    elif info.get("auth") == "disabled":  # the service was started with --insecure: every command says so
        from rlsched.cluster.security import INSECURE_LINE

        print(INSECURE_LINE, file=sys.stderr)
    import ray

    from rlsched.cluster.ray_cluster import init_ray

    init_ray(info["address"], log_to_driver=False, namespace=NAMESPACE, probe=False)  # its process runs
    try:
        return ray.get_actor(NAME, namespace=NAMESPACE), info
    except ValueError:
        raise NoService(f"the scheduler process {info['pid']} runs, but its service actor is gone; "
                        "`rlsched down --force` clears it, then `rlsched up`") from None


def call(method, *args, timeout_s: float = 60.0, attempts: int = 3):
    """A service method called with a request id where it takes one: a call that times out is sent again with
    the same id, which the service answers as the first time (never done twice)."""
    import ray

    last = None
    for _ in range(attempts):
        try:
            return ray.get(method.remote(*args), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            last = err
    raise ServiceError(f"the scheduler did not answer in {attempts} tries of {timeout_s:.0f} s") from last


def request_id() -> str:
    return uuid.uuid4().hex


def down(*, force: bool = False, echo=print, timeout_s: float = 900.0) -> int:
    """Stop the service and what it started; returns its pid. Graceful unless `force` (see the module docstring)."""
    info = read_info()
    if info is None:
        raise NoService("no scheduler running; nothing to stop")
    pid = info["pid"]
    os.kill(pid, signal.SIGUSR1 if force else signal.SIGTERM)
    echo("stopping the scheduler: " + ("at once (--force)" if force else
                                       "running tasks save their step and stop (Ctrl-C, then `rlsched down --force`, "
                                       "to stop at once)"))
    deadline = time.monotonic() + (60.0 if force else timeout_s)
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid):
        echo(f"the scheduler process {pid} did not end in time: killing its process group")
    try:
        os.killpg(pid, signal.SIGKILL)  # anything of its session still there (it leads its own group)
    except ProcessLookupError:
        pass  # nothing of it is left
    except PermissionError as err:
        echo(f"the scheduler's process group {pid} could not be killed ({err}): what is left of it runs on")
    (state_dir() / "service.json").unlink(missing_ok=True)
    return pid


# ---- the service process -------------------------------------------------------------------------------------


def shut_down(service, force: bool, *, grace_s: float = SHUTDOWN_GRACE_S, answer_s: float = SHUTDOWN_ANSWER_S) -> str:
    """Ask the service to shut down (`force`: at once; else its running tasks get `grace_s` to save and stop) and
    wait for its answer, `answer_s` beyond that at most; the line service.log gets: its answer, or what went wrong
    (the caller ends its processes either way)."""
    from rlsched.base.waits import answer

    try:
        return str(answer(service.shutdown.remote(force, grace_s), timeout_s=(0 if force else grace_s) + answer_s,
                          what="the service's shutdown()", check="its actor may hang (its lines are above in this "
                          "log); its processes are ended all the same"))
    except Exception as err:  # noqa: BLE001 - said in service.log; ending the processes must still happen
        return f"the shutdown did not finish: {type(err).__name__}: {err}"


def default_devices() -> int:
    """Devices per group when `up` is given none: a node's accelerators, or one (CPU: host devices per process)."""
    import ray

    from rlsched.cluster.ray_cluster import device_resource

    resource = device_resource()
    if resource == "CPU":
        return 1
    return int(max(n["Resources"].get(resource, 0) for n in ray.nodes() if n["Alive"]))


def serve(settings: dict[str, Any], address: str | None) -> int:
    """The body of `python -m rlsched.service.daemon`: start Ray and the service, write service.json, wait for a
    signal."""
    import ray

    from rlsched.cluster.ray_cluster import init_ray
    from rlsched.cluster.security import enforced, insecure_allowed
    from rlsched.service.server import Service

    where = state_dir()
    init_ray(address, log_to_driver=False, namespace=NAMESPACE)
    mode = os.environ.get("RAY_AUTH_MODE", "").lower() or "disabled"  # what Ray settled on for this client
    checked = enforced(ray.get_runtime_context().gcs_address)  # a client without the token must be refused
    print(f"Ray's token authentication: {mode}; a client without the token was "
          + {True: "refused", False: "let in", None: "not answered either way"}[checked], flush=True)
    if checked is False and not insecure_allowed():
        print("refused: the Ray cluster lets in clients without a token, and anyone who can reach it could run code "
              "as you; start it with token authentication (RAY_AUTH_MODE=token), or pass --insecure to `rlsched up` "
              "to run on it anyway", flush=True)
        ray.shutdown()
        return 1
    stop: dict[str, bool] = {}  # after Ray's start: it installs a SIGTERM handler of its own that ends the process
    signal.signal(signal.SIGTERM, lambda *_: stop.setdefault("force", False))
    signal.signal(signal.SIGUSR1, lambda *_: stop.update(force=True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # no terminal of its own; `down` is how it stops
    settings = dict(settings)
    if settings.get("num_devices") is None:
        settings["num_devices"] = default_devices()
    service = ray.remote(Service).options(name=NAME, namespace=NAMESPACE, lifetime="detached", num_cpus=0,
                                          max_concurrency=16, max_restarts=0).remote(settings, str(where))
    try:
        settings = ray.get(service.info.remote(), timeout=READY_TIMEOUT_S)["settings"]  # as resolved (processes)
    except Exception as err:  # noqa: BLE001 - said in service.log, and `up` shows its end
        print(f"the service did not start: {type(err).__name__}: {err}", flush=True)
        _kill(service)
        ray.shutdown()
        return 1
    info = {"pid": os.getpid(), "identity": process_identity(os.getpid()),
            "address": ray.get_runtime_context().gcs_address, "namespace": NAMESPACE,
            "settings": settings, "started": time.time(), "started_ray": address is None,
            "auth": mode, "auth_enforced": checked}
    write_atomic(where / "service.json", json.dumps(info, indent=1) + "\n")
    print(f"scheduler service ready: Ray at {info['address']}, settings {settings}", flush=True)
    code = 0
    while "force" not in stop:
        time.sleep(0.5)
        try:  # the service's process died (an OOM kill, a crash): this one ends too, and the next `up` reports it
            ray.get(service.info.remote(), timeout=30)
        except Exception as err:  # noqa: BLE001
            print(f"the service actor is gone ({type(err).__name__}); stopping", flush=True)
            code = 1
            break
    if code == 0:
        force = stop["force"]
        print("shutting down" + (" at once (--force)" if force else ": running tasks stop after saving"), flush=True)
        print(shut_down(service, force), flush=True)
    _kill(service)
    (where / "service.json").unlink(missing_ok=True)
    ray.shutdown()
    return code


def _kill(service) -> None:
    """End the service actor; a failure is said in service.log (Ray's shutdown next ends it with its workers)."""
    import ray

    try:
        ray.kill(service)
    except Exception as err:  # noqa: BLE001 - said, not raised: the process goes on to shut Ray down
        print(f"the service actor was not killed ({type(err).__name__}: {err}); Ray's shutdown ends it", flush=True)


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    raise SystemExit(serve(request["settings"], request["address"]))
