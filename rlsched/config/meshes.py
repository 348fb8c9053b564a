"""Which devices each role's mesh gets, and whether a mesh can lay out its task's model.

    role_devices("colocated", 8, {"fsdp": 4, "tp": 2}, {"tp": 2})  # {"actor": [0..7], "engine": [0, 1]}
    check_meshes(cfg)                 # before any process starts: every mesh splits its model, or ConfigError
    check_platform("tpu", cfg, "per_role")   # colocated: ConfigError, a TPU chip opens in one process

Device indices are positions in the experiment's device pool (`ExperimentConfig.num_devices`): on CPU the
XLA host devices of a role's process, on GPU the Ray accelerator ids in the order of the group's bundle.

Design decisions:
- **Two layers of checks.** What needs no file (devices against `cluster.num_devices`, batch rows against
  dp x fsdp) is validated with the config (rlsched.config.schema), so every load fails fast with the file and the
  field path. Whether a mesh divides the *model* needs the model's config.json; that is `check_meshes`
  here, called once before any process starts. Only config.json is read, never the weights.
- **Disaggregated: rollout group first, train group last.** A task's engine takes the first devices of the
  pool and its actor the last ones. With tasks of different mesh sizes, every engine then stays clear of
  every actor as long as the largest rollout mesh plus the largest actor mesh fit the pool, which the
  config checks, and each task's devices follow from its own meshes and the pool size alone.
- Pure Python: no JAX (the control plane never starts an accelerator).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from rlsched.config.schema import ConfigError, ExperimentConfig, TaskConfig
from workers.models import sharding
from workers.models.config import ModelConfig
from workers.rollout import OWN_PROCESS_ENGINES

PLATFORMS = ("cpu", "gpu", "tpu")


def role_devices(placement: str, num_devices: int, actor_mesh: Mapping[str, int],
                 rollout_mesh: Mapping[str, int]) -> dict[str, list[int]]:
    """{"actor": [device indices], "engine": [device indices]} in a pool of `num_devices`, in mesh order.

    colocated: both roles start at device 0 (they time-share one group); disaggregated: the engine takes
    the first rollout-mesh devices, the actor the last actor-mesh devices (see the module docstring)."""
    n_actor, n_engine = sharding.num_devices(actor_mesh), sharding.num_devices(rollout_mesh)
    need = max(n_actor, n_engine) if placement == "colocated" else n_actor + n_engine
    if need > num_devices:
        raise ConfigError(f"{placement}: the actor mesh ({sharding.describe(actor_mesh)}) and the rollout mesh "
                          f"({sharding.describe(rollout_mesh)}) need {need} devices; the pool has {num_devices}")
    if placement == "colocated":
        return {"actor": list(range(n_actor)), "engine": list(range(n_engine))}
    return {"actor": list(range(num_devices - n_actor, num_devices)), "engine": list(range(n_engine))}


def local_role_devices(placement: str, kind: str, num_devices: int, visible: int, actor_mesh: Mapping[str, int],
                       rollout_mesh: Mapping[str, int]) -> list[int]:
    """The positions in its process's `jax.local_devices()` of a role's mesh devices.

    A process that sees the whole pool (CPU: every role process gets the pool's XLA host devices) takes the
    role's place in it (`role_devices`). One that sees fewer sees its group's devices only (on an accelerator
    Ray makes the group's bundle visible to the process that holds the group): the same rule within them,
    an engine's mesh first and an actor's last (colocated: both first)."""
    if visible >= num_devices:
        return role_devices(placement, num_devices, actor_mesh, rollout_mesh)[kind]
    mesh = actor_mesh if kind == "actor" else rollout_mesh
    n = sharding.num_devices(mesh)
    if n > visible:
        raise ConfigError(f"the {kind}'s mesh ({sharding.describe(mesh)}) needs {n} devices, but its process "
                          f"sees {visible}")
    last = kind == "actor" and placement == "disaggregated"
    return list(range(visible - n, visible)) if last else list(range(n))


def task_devices(cfg: ExperimentConfig) -> dict[str, dict[str, list[int]]]:
    """{task: role_devices(...)} for every task of an experiment."""
    return {t.name: role_devices(cfg.cluster.placement, cfg.num_devices, t.actor.mesh.as_dict(),
                                 t.rollout.mesh.as_dict()) for t in cfg.tasks}


# ---- the model -------------------------------------------------------------------------------------------------

def read_model_config(task: TaskConfig, index: int, *, required: bool = False) -> ModelConfig | None:
    """The task's model architecture: its config.json, else its `init_preset` (what `rlsched train` will
    create there, with the preset's tokenizer), else None, or a ConfigError when `required`."""
    path = Path(task.model.path)
    if (path / "config.json").is_file():
        return ModelConfig.from_dir(path)
    if task.model.init_preset is not None:
        # These import the tokenizer libraries (a second): only when a preset is asked for.
        from workers.models.presets import PUBLISHED_PRESETS, preset_config, preset_vocab_size

        # As `init_model` makes it: byte's 259 tokens -> 384 rows, digits' 16 -> 16, a published shape's own.
        preset = task.model.init_preset
        return preset_config(preset, **({} if preset in PUBLISHED_PRESETS else
                                        {"vocab_size": preset_vocab_size(preset)}))
    if required:
        raise ConfigError(f"tasks.{index}.model.path: {path} has no config.json and tasks.{index}.model.init_preset "
                          "is not set; the model's shapes come from its config.json (weights are not read)")
    return None


def _model_source(task: TaskConfig) -> str:
    path = Path(task.model.path) / "config.json"
    return str(path) if path.is_file() else f"the {task.model.init_preset} preset"


ModelConfigs = Callable[[TaskConfig, int], ModelConfig | None]


def check_meshes(cfg: ExperimentConfig, model_config: ModelConfigs | None = read_model_config) -> None:
    """Every task's actor and rollout mesh splits every parameter of its model, and its prompts plus new
    tokens fit the model's positions; or one ConfigError line naming the key and the numbers.

    `cfg` is validated, so device counts and batch rows are checked already (rlsched.config.schema).
    `model_config(task, index)` gives a task's architecture, None to skip the task (a model that does not
    exist yet and has no preset fails later, when its role loads it); `model_config=None` checks nothing.
    KV heads fewer than tp are not an error: the table replicates them."""
    if model_config is None:
        return
    for i, task in enumerate(cfg.tasks):
        model = model_config(task, i)
        if model is None:
            continue
        if task.rollout.engine == "sglang_jax":
            from workers.rollout import sglang_compat  # pure Python: the families table, no sglang-jax or JAX

            try:
                sglang_compat.check_model(model)
            except sglang_compat.UnsupportedModelError as err:
                raise ConfigError(f"tasks.{i}.rollout.engine: {err} (model: {_model_source(task)})") from None
        if task.lora is not None:  # an MLP target needs a dense MLP in every layer
            from workers.models.config import ModelConfigError
            from workers.models.lora import check_targets  # numpy and the model's config only

            try:
                check_targets(model, task.lora.targets)
            except ModelConfigError as err:
                raise ConfigError(f"tasks.{i}.{err} (model: {_model_source(task)})") from None
        g, positions = task.grpo, model.max_position_embeddings
        if g.max_prompt_len + g.max_new_tokens > positions:
            raise ConfigError(f"tasks.{i}.grpo.max_new_tokens: max_prompt_len {g.max_prompt_len} + max_new_tokens "
                              f"{g.max_new_tokens} = {g.max_prompt_len + g.max_new_tokens} positions, but the model "
                              f"has max_position_embeddings {positions} ({_model_source(task)}); lower them")
        shapes, kv_heads = model.param_shapes(), model.num_key_value_heads
        for key, mesh in ((f"tasks.{i}.actor.mesh", task.actor.mesh.as_dict()),
                          (f"tasks.{i}.rollout.mesh", task.rollout.mesh.as_dict())):
            if mesh.get("ep", 1) > 1 and not getattr(model, "num_experts", 0):
                raise ConfigError(f"{key}.ep: ep {mesh['ep']} splits experts, but the model ({_model_source(task)}) is "
                                  f"a {model.describe()} without experts; use dp {mesh['ep']} for the same rows")
            try:
                sharding.check(shapes, mesh, kv_heads=kv_heads)
            except sharding.ShardingError as err:
                raise ConfigError(f"{key}: {err}") from None


# ---- the platform --------------------------------------------------------------------------------------------


def platform_kind(platform: str) -> str:
    """"cpu", "gpu" or "tpu" from a JAX platform name (cuda and rocm are gpu) or a Ray resource (CPU/GPU/TPU)."""
    kind = platform.lower()
    kind = "gpu" if kind in ("cuda", "rocm") else kind
    if kind not in PLATFORMS:
        raise ConfigError(f"platform {platform!r} is not one rlsched runs on; expected one of {', '.join(PLATFORMS)}")
    return kind


def resolve_processes(setting: str, platform: str) -> str:
    """`cluster.processes` once the platform is known: auto is per_device_group on every platform, CPU included
    (what the hardware needs is what everything runs: a TPU chip opens in one process, a GPU's freed memory stays
    in the process that freed it); per_role only when asked for."""
    platform_kind(platform)  # an unknown platform is named here
    return "per_device_group" if setting == "auto" else setting


def check_platform(platform: str, cfg: ExperimentConfig, processes: str) -> None:
    """Refuse what cannot run on `platform` with roles in `processes` (resolved: per_role or
    per_device_group), before any role process starts; one ConfigError line naming the key.

    - tpu, per_role, when two role processes would share chips (colocated, or several tasks' actors on one
      train group): a TPU chip is opened by one process at a time.
    - gpu, per_role, a mesh of more than one device: roles that time-share a GPU each take a fraction of it
      from Ray, and Ray gives a fractional share exactly one device.
    - tpu, per_device_group, with an engine that needs a process of its own (sglang_jax): it would open chips
      the group's process holds. On CPU and GPU it runs beside the group's process, in a process of its own.
    - gpu or tpu, per_role, with cluster.hosts > 1: a host's devices are held by one process for both roles.
    CPU runs everything: its devices are per-process host devices."""
    kind = platform_kind(platform)
    if cfg.cluster.hosts > 1 and kind != "cpu" and processes != "per_device_group":
        raise ConfigError(f"cluster.processes: per_role with cluster.hosts {cfg.cluster.hosts} on {kind}: each "
                          "host's devices must be held by one process for both roles, so a device group across "
                          "hosts is one process per host; use cluster.processes=per_device_group (or auto)")
    if processes == "per_device_group":
        for i, task in enumerate(cfg.tasks):
            if task.rollout.engine in OWN_PROCESS_ENGINES and kind == "tpu":
                raise ConfigError(f"tasks.{i}.rollout.engine: {task.rollout.engine} runs in a process of its own, but "
                                  "on tpu the device group's process holds the chips (a chip opens in one process); "
                                  "use rollout.engine=jax_sampler, or cluster.processes=per_role where no two role "
                                  "processes share a chip (disaggregated, one task)")
        return
    shared = cfg.cluster.placement == "colocated" or len(cfg.tasks) > 1
    if kind == "tpu" and shared:
        why = "each task's actor and engine share chips" if cfg.cluster.placement == "colocated" else \
            f"the {len(cfg.tasks)} tasks' actors share the train group's chips"
        raise ConfigError(f"cluster.processes: per_role on tpu cannot work here: {why}, and a TPU chip is opened by "
                          "one process at a time; use cluster.processes=per_device_group (or auto)")
    if kind == "gpu" and shared:
        for i, task in enumerate(cfg.tasks):
            for key, mesh in (("actor.mesh", task.actor.mesh), ("rollout.mesh", task.rollout.mesh)):
                shape = mesh.as_dict()
                n = sharding.num_devices(shape)
                if n > 1:
                    raise ConfigError(f"cluster.processes: per_role on gpu gives each role that time-shares a GPU a "
                                      f"fraction of one device, but tasks.{i}.{key} ({sharding.describe(shape)})"
                                      f" needs {n}; use cluster.processes=per_device_group (or auto)")
