"""Control-plane overhead: one task's step under Ray minus the same step `--in-process`.

    python -m benchmarks.overhead [--steps 30] [--warmup-steps 5] [--repeats 2]
                                  [--out benchmarks/results/overhead]

What is measured: the median `time/step_s` (what metrics.jsonl records) of the demo's addition task
(the tiny ~0.2M-parameter Qwen3, 16 prompts x 16 samples, 4 new tokens, colocated) run by the one step
loop (rlsched.task) in two ways, alternately `--repeats` times in one invocation:
- in-process: roles in this process, always-free locks (`rlsched train --in-process`);
- Ray: the driver, the actor and the engine each in a Ray actor process, locks from the scheduler actor
  (`rlsched train`), so a step pays two lock acquisitions, two releases and one call per role per phase.
The overhead is Ray step - in-process step, per repeat and as the median of the repeats; the goal is
<= 10 ms per step. Steps before `--warmup-steps` (JAX compiles there) are left out.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import environment, save_results  # first: sets JAX to CPU, hubs offline

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_addition.yaml"
GOAL_MS = 10.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="GRPO steps per run")
    p.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the medians (compiles)")
    p.add_argument("--repeats", type=int, default=2, help="in-process / Ray pairs, run alternately")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/overhead"))
    args = p.parse_args(argv)
    if args.steps <= args.warmup_steps or args.warmup_steps < 1 or args.repeats < 1:
        p.error("need --steps > --warmup-steps >= 1 and --repeats >= 1")
    return args


def config(root: Path, name: str, args):
    from rlsched.config import load_config
    from rlsched.runfiles import prepare_run_dir

    cfg = load_config(CONFIG, [f"experiment.name={name}", f"experiment.output_dir={root}",
                               f"tasks.0.model.path={root / 'model'}", f"tasks.0.steps={args.steps}",
                               "tasks.0.checkpoint_every=0", "cluster.placement=colocated"])
    prepare_run_dir(cfg, resume=False, overwrite=True)
    return cfg


def step_times(cfg, warmup: int) -> dict[str, float]:
    """Median seconds per step and per phase after the warm-up steps."""
    from rlsched.tracking import read_metrics

    rows = read_metrics(cfg.run_dir / "tasks" / "addition" / "metrics.jsonl")[warmup:]
    return {k: statistics.median(m[f"time/{k}_s"] for m in rows) for k in ("step", "rollout", "train", "reward")}


def main(argv=None) -> dict:
    args = parse_args(argv)
    from rlsched.cluster import init_ray
    from rlsched.experiment import run_experiment, run_in_process

    init_ray()
    quiet = lambda *_: None  # noqa: E731
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i in range(args.repeats):
            local = config(root, f"local-{i}", args)
            run_in_process(local, echo=quiet)
            remote = config(root, f"ray-{i}", args)
            result = run_experiment(remote, echo=quiet)["addition"]
            if result["status"] != "ok":
                raise SystemExit(f"the Ray run failed: {result.get('error')}")
            pair = {"in_process": step_times(local, args.warmup_steps), "ray": step_times(remote, args.warmup_steps)}
            pair["overhead_ms"] = 1e3 * (pair["ray"]["step"] - pair["in_process"]["step"])
            pairs.append(pair)
            print(f"repeat {i}: in-process {pair['in_process']['step'] * 1e3:.1f} ms/step, "
                  f"Ray {pair['ray']['step'] * 1e3:.1f} ms/step, overhead {pair['overhead_ms']:+.1f} ms", flush=True)
    overhead = statistics.median(p["overhead_ms"] for p in pairs)
    results = dict(args={k: str(v) for k, v in vars(args).items()}, env=environment(), repeats=pairs,
                   overhead_ms=overhead, goal_ms=GOAL_MS, timestamp=datetime.now(UTC).isoformat(timespec="seconds"))
    rows = [f"| {i} | {p['in_process']['step'] * 1e3:.1f} | {p['ray']['step'] * 1e3:.1f} | {p['overhead_ms']:+.1f} |"
            for i, p in enumerate(pairs)]
    report = "\n".join([
        f"demo addition task (tiny Qwen3, 16 x 16 samples, 4 new tokens), colocated, {args.steps} steps, "
        f"medians after {args.warmup_steps} warm-up steps",
        "", "| repeat | in-process ms/step | Ray ms/step | overhead ms |", "|---:|---:|---:|---:|", *rows, "",
        f"control-plane overhead (median of repeats): {overhead:+.1f} ms per step (goal <= {GOAL_MS:.0f} ms)",
    ])
    save_results(args.out, "Control-plane overhead", results, report)
    return results


if __name__ == "__main__":
    main()
