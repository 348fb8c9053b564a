"""GRPO math, pure jnp: group advantages and the clipped policy loss with a k3 KL penalty.

Shapes: N samples (= prompts x G generations, prompt-major), G group size, L completion tokens.
No config objects, no IO, no Ray: every number in a test can be checked by hand.

Design decisions:
- The loss takes an explicit `denominator` so a mini-batch split into micro-batches gives exactly
  the gradient of the whole mini-batch: each micro-batch divides its *sum* by the mini-batch's
  token (or sequence) count instead of by its own.
- `beta == 0` takes no reference logprobs at all (`ref_logp=None`): no reference model is built.
"""

from __future__ import annotations

import jax.numpy as jnp

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def group_advantages(rewards: jnp.ndarray, group_size: int, *, normalize_std: bool = True,
                     eps: float = 1e-6) -> jnp.ndarray:
    """rewards (N,) prompt-major, N = P * G -> advantages (N,).

    advantage = (r - mean of its group) / (std of its group + eps), or without the std division.
    std is the population std (ddof=0); a group whose rewards are all equal gets advantage 0.
    """
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards must be (P * G,) with G={group_size}, got shape {rewards.shape}")
    grouped = rewards.reshape(-1, group_size).astype(jnp.float32)  # (P, G)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    if normalize_std:
        centred = centred / (grouped.std(axis=1, keepdims=True) + eps)
    # A float32 mean of G equal rewards is not always that reward (8 x 0.7 sums to 5.6000004), and dividing the
    # rounding by a std of ~1e-8 + eps makes it a push of ~0.05-0.2 on every sample of the group: a tied group
    # carries no signal, so its advantage is 0 exactly.
    tied = (grouped == grouped[:, :1]).all(axis=1, keepdims=True)  # (P, 1)
    return jnp.where(tied, 0.0, centred).reshape(-1)


def tied_groups(rewards: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """rewards (N,) prompt-major -> the share of groups whose G rewards are all equal (advantage 0: no signal)."""
    grouped = rewards.reshape(-1, group_size)
    return (grouped == grouped[:, :1]).all(axis=1).mean()


def loss_denominator(mask: jnp.ndarray, aggregation: str) -> jnp.ndarray:
    """What `policy_loss` divides its sum by: valid tokens (token-mean) or sequences with at least
    one valid token (seq-mean-token-mean). mask: (N, L)."""
    if aggregation == "token-mean":
        return mask.sum()
    if aggregation == "seq-mean-token-mean":
        return (mask.sum(axis=1) > 0).sum()
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def policy_loss(logp: jnp.ndarray, old_logp: jnp.ndarray, ref_logp: jnp.ndarray | None, advantages: jnp.ndarray,
                mask: jnp.ndarray, *, epsilon: float, epsilon_high: float | None = None, beta: float,
                aggregation: str = "token-mean", denominator: jnp.ndarray | None = None):
    """Clipped-surrogate GRPO loss -> (loss scalar, metrics dict).

    logp, old_logp, ref_logp: (N, L) per-token log-probs under the current, rollout-time and
    reference policies; advantages: (N,); mask: (N, L) 1 for completion tokens that count.

    per token:  ratio = exp(logp - old_logp)
                pg    = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)
                kl    = exp(ref - logp) - (ref - logp) - 1        (k3: unbiased, always >= 0)
                loss  = pg + beta * kl
    aggregation "token-mean": sum over valid tokens / number of valid tokens.
                "seq-mean-token-mean": mean over each sequence's valid tokens, then / sequences.
    denominator: override the count divided by (see module docstring); default: this batch's.
    """
    if beta and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the reference policy's log-probs)")
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.astype(jnp.float32)
    adv = advantages[:, None].astype(jnp.float32)  # (N, 1)
    log_ratio = logp - old_logp
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + eps_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)  # (N, L)
    kl = jnp.zeros_like(logp)
    if beta:
        delta = ref_logp - logp
        kl = jnp.exp(delta) - delta - 1.0
        per_token = per_token + beta * kl

    if denominator is None:
        denominator = loss_denominator(mask, aggregation)
    denominator = jnp.maximum(denominator, 1)
    if aggregation == "token-mean":
        loss = (per_token * mask).sum() / denominator
    elif aggregation == "seq-mean-token-mean":
        seq_tokens = jnp.maximum(mask.sum(axis=1), 1.0)
        loss = ((per_token * mask).sum(axis=1) / seq_tokens).sum() / denominator
    else:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")

    n_tok = jnp.maximum(mask.sum(), 1.0)
    # A token is "clipped" when the clipped branch is the one min() chose and it differs.
    was_clipped = (clipped * adv < ratio * adv) & (ratio != clipped)
    metrics = {
        "loss": loss,
        "clip_frac": (was_clipped * mask).sum() / n_tok,
        "kl": (kl * mask).sum() / n_tok,
        "ratio_mean": (ratio * mask).sum() / n_tok,
        "tokens": mask.sum(),
    }
    return loss, metrics
