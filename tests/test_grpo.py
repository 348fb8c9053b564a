"""GRPO math against arithmetic written out by hand, and gradients against finite differences."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workers.grpo import group_advantages, loss_denominator, policy_loss, tied_groups
from workers.token_logprobs import target_logprobs


def test_group_advantages_by_hand():
    # group 1: [1, 0, 0, 1] mean 0.5, population std 0.5 -> [1, -1, -1, 1]
    # group 2: [2, 2, 2, 2] all equal -> 0 whatever the std
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4, eps=0.0 + 1e-12)
    np.testing.assert_allclose(adv, [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-6)
    # without std: r - mean -> [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    np.testing.assert_allclose(group_advantages(rewards, 4, normalize_std=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    # eps matters: std 0.5 + eps 0.5 = 1 -> [0.5, -0.5, ...]
    np.testing.assert_allclose(group_advantages(rewards[:4], 4, eps=0.5), [0.5, -0.5, -0.5, 0.5], atol=1e-6)
    with pytest.raises(ValueError, match="G=3"):
        group_advantages(rewards, 3)


@pytest.mark.parametrize("group_size", [5, 8, 12, 16])
@pytest.mark.parametrize("value", [0.7, 2.1, 1 / 3, 0.1, -0.3, 1e-3, 7.77])
def test_a_tied_group_gets_advantage_zero_exactly(value, group_size):
    # A float32 mean of G copies of r need not be r (8 x 0.7 -> 0.70000005), and the old (r - mean) / (std + 1e-6)
    # turned that rounding into +0.056 per sample; with or without the std, a tied group must carry no signal.
    squares = jnp.arange(group_size, dtype=jnp.float32) ** 2  # a group with no member at its mean
    rewards = jnp.concatenate([jnp.full(group_size, value), squares])
    for normalize_std in (True, False):
        adv = np.asarray(group_advantages(rewards, group_size, normalize_std=normalize_std))
        assert (adv[:group_size] == 0.0).all(), adv[:group_size]
        assert np.abs(adv[group_size:]).min() > 0  # the other group still has its signal
    assert float(tied_groups(rewards, group_size)) == 0.5


def test_on_policy_loss_is_minus_mean_advantage():
    # ratio = 1 everywhere -> pg = -A per token; token-mean over 3 valid tokens:
    # sample 0 (A=2) has 2 valid tokens, sample 1 (A=-1) has 1 -> -(2 + 2 - 1) / 3 = -1
    logp = jnp.log(jnp.array([[0.5, 0.25, 0.9], [0.1, 0.3, 0.2]]))
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    loss, m = policy_loss(logp, logp, None, jnp.array([2.0, -1.0]), mask, epsilon=0.2, beta=0.0)
    np.testing.assert_allclose(loss, -1.0, rtol=1e-6)
    np.testing.assert_allclose(m["ratio_mean"], 1.0, rtol=1e-6)
    assert float(m["clip_frac"]) == 0.0 and float(m["kl"]) == 0.0
    # seq-mean-token-mean: sample means -2 and +1 -> (-2 + 1) / 2 = -0.5
    loss, _ = policy_loss(logp, logp, None, jnp.array([2.0, -1.0]), mask, epsilon=0.2, beta=0.0,
                          aggregation="seq-mean-token-mean")
    np.testing.assert_allclose(loss, -0.5, rtol=1e-6)


def test_clipping_by_hand():
    # ratios 1.5, 0.5, 1.1 (logp - old = log ratio); epsilon 0.2 -> clip range [0.8, 1.2]
    old = jnp.zeros((1, 3))
    logp = jnp.log(jnp.array([[1.5, 0.5, 1.1]]))
    mask = jnp.ones((1, 3))
    # A = +1: min(1.5, 1.2)=1.2, min(0.5, 0.8)=0.5, min(1.1, 1.1)=1.1 -> loss -(1.2+0.5+1.1)/3 = -0.9333
    # clipped tokens: only the first (its clipped value 1.2 was chosen over 1.5) -> clip_frac 1/3
    loss, m = policy_loss(logp, old, None, jnp.array([1.0]), mask, epsilon=0.2, beta=0.0)
    np.testing.assert_allclose(loss, -(1.2 + 0.5 + 1.1) / 3, rtol=1e-6)
    np.testing.assert_allclose(m["clip_frac"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["ratio_mean"], (1.5 + 0.5 + 1.1) / 3, rtol=1e-6)
    # A = -1: min(-1.5, -1.2)=-1.5, min(-0.5, -0.8)=-0.8, -1.1 -> loss (1.5+0.8+1.1)/3 = 1.1333; clipped: 2nd
    loss, m = policy_loss(logp, old, None, jnp.array([-1.0]), mask, epsilon=0.2, beta=0.0)
    np.testing.assert_allclose(loss, (1.5 + 0.8 + 1.1) / 3, rtol=1e-6)
    np.testing.assert_allclose(m["clip_frac"], 1 / 3, rtol=1e-6)
    # asymmetric (DAPO clip-higher): epsilon_high 0.6 -> upper bound 1.6, so 1.5 is not clipped for A=+1:
    # -(1.5 + 0.5 + 1.1) / 3 = -1.0333
    loss, m = policy_loss(logp, old, None, jnp.array([1.0]), mask, epsilon=0.2, epsilon_high=0.6, beta=0.0)
    np.testing.assert_allclose(loss, -(1.5 + 0.5 + 1.1) / 3, rtol=1e-6)
    assert float(m["clip_frac"]) == 0.0


def test_k3_kl_by_hand():
    # on-policy, A = 0, so the loss is beta * KL. ref - logp = d:
    # d = ln 2: e^d - d - 1 = 2 - 0.693147 - 1 = 0.306853;  d = 0: 0
    logp = jnp.array([[0.0, -1.0]])
    ref = jnp.array([[np.log(2.0), -1.0]])
    loss, m = policy_loss(logp, logp, ref, jnp.array([0.0]), jnp.ones((1, 2)), epsilon=0.2, beta=0.5)
    kl = 2 - np.log(2.0) - 1
    np.testing.assert_allclose(m["kl"], kl / 2, rtol=1e-6)
    np.testing.assert_allclose(loss, 0.5 * kl / 2, rtol=1e-6)


def test_beta_zero_needs_no_reference_and_beta_positive_does():
    x = jnp.zeros((1, 2))
    policy_loss(x, x, None, jnp.zeros(1), jnp.ones((1, 2)), epsilon=0.2, beta=0.0)
    with pytest.raises(ValueError, match="beta > 0 needs ref_logp"):
        policy_loss(x, x, None, jnp.zeros(1), jnp.ones((1, 2)), epsilon=0.2, beta=0.1)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_with_shared_denominator_sum_to_the_full_batch(aggregation):
    rng = np.random.default_rng(0)
    logp = jnp.asarray(rng.normal(-2, 0.3, (4, 5)), jnp.float32)
    old = jnp.asarray(rng.normal(-2, 0.3, (4, 5)), jnp.float32)
    ref = jnp.asarray(rng.normal(-2, 0.3, (4, 5)), jnp.float32)
    adv = jnp.asarray(rng.normal(0, 1, 4), jnp.float32)
    mask = jnp.asarray(rng.random((4, 5)) < 0.7)
    kw = dict(epsilon=0.2, beta=0.1, aggregation=aggregation, max_tokens=7)
    full, _ = policy_loss(logp, old, ref, adv, mask, **kw)
    denom = loss_denominator(mask, aggregation, 7)
    parts = [policy_loss(logp[s], old[s], ref[s], adv[s], mask[s], denominator=denom, **kw)[0]
             for s in (slice(0, 2), slice(2, 4))]
    np.testing.assert_allclose(parts[0] + parts[1], full, rtol=1e-6)


def test_gradient_matches_finite_differences():
    """d loss / d logp, analytically by JAX vs central differences in float64 numpy."""
    rng = np.random.default_rng(1)
    old = rng.normal(-1.5, 0.2, (2, 3))
    ref = rng.normal(-1.5, 0.2, (2, 3))
    logp0 = old + rng.normal(0, 0.1, (2, 3))  # ratios near 1, mostly inside the clip range
    adv = np.array([1.3, -0.7])
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    kw = dict(epsilon=0.2, beta=0.04)

    def f(lp):
        return policy_loss(lp, jnp.asarray(old, jnp.float32), jnp.asarray(ref, jnp.float32),
                           jnp.asarray(adv, jnp.float32), jnp.asarray(mask), **kw)[0]

    grad = np.asarray(jax.grad(f)(jnp.asarray(logp0, jnp.float32)))

    def f64(lp):  # the same formula, float64, for the numerical reference
        ratio = np.exp(lp - old)
        pg = -np.minimum(ratio * adv[:, None], np.clip(ratio, 0.8, 1.2) * adv[:, None])
        d = ref - lp
        return ((pg + 0.04 * (np.exp(d) - d - 1)) * mask).sum() / mask.sum()

    h = 1e-6
    numeric = np.zeros_like(logp0)
    for idx in np.ndindex(*logp0.shape):
        up, down = logp0.copy(), logp0.copy()
        up[idx] += h
        down[idx] -= h
        numeric[idx] = (f64(up) - f64(down)) / (2 * h)
    np.testing.assert_allclose(grad, numeric, atol=1e-5)
    assert np.all(grad[1, 2] == 0)  # masked token gets no gradient


def test_advantage_std_with_ddof_1_by_hand():
    # group [1, 0, 0, 1]: mean 0.5, deviations +-0.5; sample std sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.577350
    # -> +-0.5 / 0.577350 = +-0.866025 (the population std 0.5 gives +-1, test_group_advantages_by_hand)
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    adv = group_advantages(rewards, 4, eps=1e-12, std_ddof=1)
    np.testing.assert_allclose(adv, [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0], rtol=1e-6)
    assert (np.asarray(adv[4:]) == 0).all()  # a tied group stays 0 exactly
    with pytest.raises(ValueError, match="std_ddof must be 0 .* or 1 .*, got 2"):
        group_advantages(rewards, 4, std_ddof=2)


def test_k3_kl_clamped_by_hand():
    # on-policy, A = 0, beta 1: the loss is the mean KL. ref - logp = d:
    # d = ln 20: e^d - d - 1 = 20 - 2.995732 - 1 = 16.004268, clamped at 10; d = 0: 0
    logp = jnp.array([[0.0, -1.0]])
    ref = jnp.array([[np.log(20.0), -1.0]])
    kw = dict(epsilon=0.2, beta=1.0)
    loss, m = policy_loss(logp, logp, ref, jnp.array([0.0]), jnp.ones((1, 2)), **kw)
    np.testing.assert_allclose([loss, m["kl"]], [(20 - np.log(20.0) - 1) / 2] * 2, rtol=1e-6)  # off by default
    loss, m = policy_loss(logp, logp, ref, jnp.array([0.0]), jnp.ones((1, 2)), kl_clamp=10.0, **kw)
    np.testing.assert_allclose([loss, m["kl"]], [10 / 2, 10 / 2], rtol=1e-6)

    # a clamped token passes no gradient (as torch.clamp): d/d logp of e^(ref - logp) - (ref - logp) - 1 is
    # 1 - e^(ref - logp) = 1 - 20 = -19 unclamped; / 2 tokens -> -9.5
    def grad(**extra):
        return np.asarray(jax.grad(lambda lp: policy_loss(lp, jax.lax.stop_gradient(lp), ref, jnp.array([0.0]),
                                                          jnp.ones((1, 2)), **kw, **extra)[0])(logp))

    np.testing.assert_allclose(grad()[0, 0], -9.5, rtol=1e-5)
    assert grad(kl_clamp=10.0)[0, 0] == 0.0


def test_dr_grpo_constant_normaliser_by_hand():
    # on-policy (ratio 1): pg = -A per token. sample 0 (A=2) has 2 valid tokens, sample 1 (A=-1) has 1:
    # token sum -(2 + 2 - 1) = -3, divided by 2 sequences x max_tokens 4 = 8 -> -0.375 (token-mean: -3 / 3 = -1)
    logp = jnp.log(jnp.array([[0.5, 0.25, 0.9], [0.1, 0.3, 0.2]]))
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    kw = dict(epsilon=0.2, beta=0.0, aggregation="seq-mean-token-sum-norm")
    loss, _ = policy_loss(logp, logp, None, jnp.array([2.0, -1.0]), mask, max_tokens=4, **kw)
    np.testing.assert_allclose(loss, -0.375, rtol=1e-6)
    # a constant: a completion one token longer adds its token's term and changes nothing else's weight
    longer = mask.at[1, 1].set(1)
    loss, _ = policy_loss(logp, logp, None, jnp.array([2.0, -1.0]), longer, max_tokens=4, **kw)
    np.testing.assert_allclose(loss, -(2 + 2 - 1 - 1) / 8, rtol=1e-6)
    assert float(loss_denominator(mask, "seq-mean-token-sum-norm", 4)) == 8.0
    with pytest.raises(ValueError, match="give max_tokens .* got None"):
        policy_loss(logp, logp, None, jnp.array([2.0, -1.0]), mask, **kw)


def test_token_entropy_by_hand():
    # logits [0, ln 3]: p = [1/4, 3/4]; H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.346574 + 0.215762 = 0.562335
    # temperature 2: z = [0, ln 3 / 2], p = [1, sqrt 3] / (1 + sqrt 3) = [0.366025, 0.633975];
    # H = -(0.366025 ln 0.366025 + 0.633975 ln 0.633975) = 0.367875 + 0.288932 = 0.656806
    # 8 equal logits: H = ln 8 = 2.079442
    def token_entropy(logits, temperature):  # the head is the identity: the "hidden states" are the logits
        return target_logprobs(lambda h: h, logits, jnp.zeros(logits.shape[:-1], jnp.int32),
                               temperature=temperature)[1]

    logits = jnp.array([[[0.0, np.log(3.0)]]])
    np.testing.assert_allclose(token_entropy(logits, 1.0), [[0.562335]], rtol=1e-5)
    np.testing.assert_allclose(token_entropy(logits, 2.0), [[0.656806]], rtol=1e-5)
    np.testing.assert_allclose(token_entropy(jnp.full((1, 3, 8), 5.0), 1.0), [[np.log(8.0)] * 3], rtol=1e-6)


def test_entropy_and_sampler_gap_metrics_by_hand():
    # valid tokens: (0, 0), (0, 1), (1, 0). entropy [0.5, 1.0, 1.5] there -> mean 1.0 (the masked 9.0 does not count)
    # |old - sampler|: 0.5, 0, 0.25 -> mean 0.75 / 3 = 0.25, max 0.5; the NaN sits where no token counts
    old = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -0.1, -0.2]])
    sampler = jnp.array([[-1.5, -2.0, jnp.nan], [-0.25, jnp.nan, jnp.nan]])
    entropy = jnp.array([[0.5, 1.0, 9.0], [1.5, 9.0, 9.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    loss, m = policy_loss(old, old, None, jnp.array([1.0, -1.0]), mask, epsilon=0.2, beta=0.0, entropy=entropy,
                          sampler_logp=sampler)
    np.testing.assert_allclose([m["entropy"], m["logp_gap_mean"], m["logp_gap_max"]], [1.0, 0.25, 0.5], rtol=1e-6)
    np.testing.assert_allclose(loss, -(1 + 1 - 1) / 3, rtol=1e-6)  # metrics only: the loss is as without them
    # an engine that gave no logprobs (NaN where tokens count), or none given: NaN, which nobody logs
    _, m = policy_loss(old, old, None, jnp.array([1.0, -1.0]), mask, epsilon=0.2, beta=0.0,
                       sampler_logp=jnp.full((2, 3), jnp.nan))
    assert np.isnan(m["logp_gap_mean"]) and np.isnan(m["logp_gap_max"]) and np.isnan(m["entropy"])
