"""Co-batched train, actor level: K LoRA tasks' optimizer steps in one program run against K tasks one after another.

    python -m benchmarks.cotrain [--shape tiny|small|qwen3-0.6b] [--tasks 8,32] [--rows 4] [--prompt-len 64]
                                 [--completion-len 64] [--rank 8] [--steps 3]
                                 [--dtype float32|bfloat16] [--out benchmarks/results/cotrain]

What a base group's co-batched TRAIN hold does (actor.cobatch: true; rlsched.scheduling.policy.CoBatch), without the
scheduler around it: K LoRA actors (workers.actor.ActorWorker, rank `--rank` on every target but the head) read
one shared base (workers.shared_base) in one process. Each task's batch is `--rows` sequences of `--prompt-len`
prompt and `--completion-len` completion tokens (random tokens and advantages: the cost does not depend on them), one
on-policy optimizer step per `train` call. For each K in --tasks, on the same device:
- **one after another**: each task's `train` in turn, as tasks that hold TRAIN in turn run it;
- **co-batched**: the K tasks' `train` calls from K threads in one hold (workers.rollout.base.Together), as one shared
  hold runs them (workers.actor_cobatch: one vmapped program per optimizer step, K padded to a power of two).
Two sets of K actors with the same seeds take the same `--steps` steps, one set each way; a figure is the best of
`--steps` timed rounds of K tasks' `train` after a warm-up round (compiles excluded). The two sets' adapters are
compared after every step: co-batched training equals training alone only to float rounding (docs/lora.md), and
the largest difference, relative to how far training moved the adapter, is reported, not assumed.

Self-contained (JAX, Flax, optax, numpy): it runs where the rest of rlsched's dependencies are not installed, e.g. on
an accelerator machine with only JAX; `JAX_PLATFORMS` picks the device (CPU when unset).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.cobatch import SHAPES, checked, jax_environment, save  # noqa: E402 - after the platform default

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--tasks", default="8,32", help="K values, comma-separated (default 8,32)")
    p.add_argument("--rows", type=int, default=4, help="sequences per task's batch (one micro-batch)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed train calls per task, after one warm-up call")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="the base's dtype (default: the shape's: bfloat16 for qwen3-0.6b, else float32)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cotrain")
    return checked(p, p.parse_args(argv), ("rows", "prompt_len", "completion_len", "rank", "steps"))


def save_base(shape: str, dtype: str, where: Path) -> Path:
    """A random base of `shape` in Hugging Face format (what workers.shared_base loads)."""
    from flax import nnx

    from workers.models.checkpoint import save_pretrained
    from workers.models.config import family
    from workers.models.decoder import CausalLM

    fields = {**SHAPES[shape], "dtype": dtype}
    cfg = family("qwen3")(**fields, rope_theta=1_000_000.0, max_position_embeddings=4096)
    return save_pretrained(CausalLM(cfg, rngs=nnx.Rngs(0)), where / f"base-{shape}-{dtype}")


def actors(lease, k: int, args) -> list:
    """K LoRA actors on `lease`'s base, each with a lease of its own (as each task's actor role takes one)."""
    from workers import shared_base
    from workers.actor import ActorWorker
    from workers.models.lora import LAYER_TARGETS, LoraSpec
    from workers.train_step import ActorSettings

    settings = ActorSettings(remat="layers", adam_mu_dtype="float32",
                             lr=1e-3, total_steps=1000, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.0,
                             grad_clip=1.0, b1=0.9, b2=0.999, epsilon=0.2, epsilon_high=None, beta=0.0,
                             aggregation="token-mean", temperature=1.0, micro_batch_size=args.rows,
                             mini_batch_size=args.rows, epochs=1, router_aux_loss_coef=None,
                             kl_clamp=None, max_new_tokens=None)
    spec = LoraSpec(args.rank, 2.0 * args.rank, tuple(LAYER_TARGETS))
    path, dtype = lease.key[0], lease.key[1]
    return [ActorWorker(None, settings, lora=spec, base=shared_base.acquire(path, dtype=dtype, mesh=lease.mesh), seed=i,
                        mesh=lease.mesh) for i in range(k)]


def batches(k: int, vocab: int, args) -> list:
    import numpy as np

    from workers.batch import build_train_batch

    rng = np.random.default_rng(1)
    out = []
    for _ in range(k):
        prompts = [rng.integers(1, vocab, args.prompt_len) for _ in range(args.rows)]
        completions = [rng.integers(1, vocab, args.completion_len) for _ in range(args.rows)]
        out.append(build_train_batch(prompts, completions, rng.choice([-1.0, 1.0], args.rows).astype(np.float32),
                                     pad_id=0))
    return out


def one_after_another(group: list, data: list, step: int) -> list[dict]:
    return [actor.train(batch, step=step) for actor, batch in zip(group, data, strict=True)]


def cobatched(group: list, data: list, step: int, hold: int) -> list[dict]:
    from workers.rollout.base import Together

    together, results, errors = Together(hold, len(group)), [None] * len(group), []

    def run(i: int) -> None:
        try:
            results[i] = group[i].train(data[i], step=step, together=together)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(group))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def moved_apart(alone: list, joint: list, start: list[dict]) -> dict[str, float]:
    """How far the co-batched adapters are from the alone ones, relative to how far training moved them: the largest
    over every adapter matrix of ||co-batched - alone|| / ||alone - start|| (norm), and of the same for the single
    element that differs most (element: AdamW's step is about lr x the gradient's sign, so an element whose gradient
    is near zero may step either way and lands up to twice its move apart)."""
    import numpy as np

    norm = element = 0.0
    for a, j, s in zip(alone, joint, start, strict=True):
        for name, x0 in s.items():
            x = np.asarray(a.state.params[name], np.float64)
            y = np.asarray(j.state.params[name], np.float64)
            moved, moved_most = float(np.linalg.norm(x - x0)), float(np.abs(x - x0).max())
            if moved > 0:
                norm = max(norm, float(np.linalg.norm(x - y)) / moved)
                element = max(element, float(np.abs(x - y).max()) / moved_most)
    return {"norm": norm, "element": element}


def measure(k: int, lease, cfg, args) -> dict:
    import numpy as np

    alone, joint = actors(lease, k, args), actors(lease, k, args)
    start = [{n: np.asarray(v, np.float64) for n, v in a.state.params.items()} for a in alone]
    data = batches(k, cfg.vocab_size, args)
    one_after_another(alone, data, 1)  # warm-up: compiles
    cobatched(joint, data, 1, hold=1000 * k + 1)
    seq_times, joint_times, reported = [], [], set()
    for step in range(2, args.steps + 2):
        t0 = time.perf_counter()
        one_after_another(alone, data, step)
        seq_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        metrics = cobatched(joint, data, step, hold=1000 * k + step)
        joint_times.append(time.perf_counter() - t0)
        reported |= {int(m["cobatched"]) for m in metrics}
    apart = moved_apart(alone, joint, start)
    seq_s, joint_s = min(seq_times), min(joint_times)
    samples = k * args.rows
    result = {"tasks": k, "rows_per_task": args.rows, "tokens_per_row": args.prompt_len + args.completion_len,
              "samples": samples, "one_after_another_s": seq_s, "cobatched_s": joint_s, "speedup": seq_s / joint_s,
              "one_after_another_samples_per_s": samples / seq_s, "cobatched_samples_per_s": samples / joint_s,
              "cobatched_reported": sorted(reported), "apart": apart}
    print(f"K={k}: one after another {seq_s:.3f} s, co-batched {joint_s:.3f} s ({result['speedup']:.2f} x); "
          f"adapters apart by {apart['norm']:.1e} of how far they moved ({apart['element']:.1e} in the element "
          "that differs most)", flush=True)
    for a in alone + joint:
        a.release()
    return result


def report(runs: list[dict], env: dict, args) -> str:
    dtype = args.dtype or SHAPES[args.shape]["dtype"]
    lines = [f"Shape {args.shape} in {dtype}; per task {args.rows} sequences of {args.prompt_len} + "
             f"{args.completion_len} tokens, one optimizer step per train call; rank {args.rank} on q k v o gate up "
             f"down; best of {args.steps} rounds; device: {', '.join(env['jax_devices'])}.", "",
             "| K tasks | samples | one after another (s) | co-batched (s) | speed-up "
             "| adapters apart, relative to their move: norm / worst element |", "|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['tasks']} | {r['samples']} | {r['one_after_another_s']:.3f} | {r['cobatched_s']:.3f} | "
                     f"{r['speedup']:.2f} x | {r['apart']['norm']:.1e} / {r['apart']['element']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    import jax

    from workers import shared_base
    from workers.models import sharding as S

    args = parse_args(argv)
    env = jax_environment()
    dtype = args.dtype or SHAPES[args.shape]["dtype"]
    with tempfile.TemporaryDirectory(prefix="rlsched-cotrain-") as tmp:
        path = save_base(args.shape, dtype, Path(tmp))
        lease = shared_base.acquire(path, dtype=dtype, mesh=S.mesh({}, jax.devices()[:1]))
        try:
            runs = [measure(k, lease, lease.config, args) for k in args.tasks]
        finally:
            lease.release()
    return save(args, env, runs, report(runs, env, args), "Co-batched train, actor level")

if __name__ == "__main__":
    main()
