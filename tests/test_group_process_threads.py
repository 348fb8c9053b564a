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


class GatedRole:
    """A role whose build holds 4 MiB of device arrays and ends only once the test lets it (`gate` appears); it says
    it is being built by writing `building`."""

    def __init__(self, spec, channel=None):
        import jax.numpy as jnp

        self.params = jnp.ones((1024, 1024), jnp.float32)  # 4 MiB
        spec.building.write_text("building")
        while not spec.gate.exists():
            time.sleep(0.01)

    def device_ids(self) -> list[int]:
        return [0]


def test_a_role_dropped_while_it_is_being_built_is_dropped_when_its_start_returns(ray_session, tmp_path):
    """A fence (`drop_if_idle`) or the driver's end (`drop`) reaches the process while the task's role is still being
    built: the start returns, and the role is not left behind holding its bytes for ever (an orphan)."""
    import pytest

    from rlsched.base.errors import TaskError

    ray = ray_session
    process = ray.remote(num_cpus=0, max_concurrency=8)(GroupProcess).remote()
    for task, dropping in (("a", "drop_if_idle"), ("b", "drop")):  # fenced, ended
        spec = types.SimpleNamespace(hosts=1, building=tmp_path / f"{task}.building", gate=tmp_path / f"{task}.gate")
        started = process.start.remote(f"{task}/actor", GatedRole, spec, None)
        t0 = time.monotonic()
        while not spec.building.exists():
            assert time.monotonic() - t0 < 60
            time.sleep(0.01)
        held = ray.get(process.held.remote())
        assert held["roles"] == [] and held["device_bytes"] == 1024 * 1024 * 4  # the build's arrays, not yet a role
        answer = ray.get(getattr(process, dropping).remote(f"{task}/actor"))
        assert answer is (False if dropping == "drop_if_idle" else None)  # a fence is told a call (the build) runs
        spec.gate.write_text("go")
        with pytest.raises(TaskError, match=f"{task}/actor was dropped while it was being built"):
            ray.get(started, timeout=60)
        held = ray.get(process.held.remote())
        assert held["roles"] == [] and held["device_bytes"] == 0, held
    ray.kill(process)


class HeapProbe:
    """A role that frees an 8 MiB host buffer, then holds a 2 MiB one, and says where malloc put it."""

    def __init__(self, spec, channel=None):
        pass

    def device_ids(self) -> list[int]:
        return [0]

    def where_a_buffer_goes(self) -> dict[str, int]:
        import ctypes

        import numpy as np

        class Info(ctypes.Structure):  # glibc's struct mallinfo2
            _fields_ = [(k, ctypes.c_size_t) for k in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]

        info = ctypes.CDLL(None).mallinfo2
        info.restype = Info
        big = np.ones(8 << 20, np.uint8)  # mapped on its own: above any threshold
        del big  # glibc's own rule would now raise its threshold to 8 MiB
        before = info()
        held = np.ones(2 << 20, np.uint8)
        after = info()
        assert held.sum() == 2 << 20
        return {"mapped": after.hblkhd - before.hblkhd, "heap": after.uordblks - before.uordblks}


def test_a_host_buffer_of_a_leaving_task_goes_back_to_the_os_not_into_the_heap(ray_session):
    """The device group's process fixes malloc's mmap threshold (1 MiB): a 2 MiB host buffer is mapped on its own
    (and unmapped when freed) even after a larger one was freed, where glibc's own rule would have raised the threshold
    and carved it from a heap arena, whose freed space the process keeps while other tasks' memory lies above it."""
    ray = ray_session
    process = ray.remote(num_cpus=0)(GroupProcess).remote()
    ray.get(process.start.remote("t0/actor", HeapProbe, types.SimpleNamespace(hosts=1), None), timeout=120)
    placed = ray.get(process.call.remote("t0/actor", "where_a_buffer_goes", (), {}), timeout=60)
    assert placed["mapped"] >= 2 << 20 and placed["heap"] < 1 << 20, placed
    ray.kill(process)
