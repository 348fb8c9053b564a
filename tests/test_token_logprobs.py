"""Log-probabilities by chunks of positions (workers.token_logprobs) against the whole-vocabulary computation: the
same values and gradients, and a train-like program whose temporary bytes stay far under one [rows, positions,
vocabulary] float32 array (XLA's own memory analysis of the compiled program)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workers.token_logprobs import target_logprobs


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
