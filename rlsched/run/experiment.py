"""Run an experiment: check its config, prepare its run directory, run its tasks, write its outputs.

    from rlsched.run.experiment import train, run_experiment
    results = train(["configs/demo_multitask.yaml"])   # what `rlsched train` does: {task: {"status": ...}}
    results = run_experiment(cfg)            # a validated config; embedded local Ray unless address= is given

Under Ray (the default) every task runs concurrently: one scheduler actor over the pure policy, one
TaskDriver actor per task (rlsched.run.task), their roles in the device group's placement group. A failed
task is reported with its cause and never stops the others. `in_process=True` runs the same step loop
task after task in this process, with always-free locks (debugging).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlsched.base.errors import cause_of, plain_text
from rlsched.base.waits import answer
from rlsched.cluster import ray_cluster
from rlsched.cluster.security import prepare_embedded_cluster
from rlsched.config.loading import load_configs, select_tasks
from rlsched.config.meshes import check_platform, resolve_processes
from rlsched.config.preflight import preflight
from rlsched.config.schema import ExperimentConfig, TaskConfig
from rlsched.observe.progress import LineBuffer, ProgressView
from rlsched.run.stopping import Stopped, StopSignals
from rlsched.rundir.files import TRACEBACK_FILE, prepare_run_dir, run_summary, task_dir, write_atomic
from rlsched.rundir.lock import RunLock
from rlsched.rundir.log import RunLog
from rlsched.scheduling.policy import CoBatch, GroupSpec, Phase, Policy
from rlsched.scheduling.scheduler import ASK_TIMEOUT_S
from workers.models import sharding


def train(configs: str | Path | Sequence[str | Path], *, overrides: Sequence[str] = (), resume: bool = False,
          overwrite: bool = False, tasks: Sequence[str] | None = None, in_process: bool = False,
          address: str | None = None, echo=print, live: bool = False) -> dict[str, dict[str, Any]]:
    """`rlsched train` as a function, with its defaults: validate, prepare runs/<experiment>/, run the tasks
    (`live`: a live table of the tasks, for a terminal). Returns {task: {"status": "ok" | "failed" | ...,
    "steps": ..., ...}} as the CLI reads it (a failed task says why in "error").

    By default the tasks run concurrently under the Ray scheduler. in_process=True (`--in-process`) runs them
    one after another in this process, with always-free locks: each result also holds the task's per-step
    metrics under "metrics", and the first task's error is raised, not reported.
    """
    paths = [configs] if isinstance(configs, str | Path) else list(configs)
    cfg = select_tasks(load_configs(paths, overrides), tasks)
    preflight(cfg)  # what could only fail later (meshes, positions, budget, data, reward, output dir)
    plans = [task.batch_plan().describe() for task in cfg.tasks]
    for line in plans:
        echo(line)
    if address is not None and not in_process:
        ray_cluster.check_reachable(address)  # in seconds, before anything is written
    if address is None and not in_process:  # an embedded Ray: authentication on (or --insecure), before any write
        prepare_embedded_cluster(echo)
    # The run directory is this process's until it ends: a second run on it, or an --overwrite of it, is refused.
    with RunLock(cfg.run_dir, echo=echo, overwrite=overwrite):
        run_dir = prepare_run_dir(cfg, resume=resume, overwrite=overwrite)
        with RunLog(run_dir / "run.log", echo) as log:  # every line from here on is also in run.log, timed
            for line in plans:
                log.note(line)
            log(f"run directory: {run_dir}")
            for task in cfg.tasks:
                log(weights_line(task, run_dir))
            if in_process:
                steps = {t.name: t.steps for t in cfg.tasks}
                return {name: {"task": name, "status": "ok", "steps": steps[name], "metrics": metrics}
                        for name, metrics in run_in_process(cfg, resume=resume, echo=log).items()}
            return run_experiment(cfg, resume=resume, address=address, echo=log, live=live)


def weights_line(task: TaskConfig, run_dir: Path) -> str:
    """Where the task's weights will be (said at the start: with checkpoint_every 0 the run keeps none)."""
    every, where = task.checkpoint_every, run_dir / "tasks" / task.name
    if every == 0 and not task.export_final:
        return f"[{task.name}] keeps no weights (checkpoint_every 0); unset it to keep the last step's"
    saves = "the last step" if every in (None, 0) else f"every {every} steps and the last"
    final = (f"; as a Hugging Face model in {where / 'final'}" if task.export_final else
             f"; `rlsched export {run_dir} --task {task.name} OUT` writes them as a Hugging Face model")
    return f"[{task.name}] weights: {where / 'checkpoints'}/<step>/ ({saves}){final}"


def announce_models(cfg: ExperimentConfig, echo) -> set[str]:
    """One line per random init_preset model that several tasks share and that is not there yet (a LoRA base):
    their drivers start at once, and each would say it creates it. Returns those tasks' names."""
    sharing: dict[Path, list[TaskConfig]] = {}
    for task in cfg.tasks:
        path = Path(task.model.path).absolute()
        if task.model.init_preset is not None and not (path / "config.json").is_file():
            sharing.setdefault(path, []).append(task)
    announced = set()
    for tasks in sharing.values():
        if len(tasks) > 1:
            names = ", ".join(t.name for t in tasks)
            echo(f"creating a random {tasks[0].model.init_preset} Qwen3 at {tasks[0].model.path}, shared by "
                 f"{len(tasks)} tasks ({names})")
            announced |= {t.name for t in tasks}
    return announced


def run_in_process(cfg: ExperimentConfig, *, resume: bool = False, echo=print) -> dict[str, list[dict[str, Any]]]:
    """Each task's step loop in this process, one task after another, with always-free locks; then the run's
    timeline.json and summary.json."""
    from rlsched.run.task import TaskDriver
    from rlsched.scheduling.scheduler import FreeLocks

    ray_cluster.use_host_devices(cfg.num_devices)
    specs = [dataclasses.replace(s, processes="per_device_group") for s in cfg.task_specs()]  # all in this one
    results: dict[str, list[dict[str, Any]]] = {}
    drivers = {}
    with StopSignals(echo) as stop:
        for spec in specs:
            if stop.requested:  # the stop came during an earlier task: this one does not start
                break
            drivers[spec.name] = driver = TaskDriver(spec, FreeLocks(spec.name), resume=resume, echo=echo)
            stop.on_request = driver.request_stop  # the handler may call it: it only sets an event
            results[spec.name] = driver.run()
    # a run under Ray's outputs: its timeline (phases, syncs, compiles) and summary.json; no picture (matplotlib's
    # import is most of a second, and an in-process run is for debugging and tests)
    write_run_outputs(cfg, [e for d in drivers.values() for e in d.events()],
                      {name: {"task": name, "status": "ok" if d.step_done == d.spec.config.steps else "stopped",
                              "steps": d.step_done} for name, d in drivers.items()}, echo=echo, picture=False)
    if stop.signum is not None:
        raise Stopped(stop.signum, {n: {"status": "stopped", "steps": d.step_done} for n, d in drivers.items()},
                      "stopped on request; the task in progress saved its last step")
    return results


def estimate_bytes(task: TaskConfig, shared: dict[str, int] | None = None) -> tuple[int, int]:
    """(engine, actor) bytes on one device of each role's mesh, from its model's config.json: what admission
    decides on before any worker exists (rlsched.config.plan has the per-kind numbers). engine = params + the
    largest KV cache; actor = params + AdamW moments (+ reference). Every role of a group uses its first
    device, so per-device sums are exact there, the busiest device. `shared`: {role: bytes of the shared base it
    reads} for a LoRA task of a base group, left out (the group's budget holds the base once: `build_policy`)."""
    from rlsched.config.plan import planned_bytes, resident_bytes

    held = resident_bytes(planned_bytes(task, 0))
    shared = shared or {}
    return held["engine"] - shared.get("engine", 0), held["actor"] - shared.get("actor", 0)


def build_policy(cfg: ExperimentConfig) -> tuple[Policy, dict[str, list[tuple[str, str]]]]:
    """The policy with every task registered as created on device, and the offloads each task must do
    at start because its roles don't fit the budget beside the tasks registered before it."""
    budget = cfg.cluster.memory_budget_gb
    nbytes = None if budget is None else int(budget * 2**30)
    # LoRA base groups: each base is resident once for the group's life, so it comes off the budget of the
    # devices it lies on (the busiest device's), and off each of its tasks' roles
    bases = lora_bases(cfg)

    def left(kind: str) -> int | None:
        held = max((sum(b.nbytes for b in bases if d in b.devices and any(r == kind for _, r in b.roles))
                    for d in range(cfg.num_devices)), default=0)
        return None if nbytes is None else nbytes - held

    spec = (GroupSpec.colocated(None if nbytes is None else nbytes - max(
                (sum(b.nbytes for b in bases if d in b.devices) for d in range(cfg.num_devices)), default=0))
            if cfg.cluster.placement == "colocated" else GroupSpec.disaggregated(left("engine"), left("actor")))
    policy = Policy({ray_cluster.GROUP: spec}, order=cfg.cluster.policy, starvation_limit=cfg.cluster.starvation_limit)
    initial: dict[str, list[tuple[str, str]]] = {}
    cobatch = cobatches(cfg, bases)
    for task in cfg.tasks:
        engine, actor = estimate_bytes(task, shared_bytes(bases, task.name))
        initial[task.name] = [(str(m.role), str(m.action)) for m in policy.register(
            task.name, ray_cluster.GROUP, engine, actor, priority=task.priority, weight=task.weight,
            cobatch=cobatch.get(task.name))]
    return policy, initial


def lora_bases(cfg: ExperimentConfig, processes: str | None = None) -> list:
    """The shared bases (rlsched.config.plan.SharedBase) of `cfg`'s LoRA tasks, from their models' config.json (no
    weights read): [] without any. `processes`: the roles' layout once resolved, in place of cluster.processes."""
    from rlsched.config.meshes import read_model_config
    from rlsched.config.plan import shared_bases

    if processes is not None:
        cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"processes": processes})})
    models = {t.name: read_model_config(t, i, required=True) for i, t in enumerate(cfg.tasks) if t.lora is not None}
    return shared_bases(cfg, models) if models else []


def train_cohorts(cfg: ExperimentConfig, bases: list) -> dict[str, int]:
    """{task: the most tasks a co-batched TRAIN hold of it holds} of the tasks of `cfg` that co-batch their updates
    (rlsched.config.plan.train_batches; others train alone: 1, left out); `bases`: `cfg`'s (`lora_bases`)."""
    from rlsched.config.plan import train_batches

    return {task: hold.most_members(task) for hold in train_batches(cfg, bases) for task in hold.tasks}


def task_bases(cfg: ExperimentConfig, name: str, processes: str) -> list:
    """The shared bases (rlsched.config.plan.SharedBase) task `name` of its own submission `cfg` reads when it joins
    a running scheduler with its roles in `processes`: [] for a task that loads its own weights. Found as
    `rlsched train` finds them (its whole submission, so the keys are the same)."""
    if next(t for t in cfg.tasks if t.name == name).lora is None:
        return []
    return [b for b in lora_bases(cfg, processes) if any(task == name for task, _ in b.roles)]


def shared_bytes(bases: list, name: str) -> dict[str, int]:
    """{role: bytes of the shared base it reads} of task `name` among `bases` (estimate_bytes leaves them out)."""
    return {role: b.nbytes for b in bases for task, role in b.roles if task == name}


def cobatches(cfg: ExperimentConfig, bases) -> dict[str, tuple[CoBatch, ...]]:
    """{task: its CoBatch per co-batched phase}: the LoRA tasks whose engines are slots of one shared sampler
    (workers.rollout.shared_engine: one base, one mesh and the same engine sizes), so their ROLLOUTs can share a
    hold, and those whose actors read one base with one update program, so their TRAINs can
    (rlsched.config.plan.rollout_batches and train_batches, which `rlsched plan` shows)."""
    from rlsched.config.plan import rollout_batches, train_batches

    out: dict[str, tuple[CoBatch, ...]] = {}
    for b in rollout_batches(cfg, bases) + train_batches(cfg, bases):
        for task, rows in zip(b.tasks, b.rows, strict=True):
            out[task] = (*out.get(task, ()), CoBatch(b.key, rows, b.capacity, Phase(b.phase)))
    return out


def run_experiment(cfg: ExperimentConfig, *, resume: bool = False, address: str | None = None, echo=print,
                   on_started=None, live: bool = False) -> dict[str, dict[str, Any]]:
    """Run every task of `cfg` concurrently; returns {task: {"status": "ok"|"failed", ...}}.

    The first SIGINT/SIGTERM lets every task finish its step and save it, writes the outputs and raises
    `rlsched.run.stopping.Stopped`; a second raises `Interrupted` at once. Whatever happens, the placement group,
    the scheduler, the drivers and the role processes are released before this returns or raises."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from rlsched.run.task import TaskDriver
    from rlsched.scheduling.scheduler import Scheduler, SchedulerLocks

    connected = ray_cluster.init_ray(address, log_to_driver=False)  # task lines are pulled (rlsched.observe.progress)
    logs = ray_cluster.worker_log_dir()
    if logs is not None:
        echo(f"what libraries print in role processes: {logs} (worker-*-<pid>.err; pids in summary.json)")
    resource = ray_cluster.device_resource()
    # Across hosts, per_role makes a role spanning them a group of its own (rlsched.cluster.rolegroup);
    # per_device_group, one process per host for every role (rlsched.cluster.group_process.GroupProcesses).
    processes = resolve_processes(cfg.cluster.processes, resource)
    check_platform(resource, cfg, processes)  # what cannot work on this platform: before any role starts
    devices = ray_cluster.group_devices(cfg.cluster.placement, cfg.num_devices,
                                        max(sharding.num_devices(t.rollout.mesh.as_dict()) for t in cfg.tasks))
    policy, initial_moves = build_policy(cfg)
    with StopSignals(echo, raise_on_second=False) as stop:  # the wait loop below checks for a second signal
        pg = ray_cluster.make_placement_group(cfg.experiment.name, cfg.cluster.placement, resource, devices,
                                              hosts=cfg.cluster.hosts)
        actors: list = []  # everything this run started, ended in `finally` whatever happens
        try:
            where = ray_cluster.role_sites(pg, cfg.cluster.placement, resource, devices,
                                               hosts=cfg.cluster.hosts)
            announced = announce_models(cfg, echo)
            cohorts = train_cohorts(cfg, lora_bases(cfg, processes))
            specs = [dataclasses.replace(s, processes=processes, announces_model=s.name not in announced,
                                         train_cohort=cohorts.get(s.name, 1)) for s in cfg.task_specs()]
            scheduler = ray.remote(num_cpus=0)(Scheduler).remote(policy, lease_timeout_s=cfg.cluster.lease_timeout_s)
            actors.append(scheduler)
            if processes == "per_device_group":  # one process per device group holds every task's roles there
                where = _start_group_processes(cfg, where, actors, echo, scheduler)
            # Drivers need no device: they wait on locks and score rewards between phases. Threads, not asyncio:
            # the step loop blocks one, while the lifeline and the scheduler's eviction requests take others.
            driver_cls = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)(TaskDriver)
            drivers = {s.name: driver_cls.remote(s, SchedulerLocks(scheduler, s.name), sites=where,
                                                 resume=resume, initial_moves=initial_moves[s.name],
                                                 echo=LineBuffer())  # pulled and printed here
                       for s in specs}
            actors += drivers.values()  # a driver's roles go with it: Ray ends the actors a process owns
            for name, driver in drivers.items():
                # The lifeline ref is wrapped in a list so Ray passes the ref itself rather than waiting for it.
                scheduler.watch.remote(name, [driver.lifeline.remote()])
                scheduler.register_driver.remote(name, driver)
            pending = {driver.run.remote(): name for name, driver in drivers.items()}
            if on_started is not None:  # a hook for tests and tools: {task: driver handle}
                on_started(drivers)
            with ProgressView(echo, live=live) as view:
                results = _wait_for_tasks(pending, drivers, scheduler, cfg, stop, view)
            events = list(_ask(scheduler, "events"))
            for name, driver in drivers.items():
                try:
                    events += ray.get(driver.events.remote(), timeout=60)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    echo(f"[{name}] its timeline is lost with its process")
            state = _ask(scheduler, "state")
        finally:
            for actor in actors:
                with contextlib.suppress(Exception):  # one that is gone already must not keep the others
                    ray.kill(actor)
            remove_placement_group(pg)
        with ray_cluster.shutting_down(connected):  # a Ray this run connected goes down while its outputs are written
            write_run_outputs(cfg, events, results, state, echo=echo)
    if stop.signum is not None:
        raise Stopped(stop.signum, results, _stopped_message(results))
    return results


def _start_group_processes(cfg: ExperimentConfig, where, actors: list, echo, scheduler):
    """`cluster.processes: per_device_group`: a host process per device group (one when colocated), added to
    `actors`; the placement with them. Across hosts (cluster.hosts > 1, colocated): a process per host, joined
    into one JAX job whose coordinator port comes from the scheduler's allocator
    (rlsched.cluster.group_process.GroupProcesses)."""
    from rlsched.cluster.group_process import start_group_across_hosts, start_group_processes

    if cfg.cluster.hosts > 1:
        def take_port(kind: str, host: str, busy: list[int]) -> int:
            return _ask(scheduler, "take_port", "device group", kind, host, list(busy))

        hosts = start_group_across_hosts(where, num_devices=cfg.num_devices, max_tasks=len(cfg.tasks),
                                         take_port=take_port)
        actors += hosts.members
        members = ", ".join(f"{n['host']} pid {n['pid']}" for n in hosts.nodes)
        echo(f"roles held by {len(hosts.members)} device-group processes, one per host, joined into one JAX job "
             f"(coordinator {hosts.coordinator}; {members})")
        return dataclasses.replace(where, processes={"engine": hosts, "actor": hosts})
    # A host that dies is restarted by Ray while a task of it may still restart its roles
    # (rlsched.cluster.group_process), and once more for each task the scheduler may fence by ending the host (each
    # fenced task fails: once each).
    from workers.rollout import OWN_PROCESS_ENGINES

    sizes = dict(num_devices=cfg.num_devices, max_tasks=len(cfg.tasks),
                 max_restarts=max(t.max_restarts for t in cfg.tasks) + len(cfg.tasks),
                 shares_devices=any(t.rollout.engine in OWN_PROCESS_ENGINES for t in cfg.tasks))
    group = start_group_processes(where, colocated=cfg.cluster.placement == "colocated", **sizes)
    hosts = list({id(h): h for h in group.values()}.values())
    actors += hosts
    echo(f"roles held by {len(hosts)} device-group process(es) (cluster.processes: per_device_group)")
    return dataclasses.replace(where, processes=group)


def _poll(drivers: dict, names, view: ProgressView) -> dict[str, dict[str, Any]]:
    """Print the tasks' new lines and update their rows; {task: its poll} of the drivers that answered."""
    import ray

    polls = {}
    for name in names:
        with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            polls[name] = ray.get(drivers[name].poll.remote(), timeout=10)
            view.show(name, polls[name])
    return polls


def _wait_for_tasks(pending: dict, drivers: dict, scheduler, cfg: ExperimentConfig, stop: StopSignals,
                    view: ProgressView) -> dict[str, dict[str, Any]]:
    """Each task's result as it ends, its lines shown as they come; on a stop request, ask every driver to
    stop after its step."""
    import ray

    echo = view.echo
    results: dict[str, dict[str, Any]] = {}
    t0, asked = time.perf_counter(), False
    while pending:
        if stop.requested and not asked:  # sent from here, never from the signal handler
            for name in pending.values():
                drivers[name].request_stop.remote()
            asked = True
        # A short wait: a stop request reaches the drivers, and their lines the terminal, within ~0.2 s, which
        # is a step or less even where steps are fast (the stop lands after the step in progress, as promised).
        done, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
        stop.check()  # a second signal: leave now (the caller's `finally` ends every process)
        _poll(drivers, [n for ref, n in pending.items() if ref not in done], view)
        if not done:
            continue
        name = pending.pop(done[0])
        last = _poll(drivers, [name], view).get(name)  # its last lines before its status
        results[name] = _result(name, done[0], scheduler, cfg)
        # Which process holds each role on which devices (summary.json), and whether it stopped early; a driver
        # that died with its task has no answer, and the result says why.
        if last is not None:
            results[name]["roles"] = last["roles"]
            if last.get("restarts"):
                results[name]["restarts"] = last["restarts"]
            if results[name]["status"] == "ok" and last["state"] == "stopped":
                results[name].update(status="stopped", steps=last["step"])
        status = results[name]["status"]
        restarts = len(results[name].get("restarts", ()))
        echo(f"[{name}] {status}" + (f": {results[name]['error']}" if status == "failed" else "")
             + (f" ({restarts} restart(s))" if restarts else "")
             + (f" after step {results[name]['steps']}" if status == "stopped" else "")
             + f" after {time.perf_counter() - t0:.1f}s")
        if "traceback_file" in results[name]:
            echo(f"[{name}] its traceback: {results[name]['traceback_file']}")
    return results


def _stopped_message(results: dict[str, dict[str, Any]]) -> str:
    done = ", ".join(f"{name} at step {r['steps']}" for name, r in results.items() if r["status"] == "stopped")
    return f"stopped on request ({done or 'every task had finished'}); each task saved its last step"


def _result(name: str, ref, scheduler, cfg: ExperimentConfig) -> dict[str, Any]:
    """A driver's outcome: ok with its step count, or failed with the cause (its error, or how it died)."""
    import ray

    try:
        ray.get(ref)
        return {"task": name, "status": "ok", "steps": next(t.steps for t in cfg.tasks if t.name == name)}
    except ray.exceptions.RayTaskError as err:  # the step loop raised: the original error is the cause ...
        fenced = _ask(scheduler, "fenced").get(name)  # ... unless the scheduler stopped its roles first
        error = cause_of(err) if fenced is None else f"{fenced}; its roles were stopped, and then: {cause_of(err)}"
        text = plain_text(err)
        # the cause's one line is what a terminal shows; its whole traceback goes to the task's directory
        kept = write_atomic(task_dir(cfg.run_dir, name) / TRACEBACK_FILE, text.rstrip("\n") + "\n")
        return {"task": name, "status": "failed", "error": error, "traceback": text, "traceback_file": str(kept)}
    except ray.exceptions.RayActorError as err:  # the driver's process died
        cause = _ask(scheduler, "failed").get(name, f"its process died ({type(err).__name__})")
        return {"task": name, "status": "failed", "error": cause}


def _ask(scheduler, method: str, *args) -> Any:
    """The scheduler's answer to `method(*args)`, a call that waits for no one, within ASK_TIMEOUT_S."""
    return answer(getattr(scheduler, method).remote(*args), timeout_s=ASK_TIMEOUT_S, what=f"the scheduler's {method}()",
                  check="its process may hang or be lost (`ray list actors` shows it; its log is among Ray's "
                        "worker logs)")


def _scheduler_run(cfg: ExperimentConfig, events: list[dict], summary: dict[str, Any], *, ok: bool) -> None:
    """The scheduler's own W&B run: memory per pool and lock queues over time, then per-task lock
    waits, switch costs and per-resource busy fractions as its summary."""
    from rlsched.observe.tracking import make_trackers

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
                      scheduler_state: dict[str, Any] | None = None, *, echo=print, picture: bool = True) -> None:
    """runs/<exp>/timeline.json (Chrome trace), timeline.png (Gantt, with `picture`) and summary.json, each written
    atomically; a picture that cannot be drawn is reported, never fatal."""
    from rlsched.observe.timeline import summarize, write_chrome_trace

    run_dir = cfg.run_dir
    write_chrome_trace(run_dir / "timeline.json", events)
    if picture:
        try:
            from rlsched.observe.gantt import plot_gantt

            plot_gantt(events, run_dir / "timeline.png", title=cfg.experiment.name)
        except Exception as err:  # noqa: BLE001 - the trace and the metrics are what matter
            echo(f"timeline.png not drawn: {type(err).__name__}: {err}")
    summary = run_summary(cfg.experiment.name, cfg.cluster.placement, results, summarize(events), scheduler_state)
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    if cfg.experiment.tracking.wandb:
        _scheduler_run(cfg, events, summary, ok=all(r["status"] == "ok" for r in results.values()))
    echo(f"timeline: {run_dir / 'timeline.json'} (opens in Perfetto), summary: {run_dir / 'summary.json'}")
