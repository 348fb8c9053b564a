"""Log-probabilities (and entropy) of the target tokens from the final hidden states, by chunks of positions.

A real vocabulary makes the logits the peak of a train step: [rows, positions, vocabulary] in float32 is
16 x 512 x 151,936 x 4 B = 5 GB for one micro-batch of Qwen3, and autodiff keeps it (and its softmax) for the
backward. Here the output head runs on `chunk` positions at a time inside a scan whose body is rematerialised
(jax.checkpoint): the forward keeps, per chunk, only the hidden states it read; the backward recomputes that
chunk's logits. The largest logits array alive is [rows, chunk, vocabulary], whatever the sequence length.

A train batch reads log-probabilities at its completion positions only (the loss mask), and a run's batches put
each row's completion in a window of max_new_tokens positions known before the step (workers.batch:
`completion_start`). `window_logprobs` runs the head on those W positions of each row, not all T: at Qwen3-0.6B's
shape (hidden 1,024, vocabulary 151,936, 256 prompt + 256 new positions) the head is ~26 % of a forward's FLOPs, and
half of it went to prompt positions whose log-probabilities nobody reads.

Shapes: B rows, T positions, H hidden, V vocabulary, C the chunk, W the window. Pure jnp; no model class: `head` is
any function hidden (B, C, H) -> float32 logits (B, C, V) (a CausalLM's `logits`, with its head adapters).
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
    n = -(-t // max(1, chunk))  # as few chunks as `chunk` allows, each as short as they can be: padding < n positions
    c = -(-t // n)  # (a window of 192 positions runs two chunks of 96, not 128 + 64 of padding)
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


def window_logprobs(head: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array, start: jax.Array,
                    width: int, *, temperature: float, chunk: int = DEFAULT_CHUNK) -> tuple[jax.Array, jax.Array]:
    """`target_logprobs` at positions [start_i, start_i + width) of each row i only, zeros elsewhere: hidden (B, T, H),
    targets int (B, T), start int (B,), width static -> (log p(targets) (B, T), entropy (B, T)), float32.

    The head runs on the gathered (B, width, H) hidden states (B x width positions, not B x T); what it gives is
    scattered back to its positions, so every caller reads (B, T) as before, and must read it only inside the
    windows (a GRPO loss reads it where the loss mask is 1). The caller keeps every window inside the row:
    0 <= start_i and start_i + width <= T (workers.actor checks a batch's on the host; an index outside would read
    NaN here). The gradient flows back into `hidden` at the window's positions only."""
    b, t, _ = hidden.shape
    if not 1 <= width <= t:
        raise ValueError(f"window width {width} must be within 1..{t}, the positions of the rows")
    idx = start.astype(jnp.int32)[:, None] + jnp.arange(width, dtype=jnp.int32)  # (B, W)
    logp, entropy = target_logprobs(head, jnp.take_along_axis(hidden, idx[..., None], axis=1, mode="fill"),
                                    jnp.take_along_axis(targets, idx, axis=1, mode="fill"), temperature=temperature,
                                    chunk=chunk)  # (B, W) each
    rows = jnp.arange(b)[:, None]
    scatter = lambda a: jnp.zeros((b, t), a.dtype).at[rows, idx].set(a, mode="drop")  # noqa: E731
    return scatter(logp), scatter(entropy)
