"""TaskDriver: one task's step loop under the scheduler's locks, as an async Ray actor.

`run` reads as DESIGN.md's step: acquire ROLLOUT -> onload engine -> sync + verify weights ->
generate -> release; score rewards on the host; acquire TRAIN -> onload actor -> logprobs,
advantages, updates -> publish weights -> release. The data plane (TaskRunner's engine and actor)
lives in this actor's process; the scheduler decides when it may run and what must be resident.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
from typing import Any

from rlsched import placement
from rlsched.config import ExperimentConfig
from rlsched.policy import Phase


class TaskDriver:
    def __init__(self, experiment: dict, index: int, scheduler, *, resume: bool = False):
        from rlsched.trainer import TaskRunner  # JAX is imported in the worker process only

        self.cfg = ExperimentConfig.model_validate(experiment)
        self.task = self.cfg.tasks[index].name
        self.scheduler = scheduler
        self.runner = TaskRunner(self.cfg, index, resume=resume, echo=self._echo)
        self.lock_wait_s = 0.0
        self.cores = placement.visible_cores()  # the group's devices, seen before any pinning

    def _echo(self, line: str) -> None:
        print(line, flush=True)

    async def lifeline(self) -> None:
        """Never returns while this process lives: the scheduler awaits it to learn of our death."""
        await asyncio.Event().wait()

    @contextlib.asynccontextmanager
    async def lock(self, phase: Phase):
        """Hold `phase`'s lock; first perform the moves the grant asks of this task (onload)."""
        lease = await self.scheduler.acquire.remote(self.task, str(phase))
        self.lock_wait_s += lease.waited_s
        placement.pin_process(placement.phase_cores(self.cfg.cluster.placement, phase, self.cores))
        try:
            for m in lease.moves:
                if m.task == self.task:
                    self.move(str(m.role), str(m.action))
            yield lease
        finally:
            await self.scheduler.release.remote(self.task, str(phase))

    def move(self, role: str, action: str) -> None:
        """Offload (device -> host) or onload one of this task's roles; asked by the scheduler."""
        target = self.runner.engine if role == "engine" else self.runner.actor
        if action == "offload":
            target.release_memory()
        else:
            target.resume_memory()

    async def run(self) -> dict[str, Any]:
        r = self.runner
        try:
            for step in range(r.step_done + 1, r.cfg.steps + 1):
                t0 = time.perf_counter()
                async with self.lock(Phase.ROLLOUT):
                    t1 = time.perf_counter()
                    rollout = r.rollout_phase(step)  # sync weights if stale, verify, generate
                t2 = time.perf_counter()
                rewards, reward_errors = r.score(rollout.prompts, rollout.output)
                t3 = time.perf_counter()
                async with self.lock(Phase.TRAIN):
                    t4 = time.perf_counter()
                    train = r.train_phase(step, rollout, rewards)  # logprobs, advantages, updates, publish
                t5 = time.perf_counter()
                self.record(step, rollout, rewards, reward_errors, train, {
                    "time/rollout_s": t2 - t1, "time/reward_s": t3 - t2, "time/train_s": t5 - t4,
                    "time/lock_wait_s": (t1 - t0) + (t4 - t3), "time/step_s": t5 - t0,
                    "time/end_unix": time.time()})
            return {"task": self.task, "status": "ok", "steps": r.step_done}
        except Exception as err:  # noqa: BLE001 - reported to the user with the cause, others go on
            await self.scheduler.fail.remote(self.task, f"{type(err).__name__}: {err}")
            return {"task": self.task, "status": "failed", "steps": r.step_done,
                    "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        finally:
            r.close()

    def record(self, step, rollout, rewards, reward_errors, train, times) -> None:
        from rlsched.trainer import step_metrics

        self.runner.record(step, step_metrics(rollout, rewards, reward_errors, train, self.runner.actor.version, times))
