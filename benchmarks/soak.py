"""A scheduler service that lives for weeks must not grow: many submit / cancel / finish cycles of tiny tasks.

    python -m benchmarks.soak [--cycles 200] [--minutes M] [--steps 2] [--out benchmarks/results/soak]

A service (`rlsched up`, its own state directory, an embedded Ray) takes `--cycles` cycles of a tiny task (the
fake rollout engine, a real tiny actor), one after another, in three kinds by turn: one runs to the end, one is
cancelled as soon as it is submitted, one is cancelled after its first step (then forgotten, as a user who
is done with it does). `--minutes` stops earlier (CI runs a 2-minute version as a test). Measured after every
cycle: the RSS of the service's process and of the device group's process, and the sizes of the service's
records (`Service.sizes`: tasks, log lines, request answers, submissions, the scheduler's timeline and grant
log). Saved: results.json, report.md and soak.png (RSS and record sizes over the cycles).
Checked, and said in the report:
- **flat**: after the warm-up (the first quarter of the cycles), the service's RSS and every record size at the
  end are within 10 % of their value at the end of the warm-up;
- **complete**: every task that ran to the end has one metrics row per step and its run's summary.json;
- **nothing left**: after `rlsched down`, no process the service started is alive.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import environment, save_results  # first: sets JAX to CPU, hubs offline

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo_addition.yaml"
FLAT = 0.10  # at most this much growth after the warm-up
# The service's bounds (rlsched.service.server.LIMITS), lowered so that a short soak reaches every one of them within
# its warm-up: flat after it means bounded, not merely not yet grown.
LIMITS = {"requests": 20, "lines": 50, "finished": 3, "grants": 20}
CANCELLED_STEPS = 1000  # a task to be cancelled has more steps than it can run before the cancel lands
KINDS = ("finish", "cancel at once", "cancel after a step")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=200, help="submit/cancel/finish cycles")
    p.add_argument("--minutes", type=float, default=None, help="stop after this long, whatever the cycles")
    p.add_argument("--steps", type=int, default=2, help="steps of a task that runs to the end")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"))
    p.add_argument("--cycles-to", type=Path, default=None, help=argparse.SUPPRESS)  # the child's answer (see main)
    return p.parse_args(argv)


def _overrides(root: Path, model: Path, i: int, steps: int) -> list[str]:
    return [f"experiment.name=soak-{i}", f"experiment.output_dir={root / 'runs'}", "tasks.0.name=t" + str(i),
            f"tasks.0.model.path={model}", "tasks.0.model.init_preset=null", "tasks.0.rollout.engine=fake",
            f"tasks.0.steps={steps}", "tasks.0.checkpoint_every=1", "tasks.0.grpo.prompts_per_step=2",
            "tasks.0.grpo.num_generations=2", "tasks.0.grpo.mini_batch_size=4", "tasks.0.grpo.max_new_tokens=4"]


def _wait(client, name: str, until, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        row = next(t for t in client.status()["tasks"] if t["name"] == name)
        if until(row):
            return row
        if time.monotonic() > deadline:
            raise SystemExit(f"task {name} did not get there in {timeout_s:.0f} s: {row}")
        time.sleep(0.1)


def _tree(pid: int) -> set[int]:
    import psutil

    try:
        root = psutil.Process(pid)
        return {pid, *(p.pid for p in root.children(recursive=True))}
    except psutil.Error:
        return set()


def _rss(pid: int | None) -> int:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss if pid else 0
    except psutil.Error:
        return 0


def run(args, home: Path) -> dict:
    from rlsched.service import client, daemon
    from rlsched.service.server import TERMINAL
    from workers.models import init_model

    os.environ["RLSCHED_HOME"] = str(home / "state")
    model = init_model(home / "model", preset="tiny", seed=0)
    info = daemon.up({"num_devices": 1, "placement": "colocated", "memory_budget_gb": None, "policy": "fifo",
                      "starvation_limit": 8, "lease_timeout_s": 600.0, "overcommit": False, "processes": "auto",
                      "limits": LIMITS}, echo=lambda *_: None)
    started = _tree(info["pid"])
    samples, finished, t0 = [], [], time.monotonic()
    try:
        for i in range(args.cycles):
            if args.minutes is not None and time.monotonic() - t0 > 60 * args.minutes:
                break
            kind = KINDS[i % len(KINDS)]
            overrides = _overrides(home, model, i, args.steps if kind == "finish" else CANCELLED_STEPS)
            submitted = time.monotonic()
            (name,) = client.submit([CONFIG], overrides=overrides, echo=lambda *_: None, note=lambda *_: None)
            first_step = None
            if kind == "finish":
                _wait(client, name, lambda r: r["step"] >= 1 or r["state"] in TERMINAL)
                first_step = time.monotonic() - submitted
            elif kind == "cancel at once":
                client.cancel(name)
            elif kind == "cancel after a step":
                _wait(client, name, lambda r: r["step"] >= 1 or r["state"] in TERMINAL)
                client.cancel(name)
            row = _wait(client, name, lambda r: r["state"] in TERMINAL)
            if row["state"] == "FINISHED":
                finished.append((name, Path(row["run_dir"])))
            else:
                client.forget(name)
            sizes = client.sizes()
            deadline = time.monotonic() + 120
            while sizes["records"]["submissions"] and time.monotonic() < deadline:  # its outputs being written
                time.sleep(0.1)
                sizes = client.sizes()
            samples.append({"cycle": i, "kind": kind, "state": row["state"], "t": time.monotonic() - t0,
                            "first_step_s": first_step,
                            "service_rss": _rss(sizes["pid"]),
                            "group_rss": sum(_rss(h.get("pid")) for h in client.status().get("hosts", [])),
                            "sizes": sizes["records"]})
            print(f"cycle {i:4d} {kind:20s} -> {row['state']:9s} service RSS {samples[-1]['service_rss'] / 2**20:7.1f} "
                  f"MiB  records {sizes['records']}", flush=True)
        started |= _tree(info["pid"])
    finally:
        import ray

        ray.shutdown()  # this client first: the cluster ends with the service
        daemon.down(echo=lambda *_: None)
    time.sleep(1.0)
    left = sorted(p for p in started if _alive(p))
    incomplete = [str(run_dir) for name, run_dir in finished if not _complete(run_dir, name, args.steps)]
    return {"samples": samples, "left": left, "incomplete": incomplete, "finished": len(finished)}


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _complete(run_dir: Path, task: str, steps: int) -> bool:
    from rlsched.observe.tracking import read_metrics

    rows = read_metrics(run_dir / "tasks" / task / "metrics.jsonl")
    return [r["step"] for r in rows] == list(range(1, steps + 1)) and (run_dir / "summary.json").is_file()


def flatness(samples: list[dict]) -> dict[str, dict]:
    """Per measure: its value at the end of the warm-up (the first quarter), at the end, and whether it grew by
    more than FLAT. RSS is compared by the mean of the last three samples, to smooth the allocator's steps."""
    warm = max(1, len(samples) // 4) - 1

    def at(i: int, key) -> float:
        window = samples[max(0, i - 2): i + 1]
        return sum(key(s) for s in window) / len(window)

    measures = {"service_rss": lambda s: s["service_rss"]}
    measures |= {f"records/{k}": (lambda s, k=k: s["sizes"][k]) for k in samples[0]["sizes"]}
    out = {}
    for name, key in measures.items():
        before, after = at(warm, key), at(len(samples) - 1, key)
        out[name] = {"after_warmup": before, "end": after, "flat": after <= (1 + FLAT) * before + 1}
    return out


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cycles = [s["cycle"] for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(cycles, [s["service_rss"] / 2**20 for s in samples], label="service process")
    top.plot(cycles, [s["group_rss"] / 2**20 for s in samples], label="device group's process")
    top.set_ylabel("RSS (MiB)")
    top.legend()
    for key in samples[0]["sizes"]:
        bottom.plot(cycles, [s["sizes"][key] for s in samples], label=key)
    bottom.set_ylabel("records kept")
    bottom.set_xlabel("cycle")
    bottom.legend(fontsize=7)
    fig.suptitle("rlsched service over submit / cancel / finish cycles")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    """The cycles run in a child process: it connects to the service's Ray cluster as a client, and a process
    still connected when `down` ends that cluster is ended by Ray a minute later (a test runner, say)."""
    import json
    import subprocess
    import sys

    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.cycles_to is not None:  # the child
            args.cycles_to.write_text(json.dumps(run(args, Path(tmp))))
            return {}
        answer = Path(tmp) / "outcome.json"
        child = [sys.executable, "-m", "benchmarks.soak", "--cycles", str(args.cycles), "--steps", str(args.steps),
                 "--cycles-to", str(answer), *(["--minutes", str(args.minutes)] if args.minutes is not None else [])]
        subprocess.run(child, check=True, cwd=Path(__file__).resolve().parents[1])
        outcome = json.loads(answer.read_text())
    samples = outcome["samples"]
    flat = flatness(samples)
    expected = {"finish": "FINISHED", "cancel at once": "CANCELLED", "cancel after a step": "CANCELLED"}
    wrong = [f"cycle {s['cycle']} ({s['kind']}): {s['state']}" for s in samples if s["state"] != expected[s["kind"]]]
    ok = all(f["flat"] for f in flat.values()) and not outcome["left"] and not outcome["incomplete"] and not wrong
    latencies = sorted(s["first_step_s"] for s in samples[max(1, len(samples) // 4):] if s["first_step_s"] is not None)
    latency = statistics.median(latencies) if latencies else None
    args.out.mkdir(parents=True, exist_ok=True)
    plot(samples, args.out / "soak.png")
    rows = [f"| {name} | {f['after_warmup']:.0f} | {f['end']:.0f} | {'yes' if f['flat'] else '**no**'} |"
            for name, f in flat.items()]
    report = "\n".join([
        f"{len(samples)} cycles ({', '.join(KINDS)}, by turn) in {samples[-1]['t']:.0f} s; "
        f"{outcome['finished']} tasks ran to the end", "",
        "| measure | after warm-up | at the end | flat (<= +10 %) |", "|---|---:|---:|---|", *rows, "",
        "submit to first step of a task joining the running service, warm compiles (after the warm-up): median "
        + (f"{latency:.2f} s over {len(latencies)} tasks (range {latencies[0]:.2f}-{latencies[-1]:.2f}); goal <= 2 s"
           if latency is not None else "not measured"),
        f"tasks that did not end as their kind should: {wrong or 'none'}",
        f"finished tasks with incomplete outputs: {outcome['incomplete'] or 'none'}",
        f"processes left after `rlsched down`: {outcome['left'] or 'none'}",
        f"verdict: {'flat, complete, nothing left' if ok else 'NOT met'}",
    ])
    results = dict(args={k: str(v) for k, v in vars(args).items()}, env=environment(), samples=samples, flat=flat,
                   left=outcome["left"], incomplete=outcome["incomplete"], wrong=wrong, ok=ok, limits=LIMITS,
                   first_step_s=latency,
                   timestamp=datetime.now(UTC).isoformat(timespec="seconds"))
    save_results(args.out, "Service soak: submit / cancel / finish cycles", results, report)
    return results


if __name__ == "__main__":
    main()
