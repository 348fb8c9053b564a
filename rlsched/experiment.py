"""Run an experiment's tasks concurrently on Ray: one scheduler actor, one TaskDriver per task.

    from rlsched.experiment import run_experiment
    results = run_experiment(cfg)            # embedded local Ray unless address= is given

A failed task is reported with its cause and never stops the others.
"""

from __future__ import annotations

import os
import time
from typing import Any

from rlsched.config import ExperimentConfig, TaskConfig
from rlsched.policy import GroupSpec, Policy

GROUP = "g0"  # one device group per experiment for now: every task shares it


def estimate_bytes(task: TaskConfig) -> tuple[int, int]:
    """(engine, actor) bytes of a task, from its model config: what admission decides on before any
    worker exists. engine = params + full KV cache; actor = params + AdamW moments (+ reference)."""
    from workers.models import Qwen3Config

    m = Qwen3Config.from_dir(task.model.path) if (os.path.isdir(task.model.path)) else None
    if m is None:  # created at start (init_preset): estimate from the preset itself
        from workers.models.presets import PRESETS

        m = Qwen3Config(vocab_size=384, **PRESETS[task.model.init_preset or "tiny"])
    width = 2 if task.model.dtype == "bfloat16" else 4
    params = m.num_params * width
    g = task.grpo
    kv = (2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * width
          * min(task.rollout.max_batch_size, g.prompts_per_step * g.num_generations)
          * (g.max_prompt_len + g.max_new_tokens))
    actor = params * (3 + (1 if g.beta > 0 else 0))
    return params + kv, actor


def build_policy(cfg: ExperimentConfig) -> tuple[Policy, dict[str, list[tuple[str, str]]]]:
    """The policy with every task registered as created on device, and the offloads each task must do
    at start because its roles don't fit the budget beside the tasks registered before it."""
    budget = cfg.cluster.memory_budget_gb
    nbytes = None if budget is None else int(budget * 2**30)
    spec = (GroupSpec.colocated(nbytes) if cfg.cluster.placement == "colocated"
            else GroupSpec.disaggregated(nbytes, nbytes))
    policy = Policy({GROUP: spec})
    initial: dict[str, list[tuple[str, str]]] = {}
    for task in cfg.tasks:
        engine, actor = estimate_bytes(task)
        initial[task.name] = [(str(m.role), str(m.action)) for m in policy.register(task.name, GROUP, engine, actor)]
    return policy, initial


def init_ray(address: str | None = None) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        # Local by default: nothing listens beyond 127.0.0.1 and no dashboard is started.
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=True,
                 **({"num_cpus": max(4, 2 * os.cpu_count())} if address is None else {}))


def device_resource() -> str:
    """The Ray resource a device is: GPU where the cluster has GPUs, else a CPU core."""
    import ray

    return "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU"


def make_placement_group(cfg: ExperimentConfig, resource: str):
    """One placement group for the device group: a rollout bundle and a train bundle (disaggregated)
    or one shared bundle (colocated). Every task's roles are placed in it, so they land on the
    group's devices; which device each uses is decided by pinning (see rlsched.placement)."""
    import ray
    from ray.util.placement_group import placement_group

    bundles = [{resource: 1}] if cfg.cluster.placement == "colocated" else [{resource: 1}, {resource: 1}]
    pg = placement_group(bundles, strategy="STRICT_PACK", name=f"{cfg.experiment.name}/{GROUP}")
    ray.get(pg.ready(), timeout=60)
    return pg


def run_experiment(cfg: ExperimentConfig, *, resume: bool = False, address: str | None = None,
                   lease_timeout_s: float = 600.0, echo=print, on_started=None) -> dict[str, dict[str, Any]]:
    """Run every task of `cfg` concurrently; returns {task: {"status": "ok"|"failed", ...}}."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from rlsched.scheduler import Scheduler
    from rlsched.task import TaskDriver

    init_ray(address)
    resource = device_resource()
    pg = make_placement_group(cfg, resource)
    policy, initial_moves = build_policy(cfg)
    scheduler = ray.remote(num_cpus=0)(Scheduler).remote(policy, lease_timeout_s=lease_timeout_s,
                                                         experiment=cfg.experiment.name)
    raw = cfg.model_dump(mode="json")
    # Drivers need no device: they wait on locks and score rewards between phases.
    driver_cls = ray.remote(num_cpus=0, max_restarts=0)(TaskDriver)
    drivers = {t.name: driver_cls.remote(raw, i, scheduler, resume=resume, placement_group=pg, resource=resource,
                                         initial_moves=initial_moves[t.name])
               for i, t in enumerate(cfg.tasks)}
    for name, driver in drivers.items():
        # The lifeline ref is wrapped in a list so Ray passes the ref itself rather than waiting for it.
        scheduler.watch.remote(name, [driver.lifeline.remote()])
        scheduler.register_driver.remote(name, driver)
    pending = {driver.run.remote(): name for name, driver in drivers.items()}
    if on_started is not None:  # a hook for tests and tools: {task: driver handle}
        on_started(drivers)
    results: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        name = pending.pop(done[0])
        try:
            results[name] = ray.get(done[0])
        except ray.exceptions.RayActorError as err:
            cause = ray.get(scheduler.failed.remote()).get(name, f"its process died ({type(err).__name__})")
            results[name] = {"task": name, "status": "failed", "error": cause}
        status = results[name]["status"]
        echo(f"[{name}] {status}" + (f": {results[name]['error']}" if status == "failed" else "")
             + f" after {time.perf_counter() - t0:.1f}s")
    events = list(ray.get(scheduler.events.remote()))
    for name, driver in drivers.items():
        try:
            events += ray.get(driver.events.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            echo(f"[{name}] its timeline is lost with its process")
    state = ray.get(scheduler.state.remote())
    for driver in drivers.values():
        ray.kill(driver)  # its roles go with it: Ray ends the actors a process owns when it dies
    ray.kill(scheduler)
    remove_placement_group(pg)
    write_run_outputs(cfg, events, results, state, echo=echo)
    return results


def _scheduler_run(cfg: ExperimentConfig, events: list[dict], summary: dict[str, Any], *, ok: bool) -> None:
    """The scheduler's own W&B run: memory per pool and lock queues over time, then per-task lock
    waits, switch costs and per-resource busy fractions as its summary."""
    from rlsched.tracking import make_trackers

    tracker = make_trackers(cfg.experiment.tracking, run_dir=cfg.run_dir / "scheduler", experiment=cfg.experiment.name,
                            task="scheduler", job_type="scheduler", hparams=cfg.model_dump(mode="json"))
    try:
        counters = sorted((e for e in events if e.get("kind") == "counter"), key=lambda e: e["ts"])
        for i, c in enumerate(counters):
            tracker.log(i, {f"{c['name']}/{k}": v for k, v in c["values"].items()})
        timeline = summary["timeline"]
        values = {f"task/{t}/{k}": v for t, row in timeline["tasks"].items() for k, v in row.items()}
        values |= {f"resource/{r}/{k}": v for r, row in timeline["resources"].items() for k, v in row.items()}
        tracker.summary(values)
    finally:
        tracker.finish(0 if ok else 1)


def write_run_outputs(cfg: ExperimentConfig, events: list[dict], results: dict[str, dict[str, Any]],
                      scheduler_state: dict[str, Any] | None = None, *, echo=print) -> None:
    """runs/<exp>/timeline.json (Chrome trace), timeline.png (Gantt) and summary.json, each written
    atomically; a picture that cannot be drawn is reported, never fatal."""
    import json

    from rlsched.timeline import summarize, write_chrome_trace
    from rlsched.train import write_atomic

    run_dir = cfg.run_dir
    write_chrome_trace(run_dir / "timeline.json", events)
    try:
        from rlsched.gantt import plot_gantt

        plot_gantt(events, run_dir / "timeline.png", title=cfg.experiment.name)
    except Exception as err:  # noqa: BLE001 - the trace and the metrics are what matter
        echo(f"timeline.png not drawn: {type(err).__name__}: {err}")
    summary = {"experiment": cfg.experiment.name, "placement": cfg.cluster.placement,
               "tasks": {name: {k: v for k, v in r.items() if k != "traceback"} for name, r in results.items()},
               "timeline": summarize(events),
               "scheduler": scheduler_state or {}}
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    if cfg.experiment.tracking.wandb:
        _scheduler_run(cfg, events, summary, ok=all(r["status"] == "ok" for r in results.values()))
    echo(f"timeline: {run_dir / 'timeline.json'} (opens in Perfetto), summary: {run_dir / 'summary.json'}")
