"""32 LoRA tasks on one base in one experiment, through the CLI, rolling out and training in shared holds: every task
finishes, and what the device group's process really holds on the device (its live bytes, not the roles' own
reports) is what `rlsched plan` says: the base once and 32 adapters with their optimizer state, within 10 %."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

TASKS = 32


def _config(tmp_path, base) -> dict:
    shapes = [(kind, operand) for operand in (9, 19, 49, 99) for kind in ("addition", "subtraction")]
    tasks = []
    for i in range(TASKS):
        kind, operand = shapes[i % len(shapes)]
        tasks.append({
            "name": f"t{i:02d}-{kind[:3]}-{operand}", "seed": i, "steps": 2, "checkpoint_every": 0,
            "model": {"path": str(base), "init_preset": "tiny"},
            "lora": {"rank": 4, "alpha": 8, "targets": ["q", "v"]},
            "data": {"kind": kind, "max_operand": operand, "template": "plain"}, "reward": {"name": kind},
            "rollout": {"max_batch_size": 256},  # 16 tasks' rows (4 prompts x 4 samples) in one program run
            "grpo": {"prompts_per_step": 4, "num_generations": 4, "max_prompt_len": 16, "max_new_tokens": 4,
                     "beta": 0.0, "mini_batch_size": 16},
            "optim": {"lr": 1.0e-2},
            "actor": {"cobatch": True}})  # their updates share holds too: one program per optimizer step
    return {"experiment": {"name": "lora-scale", "output_dir": str(tmp_path / "runs"), "seed": 0},
            "cluster": {"placement": "colocated"}, "tasks": tasks}


def _cli(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "rlsched.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _cli_started(*args):
    """`rlsched ARGS` started, not awaited: `.communicate(timeout=...)` gives (stdout, stderr)."""
    return subprocess.Popen([sys.executable, "-m", "rlsched.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_thirty_two_lora_tasks_run_on_one_base_holding_what_the_plan_says(tmp_path):
    from rlsched.observe.tracking import read_metrics

    config = tmp_path / "lora_scale.yaml"
    config.write_text(yaml.safe_dump(_config(tmp_path, tmp_path / "models" / "base"), sort_keys=False))
    # The plan reads the config alone: it is worked out while the run runs (its process is mostly imports)
    planning = _cli_started("plan", str(config), "--json")
    done = _cli("train", str(config))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tasks = tmp_path / "runs" / "lora-scale" / "tasks"
    metrics = {p.name: read_metrics(p / "metrics.jsonl") for p in tasks.iterdir()}
    assert len(metrics) == TASKS and all([m["step"] for m in ms] == [1, 2] for ms in metrics.values())
    assert max(m["rollout/cobatched"] for ms in metrics.values() for m in ms) > 1  # holds were shared
    assert max(m["train/cobatched"] for ms in metrics.values() for m in ms) > 1  # updates ran together
    assert re.search(r"train \d+\.\d+ \((\d+) tasks\)\)", done.stdout), done.stdout[-3000:]  # the user sees it

    planned, planning_err = planning.communicate(timeout=300)
    assert planning.returncode == 0, planning_err
    plan = json.loads(planned)
    bases = [r for r in plan["roles"] if r["role"] == "base"]
    assert len(bases) == 1 and bases[0]["task"] == f"{TASKS} tasks"  # the base once, for every task's two roles
    resident = ("params", "optimizer", "reference")  # what a role holds between its phases
    held = bases[0]["bytes"]["params"] + sum(r["bytes"].get(k, 0) for r in plan["roles"] if r["role"] != "base"
                                             for k in resident)
    # What the roles report they hold (their last step's probe): their adapters and moments, and the one base
    reported = sum(v for ms in metrics.values() for k, v in ms[-1].items()
                   if k.startswith(("mem/actor/held/", "mem/engine/held/")) and not k.endswith("/base"))
    base = {ms[-1][f"mem/{role}/held/base"] for ms in metrics.values() for role in ("actor", "engine")}
    assert len(base) == 1 and reported + base.pop() == pytest.approx(held, rel=0.10)
    # What the process really holds on its device: each probe (after a task's phase) sees the whole process's live
    # bytes. While every task lives, those are at least everyone's state, plus whatever another task's phase has
    # under way then (its activations or KV cache); the least of them is the state alone. How many probes come
    # before the first task's last step is the schedule's choice (a hold of co-batched tasks may run both its steps
    # before others run their first): 22 of 64 in one CI run. Fewer probes can only raise their least.
    every_task_alive = min(ms[-1]["time/end_unix"] for ms in metrics.values())
    live = [m[f"mem/{role}/device0/bytes_in_use"] for ms in metrics.values() for m in ms
            if m["time/end_unix"] < every_task_alive for role in ("actor", "engine")]
    assert live and min(live) == pytest.approx(held, rel=0.10), (live, held)
