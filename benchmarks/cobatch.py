"""Co-batched rollout, engine level: K LoRA tasks' rows in one program run against the K tasks one after another.

    python -m benchmarks.cobatch [--shape tiny|small|qwen3-0.6b] [--tasks 8,32] [--prompts 4] [--n 4]
                                 [--prompt-len 32] [--new-tokens 32] [--rank 8] [--repeats 3]
                                 [--dtype float32|bfloat16] [--out benchmarks/results/cobatch]

What a base group's co-batched ROLLOUT hold does (rlsched.scheduling.policy.CoBatch), without the scheduler around
it: one `JaxSampler` over one base serves K adapters (rank `--rank` on every projection, random and non-zero, so
each task's rows really differ). For each K in --tasks, in this one run, on the same device:
- **one after another**: each task's request (`--prompts` prompts x `--n` samples) is its own `generate` call, as
  tasks that hold ROLLOUT in turn run it;
- **co-batched**: the K requests in one `generate_many`, as one shared hold runs them;
- **base alone**: one task's request without adapters, the cost of the per-row adapter path beside it.
Every request generates `--new-tokens` tokens (no stop token), so the runs do the same work. Each figure is the
best of `--repeats` timed runs after a warm-up run (compiles excluded). The co-batched outputs are checked against
the one-after-another ones: identical tokens are what the scheduler promises a task (its rollout does not depend on
its neighbours); the share of identical samples is reported, not assumed.

Self-contained (JAX, Flax, numpy): it runs where the rest of rlsched's dependencies are not installed, e.g. on an
accelerator machine with only JAX; `JAX_PLATFORMS` picks the device (CPU when unset).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parents[1]
# Model shapes: the presets' (workers.models.presets), and Qwen3-0.6B's architecture with random weights
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=128, vocab_size=384, tie_word_embeddings=True, dtype="float32"),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, vocab_size=384, tie_word_embeddings=False, dtype="float32"),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       dtype="bfloat16"),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--tasks", default="8,32", help="K values, comma-separated (default 8,32)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per task's request")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="the base's dtype (default: the shape's: bfloat16 for qwen3-0.6b, else float32)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cobatch")
    return checked(p, p.parse_args(argv), ("prompts", "n", "prompt_len", "new_tokens", "rank", "repeats"))


def checked(p: argparse.ArgumentParser, args: argparse.Namespace, positive: tuple[str, ...]) -> argparse.Namespace:
    """`args` with --tasks read as a list of positive integers and every option in `positive` at least 1; anything
    else ends the command with p.error naming the option."""
    try:
        args.tasks = [int(x) for x in args.tasks.split(",") if x.strip()]
    except ValueError:
        args.tasks = []
    if not args.tasks or min(args.tasks) < 1:
        p.error(f"--tasks: give positive integers, e.g. 8,32 (got {args.tasks!r})")
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def build(shape: str, rank: int, k: int, rows: int, args):
    """The sampler over a random base of `shape`, serving k random adapters of `rank` on every projection."""
    import jax
    import numpy as np
    from flax import nnx

    from workers.models.config import family
    from workers.models.decoder import CausalLM
    from workers.models.lora import TARGETS, LoraSpec, adapter_shapes
    from workers.rollout.jax_sampler import JaxSampler

    fields = dict(SHAPES[shape])
    fields["dtype"] = args.dtype or fields["dtype"]
    cfg = family("qwen3")(**fields, rope_theta=1_000_000.0, max_position_embeddings=4096)
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    sampler = JaxSampler(model, max_prompt_len=args.prompt_len, max_new_tokens=args.new_tokens,
                         max_batch_size=k * rows, take_ownership=True)
    spec = LoraSpec(rank, 2.0 * rank, tuple(t for t in TARGETS))
    rng = np.random.default_rng(0)
    adapters = [{name: (rng.standard_normal(s) * (0.02 if name.endswith("lora_b") else 1 / np.sqrt(s[0])))
                 .astype(np.float32) for name, s in adapter_shapes(cfg, spec).items()} for _ in range(k)]
    sampler.set_adapters(adapters, [spec] * k)
    del model
    jax.block_until_ready(jax.tree.leaves(sampler._live_state()))  # noqa: SLF001 - on the device before timing
    return sampler, cfg


def requests(k: int, cfg, args) -> list[tuple]:
    import numpy as np

    from workers.rollout.base import SamplingParams

    rng = np.random.default_rng(1)
    out = []
    for task in range(k):
        prompts = [rng.integers(1, cfg.vocab_size, args.prompt_len).astype(np.int32) for _ in range(args.prompts)]
        params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=task)
        out.append((prompts, params, [task] * args.prompts))
    return out


def best_of(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up: compiles
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def measure(k: int, args) -> dict:
    rows = args.prompts * args.n
    sampler, cfg = build(args.shape, args.rank, k, rows, args)
    reqs = requests(k, cfg, args)
    seq_s, alone = best_of(lambda: [sampler.generate(*r) for r in reqs], args.repeats)
    joint_s, joint = best_of(lambda: sampler.generate_many(reqs), args.repeats)
    base_s, _ = best_of(lambda: sampler.generate(reqs[0][0], reqs[0][1]), args.repeats)
    pairs = [(a, b) for one, many in zip(alone, joint, strict=True) for a, b in zip(one.samples, many.samples,
                                                                                    strict=True)]
    same = sum(bool((a.token_ids.shape == b.token_ids.shape) and (a.token_ids == b.token_ids).all()) for a, b in pairs)
    samples = k * rows
    result = {"tasks": k, "rows_per_task": rows, "samples": samples,
              "one_after_another_s": seq_s, "cobatched_s": joint_s, "one_task_base_only_s": base_s,
              "one_task_with_adapter_s": seq_s / k,
              "one_after_another_samples_per_s": samples / seq_s, "cobatched_samples_per_s": samples / joint_s,
              "speedup": seq_s / joint_s, "identical_samples": same / len(pairs),
              "cobatched_reported": joint[0].cobatched}
    print(f"K={k}: one after another {seq_s:.3f} s, co-batched {joint_s:.3f} s ({result['speedup']:.2f} x); "
          f"one task {seq_s / k:.4f} s with its adapter, {base_s:.4f} s base only; "
          f"identical samples {same}/{len(pairs)}", flush=True)
    return result


def report(runs: list[dict], env: dict, args) -> str:
    dtype = args.dtype or SHAPES[args.shape]["dtype"]
    lines = [f"Shape {args.shape} in {dtype}; per task {args.prompts} prompts x {args.n} samples, prompt "
             f"{args.prompt_len} tokens, {args.new_tokens} new tokens; rank {args.rank} on every projection; "
             f"best of {args.repeats}; "
             f"device: {', '.join(env['jax_devices'])}.", "",
             "| K tasks | samples | one after another (s) | co-batched (s) | speed-up "
             "| one task: adapter / base only (s) | identical samples |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['tasks']} | {r['samples']} | {r['one_after_another_s']:.3f} | {r['cobatched_s']:.3f} | "
                     f"{r['speedup']:.2f} x | {r['one_task_with_adapter_s']:.4f} / {r['one_task_base_only_s']:.4f} | "
                     f"{100 * r['identical_samples']:.1f} % |")
    return "\n".join(lines)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def jax_environment() -> dict:
    """Where a JAX-only benchmark ran (no rlsched control plane: benchmarks.common needs Ray's dependencies)."""
    import flax
    import jax

    return dict(python=platform.python_version(), jax=jax.__version__, flax=flax.__version__,
                jax_devices=[str(d) for d in jax.devices()], cpu_count=os.cpu_count(), machine=platform.machine())


def save(args, env: dict, runs: list[dict], text: str, title: str) -> dict:
    """Print the report, write results.json and report.md into args.out atomically; the results."""
    print("\n" + text)
    results = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "env": env,
               "runs": runs, "timestamp": datetime.now(UTC).isoformat()}
    write_atomic(args.out / "results.json", json.dumps(results, indent=2) + "\n")
    write_atomic(args.out / "report.md", f"# {title}\n\n{text}\n")
    print(f"\nsaved {args.out / 'results.json'} and {args.out / 'report.md'}")
    return results


def main(argv=None) -> dict:
    args = parse_args(argv)
    env = jax_environment()
    runs = [measure(k, args) for k in args.tasks]
    return save(args, env, runs, report(runs, env, args), "Co-batched rollout, engine level")


if __name__ == "__main__":
    main()
