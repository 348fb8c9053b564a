"""A role held by the first host of a device group across hosts (an engine, an actor within one host) whose call
fails because another host of the group died reports that death, as the roles spanning the hosts do: the broken
JAX job is the cause, not whatever error it left on the first host (a deleted buffer, a failed collective). Real
Ray actors stand for the hosts' processes; one of them is killed."""

from __future__ import annotations

import sys

import pytest
from ray import cloudpickle

from rlsched.base.errors import RoleDied
from rlsched.cluster.group_process import GroupProcesses, GroupProcessRole

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Host travels by value into the Ray actors


class Host:
    """A host's device-group process as GroupProcessRole calls it: `call` fails as a broken job's call may."""

    def where(self) -> dict:
        import os

        return {"pid": os.getpid()}

    def call(self, key, method, args, kwargs):
        raise ValueError("Buffer has been deleted or donated")


def _group(ray, n: int) -> GroupProcesses:
    members = [ray.remote(num_cpus=0)(Host).remote() for _ in range(n)]
    pids = [ray.get(m.where.remote())["pid"] for m in members]
    nodes = [{"host": "127.0.0.1", "pid": pid, "node_id": "abcdef0123"} for pid in pids]
    return GroupProcesses(members, nodes, "127.0.0.1:1")


def test_a_failed_call_on_the_first_host_names_the_other_host_that_died(ray_session):
    ray = ray_session
    group = _group(ray, 2)
    role = GroupProcessRole(group.first, "t0/engine", "engine", timeout_s=30, group=group)
    dead_pid = group.nodes[1]["pid"]
    ray.kill(group.members[1], no_restart=True)
    with pytest.raises(RoleDied) as died:
        role.generate()
    message = str(died.value)
    assert died.value.shared and message.startswith(f"member 1 of 2 (host 127.0.0.1, pid {dead_pid}, node abcdef01)")
    assert "breaking their JAX job" in message and "generate()" in message and "ValueError there" in message, message
    for m in group.members:
        ray.kill(m)


def test_a_failed_call_with_every_host_alive_is_the_roles_own_error(ray_session):
    ray = ray_session
    group = _group(ray, 2)
    role = GroupProcessRole(group.first, "t0/engine", "engine", timeout_s=30, group=group)
    with pytest.raises(ray.exceptions.RayTaskError) as failed:
        role.generate()
    assert isinstance(failed.value, ValueError) and "Buffer has been deleted" in str(failed.value)
    alone = GroupProcessRole(group.first, "t0/engine", "engine", timeout_s=30)  # one host: no one else to ask
    with pytest.raises(ValueError):
        alone.generate()
    for m in group.members:
        ray.kill(m)
