"""Benchmarks cannot rot: each one's smallest setting runs end to end and saves its results.

The figures are not checked here (speed goals are met in the benchmarks themselves, not in timed
tests); what is checked is that every benchmark still runs against today's code and writes
results.json and report.md. A benchmark added to benchmarks/ without a row here fails the last test.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# A step of a few samples and tokens: what runs here is the benchmark's code, not its figures.
TINY_STEP = [a for kv in ("grpo.prompts_per_step=2", "grpo.num_generations=2", "grpo.max_new_tokens=2",
                          "grpo.mini_batch_size=4", "rollout.max_batch_size=4") for a in ("--set", kv)]
# module -> (its smallest setting, a key its results.json must have)
SMALLEST = {
    "rollout": (["--batch", "1", "--prompt-len", "4", "--new-tokens", "2", "--repeats", "1"], "engines"),
    "train_step": (["--steps", "1", "--warmup-steps", "1", "--prompts", "2", "--generations", "2",
                    "--new-tokens", "2"], "ratio"),
    "multitask": (["--steps", "3", "--warmup-steps", "1", "--round-trips", "5", "--solo-once", *TINY_STEP],
                  "speedup_steady"),
    "bench": (["--tasks", "1", "--placement", "colocated", "--steps", "4", "--warmup", "1"], "placements"),
    "simulate": (["--tasks", "1,2", "--steps", "2"], None),
    "overhead": (["--steps", "3", "--warmup-steps", "1", "--repeats", "1", "--no-settle", *TINY_STEP],
                 "overhead_ms"),
    "checkpoint": (["--steps", "2", "--warmup-steps", "1", "--preset", "tiny", *TINY_STEP], "runs"),
    "footprint": (["--steps", "2", "--repeats", "1", "--layouts", "per_device_group", "in_process", *TINY_STEP],
                  "median"),
    "soak": (["--cycles", "3"], "flat"),  # tests/test_soak.py runs it for 2 minutes and checks its verdict
    "startup": (["--tasks", "1", "--steps", "2", "--repeats", "1", *TINY_STEP], "restart_s"),
    "sharding": (["--hidden", "64", "--intermediate", "128", "--layers", "1", "--heads", "2", "--kv-heads", "2",
                  "--vocab", "256", "--fsdp", "1,2", "--repeats", "1"], "weight_sync"),
}
NOT_BENCHMARKS = {"__init__", "common"}


@pytest.mark.parametrize("name", sorted(SMALLEST))
def test_benchmark_runs_at_its_smallest_setting(name, ray_session, tmp_path):
    argv, key = SMALLEST[name]
    importlib.import_module(f"benchmarks.{name}").main([*argv, "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "report.md").read_text().strip()
    if key is not None:
        assert key in results, f"benchmarks/{name}.py results.json lacks {key!r}: {sorted(results)}"


def test_every_benchmark_has_a_smallest_setting():
    modules = {p.stem for p in BENCHMARKS.glob("*.py")} - NOT_BENCHMARKS
    assert modules == set(SMALLEST), f"add the new benchmarks to SMALLEST: {sorted(modules - set(SMALLEST))}"
