"""Pinning a role's process to its devices (rlsched/cluster/pinning.py), in fresh interpreters: JAX sizes its
CPU pool once, when its backends start, so each case needs a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlsched.cluster.pinning import phase_cores

PROBE = """
import json, os
from jax._src import xla_bridge
from rlsched.cluster.pinning import pin_process
started_before = xla_bridge.backends_are_initialized()
pin_process([{core}], xla_threads={threads})
print(json.dumps({{
    "started_before": started_before,
    "started_by_pin": xla_bridge.backends_are_initialized(),
    "threads_on": sorted({{c for t in os.listdir("/proc/self/task") for c in os.sched_getaffinity(int(t))}}),
}}))
"""


def _probe(core: int, threads: int) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE.format(core=core, threads=threads))],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_pinning_leaves_jax_to_start_on_the_pinned_cores():
    # The default: pinned before JAX starts, so XLA's pool is sized to the role's own cores.
    assert _probe(0, 1) == {"started_before": False, "started_by_pin": False, "threads_on": [0]}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 visible cores to widen the pool")
def test_pinning_with_more_xla_threads_starts_jax_first_then_pins_every_thread():
    # xla_threads=2 on one core: JAX starts on two cores (a two-thread pool), then every thread,
    # the pool's included, ends on the role's one core.
    core = sorted(os.sched_getaffinity(0))[-1]
    assert _probe(core, 2) == {"started_before": False, "started_by_pin": True, "threads_on": [core]}


def test_phase_cores_split_the_devices_when_disaggregated():
    assert phase_cores("disaggregated", "rollout", [0, 1, 2, 3]) == [0, 1]
    assert phase_cores("disaggregated", "train", [0, 1, 2, 3]) == [2, 3]
    assert phase_cores("colocated", "train", [0, 1]) == [0, 1]


def test_a_core_share_is_worked_out_where_it_pins_from_that_process_cores():
    """A role on another node (or in another cgroup) gets its share of its own cores, not the launcher's core ids:
    the share travels (pickled, as Ray sends it) and is resolved in the process that pins."""
    import pickle

    from rlsched.cluster.pinning import CoreShare, visible_cores

    share = CoreShare("disaggregated", "train")
    assert share.cores() == phase_cores("disaggregated", "train", visible_cores())
    code = ("import os, pickle, sys; os.sched_setaffinity(0, {0}); "
            "print(pickle.loads(bytes.fromhex(sys.argv[1])).cores())")
    here = subprocess.run([sys.executable, "-c", code, pickle.dumps(share).hex()], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).resolve().parents[1])
    assert here.stdout.strip() == "[0]"  # one core there: all of it, though the launcher would say [1]
