"""Sampling math on hand-computed distributions."""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from workers.rollout.sampling import nucleus_filter, sample_tokens

PROBS = np.array([0.5, 0.3, 0.15, 0.05])


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    logits = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]
    # mass before each token (sorted): 0, 0.5, 0.8, 0.95 -> top_p 0.75 keeps the first two.
    kept = np.isfinite(np.asarray(nucleus_filter(logits, jnp.float32(0.75))))[0]
    assert kept.tolist() == [True, True, False, False]
    # top_p tiny still keeps the most likely token.
    assert np.isfinite(np.asarray(nucleus_filter(logits, jnp.float32(1e-6))))[0].tolist() == [True, False, False, False]


def test_greedy_picks_argmax_and_reports_model_logprob():
    logits = jnp.log(jnp.asarray([PROBS, PROBS[::-1]], jnp.float32))
    keys = jax.random.split(jax.random.key(0), 2)
    tok, lp = sample_tokens(logits, keys, jnp.float32(0.0), jnp.float32(0.5))
    assert tok.tolist() == [0, 3]
    np.testing.assert_allclose(np.asarray(lp), np.log([0.5, 0.5]), rtol=1e-6)


def test_top_p_samples_follow_the_renormalised_nucleus():
    n = 20_000
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS, jnp.float32)), (n, 4))
    keys = jax.random.split(jax.random.key(1), n)
    tok, lp = sample_tokens(logits, keys, jnp.float32(1.0), jnp.float32(0.75))
    tok, lp = np.asarray(tok), np.asarray(lp)
    # Renormalised nucleus: 0.5 / 0.8 = 0.625 and 0.3 / 0.8 = 0.375; tokens 2 and 3 never appear.
    freq = np.bincount(tok, minlength=4) / n
    np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0], atol=0.015)
    np.testing.assert_allclose(lp[tok == 0], np.log(0.625), rtol=1e-5)
    np.testing.assert_allclose(lp[tok == 1], np.log(0.375), rtol=1e-5)


def test_temperature_sharpens_the_distribution():
    n = 20_000
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS, jnp.float32)), (n, 4))
    keys = jax.random.split(jax.random.key(2), n)
    tok, lp = sample_tokens(logits, keys, jnp.float32(0.5), jnp.float32(1.0))
    # p^(1/T) = p^2 normalised: [0.25, 0.09, 0.0225, 0.0025] / 0.365
    expected = PROBS**2 / (PROBS**2).sum()
    np.testing.assert_allclose(np.bincount(np.asarray(tok), minlength=4) / n, expected, atol=0.015)
    np.testing.assert_allclose(np.asarray(lp), np.log(expected[np.asarray(tok)]), rtol=1e-5)


def test_a_static_nucleus_choice_samples_what_the_run_time_branch_does():
    """`nucleus` False (top_p 1) and True (top_p < 1) are the program's choice made ahead (no lax.cond in the decode
    step): the same tokens and log-probs as the run-time branch, and the log-probs are the sampled distribution's
    log-softmax at the token, written out here (greedy: the model's own)."""
    logits = jax.random.normal(jax.random.key(3), (64, 50), jnp.float32) * 3
    keys = jax.random.split(jax.random.key(4), 64)
    for temperature, top_p, nucleus in ((1.0, 1.0, False), (0.7, 1.0, False), (0.7, 0.8, True), (0.0, 1.0, False),
                                        (0.0, 0.5, True)):
        t, p = jnp.float32(temperature), jnp.float32(top_p)
        tok, lp = jax.jit(sample_tokens, static_argnums=4)(logits, keys, t, p, nucleus)
        ref_tok, ref_lp = jax.jit(sample_tokens)(logits, keys, t, p)  # nucleus decided from the traced top_p
        assert (np.asarray(tok) == np.asarray(ref_tok)).all() and (np.asarray(lp) == np.asarray(ref_lp)).all()
        dist = logits if temperature == 0 else logits / temperature
        if top_p < 1 and temperature > 0:
            dist = nucleus_filter(dist, p)
        want = np.take_along_axis(np.asarray(jax.nn.log_softmax(dist, axis=-1)), np.asarray(tok)[:, None], 1)[:, 0]
        np.testing.assert_allclose(np.asarray(lp), want, rtol=1e-6, atol=1e-6)
        if temperature == 0:
            assert (np.asarray(tok) == np.asarray(logits.argmax(-1))).all()


def test_tokens_are_categoricals_and_argmaxs_from_one_pass_over_the_vocabulary():
    """The sampled token is jax.random.categorical's for the row's key, the greedy one argmax's (ties to the first,
    as argmax), and the log-prob log_softmax's at it, the same bits; the token and the log-softmax's max come out of
    one reduction over the vocabulary, with the log-softmax's sum the only other (each reads the (B, V) float32 logits:
    74 MiB a decode step at batch 128 and Qwen3's vocabulary)."""
    logits = jax.random.normal(jax.random.key(5), (32, 300), jnp.float32) * 3
    logits = logits.at[0, :].set(1.0).at[1, :150].set(-jnp.inf)  # row 0: all equal; row 1: half filtered out
    keys = jax.random.split(jax.random.key(6), 32)
    for temperature in (1.0, 0.6, 0.0):
        t = jnp.float32(temperature)
        tok, lp = jax.jit(sample_tokens, static_argnums=4)(logits, keys, t, jnp.float32(1.0), False)
        dist = logits if temperature == 0 else logits / t
        want = jnp.argmax(logits, -1) if temperature == 0 else jax.vmap(jax.random.categorical)(keys, dist)
        assert (np.asarray(tok) == np.asarray(want)).all()
        assert temperature > 0 or tok[0] == 0
        want_lp = jnp.take_along_axis(jax.nn.log_softmax(dist, axis=-1), want[:, None], axis=-1)[:, 0]
        assert (np.asarray(lp) == np.asarray(want_lp)).all()

    def reductions(jaxpr) -> list[str]:  # over the (B, V) logits, in nested jaxprs too
        found = []
        for e in jaxpr.eqns:
            if e.primitive.name in ("reduce", "reduce_max", "reduce_sum", "argmax", "argmin", "reduce_min") and any(
                    getattr(v.aval, "shape", None) == logits.shape for v in e.invars):
                found.append(e.primitive.name)
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                found += reductions(sub)
        return found

    jaxpr = jax.make_jaxpr(lambda x, k: sample_tokens(x, k, jnp.float32(1.0), jnp.float32(1.0), False))(logits, keys)
    assert sorted(reductions(jaxpr.jaxpr)) == ["reduce", "reduce_sum"]
