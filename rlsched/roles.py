"""A task's two data-plane roles, the actor and the rollout engine, each behind one small interface.

    actor = ActorRole(experiment, index, channel=channel)              # in this process, or
    actor = spawn_ray(ActorRole, experiment, index, channel=channel,   # in a Ray actor process of its own,
                      placement_group=pg, bundle=1, cores=[1])          # pinned to its devices

Design decisions (and why):
- **Roles, not workers, cross the process boundary.** A role owns its worker and what goes with it
  (the actor its optimizer state and checkpoints, the engine its weight version), so the driver's
  calls are few and coarse — train, publish, update_weights, verify, generate, offload, onload —
  one round trip each, and nothing large passes through the driver (weights go through the task's
  comm channel, see rlsched.comm).
- **Each role is built where it runs, from the task's config (a plain dict),** and pins its process
  to its devices *before* JAX starts, so XLA's thread pools are sized to those devices (on CPU a
  device is a core), unless its engine needs a bigger CPU pool (`XLA_CPU_THREADS`: sglang-jax
  deadlocks on one thread), which then shares the role's cores. A role's crash kills its own
  process only: the driver's call raises RayActorError and the task fails with that cause; the
  other tasks never notice.
- **The engine starts at weight version -1.** It loads nothing the actor did not send: the first
  ROLLOUT syncs v0 through the comm channel, so the actor's weights are the only weights.
- **Bytes are reported by kind after every move** (`onload()` returns them, `memory()` reads them)
  from the live arrays a role holds; the driver records them in its memory pool.
- **Spans recorded inside a role ride back with the call's result** (`(value, events)`), so the
  timeline has no gaps across processes and needs no extra round trip.
"""

from __future__ import annotations

from typing import Any

from rlsched import placement
from rlsched.comm import WeightChannel, WeightMessage


def _task(experiment: dict, index: int):
    from rlsched.config import ExperimentConfig

    cfg = ExperimentConfig.model_validate(experiment)
    return cfg, cfg.tasks[index]


def _timeline(process: str, task: str):
    from rlsched.timeline import Timeline

    return Timeline(process, task=task)


class RoleDied(RuntimeError):
    """The process of one of the task's roles died (crash, OOM, ray.kill); the task cannot go on."""


class _Role:
    """What both roles do alike: move what they hold (`_held`: a worker with release_memory,
    resume_memory and memory_bytes) and report its bytes."""

    kind = "role"
    _held: Any

    def offload(self) -> None:
        self._held.release_memory()

    def onload(self) -> dict[str, int]:
        self._held.resume_memory()
        return self.memory()

    def memory(self) -> dict[str, int]:
        return self._held.memory_bytes()

    def memory_probe(self) -> dict[str, int]:
        """This process's RSS and device bytes, named `mem/<kind>/...` (see rlsched.memprobe)."""
        from rlsched.memprobe import memory_metrics

        return memory_metrics(prefix=f"mem/{self.kind}")


class ActorRole(_Role):
    """The task's JAX actor worker (params, optimizer state, reference params) and its checkpoints."""

    kind = "actor"

    def __init__(self, experiment: dict, index: int, *, channel: WeightChannel, cores: list[int] | None = None):
        if cores:
            placement.pin_process(cores)  # before JAX creates its thread pools
        from rlsched.checkpoints import TaskCheckpointer
        from workers.actor import ActorSettings, ActorWorker
        from workers.models import load_pretrained

        cfg, task = _task(experiment, index)
        plan, g, o = task.batch_plan(), task.grpo, task.optim
        model, _ = load_pretrained(task.model.path, dtype=task.model.dtype, with_tokenizer=False)
        self.name = task.name
        self.worker = ActorWorker(model, ActorSettings(
            lr=o.lr, total_steps=plan.total_optimizer_steps, warmup_steps=plan.warmup_steps,
            weight_decay=o.weight_decay, grad_clip=o.grad_clip, b1=o.b1, b2=o.b2, epsilon=g.epsilon,
            epsilon_high=g.epsilon_high, beta=g.beta, aggregation=g.loss_aggregation, temperature=g.temperature,
            micro_batch_size=plan.micro_batch_size, mini_batch_size=plan.mini_batch_size,
            epochs=plan.epochs_per_step), seed=task.resolved_seed(cfg.experiment.seed, index))
        self.channel = channel
        self.checkpointer = TaskCheckpointer(cfg.run_dir / "tasks" / task.name / "checkpoints")
        self.timeline = _timeline("actor", task.name)
        self._held = self.worker

    def train(self, batch, step: int) -> tuple[dict[str, float], list[dict]]:
        """Logprobs and the GRPO updates of one step; (metrics, spans)."""
        metrics = self.worker.train(batch, step=step, timeline=self.timeline)
        return metrics, self.timeline.drain()

    def publish(self) -> tuple[WeightMessage, list[dict]]:
        """Send the current params (never the optimizer state) into the task's comm channel."""
        with self.timeline.span("publish") as span:
            snapshot = self.worker.export_weights()
            message = self.channel.send(snapshot.flat, snapshot.version, snapshot.checksum)
            span["bytes"] = message.nbytes
        return message, self.timeline.drain()

    def version(self) -> int:
        return self.worker.version

    def save(self, step: int, meta: dict[str, Any]) -> None:
        self.checkpointer.save(step, self.worker.state, {**meta, "version": self.worker.version})

    def restore_latest(self) -> dict[str, Any] | None:
        """Restore the latest checkpoint's state and version; its meta, or None if there is none."""
        if self.checkpointer.latest_step() is None:
            return None
        state, meta = self.checkpointer.restore(self.worker.state)
        self.worker.state, self.worker.version = state, int(meta["version"])
        return meta

    def checkpoint_dir(self) -> str:
        return str(self.checkpointer.directory)

    def close(self) -> None:
        self.checkpointer.close()


class EngineRole(_Role):
    """The task's rollout engine, holding only weights that arrived through the comm channel."""

    kind = "engine"

    def __init__(self, experiment: dict, index: int, *, channel: WeightChannel, cores: list[int] | None = None):
        from workers.rollout import XLA_CPU_THREADS, make_engine

        cfg, task = _task(experiment, index)
        r, g = task.rollout, task.grpo
        if cores:
            placement.pin_process(cores, xla_threads=XLA_CPU_THREADS.get(r.engine, 1))
        self.name = task.name
        self.channel = channel
        self.timeline = _timeline("engine", task.name)

        self.engine = make_engine(r.engine, task.model.path, dtype=task.model.dtype, max_prompt_len=g.max_prompt_len,
                                  max_new_tokens=g.max_new_tokens, max_batch_size=r.max_batch_size, weight_version=-1,
                                  seed=task.resolved_seed(cfg.experiment.seed, index), **r.engine_args)
        self._held = self.engine

    def version(self) -> int:
        return self.engine.weight_version

    def update_weights(self, message: WeightMessage) -> tuple[dict[str, int], list[dict]]:
        """Receive `message`'s params from the channel and swap them in; (swap stats, spans)."""
        with self.timeline.span("receive", bytes=message.nbytes):
            flat = self.channel.receive(message)
        with self.timeline.span("swap", bytes=message.nbytes) as span:
            stats = self.engine.update_weights(flat, message.version)
            span.update(stats or {})
        return dict(stats or {}), self.timeline.drain()

    def verify(self) -> str | None:
        """The checksum of the weights the engine holds now (hashed from the device, not cached
        across an onload)."""
        return self.engine.weight_checksum

    def generate(self, prompt_ids, params):
        return self.engine.generate(prompt_ids, params)

    def close(self) -> None:
        pass


# ---- where a role runs --------------------------------------------------------------------------------


class RemoteRole:
    """A role in another process, called like a local one: each method is one blocking round trip.

    Called from the task driver's worker thread (never its event loop), so blocking is harmless.
    """

    def __init__(self, handle, kind: str):
        self._handle, self.kind = handle, kind

    def __getattr__(self, name: str):
        import ray

        method = getattr(self._handle, name)

        def call(*args, **kwargs):
            try:
                return ray.get(method.remote(*args, **kwargs))
            except ray.exceptions.RayActorError as err:
                cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise RoleDied(f"its {self.kind} process died during {name}(): {cause}") from err

        return call

    @property
    def handle(self):
        return self._handle

    def terminate(self) -> None:
        """End the role's process (its owner ends it anyway when it exits; this frees it now)."""
        import ray

        ray.kill(self._handle, no_restart=True)


def spawn_local(cls, experiment: dict, index: int, *, channel: WeightChannel, **_placement):
    return cls(experiment, index, channel=channel)


def spawn_process(cls, experiment: dict, index: int, *, channel: WeightChannel, **_placement) -> RemoteRole:
    """Start `cls` in a Ray actor process of its own on the local Ray (started if it is not), with no
    placement group: for a role that must not share the caller's process (see
    workers.rollout.OWN_PROCESS_ENGINES) when the caller runs its task in-process."""
    from rlsched.experiment import init_ray

    init_ray()
    return spawn_ray(cls, experiment, index, channel=channel)


def spawn_ray(cls, experiment: dict, index: int, *, channel: WeightChannel, placement_group=None, bundle: int = 0,
              cores: list[int] | None = None, resource: str = "CPU") -> RemoteRole:
    """Start `cls` in a Ray actor process of its own, in `placement_group`'s bundle, pinned to `cores`.

    Its share of the bundle is nominal (1/100 of one unit): the bundle reserves the device, the
    pinning decides who uses which core, and several tasks' roles take turns on it under the locks.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options: dict[str, Any] = {"max_restarts": 0, "num_cpus": 0}
    options["num_gpus" if resource == "GPU" else "num_cpus"] = 0.01
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group, placement_group_bundle_index=bundle)
    handle = ray.remote(cls).options(**options).remote(experiment, index, channel=channel, cores=cores)
    return RemoteRole(handle, cls.kind)
