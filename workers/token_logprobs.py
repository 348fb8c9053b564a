"""Log-probabilities (and entropy) of the target tokens from the final hidden states, by chunks of positions.

A real vocabulary makes the logits the peak of a train step: [rows, positions, vocabulary] in float32 is
16 x 512 x 151,936 x 4 B = 5 GB for one micro-batch of Qwen3, and autodiff keeps it (and its softmax) for the
backward. Here the output head runs on `chunk` positions at a time inside a scan whose body is rematerialised
(jax.checkpoint): the forward keeps, per chunk, only the hidden states it read; the backward recomputes that
chunk's logits. The largest logits array alive is [rows, chunk, vocabulary], whatever the sequence length.

Shapes: B rows, T positions, H hidden, V vocabulary, C the chunk. Pure jnp; no model class: `head` is any
function hidden (B, C, H) -> float32 logits (B, C, V) (a CausalLM's `logits`, with its head adapters).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

DEFAULT_CHUNK = 128  # positions per chunk: [16, 128, 151,936] float32 is 1.2 GB, against 4.9 GB at 512 positions


def target_logprobs(head: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array, *,
                    temperature: float, chunk: int = DEFAULT_CHUNK) -> tuple[jax.Array, jax.Array]:
    """hidden (B, T, H), targets int (B, T) -> (log p(targets) (B, T), entropy (B, T)), both float32, of
    softmax(head(hidden) / temperature) at each position. The entropy carries no gradient (a metric).

    Equal to log_softmax over the whole [B, T, V] logits up to float rounding of the same per-position sums
    (tests/test_token_logprobs.py); its gradient flows into `hidden` and through `head` into its weights."""
    b, t, h = hidden.shape
    c = max(1, min(chunk, t))
    n = -(-t // c)
    pad = n * c - t
    if pad:  # the last chunk's tail: zero hidden states and token 0, dropped below
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    hs = hidden.reshape(b, n, c, h).swapaxes(0, 1)  # (n, B, C, H)
    ts = targets.reshape(b, n, c).swapaxes(0, 1)  # (n, B, C)

    @jax.checkpoint  # the backward recomputes this chunk's logits instead of keeping them
    def one(hc, tc):
        z = head(hc).astype(jnp.float32) / temperature  # (B, C, V)
        lse = jax.nn.logsumexp(z, axis=-1)  # (B, C)
        logp = jnp.take_along_axis(z, tc[..., None], axis=-1)[..., 0] - lse
        # -sum(p log p) of the log-probabilities themselves: lse - sum(p z) cancels two large numbers (1e-5 off
        # where the entropy is ~0.06)
        logq = jax.lax.stop_gradient(z - lse[..., None])
        entropy = -(jnp.exp(logq) * logq).sum(axis=-1)
        return logp, entropy

    logp, entropy = jax.lax.map(lambda xs: one(*xs), (hs, ts))  # (n, B, C) each
    unchunk = lambda a: a.swapaxes(0, 1).reshape(b, n * c)[:, :t]  # noqa: E731
    return unchunk(logp), unchunk(entropy)
