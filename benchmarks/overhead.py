"""Control-plane overhead: one task's step under Ray minus the same step `--in-process`.

    python -m benchmarks.overhead [--steps 30] [--warmup-steps 5] [--repeats 3]
                                  [--layouts per_device_group per_role] [--out benchmarks/results/overhead]

What is measured: the median `time/step_s` (what metrics.jsonl records) of the demo's addition task
(the tiny ~0.2M-parameter Qwen3, 16 prompts x 16 samples, 4 new tokens, colocated) run by the one step
loop (rlsched.run.task) in two ways, alternately `--repeats` times in one invocation (after one untimed
Ray run that lets a new cluster settle):
- in-process: roles in this process, always-free locks (`rlsched train --in-process`);
- Ray, per layout (`--layouts`): the driver in a Ray actor process, locks from the scheduler actor (`rlsched
  train`), so a step pays two lock acquisitions, two releases and one call per role per phase; the actor and
  the engine in the device group's one process (`per_device_group`, the default: the weights go actor ->
  engine inside it, no array crosses a process) or each in a process of its own (`per_role`).
Two figures, both per step, steps before `--warmup-steps` (JAX compiles there) left out:
- step time, Ray - in-process: what a user sees, but on this 2-core machine it carries the compute's
  run-to-run noise (tens of ms) and the Ray daemons' share of the cores;
- control-plane time, Ray - in-process: each step's time minus the work done inside its role calls
  (the engine's sync_weights + verify + generate, the actor's train + publish, as the roles' own spans
  time them) and minus reward scoring: what remains is locks, calls, transfers and the driver's host
  work. Compute noise cancels out of it. The goal is <= 10 ms per step.
Both are medians over steps, then over repeats.
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
    p.add_argument("--repeats", type=int, default=3, help="in-process / Ray pairs, run alternately")
    p.add_argument("--layouts", nargs="+", default=["per_device_group", "per_role"],
                   choices=["per_device_group", "per_role"], help="cluster.processes of the Ray runs")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the task (e.g. grpo.prompts_per_step=4), as `rlsched train --set`")
    p.add_argument("--no-settle", action="store_true",
                   help="skip the untimed first Ray run (for a cluster already warm, e.g. in a smoke test)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/overhead"))
    args = p.parse_args(argv)
    if args.steps <= args.warmup_steps or args.warmup_steps < 1 or args.repeats < 1:
        p.error("need --steps > --warmup-steps >= 1 and --repeats >= 1")
    return args


def config(root: Path, name: str, args, processes: str = "auto"):
    from rlsched.config.loading import load_config
    from rlsched.rundir.files import prepare_run_dir

    cfg = load_config(CONFIG, [f"experiment.name={name}", f"experiment.output_dir={root}",
                               f"tasks.0.model.path={root / 'model'}", f"tasks.0.steps={args.steps}",
                               "tasks.0.checkpoint_every=0", "cluster.placement=colocated",
                               f"cluster.processes={processes}",
                               *(f"tasks.0.{o}" for o in args.overrides)])
    prepare_run_dir(cfg, resume=False, overwrite=True)
    return cfg


ROLE_WORK = {"engine": ("sync_weights", "verify", "generate"), "actor": ("train", "publish")}


def step_times(cfg, events: list[dict], warmup: int) -> dict[str, float]:
    """Median seconds per step, per phase, and of control-plane time (see the module docstring)."""
    from rlsched.observe.tracking import read_metrics

    rows = read_metrics(cfg.run_dir / "tasks" / "addition" / "metrics.jsonl")
    spans = sorted((e for e in events if e.get("kind") == "span"), key=lambda e: e["start"])

    def per_step(process: str | None, names: tuple[str, ...]) -> list[float]:
        durations = {n: [e["end"] - e["start"] for e in spans if e["name"] == n
                         and (process is None or e.get("process") == process)] for n in names}
        # The last one of each per step: the actor also publishes once at start (v0), before step 1.
        assert all(len(d) >= len(rows) for d in durations.values()), {n: len(d) for n, d in durations.items()}
        return [sum(d[k - len(rows)] for d in durations.values()) for k in range(len(rows))]

    work = [sum(x) for x in zip(per_step("engine", ROLE_WORK["engine"]), per_step("actor", ROLE_WORK["actor"]),
                                per_step("driver", ("reward",)), strict=True)]
    out = {k: statistics.median(m[f"time/{k}_s"] for m in rows[warmup:])
           for k in ("step", "rollout", "train", "reward")}
    out["control"] = statistics.median(m["time/step_s"] - w for m, w in list(zip(rows, work, strict=True))[warmup:])
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    from rlsched.cluster.ray_cluster import init_ray
    from rlsched.observe.timeline import read_trace
    from rlsched.run.experiment import run_experiment
    from rlsched.run.task import TaskDriver
    from rlsched.scheduling.scheduler import FreeLocks

    init_ray()
    quiet = lambda *_: None  # noqa: E731
    pairs: dict[str, list[dict]] = {layout: [] for layout in args.layouts}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # An untimed Ray run first: a new cluster spends its first seconds starting workers and agents, which
        # would land on the first timed run's cores.
        if not args.no_settle:
            run_experiment(config(root, "settle", args), echo=quiet)
        for i in range(args.repeats):
            local = config(root, f"local-{i}", args)
            (spec,) = local.task_specs()
            driver = TaskDriver(spec, FreeLocks(spec.name), echo=quiet)  # what run_in_process does, kept to read
            driver.run()
            in_process = step_times(local, driver.events(), args.warmup_steps)
            for layout in args.layouts:  # each beside the same in-process run
                remote = config(root, f"ray-{layout}-{i}", args, layout)
                result = run_experiment(remote, echo=quiet)["addition"]
                if result["status"] != "ok":
                    raise SystemExit(f"the Ray run ({layout}) failed: {result.get('error')}")
                pair = {"in_process": in_process,
                        "ray": step_times(remote, read_trace(remote.run_dir / "timeline.json"), args.warmup_steps)}
                pair["step_overhead_ms"] = 1e3 * (pair["ray"]["step"] - pair["in_process"]["step"])
                pair["control_overhead_ms"] = 1e3 * (pair["ray"]["control"] - pair["in_process"]["control"])
                pairs[layout].append(pair)
                local_ms, ray_ms = (1e3 * pair[m]["control"] for m in ("in_process", "ray"))
                print(f"repeat {i} {layout}: step in-process {pair['in_process']['step'] * 1e3:.1f} ms, Ray "
                      f"{pair['ray']['step'] * 1e3:.1f} ms; control plane in-process {local_ms:.1f} ms, "
                      f"Ray {ray_ms:.1f} ms", flush=True)
    overhead = {layout: statistics.median(p["control_overhead_ms"] for p in ps) for layout, ps in pairs.items()}
    step_overhead = {layout: statistics.median(p["step_overhead_ms"] for p in ps) for layout, ps in pairs.items()}
    results = dict(args={k: str(v) for k, v in vars(args).items()}, env=environment(), repeats=pairs,
                   overhead_ms=overhead, step_overhead_ms=step_overhead, goal_ms=GOAL_MS,
                   timestamp=datetime.now(UTC).isoformat(timespec="seconds"))
    ms = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
    rows = [f"| {layout} | {i} | {ms(p['in_process']['step'])} | {ms(p['ray']['step'])} | "
            f"{p['step_overhead_ms']:+.1f} | {ms(p['in_process']['control'])} | {ms(p['ray']['control'])} | "
            f"{p['control_overhead_ms']:+.1f} |" for layout, ps in pairs.items() for i, p in enumerate(ps)]
    summary = [f"{layout}: control-plane overhead (median of repeats) {overhead[layout]:+.1f} ms per step (goal <= "
               f"{GOAL_MS:.0f} ms); step time difference {step_overhead[layout]:+.1f} ms (compute noise included)"
               for layout in pairs]
    report = "\n".join([
        f"demo addition task (tiny Qwen3, 16 x 16 samples, 4 new tokens), colocated, {args.steps} steps, "
        f"medians after {args.warmup_steps} warm-up steps; ms per step",
        "", "| layout | repeat | step, in-process | step, Ray | step diff | control plane, in-process | "
        "control plane, Ray | control-plane overhead |", "|---|---:|---:|---:|---:|---:|---:|---:|", *rows, "",
        *summary,
    ])
    save_results(args.out, "Control-plane overhead", results, report)
    return results


if __name__ == "__main__":
    main()
