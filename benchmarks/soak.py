"""A scheduler service that lives for weeks must not grow: many submit / cancel / finish cycles of tiny tasks.

    python -m benchmarks.soak [--cycles 200] [--minutes M] [--steps 2] [--processes per_device_group]
                              [--out benchmarks/results/soak]

A service (`rlsched up`, its own state directory, an embedded Ray) takes `--cycles` cycles of a tiny task (the fake
rollout engine, a real tiny actor), one after another, in three kinds by turn: one runs to the end, one is cancelled
as soon as it is submitted, one is cancelled after its first step; each of the last kind has a learning rate of its
own, as a sweep does: its programs are new ones. The last KEEP_CANCELLED cancelled tasks stay unforgotten (`status`
lists them, as a user who does not tidy up leaves them); older ones are forgotten, as a user who is done with them
does, unless the service has moved them to its history already. By default the roles live in one device group's
process for the service's life, as on a GPU or TPU node (`--processes per_role`: a process per role, CPU's default),
and a resident task trains there from start to end, so that process never empties: what it keeps must go with the
tasks that leave. `--minutes` stops earlier (tests/test_soak.py runs 18 cycles). Measured after every cycle: the
RSS of the service's process and of the device group's process, the bytes that process's C heap holds in use
(glibc's mallinfo2: what it holds, without the free space a fragmented heap keeps), its compiled programs and memory
maps (its cap is Linux's vm.max_map_count; held for ever, one actor's programs took ~590 maps), and the sizes of the
service's records (`Service.sizes`: tasks, log lines, request answers, submissions, the scheduler's timeline and
grant log).
Saved: results.json, report.md and soak.png (RSS, maps and record sizes over the cycles).
Checked, and said in the report:
- **flat**: the peaks of the service's RSS, the device group process's RSS, heap in use, programs and memory maps,
  and every record size over the last quarter of the cycles are within 10 % of their peaks over the second quarter
  (the first is the warm-up); the scheduler's timeline events, kept for a time rather than up to a count, by their
  age (at most EVENTS_AGE_S after the warm-up);
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
from rlsched.service.spool import SPOOL_MARGIN_S

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo_addition.yaml"
FLAT = 0.10  # at most this much growth after the warm-up
# The service's bounds (rlsched.service.server.LIMITS), lowered so that a short soak reaches every one of them within
# its warm-up: flat after it means bounded, not merely not yet grown.
LIMITS = {"requests": 10, "lines": 50, "finished": 3, "unfinished": 3, "grants": 20, "spool_s": 2.0}
RESIDENT_EDGE_S = 30.0  # the resident's trace must hold the scheduler's events this close to the soak's start and end
CANCELLED_STEPS = 1000  # a task to be cancelled has more steps than it can run before the cancel lands
KEEP_CANCELLED = 5  # the most recent cancelled tasks the soak leaves unforgotten (a service bound below it keeps fewer)
KINDS = ("finish", "cancel at once", "cancel after a step")
EVENTS_AGE = "scheduler events age s"  # Scheduler.sizes: since the oldest event it holds ended
# The most that age may reach: the spool interval, the margin a pass leaves (rlsched.service.spool), and 5 s for the
# service's monitor loop, which spools between its other work (a loaded 2-core machine delays it by seconds).
EVENTS_AGE_S = LIMITS["spool_s"] + SPOOL_MARGIN_S + 5.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=200, help="submit/cancel/finish cycles")
    p.add_argument("--minutes", type=float, default=None, help="stop after this long, whatever the cycles")
    p.add_argument("--steps", type=int, default=2, help="steps of a task that runs to the end")
    p.add_argument("--processes", choices=("per_device_group", "per_role"), default="per_device_group",
                   help="which processes hold the roles (cluster.processes; default: a device group's, as on GPU/TPU)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"))
    p.add_argument("--cycles-to", type=Path, default=None, help=argparse.SUPPRESS)  # the child's answer (see main)
    return p.parse_args(argv)


def _overrides(root: Path, model: Path, name: str, steps: int, lr: float = 1e-5) -> list[str]:
    return [f"experiment.name=soak-{name}", f"experiment.output_dir={root / 'runs'}", f"tasks.0.name={name}",
            f"tasks.0.model.path={model}", "tasks.0.model.init_preset=null", "tasks.0.rollout.engine=fake",
            f"tasks.0.steps={steps}", "tasks.0.checkpoint_every=1", "tasks.0.grpo.prompts_per_step=2",
            "tasks.0.grpo.num_generations=2", "tasks.0.grpo.mini_batch_size=4", "tasks.0.grpo.max_new_tokens=4",
            f"tasks.0.optim.lr={lr!r}"]


def _group(report: dict) -> dict:
    """The device group's process, summed over its hosts: RSS, programs kept, memory maps (0s when there is none)."""
    processes = [p for p in report.get("group_processes", []) if "error" not in p]
    return {"group_rss": sum(_rss(p["pid"]) for p in processes),
            "group_heap": sum(p.get("heap_bytes") or 0 for p in processes),
            "group_programs": sum(p.get("programs", 0) for p in processes),
            "group_maps": sum(p.get("memory_maps") or 0 for p in processes)}


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
                      "starvation_limit": 8, "lease_timeout_s": 600.0, "overcommit": False,
                      "processes": args.processes, "limits": LIMITS}, echo=lambda *_: None)
    started = _tree(info["pid"])
    samples, finished, cancelled, t0 = [], [], [], time.monotonic()
    resident = resident_trace = None
    if args.processes == "per_device_group":  # trains all along: the device group's process never empties
        # its rollouts take ~0.2 s (the fake engine's 0.05 s per token), as a real task's steps take seconds
        slow = ["tasks.0.rollout.engine_args.seconds_per_token=0.05"]
        (resident,) = client.submit([CONFIG], overrides=_overrides(home, model, "resident", 10**6, lr=3e-6) + slow,
                                    echo=lambda *_: None, note=lambda *_: None)
        _wait(client, resident, lambda r: r["step"] >= 1)
    try:
        for i in range(args.cycles):
            if args.minutes is not None and time.monotonic() - t0 > 60 * args.minutes:
                break
            kind = KINDS[i % len(KINDS)]
            # a sweep: each task cancelled after a step has a learning rate of its own, so programs of its own
            lr = 1e-5 * (1 + i / 1000) if kind == "cancel after a step" else 1e-5
            overrides = _overrides(home, model, f"t{i}", args.steps if kind == "finish" else CANCELLED_STEPS, lr)
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
                cancelled.append(name)
            while len(cancelled) > KEEP_CANCELLED:  # the oldest of those kept, unless the service let it go already
                oldest = cancelled.pop(0)
                if any(t["name"] == oldest for t in client.status()["tasks"]):
                    client.forget(oldest)
            sizes = client.sizes()
            deadline = time.monotonic() + 120
            while sizes["records"]["submissions"] > (resident is not None) and time.monotonic() < deadline:
                time.sleep(0.1)  # its outputs being written
                sizes = client.sizes()
            report = client.status()
            samples.append({"cycle": i, "kind": kind, "state": row["state"], "t": time.monotonic() - t0,
                            "first_step_s": first_step, "service_rss": _rss(sizes["pid"]), **_group(report),
                            "cancelled_listed": sum(t["state"] == "CANCELLED" for t in report["tasks"]),
                            "sizes": sizes["records"]})
            s = samples[-1]
            print(f"cycle {i:4d} {kind:20s} -> {row['state']:9s} service RSS {s['service_rss'] / 2**20:7.1f} MiB  "
                  f"group RSS {s['group_rss'] / 2**20:7.1f} MiB (heap in use {s['group_heap'] / 2**20:.1f} MiB), "
                  f"{s['group_programs']} programs, {s['group_maps']} "
                  f"maps  records {sizes['records']}", flush=True)
        started |= _tree(info["pid"])
        if resident is not None:
            cancelled = time.monotonic()
            client.cancel(resident)
            row = _wait(client, resident, lambda r: r["state"] in TERMINAL)
            if row["state"] != "CANCELLED":
                raise SystemExit(f"the resident task ended {row['state']}, not cancelled: {row}")
            deadline = time.monotonic() + 120
            while client.sizes()["records"]["submissions"] and time.monotonic() < deadline:
                time.sleep(0.1)  # its outputs being written
            resident_trace = _trace_check(Path(row["run_dir"]), t0, cancelled)
    finally:
        import ray

        ray.shutdown()  # this client first: the cluster ends with the service
        daemon.down(echo=lambda *_: None)
    time.sleep(1.0)
    left = sorted(p for p in started if _alive(p))
    incomplete = [str(run_dir) for name, run_dir in finished if not _complete(run_dir, name, args.steps)]
    return {"samples": samples, "left": left, "incomplete": incomplete, "finished": len(finished),
            "resident_trace": resident_trace}


def _trace_check(run_dir: Path, t0: float, t1: float) -> dict:
    """The resident's timeline.json holds the scheduler's events of its whole time, each once: lock-queue counters
    from the soak's first RESIDENT_EDGE_S and from the last before its cancel (`t1`) (the service moved the older
    ones to the submission's spool on disk and read them back at the end), and no event twice (a spool pass that
    appended one again)."""
    from rlsched.observe.timeline import read_trace

    events = [e for e in read_trace(run_dir / "timeline.json") if e["kind"] == "counter" and e["task"] is None]
    stamps = sorted(e["ts"] for e in events if e["name"].startswith("queue/"))
    keys = [(e["name"], e["ts"], tuple(sorted(e["values"].items()))) for e in events]
    wall0 = time.time() - (time.monotonic() - t0)  # the soak's start, as the events' wall clock reads it
    wall1 = time.time() - (time.monotonic() - t1)
    return {"queue_counters": len(stamps), "first_s": stamps[0] - wall0 if stamps else None,
            "last_s": wall1 - stamps[-1] if stamps else None, "twice": len(keys) - len(set(keys)),
            "ok": bool(stamps) and stamps[0] - wall0 < RESIDENT_EDGE_S and wall1 - stamps[-1] < RESIDENT_EDGE_S
            and len(keys) == len(set(keys))}


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
    """Per measure: its peak over the second quarter of the cycles (after the warm-up, the first quarter), its
    peak over the last quarter, and whether it grew by more than FLAT. Peaks, not single samples: RSS moves in a
    sawtooth as the allocator takes and gives back memory (~7 % of the service's), which a bounded measure's peaks
    do not climb over. The scheduler's events are kept for a time, not up to a count (they go to disk every
    spool_s), so their count follows the event rate (a machine's load changes it by 20 % and more): they are
    judged by their age instead, whose peak after the warm-up must stay within EVENTS_AGE_S."""
    n = len(samples)
    second = samples[max(0, n // 4): max(1, n // 2)]
    last = samples[n - max(1, n // 4):]
    measures = {"service_rss": lambda s: s["service_rss"], "group_rss": lambda s: s["group_rss"],
                "group_heap": lambda s: s["group_heap"],
                "group_programs": lambda s: s["group_programs"], "group_maps": lambda s: s["group_maps"]}
    measures |= {f"records/{k}": (lambda s, k=k: s["sizes"][k]) for k in samples[0]["sizes"]
                 if k != EVENTS_AGE}
    out = {}
    for name, key in measures.items():
        before, after = max(key(s) for s in second), max(key(s) for s in last)
        out[name] = {"after_warmup": before, "end": after, "flat": after <= (1 + FLAT) * before + 1}
    age = max(s["sizes"][EVENTS_AGE] for s in samples[max(0, n // 4):])
    out["records/scheduler events"] |= {"age_s": age, "flat": age <= EVENTS_AGE_S}
    return out


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cycles = [s["cycle"] for s in samples]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    top.plot(cycles, [s["service_rss"] / 2**20 for s in samples], label="service process")
    top.plot(cycles, [s["group_rss"] / 2**20 for s in samples], label="device group's process")
    top.plot(cycles, [s["group_heap"] / 2**20 for s in samples], label="its C heap in use")
    top.set_ylabel("RSS (MiB)")
    top.legend()
    middle.plot(cycles, [s["group_maps"] for s in samples], label="memory maps")
    middle.plot(cycles, [s["group_programs"] for s in samples], label="compiled programs kept")
    middle.set_ylabel("device group's process")
    middle.legend()
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
                 "--processes", args.processes, "--cycles-to", str(answer),
                 *(["--minutes", str(args.minutes)] if args.minutes is not None else [])]
        subprocess.run(child, check=True, cwd=Path(__file__).resolve().parents[1])
        outcome = json.loads(answer.read_text())
    samples = outcome["samples"]
    flat = flatness(samples)
    expected = {"finish": "FINISHED", "cancel at once": "CANCELLED", "cancel after a step": "CANCELLED"}
    wrong = [f"cycle {s['cycle']} ({s['kind']}): {s['state']}" for s in samples if s["state"] != expected[s["kind"]]]
    trace = outcome["resident_trace"]
    ok = (all(f["flat"] for f in flat.values()) and not outcome["left"]
          and not outcome["incomplete"] and not wrong and (trace is None or trace["ok"]))
    latencies = sorted(s["first_step_s"] for s in samples[max(1, len(samples) // 4):] if s["first_step_s"] is not None)
    latency = statistics.median(latencies) if latencies else None
    args.out.mkdir(parents=True, exist_ok=True)
    plot(samples, args.out / "soak.png")
    rows = [f"| {name} | {f['after_warmup']:.0f} | {f['end']:.0f} | {'yes' if f['flat'] else '**no**'}"
            + (f" (by age: {f['age_s']:.1f} s at most, bound {EVENTS_AGE_S:.0f} s)" if "age_s" in f else "") + " |"
            for name, f in flat.items()]
    report = "\n".join([
        f"{len(samples)} cycles ({', '.join(KINDS)}, by turn) in {samples[-1]['t']:.0f} s; "
        f"{outcome['finished']} tasks ran to the end", "",
        "| measure (peak) | cycles 1/4-1/2 | last quarter | flat (<= +10 %) |", "|---|---:|---:|---|", *rows, "",
        "submit to first step of a task joining the running service, warm compiles (after the warm-up): median "
        + (f"{latency:.2f} s over {len(latencies)} tasks (range {latencies[0]:.2f}-{latencies[-1]:.2f}); goal <= 2 s"
           if latency is not None else "not measured"),
        f"tasks that did not end as their kind should: {wrong or 'none'}",
        f"finished tasks with incomplete outputs: {outcome['incomplete'] or 'none'}",
        f"processes left after `rlsched down`: {outcome['left'] or 'none'}",
        "the resident task's timeline: " + ("none (no resident task)" if trace is None else
                                            f"{trace['queue_counters']} lock-queue counters of the scheduler, the "
                                            f"first {trace['first_s']:.1f} s after the soak began, the last "
                                            f"{trace['last_s']:.1f} s before it ended, {trace['twice']} event(s) "
                                            f"written twice ({'complete' if trace['ok'] else '**NOT complete**'})"),
        f"verdict: {'flat, complete, nothing left' if ok else 'NOT met'}",
    ])
    results = dict(args={k: str(v) for k, v in vars(args).items()}, env=environment(), samples=samples, flat=flat,
                   left=outcome["left"], incomplete=outcome["incomplete"], wrong=wrong, ok=ok, limits=LIMITS,
                   resident_trace=trace,
                   first_step_s=latency,
                   timestamp=datetime.now(UTC).isoformat(timespec="seconds"))
    save_results(args.out, "Service soak: submit / cancel / finish cycles", results, report)
    return results


if __name__ == "__main__":
    main()
