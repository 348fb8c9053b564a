"""What a task's first step compiles, one program after another and all at once, for a GPU without one.

    python -m benchmarks.compile_cost [--preset qwen3-0.6b] [--batch 128] [--prompt-len 256] [--new-tokens 256]
                                      [--micro-batch 16] [--beta 0.08] [--target h100 | h200 | present | FILE]
                                      [--lora K [--lora-rank 16] [--lora-rows 256]] [--out DIR]

The programs the first step of benchmarks/gpu.py's setting compiles: the engine's generate
(benchmarks.decode_cost.lower_generate), the actor's reference log-probabilities, gradient and update
(benchmarks.gpu_memory.lower_programs), from abstract shapes, for the target as those benchmarks compile (deviceless
for h100 / h200: see benchmarks/gpu_memory.py's docstring for the venv with the CUDA plugin). Built two ways, each in
a fresh process (nothing cached, JAX's persistent cache off):
- one after another, as a step did before (the engine's, then after the rollout the actor's, one by one);
- at once, as a step does now: every program on a thread of its own (workers.compiling.shared_at_once; the driver
  asks its engine and its actor at once, rlsched.run.task.TaskDriver.prepare). Their traces take turns on Python's
  lock; XLA's compiles run side by side.
Per program, its trace + lowering and its compile alone (the first way); the wall of each way and their ratio. The
host's cores bound the gain: XLA compiles a program mostly on one core (a GPU compile without a GPU skips the
autotuning a GPU's compile does, on the device).

`--lora K`: the first step of K LoRA tasks on one base (benchmarks/gpu.py's LoRA runs: rank 16 on every projection,
`--lora-rows` the engine's max_batch_size) instead: the base group's co-batched generate programs, K adapters stacked,
one per batch size its `prepare` compiles (one task's rows, then c tasks' until they fill the rows:
workers.rollout.shared_engine), and one LoRA actor's programs (the K actors of one setting share them in a device
group's process: workers.compiling.shared), its reference log-probabilities the base's row of its logprobs program.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import save_results  # first: sets JAX to CPU, hubs offline

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("one_after_another", "at_once")


def parse_args(argv=None) -> argparse.Namespace:
    from benchmarks.gpu_memory import add_task_args

    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_cost", description=__doc__.splitlines()[0])
    add_task_args(p, preset="qwen3-0.6b", micro_batch=16)  # beta > 0: the reference's log-probabilities compile
    p.add_argument("--batch", type=int, default=128, help="rows of the generate program (16 prompts x 8)")
    p.add_argument("--lora", type=int, default=0, help="K > 0: the first step of K LoRA tasks on one base")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-rows", type=int, default=256,
                   help="the LoRA engine's max_batch_size: rows of several tasks in one co-batched generate")
    p.add_argument("--out", type=Path, default=None,
                   help="default benchmarks/results/compile_cost-<target, or the platform with present>-<preset>")
    p.add_argument("--way", choices=WAYS, default=None, help=argparse.SUPPRESS)  # a child process: one way
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)  # where the child writes it
    return p.parse_args(argv)


def lowerings(args) -> tuple[dict, object]:
    """({program: a function that traces and lowers it}, the device), the first step's programs in the order a step
    used to compile them."""
    from flax import nnx

    from benchmarks.decode_cost import lower_generate
    from benchmarks.gpu import LORA_TARGETS  # every projection
    from benchmarks.gpu_memory import lower_programs, target_device, task_config
    from rlsched.config.spec import actor_settings
    from workers.models.decoder import CausalLM
    from workers.models.lora import LoraSpec
    from workers.models.presets import preset_config

    device = target_device(args.target)
    vocab = {} if args.vocab_size is None else {"vocab_size": args.vocab_size}
    config = preset_config(args.preset, dtype=args.dtype, **vocab)
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    length = args.prompt_len + args.new_tokens
    lora = None if not args.lora else LoraSpec(rank=args.lora_rank, alpha=2.0 * args.lora_rank,
                                               targets=tuple(LORA_TARGETS))
    actor = lower_programs(model, actor_settings(task_config(args, 1).tasks[0]), device, 1, length, lora=lora)
    if lora is None:
        programs = {"generate": lower_generate(config, device, args.batch, args.prompt_len, args.new_tokens)[0]}
    else:
        programs = {f"generate ({rows} rows)": lower_generate(config, device, rows, args.prompt_len, args.new_tokens,
                                                              lora=lora, lora_slots=args.lora)[0]
                    for rows in lora_batches(args.batch, args.lora, args.lora_rows)}
    if args.beta > 0:
        programs["reference"] = actor["reference"]
    programs |= {"gradient": actor["gradient"], "update": actor["update"]}
    return programs, device


def lora_batches(rows: int, tasks: int, max_rows: int) -> list[int]:
    """The batch sizes of the co-batched generate programs a LoRA base group's `prepare` compiles for `tasks` tasks
    of `rows` rows each, the engine's max_batch_size max(rows, min(max_rows, rows x tasks)) (benchmarks/gpu.py's):
    the rows of c tasks for c = 1 .. tasks until those of c - 1 fill a chunk
    (workers.rollout.shared_engine.SharedSampler.prepare), in chunks of at most max_batch_size, each padded to its
    power-of-two bucket (workers.rollout.jax_sampler: JaxSampler._joint_chunks)."""
    from benchmarks.gpu import lora_engine_rows
    from workers.rollout.jax_sampler import _bucket

    limit = lora_engine_rows(rows, tasks, max_rows)
    sizes = set()
    for copies in range(1, tasks + 1):
        if copies > 1 and (copies - 1) * rows >= limit:
            break
        total = copies * rows
        sizes |= {_bucket(min(limit, total - start), 1, limit) for start in range(0, total, limit)}
    return sorted(sizes)


def run_way(args) -> dict:
    """One way, in this process: its wall and, one after another, each program's trace + lowering and compile."""
    from workers.compiling import shared_at_once

    programs, device = lowerings(args)
    held, per_program = [], {}
    start = time.perf_counter()
    if args.way == "one_after_another":
        for name, lower in programs.items():
            t0 = time.perf_counter()
            lowered = lower()
            t1 = time.perf_counter()
            held.append(lowered.compile())
            per_program[name] = {"lower_s": t1 - t0, "compile_s": time.perf_counter() - t1}
    else:
        held = shared_at_once([(("compile_cost", name), lambda lower=lower: lower().compile())
                               for name, lower in programs.items()])
    return {"wall_s": time.perf_counter() - start, "programs": per_program, "device": str(device.device_kind)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.way is not None:  # a child: one way, its figures to --result
        args.result.write_text(json.dumps(run_way(args)))
        return {}
    from benchmarks.gpu import lora_engine_rows
    from benchmarks.gpu_memory import environment, target_device, target_name

    child = [a for a in (argv if argv is not None else sys.argv[1:])]
    ways = {}
    for way in WAYS:
        result = Path(os.environ.get("TMPDIR", "/tmp")) / f"compile_cost-{os.getpid()}-{way}.json"
        env = os.environ | {"JAX_COMPILATION_CACHE_DIR": "", "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-m", "benchmarks.compile_cost", *child, "--way", way, "--result",
                        str(result)], check=True, env=env, cwd=ROOT)
        ways[way] = json.loads(result.read_text())
        result.unlink()
        print(f"{way}: {ways[way]['wall_s']:.1f} s", flush=True)
    device = target_device(args.target)
    env = environment(device, args.target)
    alone, together = ways["one_after_another"], ways["at_once"]
    rows = [f"| {name} | {p['lower_s']:.1f} s | {p['compile_s']:.1f} s |" for name, p in alone["programs"].items()]
    ratio = alone["wall_s"] / together["wall_s"]
    report = "\n".join([
        f"{args.preset} ({args.dtype}), the first step's programs at benchmarks/gpu.py's setting (generate: batch "
        f"{args.batch}, {args.prompt_len} + {args.new_tokens} slots; the actor's: micro-batch {args.micro_batch}, "
        f"remat {args.remat}, beta {args.beta}"
        + (f"; {args.lora} LoRA tasks on one base, rank {args.lora_rank} on every projection, the engine's rows "
           f"{lora_engine_rows(args.batch, args.lora, args.lora_rows)}" if args.lora else "")
        + f"), compiled for {env['target']} ({args.target}) on a host of {env['cpus_usable']} usable cores", "",
        "| program | trace + lower | compile |", "|---|---:|---:|", *rows, "",
        f"one after another: **{alone['wall_s']:.1f} s**; at once: **{together['wall_s']:.1f} s** "
        f"({ratio:.2f} x faster)"])
    results = dict(args={k: str(v) for k, v in vars(args).items() if k not in ("way", "result")}, env=env,
                   ways=ways, ratio=ratio, timestamp=datetime.now(UTC).isoformat(timespec="seconds"))
    lora = f"-lora{args.lora}" if args.lora else ""
    out = args.out or ROOT / "benchmarks" / "results" / \
        f"compile_cost-{target_name(device, args.target)}-{args.preset}{lora}"
    save_results(out, "A first step's compiles: one after another, and at once", results, report)
    return results


if __name__ == "__main__":
    main()
