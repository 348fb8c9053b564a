"""Rollout benchmark: tokens/s of `jax_sampler` against transformers' `generate` (torch CPU), side by side.

    python -m benchmarks.rollout [--batch 8] [--prompt-len 32] [--new-tokens 64] [--repeats 3]
                                 [--model-dir DIR] [--out benchmarks/results/rollout]

What is measured: the wall time of one greedy generate call on `--batch` prompts of exactly `--prompt-len`
tokens, each continued by exactly `--new-tokens` tokens, token ids in and token ids out (no tokenizer).
tokens/s = batch * new_tokens / the median of `--repeats` timed calls; the ratio is jax / transformers,
so above 1.0x our engine is faster. The first call of each engine is timed on its own: it is where JAX
compiles its program, a cost a rollout worker pays once per shape bucket, not once per step.

Design decisions:
- One checkpoint directory, fp32 on both sides: transformers is the reference our tests hold the model to,
  so this is like for like, and greedy outputs should agree row for row. Agreement is reported, not
  asserted; the tests own correctness.
- Neither engine may stop early (no stop tokens for ours, eos cleared for transformers): a row that happened
  to emit eos would make one side do less work, and the tokens/s would no longer compare.
- Prompts are random byte ids 0..255, so no special token (eos, chat markers) enters a prompt.
- JAX defaults to CPU here (JAX_PLATFORMS=cpu unless set), so the default run is CPU against CPU.
- The engines run one after the other, never concurrently, so neither takes the other's cores.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from benchmarks.common import count_params, environment, save_results  # first: sets JAX to CPU, hubs offline

DEFAULT_MODEL_DIR = Path("runs/bench-models/small")
SEED = 0  # prompts are the same on every run, so runs compare


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rollout", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model-dir", type=Path, default=None,
                   help=f"a Qwen3 HF directory; default: the `small` preset, created in {DEFAULT_MODEL_DIR}")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/rollout"))
    args = p.parse_args(argv)
    for name in ("batch", "prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def ensure_model(model_dir: Path | None) -> Path:
    if model_dir is not None:
        return model_dir
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        from workers.models import init_model

        # std 0.2 (not HF's 0.02) peaks the logits, so float rounding cannot flip a greedy near-tie
        # and the agreement figure measures the engines, not the noise.
        init_model(DEFAULT_MODEL_DIR, preset="small", initializer_range=0.2)
    return DEFAULT_MODEL_DIR


def timed(call: Callable[[], np.ndarray], repeats: int, n_tokens: int) -> tuple[dict, np.ndarray]:
    """First call (compile, caches) apart, then `repeats` steady-state calls -> figures, last output."""
    t0 = time.perf_counter()
    tokens = call()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = call()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return dict(first_call_s=first, times_s=times, median_s=median, tokens_per_s=n_tokens / median), tokens


def jax_call(model_dir: Path, prompts: np.ndarray, new_tokens: int) -> Callable[[], np.ndarray]:
    from workers.rollout import SamplingParams
    from workers.rollout.jax_sampler import JaxSampler

    batch, prompt_len = prompts.shape
    # Caps equal to the request, so the shape buckets add no padding rows or columns that
    # transformers would not compute too.
    engine = JaxSampler.from_pretrained(model_dir, dtype="float32", max_prompt_len=prompt_len,
                                        max_new_tokens=new_tokens, max_batch_size=batch)
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, stop_token_ids=())
    prompt_list = prompts.tolist()

    def call() -> np.ndarray:
        out = engine.generate(prompt_list, params)
        assert out.num_tokens == batch * new_tokens, f"jax_sampler produced {out.num_tokens} tokens"
        return np.stack([s.token_ids for s in out.samples])

    return call


def transformers_call(model_dir: Path, prompts: np.ndarray, new_tokens: int) -> Callable[[], np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.from_numpy(prompts.astype(np.int64))
    mask = torch.ones_like(ids)  # equal lengths: no padding, the same work our engine does

    def call() -> np.ndarray:
        with torch.inference_mode():
            # eos_token_id=None overrides the checkpoint's generation_config, so no row ever finishes;
            # min_new_tokens guards the length should a later version ignore the None.
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, eos_token_id=None,
                                 pad_token_id=model.generation_config.pad_token_id)
        tokens = out[:, ids.shape[1]:].numpy()
        assert tokens.size == ids.shape[0] * new_tokens, f"transformers produced {tokens.size} tokens"
        return tokens

    return call


def table(results: dict) -> str:
    a, env = results["args"], results["env"]
    lines = [
        f"batch {a['batch']}, prompt {a['prompt_len']} tokens, {a['new_tokens']} new tokens, greedy fp32, "
        f"median of {a['repeats']}; model {a['model_dir']} ({results['model_params']:,} params); "
        f"torch threads {env['torch_num_threads']}, jax on {', '.join(env['jax_devices'])}",
        "",
        "| engine | first call (s) | median (s) | tokens/s |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {r['first_call_s']:.3f} | {r['median_s']:.4f} | {r['tokens_per_s']:,.0f} |"
          for name, r in results["engines"].items()),
        "",
        f"ratio jax_sampler / transformers: {results['ratio']:.2f}x",
        f"greedy agreement: {results['agreement']:.0%} of rows identical",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model_dir = ensure_model(args.model_dir)
    prompts = np.random.default_rng(SEED).integers(0, 256, (args.batch, args.prompt_len), dtype=np.int32)
    n_tokens = args.batch * args.new_tokens
    env = environment()
    print(f"torch.get_num_threads() = {env['torch_num_threads']}; jax devices {env['jax_devices']}", flush=True)

    engines, outputs = {}, {}
    for name, make in (("jax_sampler", jax_call), ("transformers", transformers_call)):
        print(f"{name}: warm-up + {args.repeats} timed calls ...", flush=True)
        engines[name], outputs[name] = timed(make(model_dir, prompts, args.new_tokens), args.repeats, n_tokens)

    results = dict(
        args=vars(args) | {"model_dir": str(model_dir), "out": str(args.out)},
        model_params=count_params(model_dir), engines=engines,
        ratio=engines["jax_sampler"]["tokens_per_s"] / engines["transformers"]["tokens_per_s"],
        agreement=float(np.mean(np.all(outputs["jax_sampler"] == outputs["transformers"], axis=1))),
        env=env, timestamp=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    save_results(args.out, "Rollout benchmark", results, table(results))
    return results


if __name__ == "__main__":
    main()
