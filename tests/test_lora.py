"""LoRA adapters in the decoder (workers.models.lora_batch): a fresh adapter is the base exactly, an adapter equals
its merged weights (workers.models.lora.merged, loaded as a plain model), gradients reach each row's own adapter
only (checked against finite differences), and each row of a mixed batch of adapters computes what it computes
alone. Tiny presets built locally, float32 on CPU."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from workers.models import ModelConfigError
from workers.models import params as P
from workers.models.decoder import CausalLM
from workers.models.lora import LoraSpec, adapter_shapes, check_targets, merged
from workers.models.lora_batch import AdapterBatch, init_adapter, stack, with_rows
from workers.models.presets import preset_config

VOCAB = 128
ALL = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION = ("q", "k", "v", "o")


@functools.cache
def _model(preset: str, dtype: str = "float32"):
    """(graphdef, state) of a tiny random model with peaked weights (std 0.2)."""
    cfg = preset_config(preset, vocab_size=VOCAB, initializer_range=0.2, dtype=dtype)
    return nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0)))


@functools.cache
def _logits_fn(graphdef):
    """Jitted logits of a padded batch; `adapters` is an argument (None: the base)."""
    def run(state, tokens, mask, adapters):
        return nnx.merge(graphdef, state)(tokens, positions=jnp.maximum(jnp.cumsum(mask, -1) - 1, 0),
                                          attention_mask=mask, adapters=adapters)
    return jax.jit(run)


def _batch(b: int = 5, t: int = 7, seed: int = 0):
    """Tokens (b, t) with left padding of 0..2 tokens on some rows."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (b, t)).astype(np.int32)
    mask = np.ones((b, t), bool)
    for row in range(b):
        mask[row, : row % 3] = False
    return jnp.asarray(tokens), jnp.asarray(mask)


def _random_adapter(cfg, spec: LoraSpec, seed: int, std: float = 0.1) -> dict[str, np.ndarray]:
    """An adapter with non-zero A and B (what training makes of one)."""
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * std).astype(np.float32)
            for name, shape in adapter_shapes(cfg, spec).items()}


def _setup(preset: str, dtype: str = "float32"):
    graphdef, state = _model(preset, dtype)
    return graphdef, state, nnx.merge(graphdef, state).config


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_fresh_adapter_computes_exactly_what_the_base_computes(dtype):
    graphdef, state, cfg = _setup("tiny", dtype)
    spec = LoraSpec(rank=4, alpha=8.0, targets=ALL)
    adapter = init_adapter(cfg, spec, jax.random.key(1))
    assert set(adapter) == set(adapter_shapes(cfg, spec))
    for name, value in adapter.items():
        assert value.dtype == jnp.float32
        if name.endswith(".lora_b"):
            assert not np.any(np.asarray(value))
        else:  # PEFT's kaiming-uniform(a=sqrt(5)): uniform in +-1/sqrt(in), and not degenerate
            bound = 1 / np.sqrt(value.shape[0])
            assert np.abs(np.asarray(value)).max() <= bound and np.abs(np.asarray(value)).max() > bound / 2
    tokens, mask = _batch()
    batch = stack([adapter], [spec], [0, 0, -1, 0, -1])
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 3, cfg.hidden_size)), _model_dtype(dtype))
    delta = batch.delta("model.layers.0.self_attn.q_proj", x)
    assert delta.dtype == x.dtype and not np.any(np.asarray(delta, np.float32))  # adds an exact 0, not a tiny number
    run = _logits_fn(graphdef)
    fresh = np.asarray(run(state, tokens, mask, batch))
    # The base as this program computes it (every row -1) is bit for bit what the fresh adapter computes ...
    assert np.array_equal(fresh, np.asarray(run(state, tokens, mask, with_rows(batch, [-1] * 5))))
    # ... and what the program without adapters computes, up to float rounding: XLA:CPU fuses the added 0 into the
    # q/k norms' reductions, and their sums come out in another order (a few 1e-6; the same in bfloat16 models'
    # float32 logits at bfloat16 precision).
    base = np.asarray(run(state, tokens, mask, None))
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(fresh, base, rtol=tol, atol=tol)


def _model_dtype(dtype: str):
    return jnp.bfloat16 if dtype == "bfloat16" else jnp.float32


@pytest.mark.parametrize(("preset", "targets"), [("tiny", ALL), ("tiny", ("v", "down")),
                                                 ("tiny-qwen2", ALL), ("tiny-qwen3moe", ATTENTION)])
def test_an_adapter_computes_what_its_merged_weights_compute(preset, targets):
    graphdef, state, cfg = _setup(preset)
    spec = LoraSpec(rank=4, alpha=16.0, targets=targets)
    adapter = _random_adapter(cfg, spec, seed=2)
    flat = P.to_flat(state)
    merged_state = P.from_flat(state, merged({k: np.asarray(v) for k, v in flat.items()}, adapter, spec))
    tokens, mask = _batch()
    run = _logits_fn(graphdef)
    expected = np.asarray(run(merged_state, tokens, mask, None))
    got = np.asarray(run(state, tokens, mask, stack([adapter], [spec], [0] * 5)))
    base = np.asarray(run(state, tokens, mask, None))
    assert np.abs(expected - base).max() > 1e-2  # the adapter changes the logits: the comparison means something
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_each_row_of_a_mixed_batch_computes_what_it_computes_alone():
    graphdef, state, cfg = _setup("tiny")
    specs = [LoraSpec(2, 4.0, ("q", "v")), LoraSpec(4, 8.0, ALL), LoraSpec(8, 8.0, ("o", "down"))]
    adapters = [_random_adapter(cfg, s, seed=10 + i) for i, s in enumerate(specs)]
    rows = [-1, 0, 1, 2, 0]
    tokens, mask = _batch()
    run = _logits_fn(graphdef)
    batch = stack(adapters, specs, rows)
    assert batch.a["model.layers.0.self_attn.q_proj"].shape == (3, cfg.hidden_size, 8)  # padded to the largest r
    mixed = np.asarray(run(state, tokens, mask, batch))
    base = np.asarray(run(state, tokens, mask, None))
    all_base = np.asarray(run(state, tokens, mask, with_rows(batch, [-1] * 5)))
    for row, k in enumerate(rows):
        if k < 0:  # exactly the base as this program computes it (see the fresh-adapter test), and the base's
            assert np.array_equal(mixed[row], all_base[row])
            np.testing.assert_allclose(mixed[row], base[row], rtol=1e-5, atol=1e-5)
            continue
        alone = np.asarray(run(state, tokens[row:row + 1], mask[row:row + 1], stack([adapters[k]], [specs[k]], [0])))
        assert np.abs(alone[0] - base[row]).max() > 1e-2
        np.testing.assert_allclose(mixed[row], alone[0], rtol=1e-5, atol=1e-5, err_msg=f"row {row} (adapter {k})")
    # The same program serves other rows and other adapter values: nothing is traced again.
    traces = []

    @jax.jit
    def count(state, tokens, mask, adapters):
        traces.append(1)
        return nnx.merge(graphdef, state)(tokens, attention_mask=mask, adapters=adapters)

    count(state, tokens, mask, batch)
    other = dataclasses.replace(with_rows(batch, [2, 2, -1, 1, 0]), b=jax.tree.map(lambda x: x * 2, batch.b))
    count(state, tokens, mask, other)
    assert len(traces) == 1


def _loss(ab, state, graphdef, batch: AdapterBatch, tokens, mask, weights):
    """A scalar of the logits (a fixed random projection of them) with the adapters' a and b as arguments."""
    logits = nnx.merge(graphdef, state)(tokens, attention_mask=mask,
                                        adapters=dataclasses.replace(batch, a=ab["a"], b=ab["b"]))
    return jnp.sum(logits * weights)


def test_gradients_reach_each_rows_adapter_and_a_step_leaves_the_base_alone():
    graphdef, state, cfg = _setup("tiny")
    specs = [LoraSpec(4, 8.0, ALL), LoraSpec(2, 2.0, ("q", "o"))]
    adapters = [_random_adapter(cfg, s, seed=20 + i) for i, s in enumerate(specs)]
    tokens, mask = _batch(b=3)
    weights = jnp.asarray(np.random.default_rng(3).standard_normal((3, tokens.shape[1], VOCAB)), jnp.float32)
    grad = jax.jit(jax.grad(functools.partial(_loss, graphdef=graphdef), argnums=(0, 1)))
    batch = stack(adapters, specs, [0, 0, 0])
    ab = {"a": batch.a, "b": batch.b}
    g_ab, g_base = grad(ab, state, batch=batch, tokens=tokens, mask=mask, weights=weights)
    for module in adapter_shapes(cfg, specs[0]):
        part, name = ("a" if module.endswith("lora_a") else "b"), module.rsplit(".", 1)[0]
        assert np.abs(np.asarray(g_ab[part][name][0])).max() > 0, f"no gradient reaches {module}"
        assert not np.any(np.asarray(g_ab[part][name][1])), f"adapter 1 runs on no row yet gets a gradient ({module})"
    assert any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(g_base))  # the base is in the graph ...

    # ... but a step updates the adapters only: the base state is an input, never an output, of the step.
    before = jax.tree.map(np.asarray, state)
    stepped = jax.tree.map(lambda p, g: p - 0.1 * g, ab, g_ab)
    after_batch = dataclasses.replace(batch, a=stepped["a"], b=stepped["b"])
    run = _logits_fn(graphdef)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), y), state, before)
    moved = np.asarray(run(state, tokens, mask, after_batch)) - np.asarray(run(state, tokens, mask, batch))
    assert np.abs(moved).max() > 0
    base = np.asarray(run(state, tokens, mask, with_rows(batch, [-1, -1, -1])))
    assert np.array_equal(np.asarray(run(state, tokens, mask, with_rows(after_batch, [-1, -1, -1]))), base)

    # Rows of the base (-1) give no adapter any gradient; a row of adapter 1 gives adapter 0 none.
    for rows, silent in (([-1, -1, -1], (0, 1)), ([1, -1, 1], (0,))):
        g_ab, _ = grad(ab, state, batch=with_rows(batch, rows), tokens=tokens, mask=mask, weights=weights)
        for k in silent:
            assert not any(np.any(np.asarray(g[k])) for g in jax.tree.leaves(g_ab)), (rows, k)
        if 1 in rows:
            assert np.abs(np.asarray(g_ab["b"]["model.layers.0.self_attn.q_proj"][1])).max() > 0


def test_one_adapter_dense_computes_and_learns_what_the_gather_does():
    """stack(..., dense=True) (a LoRA actor's: one adapter, no per-row gather) against the gathered batch of the
    same adapter: the same logits and the same gradient to float32 rounding, rows of -1 exactly the base (the same
    bits as the gathered program's), and dense refuses more than one adapter."""
    graphdef, state, cfg = _setup("tiny")
    spec = LoraSpec(4, 8.0, ALL)
    adapter = _random_adapter(cfg, spec, seed=30)
    tokens, mask = _batch(b=4)
    rows = [0, -1, 0, 0]
    gathered, dense = stack([adapter], [spec], rows), stack([adapter], [spec], rows, dense=True)
    assert dense.dense and not gathered.dense
    run = _logits_fn(graphdef)
    got, expected = np.asarray(run(state, tokens, mask, dense)), np.asarray(run(state, tokens, mask, gathered))
    base = np.asarray(run(state, tokens, mask, with_rows(gathered, [-1] * 4)))
    assert np.abs(expected[0] - base[0]).max() > 1e-2  # the adapter changes the logits
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=2e-6)
    assert np.array_equal(got[1], base[1]) and np.array_equal(got[1], expected[1])
    weights = jnp.asarray(np.random.default_rng(4).standard_normal((4, tokens.shape[1], VOCAB)), jnp.float32)
    grad = jax.jit(jax.grad(functools.partial(_loss, graphdef=graphdef)))
    g = {name: grad({"a": b.a, "b": b.b}, state, batch=b, tokens=tokens, mask=mask, weights=weights)
         for name, b in (("dense", dense), ("gathered", gathered))}
    assert np.abs(np.asarray(g["dense"]["b"]["model.layers.0.mlp.down_proj"])).max() > 0
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6),
                 g["dense"], g["gathered"])
    with pytest.raises(ValueError, match="dense is one adapter"):
        stack([adapter, adapter], [spec, spec], [0], dense=True)


def test_a_fresh_adapter_learns_through_b_first():
    """With B = 0, dL/dA = scale x^T (dL/dy) B^T is exactly 0 and dL/dB is not (as in PEFT): step 1 moves B."""
    graphdef, state, cfg = _setup("tiny")
    spec = LoraSpec(2, 4.0, ALL)
    batch = stack([init_adapter(cfg, spec, jax.random.key(4))], [spec], [0, 0])
    tokens, mask = _batch(b=2)
    weights = jnp.asarray(np.random.default_rng(5).standard_normal((2, tokens.shape[1], VOCAB)), jnp.float32)
    grad = jax.jit(jax.grad(functools.partial(_loss, graphdef=graphdef)))
    g = grad({"a": batch.a, "b": batch.b}, state, batch=batch, tokens=tokens, mask=mask, weights=weights)
    for module in batch.a:
        assert not np.any(np.asarray(g["a"][module])), module
        assert np.abs(np.asarray(g["b"][module])).max() > 0, module


def test_a_rank_1_gradient_matches_finite_differences():
    graphdef, state, cfg = _setup("tiny")
    spec = LoraSpec(1, 2.0, ("v",))  # scale 2: a forgotten scale would be off by 2x
    batch = stack([_random_adapter(cfg, spec, seed=6, std=0.3)], [spec], [0])
    tokens, mask = _batch(b=1, t=4)
    weights = jnp.asarray(np.random.default_rng(7).standard_normal((1, 4, VOCAB)) / VOCAB, jnp.float32)
    loss = jax.jit(functools.partial(_loss, state=state, graphdef=graphdef, batch=batch, tokens=tokens, mask=mask,
                                     weights=weights))
    ab = {"a": batch.a, "b": batch.b}
    g = jax.grad(loss)(ab)
    module, eps = "model.layers.1.self_attn.v_proj", 1e-2
    for part, index in (("a", (0, 3, 0)), ("a", (0, 17, 0)), ("b", (0, 0, 5)), ("b", (0, 0, 100))):
        def moved(delta, part=part, index=index):
            changed = {p: dict(d) for p, d in ab.items()}
            changed[part][module] = changed[part][module].at[index].add(delta)
            return float(loss(changed))
        numeric = (moved(eps) - moved(-eps)) / (2 * eps)
        analytic = float(g[part][module][index])
        assert abs(analytic) > 1e-4, (part, index)
        assert abs(numeric - analytic) <= 2e-2 * abs(analytic) + 1e-5, (part, index, numeric, analytic)


def test_mlp_targets_on_a_mixture_of_experts_are_refused_naming_the_layers():
    graphdef, state, cfg = _setup("tiny-qwen3moe")
    with pytest.raises(ModelConfigError, match=r"layers \[1\].*mixtures of experts"):
        check_targets(cfg, ("q", "gate"))
    with pytest.raises(ModelConfigError, match=r"layers \[1\]"):
        init_adapter(cfg, LoraSpec(2, 4.0, ("up",)), jax.random.key(0))
    # An adapter built by hand for a MoE layer's MLP is refused by the decoder too, not silently ignored.
    d = cfg.hidden_size
    hand = {"model.layers.1.mlp.gate_proj.lora_a": np.zeros((d, 2), np.float32),
            "model.layers.1.mlp.gate_proj.lora_b": np.zeros((2, cfg.moe_intermediate_size), np.float32)}
    tokens, mask = _batch(b=1)
    with pytest.raises(ModelConfigError, match=r"model.layers.1.mlp.gate_proj.*mixture-of-experts"):
        _logits_fn(graphdef)(state, tokens, mask, stack([hand], [LoraSpec(2, 4.0, ("gate",))], [0]))


def test_bad_stacks_are_refused_clearly():
    _, state, cfg = _setup("tiny")
    spec = LoraSpec(2, 4.0, ("q",))
    adapter = _random_adapter(cfg, spec, seed=0)
    with pytest.raises(ValueError, match=r"not of its spec's rank 4"):
        stack([adapter], [LoraSpec(4, 4.0, ("q",))], [0])
    with pytest.raises(ValueError, match=r"in \[-1, 1\)"):
        stack([adapter], [spec], [0, 1])
    with pytest.raises(ValueError, match=r"one spec per adapter"):
        stack([adapter, adapter], [spec], [0])
    tokens, mask = _batch(b=3)
    graphdef, _ = _model("tiny")
    with pytest.raises(ValueError, match=r"the batch has 3 rows"):
        _logits_fn(graphdef)(state, tokens, mask, stack([adapter], [spec], [0, 0]))


# ---- the built-in engine: one generate call serves rows of several adapters -------------------------------------

@pytest.mark.slow  # compiles a generate program per engine and adapter set (~10-20 s cold)
def test_the_engine_serves_each_prompt_with_its_adapter_as_if_alone(tiny_model):
    from workers.rollout import RolloutInputError, SamplingParams
    from workers.rollout.jax_sampler import JaxSampler

    model, tok = tiny_model
    cfg = model.config
    specs = [LoraSpec(2, 4.0, ("q", "v")), LoraSpec(4, 8.0, ALL), LoraSpec(8, 8.0, ("o", "down"))]
    adapters = [_random_adapter(cfg, s, seed=30 + i, std=0.5) for i, s in enumerate(specs)]
    prompts = [tok.encode(p) for p in ("Hello", "What is 12 + 30?", "a", "The quick brown fox")]
    rows = [-1, 0, 1, 2]
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)

    def tokens_and_logprobs(out):
        return ([s.token_ids.tolist() for s in out.samples], [s.logprobs for s in out.samples])

    engine = JaxSampler(model, max_prompt_len=32, max_new_tokens=8, max_batch_size=8)
    with pytest.raises(RolloutInputError, match=r"in \[-1, 0\)"):
        engine.generate(prompts, greedy, adapter_rows=[0, 0, 0, 0])  # no adapters set yet
    base_tokens, _ = tokens_and_logprobs(engine.generate(prompts, greedy))
    assert tokens_and_logprobs(engine.generate(prompts, greedy, adapter_rows=[-1] * 4))[0] == base_tokens
    engine.offload()
    engine.set_adapters(adapters, specs)  # while offloaded: they wait on host with the weights
    assert engine.num_adapters == 3
    engine.onload()
    mixed_tokens, mixed_lps = tokens_and_logprobs(engine.generate(prompts, greedy, adapter_rows=rows))
    for i, k in enumerate(rows):
        if k < 0:  # the base: the engine's program without adapters
            alone = JaxSampler(model, max_prompt_len=32, max_new_tokens=8).generate([prompts[i]], greedy)
        else:  # an engine holding only this adapter (K = 1)
            single = JaxSampler(model, max_prompt_len=32, max_new_tokens=8)
            single.set_adapters([adapters[k]], [specs[k]])
            alone = single.generate([prompts[i]], greedy, adapter_rows=[0])
            assert mixed_tokens[2 * i] != base_tokens[2 * i], f"adapter {k} changes nothing: the test proves nothing"
        alone_tokens, alone_lps = tokens_and_logprobs(alone)
        for j in range(2):  # both samples of the prompt
            assert mixed_tokens[2 * i + j] == alone_tokens[j], (i, k)
            np.testing.assert_allclose(mixed_lps[2 * i + j], alone_lps[j], rtol=1e-5, atol=1e-5)

    # The adapter's rows are its merged model's (an engine with K + scale A B loaded as full weights).
    merged_engine = JaxSampler(model, max_prompt_len=32, max_new_tokens=8)
    merged_engine.update_weights(merged(P.host_params(model), adapters[1], specs[1]), version=1)
    merged_tokens, merged_lps = tokens_and_logprobs(merged_engine.generate([prompts[2]], greedy))
    assert merged_tokens[0] == mixed_tokens[4]
    np.testing.assert_allclose(merged_lps[0], mixed_lps[4], rtol=1e-4, atol=1e-4)

    # New adapter values and another mix of rows run the programs compiled already.
    compiled = engine.programs_compiled()
    engine.set_adapters([{k: -v for k, v in a.items()} for a in adapters], specs)
    again, _ = tokens_and_logprobs(engine.generate(prompts, greedy, adapter_rows=[2, 1, -1, 0]))
    assert engine.programs_compiled() == compiled
    assert again != mixed_tokens
    # Offloaded with the weights, the adapters come back with them.
    engine.offload()
    assert engine.offloaded and engine.num_adapters == 3
    engine.onload()
    assert tokens_and_logprobs(engine.generate(prompts, greedy, adapter_rows=[2, 1, -1, 0]))[0] == again
    with pytest.raises(RolloutInputError, match=r"one integer per prompt \(4\)"):
        engine.generate(prompts, greedy, adapter_rows=[0, 1])


@pytest.mark.slow  # compiles a generate program per engine and adapter set (~10-20 s cold)
def test_the_engine_serves_adapters_on_a_mesh_as_on_one_device(tiny_model):
    """Rows over dp, kernels over tp, the stacked adapters replicated: the same tokens as one device's engine,
    both through a prepared (ahead-of-time compiled) program and a jitted one."""
    from workers.models import sharding as S
    from workers.rollout import SamplingParams
    from workers.rollout.jax_sampler import JaxSampler

    model, tok = tiny_model
    specs = [LoraSpec(2, 4.0, ("q", "o")), LoraSpec(4, 8.0, ("k", "v", "up"))]
    adapters = [_random_adapter(model.config, s, seed=40 + i, std=0.5) for i, s in enumerate(specs)]
    prompts = [tok.encode(p) for p in ("Hello", "1 + 2 =", "abc")]
    rows, greedy = [1, -1, 0], SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    results = []
    for mesh in (None, S.mesh({"dp": 2, "tp": 2}, jax.devices()[:4])):
        engine = JaxSampler(model, max_prompt_len=16, max_new_tokens=8, mesh=mesh)
        engine.set_adapters(adapters, specs)
        if mesh is not None:
            assert engine.prepare(prompts, greedy, adapter_rows=rows) == 1
        out = engine.generate(prompts, greedy, adapter_rows=rows)
        results.append(([s.token_ids.tolist() for s in out.samples], np.stack([s.logprobs for s in out.samples])))
    assert results[0][0] == results[1][0]
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5, atol=1e-5)
