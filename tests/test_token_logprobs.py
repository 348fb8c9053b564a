"""Log-probabilities by chunks of positions (workers.token_logprobs) against the whole-vocabulary computation: the
same values and gradients, and a train-like program whose temporary bytes stay far under one [rows, positions,
vocabulary] float32 array (XLA's own memory analysis of the compiled program)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workers.token_logprobs import target_logprobs, window_logprobs


def _whole(w, hidden, targets, temperature):
    z = jnp.einsum("bth,hv->btv", hidden, w, preferred_element_type=jnp.float32) / temperature
    logp = jax.nn.log_softmax(z, axis=-1)
    p = jnp.exp(logp)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], -(p * logp).sum(-1)


def _chunked(w, hidden, targets, temperature, chunk):
    head = lambda h: jnp.einsum("bch,hv->bcv", h, w, preferred_element_type=jnp.float32)  # noqa: E731
    return target_logprobs(head, hidden, targets, temperature=temperature, chunk=chunk)


@pytest.mark.parametrize("chunk", [1, 8, 37, 64])  # 37 positions: chunks that divide, leave a tail, or exceed
def test_chunks_compute_the_whole_vocabulary_values_and_gradients(chunk):
    kw, kh, kt = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(kw, (16, 300)) * 0.5
    hidden = jax.random.normal(kh, (3, 37, 16))
    targets = jax.random.randint(kt, (3, 37), 0, 300)
    want_logp, _ = _whole(w, hidden, targets, 0.7)
    logp, entropy = _chunked(w, hidden, targets, 0.7, chunk)
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
    # the entropy against float64 numpy (float32's -sum(p log p) itself is ~1e-5 off where the entropy is ~0.06)
    z = np.einsum("bth,hv->btv", np.asarray(hidden, np.float64), np.asarray(w, np.float64)) / 0.7
    logq = z - z.max(-1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
    np.testing.assert_allclose(entropy, -(np.exp(logq) * logq).sum(-1), rtol=1e-5, atol=1e-5)
    weights = jax.random.normal(kt, (3, 37))  # a loss that weighs each position differently

    def loss(fn):
        return lambda w, h: (fn(w, h)[0] * weights).sum()

    want = jax.grad(loss(lambda w, h: _whole(w, h, targets, 0.7)), argnums=(0, 1))(w, hidden)
    got = jax.grad(loss(lambda w, h: _chunked(w, h, targets, 0.7, chunk)), argnums=(0, 1))(w, hidden)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
    # the entropy is a metric: no gradient flows from it
    grad_h = jax.grad(lambda h: _chunked(w, h, targets, 0.7, chunk)[1].sum())(hidden)
    assert float(jnp.abs(grad_h).max()) == 0.0


def test_the_head_on_windows_gives_the_whole_heads_values_and_gradients_there_and_zeros_elsewhere():
    """Rows whose windows of 6 positions start anywhere, up to the last that fits (start 31 of 37 positions): inside
    them the log-probabilities, entropies and gradients of the head on every position (chunks of 4: windows across
    chunk bounds); outside, zeros that carry no gradient, so a loss read inside the windows differentiates alike."""
    kw, kh, kt = jax.random.split(jax.random.key(1), 3)
    w = jax.random.normal(kw, (16, 300)) * 0.5
    hidden = jax.random.normal(kh, (4, 37, 16))
    targets = jax.random.randint(kt, (4, 37), 0, 300)
    start = jnp.array([0, 5, 31, 13], jnp.int32)
    inside = (np.arange(37) >= np.asarray(start)[:, None]) & (np.arange(37) < np.asarray(start)[:, None] + 6)
    head = lambda w: lambda h: jnp.einsum("bch,hv->bcv", h, w, preferred_element_type=jnp.float32)  # noqa: E731
    whole_fn = partial(target_logprobs, temperature=0.7, chunk=4)
    window_fn = lambda f, h, y: window_logprobs(f, h, y, start, 6, temperature=0.7, chunk=4)  # noqa: E731
    weights = jax.random.normal(kt, (4, 37)) * inside  # a loss that reads the windows only

    @partial(jax.jit, static_argnums=0)  # one program a path (op by op, the scan's pieces compile one by one)
    def values_and_grads(fn, w, h):
        loss = lambda w, h: (fn(head(w), h, targets)[0] * weights).sum()  # noqa: E731
        return fn(head(w), h, targets), jax.grad(loss, argnums=(0, 1))(w, h)

    (whole, want), (window, got) = values_and_grads(whole_fn, w, hidden), values_and_grads(window_fn, w, hidden)
    for g, e in zip(window, whole, strict=True):
        np.testing.assert_allclose(g[inside], e[inside], rtol=1e-6, atol=1e-6)
        assert not np.any(np.asarray(g)[~inside])
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    assert not np.any(np.asarray(got[1])[~inside])  # no gradient reaches a hidden state outside the windows
    with pytest.raises(ValueError, match="window width 38"):
        window_logprobs(head(w), hidden, targets, start, 38, temperature=0.7)


def test_the_gradient_program_never_holds_the_whole_logits():
    """The value and gradient of a loss over 4 x 512 positions of a 32,768-token vocabulary: its whole logits are
    4 x 512 x 32,768 x 4 B = 256 MiB in float32. XLA's memory analysis of the compiled program counts what it
    allocates besides its inputs and outputs: the whole-vocabulary program holds at least that (5.0 x, measured),
    the chunked one (64 positions: an eighth of the logits, and their gradient) half of it at most (0.29 x)."""
    b, t, h, v = 4, 512, 64, 32_768
    logits_bytes = b * t * v * 4
    w = jax.ShapeDtypeStruct((h, v), jnp.float32)
    hidden = jax.ShapeDtypeStruct((b, t, h), jnp.float32)
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def temp_bytes(fn):
        program = jax.jit(jax.value_and_grad(lambda w, x, y: fn(w, x, y).sum(), argnums=(0, 1)))
        return program.lower(w, hidden, targets).compile().memory_analysis().temp_size_in_bytes

    whole = temp_bytes(lambda w, x, y: _whole(w, x, y, 1.0)[0])
    chunked = temp_bytes(lambda w, x, y: _chunked(w, x, y, 1.0, 64)[0])
    print(f"temporary bytes: whole {whole / logits_bytes:.2f} x the logits, chunked {chunked / logits_bytes:.2f} x")
    assert whole >= logits_bytes, whole
    assert chunked <= logits_bytes / 2, (chunked, whole)


def _settings(remat: str):
    from workers.train_step import ActorSettings

    return ActorSettings(lr=1e-3, total_steps=3, warmup_steps=0, min_lr_ratio=0.5, weight_decay=0.0, grad_clip=1.0,
                         b1=0.9, b2=0.99, epsilon=0.2, epsilon_high=None, beta=0.0, aggregation="token-mean",
                         temperature=1.0, micro_batch_size=8, mini_batch_size=8, epochs=1, router_aux_loss_coef=None,
                         kl_clamp=None, max_new_tokens=None, remat=remat, adam_mu_dtype="float32")


def test_layer_remat_trains_alike_and_its_train_program_holds_one_layer_of_attention():
    """The actor's train program (workers.actor, actor.remat) over a micro-batch of 8 x 512 of the tiny preset with 4
    layers (hidden 64, 2 heads): attention's float32 scores are 8 x 2 x 512 x 512 x 4 B = 16 MiB a layer, the largest
    activations. Without remat autodiff keeps each layer's (386 MiB of temporaries on CPU, measured: ~6 score-sized
    arrays a layer); with it the backward recomputes one layer at a time (111 MiB). The bound, 2 layers' worth of
    those arrays, is what keeping them all would break; and the gradient is the same computation (float32, 1e-6)."""
    from flax import nnx

    from workers.actor import ActorWorker
    from workers.models.decoder import CausalLM
    from workers.models.presets import preset_config
    from workers.train_step import policy_logprobs

    model = CausalLM(preset_config("tiny", vocab_size=384).replace(num_hidden_layers=4), rngs=nnx.Rngs(0))
    b, t = 8, 512
    layer_scores = b * 2 * t * t * 4
    shapes = {"tokens": ((1, b, t), np.int32), "attention_mask": ((1, b, t), np.bool_),
              "loss_mask": ((1, b, t - 1), np.float32), "advantages": ((1, b), np.float32),
              "sampler_logp": ((1, b, t - 1), np.float32)}
    temp = {}
    for remat in ("off", "layers"):
        worker = ActorWorker(model, _settings(remat))
        batch = {k: jax.ShapeDtypeStruct(*v) for k, v in shapes.items()}
        program = worker._program("train", tuple(sorted(shapes))).lower(worker._abstract, batch).compile()
        temp[remat] = program.memory_analysis().temp_size_in_bytes
    print(f"train program temporaries: off {temp['off'] / 2**20:.1f} MiB, layers {temp['layers'] / 2**20:.1f} MiB")
    assert temp["off"] >= 4 * 3 * layer_scores, temp  # every layer's scores kept: what the bound must catch
    assert temp["layers"] <= 2 * 6 * layer_scores, temp

    # The same gradient, remat or not (a shorter batch: equality needs no long one)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, 384, (4, 48)), jnp.int32)
    mask = jnp.asarray(np.arange(48)[None] < rng.integers(20, 49, (4, 1)))
    weights = jnp.asarray(rng.normal(size=(4, 47)), jnp.float32)

    def loss(remat):
        def f(p):
            logp, _, _ = policy_logprobs(graphdef, p, None, None, tokens, mask, temperature=0.9, remat=remat)
            return (logp * weights * mask[:, 1:]).sum()
        return jax.jit(jax.value_and_grad(f))(params)

    (v_off, g_off), (v_on, g_on) = loss("off"), loss("layers")
    np.testing.assert_allclose(v_on, v_off, rtol=1e-6)
    for a, e in zip(jax.tree.leaves(g_on), jax.tree.leaves(g_off), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)
