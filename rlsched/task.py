"""TaskDriver: one task's step loop under the scheduler's locks, as an async Ray actor.

`run` reads as DESIGN.md's step: acquire ROLLOUT -> onload engine -> sync + verify weights ->
generate -> release; score rewards on the host; acquire TRAIN -> onload actor -> logprobs,
advantages, updates -> publish weights -> release.

Design decisions (and why):
- The driver holds no weights. The task's actor and engine are Ray actors of their own
  (rlsched.roles), placed in the device group's placement group and pinned to their devices
  (disaggregated: engine on the rollout pool, actor on the train pool; colocated: both on all).
  Weights go actor -> engine through the task's comm channel; the driver forwards a message.
- Blocking work (each phase, each memory move) runs in a worker thread, so the event loop stays
  free to answer the scheduler (lifeline, eviction requests) while a phase runs.
- Every move goes through `memory.Residency`, which updates this task's memory pool, mirrors it
  into the scheduler's, and records an onload/offload span.
- The lock hold is one span named after the phase (ROLLOUT / TRAIN) on the lock's resource, and
  every finer span of the phase carries the same resource, so the trace shows the lock exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
from typing import Any

from rlsched import placement
from rlsched.config import ExperimentConfig
from rlsched.memory import MemoryPool, Residency
from rlsched.policy import Phase, Role


class TaskDriver:
    def __init__(self, experiment: dict, index: int, scheduler, *, resume: bool = False, placement_group=None,
                 cores: list[int] | None = None, resource: str = "CPU", initial_moves=()):
        self.cfg = ExperimentConfig.model_validate(experiment)
        self.index, self.task = index, self.cfg.tasks[index].name
        self.scheduler = scheduler
        self.lock_wait_s = 0.0
        self._start_args = (resume, placement_group, cores or placement.visible_cores(), resource)
        self._started: asyncio.Task | None = None
        self._initial_moves = list(initial_moves)  # offloads the policy decided at registration
        self.runner = None

    async def start(self) -> None:
        """Build the task's roles (their processes start, load the model and publish v0), then do the
        offloads the policy asked for at registration. Off the event loop: the lifeline and eviction
        requests stay answerable meanwhile."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._start())
        await self._started

    async def _start(self) -> None:
        await asyncio.to_thread(self._build)
        for role, action in self._initial_moves:
            r = self.residency[Role(role)]
            await asyncio.to_thread(r.offload if action == "offload" else r.onload)

    def _build(self) -> None:
        from rlsched.roles import spawn_ray
        from rlsched.timeline import Timeline
        from rlsched.trainer import TaskRunner  # JAX is imported in the worker processes only

        resume, placement_group, cores, resource = self._start_args
        mode = self.cfg.cluster.placement
        where = {"engine": (0, placement.phase_cores(mode, Phase.ROLLOUT, cores)),
                 "actor": (0 if mode == "colocated" else 1, placement.phase_cores(mode, Phase.TRAIN, cores))}

        def spawn(cls, raw, i, *, channel, role):
            bundle, role_cores = where[role]
            return spawn_ray(cls, raw, i, channel=channel, placement_group=placement_group, bundle=bundle,
                             cores=role_cores, resource=resource)

        self.timeline = Timeline("driver", task=self.task)
        runner = TaskRunner(self.cfg, self.index, resume=resume, echo=self._echo, spawn=spawn,
                            channel="object_store", timeline=self.timeline)
        self.pool = MemoryPool(self.task)
        workers = {Role.ENGINE: runner.engine, Role.ACTOR: runner.actor}
        self.residency = {role: Residency(self.pool, self.task, str(role), onload=w.onload, offload=w.offload,
                                          timeline=self.timeline, resident=True, sizes=w.memory(),
                                          on_change=self._report_memory)
                          for role, w in workers.items()}
        self.runner = runner

    def _echo(self, line: str) -> None:
        print(line, flush=True)

    def _report_memory(self, task: str, role: str, sizes: dict[str, int]) -> None:
        self.scheduler.report_memory.remote(task, role, sizes)  # fire and forget: accounting, not control

    async def lifeline(self) -> None:
        """Never returns while this process lives: the scheduler awaits it to learn of our death."""
        await asyncio.Event().wait()

    @contextlib.asynccontextmanager
    async def lock(self, phase: Phase):
        """Hold `phase`'s lock; first perform the moves the grant asks of this task (onload)."""
        asked = self.timeline.now()
        lease = await self.scheduler.acquire.remote(self.task, str(phase))
        where = {"phase": str(phase), "resource": lease.resource}
        self.timeline.add_span("lock_wait", asked, self.timeline.now(), **where)
        self.lock_wait_s += lease.waited_s
        self.runner.where = where
        try:
            with self.timeline.span(str(phase).upper(), **where):
                for m in lease.moves:
                    if m.task == self.task:
                        await self.move(str(m.role), str(m.action))
                yield lease
        finally:
            self.runner.where = {}
            await self.scheduler.release.remote(self.task, str(phase))

    async def move(self, role: str, action: str) -> None:
        """Offload (device -> host) or onload one of this task's roles: asked by our own grant, or by
        the scheduler to evict an idle role for another task."""
        await self.start()
        r = self.residency[Role(role)]
        await asyncio.to_thread(r.offload if action == "offload" else r.onload, **self.runner.where)

    async def run(self) -> dict[str, Any]:
        try:
            await self.start()
        except Exception as err:  # noqa: BLE001 - e.g. a role could not load its model
            await self.scheduler.fail.remote(self.task, f"{type(err).__name__}: {err}")
            return {"task": self.task, "status": "failed", "steps": 0, "error": f"{type(err).__name__}: {err}",
                    "traceback": traceback.format_exc()}
        r = self.runner
        exit_code = 1  # until the last step is recorded: trackers of a failed task finish as failed
        try:
            for step in range(r.step_done + 1, r.cfg.steps + 1):
                t0 = time.perf_counter()
                prompts = await asyncio.to_thread(r.next_prompts)  # host work stays outside the locks
                asked = time.perf_counter()
                async with self.lock(Phase.ROLLOUT):
                    t1 = time.perf_counter()
                    rollout = await asyncio.to_thread(r.rollout_phase, step, prompts)  # sync, verify, generate
                t2 = time.perf_counter()
                rewards, reward_errors = await asyncio.to_thread(r.score, rollout.prompts, rollout.output)
                batch = await asyncio.to_thread(r.train_batch, rollout, rewards)  # advantages, padding
                t3 = time.perf_counter()
                async with self.lock(Phase.TRAIN):
                    t4 = time.perf_counter()
                    train = await asyncio.to_thread(r.train_phase, step, batch)  # updates, publish
                t5 = time.perf_counter()
                await asyncio.to_thread(self.record, step, rollout, rewards, reward_errors, train, {
                    "time/rollout_s": t2 - t1, "time/reward_s": t3 - t2, "time/train_s": t5 - t4,
                    "time/lock_wait_s": (t1 - asked) + (t4 - t3), "time/step_s": t5 - t0,
                    "time/end_unix": time.time()})
            exit_code = 0
            return {"task": self.task, "status": "ok", "steps": r.step_done}
        except Exception as err:  # noqa: BLE001 - reported to the user with the cause, others go on
            await self.scheduler.fail.remote(self.task, f"{type(err).__name__}: {err}")
            return {"task": self.task, "status": "failed", "steps": r.step_done,
                    "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        finally:
            with contextlib.suppress(Exception):  # a dead role cannot close; the result above says why
                await asyncio.to_thread(r.close, exit_code)

    def record(self, step, rollout, rewards, reward_errors, train, times) -> None:
        from rlsched.trainer import step_metrics

        self.runner.record(step, step_metrics(rollout, rewards, reward_errors, train, self.runner.published.version,
                                              times))

    async def role_handles(self) -> dict[str, Any]:
        """{"engine": handle, "actor": handle} of this task's role actors (for tools and fault tests)."""
        await self.start()
        return {"engine": self.runner.engine.handle, "actor": self.runner.actor.handle}

    def events(self) -> list[dict]:
        """This task's timeline (driver and roles), for the experiment's trace."""
        return self.timeline.events() if self.runner is not None else []
