"""GRPO math, pure jnp: group advantages, the clipped policy loss with a k3 KL penalty, and what the step logs
about the policy (its entropy, its gap to the sampler's log-probabilities).

Shapes: N samples (= prompts x G generations, prompt-major), G group size, L completion tokens.
No config objects, no IO, no Ray: every number in a test can be checked by hand.

Design decisions:
- The loss takes an explicit `denominator` so a mini-batch split into micro-batches gives exactly
  the gradient of the whole mini-batch: each micro-batch divides its *sum* by the mini-batch's
  token (or sequence) count instead of by its own.
- `beta == 0` takes no reference logprobs at all (`ref_logp=None`): no reference model is built.
- The field's variants are options, off by default (today's numbers unchanged): the advantage's std with ddof 1
  (TRL's and verl's `torch.std` is the sample std; DeepSeekMath writes std without saying which), the k3 KL
  clamped to [-kl_clamp, kl_clamp] (verl's `low_var_kl` clamps to 10), and Dr. GRPO's constant normaliser
  (`seq-mean-token-sum-norm`: the token sum / (sequences x max_new_tokens), TRL's `dr_grpo` loss), which
  weighs every token alike whatever its completion's length.
"""

from __future__ import annotations

import jax.numpy as jnp

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# policy_loss's metrics averaged over tokens (a micro-batch's weighted by its token count) and taken as a maximum
TOKEN_MEAN_METRICS = ("clip_frac", "kl", "ratio_mean", "entropy", "logp_gap_mean")
MAX_METRICS = ("logp_gap_max",)
# policy_loss's metrics that are NaN when their input was not given (no engine logprobs): no measurement, not a value
MEASURED_METRICS = ("entropy", "logp_gap_mean", "logp_gap_max")


def group_advantages(rewards: jnp.ndarray, group_size: int, *, normalize_std: bool = True,
                     eps: float = 1e-6, std_ddof: int = 0) -> jnp.ndarray:
    """rewards (N,) prompt-major, N = P * G -> advantages (N,).

    advantage = (r - mean of its group) / (std of its group + eps), or without the std division.
    std: the population std (std_ddof 0), or the sample std (std_ddof 1: divides by G - 1, as torch.std does);
    a group whose rewards are all equal gets advantage 0.
    """
    if std_ddof not in (0, 1):
        raise ValueError(f"std_ddof must be 0 (population std) or 1 (sample std), got {std_ddof!r}")
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards must be (P * G,) with G={group_size}, got shape {rewards.shape}")
    grouped = rewards.reshape(-1, group_size).astype(jnp.float32)  # (P, G)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    if normalize_std:
        centred = centred / (grouped.std(axis=1, keepdims=True, ddof=std_ddof) + eps)
    # A float32 mean of G equal rewards is not always that reward (8 x 0.7 sums to 5.6000004), and dividing the
    # rounding by a std of ~1e-8 + eps makes it a push of ~0.05-0.2 on every sample of the group: a tied group
    # carries no signal, so its advantage is 0 exactly.
    tied = (grouped == grouped[:, :1]).all(axis=1, keepdims=True)  # (P, 1)
    return jnp.where(tied, 0.0, centred).reshape(-1)


def tied_groups(rewards: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """rewards (N,) prompt-major -> the share of groups whose G rewards are all equal (advantage 0: no signal)."""
    grouped = rewards.reshape(-1, group_size)
    return (grouped == grouped[:, :1]).all(axis=1).mean()


def step_advantages(rewards: jnp.ndarray, group_size: int, *, normalize_std: bool = True,
                    std_ddof: int = 0) -> tuple[jnp.ndarray, jnp.ndarray]:
    """rewards (N,) prompt-major -> (group_advantages (N,), tied_groups ()): what a step's TRAIN starts from, as one
    program (the actor's role compiles it with the step's other programs: rlsched.run.roles.ActorRole)."""
    return (group_advantages(rewards, group_size, normalize_std=normalize_std, std_ddof=std_ddof),
            tied_groups(rewards, group_size))


def loss_denominator(mask: jnp.ndarray, aggregation: str, max_tokens: int | None = None) -> jnp.ndarray:
    """What `policy_loss` divides its sum by: valid tokens (token-mean), sequences with at least one valid
    token (seq-mean-token-mean), or the constant sequences x `max_tokens` (seq-mean-token-sum-norm, Dr. GRPO:
    every row counts, however long its completion). mask: (N, L)."""
    if aggregation == "token-mean":
        return mask.sum()
    if aggregation == "seq-mean-token-mean":
        return (mask.sum(axis=1) > 0).sum()
    if aggregation == "seq-mean-token-sum-norm":
        if max_tokens is None or max_tokens < 1:
            raise ValueError(f"aggregation 'seq-mean-token-sum-norm' divides by sequences x max_tokens; give "
                             f"max_tokens (grpo.max_new_tokens) >= 1, got {max_tokens!r}")
        return jnp.asarray(mask.shape[0] * max_tokens, jnp.float32)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def policy_loss(logp: jnp.ndarray, old_logp: jnp.ndarray, ref_logp: jnp.ndarray | None, advantages: jnp.ndarray,
                mask: jnp.ndarray, *, epsilon: float, epsilon_high: float | None = None, beta: float,
                aggregation: str = "token-mean", denominator: jnp.ndarray | None = None,
                kl_clamp: float | None = None, max_tokens: int | None = None,
                entropy: jnp.ndarray | None = None, sampler_logp: jnp.ndarray | None = None):
    """Clipped-surrogate GRPO loss -> (loss scalar, metrics dict).

    logp, old_logp, ref_logp: (N, L) per-token log-probs under the current, rollout-time and
    reference policies; advantages: (N,); mask: (N, L) 1 for completion tokens that count.

    per token:  ratio = exp(logp - old_logp)
                pg    = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)
                kl    = exp(ref - logp) - (ref - logp) - 1        (k3: unbiased, always >= 0)
                        clipped to [-kl_clamp, kl_clamp] when kl_clamp is set (verl: 10)
                loss  = pg + beta * kl
    aggregation "token-mean": sum over valid tokens / number of valid tokens.
                "seq-mean-token-mean": mean over each sequence's valid tokens, then / sequences.
                "seq-mean-token-sum-norm": sum over valid tokens / (sequences x max_tokens) (Dr. GRPO).
    denominator: override the count divided by (see module docstring); default: this batch's.
    Metrics only (no gradient flows through them): `entropy` (N, L), the policy's entropy at each position
    (workers.token_logprobs), averaged over valid tokens; `sampler_logp` (N, L), the rollout engine's log-probs of the
    same tokens: `logp_gap_mean`/`logp_gap_max` are the mean and max of |old_logp - sampler_logp| over valid
    tokens (the actor's rollout-time policy against the sampler's; NaN where the engine gave none). Either
    missing: its metrics are NaN.
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
        if kl_clamp is not None:
            kl = jnp.clip(kl, -kl_clamp, kl_clamp)
        per_token = per_token + beta * kl

    if denominator is None:
        denominator = loss_denominator(mask, aggregation, max_tokens)
    denominator = jnp.maximum(denominator, 1)
    if aggregation in ("token-mean", "seq-mean-token-sum-norm"):
        loss = (per_token * mask).sum() / denominator
    elif aggregation == "seq-mean-token-mean":
        seq_tokens = jnp.maximum(mask.sum(axis=1), 1.0)
        loss = ((per_token * mask).sum(axis=1) / seq_tokens).sum() / denominator
    else:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")

    n_tok = jnp.maximum(mask.sum(), 1.0)
    # A token is "clipped" when the clipped branch is the one min() chose and it differs.
    was_clipped = (clipped * adv < ratio * adv) & (ratio != clipped)
    valid = mask > 0
    nan = jnp.full((), jnp.nan, jnp.float32)
    # where(), not a product: a padding position's value may be NaN (a sampler's log-prob nobody computed)
    gap = None if sampler_logp is None else jnp.where(valid, jnp.abs(old_logp - sampler_logp), 0.0)
    metrics = {
        "loss": loss,
        "clip_frac": (was_clipped * mask).sum() / n_tok,
        "kl": (kl * mask).sum() / n_tok,
        "ratio_mean": (ratio * mask).sum() / n_tok,
        "tokens": mask.sum(),
        "entropy": nan if entropy is None else jnp.where(valid, entropy, 0.0).sum() / n_tok,
        "logp_gap_mean": nan if gap is None else gap.sum() / n_tok,
        "logp_gap_max": nan if gap is None else gap.max(),
    }
    return loss, metrics

