"""What a task's processes are handed once its config is resolved: the task's `TaskSpec` (its config section, seed,
paths and the cluster settings it runs under), the `BatchPlan` its batch arithmetic derives to, and the name of its
weight channel. Built by `rlsched.config.schema.ExperimentConfig.task_specs`; immutable; pickled to every process
that works for the task, so importing this module costs nothing (no pydantic models are built here).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from workers.models import sharding


def comm_group_name(experiment: str, task: str, src: str = "actor", dst: str = "rollout") -> str:
    """The name of a task's weight channel (rlsched.cluster.comm): one per (experiment, task, direction)."""
    return f"{experiment}/{task}/{src}->{dst}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """A task's batch arithmetic, derived once from its config (see `TaskConfig.batch_plan`)."""

    task: str
    prompts_per_step: int
    num_generations: int
    samples_per_step: int  # prompts_per_step * num_generations
    mini_batch_size: int  # samples per optimizer step
    micro_batch_size: int  # samples per forward/backward
    grad_accumulation: int  # micro-batches per optimizer step
    epochs_per_step: int
    optimizer_steps_per_step: int  # per GRPO step, all epochs
    steps: int  # GRPO steps
    total_optimizer_steps: int
    warmup_steps: int

    def describe(self) -> str:
        epochs = f" x {self.epochs_per_step} epochs" if self.epochs_per_step > 1 else ""
        return (
            f"task {self.task}: {self.prompts_per_step} prompts x {self.num_generations} generations = "
            f"{self.samples_per_step} samples/step; mini-batch {self.mini_batch_size}{epochs} "
            f"({self.optimizer_steps_per_step} optimizer steps/step, {self.grad_accumulation} micro-batches of "
            f"{self.micro_batch_size} each); {self.steps} steps = {self.total_optimizer_steps} optimizer steps, "
            f"{self.warmup_steps} warmup"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """One task of an experiment, resolved once (`ExperimentConfig.task_specs`) and handed, immutable, to
    every process that works for it: its driver and its roles. Nothing downstream re-derives a seed, a
    path or a name; the experiment is never re-validated in a worker."""

    experiment: str  # the experiment's name
    index: int  # position in the experiment's `tasks` (overrides say `tasks.<index>.`)
    # The two sections below are rlsched.config.schema's TaskConfig and TrackingSection, named here but not imported:
    # schema builds TaskSpecs (ExperimentConfig.task_specs), so even a type-only import back would close a circle.
    config: Any  # the task's validated config section (TaskConfig)
    seed: int  # the task's own seed, or the experiment seed + index
    dir: Path  # absolute runs/<experiment>/tasks/<task>: metrics, checkpoints
    tracking: Any  # where metrics go besides metrics.jsonl (experiment.tracking, a TrackingSection)
    placement: Literal["colocated", "disaggregated"]
    num_devices: int  # the experiment's device pool (rlsched.config.meshes.role_devices picks each role's from it)
    processes: Literal["per_role", "per_device_group"] = "per_role"  # cluster.processes once the platform is known
    hosts: int = 1  # hosts of the device group (cluster.hosts); num_devices is then per host
    shares_devices: bool = True  # roles of other tasks or of this one may use this task's devices (colocated, or
    # several tasks on a group; a service's tasks come and go): processes sharing a GPU must free what they offload
    checkpoint_offset: int = 0  # staggers the tasks' saves (TaskConfig.checkpoint_every)
    announces_model: bool = True  # says "creating a random ..." when its init_preset model is not there yet; False
    # where the run says it once for every task that shares the model (rlsched.run.experiment.announce_models)
    compile_cache: str | None = None  # absolute directory of JAX's persistent compilation cache (None: off)
    call_timeout_s: float = 3600.0  # longest wait for one call to a role in another process (cluster.call_timeout_s)
    train_cohort: int = 1  # the most tasks of its base group a co-batched TRAIN hold of it holds (1: it trains alone;
    # rlsched.config.plan.SharedHold.most_members): its actor compiles their joint programs before the first lock

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def plan(self) -> BatchPlan:
        return self.config.batch_plan()

    def role_hosts(self, kind: str) -> int:
        """How many hosts role `kind` ("actor" / "engine") spans: its mesh's devices over a host's."""
        mesh = self.config.actor.mesh if kind == "actor" else self.config.rollout.mesh
        return max(1, -(-sharding.num_devices(mesh.as_dict()) // self.num_devices))

    @property
    def comm_group(self) -> str:
        """This task's weight channel, `<experiment>/<task>/actor->rollout`: never shared between tasks."""
        return comm_group_name(self.experiment, self.name)

    @property
    def checkpoint_dir(self) -> Path:
        return self.dir / "checkpoints"

    @property
    def run_dir(self) -> Path:
        """The experiment's runs/<experiment>, which holds this task's directory."""
        return self.dir.parent.parent


def actor_settings(task):
    """The actor's update settings (workers.train_step.ActorSettings) from a task's config (rlsched.config.schema
    .TaskConfig): the only place they are built. No Ray, no JAX: benchmarks compile the actor's programs from it."""
    from workers.train_step import ActorSettings

    plan, g, o = task.batch_plan(), task.grpo, task.optim
    return ActorSettings(
        lr=o.lr, total_steps=plan.total_optimizer_steps, warmup_steps=plan.warmup_steps, min_lr_ratio=o.min_lr_ratio,
        weight_decay=o.weight_decay, grad_clip=o.grad_clip, b1=o.b1, b2=o.b2, epsilon=g.epsilon,
        epsilon_high=g.epsilon_high, beta=g.beta, aggregation=g.loss_aggregation, temperature=g.temperature,
        micro_batch_size=plan.micro_batch_size, mini_batch_size=plan.mini_batch_size, epochs=plan.epochs_per_step,
        router_aux_loss_coef=task.actor.router_aux_loss_coef, kl_clamp=g.kl_clamp, max_new_tokens=g.max_new_tokens,
        remat=task.actor.remat, adam_mu_dtype=task.actor.adam_mu_dtype)
