"""GRPO step benchmark: one task's step (rollout, reward, train) in rlsched against a plain transformers + torch loop.

    python -m benchmarks.train_step [--steps 10] [--warmup-steps 2] [--prompts 16] [--generations 16]
                                    [--new-tokens 4] [--preset tiny] [--out benchmarks/results/train_step]

What is measured: the wall time of each phase of a GRPO step, per side, on one random checkpoint of `--preset`:
rollout (next prompts, tokenize, sample G completions each), reward (decode, score), train (advantages, one
forward/backward over all samples, one optimizer step). rlsched's phases also carry its weight hand-off (export
after train, sync and checksum before rollout); the torch loop samples from the model it trains, so it has none.
Figures are medians over `--steps` timed steps that follow `--warmup-steps` untimed ones (where JAX compiles;
the first step's time is reported on its own). The ratio is torch step / rlsched step, so above 1.0x rlsched is
faster. The goal: rlsched's step is no slower than the minimal GRPO loop a practitioner writes in eager torch.

Design decisions:
- rlsched runs its real path: configs/demo_addition.yaml through `load_config` with overrides, then the
  task's one step loop in-process (`rlsched train --in-process`); the phase times are the ones it logs to
  metrics.jsonl.
- Same work on both sides, from the same config object: the same prompts (the task's source and loader with
  the task seed), sampling (temperature, top_p; HF's default top_k=50 switched off), reward function and lengths;
  one optimizer step on all samples per GRPO step, on-policy (ratio from detached logprobs: no extra forward),
  beta 0, token-mean loss; AdamW with the same lr, betas, weight decay and grad clip. rlsched's lr follows its
  warmup-cosine schedule and the loop's is constant: a different rate, the same work.
- The two samplers draw different random streams, so completions, lengths and rewards differ; tokens/step and
  mean reward are reported so any difference in work is visible.
- fp32 on both sides, CPU against CPU by default (benchmarks.common); torch keeps its default thread count.
- The sides run one after the other, never concurrently, so neither takes the other's cores.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import count_params, environment, save_results  # first: sets JAX to CPU, hubs offline

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_addition.yaml"
PHASES = ("rollout_s", "reward_s", "train_s", "step_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_step", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed GRPO steps per side")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first (JAX compiles here)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/train_step"))
    args = p.parse_args(argv)
    for name, low in (("steps", 1), ("warmup_steps", 1), ("prompts", 1), ("generations", 2), ("new_tokens", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    return args


def ensure_model(preset: str) -> Path:
    model_dir = Path(f"runs/bench-models/{preset}-train")
    if not (model_dir / "config.json").is_file():
        from workers.models import init_model

        init_model(model_dir, preset=preset)  # the initialisation `rlsched train` uses for init_preset
    return model_dir


def experiment_config(args: argparse.Namespace, model_dir: Path, output_dir: str):
    from rlsched.config.loading import load_config

    samples = args.prompts * args.generations
    t = "tasks.0"
    # Overrides pin every setting that decides the work, so an edit to the demo config cannot skew the comparison.
    return load_config(CONFIG, [
        f"experiment.output_dir={output_dir}", f"{t}.model.path={model_dir}", f"{t}.model.init_preset=null",
        f"{t}.steps={args.warmup_steps + args.steps}", f"{t}.grpo.prompts_per_step={args.prompts}",
        f"{t}.grpo.num_generations={args.generations}", f"{t}.grpo.max_new_tokens={args.new_tokens}",
        # One optimizer step per GRPO step over all samples in one pass, as the torch loop does.
        f"{t}.grpo.mini_batch_size={samples}", f"{t}.grpo.micro_batch_size={samples}", f"{t}.grpo.epochs_per_step=1",
        f"{t}.grpo.beta=0", f"{t}.grpo.loss_aggregation=token-mean", f"{t}.model.dtype=float32",
    ])


def rlsched_steps(cfg, total: int) -> list[dict]:
    from rlsched.run.experiment import run_in_process
    from rlsched.rundir.files import prepare_run_dir

    prepare_run_dir(cfg, resume=False, overwrite=True)  # the task writes its metrics under the run dir
    metrics = run_in_process(cfg, echo=lambda line: print(f"  {line}", flush=True))[cfg.tasks[0].name]
    if len(metrics) != total:
        raise SystemExit(f"expected {total} rlsched steps, the run returned {len(metrics)}")
    return [{**{p: m[f"time/{p}"] for p in PHASES}, "tokens": m["tokens/generated"], "reward": m["reward/mean"]}
            for m in metrics]


def torch_steps(cfg, model_dir: Path, total: int) -> list[dict]:
    """The plain loop: what a practitioner writes with transformers and torch, eager, no rlsched machinery."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers import data as D
    from workers import rewards as R

    task = cfg.tasks[0]
    g, o, G = task.grpo, task.optim, task.grpo.num_generations
    seed = task.resolved_seed(cfg.experiment.seed, 0)
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")  # generate continues every row at the end
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.b1, o.b2), weight_decay=o.weight_decay)
    source = D.make_source(task.data.kind, seed=seed, max_operand=task.data.max_operand)
    loader = D.PromptLoader(source, g.prompts_per_step, seed=seed, shuffle=task.data.shuffle)
    eps_high = g.clip_range[1]

    def step() -> dict:
        t0 = time.perf_counter()
        prompts = loader.next_batch()
        # The plain template is the question as is, so these ids are the ones rlsched's render_prompt makes.
        enc = tok([p.question for p in prompts], return_tensors="pt", padding=True, return_token_type_ids=False)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=g.temperature, top_p=g.top_p, top_k=0,
                                 num_return_sequences=G, max_new_tokens=g.max_new_tokens,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        plen = enc.input_ids.shape[1]
        completion = out[:, plen:]  # (N, L), prompt-major: the G samples of a prompt are adjacent
        # Real tokens run through the first eos. Keyed on eos, not on the pad id: a random model may sample it.
        is_eos = (completion == tok.eos_token_id).int()
        mask = (is_eos.cumsum(1) - is_eos) == 0
        t1 = time.perf_counter()
        lengths = mask.sum(1).tolist()
        texts = [tok.decode(c[:n], skip_special_tokens=True) for c, n in zip(completion, lengths, strict=True)]
        answers = [p.answer for p in prompts for _ in range(G)]
        scored = R.score(task.reward.name, texts, answers, task=task.name, on_error=task.reward.on_error)
        rewards = torch.from_numpy(scored.rewards)
        t2 = time.perf_counter()
        grouped = rewards.view(-1, G)
        adv = grouped - grouped.mean(1, keepdim=True)
        if g.normalize_advantage_std:
            adv = adv / (grouped.std(1, unbiased=False, keepdim=True) + 1e-6)
        adv = adv.view(-1, 1)
        attn = torch.cat([enc.attention_mask.repeat_interleave(G, 0), mask.long()], 1)
        positions = (attn.cumsum(1) - 1).clamp(min=0)  # left padding: each row counts from its own first token
        logits = model(input_ids=out, attention_mask=attn, position_ids=positions).logits
        logits = logits[:, plen - 1 : -1] / g.temperature  # position k predicts token k + 1: completion only
        logp = logits.log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())  # on-policy: 1 in value, its gradient is that of logp
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - g.epsilon, 1 + eps_high) * adv)
        m = mask.float()
        loss = (per_token * m).sum() / m.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        t3 = time.perf_counter()
        return dict(rollout_s=t1 - t0, reward_s=t2 - t1, train_s=t3 - t2, step_s=t3 - t0, tokens=int(m.sum()),
                    reward=float(rewards.mean()))

    return [step() for _ in range(total)]


def summarize(steps: list[dict], warmup: int) -> dict:
    timed = steps[warmup:]
    out = {f"median_{p}": statistics.median(s[p] for s in timed) for p in PHASES}
    return out | dict(first_step_s=steps[0]["step_s"], min_step_s=min(s["step_s"] for s in timed),
                      max_step_s=max(s["step_s"] for s in timed),
                      tokens_per_step=statistics.mean(s["tokens"] for s in timed),
                      mean_reward=statistics.mean(s["reward"] for s in timed), steps=steps)


def table(results: dict) -> str:
    a, env, sides = results["args"], results["env"], results["sides"]
    lines = [
        f"{a['prompts']} prompts x {a['generations']} generations = {a['prompts'] * a['generations']} samples/step, "
        f"up to {a['new_tokens']} new tokens, one optimizer step per GRPO step, fp32; median of {a['steps']} timed "
        f"steps after {a['warmup_steps']} warm-up; model {results['model_dir']} ({results['model_params']:,} params); "
        f"torch threads {env['torch_num_threads']}, jax on {', '.join(env['jax_devices'])}, "
        f"{env['cpus_usable']} usable CPUs; rlsched rollout.max_batch_size {results['rollout_max_batch_size']}",
        "",
        "| side | first step (s) | rollout (s) | reward (s) | train (s) | step (s) | step min-max (s) "
        "| tokens/step | mean reward |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {name} | {s['first_step_s']:.3f} | {s['median_rollout_s']:.4f} | {s['median_reward_s']:.4f} | "
          f"{s['median_train_s']:.4f} | {s['median_step_s']:.4f} | {s['min_step_s']:.4f}-{s['max_step_s']:.4f} | "
          f"{s['tokens_per_step']:.0f} | {s['mean_reward']:.3f} |" for name, s in sides.items()),
        "",
        f"ratio torch / rlsched step: {results['ratio']:.2f}x (>1: rlsched faster); per phase: "
        + ", ".join(f"{p.removesuffix('_s')} {r:.2f}x" for p, r in results["phase_ratios"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model_dir = ensure_model(args.preset)
    env = environment()
    print(f"torch.get_num_threads() = {env['torch_num_threads']}; jax devices {env['jax_devices']}", flush=True)
    total = args.warmup_steps + args.steps
    with tempfile.TemporaryDirectory(prefix="rlsched-bench-") as tmp:
        cfg = experiment_config(args, model_dir, tmp)
        print(cfg.tasks[0].batch_plan().describe(), flush=True)
        print(f"rlsched: {args.warmup_steps} warm-up + {args.steps} timed steps ...", flush=True)
        rlsched = summarize(rlsched_steps(cfg, total), args.warmup_steps)
    print(f"transformers + torch: {args.warmup_steps} warm-up + {args.steps} timed steps ...", flush=True)
    torch_side = summarize(torch_steps(cfg, model_dir, total), args.warmup_steps)

    sides = {"rlsched (jax)": rlsched, "transformers + torch": torch_side}
    results = dict(
        args=vars(args) | {"out": str(args.out)}, model_dir=str(model_dir), model_params=count_params(model_dir),
        rollout_max_batch_size=cfg.tasks[0].rollout.max_batch_size, sides=sides,
        ratio=torch_side["median_step_s"] / rlsched["median_step_s"],
        phase_ratios={p: torch_side[f"median_{p}"] / rlsched[f"median_{p}"] for p in PHASES[:3]},
        env=env, timestamp=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    save_results(args.out, "GRPO step benchmark", results, table(results))
    return results


if __name__ == "__main__":
    main()
