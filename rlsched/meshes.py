"""Which devices each role's mesh gets, and whether a mesh can lay out its task's model.

    role_devices("colocated", 8, {"fsdp": 4, "tp": 2}, {"tp": 2})  # {"actor": [0..7], "engine": [0, 1]}
    check_meshes(cfg)                 # before any process starts: every mesh splits its model, or ConfigError
    check_platform("tpu", "colocated", colocated_in_one_process=False)   # ConfigError: it cannot work

Device indices are positions in the experiment's device pool (`ExperimentConfig.num_devices`): on CPU the
XLA host devices of a role's process, on GPU the Ray accelerator ids in the order of the group's bundle.

Design decisions:
- **Two layers of checks.** What needs no file (devices against `cluster.num_devices`, batch rows against
  dp x fsdp) is validated with the config (rlsched.config), so every load fails fast with the file and the
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

from rlsched.config import ConfigError, ExperimentConfig, TaskConfig
from workers.models import sharding
from workers.models.config import Qwen3Config

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


def task_devices(cfg: ExperimentConfig) -> dict[str, dict[str, list[int]]]:
    """{task: role_devices(...)} for every task of an experiment."""
    return {t.name: role_devices(cfg.cluster.placement, cfg.num_devices, t.actor.mesh.as_dict(),
                                 t.rollout.mesh.as_dict()) for t in cfg.tasks}


# ---- the model -------------------------------------------------------------------------------------------------

def read_model_config(task: TaskConfig, index: int, *, required: bool = False) -> Qwen3Config | None:
    """The task's model architecture: its config.json, else its `init_preset` (what `rlsched train` will
    create there, with the byte tokenizer), else None, or a ConfigError when `required`."""
    path = Path(task.model.path)
    if (path / "config.json").is_file():
        return Qwen3Config.from_dir(path)
    if task.model.init_preset is not None:
        # These import the tokenizer libraries (a second): only when a preset is asked for.
        from workers.models.presets import PRESETS
        from workers.models.tokenizer import BYTE_VOCAB_SIZE

        vocab = -(-BYTE_VOCAB_SIZE // 128) * 128  # rounded up as `init_model` does (259 tokens -> 384 rows)
        return Qwen3Config(vocab_size=vocab, **PRESETS[task.model.init_preset])
    if required:
        raise ConfigError(f"tasks.{index}.model.path: {path} has no config.json and tasks.{index}.model.init_preset "
                          "is not set; the model's shapes come from its config.json (weights are not read)")
    return None


ModelConfigs = Callable[[TaskConfig, int], Qwen3Config | None]


def check_meshes(cfg: ExperimentConfig, model_config: ModelConfigs | None = read_model_config) -> None:
    """Every task's actor and rollout mesh splits every parameter of its model, or one ConfigError line
    naming the key, the parameter, its shape and the axis.

    `cfg` is validated, so device counts and batch rows are checked already (rlsched.config).
    `model_config(task, index)` gives a task's architecture, None to skip the task (a model that does not
    exist yet and has no preset fails later, when its role loads it); `model_config=None` checks nothing.
    KV heads fewer than tp are not an error: the table replicates them."""
    if model_config is None:
        return
    for i, task in enumerate(cfg.tasks):
        model = model_config(task, i)
        if model is None:
            continue
        shapes, kv_heads = model.param_shapes(), model.num_key_value_heads
        for key, mesh in ((f"tasks.{i}.actor.mesh", task.actor.mesh.as_dict()),
                          (f"tasks.{i}.rollout.mesh", task.rollout.mesh.as_dict())):
            try:
                sharding.check(shapes, mesh, kv_heads=kv_heads)
            except sharding.ShardingError as err:
                raise ConfigError(f"{key}: {err}") from None


# ---- the platform --------------------------------------------------------------------------------------------


def check_platform(platform: str, placement: str, colocated_in_one_process: bool) -> None:
    """Refuse what cannot run on `platform` (a JAX platform name: cpu, gpu/cuda/rocm, tpu), before it starts.

    - tpu, colocated, actor and engine in two processes: a TPU chip is opened by one process at a time, so
      the second role could never reach the devices it shares with the first.
    Everything else can run: CPU devices are per-process host devices, and GPUs take several processes
    (each must leave the others memory: no XLA preallocation of most of the device)."""
    kind = "gpu" if platform in ("cuda", "rocm") else platform
    if kind not in PLATFORMS:
        raise ConfigError(f"platform {platform!r} is not one rlsched runs on; expected one of {', '.join(PLATFORMS)}")
    if kind == "tpu" and placement == "colocated" and not colocated_in_one_process:
        raise ConfigError("cluster.placement: colocated on tpu needs each task's actor and engine in one process "
                          "(a TPU chip is opened by one process at a time); use cluster.placement=disaggregated "
                          "or an engine that runs in its actor's process")
