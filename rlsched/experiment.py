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


def build_policy(cfg: ExperimentConfig) -> Policy:
    budget = cfg.cluster.memory_budget_gb
    nbytes = None if budget is None else int(budget * 2**30)
    spec = (GroupSpec.colocated(nbytes) if cfg.cluster.placement == "colocated"
            else GroupSpec.disaggregated(nbytes, nbytes))
    policy = Policy({GROUP: spec})
    for task in cfg.tasks:
        engine, actor = estimate_bytes(task)
        policy.register(task.name, GROUP, engine, actor)
    return policy


def init_ray(address: str | None = None) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        # Local by default: nothing listens beyond 127.0.0.1 and no dashboard is started.
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=True,
                 **({"num_cpus": max(4, 2 * os.cpu_count())} if address is None else {}))


def run_experiment(cfg: ExperimentConfig, *, resume: bool = False, address: str | None = None,
                   lease_timeout_s: float = 600.0, echo=print, on_started=None) -> dict[str, dict[str, Any]]:
    """Run every task of `cfg` concurrently; returns {task: {"status": "ok"|"failed", ...}}."""
    import ray

    from rlsched.scheduler import Scheduler
    from rlsched.task import TaskDriver

    init_ray(address)
    scheduler = ray.remote(num_cpus=0)(Scheduler).remote(build_policy(cfg), lease_timeout_s=lease_timeout_s,
                                                         experiment=cfg.experiment.name)
    raw = cfg.model_dump(mode="json")
    driver_cls = ray.remote(num_cpus=1, max_restarts=0)(TaskDriver)
    drivers = {t.name: driver_cls.options(name=None).remote(raw, i, scheduler, resume=resume)
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
    for driver in drivers.values():
        ray.kill(driver)
    ray.kill(scheduler)
    return results
