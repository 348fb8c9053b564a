"""`rlsched bench`: the same GRPO task run as 1, 2, 3 and 4 concurrent tasks, and each task alone.

    rlsched bench [--tasks 1,2,3,4] [--placement disaggregated|colocated|both] [--preset cpu]
                  [--steps 20] [--warmup 3] [--set grpo.max_new_tokens=32 ...] [--out DIR]

What one invocation measures, side by side (see the report's glossary for every column):
- **Throughput** of N tasks together (GRPO steps/s, samples/s, generated tokens/s) over the steady
  window once every task is past `--warmup` steps (JAX compiles in the first steps of each process).
- **Speedup vs sequential**: each task of the N also runs alone; "sequential" is their steady rates
  combined back to back. The **ideal bound** comes from the solo run's measured phase times: for N
  tasks on one rollout and one train resource, throughput <= 1 / max(R, T) steps/s (and <= N solo
  rates); **efficiency** = measured / bound.
- From each run's timeline: device **busy fraction** per resource, **switch overhead** (onload,
  offload, weight sync, verify) and **lock wait** per task.
- **Learning parity**: each task's reward curve together vs alone. Multiplexing changes when things
  run, never what they compute, so the curves must be identical (the report gives the largest
  difference of any step's mean reward).
- **Simulator check**: benchmarks.simulate, fed the solo run's phase profile, predicts each N's
  makespan with the scheduler's own policy; the report gives its error against the measurement.

Presets: `cpu` is the balanced tiny task (see benchmarks.multitask.BALANCED) sized for this 2-core CPU
(both placements, 1-4 tasks, ~10 minutes); `qwen3-gsm8k` is configs/gsm8k_qwen3.yaml for real hardware
(it needs the weights where the config says).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.common import environment, save_results

ROOT = Path(__file__).resolve().parents[1]
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {"config": ROOT / "configs" / "demo_addition.yaml", "tiny": True,
            "set": {"grpo.prompts_per_step": 4, "grpo.num_generations": 8, "grpo.max_new_tokens": 32,
                    "grpo.mini_batch_size": 32, "rollout.max_batch_size": 4}},
    "qwen3-gsm8k": {"config": ROOT / "configs" / "gsm8k_qwen3.yaml", "tiny": False, "set": {}},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlsched bench", description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="1,2,3,4", help="task counts to run together (default 1,2,3,4)")
    p.add_argument("--placement", choices=("disaggregated", "colocated", "both"), default="both")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--steps", type=int, default=20, help="GRPO steps per task (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of steady-state figures (default 3)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a task setting, e.g. grpo.max_new_tokens=16 (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/bench-<preset>")
    args = p.parse_args(argv)
    try:
        args.counts = sorted({int(x) for x in args.tasks.split(",") if x.strip()})
    except ValueError:
        p.error(f"--tasks takes task counts like 1,2,3,4, got {args.tasks!r}")
    if not args.counts or min(args.counts) < 1:
        p.error(f"--tasks needs positive task counts, got {args.tasks!r}")
    if args.steps <= args.warmup + 2:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) by at least 3 to leave a steady window")
    args.out = args.out or ROOT / "benchmarks" / "results" / f"bench-{args.preset}"
    return args


# ---- runs ------------------------------------------------------------------------------------------------------

def make_config(root: Path, name: str, names: list[str], placement: str, args):
    """An experiment of `names`, each the preset task with its own seed (seed i for task i, alone or not)."""
    import yaml

    from rlsched.config.loading import validate
    from rlsched.rundir.files import prepare_run_dir

    preset = PRESETS[args.preset]
    raw = yaml.safe_load(Path(preset["config"]).read_text())
    template = raw["tasks"][0]
    if preset["tiny"]:
        template["model"] = {"path": str(root / "model"), "init_preset": "tiny"}
    template.update(steps=args.steps, checkpoint_every=0)
    raw["tasks"] = [{**template, "name": n, "seed": 1000 + int(n[1:])} for n in names]
    settings = [f"{k}={v}" for k, v in preset["set"].items()] + list(args.overrides)
    raw["experiment"] = {**raw.get("experiment", {}), "name": name, "output_dir": str(root)}
    raw["cluster"] = {**raw.get("cluster", {}), "placement": placement}
    cfg = validate(raw, [f"tasks.{i}.{o}" for i in range(len(names)) for o in settings], label=name)
    prepare_run_dir(cfg, resume=False, overwrite=True)
    return cfg


def run(cfg) -> dict[str, Any]:
    """Run an experiment; its tasks' metrics rows and its summary.json."""
    from rlsched.observe.tracking import read_metrics
    from rlsched.run.experiment import run_experiment

    t0 = time.perf_counter()
    results = run_experiment(cfg, echo=lambda *_: None)
    wall = time.perf_counter() - t0
    failed = {k: v.get("error") for k, v in results.items() if v["status"] != "ok"}
    if failed:
        raise SystemExit(f"bench: run {cfg.experiment.name} failed: {failed}")
    rows = {t.name: read_metrics(cfg.run_dir / "tasks" / t.name / "metrics.jsonl") for t in cfg.tasks}
    summary = json.loads((cfg.run_dir / "summary.json").read_text())
    return {"rows": rows, "summary": summary, "wall_s": wall}


def steady(rows: dict[str, list[dict]], warmup: int) -> dict[str, float]:
    """Steps/s, samples/s and generated tokens/s over the window where every task is past `warmup`."""
    ends = {t: [m["time/end_unix"] for m in r] for t, r in rows.items()}
    start = max(e[warmup - 1] for e in ends.values())  # every task has finished its warm-up steps
    stop = min(e[-1] for e in ends.values())  # ... and none has finished its run
    done = [m for r in rows.values() for m in r if start < m["time/end_unix"] <= stop]
    seconds = stop - start
    samples = sum(m["tokens/generated"] / max(m["response_len/mean"], 1e-9) for m in done)
    return {"steps_per_s": len(done) / seconds, "samples_per_s": samples / seconds,
            "tokens_per_s": sum(m["tokens/generated"] for m in done) / seconds, "window_s": seconds}


def phase_medians(rows: list[dict], warmup: int) -> dict[str, float]:
    keys = ("rollout", "reward", "train", "step")
    return {k: statistics.median(m[f"time/{k}_s"] for m in rows[warmup:]) for k in keys}


def parity(together: list[dict], alone: list[dict]) -> float:
    """Largest |mean reward together - alone| over the steps (0.0 when multiplexing changed nothing)."""
    return max(abs(a["reward/mean"] - b["reward/mean"]) for a, b in zip(together, alone, strict=True))


# ---- one placement ---------------------------------------------------------------------------------------------

def bench_placement(root: Path, placement: str, args) -> dict[str, Any]:
    from benchmarks import simulate as S

    w, n_max = args.warmup, max(args.counts)
    names = [f"t{i}" for i in range(n_max)]
    solo = {}
    for name in names:
        print(f"[bench] {placement}: {name} alone", flush=True)
        solo[name] = run(make_config(root, f"{placement}-solo-{name}", [name], placement, args))
    rates = {n: steady(solo[n]["rows"], w)["steps_per_s"] for n in names}
    phases = phase_medians(solo["t0"]["rows"]["t0"], w)
    rows = []
    measured_makespan = {}
    for n in args.counts:
        members = names[:n]
        if n == 1:
            result = solo["t0"]
        else:
            print(f"[bench] {placement}: {n} tasks together", flush=True)
            result = run(make_config(root, f"{placement}-together-{n}", members, placement, args))
        rate = steady(result["rows"], w)
        sequential = len(members) / sum(1 / rates[m] for m in members)  # back to back, each at its solo rate
        bound = min(sum(rates[m] for m in members), 1 / max(phases["rollout"], phases["train"]))
        timeline = result["summary"].get("timeline", {})
        tasks_tl = timeline.get("tasks", {})
        seconds, steps = S.measured_makespan(list(result["rows"].values()), warmup=w)
        measured_makespan[n] = seconds
        rows.append({
            "tasks": n, **rate, "sequential_steps_per_s": sequential, "speedup": rate["steps_per_s"] / sequential,
            "bound_steps_per_s": bound, "bound_speedup": bound / sequential,
            "efficiency": rate["steps_per_s"] / bound, "wall_s": result["wall_s"],
            "busy": {r: v.get("busy_fraction") for r, v in timeline.get("resources", {}).items()},
            "switch_s_per_task": (statistics.mean(v.get("switch_s", 0.0) for v in tasks_tl.values())
                                  if tasks_tl else None),
            "lock_wait_s_per_task": statistics.mean(sum(m["time/lock_wait_s"] for m in r[w:])
                                                    for r in result["rows"].values()),
            "parity_max_abs_reward_diff": max(parity(result["rows"][m], solo[m]["rows"][m]) for m in members),
        })
    profile = S.profile_from_metrics(solo["t0"]["rows"]["t0"], warmup=w)
    validation = S.validate(measured_makespan, profile, steps=args.steps - w, placement=placement)
    return {"placement": placement, "solo_steps_per_s": rates, "solo_phase_s": phases, "rows": rows,
            "simulator": validation}


# ---- report ----------------------------------------------------------------------------------------------------

def format_placement(res: dict[str, Any]) -> str:
    from benchmarks.simulate import format_validation

    p = res["solo_phase_s"]
    lines = [f"### {res['placement']}", "",
             f"solo phase medians (t0): rollout {p['rollout']:.3f}s, reward {p['reward']:.3f}s, "
             f"train {p['train']:.3f}s, step {p['step']:.3f}s", "",
             "| tasks | steps/s | samples/s | tokens/s | speedup vs sequential | bound | efficiency | busy "
             "| switch s/task | lock wait s/task | parity (max Δreward) |",
             "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in res["rows"]:
        busy = ", ".join(f"{k.split('/')[-1]} {v:.0%}" for k, v in r["busy"].items() if v is not None) or "n/a"
        switch = "n/a" if r["switch_s_per_task"] is None else f"{r['switch_s_per_task']:.2f}"
        lines.append(f"| {r['tasks']} | {r['steps_per_s']:.2f} | {r['samples_per_s']:.1f} | {r['tokens_per_s']:.0f} "
                     f"| {r['speedup']:.2f}x | {r['bound_speedup']:.2f}x | {r['efficiency']:.0%} | {busy} "
                     f"| {switch} | {r['lock_wait_s_per_task']:.2f} | {r['parity_max_abs_reward_diff']:.2g} |")
    if res["placement"] == "colocated":
        lines += ["", "Colocated: both slots use the same devices (here both cores), so two phases running at once "
                  "split them; the bound above assumes independent rollout and train devices and is not reachable "
                  "here. The gain left is the part of a phase that cannot use every core (dispatch, host work)."]
    lines += ["", "Simulator (same policy code, solo t0 profile) vs measured makespan of the steady window:", "",
              format_validation(res["simulator"])]
    return "\n".join(lines)


GLOSSARY = """\
Glossary: *steps/s* = GRPO steps of all tasks per second in the steady window (every task past warm-up,
none finished). *speedup* = steps/s over the sequential rate (each task's solo steps/s, back to back).
*bound* = min(sum of solo rates, 1 / max(R, T)) over the sequential rate, R and T the solo phase medians.
*efficiency* = steps/s / bound. *busy* = fraction of the run a resource's lock was held (from the
timeline). *switch* = onload + offload + weight sync + verify seconds per task. *parity* = the largest
difference of a step's mean reward between a task together and alone (0 = identical learning)."""


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for res in results:
        ns = [r["tasks"] for r in res["rows"]]
        line, = ax.plot(ns, [r["speedup"] for r in res["rows"]], "o-", label=f"{res['placement']} measured")
        ax.plot(ns, [r["bound_speedup"] for r in res["rows"]], "--", color=line.get_color(),
                label=f"{res['placement']} bound")
    ax.set_xlabel("concurrent tasks")
    ax.set_ylabel("speedup vs sequential")
    ax.set_xticks(sorted({r["tasks"] for res in results for r in res["rows"]}))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    from rlsched.cluster.ray_cluster import init_ray

    init_ray()
    placements = ["disaggregated", "colocated"] if args.placement == "both" else [args.placement]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = [bench_placement(Path(tmp), p, args) for p in placements]
    elapsed = time.perf_counter() - t0
    report = "\n\n".join([
        f"preset `{args.preset}`, {args.steps} steps per task, warm-up {args.warmup}, tasks {args.counts}; "
        f"{elapsed / 60:.1f} minutes in all", *map(format_placement, results), GLOSSARY])
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        plot(results, args.out / "speedup.png")
    except Exception as err:  # noqa: BLE001 - the numbers are saved either way
        print(f"speedup.png not drawn: {type(err).__name__}: {err}")
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "env": environment(), "elapsed_s": elapsed,
               "placements": results, "timestamp": datetime.now(UTC).isoformat(timespec="seconds")}
    save_results(args.out, "Multi-task throughput benchmark (1-N tasks)", payload, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
