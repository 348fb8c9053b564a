"""Sharded roles end to end through the CLI: configs/demo_mesh.yaml (actor fsdp 2 x tp 2, rollout tp 2 on
8 devices) in a real `rlsched train` process under its own Ray, against the same tasks on one device and
against one task alone."""

from __future__ import annotations

import json
import subprocess
import sys
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
    models = tmp_path / "models"
    sharded = _train(tmp_path / "sharded", models)
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
