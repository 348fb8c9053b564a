"""Meshes and `rlsched plan`: which devices each role gets, bytes per device by hand, and every mesh error
through the real CLI (one stderr line, exit 2, before any process starts)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlsched.cli import main
from rlsched.config.loading import load_config, select_tasks
from rlsched.config.meshes import check_meshes, check_platform, read_model_config, role_devices, task_devices
from rlsched.config.plan import FIT, SharedHold, actor_bytes, device_plan, engine_bytes, layer_width_bytes
from rlsched.config.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

# Qwen3-1.7B's config.json (the fields that shape it): a plan needs no weights.
QWEN3_1P7B = {"model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
              "tie_word_embeddings": True, "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}
QWEN2P5_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
              "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
              "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
              "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 131072,
              "max_window_layers": 28, "torch_dtype": "bfloat16"}  # Qwen2.5-7B-Instruct
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                 "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
                 "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
                 "tie_word_embeddings": False, "router_aux_loss_coef": 0.001, "output_router_logits": False,
                 "torch_dtype": "bfloat16"}


# --- role_devices --------------------------------------------------------------------------------------------


def test_colocated_roles_share_the_first_devices():
    assert role_devices("colocated", 8, {"fsdp": 4, "tp": 2}, {"tp": 2}) == {"actor": list(range(8)),
                                                                             "engine": [0, 1]}
    assert role_devices("colocated", 8, {}, {}) == {"actor": [0], "engine": [0]}


def test_disaggregated_engine_first_actor_last():
    assert role_devices("disaggregated", 4, {"fsdp": 2}, {"tp": 2}) == {"actor": [2, 3], "engine": [0, 1]}
    # A larger pool leaves the middle free: the actor takes the last devices.
    assert role_devices("disaggregated", 8, {"fsdp": 2}, {"tp": 2}) == {"actor": [6, 7], "engine": [0, 1]}
    with pytest.raises(ConfigError, match=r"disaggregated: the actor mesh \(fsdp 4\) and the rollout mesh \(tp 2\) "
                                          r"need 6 devices; the pool has 4"):
        role_devices("disaggregated", 4, {"fsdp": 4}, {"tp": 2})


def test_disaggregated_tasks_of_different_sizes_never_overlap(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text((CONFIGS / "demo_mesh.yaml").read_text())
    cfg = load_config(path, ["cluster.placement=disaggregated", "cluster.num_devices=null",
                             "tasks.0.rollout.mesh={dp: 1, tp: 1}", "tasks.0.actor.mesh={fsdp: 2, tp: 1}",
                             "tasks.1.rollout.mesh={dp: 2, tp: 2}", "tasks.1.actor.mesh={fsdp: 2, tp: 2}"])
    assert cfg.num_devices == 8  # largest rollout mesh 4 + largest actor mesh 4
    devices = task_devices(cfg)
    assert devices == {"addition": {"actor": [6, 7], "engine": [0]},
                       "subtraction": {"actor": [4, 5, 6, 7], "engine": [0, 1, 2, 3]}}
    engines = {d for t in devices.values() for d in t["engine"]}
    actors = {d for t in devices.values() for d in t["actor"]}
    assert not engines & actors


def test_an_fsdp_actor_counts_the_weights_it_gathers(tmp_path, monkeypatch):
    """The small preset (hidden 256, MLP 768, 4 layers, 4 heads, 2 KV heads, head_dim 128, vocabulary 4,096, untied),
    bfloat16. Per layer q (256, 512), k and v (256, 256), o (512, 256), gate/up (256, 768), down (768, 256): 983,040
    values in matrices, all split over fsdp (the norms are not: nothing to gather); embed (4,096, 256) and the head
    (256, 4,096): 2 x 1,048,576. On fsdp 2 a device gathers a layer at a time, whole (with its 768 values of norms:
    983,808, bfloat16; with remat off the forward's gathers of every layer wait for the backward: the half it lacks
    of all 4), and both vocabulary matrices whole (bfloat16), a full-weight actor their float32 gradients too."""
    from rlsched.config.plan import fsdp_gathered_bytes
    from workers.models.presets import preset_config

    model = preset_config("small", vocab_size=4096, dtype="bfloat16")
    mesh = {"dp": 1, "fsdp": 2, "ep": 1, "tp": 1}
    layer, vocab = 983_808 * 2, 2 * 1_048_576
    assert fsdp_gathered_bytes(model, mesh, 2, trained=True) == layer + vocab * (2 + 4)
    assert fsdp_gathered_bytes(model, mesh, 2, trained=False) == layer + vocab * 2  # a LoRA actor's frozen base
    assert fsdp_gathered_bytes(model, mesh, 2, trained=True, remat="off") == 4 * 983_040 // 2 * 2 + vocab * (2 + 4)
    # tp 2 splits what fsdp gathers: heads (2 KV heads split too), the MLP's width and the vocabulary; not the norms
    assert fsdp_gathered_bytes(model, mesh | {"tp": 2}, 2, trained=True) == (983_040 // 2 + 768) * 2 + vocab * 3
    assert fsdp_gathered_bytes(model, mesh | {"fsdp": 1}, 2, trained=True) == 0  # nothing to gather

    # in the plan, an fsdp actor's activations carry it: the tiny preset (float32) on fsdp 2 gathers a layer whole
    # (86,400 values), and its tied embedding (384, 64) whole with its float32 gradient
    cfg = _demo_mesh(tmp_path, ["tasks.0.actor.mesh={fsdp: 2, tp: 1}"])
    task, tiny = cfg.tasks[0], read_model_config(cfg.tasks[0], 0)
    counted = actor_bytes(task, tiny)["activations"]
    monkeypatch.setattr("rlsched.config.plan.fsdp_gathered_bytes", lambda *a, **k: 0)
    assert counted - actor_bytes(task, tiny)["activations"] == 86_400 * 4 + 384 * 64 * (4 + 4)


def test_a_process_that_sees_only_its_group_places_the_mesh_within_it():
    """On an accelerator the group's host sees its bundle's devices only: the rule holds within them (engine
    first, disaggregated actor last); a process that sees the pool takes the role's place in it."""
    from rlsched.config.meshes import local_role_devices

    actor, rollout = {"fsdp": 2, "tp": 2}, {"tp": 2}
    assert local_role_devices("disaggregated", "actor", 8, 8, actor, rollout) == [4, 5, 6, 7]
    assert local_role_devices("disaggregated", "actor", 8, 6, actor, rollout) == [2, 3, 4, 5]  # the train group
    assert local_role_devices("disaggregated", "engine", 8, 2, actor, rollout) == [0, 1]
    assert local_role_devices("colocated", "actor", 8, 4, actor, rollout) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="the actor's mesh \\(fsdp 2 x tp 2\\) needs 4 devices, but its process "
                                          "sees 1"):
        local_role_devices("colocated", "actor", 8, 1, actor, rollout)


def test_bundles_reserve_each_groups_accelerators():
    from rlsched.cluster.ray_cluster import bundle_shapes, group_devices

    disagg = group_devices("disaggregated", 8, 2)
    assert bundle_shapes("disaggregated", "TPU", disagg) == [{"TPU": 2}, {"TPU": 6}]
    assert bundle_shapes("colocated", "GPU", group_devices("colocated", 8, 2)) == [{"GPU": 8}]
    assert bundle_shapes("disaggregated", "CPU", disagg) == [{"CPU": 1}, {"CPU": 1}]  # a core; devices are XLA's


def test_an_engine_with_a_process_of_its_own_runs_beside_the_group_process(tmp_path):
    """sglang_jax under per_device_group: its engine is a process of its own beside the group's (which holds the
    actor), so its weights go through the object store; a jax_sampler task of the same group keeps a local channel."""
    from rlsched.cluster.comm import LocalChannel, ObjectStoreChannel
    from rlsched.cluster.ray_cluster import RoleSites
    from rlsched.run.roles import channel_for

    cfg = _demo_mesh(tmp_path, ["cluster.processes=per_device_group", "tasks.0.rollout.engine=sglang_jax",
                                "tasks.0.rollout.mesh.tp=1"])
    where = RoleSites(None, {"engine": 0, "actor": 0}, {"engine": [0], "actor": [0]},
                          processes={"engine": "process", "actor": "process"})
    sglang, sampler = cfg.task_specs()
    assert type(channel_for(sglang, where)) is ObjectStoreChannel
    assert type(channel_for(sampler, where)) is LocalChannel


# --- the platform rule ---------------------------------------------------------------------------------------


def test_platform_rule(tmp_path):
    """Which role processes can run where: CPU takes anything; a TPU chip opens in one process; a GPU shared by
    role processes is a fraction of one device; an engine with a process of its own cannot be hosted."""
    from rlsched.config.meshes import resolve_processes

    colocated, disaggregated = _demo_mesh(tmp_path), _demo_mesh(tmp_path, ["cluster.placement=disaggregated"])
    one_task = _demo_mesh(tmp_path, ["cluster.placement=disaggregated", "--tasks", "addition"])
    # One execution model on every platform: what the demo and the tests run on CPU is what a GPU or TPU node runs.
    assert [resolve_processes("auto", p) for p in ("cpu", "CPU", "gpu", "cuda", "TPU")] == ["per_device_group"] * 5
    with pytest.raises(ConfigError, match="platform 'metal' is not one rlsched runs on"):
        resolve_processes("auto", "metal")
    assert resolve_processes("per_role", "tpu") == "per_role"
    for cfg in (colocated, disaggregated, one_task):
        for platform in ("cpu", "gpu", "tpu"):
            check_platform(platform, cfg, "per_device_group")
        check_platform("cpu", cfg, "per_role")
    with pytest.raises(ConfigError, match="^cluster.processes: per_role on tpu cannot work here: each task's actor "
                                          "and engine share chips, and a TPU chip is opened by one process at a time"):
        check_platform("tpu", colocated, "per_role")
    with pytest.raises(ConfigError, match="the 2 tasks' actors share the train group's chips"):
        check_platform("tpu", disaggregated, "per_role")
    check_platform("tpu", one_task, "per_role")  # one actor and one engine on chips of their own
    with pytest.raises(ConfigError, match=r"per_role on gpu .* tasks.0.actor.mesh \(fsdp 2 x tp 2\) needs 4"):
        check_platform("cuda", colocated, "per_role")
    sglang = _demo_mesh(tmp_path, [f"tasks.{i}.{k}" for i in (0, 1) for k in (
        "rollout.engine=sglang_jax", "rollout.mesh.tp=1")])
    with pytest.raises(ConfigError, match="tasks.0.rollout.engine: sglang_jax runs in a process of its own, but "
                                          "on tpu the device group's process holds the chips"):
        check_platform("tpu", sglang, "per_device_group")
    for platform in ("cpu", "gpu"):  # there it runs in a process of its own beside the group's
        check_platform(platform, sglang, "per_device_group")
    with pytest.raises(ConfigError, match="platform 'metal' is not one rlsched runs on"):
        check_platform("metal", colocated, "per_role")
    # A device group across hosts on an accelerator: one process per host holds both roles, never a process per role.
    hosts = _demo_mesh(tmp_path, ["cluster.hosts=2", "cluster.num_devices=4"])
    for platform in ("cpu", "gpu", "tpu"):
        check_platform(platform, hosts, "per_device_group")
    check_platform("cpu", hosts, "per_role")  # CPU devices are per-process host devices
    for platform in ("gpu", "tpu"):
        with pytest.raises(ConfigError, match=f"^cluster.processes: per_role with cluster.hosts 2 on {platform}: each "
                                              "host's devices must be held by one process for both roles"):
            check_platform(platform, hosts, "per_role")


# --- bytes per device, by hand -------------------------------------------------------------------------------


def _demo_mesh(tmp_path, overrides=()):
    """configs/demo_mesh.yaml with its models absent: the plan reads the tiny preset's shapes. `--tasks` and a
    name in `overrides` keep only that task."""
    sets = [o for o in overrides if not o.startswith("--") and "=" in o]
    names = [o for o in overrides if "=" not in o and not o.startswith("--")]
    cfg = load_config(CONFIGS / "demo_mesh.yaml", [f"tasks.0.model.path={tmp_path / 'a'}",
                                                   f"tasks.1.model.path={tmp_path / 'b'}", *sets])
    return select_tasks(cfg, names) if names else cfg


def test_tiny_plan_by_hand(tmp_path):
    """The tiny preset: vocab 384, hidden 64, MLP 192, 2 layers, 2 heads, 1 KV head, head_dim 128, tied.
    Per layer: q (64, 256), k and v (64, 128), o (256, 64), gate/up (64, 192), down (192, 64), norms 64 + 64
    + 128 + 128 = 384 values (replicated); embed (384, 64) and the final norm (64)."""
    cfg = _demo_mesh(tmp_path)
    task, model = cfg.tasks[0], read_model_config(cfg.tasks[0], 0)
    assert model.num_params == 197_440  # 24,576 + 64 + 2 x 86,400
    # actor fsdp 2 x tp 2: embed 192 x 32 = 6,144; per layer q 32 x 128, k and v 32 x 128 (one KV head cannot
    # split over tp 2: replicated), o 128 x 32 -> 4 x 4,096; gate/up 32 x 96, down 96 x 32 -> 3 x 3,072; norms
    # 384. (6,144 + 64 + 2 x (16,384 + 9,216 + 384)) = 58,176 values x 4 bytes (float32).
    params = 58_176 * 4
    assert actor_bytes(task, model) == {
        "params": params, "grads": params,
        "optimizer": 2 * params + 8,  # two moments + Adam's and the schedule's int32 counts
        # micro-batch 64 / (dp 1 x fsdp 2) = 32 rows x [XLA:GPU's count (the default backend), remat layers: 2
        # layers' inputs (4 B x 20 tokens x 64) + the rest (8 B x 20 x 64) + the larger of one layer recomputed (20
        # tokens x (8 x 64 + 8 x 2 x 128 / tp 2 + 8 x 128, the one KV head whole + 8 x 192 / 2) = 20 x 3,328, + 2 B x
        # 1 head per tp x 20^2 scores) and the head on each row's completion window (max_new_tokens 4 log-prob
        # positions, one chunk: 4 x 8 B x 384 / tp 2)]; a float32 model: no vocabulary gradient in the model's dtype.
        # On fsdp 2, what it gathers: a layer at a time, whole over fsdp (split over tp 2 alone: 4 x 8,192 + 3 x 6,144
        # + 384 of norms = 51,584 values); the embedding (192 x 64 = 12,288 values) and its float32 gradient whole
        "activations": 32 * (2 * 4 * 20 * 64 + 8 * 20 * 64 + max(20 * 3_328 + 2 * 1 * 20 * 20, 4 * 8 * 192))
        + 51_584 * 4 + 12_288 * (4 + 4),
    }
    # engine tp 2: embed 192 x 64 = 12,288; per layer q 64 x 128, k, v 64 x 128 (replicated), o 128 x 64 ->
    # 4 x 8,192; gate/up 64 x 96, down 96 x 64 -> 3 x 6,144; norms 384: 12,288 + 64 + 2 x 51,584 = 115,520.
    # KV cache: 256 rows x 20 slots x 2 layers x (k, v) x 1 head (replicated) x 128 x 4 bytes = 10 MiB.
    assert engine_bytes(task, model) == {"params": 115_520 * 4, "kv_cache": 256 * 20 * 2 * 2 * 1 * 128 * 4}
    assert 256 * 20 * 2 * 2 * 128 * 4 == 10 * 2**20

    plan = device_plan(cfg)
    actor = sum(actor_bytes(task, model).values())
    engine = sum(engine_bytes(task, model).values())
    # Colocated, two identical tasks: devices 0-1 hold both actors and both engines, 2-3 the actors only.
    assert plan.per_device == [2 * (actor + engine)] * 2 + [2 * actor] * 2 + [0] * 4
    (group,) = plan.groups
    assert (group.name, group.devices, group.resident, group.largest_role, group.fits) == (
        "shared", list(range(8)), 2 * (actor + engine), max(actor, engine), None)


def test_a_reference_model_doubles_the_params_it_keeps(tmp_path):
    cfg = _demo_mesh(tmp_path, ["tasks.0.grpo.beta=0.04"])
    b = actor_bytes(cfg.tasks[0], read_model_config(cfg.tasks[0], 0))
    assert b["reference"] == b["params"] == 58_176 * 4
    # actor.offload_reference: on the devices for its log-probs alone, under the gradient and update that follow
    off = actor_bytes(_demo_mesh(tmp_path, ["tasks.0.grpo.beta=0.04", "tasks.0.actor.offload_reference=true"]).tasks[0],
                      read_model_config(cfg.tasks[0], 0))
    assert "reference" not in off and off == {k: v for k, v in b.items() if k != "reference"}


def test_a_bfloat16_actor_plans_its_float32_master_and_holds_what_it_plans(tmp_path, tiny_model_dir):
    """A bfloat16 model trains float32 master weights (workers.actor). The tiny preset has 197,440 parameters: on
    one device the actor holds the master (4 bytes each) and the bfloat16 params it serves (2), float32 gradients
    (4) and two float32 moments (8) + 8 bytes of step counts; the reference (beta > 0) is bfloat16 (2). A float32
    model's params are its master: 4 bytes each everywhere."""
    from tests.test_mixed_precision import SETTINGS
    from workers.actor import ActorWorker
    from workers.models import load_pretrained

    one = ["tasks.0.actor.mesh={fsdp: 1, tp: 1}", "tasks.0.grpo.beta=0.04"]
    cfg = _demo_mesh(tmp_path, [*one, "tasks.0.model.dtype=bfloat16"])
    model = read_model_config(cfg.tasks[0], 0)
    b, n = actor_bytes(cfg.tasks[0], model), 197_440
    assert (b["params"], b["grads"], b["optimizer"], b["reference"]) == (6 * n, 4 * n, 8 * n + 8, 2 * n)
    f32 = actor_bytes(_demo_mesh(tmp_path, one).tasks[0], model)
    assert (f32["params"], f32["grads"], f32["optimizer"], f32["reference"]) == (4 * n, 4 * n, 8 * n + 8, 4 * n)
    # What a live actor of the tiny model holds, once it has published (the served copy is made then)
    actor = ActorWorker(load_pretrained(tiny_model_dir, dtype="bfloat16", with_tokenizer=False)[0],
                        dataclasses.replace(SETTINGS, beta=0.04))
    actor.export_weights()
    assert actor.memory_bytes() == {"params": b["params"], "opt": b["optimizer"], "ref": b["reference"]}


def test_optimizer_bytes_are_what_optax_allocates(tmp_path):
    """The plan's AdamW arithmetic against the real optimizer's state (shapes only: nothing is allocated)."""
    import jax
    import numpy as np

    from rlsched.config.spec import actor_settings
    from workers.train_step import make_optimizer

    for mu, per_param in (("float32", 4 + 4), ("bfloat16", 2 + 4)):  # actor.adam_mu_dtype: the first moment's
        cfg = _demo_mesh(tmp_path, ["tasks.0.actor.mesh={fsdp: 1, tp: 1}", f"tasks.0.actor.adam_mu_dtype={mu}"])
        task, model = cfg.tasks[0], read_model_config(cfg.tasks[0], 0)
        params = {name: jax.ShapeDtypeStruct(shape, np.float32) for name, shape in model.param_shapes().items()}
        state = jax.eval_shape(make_optimizer(actor_settings(cfg.tasks[0])).init, params)
        allocated = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))
        assert actor_bytes(task, model)["optimizer"] == allocated == 197_440 * per_param + 8, mu


def test_qwen3_1p7b_recipe_plan_by_hand(tmp_path, capsys):
    """configs/gsm8k_qwen3_1p7b_mesh.yaml from Qwen3-1.7B's config.json alone.

    Parameters: embed 151,936 x 2,048 = 311,164,928; per layer q 2,048 x 2,048, k and v 2,048 x 1,024,
    o 2,048 x 2,048, gate/up/down 3 x 2,048 x 6,144, norms 2 x 2,048 + 2 x 128 = 4,352 -> 50,336,000;
    28 layers + the final norm (2,048): 1,720,574,976. Replicated (norms): 28 x 4,352 + 2,048 = 123,904.
    Every other dimension splits exactly (8 KV heads over tp 2)."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_1P7B))
    assert main(["plan", str(CONFIGS / "gsm8k_qwen3_1p7b_mesh.yaml"), "--set", f"tasks.0.model.path={tmp_path}",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    total, replicated = 1_720_574_976, 123_904
    actor_params = ((total - replicated) // 8 + replicated) * 2  # fsdp 4 x tp 2, bfloat16
    engine_params = ((total - replicated) // 2 + replicated) * 2  # tp 2
    assert actor_params == 430_360_576 and engine_params == 1_720_698_880
    actor, engine = plan["roles"]
    assert (actor["role"], actor["mesh"], actor["devices"]) == (
        "actor", {"dp": 1, "fsdp": 4, "ep": 1, "tp": 2}, list(range(8)))
    assert (engine["role"], engine["mesh"], engine["devices"]) == (
        "engine", {"dp": 1, "fsdp": 1, "ep": 1, "tp": 2}, [0, 1])
    # XLA:GPU's count (the default backend): 2 rows x [remat layers, bfloat16: 28 layers' inputs (2 B x 1,280 x 2,048)
    # + the rest (4 B x 1,280 x 2,048) + one layer recomputed (1,280 tokens x 4 B x (2,048 + 16 / tp 2 heads x 128 + 8
    # / 2 KV heads x 128 + 6,144 / 2) + 2 B x 8 heads x 1,280^2) or the head's chunk (128 positions x 8 B x 151,936 /
    # tp 2), whichever is larger: the chunk (on fsdp the embedding's float32 gradient is a shard, no room for it)] +
    # the bfloat16 gradient of the tied embedding (2 B x 151,936 x 2,048 / (fsdp 4 x tp 2)) + the accumulation of 16
    # micro-batches of 8 (0.1 x the float32 master, 2 x actor_params) + what fsdp 4 gathers: a layer at a time over tp
    # 2 ((50,336,000 - 4,352 norms) / 2 + 4,352 values, bfloat16) and the embedding over tp 2, bfloat16, with its
    # float32 gradient whole (151,936 x 2,048 / 2 x (2 + 4) B): 1.62 GB. The update allocates
    # nothing beside the gradient (a float32 first moment). One optimizer step a GRPO step (mini-batch 128 = the step's
    # samples): the forward reads the bfloat16 copy the actor serves, no cast
    work, head = 1280 * 4 * (2048 + 1024 + 512 + 3072) + 2 * 8 * 1280**2, 128 * 8 * 151_936 // 2
    gathered = ((50_336_000 - 4_352) // 2 + 4_352) * 2 + 151_936 * 2048 // 2 * (2 + 4)
    activations = (8 // 4) * (28 * 2 * 1280 * 2048 + 4 * 1280 * 2048 + max(work, head)) \
        + 2 * 151_936 * 2048 // 8 + int(0.1 * 2 * actor_params) + gathered
    assert head > work and activations == 1_617_853_747
    # bfloat16: the actor trains float32 master weights (2 x the bfloat16 bytes) and serves the bfloat16 params;
    # its gradients and both moments are float32; the reference (beta 0.08) is bfloat16
    assert actor["bytes"] == {
        "params": 3 * actor_params, "grads": 2 * actor_params, "optimizer": 4 * actor_params + 8,
        "reference": actor_params,
        "activations": activations,
        "total": 10 * actor_params + 8 + activations}
    kv = 64 * (256 + 1024) * 28 * 2 * (8 // 2) * 128 * 2  # 64 rows x 1,280 slots x 28 layers x (k, v) x 4 heads
    assert engine["bytes"] == {"params": engine_params, "kv_cache": kv, "total": engine_params + kv}
    assert kv == 4_697_620_480
    device0 = 10 * actor_params + 8 + activations + engine_params + kv
    assert plan["per_device"] == [device0] * 2 + [10 * actor_params + 8 + activations] * 6
    assert plan["memory_budget_bytes"] == 64 * 2**30 and plan["groups"][0]["fits"] == "yes" and plan["runnable"]


def _recipe(tmp_path, name: str, config_json: dict):
    """configs/<name> validated, with its model's config.json (and nothing else) at tasks.0.model.path."""
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    return load_config(CONFIGS / name, [f"tasks.0.model.path={tmp_path}"])


@pytest.mark.parametrize(("name", "config_json", "model"), [
    ("gsm8k_qwen2p5_7b.yaml", QWEN2P5_7B, "/models/Qwen2.5-7B-Instruct"),
    ("gsm8k_qwen3_30b_a3b.yaml", QWEN3_30B_A3B, "/models/Qwen3-30B-A3B")])
def test_the_8_device_recipes_validate_and_split_their_models(tmp_path, name, config_json, model):
    assert load_config(CONFIGS / name).tasks[0].model.path == model
    cfg = _recipe(tmp_path, name, config_json)
    assert cfg.num_devices == 8
    check_meshes(cfg)  # every parameter of the real model splits over both meshes


def test_qwen2p5_7b_recipe_plan_by_hand(tmp_path):
    """configs/gsm8k_qwen2p5_7b.yaml from Qwen2.5-7B-Instruct's config.json alone.

    Parameters: embed and lm_head 2 x 152,064 x 3,584 = 1,089,994,752; per layer q 3,584 x 3,584 + bias 3,584,
    k and v 3,584 x 512 + bias 512 each, o 3,584 x 3,584, gate/up/down 3 x 3,584 x 18,944, norms 2 x 3,584
    -> 233,057,792; 28 layers + the final norm (3,584): 7,615,616,512. Replicated: the norms, 28 x 7,168 +
    3,584 = 204,288. The biases (4,608 per layer, 129,024) split over tp only; the rest over fsdp and tp."""
    plan = device_plan(_recipe(tmp_path, "gsm8k_qwen2p5_7b.yaml", QWEN2P5_7B))
    total, replicated, biases = 7_615_616_512, 204_288, 129_024
    assert plan.models["gsm8k"].startswith("Qwen2 of 7.62B params in bfloat16, 28 layers, 4 KV heads")
    actor_params = ((total - replicated - biases) // 8 + biases // 2 + replicated) * 2  # fsdp 4 x tp 2
    engine_params = ((total - replicated) // 4 + replicated) * 2  # tp 4: 4 KV heads, one per device
    assert actor_params == 1_904_358_400 and engine_params == 3_808_114_688
    # XLA:GPU's count: micro-batch 4 / fsdp 4 = 1 row x [28 layers' inputs (2 B x 1,280 x 3,584) + the rest (4 B x
    # 1,280 x 3,584) + one layer recomputed (1,280 tokens x 4 B x (3,584 + 28 / tp 2 heads x 128 + 4 / 2 KV heads x 128
    # + 18,944 / 2) + 2 B x 14 heads x 1,280^2), larger than the head's chunk (128 positions x 8 B x 152,064 / 2)]
    # + the bfloat16 gradients of the untied embedding and head (2 B x 2 x 152,064 x 3,584 / (fsdp 4 x tp 2)) + the
    # accumulation of 32 micro-batches (0.1 x the float32 master) + what fsdp 4 gathers: a layer at a time over tp 2
    # ((233,057,792 - 7,168 of norms) / 2 + 7,168 values, the biases split over tp too) and the embedding and head over
    # tp 2 in bfloat16 with their float32 gradients (2 x 152,064 x 3,584 / 2 x (2 + 4) B): 4.55 GB; the update
    # allocates nothing beside the gradient (a float32 first moment: rlsched.config.plan.UPDATE_COPIES)
    gathered = ((233_057_792 - 7_168) // 2 + 7_168) * 2 + 2 * 152_064 * 3584 // 2 * (2 + 4)
    activations = 1 * (28 * 2 * 1280 * 3584 + 4 * 1280 * 3584 + 1280 * 4 * (3584 + 1792 + 256 + 9472)
                       + 2 * 14 * 1280**2) + 2 * 2 * 152_064 * 3584 // 8 + int(0.1 * 2 * actor_params) + gathered
    assert activations == 4_554_878_464
    kv = 128 * 1280 * 28 * 2 * 1 * 128 * 2  # 128 rows x 1,280 slots x 28 layers x (k, v) x 1 head x 128 x bf16
    actor, engine = plan.roles
    assert (actor.devices, engine.devices) == (list(range(8)), [0, 1, 2, 3])
    assert actor.bytes == {"params": 3 * actor_params, "grads": 2 * actor_params,  # float32 master (module doc)
                           "optimizer": 4 * actor_params + 8, "reference": actor_params, "activations": activations}
    assert engine.bytes == {"params": engine_params, "kv_cache": kv}
    # 10 x 1,904,358,400 + 8 of state + 4,554,878,464 of activations
    assert (actor.total, engine.total) == (23_598_462_472, 6_156_924_928)  # 22.0, 5.7 GiB
    assert plan.per_device == [actor.total + engine.total] * 4 + [actor.total] * 4
    (group,) = plan.groups
    assert group.fits == "yes" and group.resident == 29_755_387_400 < 64 * 2**30  # 27.7 GiB


def test_qwen3_30b_a3b_recipe_plan_by_hand(tmp_path):
    """configs/gsm8k_qwen3_30b_a3b.yaml from Qwen3-30B-A3B's config.json alone: it fits a 141 GB H200 with every
    role resident, and no 8-device actor mesh fits the 64 GiB an 80 GB device has (the header's numbers).

    Parameters: embed and lm_head 2 x 151,936 x 2,048 = 622,329,856; per layer q 2,048 x 4,096, k and v
    2,048 x 512, o 4,096 x 2,048 (18,874,368), norms 2 x 2,048 + 2 x 128 = 4,352, router 2,048 x 128 =
    262,144, experts 3 x 128 x 2,048 x 768 = 603,979,776 -> 623,120,640; 48 layers + the final norm (2,048):
    30,532,122,624. Whole on every device (no fsdp): norms and routers, 48 x 266,496 + 2,048 = 12,793,856.
    Experts, 48 x 603,979,776 = 28,991,029,248, split over ep x tp = 8 on both meshes; the rest
    (1,528,299,520: attention, embed, lm_head) over tp, except k and v (2 x 2,048 x 512 x 48 = 100,663,296): their
    4 KV heads do not split over tp 8 on the actor's mesh, whole on every device there."""
    plan = device_plan(_recipe(tmp_path, "gsm8k_qwen3_30b_a3b.yaml", QWEN3_30B_A3B))
    total, whole, experts, kv_proj = 30_532_122_624, 12_793_856, 28_991_029_248, 100_663_296
    rest = total - whole - experts
    assert plan.models["gsm8k"].startswith("Qwen3-MoE (128 experts, top 8) of 30.53B params in bfloat16, 48 layers")
    actor_params = (experts // 8 + (rest - kv_proj) // 8 + kv_proj + whole) * 2  # tp 8
    engine_params = (experts // 8 + rest // 2 + whole) * 2  # ep 4 x tp 2
    assert actor_params == 7_831_580_672 and engine_params == 8_801_644_544
    # XLA:GPU's count: micro-batch 1 = 1 row x [48 layers' inputs (2 B x 1,280 x 2,048) + the rest (4 B x 1,280 x
    # 2,048) + one layer recomputed (1,280 tokens x (4 B x (2,048 + 32 / tp 8 heads x 128 + 4 KV heads x 128, whole:
    # 4 does not split over 8) + the MoE's 4 B x 12 values x 128 experts x 768 / tp 8) + 2 B x 4 heads x 1,280^2); the
    # head's chunk fits in the embedding's float32 gradient] + the bfloat16 gradients of the untied embedding and head
    # (2 B x 2 x 151,936 x 2,048 / tp 8) + the accumulation of 128 micro-batches (0.1 x the float32 master): 2.6 GiB,
    # the activations (the update allocates nothing beside the gradient with a float32 first moment)
    activations = 1 * (48 * 2 * 1280 * 2048 + 4 * 1280 * 2048
                       + 1280 * (4 * (2048 + 512 + 512) + 4 * 12 * 128 * 768 // 8) + 2 * 4 * 1280**2) \
        + 2 * 2 * 151_936 * 2048 // 8 + int(0.1 * 2 * actor_params)
    assert activations == 2_767_853_158
    kv = 32 * 1280 * 48 * 2 * 2 * 128 * 2  # 128 rows / ep 4 x 1,280 slots x 48 layers x (k, v) x 4 / tp 2 heads
    actor, engine = plan.roles
    assert (actor.mesh, engine.mesh) == ({"dp": 1, "fsdp": 1, "ep": 1, "tp": 8}, {"dp": 1, "fsdp": 1, "ep": 4, "tp": 2})
    assert actor.bytes == {"params": 3 * actor_params, "grads": 2 * actor_params,  # float32 master (module doc)
                           "optimizer": 4 * actor_params + 8, "reference": actor_params, "activations": activations}
    assert engine.bytes == {"params": engine_params, "kv_cache": kv}
    # actor: 10 x 7,831,580,672 + 8 = 78,315,806,728 of state (72.9 GiB) + activations 2,767,853,158:
    # 81,083,659,886 (75.5 GiB)
    assert (actor.total, engine.total) == (81_083_659_886, 10_814_910_464)  # 75.5 GiB, 10.1 GiB
    (group,) = plan.groups
    # 81,083,659,886 + 10,814,910,464 = 91,898,570,350 (85.6 GiB) <= 112 GiB: no role need offload
    assert (group.resident, group.largest_role, group.fits) == (91_898_570_350, actor.total, "yes")
    assert group.resident <= 112 * 2**30 and plan.runnable

    # The 80 GB budget: the actor alone at one row per device, for the header's layouts (GiB, one decimal). Each is
    # over 64 GiB by its state alone; e.g. fsdp 2 x ep 4: params (experts / 8 + rest / fsdp 2 + routers / 2 + norms
    # 210,944) x 2 B = 8,789,061,632 -> 10 x that + 8 = 87,890,616,328, + activations of 4 rows per device (micro-batch
    # 8 / fsdp 2) 8,821,020,262, + what fsdp 2 gathers: a layer at a time, whole over fsdp (its attention, norms,
    # router and experts over ep 4: 18,874,368 + 4,352 + 262,144 + 603,979,776 / 4 values) in bfloat16, and both
    # vocabulary matrices (622,329,856 values) in bfloat16 with their float32 gradients, 4,074,250,752:
    # 100,785,887,342 = 93.9 GiB.
    assert (18_874_368 + 4_352 + 262_144 + 603_979_776 // 4) * 2 + 622_329_856 * 6 == 4_074_250_752
    for mesh, micro, gib in (("{fsdp: 2, ep: 4}", 8, 93.9), ("{fsdp: 2, ep: 2, tp: 2}", 4, 81.7),
                             ("{ep: 2, tp: 4}", 2, 78.3), ("{tp: 8}", 1, 75.5)):
        cfg = load_config(CONFIGS / "gsm8k_qwen3_30b_a3b.yaml", [
            f"tasks.0.model.path={tmp_path}", f"tasks.0.actor.mesh={mesh}", f"tasks.0.grpo.micro_batch_size={micro}",
            "cluster.memory_budget_gb=64"])
        tight = device_plan(cfg)
        assert round(tight.roles[0].total / 2**30, 1) == gib and tight.groups[0].fits == "no", mesh


def test_moe_activations_count_experts_only_in_moe_layers():
    """tiny-qwen3moe: hidden 64, dense MLP 192 in layer 0, 4 experts of width 48 in layer 1, 2 heads, 1 KV head of 128,
    float32, XLA:CPU's count of a layer kept (remat off). Per token, the tp-split widths: q 16 B x 2 x 128 / tp, kv 16
    B x 128 (one KV head: whole), and the MLP: dense 22 B x 192 / tp, MoE 4 B x 12 x 4 experts x 48 / tp (ep splits
    the experts but gathers its rows: each device's rows meet every expert)."""
    from workers.models.presets import preset_config

    model = preset_config("tiny-qwen3moe", vocab_size=384)
    assert [model.moe_layer(i) for i in range(2)] == [False, True]
    per = FIT["cpu"]["float32"].layer
    ep2_tp2 = {"dp": 1, "fsdp": 1, "ep": 2, "tp": 2}
    assert [layer_width_bytes(model, ep2_tp2, per, i) for i in range(2)] == [2_048 + 2_048 + 2_112,
                                                                            2_048 + 2_048 + 4_608]
    ep4 = {"dp": 1, "fsdp": 1, "ep": 4, "tp": 1}
    assert [layer_width_bytes(model, ep4, per, i) for i in range(2)] == [4_096 + 2_048 + 4_224, 4_096 + 2_048 + 9_216]


def test_budget_verdicts(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_1P7B))
    recipe = [str(CONFIGS / "gsm8k_qwen3_1p7b_mesh.yaml"), "--set", f"tasks.0.model.path={tmp_path}"]
    # Device 0 holds the actor, 5,921,459,515 B (5.5 GiB), and the engine, 6,418,319,360 B (6.0 GiB): 12,339,778,875 B
    # (11.5 GiB) resident (test_qwen3_1p7b_recipe_plan_by_hand's bytes). 12 GiB: both at once.
    assert main(["plan", *recipe, "--set", "cluster.memory_budget_gb=12"]) == 0
    out = capsys.readouterr().out
    assert "group shared (devices 0-7): 11.5 GiB on device 0 with every role resident; largest role 6.0 GiB; " \
           "fits\n" in out
    assert "gsm8k  actor   fsdp 4 x tp 2  0-7" in out and "gsm8k  engine  tp 2           0-1" in out
    # 8 GiB: not both at once, each alone.
    assert main(["plan", *recipe, "--set", "cluster.memory_budget_gb=8"]) == 0
    assert "11.5 GiB on device 0 with every role resident; largest role 6.0 GiB; fits one role at a time (idle roles " \
           "offload)" in capsys.readouterr().out
    # 5.8 GiB (6,227,702,579 B): the actor alone fits, the engine alone does not.
    assert main(["plan", *recipe, "--set", "cluster.memory_budget_gb=5.8"]) == 1
    out = capsys.readouterr()
    assert "largest role 6.0 GiB; does NOT fit: a role alone is over the budget" in out.out
    from conftest import own_lines

    assert own_lines(out.err) == [
        "error: a role does not fit cluster.memory_budget_gb even alone (see the group lines)"]


def test_disaggregated_plan_has_a_group_per_phase(tmp_path):
    plan = device_plan(_demo_mesh(tmp_path, ["cluster.placement=disaggregated", "cluster.num_devices=6",
                                             "cluster.memory_budget_gb=1"]))
    rollout, train = plan.groups
    assert (rollout.name, rollout.devices, train.name, train.devices) == ("rollout", [0, 1], "train", [2, 3, 4, 5])
    engine, actor = plan.roles[1].total, plan.roles[0].total
    assert plan.per_device == [2 * engine] * 2 + [2 * actor] * 4
    assert (rollout.resident, train.resident, rollout.fits, train.fits) == (2 * engine, 2 * actor, "yes", "yes")


def test_plan_needs_the_models_shapes(tmp_path):
    cfg = _demo_mesh(tmp_path, ["tasks.1.model.init_preset=null"])
    with pytest.raises(ConfigError, match=rf"tasks\.1\.model\.path: {tmp_path / 'b'} has no config\.json and "
                                          r"tasks\.1\.model\.init_preset is not set"):
        device_plan(cfg)


# --- through the CLI, in a real process ---------------------------------------------------------------------

TASK = """\
experiment: {{name: mesh-errors, output_dir: {out}}}
tasks:
  - name: addition
    model: {{path: {model}}}
    data: {{kind: addition}}
    reward: {{name: addition}}
    grpo: {{prompts_per_step: 16, num_generations: 16, mini_batch_size: 128, micro_batch_size: 64}}
    steps: 2
"""


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlsched.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


@pytest.fixture
def task_yaml(tmp_path, tiny_model_dir):
    path = tmp_path / "task.yaml"
    path.write_text(textwrap.dedent(TASK.format(out=tmp_path / "runs", model=tiny_model_dir)))
    return path


CONFIG_ERRORS = [  # caught when the config is validated: the same line from every command
    (["cluster.num_devices=2", "tasks.0.actor.mesh.fsdp=4"],
     "tasks.0.actor.mesh: fsdp 4 = 4 devices, but cluster.num_devices is 2"),
    (["cluster.num_devices=2", "tasks.0.rollout.mesh.tp=4"],
     "tasks.0.rollout.mesh: tp 4 = 4 devices, but cluster.num_devices is 2"),
    (["cluster.placement=disaggregated", "cluster.num_devices=4", "tasks.0.actor.mesh.fsdp=4",
      "tasks.0.rollout.mesh.tp=2"],
     "cluster.num_devices: disaggregated puts a rollout group of 2 devices (tasks.0.rollout.mesh: tp 2 = 2) beside "
     "a train group of 4 (tasks.0.actor.mesh: fsdp 4 = 4): 2 + 4 = 6 devices, but cluster.num_devices is 4"),
    (["tasks.0.actor.mesh={dp: 3}"],
     "tasks.0.actor.mesh: a micro-batch of 64 samples (grpo.micro_batch_size) does not split over dp 3 x fsdp 1 = 3"),
    (["tasks.0.rollout.mesh.dp=3"],
     "tasks.0.rollout.mesh: 256 samples/step (grpo.prompts_per_step 16 x grpo.num_generations 16) do not split "
     "over dp 3"),
    (["tasks.0.rollout.mesh.fsdp=2"], "tasks.0.rollout.mesh.fsdp: unknown key (got 2)"),
]


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


@pytest.mark.parametrize(("overrides", "expected"), CONFIG_ERRORS, ids=[o[-1] for o, _ in CONFIG_ERRORS])
def test_train_refuses_a_mesh_before_anything_starts(task_yaml, overrides, expected):
    line = _one_error_line(cli("train", str(task_yaml), *(a for o in overrides for a in ("--set", o))))
    assert f"error: {task_yaml}: {expected}" in line
    assert not (task_yaml.parent / "runs").exists()  # no run directory: nothing started


MODEL_ERRORS = [  # need the model's config.json: the tiny preset, vocab 384, hidden 64, q_proj (64, 256)
    (["tasks.0.actor.mesh.fsdp=128", "tasks.0.grpo.micro_batch_size=128"],
     "error: tasks.0.actor.mesh: model.embed_tokens.weight (384, 64): dimension 1 (embed, 64) does not split over "
     "fsdp 128 = 128"),
    (["tasks.0.actor.mesh.tp=3"],
     "error: tasks.0.actor.mesh: model.layers.0.self_attn.q_proj.kernel (64, 256): dimension 1 (heads, 256) does "
     "not split over tp 3 = 3"),
    (["tasks.0.rollout.mesh.tp=3"],
     "error: tasks.0.rollout.mesh: model.layers.0.self_attn.q_proj.kernel (64, 256): dimension 1 (heads, 256) does "
     "not split over tp 3 = 3"),
]


@pytest.mark.parametrize(("overrides", "expected"), MODEL_ERRORS, ids=[o[0] for o, _ in MODEL_ERRORS])
def test_plan_refuses_a_mesh_that_does_not_split_the_model(task_yaml, overrides, expected):
    assert _one_error_line(cli("plan", str(task_yaml), *(a for o in overrides for a in ("--set", o)))) == expected


def test_tp_above_the_kv_heads_is_not_an_error(task_yaml, capsys):
    """The tiny model has one KV head: tp 2 keeps it whole on both devices."""
    assert main(["plan", str(task_yaml), "--set", "tasks.0.actor.mesh.tp=2", "--set", "tasks.0.rollout.mesh.tp=2"]) == 0
    assert "addition  engine  tp 2" in capsys.readouterr().out


def test_demo_mesh_plans_without_jax():
    """`rlsched plan configs/demo_mesh.yaml` in a fresh process: exit 0, and JAX is never imported."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "rlsched.cli", "plan", "configs/demo_mesh.yaml"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "addition     actor   fsdp 2 x tp 2  0-3" in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")}
    heavy = {m for m in imported if m.split(".")[0] in ("jax", "flax", "torch")}
    assert "rlsched.config.plan" in imported and not heavy


def test_the_moe_recipe_plans_through_the_cli(tmp_path):
    """`rlsched plan configs/gsm8k_qwen3_30b_a3b.yaml` in a fresh process, from config.json alone."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    out = cli("plan", "configs/gsm8k_qwen3_30b_a3b.yaml", "--set", f"tasks.0.model.path={tmp_path}")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[1] == (f"task gsm8k: Qwen3-MoE (128 experts, top 8) of 30.53B params in bfloat16, 48 layers, 4 KV "
                        f"heads ({tmp_path / 'config.json'})")
    # columns padded to their widths; the bytes test_qwen3_30b_a3b_recipe_plan_by_hand counts
    assert [" ".join(line.split()) for line in lines[4:6]] == [
        "gsm8k actor tp 8 0-7 21.9 GiB 14.6 GiB 29.2 GiB 7.3 GiB - 2.6 GiB 75.5 GiB",
        "gsm8k engine ep 4 x tp 2 0-7 8.2 GiB - - - 1.9 GiB - 10.1 GiB"]
    assert lines[6] == ("group shared (devices 0-7): 85.6 GiB on device 0 with every role resident; largest role "
                        "75.5 GiB; fits")


def test_the_memory_line_puts_each_measured_kind_beside_the_plans():
    from rlsched.config.plan import measured_vs_plan

    line = measured_vs_plan("a", 1, {"actor": {"params": 2048, "opt": 4104, "ref": 0},
                                     "engine": {"params": 3 * 2**20, "kv": 0}},
                            {"actor": {"params": 2048, "grads": 2048, "optimizer": 4104, "activations": 9},
                             "engine": {"params": 3 * 2**20, "kv_cache": 5}})
    # no reference in the plan (beta 0): not shown; grads, activations and the KV cache live only inside a phase
    assert line == ("[a] bytes per device after step 1, measured / planned: actor params 2.0 KiB / 2.0 KiB, "
                    "optimizer 4.0 KiB / 4.0 KiB; engine params 3.0 MiB / 3.0 MiB")


def test_settings_that_could_only_fail_later_are_refused_before_anything_starts(task_yaml):
    """Positions past the model's, a budget smaller than one role, an address where no Ray listens: each
    one line naming the key (or address) and the numbers, before a run directory exists."""
    too_long = _one_error_line(cli("train", str(task_yaml), "--set", "tasks.0.grpo.max_new_tokens=100000"))
    assert re.fullmatch(r"error: tasks\.0\.grpo\.max_new_tokens: max_prompt_len (\d+) \+ max_new_tokens 100000 = "
                        r"\d+ positions, but the model has max_position_embeddings 4096 \(.*config\.json\); lower "
                        r"them", too_long), too_long
    small = _one_error_line(cli("train", str(task_yaml), "--set", "cluster.memory_budget_gb=0.004"))
    assert re.fullmatch(r"error: cluster\.memory_budget_gb: 0\.004 GiB per device, but task addition's engine needs "
                        r"0\.\d+ GiB on one device \(params \S+ \S+ \+ kv cache \S+ \S+\); raise the budget or split "
                        r"the role wider with tasks\.0\.rollout\.max_batch_size or rollout\.mesh", small), small
    t0 = time.monotonic()
    nowhere = cli("train", str(task_yaml), "--address", "127.0.0.1:1")
    assert nowhere.returncode == 1 and time.monotonic() - t0 < 30 and "Traceback" not in nowhere.stderr
    assert nowhere.stderr.splitlines() == [
        "error: --address 127.0.0.1:1: no Ray cluster answers there (Connection refused); start one with `ray start "
        "--head` and pass the address it prints, or leave --address out for an embedded local Ray"]
    assert not (task_yaml.parent / "runs").exists()


def test_data_reward_and_output_dir_are_checked_before_anything_starts(task_yaml, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('\n{"prompt": "1+1=", "answer": "2"}\n')
    sets = [f"tasks.0.data={{kind: jsonl, path: {bad}}}", "tasks.0.reward.name=addition"]
    no_field = _one_error_line(cli("train", str(task_yaml), *(a for s in sets for a in ("--set", s))))
    assert no_field == (f"error: tasks.0.data.path: the first record of {bad} has no field 'question' (it has "
                        "['answer', 'prompt']); set tasks.0.data.question_field / answer_field")
    reward = _one_error_line(cli("train", str(task_yaml), "--set", "tasks.0.reward.name=additoin"))
    assert reward.startswith("error: tasks.0.reward.name: unknown reward 'additoin'; known rewards: addition, ")
    blocked = tmp_path / "file"
    blocked.write_text("")
    out_dir = _one_error_line(cli("train", str(task_yaml), "--set", f"experiment.output_dir={blocked / 'runs'}"))
    assert out_dir == (f"error: experiment.output_dir: {blocked} is not a directory, so {blocked / 'runs'} cannot "
                       f"hold the run (got '{blocked / 'runs'}')")
    assert not (task_yaml.parent / "runs").exists()


def test_per_role_processes_ask_for_what_their_platform_needs(tmp_path):
    """per_role on a GPU: every process that shares one frees what it offloads (no preallocation, the platform
    allocator), whenever roles share it: colocated, or several tasks on a group; on a TPU a role's process asks
    Ray for its bundle's chips (a chip opens in one process, so one that did not ask would not see it)."""
    from rlsched.cluster.ray_cluster import own_process_resources, role_env

    assert own_process_resources("GPU", 4) == {"num_gpus": 0.01}  # a share: roles time-share the device
    assert own_process_resources("TPU", 4) == {"num_cpus": 0, "resources": {"TPU": 4}}
    assert own_process_resources("CPU", 1) == {"num_cpus": 0.01}
    colocated = _demo_mesh(tmp_path)
    disaggregated = _demo_mesh(tmp_path, ["cluster.placement=disaggregated"])
    alone = _demo_mesh(tmp_path, ["cluster.placement=disaggregated", "--tasks", "addition"])
    assert [s.shares_devices for s in colocated.task_specs()] == [True, True]
    assert [s.shares_devices for s in disaggregated.task_specs()] == [True, True]  # two actors on one train group
    assert [s.shares_devices for s in alone.task_specs()] == [False]  # one actor, one engine: each alone
    sharing = role_env(1, "GPU", shares_devices=True)
    assert sharing["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and sharing["XLA_PYTHON_CLIENT_ALLOCATOR"] == "platform"
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in role_env(1, "GPU", shares_devices=False)


def test_a_star_override_plans_every_task_as_one_override_each_does():
    """`--set 'tasks.*.grpo.max_new_tokens=12'` through the CLI: the plan of one override per task (each task's KV
    cache grows), and a key no task has is refused with a line per task, exit 2."""
    demo = "configs/demo_multitask.yaml"
    star = cli("plan", demo, "--json", "--set", "tasks.*.grpo.max_new_tokens=12")
    each = cli("plan", demo, "--json", "--set", "tasks.0.grpo.max_new_tokens=12", "--set",
               "tasks.1.grpo.max_new_tokens=12")
    plain = cli("plan", demo, "--json")
    assert star.returncode == each.returncode == plain.returncode == 0, star.stderr + each.stderr
    assert json.loads(star.stdout) == json.loads(each.stdout)
    kv = [[r["bytes"].get("kv_cache") for r in json.loads(p.stdout)["roles"] if r["role"] == "engine"]
          for p in (plain, star)]
    assert all(k > p for p, k in zip(*kv, strict=True)), kv  # both tasks' caches hold 12 new tokens, not 4
    bad = cli("plan", demo, "--set", "tasks.*.stepz=10")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.splitlines() == [
        f"{'error: ' if i == 0 else ''}{demo}: tasks.{i}.stepz: unknown key (got 10); did you mean 'steps'? "
        "[from override 'tasks.*.stepz=10']" for i in (0, 1)]


def test_plan_of_an_absent_model_takes_published_shapes_as_check_does(tmp_path):
    """`rlsched plan configs/gsm8k_qwen3.yaml` on a machine without the weights: `--model qwen3-1.7b` (or a directory
    named like it) plans what Qwen3-1.7B's own config.json plans; an unnamed absent directory is refused, exit 2,
    with the flags that fix it (it said only "has no config.json", while `check` took --model)."""
    recipe = str(CONFIGS / "gsm8k_qwen3.yaml")
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "config.json").write_text(json.dumps(QWEN3_1P7B))
    runs = [cli("plan", recipe, "--json", "--set", f"tasks.0.model.path={tmp_path / path}", *flags)
            for path, flags in (("real", ()), ("absent", ("--model", "qwen3-1.7b")), ("Qwen3-1.7B", ()))]
    assert [r.returncode for r in runs] == [0, 0, 0], [r.stderr for r in runs]
    real, *published = [json.loads(r.stdout) for r in runs]
    for plan in published:
        assert plan["models"]["gsm8k"].endswith("has no config.json here)"), plan["models"]
        assert {k: v for k, v in plan.items() if k != "models"} == {k: v for k, v in real.items() if k != "models"}
    assert real["roles"][0]["bytes"]["params"] == 1_720_574_976 * 6  # float32 master + the bfloat16 it serves
    text = cli("plan", recipe, "--set", f"tasks.0.model.path={tmp_path / 'absent'}", "--model", "qwen3-1.7b")
    assert text.returncode == 0 and "Qwen3 of 1.72B params in bfloat16" in text.stdout, text.stderr
    refused = cli("plan", recipe, "--set", f"tasks.0.model.path={tmp_path / 'absent'}")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.startswith(f"error: tasks.0.model.path: {tmp_path / 'absent'} has no config.json here, so "
                                     "its shapes are unknown: give --model NAME (one of qwen3-0.6b, ")
    unknown = cli("plan", recipe, "--set", f"tasks.0.model.path={tmp_path / 'absent'}", "--model", "qwen9")
    assert unknown.returncode == 2 and "no published shapes for 'qwen9'; known: qwen3-0.6b" in unknown.stderr


def test_plan_counts_activations_for_the_backend_asked(tmp_path, capsys):
    """`rlsched plan --backend cpu` counts XLA:CPU's activations, which keep more than XLA:GPU's (the default): the
    1.7B recipe's actor, bfloat16 and accumulating 16 micro-batches, holds a float32 copy of its weights through the
    loop on XLA:CPU (1.7 x the float32 master, ACCUMULATION_COPIES); only the activations differ."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_1P7B))
    recipe = [str(CONFIGS / "gsm8k_qwen3_1p7b_mesh.yaml"), "--set", f"tasks.0.model.path={tmp_path}"]
    plans = {}
    for backend in ("gpu", "cpu"):
        assert main(["plan", *recipe, "--backend", backend, "--json"]) == 0
        plans[backend] = json.loads(capsys.readouterr().out)
        assert plans[backend]["backend"] == backend
    gpu, cpu = (plans[b]["roles"][0]["bytes"] for b in ("gpu", "cpu"))
    assert {k: v for k, v in gpu.items() if k not in ("activations", "total")} == \
        {k: v for k, v in cpu.items() if k not in ("activations", "total")}
    assert cpu["activations"] > gpu["activations"] + 1.6 * gpu["grads"]  # the float32 copy through the loop
    assert main(["plan", *recipe, "--backend", "cpu"]) == 0
    assert "(activations: XLA:CPU's, an estimate, see rlsched/config/plan.py)" in capsys.readouterr().out


def test_a_train_hold_of_a_task_holds_the_others_whose_rows_fit_fewest_first():
    """SharedHold.most_members: what its actor compiles joint updates for ahead (TaskSpec.train_cohort)."""
    hold = SharedHold(phase="train", key="k", tasks=["a", "b", "c", "d"], rows=[8, 4, 16, 4], capacity=16)
    assert [hold.most_members(t) for t in hold.tasks] == [3, 3, 1, 3]  # a: 8 + 4 + 4; c fills it alone
