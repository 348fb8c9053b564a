"""Errors a task ends with, shared by the processes of the control plane (driver and roles).

Each message names the task and the cause; the CLI prints it as one `error:` line.
"""

from __future__ import annotations


class TaskError(RuntimeError):
    """A task cannot go on; the message names the task and the cause."""


class RoleDied(TaskError):
    """The process of one of the task's roles died (crash, OOM, ray.kill, lost node). `role`: "actor" or
    "engine"; `shared`: the process held other tasks' roles too (a device-group host), so it is not the task's
    own to restart (rlsched.task restarts a role under `max_restarts`)."""

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
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {message}" + (f" ({'; '.join(reversed(notes))})" if notes else "")


class ClusterTooSmall(RuntimeError):
    """The Ray cluster cannot hold a device group: fewer nodes with its devices than cluster.hosts."""
