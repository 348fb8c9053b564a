"""Sharded roles end to end through the CLI: configs/demo_mesh.yaml (actor fsdp 2 x tp 2, rollout tp 2 on
8 devices) in a real `rlsched train` process under its own Ray, against the same tasks on one device and
against one task alone."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

SMALL = [f"tasks.{i}.{k}" for i in (0, 1) for k in (
    "steps=3", "checkpoint_every=0", "grpo.prompts_per_step=4", "grpo.num_generations=4", "grpo.mini_batch_size=8",
    "rollout.max_batch_size=16")]
ONE_DEVICE = [f"tasks.{i}.{k}=1" for i in (0, 1) for k in ("actor.mesh.fsdp", "actor.mesh.tp", "rollout.mesh.tp")]


def _train(out: Path, models: Path, *extra: str) -> subprocess.CompletedProcess:
    sets = [*SMALL, f"experiment.output_dir={out}", f"tasks.0.model.path={models / 'a'}",
            f"tasks.1.model.path={models / 's'}", *extra]
    args = [sys.executable, "-m", "rlsched.cli", "train", "configs/demo_mesh.yaml", "--overwrite"]
    for s in sets:
        args += ["--set", s] if "=" in s else [s]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _metrics(out: Path, task: str) -> list[dict]:
    path = out / "demo-mesh" / "tasks" / task / "metrics.jsonl"
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "mem/"))}
            for line in path.read_text().splitlines()]


def test_sharded_tasks_compute_what_one_device_does_and_alone_equals_together(tmp_path):
    """The scheduler's run holds both tasks' roles in one device-group process (cluster.processes:
    per_device_group, what a TPU needs): one pid for all four roles, each mesh on its devices, and the same
    numbers as a task alone in one process and (within float tolerance) on one device."""
    models = tmp_path / "models"
    sharded = _train(tmp_path / "sharded", models, "cluster.processes=per_device_group")
    assert "[addition] ok" in sharded.stdout + sharded.stderr
    one = _train(tmp_path / "one", models, *ONE_DEVICE, "--in-process", "--tasks", "addition")
    alone = _train(tmp_path / "alone", models, "--in-process", "--tasks", "addition")
    together, single = _metrics(tmp_path / "sharded", "addition"), _metrics(tmp_path / "one", "addition")
    assert len(together) == len(single) == 3
    assert together[0]["reward/mean"] == single[0]["reward/mean"]  # same samples: same weights, same random numbers
    for s, o in zip(together, single, strict=True):
        assert abs(s["loss"] - o["loss"]) <= 1e-4, (s, o)
    # Sharded under the scheduler beside another task = sharded alone in one process, bit for bit.
    assert _metrics(tmp_path / "alone", "addition") == together
    assert one.returncode == alone.returncode == 0
    # After the first step each role's bytes per device, measured from its live arrays, beside the plan's.
    for out in (sharded.stdout, alone.stdout):
        line = re.search(r"\[addition\] bytes per device after step 1, measured / planned: actor params (.+) / (.+), "
                         r"optimizer (.+) / (.+); engine params (.+) / (.+)\n", out)
        assert line is not None, out[-3000:]
        got = line.groups()
        assert got[0] == got[1] and got[2] == got[3] and got[4] == got[5], got  # params and AdamW are exact
    tasks = json.loads((tmp_path / "sharded" / "demo-mesh" / "summary.json").read_text())["tasks"]
    places = {(t, role): p for t in ("addition", "subtraction") for role, p in tasks[t]["roles"].items()}
    assert len({p["pid"] for p in places.values()}) == 1, places  # one process holds the group
    for t in ("addition", "subtraction"):  # colocated: actor fsdp 2 x tp 2 on 0-3, engine tp 2 on 0-1
        assert (places[t, "actor"]["devices"], places[t, "engine"]["devices"]) == ([0, 1, 2, 3], [0, 1])


def test_each_role_process_gets_the_pool_and_builds_its_mesh_on_its_own_devices(ray_session, tmp_path, tiny_model_dir):
    """Disaggregated on a pool of 8: the engine's tp 2 takes devices 0-1, the actor's fsdp 2 x tp 2 the last
    four; each role is a process of its own whose environment gives it the 8 XLA host devices."""
    import os

    import ray
    import yaml

    from rlsched.cluster import ray_cluster
    from rlsched.cluster.comm import make_channel
    from rlsched.config.loading import validate
    from rlsched.run.roles import ActorRole, EngineRole, spawn

    raw = yaml.safe_load((ROOT / "configs/demo_mesh.yaml").read_text())
    raw["experiment"].update(name="mesh-env", output_dir=str(tmp_path))
    raw["cluster"]["placement"] = "disaggregated"
    raw["tasks"] = raw["tasks"][:1]
    raw["tasks"][0]["model"] = {"path": str(tiny_model_dir)}
    spec = validate(raw).task_specs()[0]
    resource = ray_cluster.device_resource()
    pg = ray_cluster.make_placement_group("mesh-env", "disaggregated", resource)
    where = ray_cluster.role_sites(pg, "disaggregated", resource)
    channel = make_channel("object_store", spec.comm_group)
    roles = {cls.kind: spawn(cls, spec, channel=channel, sites=where) for cls in (ActorRole, EngineRole)}

    def seen(role):
        held = lambda r: r.worker if r.kind == "actor" else r.engine  # noqa: E731
        return ray.get(role.handle.__ray_call__.remote(lambda r: (
            os.getpid(), os.environ["XLA_FLAGS"], __import__("jax").device_count(),
            [d.id for d in held(r).mesh.devices.flat], dict(held(r).mesh.shape))))

    actor, engine = seen(roles["actor"]), seen(roles["engine"])
    assert actor[0] != engine[0] != os.getpid()
    for _, flags, count, _, _ in (actor, engine):
        assert "--xla_force_host_platform_device_count=8" in flags and count == 8
    assert actor[3:] == ([4, 5, 6, 7], {"dp": 1, "fsdp": 2, "ep": 1, "tp": 2})
    assert engine[3:] == ([0, 1], {"dp": 1, "fsdp": 1, "ep": 1, "tp": 2})
    for role in roles.values():
        role.terminate()
    ray.util.remove_placement_group(pg)


def test_a_device_group_process_holds_its_groups_roles_and_its_death_is_named(ray_session, tmp_path, tiny_model_dir):
    """cluster.processes: per_device_group, disaggregated on a pool of 8: a rollout host and a train host, each
    one process seeing the pool; the engine's tp 2 on devices 0-1 of the first, the actor's fsdp 2 x tp 2 on 4-7
    of the second. A host that dies fails its roles' calls with RoleDied naming it."""
    import os

    import ray
    import yaml

    from rlsched.base.errors import RoleDied
    from rlsched.cluster import ray_cluster
    from rlsched.cluster.comm import make_channel
    from rlsched.cluster.group_process import GroupProcessRole, start_group_process
    from rlsched.config.loading import validate
    from rlsched.run.roles import ActorRole, EngineRole, spawn

    raw = yaml.safe_load((ROOT / "configs/demo_mesh.yaml").read_text())
    raw["experiment"].update(name="mesh-host", output_dir=str(tmp_path))
    raw["cluster"].update(placement="disaggregated", processes="per_device_group")
    raw["tasks"] = raw["tasks"][:1]
    raw["tasks"][0]["model"] = {"path": str(tiny_model_dir)}
    spec = validate(raw).task_specs()[0]
    devices = ray_cluster.group_devices("disaggregated", 8, 2)
    assert devices == {"engine": 2, "actor": 6}
    pg = ray_cluster.make_placement_group("mesh-host", "disaggregated", "CPU", devices)
    where = ray_cluster.role_sites(pg, "disaggregated", "CPU", devices)
    hosts = {k: start_group_process(where, k, num_devices=8, max_tasks=1) for k in ("engine", "actor")}
    import dataclasses

    where = dataclasses.replace(where, processes=hosts)
    assert not where.one_process
    channel = make_channel("object_store", spec.comm_group)
    roles = {cls.kind: spawn(cls, spec, channel=channel, sites=where) for cls in (ActorRole, EngineRole)}
    assert all(isinstance(r, GroupProcessRole) for r in roles.values())
    for r in roles.values():  # each is built in its process in the background from its spawn
        r.wait_built()
    seen = {k: ray.get(h.where.remote()) for k, h in hosts.items()}
    assert seen["engine"]["pid"] != seen["actor"]["pid"] != os.getpid()
    assert seen["engine"]["devices"] == seen["actor"]["devices"] == list(range(8))
    assert seen["engine"]["roles"] == {"addition/engine": [0, 1]}
    assert seen["actor"]["roles"] == {"addition/actor": [4, 5, 6, 7]}
    assert roles["actor"].where() == {"pid": seen["actor"]["pid"], "devices": [4, 5, 6, 7]}
    ray.kill(hosts["engine"], no_restart=True)
    deadline = time.monotonic() + 60
    with pytest.raises(RoleDied, match="device group.s process holding its engine died during version\\(\\)"):
        while time.monotonic() < deadline:  # the kill lands asynchronously: calls fail from then on
            roles["engine"].version()
            time.sleep(0.1)
    roles["engine"].terminate()  # a dead host: nothing left to free, and no error
    roles["actor"].terminate()
    assert ray.get(hosts["actor"].where.remote())["roles"] == {}
    ray.kill(hosts["actor"])
    ray.util.remove_placement_group(pg)
