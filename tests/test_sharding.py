"""Sharded roles on 8 CPU devices: the rule table, and a sharded actor / engine computing what one
device computes (transformers is the reference for one device; see test_models_reference.py)."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

from workers.actor import ActorWorker
from workers.models import load_pretrained
from workers.models import params as P
from workers.models import sharding as S
from workers.models.checkpoint import abstract_model
from workers.models.config import Qwen3Config
from workers.models.decoder import CausalLM
from workers.models.presets import PRESETS, preset_config
from workers.rollout import SamplingParams
from workers.rollout.jax_sampler import JaxSampler
from workers.train_step import ActorSettings

ACTOR_MESHES = [dict(dp=2, fsdp=2, tp=2), dict(fsdp=4, tp=2), dict(tp=4), dict(fsdp=8)]
ROLLOUT_MESHES = [dict(tp=2), dict(dp=2, tp=2), dict(tp=4)]


@pytest.fixture(scope="module")
def prompt_ids(tiny_model):
    _, tok = tiny_model
    return [tok.encode(p) for p in ("1+2=", "hello world", "what is 7 plus 8?", "x")]


def _mesh(shape):
    return S.mesh(shape, jax.devices()[: S.num_devices(shape)])


# ---- the table ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("bias", [False, True])
def test_every_parameter_has_a_rule_and_the_pure_shapes_are_the_models(preset, bias):
    cfg = preset_config(preset, vocab_size=384, attention_bias=bias)
    model = nnx.eval_shape(lambda: abstract_model(cfg))
    real = {k: tuple(v.shape) for k, v in P.to_flat(nnx.state(model, nnx.Param)).items()}
    assert cfg.param_shapes() == real  # what the control plane checks meshes against, without JAX
    assert all(S.logical_axes(name) for name in real)


def test_the_table_splits_as_it_says():
    small = Qwen3Config(vocab_size=384, **PRESETS["small"])  # 2 KV heads
    specs = S.param_specs(small.param_shapes(), dict(fsdp=4, tp=2), kv_heads=2)
    assert specs["model.embed_tokens.weight"] == ("tp", "fsdp")
    assert specs["lm_head.kernel"] == ("fsdp", "tp")
    assert specs["model.layers.0.self_attn.q_proj.kernel"] == ("fsdp", "tp")  # column parallel
    assert specs["model.layers.0.self_attn.k_proj.kernel"] == ("fsdp", "tp")
    assert specs["model.layers.0.self_attn.o_proj.kernel"] == ("tp", "fsdp")  # row parallel
    assert specs["model.layers.0.mlp.down_proj.kernel"] == ("tp", "fsdp")
    assert specs["model.layers.0.input_layernorm.weight"] == (None,)
    # tp 4 exceeds the 2 KV heads: k/v stay whole, the rest still splits.
    tp4 = S.param_specs(small.param_shapes(), dict(tp=4), kv_heads=2)
    assert tp4["model.layers.0.self_attn.v_proj.kernel"] == (None, None)
    assert tp4["model.layers.0.self_attn.q_proj.kernel"] == (None, "tp")
    assert S.shard_bytes((256, 512), ("fsdp", "tp"), dict(fsdp=4, tp=2), 4) == 256 * 512 * 4 // 8
    assert S.shard_bytes((256, 512), (("dp", "fsdp"), None), dict(dp=2, fsdp=4), 2) == 256 * 512 * 2 // 8


def test_a_misfit_names_the_parameter_its_shape_and_the_axis():
    tiny = Qwen3Config(vocab_size=384, **PRESETS["tiny"])
    with pytest.raises(S.ShardingError, match=re.escape(
            "model.embed_tokens.weight (384, 64): dimension 1 (embed, 64) does not split over fsdp 128 = 128")):
        S.check(tiny.param_shapes(), dict(fsdp=128), kv_heads=1)
    with pytest.raises(S.ShardingError, match=r"micro_batch_size = 6 does not split over dp 2 x fsdp 2 = 4"):
        S.check(tiny.param_shapes(), dict(dp=2, fsdp=2), kv_heads=1, batch_sizes={"micro_batch_size": 6})
    S.check(tiny.param_shapes(), dict(tp=2), kv_heads=1)  # tp over one KV head: replicated, not an error


# ---- the actor --------------------------------------------------------------------------------------------

# lr 1e-3 (already 100x a typical RL rate): Adam turns float-rounding noise in near-zero gradients into
# lr-sized steps, so a larger rate measures the optimizer's amplification rather than the sharding.
SETTINGS = ActorSettings(remat="layers", adam_mu_dtype="float32",
                         lr=1e-3, total_steps=4, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.01, grad_clip=1.0,
                         b1=0.9, b2=0.999, epsilon=0.2, epsilon_high=None, beta=0.0, aggregation="token-mean",
                         temperature=1.0, micro_batch_size=8, mini_batch_size=16, epochs=1, router_aux_loss_coef=None,
                         kl_clamp=None, max_new_tokens=None)


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 200, (16, 12)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    mask[::2, 9:] = False
    loss_mask = np.zeros((16, 11), np.float32)
    loss_mask[:, 4:8] = 1
    advantages = rng.normal(size=16).astype(np.float32)
    mini = {"tokens": tokens, "attention_mask": mask, "loss_mask": loss_mask, "advantages": advantages}
    return tokens, mask, {k: v.reshape(2, 8, *v.shape[1:]) for k, v in mini.items()}


def _train(model, shape):
    """logits of a batch, then 3 optimizer steps -> (logits, flat params, specs before, specs after, ...)."""
    actor = ActorWorker(model, SETTINGS, mesh=_mesh(shape))
    tokens, mask, mini = _batch()
    logits = jax.jit(lambda p: nnx.merge(actor.graphdef, p)(tokens, attention_mask=mask))(actor.state.params)
    before = {k: v.sharding for k, v in P.to_flat(actor.state.params).items()}
    program = actor._program("train", tuple(sorted(mini)))  # the gradient's (then `update`'s, elementwise)
    for _ in range(3):
        actor._steps([mini], [])
    flat = P.to_flat(actor.state.params)
    after = {k: v.sharding for k, v in flat.items()}
    return np.asarray(logits), {k: np.asarray(v) for k, v in flat.items()}, before, after, actor, program, mini


@pytest.fixture(scope="module")
def one_device(tiny_model_dir):
    return _train(load_pretrained(tiny_model_dir)[0], {})


@pytest.mark.slow
@pytest.mark.parametrize("shape", ACTOR_MESHES, ids=S.describe)
def test_a_sharded_actor_computes_what_one_device_does(tiny_model_dir, one_device, shape):
    logits, params, before, after, actor, _, _ = _train(load_pretrained(tiny_model_dir)[0], shape)
    ref_logits, ref_params = one_device[0], one_device[1]
    scale = float(np.max(np.abs(ref_logits)))
    assert np.max(np.abs(logits - ref_logits)) <= 1e-5 * scale
    # Three steps later, every parameter within 5e-5 (relative). Not 1e-5: Adam's first steps are nearly
    # sign(g) * lr, so a gradient element within rounding of zero moves a whole lr either way on another layout
    # (CI saw 1.02e-5 on fsdp 4 x tp 2 once); a layout that computed something else would be off by O(1).
    for name, ref in ref_params.items():
        assert np.linalg.norm(params[name] - ref) <= 5e-5 * np.linalg.norm(ref), name
    # Laid out as the table says, and still so after the steps: nothing came back gathered.
    specs = S.param_specs({k: v.shape for k, v in params.items()}, shape, kv_heads=actor.config.num_key_value_heads)
    for name, sharding in after.items():
        assert sharding == before[name] and tuple(sharding.spec) == specs[name], name
        leaf = P.to_flat(actor.state.params)[name]
        itemsize = leaf.dtype.itemsize
        assert leaf.addressable_shards[0].data.nbytes == S.shard_bytes(leaf.shape, specs[name], shape, itemsize)


@pytest.mark.slow
def test_the_compiled_train_step_never_gathers_a_tp_split_parameter_whole():
    # Dimensions chosen so no whole parameter has the shape of another's tp shard (tiny's tied embedding
    # shard, gathered over fsdp, is (192, 64): the shape of its whole down_proj).
    cfg = Qwen3Config(vocab_size=416, hidden_size=48, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    *_, actor, program, mini = _train(abstract_model(cfg), dict(fsdp=2, tp=2))
    hlo = program.lower(actor.state, mini).compile().as_text()
    gathered = {tuple(int(d) for d in m.group(1).split(",") if d)
                for m in re.finditer(r"= f32\[([\d,]*)\]\{[^}]*\} all-gather\(", hlo)}
    assert gathered, "fsdp gathers parameters per use; none found: the regex no longer reads the HLO"
    whole_tp = {tuple(v.shape) for k, v in P.to_flat(actor.state.params).items() if "tp" in v.sharding.spec}
    assert not gathered & whole_tp, f"whole tp-split parameters gathered: {gathered & whole_tp}"


@pytest.mark.slow
def test_on_fsdp_the_residual_stream_keeps_its_rows_and_the_weights_are_gathered():
    """An actor on fsdp 2 (the `small` preset, bfloat16): its gradient program gathers weights per use and keeps
    each layer's activations on their rows (CausalLM.forward's `rows`). Without that layout XLA's partitioner met
    rows and the weights' hidden dimension both split over fsdp and shuffled activations inside every layer: 37
    all-to-alls and 49 all-reduces in this program (2 and 8 with it), 229 all-to-alls and 2.5 x the temporaries at
    Qwen3-0.6B's shape (benchmarks/gpu_memory.py --fsdp). Each layer's 7 matrices are gathered twice, in the forward
    and again in the backward's recompute (32 gathers here when XLA merged the two, keeping every layer's gathered
    weights from one to the other: 2.6 x the temporaries of a Qwen3-4B gradient for 4 H100s)."""
    cfg = preset_config("small", vocab_size=512, dtype="bfloat16")
    actor = ActorWorker(CausalLM(cfg, rngs=nnx.Rngs(0)), dataclasses.replace(SETTINGS, mini_batch_size=8),
                        mesh=_mesh(dict(fsdp=2)))
    assert actor.prepare(8, 64) > 0
    (program,) = [p for key, p in actor._prepared.items() if key[0] == "train"]
    hlo = program.as_text()
    count = {op: len(re.findall(rf"= [^\n]*? {op}(?:-start)?\(", hlo)) for op in ("all-gather", "all-to-all")}
    assert count["all-gather"] >= 2 * 7 * cfg.num_hidden_layers, count  # the weights, gathered per use
    assert count["all-to-all"] < cfg.num_hidden_layers, count  # no activation shuffle per layer


@pytest.mark.slow
def test_offload_and_onload_of_a_sharded_actor_keep_values_and_layout(tiny_model_dir):
    model, _ = load_pretrained(tiny_model_dir)
    actor = ActorWorker(model, SETTINGS, mesh=_mesh(dict(fsdp=2, tp=2)))
    flat = P.to_flat(actor.state.params)
    values = {k: np.asarray(v) for k, v in flat.items()}
    layout = {k: v.sharding for k, v in flat.items()}
    actor.offload()
    assert actor.memory_bytes() == {"params": 0, "opt": 0, "ref": 0}
    actor.onload()
    for name, leaf in P.to_flat(actor.state.params).items():
        assert leaf.sharding == layout[name]
        np.testing.assert_array_equal(np.asarray(leaf), values[name])


@pytest.mark.slow
def test_a_sharded_actor_prepared_while_offloaded_trains_without_compiling_and_as_one_that_did_not(tiny_model_dir):
    """What a task does before asking for the train lock: compile the step's programs (logprobs, two
    mini-batches: off-policy, and a reference for beta > 0) while the state is on host. The train that follows
    compiles nothing and computes what an actor that compiled on first use computes, bit for bit."""
    from workers.batch import build_train_batch

    settings = dataclasses.replace(SETTINGS, beta=0.04, mini_batch_size=8, micro_batch_size=4)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 200, 5).astype(np.int32) for _ in range(16)]
    completions = [rng.integers(1, 200, int(rng.integers(1, 7))).astype(np.int32) for _ in range(16)]
    batch = build_train_batch(prompts, completions, rng.normal(size=16).astype(np.float32), pad_id=0)
    results = []
    for prepare in (False, True):
        model, _ = load_pretrained(tiny_model_dir)
        actor = ActorWorker(model, settings, mesh=_mesh(dict(fsdp=2, tp=2)))
        if prepare:
            actor.offload()
            assert actor.prepare(batch.size, batch.tokens.shape[1]) == 3  # logprobs, the gradient and the update
            assert actor.prepare(batch.size, batch.tokens.shape[1]) == 0
            actor.onload()
        metrics = actor.train(batch, step=1)
        jitted = [actor._program(*k) for k in actor._programs]
        results.append((metrics, P.to_flat(actor.state.params), sum(p._cache_size() for p in jitted)))
    (plain, plain_params, plain_compiles), (ahead, ahead_params, ahead_compiles) = results
    assert plain_compiles >= 2 and ahead_compiles == 0  # the prepared actor's jitted programs never ran
    assert plain == ahead
    for name, leaf in plain_params.items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ahead_params[name]))


# ---- experts ------------------------------------------------------------------------------------------------

MOE_MESHES = [dict(ep=2, tp=2), dict(fsdp=2, ep=4)]


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    """tiny-qwen3moe: 4 experts, top 2, layer 0 dense, layer 1 sparse (the preset's init, as the dense tests')."""
    from workers.models.presets import init_model

    return init_model(tmp_path_factory.mktemp("moe") / "tiny-qwen3moe", preset="tiny-qwen3moe")


@pytest.fixture(scope="module")
def moe_one_device(tiny_moe_dir):
    return _train(load_pretrained(tiny_moe_dir)[0], {})


def _moe_gradients(model, shape):
    """Gradients of a GRPO-like objective (advantage-weighted sequence logprobs) on `shape`, as host arrays."""
    from workers.train_step import token_logprobs

    actor = ActorWorker(model, SETTINGS, mesh=_mesh(shape))
    tokens, mask, mini = _batch()
    weights = np.asarray(mini["advantages"]).reshape(-1)[:, None] * np.asarray(mask[:, 1:], np.float32)

    def objective(params):
        return (token_logprobs(actor.graphdef, params, tokens, mask, temperature=1.0) * weights).sum()

    grads = jax.jit(jax.grad(objective))(actor.state.params)
    return {k: np.asarray(v) for k, v in P.to_flat(grads).items()}


def _first_step_metrics(model, shape):
    actor = ActorWorker(model, SETTINGS, mesh=_mesh(shape))
    _, _, mini = _batch()
    return actor._program("train", tuple(sorted(mini)))(actor.state, mini)[1]


@pytest.mark.slow
@pytest.mark.parametrize("shape", MOE_MESHES, ids=S.describe)
def test_a_moe_actor_with_experts_over_ep_computes_what_one_device_does(tiny_moe_dir, moe_one_device, shape):
    """Qwen3-MoE with the experts split over ep (with tp, with fsdp) against one device: logits and every
    parameter's gradient within 1e-5 (relative), and a GRPO step reports the same loss and gradient norm;
    after three steps every expert weight is still split as the table says.

    Parameters after the steps are not compared at 1e-5: Adam's first steps are nearly sign(g) * lr, so a
    gradient element within rounding of zero moves a whole lr either way on different layouts (the loss and
    gradient norm agree to 1e-7; the params to ~1e-5, on the dense tiny model too)."""
    logits, params, _, after, actor, _, _ = _train(load_pretrained(tiny_moe_dir)[0], shape)
    ref_logits = moe_one_device[0]
    assert np.max(np.abs(logits - ref_logits)) <= 1e-5 * float(np.max(np.abs(ref_logits)))
    ref_grads = _moe_gradients(load_pretrained(tiny_moe_dir)[0], {})
    grads = _moe_gradients(load_pretrained(tiny_moe_dir)[0], shape)
    assert np.linalg.norm(ref_grads["model.layers.1.mlp.experts.up_proj.kernel"]) > 0  # experts are trained
    for name, ref in ref_grads.items():
        assert np.linalg.norm(grads[name] - ref) <= 1e-5 * np.linalg.norm(ref), name
    ref_metrics, metrics = (_first_step_metrics(load_pretrained(tiny_moe_dir)[0], mesh) for mesh in ({}, shape))
    for key in ("loss", "grad_norm"):
        assert abs(float(metrics[key]) - float(ref_metrics[key])) <= 1e-5 * abs(float(ref_metrics[key])), key
    experts = after["model.layers.1.mlp.experts.gate_proj.kernel"]
    assert tuple(experts.spec)[0] == "ep"  # experts over ep: each device holds E / ep of them
    specs = S.param_specs({k: v.shape for k, v in params.items()}, shape, kv_heads=actor.config.num_key_value_heads)
    for name, sharding in after.items():
        assert tuple(sharding.spec) == specs[name], name
    leaf = P.to_flat(actor.state.params)["model.layers.1.mlp.experts.down_proj.kernel"]
    assert leaf.addressable_shards[0].data.shape[0] == 4 // shape["ep"]


@pytest.mark.slow
def test_a_moe_engine_on_ep_decodes_what_one_device_does_and_takes_a_sync(tiny_moe_dir, prompt_ids):
    """The rollout side of a MoE model: decoding on ep 2 x tp 2 gives one device's tokens; a sync from an
    actor on fsdp 2 x ep 4 lands with the published checksum, and an offload/onload keeps the output."""
    model, _ = load_pretrained(tiny_moe_dir)
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    one = JaxSampler(model, max_prompt_len=32, max_new_tokens=16)
    sharded = JaxSampler(load_pretrained(tiny_moe_dir)[0], max_prompt_len=32, max_new_tokens=16,
                         mesh=_mesh(dict(ep=2, tp=2)), take_ownership=True)
    for x, y in zip(one.generate(prompt_ids, greedy).samples, sharded.generate(prompt_ids, greedy).samples,
                    strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    actor = ActorWorker(load_pretrained(tiny_moe_dir)[0], SETTINGS, mesh=_mesh(dict(fsdp=2, ep=4)))
    _, _, mini = _batch()
    actor._steps([mini], [])
    snapshot = actor.export_weights()
    sharded.update_weights(snapshot.flat, 1, checksum=snapshot.checksum)
    assert sharded.weight_checksum == snapshot.checksum
    trained = sharded.generate(prompt_ids, greedy)
    sharded.offload()
    sharded.onload()
    assert sharded.weight_checksum == snapshot.checksum
    for x, y in zip(trained.samples, sharded.generate(prompt_ids, greedy).samples, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)


# ---- the engine -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("shape", ROLLOUT_MESHES, ids=S.describe)
def test_a_sharded_engine_decodes_the_tokens_one_device_does(tiny_model, prompt_ids, shape):
    model, _ = tiny_model
    one = JaxSampler(model, max_prompt_len=32, max_new_tokens=16)
    sharded = JaxSampler(model, max_prompt_len=32, max_new_tokens=16, mesh=_mesh(shape))
    for params in (SamplingParams(temperature=0, max_new_tokens=12),  # greedy
                   SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3)):  # same random numbers
        for x, y in zip(one.generate(prompt_ids, params).samples, sharded.generate(prompt_ids, params).samples,
                        strict=True):
            np.testing.assert_array_equal(x.token_ids, y.token_ids)
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    assert sharded.weight_checksum == one.weight_checksum
    sharded.offload()
    sharded.onload()
    assert sharded.weight_checksum == one.weight_checksum


# ---- weights between them ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_checksum_is_of_logical_values_and_is_hashed_where_they_lie(dtype):
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    dt = jnp.dtype(dtype)
    host = {"a": rng.normal(size=(384, 64)).astype(dt), "b": rng.normal(size=(64,)).astype(dt)}
    mesh = _mesh(dict(fsdp=4, tp=2))
    sharded = {"a": jax.device_put(host["a"], S.named(mesh, ("tp", "fsdp"))),
               "b": jax.device_put(host["b"], S.named(mesh, ()))}
    assert P.checksum(host) == P.checksum(sharded) == P.checksum({k: jnp.asarray(v) for k, v in host.items()})
    changed = dict(host, a=host["a"].copy())
    changed["a"][100, 7] = -changed["a"][100, 7]  # one element
    assert P.checksum(changed) != P.checksum(host)
    assert P.checksum(dict(host, b=host["b"][::-1].copy())) != P.checksum(host)  # same values, another order
    hlo = P._digest_device.lower(sharded).compile().as_text()
    assert "all-gather" not in hlo  # each device reduces its own shard; only the sums cross


@pytest.fixture(scope="module")
def actor_and_engine(tiny_model_dir):
    """An actor on fsdp 4 x tp 2 (devices 0-7) and an engine on tp 2 (devices 0-1), in this process."""
    model, _ = load_pretrained(tiny_model_dir)
    actor = ActorWorker(model, SETTINGS, mesh=_mesh(dict(fsdp=4, tp=2)))
    engine = JaxSampler(load_pretrained(tiny_model_dir)[0], max_prompt_len=32, max_new_tokens=16,
                        mesh=_mesh(dict(tp=2)), take_ownership=True)
    return actor, engine


@pytest.mark.slow
@pytest.mark.parametrize("room", [True, False], ids=["beside", "host-undo"])
def test_a_sync_reshards_device_to_device(actor_and_engine, prompt_ids, monkeypatch, room):
    """With room for both versions the old weights wait beside the new ones; without, each old leaf goes to host
    before the new one lands, and never more than one leaf's shard is held beyond the steady state."""
    from workers.rollout import jax_sampler

    if not room:
        monkeypatch.setattr(jax_sampler, "room_for", lambda nbytes: False)
    actor, engine = actor_and_engine
    _, _, mini = _batch()
    actor._steps([mini], [])  # weights the engine lacks
    snapshot = actor.export_weights()
    layout = {k: v.sharding for k, v in P.to_flat(engine._state).items()}
    version = engine.weight_version + 1
    stats = engine.update_weights(snapshot.flat, version, checksum=snapshot.checksum)
    assert engine.weight_version == version and engine.weight_checksum == snapshot.checksum
    flat = P.to_flat(engine._state)
    assert {k: v.sharding for k, v in flat.items()} == layout  # the engine's layout (tp 2), not the actor's
    for name, leaf in flat.items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(snapshot.flat[name]))
    held = engine.memory_bytes()["params"]  # per device: tp 2 splits most leaves
    if room:
        assert stats["peak_extra_bytes"] == stats["params_bytes"] == held and stats["undo_host_bytes"] == 0
    else:
        assert 0 <= stats["peak_extra_bytes"] <= stats["largest_leaf_bytes"]
        assert stats["undo_host_bytes"] == held
    assert stats["largest_leaf_bytes"] == max(max(s.data.nbytes for s in v.addressable_shards) for v in flat.values())
    assert not any(v.is_deleted() for v in snapshot.flat.values())  # the actor's own arrays are untouched


@pytest.mark.slow
def test_a_sync_that_fails_half_way_leaves_the_engine_on_its_previous_version(actor_and_engine, prompt_ids):
    actor, engine = actor_and_engine
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    version, checksum = engine.weight_version, engine.weight_checksum
    before = engine.generate(prompt_ids, greedy)
    broken = {k: jax.numpy.copy(v) for k, v in actor.export_weights().flat.items()}
    victim = sorted(broken)[len(broken) // 2]
    broken[victim].delete()  # the transfer of this leaf fails, after half the leaves have landed
    with pytest.raises(RuntimeError, match="deleted"):
        engine.update_weights(broken, version + 1)
    wrong = {k: np.asarray(v) * 1.01 for k, v in actor.export_weights().flat.items()}  # lands, but is not v+1
    with pytest.raises(P.WeightMismatchError, match=f"keeping v{version}"):
        engine.update_weights(wrong, version + 1, checksum=actor.export_weights().checksum)
    assert (engine.weight_version, engine.weight_checksum) == (version, checksum)
    after = engine.generate(prompt_ids, greedy)
    for x, y in zip(before.samples, after.samples, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)


@pytest.mark.slow
def test_a_sync_into_a_resumed_engine_lands_in_place_of_weights_still_on_host(actor_and_engine, prompt_ids):
    """The colocated step: the engine is onloaded, then synced to the actor's newer version. Its old weights
    wait on host since the onload (their device memory counted as the engine's), so the sync moves nothing
    out; a failed sync leaves them waiting, and they come back on first use."""
    actor, engine = actor_and_engine
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    version, checksum = engine.weight_version, engine.weight_checksum
    before = engine.generate(prompt_ids, greedy)
    resident = engine.memory_bytes()
    layout = {k: v.sharding for k, v in P.to_flat(engine._state).items()}
    engine.offload()
    assert engine.offloaded and engine.memory_bytes()["params"] == 0
    engine.onload()
    assert not engine.offloaded and engine._state is None  # reserved, not moved
    assert engine.memory_bytes() == resident  # the reservation is exactly what the weights take
    broken = {k: jax.numpy.copy(v) for k, v in actor.export_weights().flat.items()}
    broken[sorted(broken)[3]].delete()
    with pytest.raises(RuntimeError, match="deleted"):
        engine.update_weights(broken, version + 1)
    assert engine._state is None and (engine.weight_version, engine.memory_bytes()) == (version, resident)
    after = engine.generate(prompt_ids, greedy)  # first use: the old weights come back
    for x, y in zip(before.samples, after.samples, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
    assert engine.weight_checksum == checksum
    engine.offload()
    engine.onload()
    _, _, mini = _batch()
    actor._steps([mini], [])
    snapshot = actor.export_weights()
    stats = engine.update_weights(snapshot.flat, version + 1, checksum=snapshot.checksum)
    assert (engine.weight_version, engine.weight_checksum) == (version + 1, snapshot.checksum)
    assert stats["peak_extra_bytes"] == 0 and stats["params_bytes"] == resident["params"]
    assert {k: v.sharding for k, v in P.to_flat(engine._state).items()} == layout
    assert engine.restore_weights() == 0  # nothing waits on host any more
