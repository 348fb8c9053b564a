"""How close `rlsched plan`'s actor activations are to what XLA allocates, over a grid of models and micro-batches.

    python -m benchmarks.plan_fit [--target h100 | h200 | present | FILE] [--grid real | small] [--points N]
                                  [--out DIR]

rlsched.config.plan counts the actor's activations per compiler (FIT["gpu"], FIT["cpu"]: `rlsched plan --backend`),
fitted to XLA's memory analysis of the actor's programs; this measures that fit. Per point, the actor's gradient and
update programs of one micro-batch a step are compiled from abstract shapes (benchmarks.gpu_memory.compile_programs:
nothing runs, no weights are made) for `--target`, and what they allocate beside the actor's state,
max(gradient temp, update temp) + gradient out (the float32 gradient), is set beside the plan's grads + activations
for the same config, counted for the compiler that compiled them ("cpu" where the device is a CPU, else "gpu"), as
tests/test_plan_memory.py compares them. The summary: the ratio plan / allocated, its min, median and max, and how
many points are within 10 % of 1.

--grid real (the default on a GPU target): Qwen3 0.6B, 1.7B and 4B, bfloat16 (one float32), remat layers and off,
2 to 32 rows of 256 to 2,048 positions, beta 0.08 (the batch carries ref_logp); for an H100, 28 min on 2 cores
shared with the small grid's run (26 min of it XLA's compiles, results.json's compile_s).
--grid small (the default with --target present, the CPU): the `small` preset's widths (hidden 256, MLP 768, 4
heads, 2 KV heads, head_dim 128) over a 4,096-token vocabulary and 2 layers, tests/test_plan_memory.py's model,
one width at a time varied, more rows, positions and layers, larger vocabularies; float32 and bfloat16, remat layers
and off; 64-token prompts, beta 0; 19 min on 2 cores shared with the real grid's run (18 of them compiling).
The GPU targets need the CUDA plugin's venv (benchmarks/gpu_memory.py's docstring):
    JAX_PLATFORMS=cpu PYTHONPATH=. gpuaot/bin/python -m benchmarks.plan_fit --target h100
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import save_results  # first: sets JAX to CPU, hubs offline
from benchmarks.gpu_memory import (
    compile_programs,
    environment,
    target_device,
    target_name,
    task_config,
)
from rlsched.base.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


@dataclass(frozen=True)
class Point:
    """One compile: a preset with `fields` set on it, and a micro-batch of `rows` x (prompt_len + new_tokens)."""

    name: str
    preset: str
    dtype: str
    remat: str  # actor.remat: "layers" or "off"
    rows: int  # the micro-batch (one a step)
    prompt_len: int
    new_tokens: int  # max_new_tokens: the output head's completion window
    beta: float  # > 0: the batch carries ref_logp
    fields: dict = field(default_factory=dict)  # set on the preset's config (vocab_size, num_hidden_layers, ...)


def _real(preset: str, dtype: str, remat: str, rows: int, prompt: int, new: int) -> Point:
    return Point(f"{preset} {dtype} {remat} {rows}x{prompt}+{new}", preset, dtype, remat, rows, prompt, new, 0.08)


# The published Qwen3 shapes at the batches an H100 trains them at: rows and windows both ways, remat off where it fits
REAL = [_real(*p) for p in (
    ("qwen3-0.6b", "bfloat16", "layers", 4, 256, 256), ("qwen3-0.6b", "bfloat16", "layers", 16, 256, 256),
    ("qwen3-0.6b", "bfloat16", "layers", 8, 512, 512), ("qwen3-0.6b", "bfloat16", "off", 4, 256, 256),
    ("qwen3-0.6b", "float32", "layers", 8, 256, 256), ("qwen3-0.6b", "bfloat16", "layers", 32, 256, 256),
    ("qwen3-1.7b", "bfloat16", "layers", 8, 256, 256), ("qwen3-1.7b", "bfloat16", "layers", 4, 1024, 1024),
    ("qwen3-4b", "bfloat16", "layers", 2, 256, 256), ("qwen3-4b", "bfloat16", "layers", 8, 256, 256),
    ("qwen3-4b", "bfloat16", "layers", 4, 512, 512), ("qwen3-4b", "bfloat16", "off", 2, 256, 256),
    ("qwen3-1.7b", "bfloat16", "layers", 16, 64, 192), ("qwen3-0.6b", "bfloat16", "off", 8, 512, 512))]

# tests/test_plan_memory.py's model: the `small` preset's widths over 4,096 tokens, 2 layers, 64-token prompts
SMALL_BASE = {"vocab_size": 4096, "num_hidden_layers": 2}
SMALL_PROMPT = 64
# (name, fields set on the base, rows, positions): one width varied at a time, at 4 x 512 positions ...
VARIANTS = [("base", {}), ("mlp1536", {"intermediate_size": 1536}), ("hidden128", {"hidden_size": 128}),
            ("heads8", {"num_attention_heads": 8}), ("kv4", {"num_key_value_heads": 4}), ("hd64", {"head_dim": 64}),
            ("v16k", {"vocab_size": 16384}), ("v64k", {"vocab_size": 65536})]
SHAPES = [(n, f, 4, 512) for n, f in VARIANTS] + [
    ("rows8", {}, 8, 512), ("pos384", {}, 4, 384), ("L4", {"num_hidden_layers": 4}, 4, 512)]
# ... and vocabularies of 4k-32k at fewer positions, more rows, more layers (dtype, remat, vocab, rows, positions,
# layers): the output head's chunk grows with the vocabulary, a layer's activations with rows x positions, and the
# plan counts the larger of the two with remat layers, so the grid covers each side of that line
SURVEY = [("float32", "layers", 4096, 4, 256, 2), ("float32", "off", 4096, 4, 256, 2),
          ("bfloat16", "layers", 4096, 2, 512, 2), ("bfloat16", "layers", 16384, 8, 512, 4),
          ("bfloat16", "layers", 32768, 4, 512, 2), ("bfloat16", "layers", 4096, 8, 512, 4),
          ("bfloat16", "layers", 16384, 2, 256, 2), ("float32", "layers", 8192, 4, 512, 2),
          ("float32", "layers", 32768, 4, 512, 2), ("bfloat16", "layers", 8192, 4, 512, 2),
          ("bfloat16", "layers", 4096, 8, 256, 2), ("bfloat16", "layers", 32768, 8, 256, 2)]


def _small(name: str, dtype: str, remat: str, fields: dict, rows: int, positions: int) -> Point:
    return Point(f"{name} {dtype} {remat}", "small", dtype, remat, rows, SMALL_PROMPT, positions - SMALL_PROMPT, 0.0,
                 SMALL_BASE | fields)


SMALL = [_small(n, dtype, remat, f, rows, pos) for dtype in ("float32", "bfloat16") for remat in ("layers", "off")
         for n, f, rows, pos in SHAPES] + [
    _small(f"v{vocab // 1024}k {rows}x{pos} L{layers}", dtype, remat,
           {"vocab_size": vocab, "num_hidden_layers": layers}, rows, pos)
    for dtype, remat, vocab, rows, pos, layers in SURVEY]
GRIDS = {"real": REAL, "small": SMALL}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plan_fit", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="h100", help="h100, h200, present (the first device JAX sees) or a file")
    p.add_argument("--grid", default=None, choices=sorted(GRIDS),
                   help="default: small with --target present, real for a GPU")
    p.add_argument("--points", type=int, default=None, help="only the grid's first N points")
    p.add_argument("--out", type=Path, default=None,
                   help="default benchmarks/results/plan_fit-<target, or the platform with present>-<grid>")
    return p.parse_args(argv)


def point_config(point: Point):
    """(the task, the model's config) of `point`: configs/gsm8k_qwen3.yaml's task (benchmarks.gpu_memory.task_config),
    one micro-batch a step."""
    from workers.models.presets import preset_config

    args = argparse.Namespace(micro_batch=point.rows, dtype=point.dtype, remat=point.remat, adam_mu_dtype="float32",
                              prompt_len=point.prompt_len, new_tokens=point.new_tokens, beta=point.beta)
    # a preset's own widths are keyword arguments of preset_config that `fields` may set again: set after it
    fields = dict(point.fields)
    vocab = {"vocab_size": fields.pop("vocab_size")} if "vocab_size" in fields else {}
    return task_config(args, 1).tasks[0], preset_config(point.preset, dtype=point.dtype, **vocab).replace(**fields)


def allocated_bytes(programs: dict) -> int:
    """What the actor allocates beside its state: the larger program's temporaries and the float32 gradient (the
    gradient program's output, the update's argument), as tests/test_plan_memory.py counts it."""
    grad, upd = programs["gradient"], programs["update"]
    return max(grad["temp_bytes"], upd["temp_bytes"]) + grad["output_bytes"]


def measure(point: Point, device) -> dict:
    from flax import nnx

    from rlsched.config.plan import actor_bytes
    from rlsched.config.spec import actor_settings
    from workers.models.decoder import CausalLM

    task, config = point_config(point)
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    programs = compile_programs(model, actor_settings(task), device, 1, point.prompt_len + point.new_tokens)
    plan = actor_bytes(task, config, backend="cpu" if device.platform == "cpu" else "gpu")
    allocated = allocated_bytes(programs)
    return dict(**asdict(point), positions=point.prompt_len + point.new_tokens, layers=config.num_hidden_layers,
                vocab_size=config.vocab_size, **programs, allocated_bytes=allocated,
                plan={k: plan[k] for k in ("grads", "activations")},
                ratio=(plan["grads"] + plan["activations"]) / allocated)


def summary(runs: list[dict]) -> dict:
    ratios = [r["ratio"] for r in runs]
    return dict(points=len(ratios), min=min(ratios), median=statistics.median(ratios), max=max(ratios),
                within_5_percent=sum(abs(r - 1) <= 0.05 for r in ratios),
                within_10_percent=sum(abs(r - 1) <= 0.10 for r in ratios))


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = target_device(args.target)
    backend = "cpu" if device.platform == "cpu" else "gpu"
    grid = args.grid or ("small" if args.target == "present" else "real")
    points = GRIDS[grid][:args.points]
    runs = []
    for i, point in enumerate(points, 1):
        run = measure(point, device)
        runs.append(run)
        print(f"[{i}/{len(points)}] {point.name}: allocated {run['allocated_bytes'] / MiB:,.1f} MiB "
              f"(gradient temp {run['gradient']['temp_bytes'] / MiB:,.1f}, {run['gradient']['compile_s']:.0f} s), "
              f"planned {(run['plan']['grads'] + run['plan']['activations']) / MiB:,.1f} MiB: {run['ratio']:.3f}",
              flush=True)
    env = environment(device, args.target)
    s = summary(runs)
    rows = [f"| {r['name']} | {r['layers']} | {r['vocab_size']:,} | {r['rows']} x {r['positions']} | " + " | ".join(
        format_bytes(n) for n in (r["gradient"]["temp_bytes"], r["gradient"]["output_bytes"],
                                  r["update"]["temp_bytes"], r["allocated_bytes"], r["plan"]["activations"],
                                  r["plan"]["grads"])) + f" | {r['ratio']:.3f} |" for r in runs]
    report = "\n".join([
        f"The {grid} grid, compiled for {env['target']} ({args.target}); the plan counted for XLA:{backend.upper()} "
        f"(`rlsched plan --backend {backend}`). One micro-batch a step, float32 first moment.", "",
        f"plan / allocated over {s['points']} points: min {s['min']:.3f}, median {s['median']:.3f}, max "
        f"{s['max']:.3f}; within 10 %: {s['within_10_percent']} of {s['points']}, within 5 %: "
        f"{s['within_5_percent']}.", "",
        "| point | layers | vocab | rows x positions | gradient temp | gradient out | update temp | allocated | "
        "plan activations | plan grads | plan / allocated |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, "",
        "allocated = max(gradient temp, update temp) + gradient out (the float32 gradient): what the actor's two "
        "programs need beside its state (XLA's memory_analysis()); plan = grads + activations "
        "(rlsched.config.plan.actor_bytes for the same config)."])
    results = dict(args={k: str(v) for k, v in vars(args).items()}, grid=grid, backend=backend, env=env, summary=s,
                   runs=runs, timestamp=datetime.now(UTC).isoformat(timespec="seconds"))
    out = args.out or ROOT / "benchmarks" / "results" / f"plan_fit-{target_name(device, args.target)}-{grid}"
    save_results(out, "`rlsched plan`'s activations against what XLA allocates", results, report)
    return results


if __name__ == "__main__":
    main()
