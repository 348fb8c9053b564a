"""What a checkpoint costs the step: `checkpoint_every: 1` against 0, written in the background (the
default) and synchronously (what rlsched did before), side by side in one invocation.

    python -m benchmarks.checkpoint [--steps 20] [--warmup-steps 4] [--preset small]
                                    [--out benchmarks/results/checkpoint]

The demo's addition task in this process (`rlsched train --in-process`: the one step loop, always-free locks)
on a random Qwen3 of `--preset` (`small`, ~4.5M params with AdamW's two moments: a save writes ~55 MB),
three runs: no checkpoints; one per step written in the background; one per step written before the step
goes on. Figures, medians over the steps after `--warmup-steps` (JAX compiles there):
- step time per run (from one step's end to the next's: the save and what the background write takes from
  the next step are in it), and each checkpointing run's ratio to the run without (the goal for the
  background writer is <= 1.05);
- the stall per save: the step's own `checkpoint` span (copy to host, and for the synchronous writer the
  files too).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import environment, save_results  # first: sets JAX to CPU, hubs offline

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_addition.yaml"
GOAL_RATIO = 1.05
MODES = {"none": ["tasks.0.checkpoint_every=0"],
         "background": ["tasks.0.checkpoint_every=1", "tasks.0.checkpoint_async=true"],
         "synchronous": ["tasks.0.checkpoint_every=1", "tasks.0.checkpoint_async=false"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="GRPO steps per run")
    p.add_argument("--warmup-steps", type=int, default=4, help="steps left out of the medians (compiles)")
    p.add_argument("--preset", default="small", choices=["tiny", "small"], help="the random model's size")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the task, as `rlsched train --set` (e.g. grpo.prompts_per_step=4)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/checkpoint"))
    args = p.parse_args(argv)
    if args.steps <= args.warmup_steps or args.warmup_steps < 1:
        p.error("need --steps > --warmup-steps >= 1")
    return args


def run(root: Path, mode: str, args) -> dict[str, float]:
    from rlsched.config.loading import load_config
    from rlsched.run.task import TaskDriver
    from rlsched.rundir.files import prepare_run_dir
    from rlsched.scheduling.scheduler import FreeLocks

    cfg = load_config(CONFIG, [f"experiment.name={mode}", f"experiment.output_dir={root}",
                               f"tasks.0.model.path={root / 'model'}", f"tasks.0.model.init_preset={args.preset}",
                               f"tasks.0.steps={args.steps}", *MODES[mode],
                               *(f"tasks.0.{o}" for o in args.overrides)])
    prepare_run_dir(cfg, resume=False, overwrite=True)
    (spec,) = cfg.task_specs()
    driver = TaskDriver(spec, FreeLocks(spec.name), echo=lambda *_: None)  # what run_in_process does, kept
    rows = driver.run()
    saves = [e["end"] - e["start"] for e in driver.events() if e.get("kind") == "span" and e["name"] == "checkpoint"]
    kept = sorted(p.name for p in spec.checkpoint_dir.iterdir()) if spec.checkpoint_dir.exists() else []
    # A step's own time (time/step_s) ends before its save; the wall time from one step's end to the next's
    # holds the save's stall and whatever the background writer takes from the next step.
    ends = [m["time/end_unix"] for m in rows[args.warmup_steps - 1:]]
    return {"step_s": statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False)),
            "compute_step_s": statistics.median(m["time/step_s"] for m in rows[args.warmup_steps:]),
            "save_stall_s": statistics.median(saves[args.warmup_steps:]) if saves else 0.0,
            "saves": len(saves), "kept": kept}


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for mode in MODES:
            runs[mode] = run(Path(tmp), mode, args)
            print(f"{mode}: step {runs[mode]['step_s'] * 1e3:.1f} ms, stall per save "
                  f"{runs[mode]['save_stall_s'] * 1e3:.1f} ms ({runs[mode]['saves']} saves)", flush=True)
    base = runs["none"]["step_s"]
    for mode in ("background", "synchronous"):
        runs[mode]["ratio"] = runs[mode]["step_s"] / base
    results = dict(args={k: str(v) for k, v in vars(args).items()}, env=environment(), runs=runs,
                   goal_ratio=GOAL_RATIO, met=runs["background"]["ratio"] <= GOAL_RATIO,
                   timestamp=datetime.now(UTC).isoformat(timespec="seconds"))
    rows = [f"| {mode} | {r['step_s'] * 1e3:.1f} | {r.get('ratio', 1.0):.3f} | {r['save_stall_s'] * 1e3:.1f} | "
            f"{r['compute_step_s'] * 1e3:.1f} |" for mode, r in runs.items()]
    report = "\n".join([
        f"demo addition task, {args.preset} Qwen3, in-process, {args.steps} steps, medians after "
        f"{args.warmup_steps} warm-up steps",
        "", "| checkpoints | step, ms | vs none | stall per save, ms | step without its save, ms |",
        "|---|---:|---:|---:|---:|", *rows, "",
        f"background writer: {runs['background']['ratio']:.3f} x the step without checkpoints "
        f"(goal <= {GOAL_RATIO}: {'met' if results['met'] else 'NOT met'}); synchronous: "
        f"{runs['synchronous']['ratio']:.3f} x"])
    save_results(args.out, "Checkpoint cost per step", results, report)
    return results


if __name__ == "__main__":
    main()
