"""How a role's process ended, told from what it recorded (rlsched.cluster.exits): real processes, real signals."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlsched.cluster import exits


def _record(**over):
    record = {"start": {"pid": 1, "oom": {"path": "/proc/vmstat", "count": 3}}, "signals": [], "fatal": "",
              "exited": False, "oom_now": 3}
    return record | over


def test_what_a_record_says_in_order_of_evidence():
    assert exits.describe(None) is None  # not watched: nothing to add to Ray's message
    assert exits.describe(_record()) == ("killed by signal 9 (SIGKILL): it ended without running any handler, "
                                         "and no out-of-memory kill was counted")
    assert exits.describe(_record(oom_now=4)) == ("out of memory: killed by the kernel's OOM killer (oom_kill in "
                                                  "/proc/vmstat rose from 3 to 4 while it ran)")
    assert exits.describe(_record(signals=["SIGTERM"], exited=True, oom_now=4)) == "killed by signal 15 (SIGTERM)"
    fatal = ('Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n'
             '  File "x.py", line 3 in f\n')
    assert exits.describe(_record(fatal=fatal)) == 'crashed: Segmentation fault (File "x.py", line 3 in f)'
    assert exits.describe(_record(exited=True)).startswith("exited: its Python interpreter shut down")
    assert exits.describe(_record(), "... killed by `ray.kill` ...") == "ended by ray.kill()"
    assert exits.describe(None, "Task was killed due to the node running low on memory.").startswith(
        "out of memory: Ray's memory monitor")


def test_the_oom_kill_counter_is_read_from_this_machine():
    counter = exits.oom_kill_counter()
    assert counter is not None, "neither a memory cgroup nor /proc/vmstat has an oom_kill line here"
    path, count = counter
    assert os.path.isfile(path) and count >= 0


@pytest.mark.parametrize("how, expected", [
    ("SIGKILL", "killed by signal 9 (SIGKILL)"),
    ("SIGTERM", "killed by signal 15 (SIGTERM)"),
    ("segfault", "crashed: Segmentation fault"),
])
def test_a_ray_actor_that_dies_is_explained(ray_session, tmp_path, how, expected):
    ray = ray_session

    @ray.remote(max_restarts=0, num_cpus=0)
    class Role:
        def __init__(self, directory):
            from pathlib import Path

            from rlsched.cluster import exits as e

            assert e.watch(Path(directory))

        def pid(self):
            return os.getpid()

        def crash(self):
            import ctypes

            ctypes.string_at(0)  # reads address 0: SIGSEGV

        def wait(self):
            time.sleep(60)

    role = Role.remote(str(tmp_path))
    pid = ray.get(role.pid.remote())
    if how == "segfault":
        ref = role.crash.remote()
    else:
        ref = role.wait.remote()
        time.sleep(0.5)
        os.kill(pid, getattr(signal, how))
    with pytest.raises(ray.exceptions.RayActorError) as died:
        ray.get(ref, timeout=60)
    record = exits.read_record(pid, tmp_path)
    assert exits.describe(record, str(died.value)).startswith(expected), (record, str(died.value))
