"""Experiment configuration: frozen pydantic models, loaded from YAML, with errors that name the field.

One experiment runs many GRPO tasks; each `TaskConfig` is self-contained (model, data, reward,
rollout, GRPO, optimizer, step counts), so a task can be added or removed without touching the
others. `ClusterConfig` is the only shared section.

Design decisions:
- Frozen and `extra="forbid"`: a config is read once and never mutated; a misspelt key is an error
  (with a "did you mean" suggestion), never a silently ignored setting that wrecks a reward curve.
- Strict validation: the value in the file is the value used (`steps: "10"` or `steps: true` is an
  error, not a coercion). YAML is read with YAML 1.2 float rules so `lr: 1e-6` is a float; PyYAML's
  default (YAML 1.1) reads it as the string "1e-6".
- Every error line reads `<file>: <field.path>: <message> (got <value>)`: the path is what you
  would pass to `--set`, so the fix is one edit away.
- Batch arithmetic (samples per step, mini/micro batches, optimizer and warmup steps) is derived
  once, at load, in `BatchPlan`: a config whose batches do not divide fails before any model loads,
  and the trainer logs `BatchPlan.describe()` instead of recomputing it.
- Overrides (`--set tasks.0.grpo.beta=0.04`) edit the raw YAML dict before validation, so an
  overridden value goes through exactly the same checks and messages as one from the file.
- Engine-specific knobs live in `rollout.engine_args`, passed through untouched: the config does
  not copy every engine's settings field by field.
- Meshes (`actor.mesh`, `rollout.mesh`) are checked here against what needs no file: device counts
  against `cluster.num_devices` and batch sizes against dp x fsdp. Whether a mesh splits the *model*
  needs its config.json, so that check is `rlsched.config.meshes.check_meshes`, run before any process starts.
- No jax/ray imports: the CLI validates a config in milliseconds.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from workers.models import sharding
from workers.rollout import OWN_PROCESS_ENGINES

# `rlsched init-model` presets (workers.models.presets.PRESETS, which a test holds equal): named here so the
# CLI and the config check them without importing the model code.
MODEL_PRESETS = ("tiny", "small", "tiny-qwen2", "small-qwen2", "tiny-qwen3moe", "small-qwen3moe")


def comm_group_name(experiment: str, task: str, src: str = "actor", dst: str = "rollout") -> str:
    """The name of a task's weight channel (rlsched.cluster.comm): one per (experiment, task, direction)."""
    return f"{experiment}/{task}/{src}->{dst}"


class ConfigError(ValueError):
    """A config rlsched cannot run; the message names the file, the field path and the value."""


class _FieldError(ValueError):
    """Raised by cross-field validators to point at one field (relative to the model) and its value."""

    def __init__(self, field: str, value: Any, message: str):
        super().__init__(message)
        self.field, self.value = tuple(field.split(".")), value


def _check_name(name: str) -> str:
    # Names become directories (runs/<experiment>/tasks/<task>) and comm-group names.
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (".", ".."):
        raise ValueError("must be letters, digits, '_', '.' or '-' (it names a directory)")
    return name


Name = Annotated[str, AfterValidator(_check_name)]
_SYNTHETIC_KINDS = ("addition", "subtraction")


class _Section(BaseModel):
    # Fields are documented by the string under each (read by `field_doc`). pydantic's
    # use_attribute_docstrings would read them at import, ~0.15 s of CPU in every process that unpickles a
    # TaskSpec (each role process, driver and scheduler): time every task's start pays for nothing.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


def field_doc(section: type[BaseModel], name: str) -> str | None:
    """The docstring written under field `name` of a config section (or of the section it extends), or None."""
    import ast
    import inspect
    import textwrap

    for cls in section.__mro__:
        if cls is BaseModel or not issubclass(cls, BaseModel):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for stmt, after in zip(body, body[1:], strict=False):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                return inspect.cleandoc(after.value.value)
    return None


class TrackingSection(_Section):
    wandb: bool = False
    """Also log to Weights & Biases: one run per task and one for the scheduler, grouped by experiment."""
    project: str = "rlsched"
    """W&B project the runs belong to."""
    mode: Literal["offline", "online", "disabled"] | None = None
    """W&B mode; None = the `WANDB_MODE` environment variable, else `offline` (sync later with `wandb sync`)."""
    tags: list[str] = Field(default_factory=list)
    """W&B tags added to every run of the experiment."""


class ExperimentSection(_Section):
    name: Name
    """Experiment name; the run directory is `<output_dir>/<name>`."""
    output_dir: str = "runs"
    """Directory (relative to the working directory) that holds one sub-directory per experiment."""
    seed: int = 0
    """Base seed; a task without its own seed gets `seed + task index`."""
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    """Where metrics go besides each task's metrics.jsonl (always written)."""


class ClusterConfig(_Section):
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """`colocated`: a task's actor and engine share devices; `disaggregated`: separate rollout and train pools."""
    num_devices: int | None = Field(None, ge=1)
    """Devices of the experiment's pool, which every role's mesh takes its devices from (on CPU: the XLA host
    devices each role process gets; rlsched sets the XLA flag itself). None = exactly what the meshes need:
    colocated, the largest mesh of any task; disaggregated, the largest rollout mesh plus the largest actor mesh."""
    hosts: int = Field(1, ge=1)
    """Hosts per device group. With more than one, `num_devices` is the devices of each host and a task's actor
    mesh may span hosts (a multiple of num_devices devices): it runs as one process per host joined into one JAX
    job (docs/hosts.md). Its engine and every other mesh stay within one host."""
    memory_budget_gb: float | None = Field(None, gt=0)
    """Memory budget of each device, in GiB (a role on an n-device mesh holds its share on each); None = unlimited."""
    lease_timeout_s: float = Field(600.0, gt=0)
    """Longest a task may hold one phase's lock, in seconds, its first hold included (programs compile before a
    lock is asked for); a holder past it is fenced (its roles stopped; in a device group's process, that
    process is ended and restarted, and the other tasks there rebuilt) and fails, and only then does the lock
    pass on."""
    call_timeout_s: float = Field(3600.0, gt=0)
    """Longest wait for one call to a role in another process (building it, compiling, a phase's work), in
    seconds: a call past it fails its task, naming the role and the call, instead of waiting forever on a process
    that hangs outside any lock (inside a lock, `lease_timeout_s` fences it first). Raise it for compiles of very
    large models."""
    processes: Literal["auto", "per_role", "per_device_group"] = "auto"
    """Which processes hold the roles. `per_device_group`: one process per host for each device group, holding
    every task's roles there and swapping them between device and host (what a TPU needs: a chip opens in one
    process; on a GPU, memory freed in one process is free for the next task). An engine that needs a process of
    its own (sglang_jax) gets one beside it. `per_role`: each task's actor and engine in a process of its own
    (roles that time-share devices are then several processes on one device: CPU, and GPU with rlsched turning
    XLA's preallocation off), so a role's crash ends its own process only. `auto`: per_device_group on every
    platform (docs/design.md, "Device groups and who owns a device")."""
    policy: Literal["fifo", "priority", "fair"] = "fifo"
    """Which waiting task a free lock goes to: `fifo` the one that asked first; `priority` the highest
    `tasks[i].priority`; `fair` the one with the least lock time on that phase per unit of `tasks[i].weight`
    (weighted fair share). Locks pass only at phase boundaries, never mid-phase."""
    starvation_limit: int = Field(8, ge=1)
    """A request passed over this many times is served before any other (oldest first): in every policy a task
    waits at most starvation_limit + N - 1 grants of a lock, N the tasks sharing it (rlsched/scheduling/policy.py)."""
    compile_cache_dir: str | None = ".jax_cache"
    """JAX's persistent compilation cache, shared by every role process of every experiment that names it:
    a program compiled once (by any task with the same shapes, in any run) is loaded, not compiled again.
    Relative to experiment.output_dir; null = off. A JAX_COMPILATION_CACHE_DIR in the environment wins."""


class ModelSection(_Section):
    path: str
    """Hugging Face Qwen3 directory (config.json, safetensors, tokenizer.json)."""
    init_preset: Literal[MODEL_PRESETS] | None = None
    """If set and `path` has no config.json, the trainer creates a random model of this preset there (demos)."""
    init_seed: int = 0
    """Seed of that random initialisation."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype on device."""


class DataSection(_Section):
    kind: Literal["jsonl", "parquet", "gsm8k", "addition", "subtraction"]
    """Prompt source: files (jsonl/parquet/gsm8k) or a synthetic generator (addition/subtraction)."""
    path: str | None = None
    """Dataset file; required for jsonl/parquet, must be absent for synthetic kinds; for gsm8k, None = the
    GSM8K train split shipped with rlsched (workers/datasets/gsm8k, MIT)."""
    question_field: str = "question"
    """Record field holding the prompt text."""
    answer_field: str = "answer"
    """Record field holding the reference answer given to the reward."""
    template: Literal["auto", "chat", "plain"] = "auto"
    """Prompt formatting: `chat` applies the tokenizer's chat template, `plain` uses the text; `auto` picks."""
    system_prompt: str | None = None
    """System message for chat templates; None = none."""
    shuffle: bool = True
    """Shuffle prompts each epoch (with the task seed)."""
    max_operand: int = Field(9, ge=1)
    """Largest operand of synthetic arithmetic problems (synthetic kinds only)."""
    too_long: Literal["error", "skip", "truncate"] = "error"
    """A prompt longer than grpo.max_prompt_len tokens: `error` fails the task naming it; `skip` draws the next
    prompt in its place (metric data/skipped_too_long); `truncate` keeps its last max_prompt_len tokens, where
    the question and the opened assistant turn are (metric data/truncated)."""

    @model_validator(mode="after")
    def _path_matches_kind(self) -> DataSection:
        if self.kind in _SYNTHETIC_KINDS and self.path is not None:
            # A path here usually means the wrong kind was chosen; ignoring it would hide that.
            raise _FieldError("path", self.path, f"synthetic kind {self.kind!r} reads no file; remove data.path")
        if self.kind in ("jsonl", "parquet") and self.path is None:
            raise _FieldError("path", None, f"data.path is required when data.kind is {self.kind!r}")
        return self


class RewardSection(_Section):
    name: str | None = None
    """A built-in reward (workers/rewards.py): addition, subtraction, gsm8k, gsm8k_flexible. Or give `function`."""
    function: str | None = None
    """Your own reward: `pkg.module:fn` (an importable module), or with `file` the function's name in that file.
    Called as fn(completion: str, answer: str) -> float (docs/rewards.md)."""
    file: str | None = None
    """Python file that defines `function`; a relative path is relative to the config file's directory."""
    batch: bool = False
    """`function` scores a whole step at once: fn(completions: list[str], answers: list[str]) -> list[float]."""
    on_error: Literal["fail", "zero"] = "fail"
    """When the reward function raises: `fail` stops the task, `zero` scores the sample 0."""

    @model_validator(mode="after")
    def _one_reward(self) -> RewardSection:
        # The function is imported by the preflight (rlsched.config.preflight), not here: a config loads without it.
        if (self.name is None) == (self.function is None):
            both = self.name is not None
            raise _FieldError("name" if both else "function", self.name if both else None,
                              ("give reward.name or reward.function, not both" if both else
                               "give reward.name (a built-in: addition, subtraction, gsm8k, gsm8k_flexible) or "
                               "reward.function (your own, 'pkg.module:fn' or a name in reward.file)"))
        if self.name is not None and (self.file is not None or self.batch):
            key = "file" if self.file is not None else "batch"
            raise _FieldError(key, getattr(self, key), f"reward.{key} goes with reward.function, not a built-in name")
        if self.function is not None:
            if self.file is None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", self.function):
                raise _FieldError("function", self.function, "must be 'pkg.module:fn' (an importable module), or "
                                  "a function name with reward.file naming the Python file that defines it")
            if self.file is not None and not self.function.isidentifier():
                raise _FieldError("function", self.function, "with reward.file, the name of a function in that "
                                  "file, e.g. 'exact'")
        return self


class MeshSection(_Section):
    """A role's device mesh, dp x fsdp x ep x tp devices (how each array splits: workers.models.sharding)."""

    dp: int = Field(1, ge=1)
    """Data parallel: batch rows split over it, parameters replicated."""
    fsdp: int = Field(1, ge=1)
    """Fully sharded data parallel: batch rows and the parameters' embed dimension split over it."""
    ep: int = Field(1, ge=1)
    """Expert parallel (models with experts, e.g. Qwen3-MoE): the experts split over it, and batch rows too."""
    tp: int = Field(1, ge=1)
    """Tensor parallel: vocab, attention heads and MLP width split over it."""

    def as_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "fsdp": self.fsdp, "ep": self.ep, "tp": self.tp}


class RolloutMeshSection(_Section):
    """The rollout engine's mesh, dp x ep x tp devices: no fsdp, since decoding gathers every weight every token."""

    dp: int = Field(1, ge=1)
    """Data parallel: request rows (and their KV cache) split over it, parameters replicated."""
    ep: int = Field(1, ge=1)
    """Expert parallel (models with experts): the experts split over it, and request rows too."""
    tp: int = Field(1, ge=1)
    """Tensor parallel: vocab, attention heads, MLP width and KV heads split over it."""

    def as_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "fsdp": 1, "ep": self.ep, "tp": self.tp}


class ActorSection(_Section):
    mesh: MeshSection = Field(default_factory=MeshSection)
    """The actor's mesh (one device by default)."""
    router_aux_loss_coef: float | None = Field(None, ge=0)
    """Models with experts: the weight of the router's load-balancing loss added to GRPO's loss (0 turns it off);
    unset: the checkpoint's config.json `router_aux_loss_coef`. Ignored for models without experts."""


class RolloutSection(_Section):
    engine: Literal["jax_sampler", "fake", "sglang_jax"] = "jax_sampler"
    """Rollout engine implementation."""
    max_batch_size: int = Field(64, ge=1)
    """Most sequences the engine decodes at once, in sequences."""
    mesh: RolloutMeshSection = Field(default_factory=RolloutMeshSection)
    """The engine's mesh (one device by default)."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Engine-specific knobs, passed through to the engine untouched."""

    @model_validator(mode="after")
    def _mesh_is_laid_out_by_the_engine(self) -> RolloutSection:
        if self.engine == "sglang_jax" and sharding.num_devices(self.mesh.as_dict()) > 1:
            raise _FieldError("mesh", self.mesh.model_dump(),
                              "the sglang_jax engine does not lay itself out on an rlsched mesh yet; use "
                              "rollout.engine=jax_sampler for a sharded rollout, or a one-device rollout.mesh")
        return self


class GRPOSection(_Section):
    prompts_per_step: int = Field(16, ge=1)
    """Prompts sampled per GRPO step."""
    num_generations: int = Field(8, ge=2)
    """Completions per prompt (group size G); with 1 every group-relative advantage would be 0."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus-sampling mass; 1 = off."""
    max_prompt_len: int = Field(256, ge=1)
    """Longest prompt, in tokens (a longer one is handled as data.too_long says: an error by default)."""
    max_new_tokens: int = Field(256, ge=1)
    """Longest completion, in tokens."""
    beta: float = Field(0.0, ge=0)
    """KL-penalty weight; 0 = no reference model is kept."""
    epsilon: float = Field(0.2, gt=0)
    """Lower clip range of the importance ratio: ratios below 1 - epsilon are clipped."""
    epsilon_high: float | None = Field(None, gt=0)
    """Upper clip range (ratios above 1 + epsilon_high are clipped); None = epsilon."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """`token-mean`: mean over all tokens of the batch; `seq-mean-token-mean`: per sequence, then over sequences."""
    normalize_advantage_std: bool = True
    """Divide group-centred rewards by the group's standard deviation."""
    mini_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step; None = all samples of a GRPO step (one optimizer step per epoch)."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Samples per forward/backward pass (gradients accumulate over a mini-batch); None = mini_batch_size."""
    epochs_per_step: int = Field(1, ge=1)
    """Passes over a GRPO step's samples."""

    @property
    def clip_range(self) -> tuple[float, float]:
        """(epsilon, epsilon_high) with the default applied: ratios are clipped to [1 - low, 1 + high]."""
        return self.epsilon, self.epsilon if self.epsilon_high is None else self.epsilon_high


class OptimSection(_Section):
    lr: float = Field(1e-6, gt=0)
    """Peak AdamW learning rate."""
    warmup_ratio: float = Field(0.1, ge=0, lt=1)
    """Fraction of the task's total optimizer steps spent in linear warmup."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """The cosine schedule decays to lr * min_lr_ratio at the last optimizer step (0 = to zero)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    b1: float = Field(0.9, ge=0, lt=1)
    """Adam first-moment decay."""
    b2: float = Field(0.999, ge=0, lt=1)
    """Adam second-moment decay."""


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


def _divisors(n: int) -> str:
    return ", ".join([str(d) for d in range(n, 0, -1) if n % d == 0][:6])


def _plan(name: str, g: GRPOSection, steps: int, warmup_ratio: float) -> BatchPlan:
    samples = g.prompts_per_step * g.num_generations
    mini = g.mini_batch_size or samples
    micro = g.micro_batch_size or mini
    where = f"{samples} samples/step = grpo.prompts_per_step {g.prompts_per_step} x grpo.num_generations " \
            f"{g.num_generations}"
    if mini > samples or samples % mini:
        raise _FieldError("grpo.mini_batch_size", mini, f"must divide the {where}; use one of {_divisors(samples)}")
    if micro > mini or mini % micro:
        unset = " (unset: all samples of a step)" if g.mini_batch_size is None else ""
        raise _FieldError("grpo.micro_batch_size", micro,
                          f"must divide grpo.mini_batch_size {mini}{unset}; use one of {_divisors(mini)}")
    per_step = samples // mini * g.epochs_per_step
    total = per_step * steps
    return BatchPlan(
        task=name, prompts_per_step=g.prompts_per_step, num_generations=g.num_generations, samples_per_step=samples,
        mini_batch_size=mini, micro_batch_size=micro, grad_accumulation=mini // micro,
        epochs_per_step=g.epochs_per_step, optimizer_steps_per_step=per_step, steps=steps,
        total_optimizer_steps=total,
        # The epsilon keeps products like 0.29 * 100 (= 28.999999999999996) from flooring to 28.
        warmup_steps=int(warmup_ratio * total + 1e-9),
    )


class TaskConfig(_Section):
    name: Name
    """Task name, unique within the experiment; names `runs/<experiment>/tasks/<name>`."""
    seed: int | None = None
    """Task seed (data order, sampling); None = experiment seed + task index."""
    model: ModelSection
    data: DataSection
    reward: RewardSection
    actor: ActorSection = Field(default_factory=ActorSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    grpo: GRPOSection = Field(default_factory=GRPOSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    steps: int = Field(ge=1)
    """GRPO steps to run."""
    checkpoint_every: int = Field(0, ge=0)
    """GRPO steps between checkpoints (and the last step); 0 = never (a stop still saves). Written in the
    background: the step waits only for the copy to host. Tasks' saves are staggered: task i of n saves at the
    steps where (step + i * checkpoint_every // n) is a multiple of checkpoint_every, so they do not all write
    at once."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept per task (older ones are deleted once a newer one is complete)."""
    checkpoint_async: bool = True
    """Write checkpoints in the background (the step waits only for the copy to host); false: the step waits
    for the files (benchmarks/checkpoint.py compares the two)."""
    export_final: bool = False
    """At the end of a run that did every step, write the last checkpoint as a Hugging Face model directory in
    `runs/<experiment>/tasks/<task>/final/` (what `rlsched export` writes; transformers loads it). The last step
    is then checkpointed even with checkpoint_every 0."""
    log_every: int = Field(1, ge=1)
    """GRPO steps between metric logs."""
    priority: int = 0
    """cluster.policy=priority: higher goes first when tasks wait for the same lock."""
    weight: float = Field(1.0, gt=0)
    """cluster.policy=fair: the task's share of each lock's time, relative to the other tasks' weights."""
    max_restarts: int = Field(0, ge=0)
    """Times the task restarts a role whose process died (killed, out of memory, lost node) before it fails;
    0 = fail at once. A dead engine is replaced and the step redone with the actor's live weights; a dead actor
    is replaced from the last checkpoint (or from the start without one), and the steps after it are redone.
    Errors raised inside a role (a config error, a reward bug) are never retried."""

    _batch_plan: BatchPlan = PrivateAttr()

    @model_validator(mode="after")
    def _check_batches(self) -> TaskConfig:
        # Private attributes may be set on frozen models; this is the one place the plan is computed.
        self._batch_plan = _plan(self.name, self.grpo, self.steps, self.optim.warmup_ratio)
        return self

    def batch_plan(self) -> BatchPlan:
        """The derived batch arithmetic, checked at load time."""
        return self._batch_plan

    def resolved_seed(self, experiment_seed: int, index: int) -> int:
        """This task's seed: its own, or `experiment_seed + index` (index = position in `tasks`)."""
        return experiment_seed + index if self.seed is None else self.seed


class ExperimentConfig(_Section):
    experiment: ExperimentSection
    tasks: list[TaskConfig] = Field(min_length=1)
    """The GRPO tasks run together; at least one."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _unique_task_names(self) -> ExperimentConfig:
        first: dict[str, int] = {}
        for i, task in enumerate(self.tasks):
            if task.name in first:
                raise _FieldError(f"tasks.{i}.name", task.name,
                                  f"duplicate task name: tasks.{first[task.name]} and tasks.{i} are both named "
                                  f"{task.name!r}; task names must be unique (they name run directories)")
            first[task.name] = i
        return self

    @model_validator(mode="after")
    def _meshes_fit(self) -> ExperimentConfig:
        # What needs no model file: each mesh's devices against the pool, and the batches each mesh splits.
        given = self.cluster.num_devices
        for i, task in enumerate(self.tasks):
            plan, actor, rollout = task.batch_plan(), task.actor.mesh, task.rollout.mesh
            for key, mesh in ((f"tasks.{i}.actor.mesh", actor), (f"tasks.{i}.rollout.mesh", rollout)):
                if given is not None and _devices(mesh) > given and self.cluster.hosts == 1:  # else _hosts_fit
                    raise _FieldError(key, mesh.model_dump(),
                                      f"{_mesh_text(mesh)} devices, but cluster.num_devices is {given}")
            rows = actor.dp * actor.fsdp * actor.ep
            if plan.micro_batch_size % rows:  # the mini-batch is a multiple of the micro-batch: it splits too
                raise _FieldError(f"tasks.{i}.actor.mesh", actor.model_dump(),
                                  f"a micro-batch of {plan.micro_batch_size} samples (grpo.micro_batch_size) does not "
                                  f"split over {_rows_text(actor)} = {rows} devices; make the "
                                  f"micro-batch a multiple of {rows}")
            split = rollout.dp * rollout.ep
            if plan.samples_per_step % split:
                over = _rows_text(rollout) + (f" = {split}" if rollout.ep > 1 else "")
                raise _FieldError(f"tasks.{i}.rollout.mesh", rollout.model_dump(),
                                  f"{plan.samples_per_step} samples/step (grpo.prompts_per_step {plan.prompts_per_step}"
                                  f" x grpo.num_generations {plan.num_generations}) do not split over {over}")
        if self.cluster.hosts > 1:
            self._hosts_fit()
        if self.cluster.placement == "disaggregated" and given is not None and self._devices_needed() > given:
            e = max(range(len(self.tasks)), key=lambda i: _devices(self.tasks[i].rollout.mesh))
            a = max(range(len(self.tasks)), key=lambda i: _devices(self.tasks[i].actor.mesh))
            engine, actor = self.tasks[e].rollout.mesh, self.tasks[a].actor.mesh
            r, t = _devices(engine), _devices(actor)
            raise _FieldError("cluster.num_devices", given,
                              f"disaggregated puts a rollout group of {r} devices (tasks.{e}.rollout.mesh: "
                              f"{_mesh_text(engine)}) beside a train group of {t} (tasks.{a}.actor.mesh: "
                              f"{_mesh_text(actor)}): {r} + {t} = {r + t} devices, but cluster.num_devices is {given}")
        return self

    def _hosts_fit(self) -> None:
        """cluster.hosts > 1: what a mesh across hosts must be, before any process starts."""
        c = self.cluster
        if c.num_devices is None:
            raise _FieldError("cluster.num_devices", None, f"cluster.hosts is {c.hosts}: say how many devices each "
                              "host has (cluster.num_devices, per host)")
        if c.placement != "colocated":
            raise _FieldError("cluster.placement", c.placement, "cluster.hosts > 1 runs colocated only for now "
                              "(an actor across hosts, its engine on the first host); set cluster.placement=colocated")
        per_host, pool = c.num_devices, c.num_devices * c.hosts
        for i, task in enumerate(self.tasks):
            actor, n = task.actor.mesh, _devices(task.actor.mesh)
            if n > pool:
                raise _FieldError(f"tasks.{i}.actor.mesh", actor.model_dump(),
                                  f"{_mesh_text(actor)} devices, but cluster.hosts {c.hosts} x cluster.num_devices "
                                  f"{per_host} = {pool}")
            if n > per_host and n % per_host:
                raise _FieldError(f"tasks.{i}.actor.mesh", actor.model_dump(),
                                  f"{_mesh_text(actor)} devices spans hosts of {per_host} devices but not whole ones; "
                                  f"a mesh across hosts takes whole hosts: a multiple of {per_host} devices")
            if n > per_host and (actor.tp > per_host or per_host % actor.tp):
                raise _FieldError(f"tasks.{i}.actor.mesh.tp", actor.tp,
                                  f"tp must stay inside a host (its all-reduces run every layer); a host has "
                                  f"{per_host} devices, so tp must divide {per_host}; split across hosts with dp or "
                                  "fsdp")
            if c.processes == "per_device_group" and per_host < n < pool:
                raise _FieldError(f"tasks.{i}.actor.mesh", actor.model_dump(),
                                  f"{_mesh_text(actor)} devices spans some of the {c.hosts} hosts, but with "
                                  "cluster.processes=per_device_group the hosts are one JAX job and a mesh across "
                                  f"them takes them all: {pool} devices (or one host's {per_host} at most)")
            rollout = task.rollout.mesh
            if _devices(rollout) > per_host:
                raise _FieldError(f"tasks.{i}.rollout.mesh", rollout.model_dump(),
                                  f"{_mesh_text(rollout)} devices, but an engine runs on one host of "
                                  f"{per_host} devices (engines across hosts are not supported yet)")
            if task.rollout.engine in OWN_PROCESS_ENGINES and n > per_host:
                raise _FieldError(f"tasks.{i}.rollout.engine", task.rollout.engine,
                                  f"{task.rollout.engine} beside an actor across hosts is not supported yet; use "
                                  "rollout.engine=jax_sampler")

    def _devices_needed(self) -> int:
        actor = max(_devices(t.actor.mesh) for t in self.tasks)
        rollout = max(_devices(t.rollout.mesh) for t in self.tasks)
        return max(actor, rollout) if self.cluster.placement == "colocated" else actor + rollout

    @property
    def num_devices(self) -> int:
        """The device pool: `cluster.num_devices`, or when None exactly what the meshes need (colocated: the
        largest mesh of any task; disaggregated: the largest rollout mesh plus the largest actor mesh)."""
        return self._devices_needed() if self.cluster.num_devices is None else self.cluster.num_devices

    @property
    def run_dir(self) -> Path:
        """`<output_dir>/<name>`, relative to the working directory unless output_dir is absolute."""
        return Path(self.experiment.output_dir) / self.experiment.name

    def task_specs(self) -> list[TaskSpec]:
        """Every task resolved once, in order: what each process of the run is handed."""
        run_dir = self.run_dir.absolute()
        cache = self.cluster.compile_cache_dir
        cache = None if cache is None else str((Path(self.experiment.output_dir) / cache).absolute())
        return [TaskSpec(experiment=self.experiment.name, index=i, config=t,
                         seed=t.resolved_seed(self.experiment.seed, i), dir=run_dir / "tasks" / t.name,
                         tracking=self.experiment.tracking, placement=self.cluster.placement,
                         num_devices=self.num_devices, hosts=self.cluster.hosts,
                         shares_devices=self.cluster.placement == "colocated" or len(self.tasks) > 1,
                         checkpoint_offset=i * t.checkpoint_every // len(self.tasks),
                         compile_cache=cache, call_timeout_s=self.cluster.call_timeout_s)
                for i, t in enumerate(self.tasks)]


def _devices(mesh: MeshSection | RolloutMeshSection) -> int:
    return sharding.num_devices(mesh.as_dict())


def _rows_text(mesh: MeshSection | RolloutMeshSection) -> str:
    """'dp 2 x fsdp 2' (actor) / 'dp 4' (rollout), with ' x ep N' when ep > 1: the axes a batch's rows split over."""
    text = f"dp {mesh.dp} x fsdp {mesh.fsdp}" if isinstance(mesh, MeshSection) else f"dp {mesh.dp}"
    return text + (f" x ep {mesh.ep}" if mesh.ep > 1 else "")


def _mesh_text(mesh: MeshSection | RolloutMeshSection) -> str:
    """'fsdp 4 x tp 2 = 8'."""
    return f"{sharding.describe(mesh.as_dict())} = {_devices(mesh)}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """One task of an experiment, resolved once (`ExperimentConfig.task_specs`) and handed, immutable, to
    every process that works for it: its driver and its roles. Nothing downstream re-derives a seed, a
    path or a name; the experiment is never re-validated in a worker."""

    experiment: str  # the experiment's name
    index: int  # position in the experiment's `tasks` (overrides say `tasks.<index>.`)
    config: TaskConfig  # the task's validated config section
    seed: int  # the task's own seed, or the experiment seed + index
    dir: Path  # absolute runs/<experiment>/tasks/<task>: metrics, checkpoints
    tracking: TrackingSection  # where metrics go besides metrics.jsonl
    placement: Literal["colocated", "disaggregated"]
    num_devices: int  # the experiment's device pool (rlsched.config.meshes.role_devices picks each role's from it)
    processes: Literal["per_role", "per_device_group"] = "per_role"  # cluster.processes once the platform is known
    hosts: int = 1  # hosts of the device group (cluster.hosts); num_devices is then per host
    shares_devices: bool = True  # roles of other tasks or of this one may use this task's devices (colocated, or
    # several tasks on a group; a service's tasks come and go): processes sharing a GPU must free what they offload
    checkpoint_offset: int = 0  # staggers the tasks' saves (TaskConfig.checkpoint_every)
    compile_cache: str | None = None  # absolute directory of JAX's persistent compilation cache (None: off)
    call_timeout_s: float = 3600.0  # longest wait for one call to a role in another process (cluster.call_timeout_s)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def plan(self) -> BatchPlan:
        return self.config.batch_plan()

    def role_hosts(self, kind: str) -> int:
        """How many hosts role `kind` ("actor" / "engine") spans: its mesh's devices over a host's."""
        mesh = self.config.actor.mesh if kind == "actor" else self.config.rollout.mesh
        return max(1, -(-_devices(mesh) // self.num_devices))

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


def with_absolute_paths(cfg: ExperimentConfig, base: str | Path) -> ExperimentConfig:
    """`cfg` with its relative paths (experiment.output_dir, each task's model.path and data.path) made
    absolute against `base`: what a process with another working directory (the scheduler service) is handed."""
    def absolute(path: str | None) -> str | None:
        return None if path is None else str((Path(base) / path).absolute())

    tasks = [t.model_copy(update={"model": t.model.model_copy(update={"path": absolute(t.model.path)}),
                                  "data": t.data.model_copy(update={"path": absolute(t.data.path)})})
             for t in cfg.tasks]
    experiment = cfg.experiment.model_copy(update={"output_dir": absolute(cfg.experiment.output_dir)})
    return cfg.model_copy(update={"tasks": tasks, "experiment": experiment})


def select_tasks(cfg: ExperimentConfig, names: Sequence[str] | None) -> ExperimentConfig:
    """`--tasks a,b`: only these tasks, each keeping the seed it has in the whole experiment."""
    if not names:
        return cfg
    known = [t.name for t in cfg.tasks]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"--tasks: no task named {', '.join(map(repr, unknown))}; this experiment has {known}")
    # Pin each task's seed to its place in the full experiment, so a subset computes what it would
    # have computed as part of the whole.
    seed = cfg.experiment.seed
    kept = [t.model_copy(update={"seed": t.resolved_seed(seed, i)}) for i, t in enumerate(cfg.tasks) if t.name in names]
    return cfg.model_copy(update={"tasks": kept})


# --- loading -------------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats: `1e-6` and `3E5` are numbers, not strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _apply_override(raw: dict, override: str) -> str:
    """Set one `a.b.0.c=value` in the raw dict; returns the dotted path it set."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} is malformed; expected path.to.key=value, "
                          "e.g. tasks.0.grpo.beta=0.04")
    try:
        value = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: value {text!r} is not valid YAML: {e}") from None
    parts = key.strip().split(".")
    node: Any = raw
    for depth, part in enumerate(parts):
        last, here = depth == len(parts) - 1, ".".join(parts[:depth]) or "the top level"
        if isinstance(node, dict):
            # A new key is allowed: validation then reports it as unknown, with a suggestion.
            if last:
                node[part] = value
            elif node.get(part) is None:
                node[part] = {}  # absent, or `section:` left empty in the YAML
            node = node[part]
        elif isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {override!r}: {here} is a list of {len(node)} items; index {part!r} "
                                  f"is out of range (use 0..{len(node) - 1})")
            if last:
                node[int(part)] = value
            node = node[int(part)]
        else:
            raise ConfigError(f"override {override!r}: {here} is {node!r}, not a mapping or list, so it has no "
                              f"key {part!r}")
    return key.strip()


def _model_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model class that validates the mapping at `loc`, for unknown-key suggestions."""
    cls: type[BaseModel] = ExperimentConfig
    for part in loc:
        if isinstance(part, int):
            continue  # list element: the annotation below was already unwrapped
        field = cls.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        while get_origin(ann) in (list, Union, types.UnionType):
            ann = next(a for a in get_args(ann) if a is not type(None))
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _format_error(err: dict, label: str, overridden: dict[str, str]) -> str:
    loc, value, msg, suffix = tuple(err["loc"]), err.get("input"), err["msg"], ""
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, _FieldError):
        loc, value, msg = loc + cause.field, cause.value, str(cause)
    elif err["type"] == "value_error":
        msg = str(cause)  # without pydantic's "Value error, " prefix
    elif err["type"] == "extra_forbidden":
        cls = _model_at(loc[:-1])
        names = list(cls.model_fields) if cls else []
        close = difflib.get_close_matches(str(loc[-1]), names, n=1)
        msg = "unknown key"
        suffix = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}" if names else ""
    path = ".".join(str(p) for p in loc) or "<top level>"
    quoted = "" if err["type"] == "missing" else f" (got {_short_repr(value)})"  # a missing key has no value
    line = f"{label}: {path}: {msg}{quoted}{suffix}"
    for prefix, override in overridden.items():
        if path == prefix or path.startswith(prefix + "."):
            line += f" [from override {override!r}]"
    return line


def read_raw(path: str | Path) -> dict:
    """The YAML mapping of a config file, before validation; syntax errors name file:line:col."""
    path = Path(path)
    if not path.is_file():
        what = "does not exist" if not path.exists() else "is a directory" if path.is_dir() else "is not a file"
        raise ConfigError(f"config file {path} {what}; name an experiment YAML (see configs/)")
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from None
    if not isinstance(raw, dict):
        got = "an empty file" if raw is None else f"a {type(raw).__name__}"
        raise ConfigError(f"{path}: the top level must be a mapping with experiment:, tasks: and cluster: (got {got})")
    return raw


def _unshare(node: Any) -> Any:
    """A copy in which no mapping or list appears twice. YAML anchors (`rollout: *rollout`) load as one shared
    object; an override of `tasks.1.rollout` must not also change every task that names the same anchor."""
    if isinstance(node, dict):
        return {k: _unshare(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_unshare(v) for v in node]
    return node


def _reward_files_absolute(raw: dict, task_dirs: Sequence[Path]) -> None:
    """Each task's relative `reward.file` made absolute against its config file's directory (task_dirs[i]), so
    any process, started anywhere, loads the same file."""
    tasks = raw.get("tasks")
    for i, task in enumerate(tasks if isinstance(tasks, list) else []):
        reward = task.get("reward") if isinstance(task, dict) else None
        file = reward.get("file") if isinstance(reward, dict) else None
        if isinstance(file, str) and file:
            base = task_dirs[i] if i < len(task_dirs) else Path.cwd()
            reward["file"] = str((base / Path(file).expanduser()).absolute())  # an absolute path stays itself


def validate(raw: dict, overrides: Sequence[str] = (), *, label: str = "config",
             task_dirs: Sequence[Path] = ()) -> ExperimentConfig:
    """Apply `--set` overrides to a raw mapping and validate it; every problem is a `ConfigError`.
    `task_dirs[i]`: the directory of the file task i came from (a relative reward.file is relative to it; to the
    working directory when not given)."""
    raw = _unshare(raw)
    overridden = {_apply_override(raw, o): o for o in overrides}
    _reward_files_absolute(raw, [Path(d).absolute() for d in task_dirs])
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        lines = [_format_error(err, label, overridden) for err in e.errors()]
        raise ConfigError("\n".join(lines)) from None


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read, override and validate an experiment config; every problem is a `ConfigError`."""
    raw = read_raw(path)
    tasks = raw.get("tasks")
    return validate(raw, overrides, label=str(path),
                    task_dirs=[Path(path).parent] * (len(tasks) if isinstance(tasks, list) else 0))


def load_configs(paths: Sequence[str | Path], overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Several configs as one experiment: tasks concatenated in order (`tasks.N` overrides index the
    combined list); experiment: and cluster: come from the first file."""
    if len(paths) == 1:
        return load_config(paths[0], overrides)
    raws = [read_raw(p) for p in paths]
    merged = dict(raws[0])
    merged["tasks"] = [t for raw in raws for t in (raw.get("tasks") or [])]
    dirs = [Path(p).parent for p, raw in zip(paths, raws, strict=True) for _ in (raw.get("tasks") or [])]
    return validate(merged, overrides, label="+".join(str(p) for p in paths), task_dirs=dirs)


def dump_resolved(cfg: ExperimentConfig) -> str:
    """The config with every default filled in, as YAML; `load_config` of it gives back `cfg`."""
    header = "# Resolved by rlsched: every default filled in. This file is a valid config on its own.\n"
    return header + yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
