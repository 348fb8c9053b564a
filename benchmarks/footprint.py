"""What a run costs beside the same work in one process: memory of every process, wall time, start and exit.

    python -m benchmarks.footprint [--steps 30] [--repeats 2] [--layouts per_device_group per_role in_process]
                                   [--out benchmarks/results/footprint]

The two-task demo (configs/demo_multitask.yaml, `--steps` steps each) run as a user runs it, `rlsched train` in a
process of its own, once per layout and repeat, the layouts alternated (same machine, same minute):
- `per_device_group` / `per_role`: under its own embedded Ray (`cluster.processes`);
- `in_process`: `--in-process`, both tasks one after the other in the command's process: the same work with no
  Ray at all, the floor.
Figures, each the median over repeats:
- **peak PSS**: the most summed proportional set size of the command and every process under it (Ray's GCS,
  raylet, dashboard agents and workers, the roles' processes), sampled every `--every` s: PSS divides a page
  shared by N processes by N, so the sum is what the run costs the machine;
- **wall**: the command's whole run, launch to exit;
- **start**: launch to the first task's step-1 line (Ray's start, the roles' processes, models, compiles);
- **exit**: the last task's last step line to the command's exit (outputs, trace, Ray's shutdown).
The models and the compile cache are made by an untimed first run, so every timed run finds them.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import environment, save_results  # first: sets JAX to CPU, hubs offline

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo_multitask.yaml"
LAYOUTS = ("per_device_group", "per_role", "in_process")
GOALS = {"pss": 1.5, "wall": 1.2, "start": 1.2}  # Ray run / in-process; exit: <= 2 s


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.footprint", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="GRPO steps per task")
    p.add_argument("--repeats", type=int, default=2, help="runs per layout, alternated; medians are reported")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--every", type=float, default=0.25, help="seconds between memory samples")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of both tasks, as `rlsched train --set` (e.g. grpo.prompts_per_step=4)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/footprint"))
    return p.parse_args(argv)


# What each process of a run is, from its command line (Ray names an actor's process `ray::Class.method`).
KINDS = (("ray::GroupProcess", "device-group process"), ("ray::ActorRole", "role processes"),
         ("ray::EngineRole", "role processes"), ("ray::TaskDriver", "task drivers"), ("ray::Scheduler", "scheduler"),
         ("ray::IDLE", "Ray's idle workers"))


def kind_of(proc, root_pid: int) -> str:
    if proc.pid == root_pid:
        return "the command"
    line = " ".join(proc.cmdline())
    return next((kind for prefix, kind in KINDS if line.startswith(prefix)), "Ray's daemons")  # GCS, raylet, agents


def pss_of_tree(pid: int) -> dict[str, int]:
    """PSS (bytes) of process `pid` and all its descendants, summed per kind of process (`kind_of`); processes
    that end meanwhile count 0."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    kinds: dict[str, int] = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):  # gone, or a zombie
            kind = kind_of(proc, pid)
            kinds[kind] = kinds.get(kind, 0) + proc.memory_full_info().pss
    return kinds


def run_once(layout: str, root: Path, args) -> dict:
    """One `rlsched train` of the demo in `layout`: its figures (seconds, bytes)."""
    name = f"fp-{layout}"
    command = [sys.executable, "-m", "rlsched.cli", "train", str(CONFIG), "--overwrite",
               "--set", f"experiment.name={name}", "--set", f"experiment.output_dir={root}"]
    for i, task in enumerate(("addition", "subtraction")):
        command += ["--set", f"tasks.{i}.steps={args.steps}", "--set", f"tasks.{i}.model.path={root / task}"]
        command += [a for o in args.overrides for a in ("--set", f"tasks.{i}.{o}")]
    command += ["--in-process"] if layout == "in_process" else ["--set", f"cluster.processes={layout}"]
    marks: dict[str, float] = {}
    last = f"step {args.steps:4d}/{args.steps}"
    t0 = time.monotonic()
    proc = subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            now = time.monotonic()
            if "step    1/" in line:
                marks.setdefault("first", now)
            if last in line:
                marks["last"] = now  # the later of the two tasks' last lines

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak, at_peak = 0, {}
    while proc.poll() is None:
        kinds = pss_of_tree(proc.pid)
        if sum(kinds.values()) > peak:
            peak, at_peak = sum(kinds.values()), kinds
        time.sleep(args.every)
    end = time.monotonic()
    reader.join(30)
    if proc.returncode != 0 or "first" not in marks or "last" not in marks:
        raise SystemExit(f"{layout}: the run failed (exit {proc.returncode}):\n" + "".join(lines[-40:]))
    return {"pss_bytes": peak, "wall_s": end - t0, "start_s": marks["first"] - t0, "exit_s": end - marks["last"],
            "pss_at_peak": at_peak}


def main(argv=None) -> dict:
    args = parse_args(argv)
    runs: dict[str, list[dict]] = {layout: [] for layout in args.layouts}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("untimed first run: makes the models and fills the compile cache", flush=True)
        run_once(args.layouts[0], root, args)
        for i in range(args.repeats):
            for layout in args.layouts:
                runs[layout].append(run_once(layout, root, args))
                r = runs[layout][-1]
                print(f"repeat {i} {layout}: peak PSS {r['pss_bytes'] / 2**30:.2f} GiB, wall {r['wall_s']:.1f} s, "
                      f"start {r['start_s']:.1f} s, exit {r['exit_s']:.1f} s", flush=True)
    median = {layout: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "pss_at_peak"}
              for layout, rs in runs.items()}
    base = median.get("in_process")
    def ratio(m: dict, k: str) -> str:
        return f" ({m[k] / base[k]:.2f} x)" if base and m is not base else ""

    rows = [f"| {layout} | {m['pss_bytes'] / 2**30:.2f} GiB{ratio(m, 'pss_bytes')} | {m['wall_s']:.1f} s"
            f"{ratio(m, 'wall_s')} | {m['start_s']:.1f} s{ratio(m, 'start_s')} | {m['exit_s']:.1f} s |"
            for layout, m in median.items()]
    def parts(layout: str) -> str:  # the run nearest the median's peak, per kind of process
        run = min(runs[layout], key=lambda r: abs(r["pss_bytes"] - median[layout]["pss_bytes"]))
        return ", ".join(f"{kind} {b / 2**30:.2f}" for kind, b in
                         sorted(run["pss_at_peak"].items(), key=lambda kv: -kv[1]))

    report = "\n".join([
        f"two-task demo (tiny Qwen3s, 16 x 16 samples, {args.steps} steps each), `rlsched train` in a process of its "
        f"own; medians of {args.repeats} alternated runs per layout",
        "", "| layout | peak summed PSS (every process) | wall | launch -> step 1 | last step -> exit |",
        "|---|---:|---:|---:|---:|", *rows, "",
        f"goals, a Ray run beside in_process: PSS <= {GOALS['pss']} x, wall <= {GOALS['wall']} x, start <= "
        f"{GOALS['start']} x, exit <= 2 s", "",
        "peak PSS per kind of process (GiB):", *(f"- {layout}: {parts(layout)}" for layout in runs),
    ])
    results = dict(args={k: str(v) for k, v in vars(args).items()}, env=environment(), runs=runs, median=median,
                   goals=GOALS, timestamp=datetime.now(UTC).isoformat(timespec="seconds"))
    save_results(args.out, "Run footprint: memory, wall time, start and exit", results, report)
    return results


if __name__ == "__main__":
    main()
