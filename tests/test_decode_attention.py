"""The decode attention kernel (workers.models.decode_attention) against attention written out in numpy, and the
sampler with it against the sampler with XLA's attention. The kernel runs here under Pallas's interpreter (the same
kernel body a GPU's Triton lowers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workers.models import decode_attention as A
from workers.rollout import SamplingParams
from workers.rollout.jax_sampler import JaxSampler


def _numpy_attention(q, k, v, first, end):
    """softmax(q k^T / sqrt(D)) v over slots [first[b], end[b]) of each row (end: one for all, or one a row), in
    float64, one head at a time; a row with no slots: zeros."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, kv, g, d = q.shape
    ends = np.broadcast_to(end, (b,))
    out = np.zeros((b, kv, g, d))
    for i in range(b):
        if ends[i] <= first[i]:
            continue
        for j in range(kv):
            keys, values = k[i, j, first[i]:ends[i]], v[i, j, first[i]:ends[i]]
            for h in range(g):
                scores = keys @ q[i, j, h] / np.sqrt(d)
                weights = np.exp(scores - scores.max())
                out[i, j, h] = weights @ values / weights.sum()
    return out


def _inputs(b, kv, g, s, d, dtype):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, kv, g, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, kv, s, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, kv, s, d), jnp.float32).astype(dtype)
    return q, k, v


@pytest.mark.parametrize(("g", "s", "first", "end"), [
    (2, 96, [0, 7, 40, 63], 64),   # blocks of 32; a row whose first slot is the last one attended
    (3, 24, [0, 5, 9, 23], 24),    # 3 query heads a KV head; 24 slots: blocks of 8
    (1, 64, [31, 32, 33, 0], 40),  # first slots either side of a block's edge
    (2, 64, [3, 9, 20, 0], [64, 9, 33, 1]),  # an end a row: row 1 has finished (an empty run: zeros)
])
def test_the_kernel_attends_to_each_rows_slots_from_its_first_to_end(g, s, first, end):
    q, k, v = _inputs(4, 2, g, s, 16, jnp.float32)
    expected = _numpy_attention(q, k, v, first, end)
    first = jnp.asarray(first, jnp.int32)
    for impl in ("interpret", "xla"):
        out = A.attend(q, k, v, first, jnp.asarray(end, jnp.int32), impl=impl)
        assert out.shape == q.shape and out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-6, err_msg=impl)


def test_another_tiling_attends_alike():
    """Blocks of 8 slots and 2 warps (benchmarks/gpu.py times such tilings on a GPU): the same attention."""
    q, k, v = _inputs(2, 1, 2, 48, 16, jnp.float32)
    first, end = [5, 17], 41
    out = A.attend(q, k, v, jnp.asarray(first, jnp.int32), jnp.int32(end), impl="interpret", block=8, num_warps=2)
    np.testing.assert_allclose(np.asarray(out), _numpy_attention(q, k, v, first, end), atol=2e-6)


def test_slots_outside_a_rows_range_do_not_change_its_output():
    """What the kernel skips or masks (the left padding, slots not written yet) may hold anything."""
    q, k, v = _inputs(2, 1, 2, 64, 16, jnp.float32)
    first, end = jnp.asarray([10, 33], jnp.int32), jnp.int32(50)
    garbage = jnp.full_like(k, 1e4)
    outside = (jnp.arange(64)[None, :] < first[:, None]) | (jnp.arange(64)[None, :] >= end)  # (B, S)
    k2, v2 = (jnp.where(outside[:, None, :, None], garbage, x) for x in (k, v))
    a = A.attend(q, k, v, first, end, impl="interpret")
    b = A.attend(q, k2, v2, first, end, impl="interpret")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_inputs_agree_with_the_float64_attention_to_bfloat16_rounding():
    q, k, v = _inputs(2, 2, 2, 64, 32, jnp.bfloat16)
    first, end = [3, 20], 64
    expected = _numpy_attention(q, k, v, first, end)
    out = A.attend(q, k, v, jnp.asarray(first, jnp.int32), jnp.int32(end), impl="interpret")
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)  # float32 inside: only the inputs are rounded


def test_resolve_picks_the_kernel_on_gpus():
    assert A.resolve("auto", platform="gpu", head_dim=128) == "pallas"  # one GPU or a mesh: attend partitions it
    assert A.resolve("auto", platform="cpu", head_dim=128) == "xla"
    assert A.resolve("auto", platform="gpu", head_dim=96) == "xla"   # Triton's blocks: powers of two
    assert A.resolve("interpret", platform="cpu", head_dim=64) == "interpret"
    with pytest.raises(ValueError, match="'interpret' runs the kernel here"):
        A.resolve("pallas", platform="cpu", head_dim=128)
    with pytest.raises(ValueError, match="head_dim 96 is not a power of two"):
        A.resolve("pallas", platform="gpu", head_dim=96)
    with pytest.raises(ValueError, match="one of"):
        A.resolve("flash", platform="gpu", head_dim=128)


def _mesh(shape):
    from workers.models import sharding as S

    return S.mesh(shape, jax.devices()[: S.num_devices(shape)])


@pytest.mark.parametrize("shape", [dict(dp=2, tp=2), dict(tp=4), dict(dp=4)], ids=str)
def test_on_a_mesh_the_kernel_attends_on_each_devices_shard_of_the_cache(shape):
    """The cache laid out as an engine's (rows over dp, 2 KV heads over tp 2; whole where tp 4 does not divide
    them): each device attends to its shard, the same attention as numpy's, and the program moves no cache between
    devices (no collective at all: a row's attention needs only its own KV heads)."""
    from workers.models import sharding as S

    mesh = _mesh(shape)
    sharding = S.kv_cache_sharding(mesh, kv_heads=2)
    q, k, v = _inputs(4, 2, 2, 64, 16, jnp.float32)
    first, end = [0, 7, 40, 20], [64, 30, 41, 20]  # row 3 finished: nothing to read
    rows = S.batch_sharding(mesh, 1)
    q, k, v = (jax.device_put(x, sharding) for x in (q, k, v))
    program = jax.jit(lambda q, k, v, f, e: A.attend(q, k, v, f, e, impl="interpret", sharding=sharding),
                      out_shardings=sharding)
    args = (q, k, v, jax.device_put(jnp.asarray(first, jnp.int32), rows), jax.device_put(jnp.asarray(end), rows))
    out = program(*args)
    np.testing.assert_allclose(np.asarray(out), _numpy_attention(q, k, v, first, end), atol=2e-6)
    assert out.sharding.is_equivalent_to(sharding, 4)
    hlo = program.lower(*args).compile().as_text()
    collectives = [op for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute") if op in hlo]
    assert not collectives, collectives


def test_a_cache_split_along_its_slots_is_refused_by_name():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh(dict(tp=2))
    q, k, v = _inputs(2, 2, 1, 32, 16, jnp.float32)
    with pytest.raises(ValueError, match="split along its slots"):
        A.attend(q, k, v, jnp.zeros(2, jnp.int32), 32, impl="interpret",
                 sharding=NamedSharding(mesh, P(None, None, "tp", None)))


def test_a_sharded_engine_with_the_kernel_decodes_the_tokens_of_one_device(tmp_path):
    """An engine on dp 2 x tp 2 (a model with 2 KV heads: rows and heads both split) with the kernel on each
    device's shard against XLA's attention on the same mesh and on one device: the same greedy and sampled tokens;
    log-probs within float rounding (the first token's, from the prefill both attend to alike, equal on one mesh)."""
    from workers.models import init_model, load_pretrained

    model, tok = load_pretrained(init_model(tmp_path / "small", preset="small", seed=0, initializer_range=0.2))
    assert model.config.num_key_value_heads == 2
    prompts = [tok.encode(p) for p in ["Hello", "What is 12 + 30?", "a", "The quick brown fox"]]
    mesh = _mesh(dict(dp=2, tp=2))
    engines = {"one": JaxSampler(model, max_prompt_len=32, max_new_tokens=8, decode_attention="xla"),
               "mesh": JaxSampler(model, max_prompt_len=32, max_new_tokens=8, mesh=mesh, decode_attention="xla"),
               "kernel": JaxSampler(model, max_prompt_len=32, max_new_tokens=8, mesh=mesh,
                                    decode_attention="interpret")}
    assert engines["kernel"].decode_attention == "interpret"
    for params in (SamplingParams(temperature=0, max_new_tokens=8),
                   SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3)):
        runs = {name: engine.generate(prompts, params).samples for name, engine in engines.items()}
        for one, xla, kernel in zip(runs["one"], runs["mesh"], runs["kernel"], strict=True):
            np.testing.assert_array_equal(kernel.token_ids, xla.token_ids)
            np.testing.assert_array_equal(kernel.token_ids, one.token_ids)
            assert kernel.logprobs[0] == xla.logprobs[0]
            np.testing.assert_allclose(kernel.logprobs, xla.logprobs, atol=1e-5)
            np.testing.assert_allclose(kernel.logprobs, one.logprobs, atol=3e-5)  # the mesh's sums in their order


def test_the_sampler_with_the_kernel_gives_the_tokens_of_xlas_attention(tiny_model):
    """Prompts of several lengths (left padding of several widths), greedy and sampled (with stop tokens some rows
    hit early: the kernel reads nothing of a finished row): the same tokens and finish reasons, log-probs within
    float rounding."""
    model, tok = tiny_model
    prompts = [tok.encode(p) for p in ["Hello", "What is 12 + 30?", "a", "The quick brown fox jumps over the lazy"]]
    runs = {}
    for impl in ("xla", "interpret"):
        engine = JaxSampler(model, max_prompt_len=64, max_new_tokens=32, decode_attention=impl)
        assert engine.decode_attention == impl
        runs[impl] = [engine.generate(prompts, p) for p in (
            SamplingParams(temperature=0, max_new_tokens=32, stop_token_ids=(tok.eos_token_id,)),
            SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=3, stop_token_ids=tuple(range(0, 384, 24))))]
    lengths = [len(s.token_ids) for s in runs["xla"][1].samples]
    assert min(lengths) < max(lengths), lengths  # rows finished at several steps
    for xla, kernel in zip(runs["xla"], runs["interpret"], strict=True):
        for x, y in zip(xla.samples, kernel.samples, strict=True):
            np.testing.assert_array_equal(x.token_ids, y.token_ids)
            assert x.finish_reason == y.finish_reason
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    assert JaxSampler(model, max_prompt_len=32, max_new_tokens=32).decode_attention == "xla"  # auto, on the CPU


def test_a_sampler_refuses_the_gpu_kernel_on_the_cpu_and_says_what_runs_here(tiny_model):
    model, _ = tiny_model
    with pytest.raises(ValueError, match="'interpret' runs the kernel here"):
        JaxSampler(model, max_prompt_len=32, max_new_tokens=8, decode_attention="pallas")


def test_a_lora_base_groups_views_decode_alike_with_the_kernel(tiny_model_dir):
    """A LoRA task's engine is a slot of its base group's shared sampler, whose decode attention is one of the
    group's settings: views asking for another are another group; each group's adapted tokens are the same."""
    from workers.models import lora as L
    from workers.models import sharding as S
    from workers.rollout.shared_engine import open_view

    spec = L.LoraSpec(rank=4, alpha=8.0, targets=("q", "v", "down"))
    request = ([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(n=2, seed=7, temperature=1.0, max_new_tokens=8))
    views = {impl: open_view(tiny_model_dir, dtype=None, mesh=S.mesh({}, jax.devices()[:1]), spec=spec,
                             max_prompt_len=16, max_new_tokens=8, max_batch_size=8, decode_attention=impl)
             for impl in ("xla", "interpret")}
    try:
        assert views["xla"].group is not views["interpret"].group
        outs = {}
        for impl, view in views.items():
            assert view.group.sampler.decode_attention == impl
            rng = np.random.default_rng(3)
            shapes = L.adapter_shapes(view.config, spec)
            view.update_weights({n: rng.normal(0, 0.3, s).astype(np.float32) for n, s in shapes.items()}, 1)
            outs[impl] = view.generate(*request)
    finally:
        for view in views.values():
            view.close()
    for x, y in zip(outs["xla"].samples, outs["interpret"].samples, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
