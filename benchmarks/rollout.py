"""Rollout benchmark: start-up time and tokens/s of each rollout engine against the built-in `jax_sampler`.

    python -m benchmarks.rollout [--engines auto|jax_sampler,transformers,sglang_jax] [--batch 8]
                                 [--prompt-len 32] [--new-tokens 64] [--repeats 3] [--model-dir DIR] [--out DIR]

    .venv/bin/python -m benchmarks.rollout                 # jax_sampler vs transformers (torch CPU, Python 3.11)
    .venv312/bin/python -m benchmarks.rollout              # jax_sampler vs sglang_jax (the `sglang` extra, 3.12)

What is measured: the wall time of one greedy generate call on `--batch` prompts of exactly `--prompt-len`
tokens, each continued by exactly `--new-tokens` tokens, token ids in and token ids out (no tokenizer).
tokens/s = batch * new_tokens / the median of `--repeats` timed calls; each ratio is engine / jax_sampler,
so above 1.0x that engine is faster than ours. Start-up is the time from nothing to an engine holding the
checkpoint's weights (sglang_jax: its process, the Engine, and rlsched's weight update); the first call is
timed on its own: it is where an engine compiles, a cost a rollout worker pays once per shape bucket.

Design decisions:
- One checkpoint directory, fp32 everywhere: transformers is the reference our tests hold the model to, and
  sglang_jax receives the very weights jax_sampler loads, so this is like for like, and greedy outputs
  should agree row for row. Agreement is reported, not asserted; the tests own correctness.
- No engine may stop early (no stop tokens for ours and sglang_jax, eos cleared for transformers): a row that
  happened to emit eos would make one side do less work, and the tokens/s would no longer compare.
- Prompts are random byte ids 0..255, so no special token (eos, chat markers) enters a prompt.
- sglang_jax runs where it runs in training: in a Ray actor process of its own (its errors kill their
  process). Its timings therefore include one actor round trip per call (about a millisecond).
- `auto` takes every engine importable here: transformers needs torch (the `test` extra, Python 3.11),
  sglang_jax needs sglang-jax (the `sglang` extra, Python 3.12); no environment has both, so each run
  compares its engines with jax_sampler side by side.
- JAX defaults to CPU here (JAX_PLATFORMS=cpu unless set), so the default run is CPU against CPU.
- The engines run one after the other, never concurrently, so none takes another's cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from benchmarks.common import count_params, environment, save_results  # first: sets JAX to CPU, hubs offline

DEFAULT_MODEL_DIR = Path("runs/bench-models/small")
SEED = 0  # prompts are the same on every run, so runs compare
REFERENCE = "jax_sampler"
# engine -> (module it needs, how to get it)
OPTIONAL = {"transformers": ("torch", "pip install -e '.[test]' (Python 3.11: the CPU torch wheel)"),
            "sglang_jax": ("sgl_jax", "pip install -e '.[sglang]' (Python >= 3.12)")}


def available(engine: str) -> bool:
    return engine == REFERENCE or importlib.util.find_spec(OPTIONAL[engine][0]) is not None


def resolve_engines(spec: str) -> list[str]:
    """`auto` -> jax_sampler and every optional engine importable here; else the named ones, checked."""
    if spec == "auto":
        return [REFERENCE, *(e for e in OPTIONAL if available(e))]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n != REFERENCE and n not in OPTIONAL]
    if unknown:
        raise SystemExit(f"error: --engines: unknown engine(s) {unknown}; choose from {[REFERENCE, *OPTIONAL]}")
    missing = [n for n in names if not available(n)]
    if missing:
        hints = "; ".join(f"{n}: {OPTIONAL[n][1]}" for n in missing)
        raise SystemExit(f"error: --engines: {missing} cannot run in this environment ({hints})")
    return [REFERENCE, *(n for n in names if n != REFERENCE)]  # the reference always runs, first


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rollout", description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="auto",
                   help="comma-separated engines (jax_sampler always runs, as the reference), or auto")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model-dir", type=Path, default=None,
                   help=f"a Qwen3 HF directory; default: the `small` preset, created in {DEFAULT_MODEL_DIR}")
    p.add_argument("--out", type=Path, default=None,
                   help="default benchmarks/results/rollout, or rollout-sglang when sglang_jax runs")
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


Call = Callable[[], np.ndarray]


def jax_call(model_dir: Path, prompts: np.ndarray, new_tokens: int) -> tuple[Call, Callable[[], None]]:
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

    return call, lambda: None


def transformers_call(model_dir: Path, prompts: np.ndarray, new_tokens: int) -> tuple[Call, Callable[[], None]]:
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

    return call, lambda: None


def sglang_call(model_dir: Path, prompts: np.ndarray, new_tokens: int) -> tuple[Call, Callable[[], None]]:
    """sglang_jax in a Ray actor of its own, started from a dummy load, then given the checkpoint's
    weights through `update_weights` (as in training: the actor's weights are the only weights)."""
    import ray

    from rlsched.cluster.ray_cluster import init_ray
    from workers.models import load_pretrained
    from workers.models import params as P
    from workers.rollout import SamplingParams
    from workers.rollout.sglang_jax import SglangJaxEngine

    batch, prompt_len = prompts.shape
    init_ray()
    actor = ray.remote(SglangJaxEngine).options(num_cpus=0, max_restarts=0).remote(
        str(model_dir), dtype="float32", max_prompt_len=prompt_len, max_new_tokens=new_tokens, max_batch_size=batch)
    model, _ = load_pretrained(model_dir, dtype="float32", with_tokenizer=False)
    ray.get(actor.update_weights.remote(P.host_params(model), 0))
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, stop_token_ids=())
    prompt_list = prompts.tolist()

    def call() -> np.ndarray:
        out = ray.get(actor.generate.remote(prompt_list, params))
        assert out.num_tokens == batch * new_tokens, f"sglang_jax produced {out.num_tokens} tokens"
        return np.stack([s.token_ids for s in out.samples])

    return call, lambda: ray.kill(actor)


MAKERS = {"jax_sampler": jax_call, "transformers": transformers_call, "sglang_jax": sglang_call}


def table(results: dict) -> str:
    a, env = results["args"], results["env"]
    threads = f"torch threads {env['torch_num_threads']}, " if "torch_num_threads" in env else ""
    rows = []
    for name, r in results["engines"].items():
        ratio = "1.00x (reference)" if name == REFERENCE else f"{r['vs_jax_sampler']:.2f}x"
        rows.append(f"| {name} | {r['start_s']:.2f} | {r['first_call_s']:.3f} | {r['median_s']:.4f} | "
                    f"{r['tokens_per_s']:,.0f} | {ratio} | {r['greedy_agreement']:.0%} |")
    return "\n".join([
        f"batch {a['batch']}, prompt {a['prompt_len']} tokens, {a['new_tokens']} new tokens, greedy fp32, "
        f"median of {a['repeats']}; model {a['model_dir']} ({results['model_params']:,} params); "
        f"{threads}jax {env['jax']} on {', '.join(env['jax_devices'])}, Python {env['python']}",
        "",
        "| engine | start-up (s) | first call (s) | median (s) | tokens/s | tokens/s vs jax_sampler "
        "| greedy rows equal to jax_sampler's |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    engines_to_run = resolve_engines(args.engines)
    out_dir = args.out or Path("benchmarks/results/rollout" + ("-sglang" if "sglang_jax" in engines_to_run else ""))
    model_dir = ensure_model(args.model_dir)
    prompts = np.random.default_rng(SEED).integers(0, 256, (args.batch, args.prompt_len), dtype=np.int32)
    n_tokens = args.batch * args.new_tokens
    env = environment()
    print(f"engines {engines_to_run}; jax devices {env['jax_devices']}", flush=True)

    engines, outputs = {}, {}
    for name in engines_to_run:
        print(f"{name}: start + warm-up + {args.repeats} timed calls ...", flush=True)
        t0 = time.perf_counter()
        call, close = MAKERS[name](model_dir, prompts, args.new_tokens)
        start_s = time.perf_counter() - t0
        try:
            engines[name], outputs[name] = timed(call, args.repeats, n_tokens)
        finally:
            close()
        engines[name]["start_s"] = start_s
    for name, r in engines.items():
        r["vs_jax_sampler"] = r["tokens_per_s"] / engines[REFERENCE]["tokens_per_s"]
        r["greedy_agreement"] = float(np.mean(np.all(outputs[name] == outputs[REFERENCE], axis=1)))

    results = dict(
        args=vars(args) | {"model_dir": str(model_dir), "out": str(out_dir), "engines": engines_to_run},
        model_params=count_params(model_dir), engines=engines, env=env,
        timestamp=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    save_results(out_dir, "Rollout benchmark", results, table(results))
    return results


if __name__ == "__main__":
    main()
