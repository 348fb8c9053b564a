"""Experiment configuration: the frozen pydantic models of a config file, with errors that name the field. Reading a
file, `--set` overrides and the error lines are `rlsched.config.loading`; what a task's processes are handed once
it is resolved (`TaskSpec`, `BatchPlan`) is `rlsched.config.spec`.

One experiment runs many GRPO tasks; each `TaskConfig` is self-contained (model, data, reward,
rollout, GRPO, optimizer, step counts), so a task can be added or removed without touching the
others. `ClusterConfig` is the only shared section.

Design decisions:
- Frozen and `extra="forbid"`: a config is read once and never mutated; a misspelt key is an error
  (with a "did you mean" suggestion), never a silently ignored setting that wrecks a reward curve.
- Strict validation: the value in the file is the value used (`steps: "10"` or `steps: true` is an
  error, not a coercion).
- Batch arithmetic (samples per step, mini/micro batches, optimizer and warmup steps) is derived
  once, at validation, into a `BatchPlan` (rlsched.config.spec): a config whose batches do not divide fails
  before any model loads, and the trainer logs `BatchPlan.describe()` instead of recomputing it.
- Engine-specific knobs live in `rollout.engine_args`, passed through untouched: the config does
  not copy every engine's settings field by field.
- Meshes (`actor.mesh`, `rollout.mesh`) are checked here against what needs no file: device counts
  against `cluster.num_devices` and batch sizes against dp x fsdp. Whether a mesh splits the *model*
  needs its config.json, so that check is `rlsched.config.meshes.check_meshes`, run before any process starts.
- No jax/ray imports: the CLI validates a config in milliseconds.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from rlsched.config.spec import BatchPlan, TaskSpec
from workers.models import sharding
from workers.rollout import OWN_PROCESS_ENGINES

# `rlsched init-model` presets (workers.models.presets.PRESETS, which a test holds equal): named here so the
# CLI and the config check them without importing the model code.
MODEL_PRESETS = ("tiny", "small", "tiny-digits", "small-digits", "tiny-qwen2", "small-qwen2", "tiny-qwen3moe",
                 "small-qwen3moe", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b")


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
    """The model's dtype: what the forward and backward compute in, what the engine serves and what an export writes.
    A bfloat16 task trains float32 master weights (its optimizer moments and summed gradients float32 too) and
    checkpoints them (docs/models.md, "Precision")."""


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
    chat_template_args: dict[str, Any] = Field(default_factory=dict)
    """Variables the chat template reads, passed to the tokenizer's `apply_chat_template` as they are, e.g.
    `{enable_thinking: false}` for Qwen3 (its template then closes an empty think block); ignored by `plain`."""
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


class EvalSection(_Section):
    every: int = Field(0, ge=0)
    """GRPO steps between evaluations; 0 = only after the last step. The last step is always evaluated."""
    before: bool = False
    """Also evaluate the starting weights, before the first step (metrics.jsonl's step 0)."""
    split: Literal["test", "train", "all"] = "test"
    """`test`: the held-out problems, never trained on (GSM8K's test file; one arithmetic problem in ten, by a
    rule of its text; a jsonl/parquet task's `eval.path`). `train` / `all`: the training problems / both."""
    path: str | None = None
    """The held-out file of a jsonl/parquet task (the fields of data.path); for gsm8k, None = GSM8K's test split
    shipped with rlsched. Synthetic kinds take none."""
    problems: int | None = Field(None, ge=1)
    """Problems scored: the first N of the split in a fixed shuffle (the same for every run); None = all."""
    samples: int = Field(1, ge=1)
    """Completions per problem (n of pass@n)."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature; 0 = greedy."""
    correct: float = 1.0
    """A sample is right when its reward is at least this: the reward's maximum (1.0 for the built-in rewards,
    whose partial credit stays below it). eval/accuracy is the share of right samples."""

    @model_validator(mode="after")
    def _samples_need_a_temperature(self) -> EvalSection:
        if self.samples > 1 and self.temperature == 0:
            raise _FieldError("samples", self.samples, "more than one sample at temperature 0 repeats the one greedy "
                              "answer; set eval.temperature > 0 for pass@n, or samples: 1")
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
    cobatch: bool = False
    """LoRA tasks of one base group whose update is the same program (the same grpo settings and adapter shape; data,
    rewards, seeds, steps and optim settings may differ, a sweep over learning rates among them): true lets several
    that wait for TRAIN share one hold, their optimizer steps run as one program (each task's own loss, clipping,
    moments, learning rate, weight decay and schedule). A task's update then equals its update alone to float
    rounding only (a few 1e-6 in float32 on CPU, which AdamW can magnify), where training alone is bit-reproducible
    whatever the neighbours do: hence off by default. Worth it where one task's rows leave the devices idle
    (accelerators); docs/lora.md has the figures."""
    max_cobatch_rows: int = Field(512, ge=1)
    """Most rows one co-batched TRAIN runs at once: each task adds its grpo.micro_batch_size, and the tasks of a hold
    are padded to a power of two (activation memory grows with it)."""
    remat: Literal["layers", "off"] = "layers"
    """What the update's forward keeps for its backward: `layers` each decoder layer's input only, the backward
    recomputing one layer at a time (about a third more FLOPs in the update; activation memory ~1/L of `off`'s, L the
    layers: workers.models.decoder); `off` every layer's internals, attention's float32 scores the largest. The
    results are the same either way (the same computation, recomputed)."""

    adam_mu_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype AdamW stores its first moment in (optax.adamw's `mu_dtype`; the second moment stays float32, and
    the update is computed in float32 before the moment is rounded to be stored). `bfloat16` halves it between
    steps: 2 bytes a parameter fewer, 7.5 GiB of a 4B model; XLA:CPU keeps as much more inside the optimizer's step,
    so where that step is the actor's peak it saves nothing (docs/performance.md). It changes the numerics, hence
    opt-in: the stored moment keeps 8 bits of mantissa, and optax decays it by b1 rounded to bfloat16 (0.9 becomes
    0.8984375)."""
    offload_reference: bool = False
    """The frozen KL reference's params (grpo.beta > 0, a full-weight task) in host memory but while its log-probs
    are computed: onloaded before them and offloaded after, each step (verl's ref param_offload), so the update's
    programs run without them: the reference's bytes (a 4B bfloat16 model's 7.5 GiB) off the actor's peak. The same
    results to the bit; it costs a host round trip of the reference per step (two named spans of the actor's
    timeline, `onload_reference` and `offload_reference`). A LoRA task's reference is its base, which the update
    reads: nothing moves."""

    @field_validator("remat", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare `off` as false (`--set tasks.0.actor.remat=off` too): the setting's `off`."""
        return "off" if value is False else value


# jax_sampler's engine_args.decode_attention: "auto" and workers.models.decode_attention.IMPLS (which imports JAX)
DECODE_ATTENTION = ("auto", "xla", "pallas", "interpret")


class RolloutSection(_Section):
    engine: Literal["jax_sampler", "fake", "sglang_jax"] = "jax_sampler"
    """Rollout engine implementation."""
    max_batch_size: int = Field(64, ge=1)
    """Most sequences the engine decodes at once, in sequences."""
    mesh: RolloutMeshSection = Field(default_factory=RolloutMeshSection)
    """The engine's mesh (one device by default)."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Engine-specific knobs, passed through to the engine untouched. jax_sampler's `decode_attention`: how a decode
    step attends, `auto` (the default: a Pallas kernel reading each row's filled KV slots where the engine is on GPUs,
    on each device's shard of the cache where its mesh has several; XLA's attention elsewhere), `xla`, `pallas` (the
    kernel; GPUs) or `interpret` (the kernel under Pallas's interpreter, any platform: slow, for tests);
    docs/performance.md has what it saves."""
    cobatch: bool = True
    """LoRA tasks of one base group: when several wait for ROLLOUT, one hold runs all their rows in one program run
    (up to max_batch_size rows). Each row keeps its task's seed, so a task samples what it would alone, to the bit on
    CPU; on GPUs in bfloat16 a row's numerics depend on the batch's shape, and some samples differ from the run
    alone. false: this task always rolls out alone (bit-reproducible whatever its neighbours do)."""

    @model_validator(mode="after")
    def _decode_attention_is_known(self) -> RolloutSection:
        """jax_sampler's engine_args.decode_attention is one it knows: refused here, not when the engine starts."""
        chosen = self.engine_args.get("decode_attention", "auto")
        if self.engine == "jax_sampler" and chosen not in DECODE_ATTENTION:
            raise _FieldError("engine_args", self.engine_args,
                              f"decode_attention {chosen!r}: one of {', '.join(DECODE_ATTENTION)}")
        return self

    @model_validator(mode="after")
    def _mesh_is_laid_out_by_the_engine(self) -> RolloutSection:
        if self.engine == "sglang_jax" and sharding.num_devices(self.mesh.as_dict()) > 1:
            raise _FieldError("mesh", self.mesh.model_dump(),
                              "the sglang_jax engine does not lay itself out on an rlsched mesh yet; use "
                              "rollout.engine=jax_sampler for a sharded rollout, or a one-device rollout.mesh")
        return self


class LoraSection(_Section):
    rank: int = Field(8, ge=1)
    """Rank r of the adapter on each targeted projection (its bytes grow in proportion to it)."""
    alpha: float = Field(16.0, gt=0)
    """The adapter's output is scaled by alpha / rank (PEFT's `lora_alpha`)."""
    targets: list[Literal["q", "k", "v", "o", "gate", "up", "down", "lm_head"]] = Field(
        default_factory=lambda: ["q", "k", "v", "o"])
    """Projections adapted: in every layer attention q, k, v, o and the MLP's gate, up, down (not on a
    mixture-of-experts layer); once, the output head lm_head (tied to the embedding or not; a merged export of
    a tied base unties it)."""

    @model_validator(mode="after")
    def _targets_once(self) -> LoraSection:
        if not self.targets or len(set(self.targets)) != len(self.targets):
            raise _FieldError("targets", list(self.targets), "name each projection once, at least one "
                              "(q, k, v, o, gate, up, down, lm_head)")
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
    prompt_padding: Literal["bucket", "max"] = "bucket"
    """The length prompts are padded to, in the rollout engine (jax_sampler) and the train batch: `bucket` the
    power-of-two bucket of each batch's longest prompt (at least 8, at most max_prompt_len): less work where prompts
    are short, but one compile of the engine's and the actor's programs per new bucket, also mid-run (74 s at
    Qwen3-0.6B's shape on an H100, GSM8K prompts under max_prompt_len 256); `max` max_prompt_len, every batch: one
    shape a run, so nothing compiles after step 1 (what verl and tunix do: pad to max_prompt_length), at the cost of
    prefill and KV-cache reads for the longest possible prompt at every step."""
    beta: float = Field(0.0, ge=0)
    """KL-penalty weight; 0 = no reference model is kept."""
    epsilon: float = Field(0.2, gt=0)
    """Lower clip range of the importance ratio: ratios below 1 - epsilon are clipped."""
    epsilon_high: float | None = Field(None, gt=0)
    """Upper clip range (ratios above 1 + epsilon_high are clipped); None = epsilon."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """`token-mean`: mean over all tokens of the batch; `seq-mean-token-mean`: per sequence, then over sequences;
    `seq-mean-token-sum-norm`: the sum over tokens / (sequences x max_new_tokens), a constant (Dr. GRPO; TRL's
    `dr_grpo`), so a token weighs the same in a short completion as in a long one."""
    normalize_advantage_std: bool = True
    """Divide group-centred rewards by the group's standard deviation."""
    advantage_std_ddof: Literal[0, 1] = 0
    """That standard deviation's degrees of freedom: 0 the population std, 1 the sample std (divides by G - 1, as
    TRL's and verl's torch.std do)."""
    kl_clamp: float | None = Field(None, gt=0)
    """Clip the per-token k3 KL to [-kl_clamp, kl_clamp] (verl clamps at 10); None = no clip. Only with beta > 0."""
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
    eval: EvalSection | None = None
    """Score the policy on held-out problems (eval/accuracy, eval/pass@n, eval/reward) under the task's ROLLOUT
    lock, every `eval.every` steps and after the last; None = no evaluation (`rlsched eval` scores a run later)."""
    lora: LoraSection | None = None
    """Train a LoRA adapter on `model.path` (the base, frozen) instead of every weight: the optimizer holds the
    adapter's moments only, the KL reference is the base, and the engine receives the adapter only. None: a
    full-weight task."""
    steps: int = Field(ge=1)
    """GRPO steps to run."""
    checkpoint_every: int | None = Field(None, ge=0)
    """GRPO steps between checkpoints, the last step saved too; null (the default): the last step only, so a run
    keeps its final weights (`rlsched export` writes them as a Hugging Face model); 0: never, the run keeps no
    weights (a stop still saves). The run says where they go when it starts. Written in the
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

    @model_validator(mode="after")
    def _lora_needs_an_engine_that_loads_adapters(self) -> TaskConfig:
        if self.lora is not None and self.rollout.engine != "jax_sampler":
            why = "the released sglang-jax cannot load LoRA adapters" if self.rollout.engine == "sglang_jax" else \
                "the fake engine holds no weights to adapt"
            raise _FieldError("rollout.engine", self.rollout.engine,
                              f"{why}; a LoRA task rolls out with rollout.engine=jax_sampler (it serves several "
                              "tasks' adapters in one batch)")
        return self

    @model_validator(mode="after")
    def _eval_split_exists(self) -> TaskConfig:
        e, kind = self.eval, self.data.kind
        if e is None:
            return self
        if kind in _SYNTHETIC_KINDS and e.path is not None:
            raise _FieldError("eval.path", e.path, f"synthetic kind {kind!r} holds its problems out by a rule and "
                              "reads no file; remove eval.path")
        if kind in ("jsonl", "parquet") and e.path is None and e.split != "train":
            raise _FieldError("eval.path", None, f"a {kind} task's held-out problems are a file of their own: set "
                              "eval.path (same fields as data.path), or eval.split: train")
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
                         checkpoint_offset=i * (t.checkpoint_every or 0) // len(self.tasks),
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
