"""Roles across hosts on a real multi-node Ray cluster (ray.cluster_utils.Cluster: a head and two worker nodes, each
a raylet of its own on this machine), through `rlsched train --address` in real processes.

A task's actor with mesh {dp: 2, fsdp: 2} on cluster.hosts 2 x cluster.num_devices 2 runs as one process per node
joined into one JAX job (rlsched.cluster.rolegroup); it must compute what the same task does on one host of 4 devices,
fail alone when a member is killed, and take a coordinator port no other group holds."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# configs/demo_mesh.yaml made small: both tasks' actors {dp: 2, fsdp: 2}, engines on one device. Batches of 16 x 8
# samples: enough that a random tiny model scores a few answers, so the first steps have gradients to compare.
SMALL = [f"tasks.{i}.{k}" for i in (0, 1) for k in (
    "actor.mesh={dp: 2, fsdp: 2, tp: 1}", "rollout.mesh.tp=1", "checkpoint_every=0", "grpo.prompts_per_step=16",
    "grpo.num_generations=8", "grpo.mini_batch_size=64", "rollout.max_batch_size=128", "data.max_operand=3")]
TWO_HOSTS = ["cluster.hosts=2", "cluster.num_devices=2"]
# A process per role: each task's actor is a group of its own across the hosts (rlsched.cluster.rolegroup); the device
# group's processes across hosts (the default) are the tests at the end.
ROLE_GROUPS = [*TWO_HOSTS, "cluster.processes=per_role"]
ONE_HOST = ["cluster.num_devices=4"]
# addition's steps: room after the Ctrl-C at step 1, which lands a step or two later on a fast machine (3 of 6 at
# most); every step of every run here costs 1-3 s across hosts on a loaded 2-core machine
STEPS = 6


@pytest.fixture(scope="module")
def nodes():
    """A head without CPUs (drivers and the scheduler need none) and two nodes of 2 CPUs: a device group's process
    bundle can only go to a worker node, so two hosts are two nodes."""
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 0})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


def _args(out: Path, models: Path, steps: tuple[int, int], *extra: str) -> list[str]:
    sets = [*SMALL, f"experiment.output_dir={out}", f"tasks.0.model.path={models / 'a'}",
            f"tasks.1.model.path={models / 's'}", f"tasks.0.steps={steps[0]}", f"tasks.1.steps={steps[1]}"]
    args = [sys.executable, "-u", "-m", "rlsched.cli", "train", "configs/demo_mesh.yaml", "--overwrite"]
    for s in sets:
        args += ["--set", s]
    for s in extra:
        args += ["--set", s] if "=" in s and not s.startswith("--") else [s]
    return args


def _train(out: Path, models: Path, steps: tuple[int, int], *extra: str, ok: bool = True):
    done = subprocess.run(_args(out, models, steps, *extra), capture_output=True, text=True, cwd=ROOT, timeout=400)
    if ok:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _metrics(out: Path, task: str) -> list[dict]:
    path = out / "demo-mesh" / "tasks" / task / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _numbers(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "mem/"))} for r in rows]


def _trace(out: Path) -> list[dict]:
    trace = json.loads((out / "demo-mesh" / "timeline.json").read_text())
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _one_task_fits() -> str:
    """The override for a per-device memory budget that fits one task of the run, not two."""
    from conftest import one_task_fits_gb

    from rlsched.config.loading import load_config

    task = load_config(ROOT / "configs" / "demo_mesh.yaml", [*SMALL, *TWO_HOSTS]).tasks[0]
    return f"cluster.memory_budget_gb={one_task_fits_gb(task)}"


def _groups(out: Path) -> dict[str, dict]:
    """{task: the 'role_group' span's args} from the run's Perfetto trace."""
    events = _trace(out)
    return {e["args"]["task"]: e["args"] for e in events if e.get("name") == "role_group"}


@pytest.fixture(scope="module")
def one_host(tmp_path_factory) -> Path:
    """Both tasks on one host of 4 devices (embedded local Ray): what every run across hosts must compute."""
    out = tmp_path_factory.mktemp("one-host")
    _train(out, out / "models", (STEPS, 4), *ONE_HOST)
    return out


def _same_numbers(across: Path, one: Path) -> None:
    """Both tasks computed across hosts what they do on one host."""
    for task, steps in (("addition", STEPS), ("subtraction", 4)):
        a_rows, o_rows = _metrics(across, task), _metrics(one, task)
        assert len(a_rows) == len(o_rows) == steps
        assert any(r["reward/mean"] > 0 for r in o_rows), task  # something scored...
        assert any(r["grad_norm"] > 0 for r in o_rows), task  # ...so the comparison has gradients in it
        # Same samples every step (rewards equal), losses within 1e-5; the gradient norm within 1e-4 relative:
        # float32 sums taken in another order across processes, felt most where the loss is ~1e-4 and cancels.
        for a, o in zip(a_rows, o_rows, strict=True):
            assert a["reward/mean"] == o["reward/mean"], (a, o)
            assert abs(a["loss"] - o["loss"]) <= 1e-5, (a, o)
            assert abs(a["grad_norm"] - o["grad_norm"]) <= 1e-4 * o["grad_norm"], (a, o)


def test_an_actor_across_two_hosts_computes_what_one_host_does(nodes, tmp_path, one_host):
    """Two tasks, each actor across both nodes (two groups at once), against the task on one host of 4 devices
    (embedded Ray, and the same cluster by --address)."""
    models = tmp_path / "models"
    # Memory for one task's engine and actor per device, not two: roles are evicted (offloaded, every member its
    # own shards) and brought back all along, and the numbers must not move.
    two = _train(tmp_path / "two", models, (STEPS, 4), *ROLE_GROUPS, _one_task_fits(), "--address", nodes)
    assert "[addition] ok" in two.stdout and "[subtraction] ok" in two.stdout, two.stdout[-2000:]
    assert re.search(r"\[addition\] actor on 2 hosts, 4 devices", two.stdout)
    groups = _groups(tmp_path / "two")
    for task, group in groups.items():  # every member on a node of its own
        assert len(set(group["nodes"])) == len(group["nodes"]) == 2, (task, group)
        assert group["guarded"] == [False, True], group  # member 1 ran (and saved, below) under the run-file guard
    moved = {(e["name"], e["args"]["task"]) for e in _trace(tmp_path / "two") if e.get("ph") == "X"
             and e["name"] in ("offload", "onload") and e["args"].get("role") == "actor"}
    # Whose actor is moved depends on when each task is done compiling (a step's roles compile before its first lock,
    # and the task done first may run several steps before the other asks for one): an actor group went to host
    # memory and came back, each member with its own shards, and the numbers did not move (below)
    assert any({("offload", t), ("onload", t)} <= moved for t in ("addition", "subtraction")), moved
    assert set(groups) == {"addition", "subtraction"}
    ports = {task: g["coordinator"] for task, g in groups.items()}
    assert ports["addition"] != ports["subtraction"], ports  # two groups, two coordinators

    _train(tmp_path / "one-address", models, (STEPS, 4), *ONE_HOST, "--tasks", "addition", "--address", nodes)
    _same_numbers(tmp_path / "two", one_host)  # both groups computed what one host does
    across, one = _metrics(tmp_path / "two", "addition"), _metrics(one_host, "addition")
    # The user's cluster by --address runs exactly what the embedded default runs.
    assert _numbers(_metrics(tmp_path / "one-address", "addition")) == _numbers(one)

    # Ctrl-C after step 1 saves the group's state (orbax, every member), --resume restores it in every member:
    # the steps after equal the uninterrupted run's.
    stop = _args(tmp_path / "stopped", models, (STEPS, 4), *ROLE_GROUPS, "tasks.0.checkpoint_every=1",
                 "--tasks", "addition", "--address", nodes)
    proc = subprocess.Popen(stop, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        for line in proc.stdout:
            if re.match(r"\[addition\] step +1/", line):
                proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    finally:
        proc.kill()
    saved = len(_metrics(tmp_path / "stopped", "addition"))
    assert 1 <= saved < STEPS, saved  # stopped after the step in progress, well before the end
    resumed = _train(tmp_path / "stopped", models, (STEPS, 4), *ROLE_GROUPS, "tasks.0.checkpoint_every=1", "--tasks",
                     "addition", "--address", nodes, "--resume")
    assert f"[addition] resumed after step {saved}" in resumed.stdout
    assert _numbers(_metrics(tmp_path / "stopped", "addition")) == _numbers(across)


def test_a_killed_member_fails_its_task_only(nodes, tmp_path):
    """SIGKILL one member of addition's 2-host actor mid-run: addition fails naming the member within 30 s, every
    process of its group is gone, and subtraction (one host, same experiment) finishes as it does alone."""
    models = tmp_path / "models"
    # subtraction's actor on one device of host 0: a task within one host beside a task across both
    one_device = ["tasks.1.actor.mesh={dp: 1, fsdp: 1, tp: 1}", "tasks.1.grpo.prompts_per_step=4",
                  "tasks.1.grpo.num_generations=4", "tasks.1.grpo.mini_batch_size=16"]
    args = _args(tmp_path / "run", models, (200, 200), *ROLE_GROUPS, *one_device, "--address", nodes)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines, members, killed_at, failed_after = [], None, None, None
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            lines.append(line)
            if members is None and "[addition] actor on 2 hosts" in line:
                members = [int(p) for p in re.findall(r"pid (\d+)", line.split("engine")[0])]
            if killed_at is None and members and re.match(r"\[addition\] step +1/", line):
                os.kill(members[1], signal.SIGKILL)
                killed_at = time.monotonic()
            if killed_at and "[addition] failed" in line:
                failed_after = time.monotonic() - killed_at
            assert time.monotonic() < deadline, "".join(lines[-30:])
        proc.wait(timeout=60)
    finally:
        proc.kill()
    out = "".join(lines)
    assert members and len(members) == 2 and killed_at, out[-3000:]
    assert proc.returncode != 0  # a task failed
    failure = re.search(r"\[addition\] failed: RoleDied: member 1 of 2 \(host [\d.]+, pid (\d+), node \w+\) of its "
                        r"actor group died during \w+\(\): killed by signal 9", out)
    assert failure and int(failure.group(1)) == members[1], out[-3000:]
    assert failed_after is not None and failed_after <= 30, failed_after
    assert "[subtraction] ok" in out, out[-3000:]
    for pid in members:  # no process of the failed group is left
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    together = _metrics(tmp_path / "run", "subtraction")
    # subtraction was still running when the member died: the failure happened beside it, not after it
    assert together[-1]["time/end_unix"] > time.time() - (time.monotonic() - killed_at)
    _train(tmp_path / "alone", models, (200, 200), *ROLE_GROUPS, *one_device, "--tasks", "subtraction",
           "--address", nodes)
    assert _numbers(together) == _numbers(_metrics(tmp_path / "alone", "subtraction"))


def test_more_hosts_than_the_cluster_has_nodes_is_refused_with_the_numbers(nodes, tmp_path):
    done = _train(tmp_path / "three", tmp_path / "models", (3, 3), "cluster.hosts=3", "cluster.num_devices=2",
                  "--tasks", "addition", "--address", nodes, ok=False)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert ("error: cluster.hosts is 3, but the Ray cluster has 2 node(s) with 1 CPU free to give (3 alive in all; "
            "2 devices per host)") in done.stderr, done.stderr[-2000:]


def test_a_device_group_across_hosts_is_one_process_per_host_holding_every_role(nodes, tmp_path, one_host):
    """cluster.processes: per_device_group (the default on GPU and TPU, where a host's devices open in one process)
    across 2 hosts: one process per node holds both tasks' roles, the two processes are one JAX job, each actor
    is built in both and called SPMD, the engines live in the first host's process; under a budget for one task
    the actors are evicted and brought back all along, and both tasks compute what they do on one host."""
    run = _train(tmp_path / "hosts", tmp_path / "models", (STEPS, 4), *TWO_HOSTS, "cluster.processes=per_device_group",
                 _one_task_fits(), "--address", nodes)
    assert "[addition] ok" in run.stdout and "[subtraction] ok" in run.stdout, run.stdout[-2000:]
    hosts = re.search(r"roles held by 2 device-group processes, one per host, joined into one JAX job \(coordinator "
                      r"([\d.]+:\d+); [\d.]+ pid (\d+), [\d.]+ pid (\d+)\)", run.stdout)
    assert hosts, run.stdout[-2000:]
    pids = [int(hosts.group(2)), int(hosts.group(3))]
    groups = _groups(tmp_path / "hosts")
    assert set(groups) == {"addition", "subtraction"}
    for task, group in groups.items():  # both actors are the same two processes, on two nodes, one job
        assert group["pids"] == pids and len(set(group["nodes"])) == 2, (task, group)
        assert group["coordinator"] == hosts.group(1) and group["guarded"] == [False, True], group
    summary = json.loads((tmp_path / "hosts" / "demo-mesh" / "summary.json").read_text())
    for task in ("addition", "subtraction"):  # the engine is in the first host's process, beside actor member 0
        assert summary["tasks"][task]["roles"]["engine"]["pid"] == pids[0], summary["tasks"][task]["roles"]
    moved = {(e["name"], e["args"]["task"]) for e in _trace(tmp_path / "hosts") if e.get("ph") == "X"
             and e["name"] in ("offload", "onload") and e["args"].get("role") == "actor"}
    # Whose actor is moved depends on when each task is done compiling (a step's roles compile before its first lock,
    # and the task done first may run several steps before the other asks for one): an actor group went to host
    # memory and came back, each member with its own shards, and the numbers did not move (below)
    assert any({("offload", t), ("onload", t)} <= moved for t in ("addition", "subtraction")), moved
    _same_numbers(tmp_path / "hosts", one_host)
    for pid in pids:  # the run ended its hosts
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_dead_host_of_a_device_group_across_hosts_ends_every_task_there_naming_it(nodes, tmp_path):
    """SIGKILL the second host's process of a per_device_group run across 2 hosts: its JAX job is broken, so every
    host is stopped and both tasks fail within 30 s, one of them naming the member and the signal; no host is left."""
    args = _args(tmp_path / "run", tmp_path / "models", (200, 200), *TWO_HOSTS, "cluster.processes=per_device_group",
                 "--address", nodes)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines, pids, killed_at, failed = [], None, None, {}
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            lines.append(line)
            hosts = re.search(r"one JAX job \(coordinator ([\d.]+):(\d+); [\d.]+ pid (\d+), [\d.]+ pid (\d+)\)", line)
            if hosts:
                pids = [int(p) for p in hosts.groups()[2:]]
                # The coordinator (no authentication of its own) listens on its node's address alone, never on
                # every interface.
                listening = subprocess.run(["ss", "-Hltn", f"sport = :{hosts.group(2)}"], capture_output=True,
                                           text=True, check=True).stdout.split()
                node, port = hosts.group(1), hosts.group(2)  # gRPC may bind IPv6, at the v4-mapped address
                assert listening and listening[3] in (f"{node}:{port}", f"[::ffff:{node}]:{port}"), listening
            if killed_at is None and pids and re.match(r"\[addition\] step +1/", line):
                os.kill(pids[1], signal.SIGKILL)
                killed_at = time.monotonic()
            task = re.match(r"\[(\w+)\] failed: (.*)", line)
            if killed_at and task:
                failed[task.group(1)] = (time.monotonic() - killed_at, task.group(2))
            assert time.monotonic() < deadline, "".join(lines[-30:])
        proc.wait(timeout=60)
    finally:
        proc.kill()
    out = "".join(lines)
    assert pids and killed_at and proc.returncode != 0, out[-3000:]
    assert set(failed) == {"addition", "subtraction"}, out[-3000:]  # the group's tasks, both
    assert all(after <= 30 and why.startswith("RoleDied: ") for after, why in failed.values()), "\n".join(
        f"{task} after {after:.1f} s: {why}" for task, (after, why) in failed.items())  # whole: a dict's repr is cut
    named = [why for _, why in failed.values() if re.match(
        rf"RoleDied: member 1 of 2 \(host [\d.]+, pid {pids[1]}, node \w+\) of its device group's processes "
        r"\(holding its actor\) died during \w+\(\): killed by signal 9", why)]
    assert named, failed
    for pid in pids:  # no host of the broken job is left
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
