"""A task's two data-plane roles, the actor and the rollout engine, and how they are started.

    actor = spawn(ActorRole, spec, channel=channel, sites=None)     # in this process, or
    actor = spawn(ActorRole, spec, channel=channel, sites=where)    # a Ray actor process of its own,
                                                                         # in the group's bundle, pinned
Design decisions (and why):
- **One call per role per phase.** A phase's whole work is one method that returns its result, the
  spans it recorded and the role's memory probe: `EngineRole.rollout` (sync the weights if stale,
  verify, generate) and `ActorRole.train` (advantages, logprobs, updates, publish v+1). Under Ray that
  is one round trip each; nothing large passes through the driver (weights go through the task's comm
  channel, see rlsched.cluster.comm).
- **Each role is built where it runs, from the task's resolved spec** (`config.TaskSpec`), and pins its
  process to its devices *before* JAX starts, so XLA's thread pools are sized to those devices (on
  CPU a device is a core), unless its engine needs a bigger CPU pool (`XLA_CPU_THREADS`: sglang-jax
  deadlocks on one thread). A role's crash kills its own process only: the driver's call raises
  `RoleDied` naming the role and the call, and the other tasks never notice.
- **Models are made where weights live.** A task whose model is created from a preset gets it from
  its actor (`ActorRole.__init__`): the driver never imports JAX.
- **The engine starts at weight version -1.** It loads nothing the actor did not send: the first
  ROLLOUT syncs v0 through the comm channel, so the actor's weights are the only weights. It refuses to
  generate with weights older than the published version or whose checksum differs from the one the
  actor computed before they left.
- **Bytes are reported by kind after every move** (`onload()` returns them, `memory()` reads them)
  from the live arrays a role holds; the driver records them in its memory pool.
- This module imports neither the task driver nor the experiment: roles know their spec, their
  channel and where they run, nothing above them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path
from typing import Any

from rlsched.base.errors import RoleDied, TaskError
from rlsched.cluster import exits
from rlsched.cluster import pinning as pin
from rlsched.cluster.comm import WeightChannel, WeightMessage, make_channel
from rlsched.cluster.ray_cluster import RoleSites, enter_role_env, init_ray, own_process_resources, role_env
from rlsched.config.spec import TaskSpec, actor_settings
from rlsched.observe.timeline import STARTUP, Timeline


def lora_spec(spec: TaskSpec):
    """A LoRA task's adapter (workers.models.lora.LoraSpec) from its config, else None."""
    from workers.models.lora import LoraSpec

    section = spec.config.lora
    return None if section is None else LoraSpec(section.rank, section.alpha, tuple(section.targets))


def shares_base(spec: TaskSpec, kind: str) -> bool:
    """Whether a LoRA task's `kind` role reads its base group's one copy of the base (workers.shared_base): in a
    device group's process (cluster.processes per_device_group), a role within one host, on jax_sampler for an
    engine. Elsewhere each role loads its own copy, as a process of its own holds no other task's roles."""
    return (spec.config.lora is not None and spec.processes == "per_device_group" and spec.role_hosts(kind) == 1
            and (kind == "actor" or spec.config.rollout.engine == "jax_sampler"))


@dataclasses.dataclass(frozen=True)
class PhaseResult:
    """What one phase call of a role returns."""

    value: Any  # the phase's result: a RolloutOutput, or the train metrics
    events: list[dict]  # spans recorded inside the role (the driver stamps them with the lock held)
    memory: dict[str, int]  # the role's process RSS and device bytes after the phase (mem/<role>/...)
    message: WeightMessage | None = None  # TRAIN: the weights published after the update (v+1)


def role_mesh(spec: TaskSpec, kind: str):
    """The `jax.sharding.Mesh` of a task's role ("actor" or "engine") over its devices in this process
    (rlsched.config.meshes.role_devices: positions in the experiment's device pool)."""
    import jax

    from rlsched.config.meshes import local_role_devices, platform_kind
    from workers.models import sharding

    # The experiment checked the platform from Ray's resources (rlsched.config.meshes.check_platform); a TPU that Ray
    # did not announce is caught here, where JAX sees it.
    if platform_kind(jax.default_backend()) == "tpu" and spec.processes == "per_role" and spec.placement == "colocated":
        raise TaskError(f"task {spec.name}: its {kind} is a process of its own colocated on a TPU, whose chips open "
                        "in one process at a time; set cluster.processes=per_device_group")
    actor, rollout = spec.config.actor.mesh.as_dict(), spec.config.rollout.mesh.as_dict()
    shape = actor if kind == "actor" else rollout
    if jax.process_count() > 1 and spec.role_hosts(kind) > 1:  # a role across hosts (rlsched.cluster.rolegroup, or a
        # device group's processes, rlsched.cluster.group_process): the job's devices, in process order, so tp
        # (innermost) stays within a host (the config checks it)
        devices = jax.devices()
        if len(devices) != sharding.num_devices(shape):
            raise TaskError(f"task {spec.name}: its {kind}'s mesh ({sharding.describe(shape)}) needs "
                            f"{sharding.num_devices(shape)} devices; its group's {jax.process_count()} processes "
                            f"have {len(devices)}")
        return sharding.mesh(shape, devices)
    local = jax.local_devices()
    if spec.hosts > 1:  # a role within one host of a group across hosts (colocated): its host's first devices
        # (a process of its own beside a role group, or the first host of a device group across hosts)
        return sharding.mesh(shape, local[: sharding.num_devices(shape)])
    try:
        ids = local_role_devices(spec.placement, kind, spec.num_devices, len(local), actor, rollout)
    except ValueError as err:
        raise TaskError(f"task {spec.name}: {err} ({jax.default_backend()}; on CPU the pool comes from XLA_FLAGS="
                        "--xla_force_host_platform_device_count, which must be set before JAX starts)") from None
    return sharding.mesh(shape, [local[i] for i in ids])


class _Role:
    """What both roles do alike: move what they hold (`_held`: a worker with offload,
    onload and memory_bytes) and report its bytes."""

    kind = "role"
    _held: Any

    def offload(self) -> None:
        self._held.offload()

    def onload(self) -> dict[str, int]:
        self._held.onload()
        return self.memory()

    def memory(self) -> dict[str, int]:
        return self._held.memory_bytes()

    def where(self) -> dict[str, Any]:
        """The process holding the role and its mesh's device ids: {"pid": ..., "devices": [...]}."""
        import os

        return {"pid": os.getpid(), "devices": self.device_ids()}

    def device_ids(self) -> list[int]:
        """The ids of the devices the role's mesh uses (empty for an engine that lays itself out)."""
        mesh = getattr(self._held, "mesh", None)
        return [] if mesh is None else [int(d.id) for d in mesh.devices.flat]

    def memory_probe(self) -> dict[str, int]:
        """This process's RSS and device bytes, named `mem/<kind>/...` (see rlsched.observe.memprobe), and what the
        role itself holds per device by kind, `mem/<kind>/held/<params|opt|ref|kv>` (the plan's numbers)."""
        from rlsched.observe.memprobe import memory_metrics

        held = {f"mem/{self.kind}/held/{k}": v for k, v in self.memory().items()}
        shared = getattr(self._held, "shared_bytes", None)  # a shared base: held once in the process, not per task
        if shared is not None and (base := shared()):
            held[f"mem/{self.kind}/held/base"] = base
        return memory_metrics(prefix=f"mem/{self.kind}") | held

    def close(self) -> None:
        pass


class ActorRole(_Role):
    """The task's JAX actor worker (params, optimizer state, reference params) and its checkpoints."""

    kind = "actor"

    def __init__(self, spec: TaskSpec, *, channel: WeightChannel, cores: pin.CoreShare | list[int] | None = None,
                 env: dict[str, str] | None = None):
        self.timeline = Timeline("actor", task=spec.name)  # first: the role's startup is spans of it (STARTUP)
        started = self.timeline.now()
        enter_role_env(env)  # before anything reads it: JAX, and exits.watch
        exits.watch()  # in a process of its own: a death is told by how it happened
        if cores:
            pin.pin_process(cores)  # before JAX creates its thread pools
        from rlsched.cluster import compile_cache
        from rlsched.run.checkpoints import TaskCheckpointer
        from workers.actor import ActorWorker
        from workers.models import init_model, load_pretrained

        compile_cache.enable(spec.compile_cache)
        self.timeline.add_span("imports", started, self.timeline.now(), phase=STARTUP)
        m = spec.config.model
        self.spec = spec
        with self.timeline.span("devices", phase=STARTUP):  # JAX's backend (at its first use in the process), the mesh
            mesh = role_mesh(spec, "actor")
        with self.timeline.span("load_model", phase=STARTUP):  # read (or made first, for a preset without files)
            _make_preset_model(m, init_model, across=spec.role_hosts("actor") > 1)
            shared = shares_base(spec, "actor")  # one copy of the base in this process for its base group
            if shared:
                from workers import shared_base  # (workers.shared_base)

                lease = shared_base.acquire(m.path, dtype=m.dtype, mesh=mesh)
            else:
                model, _ = load_pretrained(m.path, dtype=m.dtype, with_tokenizer=False)
        with self.timeline.span("build_worker", phase=STARTUP):  # on its devices: weights, optimizer, reference
            if shared:
                self.worker = ActorWorker(None, actor_settings(spec.config), seed=spec.seed, mesh=mesh,
                                          lora=lora_spec(spec), base=lease)
            else:
                self.worker = ActorWorker(model, actor_settings(spec.config), seed=spec.seed, mesh=mesh,
                                          lora=lora_spec(spec), offload_reference=spec.config.actor.offload_reference)
        self.channel = channel
        self.checkpointer = TaskCheckpointer(spec.checkpoint_dir, max_to_keep=spec.config.keep_last,
                                             background=spec.config.checkpoint_async)
        self._held = self.worker
        self._published_checksum: str | None = None
        self._advantage_programs: dict[int, Any] = {}  # rows -> `_advantages`' compiled program

    def offload(self) -> None:
        """Offload; weights published and not yet received stay readable from their host copies
        (rlsched.cluster.comm)."""
        self.channel.follow(self.worker.version, self._moved(self.worker.offload))

    def onload(self) -> dict[str, int]:
        self.channel.follow(self.worker.version, self._moved(self.worker.onload))
        return self.memory()

    def _moved(self, move):
        def moved():
            move()
            return self.worker.params_flat()

        return moved

    def start(self, resume: bool) -> tuple[dict[str, Any] | None, WeightMessage]:
        """Restore the latest checkpoint when resuming (its meta, or None without one), then publish the
        weights the engine must hold before it generates."""
        meta = None
        if resume:
            with self.timeline.span("restore", phase=STARTUP):
                meta = self.restore_latest()
        return meta, self._publish()

    def train(self, batch, rewards, step: int, together=None) -> PhaseResult:
        """TRAIN: group advantages from `rewards` (N,), logprobs and the GRPO updates of one step, then
        publish v+1. `together` (workers.rollout.base.Together): this task shares its hold with others whose update
        is the same program, and its optimizer steps run with theirs as one (workers.actor_cobatch)."""
        import numpy as np

        with self.timeline.span("train", samples=batch.size):
            try:
                advantages, tied = self._advantages(len(rewards))(np.asarray(rewards, np.float32))
                tied = float(tied)
            except BaseException:
                if together is not None:  # the hold's other members must not wait for an update that will not come
                    self.worker.withdraw(together)  # (a failure inside train is the worker's: it withdraws itself)
                raise
            kwargs = {} if together is None else {"together": together}
            metrics = self.worker.train(batch.with_advantages(advantages), step=step, timeline=self.timeline,
                                        **kwargs)
            metrics["tied_groups"] = tied  # groups whose rewards all tie: advantage 0, no signal
        before = self._published_checksum
        message = self._publish()
        # `moved`: the served weights must differ (workers.actor.ActorWorker._moved). A bfloat16 model trains a
        # float32 master, whose steps may rightly leave every bfloat16 weight as it was: it never says so then.
        if metrics.pop("moved") and message.checksum == before:
            raise TaskError(f"task {self.spec.name}: step {step}'s update left every parameter as it was "
                            f"(v{message.version} hashes like v{message.version - 1}); the update did not reach the "
                            "weights (an optimizer or freeze mask whose updates are all zero?)")
        return PhaseResult(metrics, self.timeline.drain(), self.memory_probe(), message=message)

    def prepare(self, size: int, length: int) -> tuple[int, list[dict]]:
        """Compile TRAIN's programs for a batch of `size` rows of `length` tokens, before the lock is asked for
        (the state may be on host); (programs compiled now, spans: a "compile" span if any was)."""
        def compile_all() -> int:
            fresh = size not in self._advantage_programs
            self._advantages(size)
            return self.worker.prepare(size, length, cohort=self.spec.train_cohort) + fresh

        return _compile_span(self.timeline, compile_all, samples=size, length=length)

    def _advantages(self, size: int):
        """The compiled workers.grpo.step_advantages of `size` rewards (float32 on the host) -> (advantages, tied
        groups). jnp, not numpy: the math is the jitted kind everywhere (numpy's float32 sums round differently);
        one program, compiled by `prepare`: run eagerly, its dozen operations each compiled at the first step, inside
        the TRAIN lock (0.4 s on a CPU)."""
        if size not in self._advantage_programs:
            import jax
            import numpy as np

            from workers.grpo import step_advantages

            g = self.spec.config.grpo
            program = jax.jit(functools.partial(step_advantages, group_size=g.num_generations,
                                                normalize_std=g.normalize_advantage_std, std_ddof=g.advantage_std_ddof))
            self._advantage_programs[size] = program.lower(jax.ShapeDtypeStruct((size,), np.float32)).compile()
        return self._advantage_programs[size]

    def _publish(self) -> WeightMessage:
        """Send the current params (never the optimizer state) into the task's comm channel."""
        with self.timeline.span("publish") as span:
            snapshot = self.worker.export_weights()
            message = self.channel.send(snapshot.flat, snapshot.version, snapshot.checksum)
            span["bytes"] = message.nbytes
        self._published_checksum = message.checksum
        return message

    def publish(self) -> tuple[WeightMessage, list[dict]]:
        """Publish the current weights again (e.g. for a new engine); (message, spans)."""
        return self._publish(), self.timeline.drain()

    def save(self, step: int, meta: dict[str, Any]) -> None:
        self.checkpointer.save(step, self.worker.state, {**meta, "version": self.worker.version})

    def restore_latest(self) -> dict[str, Any] | None:
        """Restore the latest checkpoint's state and version; its meta, or None if there is none."""
        if self.checkpointer.latest_step() is None:
            return None
        state, meta = self.checkpointer.restore(self.worker.state)
        self.worker.state, self.worker.version = state, int(meta["version"])
        return meta

    def close(self) -> None:
        self.checkpointer.close()
        self.channel.close()  # a local channel's slot holds our last published weights
        self.worker.release()  # a shared base's lease: the group's last holder frees the base


def _make_preset_model(m, init_model, *, across: bool) -> None:
    """Create the task's preset model if its directory has none. In a group across hosts (`across`) process 0
    writes it and the others wait for it (a shared filesystem); a host that still cannot see it makes the same
    model itself (same preset, same seed: the same weights). An actor within one host makes it alone, even in a
    process of a JAX job across hosts (rlsched.cluster.group_process): the other processes take no part in its calls."""
    import jax

    missing = lambda: m.init_preset is not None and not (Path(m.path) / "config.json").is_file()  # noqa: E731
    if across and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        from workers.multihost import is_primary

        if is_primary() and missing():
            _create_once(m, init_model, missing)
        multihost_utils.sync_global_devices(f"model {m.path}")
    if missing():
        _create_once(m, init_model, missing)


def _create_once(m, init_model, missing) -> None:
    """Create the preset model under a lock beside it: tasks that share one base (LoRA tasks of a base group) start
    at once, and the second would otherwise replace the directory the first just wrote while a third reads it."""
    import fcntl

    path = Path(m.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        if missing():  # another task made it while this one waited
            init_model(m.path, preset=m.init_preset, seed=m.init_seed)


class EngineRole(_Role):
    """The task's rollout engine, holding only weights that arrived through the comm channel."""

    kind = "engine"

    def __init__(self, spec: TaskSpec, *, channel: WeightChannel, cores: pin.CoreShare | list[int] | None = None,
                 env: dict[str, str] | None = None):
        self.timeline = Timeline("engine", task=spec.name)  # first: the role's startup is spans of it (STARTUP)
        started = self.timeline.now()
        enter_role_env(env)  # before anything reads it: JAX, and exits.watch
        from workers.rollout import XLA_CPU_THREADS, make_engine

        exits.watch()  # in a process of its own: a death is told by how it happened
        r, g = spec.config.rollout, spec.config.grpo
        if cores:
            pin.pin_process(cores, xla_threads=XLA_CPU_THREADS.get(r.engine, 1))
        from rlsched.cluster import compile_cache

        compile_cache.enable(spec.compile_cache)
        self.timeline.add_span("imports", started, self.timeline.now(), phase=STARTUP)
        self.name = spec.name
        self.channel = channel
        # Only jax_sampler lays itself out on a mesh so far (the config refuses a mesh for the others), and only it
        # pads prompts as grpo.prompt_padding says (the others pad their own way; the train batch follows the key).
        # Its decode attention is a setting of a LoRA base group's shared sampler too, hence taken out of the rest.
        engine_args = dict(r.engine_args)
        with self.timeline.span("devices", phase=STARTUP):  # JAX's backend (at its first use in the process), the mesh
            mesh = role_mesh(spec, "engine") if r.engine == "jax_sampler" else None
        jax_args = ({"mesh": mesh, "prompt_padding": g.prompt_padding,
                     "decode_attention": engine_args.pop("decode_attention", "auto")}
                    if r.engine == "jax_sampler" else {})
        self._view = shares_base(spec, "engine")
        with self.timeline.span("make_engine", phase=STARTUP):  # its model read and placed on its devices
            if self._view:  # a slot of its base group's engine in this process (workers.rollout.shared_engine)
                from workers.rollout.shared_engine import open_view

                self.engine = open_view(spec.config.model.path, dtype=spec.config.model.dtype, spec=lora_spec(spec),
                                        max_prompt_len=g.max_prompt_len, max_new_tokens=g.max_new_tokens,
                                        max_batch_size=r.max_batch_size, seed=spec.seed, weight_version=-1, **jax_args)
            else:
                self.engine = make_engine(r.engine, spec.config.model.path, dtype=spec.config.model.dtype,
                                          max_prompt_len=g.max_prompt_len, max_new_tokens=g.max_new_tokens,
                                          max_batch_size=r.max_batch_size, weight_version=-1, seed=spec.seed,
                                          lora=lora_spec(spec), **jax_args, **engine_args)
        self._held = self.engine

    def close(self) -> None:
        if self._view:
            self.engine.close()  # its slot; the group's last view gives the base back

    def rollout(self, message: WeightMessage, prompt_ids, params, together=None) -> PhaseResult:
        """ROLLOUT: bring the engine up to `message`'s weights if it is behind, verify them, generate. `together`
        (workers.rollout.base.Together): this task shares its hold with others of its base group, and its rows
        run in one program run with theirs (a slot of the group's shared engine; other engines run alone)."""
        together = together if self._view else None
        try:
            if self.version() != message.version:
                self.update_weights(message)  # its stats ride on its "sync_weights" span
            elif hasattr(self.engine, "restore_weights"):  # weights left on host by a lazy onload come back now
                with self.timeline.span("restore_weights") as span:
                    span["bytes"] = self.engine.restore_weights()
            self._check(message)
        except BaseException:
            if together is not None:  # the hold's other tasks must not wait for rows that will not come (a failure
                self.engine.withdraw(together)  # inside generate is the engine's: it withdraws itself, once)
            raise
        output = self._generate(prompt_ids, params, together)
        return PhaseResult(output, self.timeline.drain(), self.memory_probe())

    def evaluate(self, message: WeightMessage, prompt_ids, params, together=None) -> PhaseResult:
        """A held-out evaluation under the ROLLOUT lock: `rollout` of the evaluation's prompts, alone. In a hold
        co-batched with its base group's tasks (`together`), this task's slot withdraws first: the others' rows
        run without waiting for these (rlsched.run.evaluation)."""
        if together is not None and self._view:
            self.engine.withdraw(together)
        return self.rollout(message, prompt_ids, params)

    def prepare(self, prompt_ids, params) -> tuple[int, list[dict]]:
        """Compile ROLLOUT's programs for these prompts, before the lock is asked for (the weights may be on
        host); (programs compiled now, spans: a "compile" span if any was)."""
        return _compile_span(self.timeline, lambda: self.engine.prepare(prompt_ids, params), prompts=len(prompt_ids))

    def version(self) -> int:
        return self.engine.weight_version

    def update_weights(self, message: WeightMessage) -> dict[str, int]:
        """Receive `message`'s params from the channel and swap them in; the swap's stats."""
        with self.timeline.span("sync_weights", bytes=message.nbytes) as sync:
            with contextlib.ExitStack() as receiving:  # the actor moves none of the arrays while we copy them
                with self.timeline.span("receive", bytes=message.nbytes) as received:
                    flat = receiving.enter_context(self.channel.receiving(message))
                    received.update(_where(flat))
                with self.timeline.span("swap", bytes=message.nbytes) as span:
                    from workers.models.params import WeightMismatchError  # JAX: this is the engine's process

                    before = self.version()
                    try:  # staged, then verified against what the actor hashed before sending
                        stats = dict(self.engine.update_weights(flat, message.version, checksum=message.checksum)
                                     or {})
                    except WeightMismatchError as err:
                        raise TaskError(f"task {self.name}: the weights received for v{message.version} were "
                                        f"refused (the engine holds v{self.version()}, it held v{before}): "
                                        f"{err}") from err
                    span.update(stats)
            sync.update(stats)
        return stats

    def _check(self, expected: WeightMessage) -> None:
        """The engine holds exactly the weights `expected` announced (version and checksum), or a TaskError."""
        if self.version() != expected.version:
            raise TaskError(f"task {self.name}: the engine holds weights v{self.version()} but the actor published "
                            f"v{expected.version}; refusing to generate with stale weights")
        if self.verify() != expected.checksum:
            raise TaskError(f"task {self.name}: engine checksum differs from the actor's published "
                            f"v{expected.version}; refusing to generate with unverified weights")

    def verify(self) -> str | None:
        """The checksum of the weights the engine holds now (hashed from the device, not cached
        across an onload)."""
        with self.timeline.span("verify"):
            return self.engine.weight_checksum

    def generate(self, prompt_ids, params, *, expected: WeightMessage, together=None):
        """Generate, but only with exactly the weights `expected` announced: same version, same checksum."""
        self._check(expected)
        return self._generate(prompt_ids, params, together)

    def _generate(self, prompt_ids, params, together):
        with self.timeline.span("generate") as span:
            output = (self.engine.generate(prompt_ids, params) if together is None
                      else self.engine.generate(prompt_ids, params, together=together))
            span["tokens"] = output.num_tokens
            if output.cobatched > 1:
                span["cobatched"] = output.cobatched  # tasks whose rows ran in this one program run
        return output


def _where(flat) -> dict[str, str]:
    """{"from": "device" | "host"}: where the weights received lie (host: an actor offloaded since it published)."""
    from workers.offload import on_device

    leaf = next(iter(flat.values()), None)
    on = leaf is not None and hasattr(leaf, "sharding") and on_device(leaf)
    return {"from": "device" if on else "host"}


def _compile_span(timeline: Timeline, compile_, **attrs) -> tuple[int, list[dict]]:
    """Run a role's prepare; a "compile" span when it compiled programs, or waited for another task's compile of
    them in this process (`shared_wait_s`: workers.compiling.shared), so the trace puts that time on a compile."""
    from workers.compiling import waits

    start = timeline.now()
    with waits() as waited:
        compiled = compile_()
    if compiled or waited["seconds"]:
        extra = {"shared_wait_s": waited["seconds"]} if waited["seconds"] else {}
        timeline.add_span("compile", start, timeline.now(), programs=compiled, **extra, **attrs)
    return compiled, timeline.drain()


# ---- where a role runs --------------------------------------------------------------------------------


class RemoteRole:
    """A role in another process, called like a local one: each method is one blocking round trip.

    `built`: the ref of the role's `build` call (its constructor, see `_built_by_call`), which runs in the
    background from `spawn`; the first call waits for it, and raises its error as the role's own."""

    def __init__(self, handle, kind: str, built=None, timeout_s: float | None = None):
        self._handle, self.kind = handle, kind
        self._built, self._never_built = built, False
        self._timeout_s = timeout_s  # cluster.call_timeout_s: no call waits longer

    def _get(self, ref, name: str):
        import ray

        try:
            return ray.get(ref, timeout=self._timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TaskError(f"its {self.kind}'s {name}() did not answer in {self._timeout_s:g} s "
                            "(cluster.call_timeout_s): its process may hang; raise the timeout if the call is a "
                            "compile of a large model") from None

    def wait_built(self) -> None:
        """Wait for the role's build (if it may still run); raise its error, once."""
        import ray

        if self._built is None:
            return
        ref, self._built = self._built, None
        try:
            self._get(ref, "build")
        except ray.exceptions.RayTaskError:  # the constructor raised: its error, whose `cause` is the role's own
            self._never_built = True
            raise
        except ray.exceptions.RayActorError as err:
            raise RoleDied(f"its {self.kind} process died while the role was built: {exits.death_cause(err)}",
                           self.kind) from err

    def __getattr__(self, name: str):
        import ray

        if name.startswith("_"):
            raise AttributeError(name)
        method = getattr(self._handle, name)

        def call(*args, **kwargs):
            if name == "close":  # a role whose constructor raised holds nothing: its error was told already
                with contextlib.suppress(ray.exceptions.RayTaskError):
                    self.wait_built()
                if self._never_built:
                    return None
            self.wait_built()
            if self._never_built:
                raise TaskError(f"its {self.kind} was never built: its constructor raised (the error before this)")
            try:
                return self._get(method.remote(*args, **kwargs), name)
            except ray.exceptions.RayActorError as err:
                cause = exits.death_cause(err)
                raise RoleDied(f"its {self.kind} process died during {name}(): {cause}", self.kind) from err

        return call

    @property
    def handle(self):
        return self._handle

    def fence_target(self):
        """What the scheduler stops if it must fence this role's task: its process."""
        from rlsched.scheduling.fencing import Target

        return Target(self.kind, self._handle)

    def terminate(self) -> None:
        """End the role's process now (its owner would end it when it exits)."""
        import ray

        ray.kill(self._handle, no_restart=True)


def channel_for(spec: TaskSpec, sites: RoleSites | None, kind: str | None = None) -> WeightChannel:
    """The task's comm channel: in memory when both roles share a process (this one, or a colocated group's
    host), else Ray's object store."""
    local = not _own_process(spec) and (sites is None or sites.one_process)
    return make_channel(kind or ("local" if local else "object_store"), spec.comm_group)


def _own_process(spec: TaskSpec) -> bool:
    from workers.rollout import OWN_PROCESS_ENGINES  # a name table; imports no engine

    return spec.config.rollout.engine in OWN_PROCESS_ENGINES


def spawn(cls, spec: TaskSpec, *, channel: WeightChannel, sites: RoleSites | None, take_port=None):
    """Start role `cls` for `spec`: in this process (`sites` None), except an engine that must have a
    process of its own (workers.rollout.OWN_PROCESS_ENGINES); in its device group's process (`sites.processes`,
    rlsched.cluster.group_process); as a group of one process per host when its mesh spans hosts
    (rlsched.cluster.rolegroup; `take_port(role, host, busy)` gives its coordinator port); or as a Ray actor of its own
    in `sites`."""
    from rlsched.cluster.rolegroup import RoleGroup, spans_hosts

    own = cls is EngineRole and _own_process(spec)  # an engine that must have a process of its own (sglang-jax)
    if sites is not None and sites.processes is not None and not own:  # beside the group's process if `own`
        from rlsched.cluster.group_process import GroupProcesses, GroupProcessesRole, GroupProcessRole

        host = sites.processes[cls.kind]
        if isinstance(host, GroupProcesses):  # a device group across hosts: a role spanning them is built in each
            if spans_hosts(spec, cls.kind):
                return GroupProcessesRole.launch(host, cls, spec, channel)
            # a role within one host: the first host's devices (a death of another host breaks it too)
            return GroupProcessRole.launch(host.first, cls, spec, channel, group=host)
        return GroupProcessRole.launch(host, cls, spec, channel)
    if spans_hosts(spec, cls.kind):
        if sites is None or take_port is None:
            raise TaskError(f"task {spec.name}: its {cls.kind}'s mesh spans hosts (cluster.hosts {spec.hosts}), which "
                            "needs a Ray cluster: run without --in-process")
        return RoleGroup.launch(cls, spec, channel=channel, sites=sites, take_port=take_port,
                                bundles=sites.host_bundles[: spec.role_hosts(cls.kind)])
    if sites is None and not own:
        return cls(spec, channel=channel)
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # Its share of the bundle is nominal (1/100 of one unit): the bundle reserves the device, the
    # pinning decides who uses which core, and several tasks' roles take turns on it under the locks.
    options: dict[str, Any] = {"max_restarts": 0, "num_cpus": 0}
    cores, resource = None, "CPU"
    if sites is None:
        init_ray()  # an in-process run whose engine needs a process of its own: the local Ray
    else:
        resource = sites.resource
        options |= own_process_resources(resource, sites.bundle_devices[cls.kind])
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            sites.placement_group, placement_group_bundle_index=sites.bundles[cls.kind])
        cores = sites.cores[cls.kind]
    # A role on an rlsched mesh sees the pool and takes its devices from it (role_mesh); an engine that lays
    # itself out (sglang-jax fills its mesh with every device it sees) sees one: its own.
    on_mesh = cls is ActorRole or spec.config.rollout.engine == "jax_sampler"
    env = role_env(spec.num_devices if on_mesh else 1, resource, shares_devices=spec.shares_devices)
    handle = ray.remote(_built_by_call(cls)).options(**options).remote()
    return RemoteRole(handle, cls.kind, built=handle.build.remote(spec, channel=channel, cores=cores, env=env),
                      timeout_s=spec.call_timeout_s)


@functools.cache
def _built_by_call(cls):
    """`cls` as a Ray actor class whose constructor is a method, `build(*args, **kwargs)`.

    Why: an exception a Ray actor's constructor raises reaches the caller only as text (an ActorDiedError whose
    message holds Ray's ANSI-coloured `ray::ActorRole.__init__()` line and the traceback; the exception itself
    is dropped), while one a method raises arrives as a RayTaskError whose `cause` is the original exception:
    its own type and message, as a role built in a device group's process (rlsched.cluster.group_process) reports
    it. The process starts with an empty constructor; `build` runs the role's, in the background (calls queue
    behind it)."""
    def __init__(self):
        pass

    def build(self, *args, **kwargs) -> None:
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "build": build, "__module__": cls.__module__,
                                       "__doc__": cls.__doc__})
