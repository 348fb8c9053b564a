"""Errors a task ends with, shared by the processes of the control plane (driver and roles).

Each message names the task and the cause; the CLI prints it as one `error:` line.
"""

from __future__ import annotations


class TaskError(RuntimeError):
    """A task cannot go on; the message names the task and the cause."""


class RoleDied(TaskError):
    """The process of one of the task's roles died (crash, OOM, ray.kill); the task cannot go on."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written (non-finite params) or read (none there, or damaged)."""


class ClusterUnreachable(RuntimeError):
    """`--address` names no Ray cluster this process can reach; the message names the address."""
