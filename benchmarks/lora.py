"""LoRA benchmark: N LoRA tasks on one shared base against the same N tasks as full-weight tasks, time-sliced.

    python -m benchmarks.lora [--tasks 1,8,32] [--full-tasks 1,8,32] [--steps 12] [--warmup-steps 4]
                              [--out benchmarks/results/lora]

For each N in --tasks, in this one run, on the same devices (colocated, `rlsched train`'s default
per_device_group layout under Ray, so a base group's base is loaded once in the device group's process):
- **lora**: N tasks of configs/demo_lora.yaml's shape (rank-8 adapters on every projection of one tiny base),
  addition and subtraction over four operand ranges, each its own seed;
- **full**: the same N tasks without `lora`: each trains its own copy of the tiny model, time-sliced by the
  scheduler (only for N in --full-tasks: 32 full-weight tasks are slow);
- **lora one after another**: not run; its steady throughput is the 1-task LoRA run's (the tasks have one
  shape), so it is derived from that run and labelled so.
Figures per configuration:
- aggregate samples/s in steady state: steps of every task that end in the window where every task is past
  `--warmup-steps` (JAX compiles in the first steps) and none has finished, x samples per step, / the window;
- mean step time per task: each task's wall time per step past warmup (waits for the locks included), averaged;
- bytes per device (device 0; colocated, every role is on it): what the roles measure they hold between phases
  (metrics `mem/<role>/held/*`, the last step's; a LoRA role's shared base `held/base` counted once per base
  group), beside `rlsched plan`'s numbers for the same config (rlsched.config.plan.device_plan): the same
  kinds (params, optimizer, reference, the bases), and the plan's whole-device total with every role resident
  (gradients, activations and KV caches included). The device-group process's live bytes on device 0 after
  the last phase (`mem/<role>/device0/bytes_in_use`) are shown too: whatever else was live then counts in.
The issue's three goals are checked from these: 32 LoRA tasks >= 8 x the aggregate throughput of 32 full-weight
tasks; per-task step time at 32 LoRA tasks <= 4 x one LoRA task alone; device bytes for 32 LoRA tasks <= 1.5 x
one full-weight task's. LoRA tasks of the base group share ROLLOUT holds (their rows in one program run, up to
`rollout.max_batch_size` rows: 8 of the demo's tasks) and TRAIN holds (their optimizer steps in one program run, up
to `actor.max_cobatch_rows` micro-batch rows); the mean number of tasks in each is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import environment, save_results  # first: sets JAX to CPU, hubs offline
from rlsched.rundir.files import write_atomic

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo_lora.yaml"
SHAPES = [(kind, operand) for operand in (9, 19, 49, 99) for kind in ("addition", "subtraction")]  # the demo's 8


def _targets() -> list[str]:
    import yaml

    return yaml.safe_load(CONFIG.read_text())["tasks"][0]["lora"]["targets"]


TARGETS = _targets()  # the demo's adapter targets, which every LoRA task here uses
GOALS = {"throughput": 8.0, "step_time": 4.0, "bytes": 1.5}
MEASURED = {"actor": ("params", "opt", "ref"), "engine": ("params",)}  # what a role reports it holds, by kind
PLANNED = {"actor": ("params", "optimizer", "reference"), "engine": ("params",)}  # the same kinds in the plan


def task_counts(text: str) -> list[int]:
    if text.strip().lower() == "none":  # --full-tasks none: no full-weight runs
        return []
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give task counts as positive integers, e.g. 1,8,32")
    return sorted(set(counts))


def counts(ns: list[int]) -> str:
    return ",".join(map(str, ns)) or "none"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=task_counts, default=[1, 8, 32], help="task counts N, e.g. 1,8,32")
    p.add_argument("--full-tasks", type=task_counts, default=None,
                   help="the N of --tasks that also run as full-weight tasks (default: all of them; none: no such run)")
    p.add_argument("--steps", type=int, default=12, help="GRPO steps per task")
    p.add_argument("--warmup-steps", type=int, default=4, help="steps per task left out of the steady state")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha stays 2 x rank, as in the demo)")
    p.add_argument("--preset", choices=("tiny", "small"), default="tiny",
                   help="the base: a random Qwen3 preset (tiny is the demo's; an adapter's share of it grows as the "
                        "model shrinks: rank 8 on every projection of tiny is ~15 %% of its bytes)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting of every task, e.g. grpo.max_new_tokens=8 (repeatable)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/lora"))
    args = p.parse_args(argv)
    if args.steps < args.warmup_steps + 2:
        p.error(f"--steps {args.steps}: need at least --warmup-steps + 2 = {args.warmup_steps + 2} steps, so that "
                "the steady state has an interval to time")
    if args.full_tasks is None:
        args.full_tasks = list(args.tasks)
    if not set(args.full_tasks) <= set(args.tasks):
        p.error(f"--full-tasks {counts(args.full_tasks)}: each must be one of --tasks {counts(args.tasks)}")
    return args


def experiment(name: str, n: int, lora: bool, args, *, base: str, output_dir: str) -> str:
    """The YAML config of N tasks of the demo's shape, with or without their adapters, on the model at `base`."""
    import yaml

    raw = yaml.safe_load(CONFIG.read_text())
    template = raw["tasks"][0]
    template["model"] = {"path": base, "init_preset": args.preset}
    template["lora"] = {**template["lora"], "rank": args.rank, "alpha": 2 * args.rank}
    if not lora:
        del template["lora"]
    tasks = []
    for i in range(n):
        kind, operand = SHAPES[i % len(SHAPES)]
        tasks.append({**template, "name": f"{kind[:3]}-{operand}-{i}", "seed": i, "steps": args.steps,
                      "checkpoint_every": 0, "data": {**template["data"], "kind": kind, "max_operand": operand},
                      "reward": {"name": kind}})
    raw["tasks"] = tasks
    raw["experiment"] = {"name": name, "output_dir": output_dir, "seed": 0}
    return yaml.safe_dump(raw, sort_keys=False)


def overrides(n: int, args) -> list[str]:
    return [f"tasks.{i}.{o}" for i in range(n) for o in args.overrides]


def measure(root: Path, name: str, n: int, lora: bool, args) -> dict:
    """Run one configuration under Ray and read back its figures (seconds, samples, bytes)."""
    from rlsched.config.loading import load_configs
    from rlsched.config.plan import device_plan
    from rlsched.observe.tracking import read_metrics
    from rlsched.run.experiment import train

    path = root / f"{name}.yaml"
    path.write_text(experiment(name, n, lora, args, base=str(root / "base"), output_dir=str(root / "runs")))
    cfg = load_configs([path], overrides(n, args))
    t0 = time.perf_counter()
    results = train([path], overrides=overrides(n, args), overwrite=True, echo=lambda *_: None)
    wall = time.perf_counter() - t0
    failed = {k: v.get("error", v["status"]) for k, v in results.items() if v["status"] != "ok"}
    if failed:
        for task, v in results.items():  # where it failed: the remote traceback, for the report of a bug
            if v["status"] != "ok" and v.get("traceback"):
                print(f"{name}: task {task} failed:\n{v['traceback']}", file=sys.stderr, flush=True)
        raise SystemExit(f"{name}: tasks failed: {failed}")
    metrics = {t.name: read_metrics(cfg.run_dir / "tasks" / t.name / "metrics.jsonl") for t in cfg.tasks}
    short = {t: len(m) for t, m in metrics.items() if len(m) != args.steps}
    if short:
        raise SystemExit(f"{name}: tasks logged fewer than {args.steps} steps: {short}")
    w = args.warmup_steps
    ends = {t: [m["time/end_unix"] for m in rows] for t, rows in metrics.items()}
    start, stop = max(e[w] for e in ends.values()), min(e[-1] for e in ends.values())
    samples = {t.name: t.grpo.prompts_per_step * t.grpo.num_generations for t in cfg.tasks}
    if stop > start:  # steps that end inside the window where every task runs past its warmup
        done = sum(samples[t] * sum(1 for x in e if start < x <= stop) for t, e in ends.items())
        rate = done / (stop - start)
    else:  # no common window (a task finished before another left warmup): every steady step over the span from
        # the first task's warmup to the last task's end; others' warmups fall in it, so it errs low, never high
        span = max(e[-1] for e in ends.values()) - min(e[w] for e in ends.values())
        rate = sum(samples[t] * (len(e) - 1 - w) for t, e in ends.items()) / span
    step_s = statistics.mean((e[-1] - e[w]) / (len(e) - 1 - w) for e in ends.values())
    cobatched = statistics.mean(m["rollout/cobatched"] for rows in metrics.values() for m in rows[w:])
    cotrained = statistics.mean(m.get("train/cobatched", 1) for rows in metrics.values() for m in rows[w:])
    # bytes per device 0, measured: each role's own (its adapter when LoRA), each distinct shared base once
    held = {"tasks": 0, "bases": 0, "process_live": 0}
    bases = set()
    for rows in metrics.values():
        last = rows[-1]
        for role, kinds in MEASURED.items():
            held["tasks"] += sum(int(last.get(f"mem/{role}/held/{k}", 0)) for k in kinds)
            if f"mem/{role}/held/base" in last:
                bases.add(int(last[f"mem/{role}/held/base"]))
            held["process_live"] = max(held["process_live"], int(last.get(f"mem/{role}/device0/bytes_in_use", 0)))
    held["bases"] = sum(bases)  # one base group here: its actors and engines read one base
    held["total"] = held["tasks"] + held["bases"]
    plan = device_plan(cfg)
    planned = {"tasks": sum(r.bytes.get(k, 0) for r in plan.roles if r.role in PLANNED and 0 in r.devices
                            for k in PLANNED[r.role]),
               "bases": sum(r.total for r in plan.roles if r.role == "base" and 0 in r.devices),
               "every_role_resident": plan.per_device[0]}
    planned["total"] = planned["tasks"] + planned["bases"]
    # the device's peak under the scheduler, by the plan: what is held, plus one actor's train phase (gradients,
    # activations) and one engine's KV cache (a ROLLOUT and a TRAIN lock each hold one task at a time)
    on0 = [r for r in plan.roles if 0 in r.devices]
    planned["one_phase_at_a_time"] = planned["total"] + max(
        (r.bytes.get("grads", 0) + r.bytes.get("activations", 0) for r in on0 if r.role == "actor"), default=0) + max(
        (r.bytes.get("kv_cache", 0) for r in on0 if r.role == "engine"), default=0)
    print(f"{name}: {rate:.1f} samples/s, {step_s:.3f} s/step per task, {cobatched:.1f} tasks per rollout, "
          f"{cotrained:.1f} per train, "
          f"{held['total'] / 2**20:.2f} MiB held "
          f"(plan {planned['total'] / 2**20:.2f} MiB), {wall:.1f} s wall", flush=True)
    # the same config, kept beside the results: `rlsched plan` (and `rlsched train`) of it from the repo's root
    saved = args.out / "configs" / f"{name}.yaml"
    saved.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(saved, experiment(name, n, lora, args, base=f"runs/models/{args.preset}-lora-base", output_dir="runs"))
    plan_command = ["plan", str(saved), *(a for o in overrides(n, args) for a in ("--set", o))]
    return dict(tasks=n, lora=lora, wall_s=wall, plan_command=plan_command, samples_per_step=samples,
                samples_per_s=rate, step_s=step_s, cobatched=cobatched, cotrained=cotrained,
                window_s=max(stop - start, 0.0), bytes_measured=held,
                bytes_planned=planned, shared_bases=len(bases))


def goals(runs: dict[str, dict], args) -> dict:
    """The issue's three goals, each {"ratio", "goal", "met", "note"}, or {"skipped": why} where a run is missing."""
    n = max(args.tasks)
    lora, full, one = runs.get(f"lora-{n}"), runs.get(f"full-{n}"), runs.get("lora-1")
    full_one = runs.get("full-1")
    out: dict[str, dict] = {}
    if lora and full:
        ratio = lora["samples_per_s"] / full["samples_per_s"]
        out["throughput"] = dict(ratio=ratio, goal=GOALS["throughput"], met=ratio >= GOALS["throughput"],
                                 what=f"{n} LoRA tasks' aggregate samples/s / {n} full-weight tasks'")
    else:
        out["throughput"] = dict(skipped=f"needs lora-{n} and full-{n} (--full-tasks {counts(args.full_tasks)})")
    if lora and one:
        ratio = lora["step_s"] / one["step_s"]
        out["step_time"] = dict(ratio=ratio, goal=GOALS["step_time"], met=ratio <= GOALS["step_time"],
                                what=f"mean step time per task, {n} LoRA tasks / one LoRA task alone")
    else:
        out["step_time"] = dict(skipped=f"needs lora-{n} and lora-1 (--tasks {counts(args.tasks)})")
    if lora and full_one:
        measured = lora["bytes_measured"]["total"] / full_one["bytes_measured"]["total"]
        peak = lora["bytes_planned"]["one_phase_at_a_time"] / full_one["bytes_planned"]["one_phase_at_a_time"]
        every = lora["bytes_planned"]["every_role_resident"] / full_one["bytes_planned"]["every_role_resident"]
        out["bytes"] = dict(ratio=measured, goal=GOALS["bytes"], met=measured <= GOALS["bytes"],
                            planned_one_phase_ratio=peak, planned_one_phase_met=peak <= GOALS["bytes"],
                            planned_every_role_resident_ratio=every,
                            planned_every_role_resident_met=every <= GOALS["bytes"],
                            what=f"bytes held on device 0, {n} LoRA tasks / one full-weight task")
    else:
        out["bytes"] = dict(skipped=f"needs lora-{n} and full-1 (--tasks and --full-tasks must hold 1)")
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    from rlsched.cluster.ray_cluster import init_ray
    from workers.models import init_model

    init_ray()  # one Ray for every configuration: a run's start does not include Ray's
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        init_model(root / "base", preset=args.preset, seed=0)  # made once, before any timed run (init_seed 0)
        for n in args.tasks:  # side by side: each N's LoRA and full-weight runs back to back, same minute
            runs[f"lora-{n}"] = measure(root, f"lora-{n}", n, True, args)
            if n in args.full_tasks:
                runs[f"full-{n}"] = measure(root, f"full-{n}", n, False, args)
    if "lora-1" in runs:  # one after another: each task at the 1-task rate, back to back (derived, not run)
        for n in args.tasks:
            runs[f"lora-{n}"]["sequential_samples_per_s"] = runs["lora-1"]["samples_per_s"]
    verdicts = goals(runs, args)
    skipped = [n for n in args.tasks if n not in args.full_tasks]
    results = dict(args={k: str(v) for k, v in vars(args).items()}, env=environment(), runs=runs, goals=verdicts,
                   full_skipped=skipped,
                   timestamp=datetime.now(UTC).isoformat(timespec="seconds"))
    save_results(args.out, "LoRA tasks on one base against full-weight tasks", results, report(runs, verdicts, args))
    return results


def report(runs: dict[str, dict], verdicts: dict, args) -> str:
    mib = 2**20
    rows = []
    for name, r in runs.items():
        seq = r.get("sequential_samples_per_s")
        rows.append(f"| {name} | {r['samples_per_s']:.1f} | {'-' if seq is None else f'{seq:.1f}'} | "
                    f"{r['step_s']:.3f} | {r['cobatched']:.1f} | {r.get('cotrained', 1.0):.1f} | "
                    f"{r['bytes_measured']['total'] / mib:.2f} | "
                    f"{r['bytes_planned']['total'] / mib:.2f} | "
                    f"{r['bytes_planned']['one_phase_at_a_time'] / mib:.2f} | "
                    f"{r['bytes_planned']['every_role_resident'] / mib:.2f} | "
                    f"{r['bytes_measured']['process_live'] / mib:.2f} | {r['window_s']:.1f} | {r['wall_s']:.1f} |")
    lines = [
        f"{args.preset} Qwen3 base, demo_lora's task shape (rank {args.rank} on {' '.join(TARGETS)}), colocated, "
        f"per_device_group under Ray; {args.steps} steps per task, steady state past {args.warmup_steps} "
        f"warmup steps" + (f"; --set {' '.join(args.overrides)}" if args.overrides else ""),
        "",
        "| run | aggregate samples/s | LoRA one after another, samples/s (derived from lora-1) | step s per task "
        "| tasks per rollout | tasks per train | MiB held, measured | MiB held, plan | MiB plan, one phase at a time "
        "| MiB plan, every role resident "
        "| MiB live in the process | "
        "steady window s | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "MiB held: device 0, between phases: actor params + optimizer + reference and engine params per task (a "
        "LoRA task's: its adapter), the shared base once. Plan, one phase at a time: held, plus the "
        "largest actor's gradients and activations and the largest engine KV cache (the ROLLOUT and TRAIN locks "
        "each serve one task at a time). Plan, every role resident: `rlsched plan`'s device total, every task's "
        "gradients, activations and KV cache at once. Steady window: where every task is past warmup and none "
        "has finished (0: there was none, and the rate is every steady step over the span from the first task's warmup "
        "to the last one's end, which errs low). The configs run are "
        f"in {args.out / 'configs'} (`rlsched plan` of each gives the plan's columns).",
    ]
    skipped = [n for n in args.tasks if n not in args.full_tasks]
    if skipped:
        lines.append(f"full-weight runs skipped for N = {', '.join(map(str, skipped))} (not in --full-tasks, for "
                     "time: each full-weight task trains its own copy of the model).")
    lines += ["", "goals:"]
    notes = {"throughput": "", "step_time": "", "bytes": ""}
    one = runs.get("lora-1", {}).get("bytes_measured")
    if one and one["bases"]:  # what decides the bytes goal: a task's adapter state beside the base it shares
        notes["bytes"] = (f"each LoRA task holds {one['tasks'] / one['bases']:.0%} of the base's bytes (its adapter, "
                          "the adapter's two moments, the engine's copy); the share falls as the model widens "
                          "(rank x (in + out) against in x out per projection)")
    for key, g in verdicts.items():
        if "skipped" in g:
            lines.append(f"- {key}: not measured ({g['skipped']})")
            continue
        sign = ">=" if key == "throughput" else "<="
        verdict = "met" if g["met"] else "NOT met"
        line = f"- {key}: {g['what']} = {g['ratio']:.2f} x (goal {sign} {g['goal']:g} x): {verdict}"
        if key == "bytes":
            line += (f"; by the plan's peak with one phase at a time {g['planned_one_phase_ratio']:.2f} x: "
                     f"{'met' if g['planned_one_phase_met'] else 'NOT met'}; by the plan with every role resident "
                     f"(every task's KV cache and activations at once, an upper bound) "
                     f"{g['planned_every_role_resident_ratio']:.2f} x: "
                     f"{'met' if g['planned_every_role_resident_met'] else 'NOT met'}")
        if notes[key]:
            line += f". Note: {notes[key]}"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
