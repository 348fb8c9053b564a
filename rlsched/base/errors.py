"""Errors a task ends with, shared by the processes of the control plane (driver and roles).

Each message names the task and the cause; the CLI prints it as one `error:` line.
"""

from __future__ import annotations

import re


class UsageError(ValueError):
    """What the user gave cannot work (a command's arguments, a file): the CLI prints it as one line, exit 2."""


def is_input_error(err: BaseException) -> bool:
    """Whether `err` says what to fix in the user's input (a config, a file, a command line): every ValueError
    subclass rlsched defines (ConfigError, RunDirError, DataError, ModelConfigError, ...) is one, and so is a
    CheckpointError (none there, or damaged). A plain ValueError, or any other exception, is a bug."""
    if isinstance(err, CheckpointError):
        return True
    ours = type(err).__module__.split(".")[0] in ("rlsched", "workers", "benchmarks")
    return isinstance(err, ValueError) and type(err) is not ValueError and ours


class TaskError(RuntimeError):
    """A task cannot go on; the message names the task and the cause."""


class RoleDied(TaskError):
    """The process of one of the task's roles died (crash, OOM, ray.kill, lost node). `role`: "actor" or
    "engine"; `shared`: the process held other tasks' roles too (a device-group process), so it is not the task's
    own to restart (rlsched.run.task restarts a role under `max_restarts`)."""

    def __init__(self, message: str, role: str | None = None, shared: bool = False):
        super().__init__(message)
        self.role, self.shared = role, shared

    def __reduce__(self):  # keeps role and shared (and the notes) through pickling, e.g. in Ray's errors
        return type(self), (str(self), self.role, self.shared), self.__dict__


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written (non-finite params) or read (none there, or damaged)."""


class ClusterUnreachable(RuntimeError):
    """`--address` names no Ray cluster this process can reach; the message names the address."""


def cause_of(err: BaseException) -> str:
    """"<Type>: <message> (<where>)" of the error a role or a driver raised, through Ray's wrapping (a role's
    error re-raised by its driver is a RayTaskError whose cause is another): the original type and message,
    with the notes each level added (task, step, role and call)."""
    import ray

    notes: list[str] = []
    while True:
        notes += [n for n in getattr(err, "__notes__", ()) if n not in notes]
        inner = getattr(err, "cause", None)
        if not isinstance(err, ray.exceptions.RayTaskError) or not isinstance(inner, BaseException):
            break
        err = inner
    created = creation_error(err)
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    text = created or f"{type(err).__name__}: {message}"
    return text + (f" ({'; '.join(reversed(notes))})" if notes else "")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def plain_text(err: BaseException) -> str:
    """`str(err)` without ANSI colour codes: Ray's error text (its process's name coloured, then the traceback) as a
    file or a log keeps it."""
    return _ANSI.sub("", str(err))


def creation_error(err: BaseException) -> str | None:
    """"<Type>: <message>" of the exception a Ray actor's constructor raised, or None when `err` is not Ray's report
    of one. Ray reports it as an ActorDiedError that keeps only text: "The actor died because of an error raised in
    its creation task, " + its process's name in ANSI colours + the traceback, which ends with the exception's
    own lines (format_exception_only: the type, qualified by its module, then the message). Roles are built by a
    method instead (rlsched.run.roles), so their errors arrive whole; this reads the other actors' (a device group's
    host, a scheduler) without colour codes or Ray's wrapper."""
    if not getattr(err, "actor_init_failed", False):
        return None
    lines = plain_text(err).splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    after = lines[frames[-1] + 1:] if frames else lines[1:]  # the last frame's source lines are indented
    own = next((line for line in after if line.strip() and not line.startswith(" ")), None)
    if own is None:
        return None
    kind, colon, message = own.partition(":")
    return f"{kind.rpartition('.')[2]}{colon}{message}"


class ClusterTooSmall(RuntimeError):
    """The Ray cluster cannot hold a device group: fewer nodes with its devices than cluster.hosts."""
