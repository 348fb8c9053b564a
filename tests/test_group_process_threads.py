"""The device group's process serves every task's calls from threads: its book of roles must stay consistent while
tasks start roles at once. Every role's start asks the process `where()` (its pid, for fencing), which walks the
book; 32 LoRA tasks starting at once made one of them fail with "dictionary changed size during iteration"."""

from __future__ import annotations

import sys
import time
import types

from ray import cloudpickle

from rlsched.cluster.group_process import GroupProcess

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # SlowRole travels by value into the Ray actor


class SlowRole:
    """A role whose device_ids() takes a moment, as a real role's mesh lookup may: a walk of the book is not instant."""

    def __init__(self, spec, channel=None):
        time.sleep(0.005)

    def device_ids(self) -> list[int]:
        time.sleep(0.001)
        return [0]


def test_roles_started_from_many_threads_while_where_walks_the_book(ray_session):
    ray = ray_session
    process = ray.remote(num_cpus=0, max_concurrency=16)(GroupProcess).remote()
    spec = types.SimpleNamespace(hosts=1)
    starts = [process.start.remote(f"t{i}/actor", SlowRole, spec, None) for i in range(40)]
    wheres = [process.where.remote() for _ in range(120)]
    ray.get(starts + wheres, timeout=120)  # none raises (before: RuntimeError, the dict changed size)
    assert len(ray.get(process.where.remote())["roles"]) == 40
    for i in range(40):
        ray.get(process.drop.remote(f"t{i}/actor"))
    assert ray.get(process.held.remote())["roles"] == []
    ray.kill(process)
