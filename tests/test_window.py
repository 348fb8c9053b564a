"""The actor's output head on each row's completion window only (workers.actor, workers.token_logprobs
.window_logprobs): a run's batch (workers.batch, built with max_new_tokens) says where its completions can be, and
the logprobs programs and the train step run the head there alone. Against the head on every position (the same
batch without its windows): the same log-probabilities at the completions, zeros outside the windows, the same
update; and the train program's FLOPs fall by the head's share of the positions it no longer reads.

One actor per path on a 1-layer float32 model whose head dominates (hidden 64, vocabulary 2,048): the head's
matrix is 131k of the model's 217k parameters, so its share of the FLOPs is one to see."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from workers.actor import ActorWorker
from workers.batch import build_train_batch
from workers.train_step import WINDOW, ActorSettings

W, MAX_PROMPT = 8, 16  # max_new_tokens; prompts of at most 12 tokens: bucket 16, T = 16 + 8 = 24 positions
PROMPTS, COMPLETIONS = [3, 7, 5, 12, 2, 9, 6, 4], [8, 0, 3, 5, 8, 1, 7, 2]  # lengths; row 1's completion is empty
SETTINGS = ActorSettings(remat="off", lr=1e-2, total_steps=4, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.1,
                         grad_clip=1.0, b1=0.9, b2=0.999, epsilon=0.2, epsilon_high=None, beta=0.1,
                         aggregation="token-mean", temperature=0.9, micro_batch_size=4, mini_batch_size=4, epochs=1,
                         router_aux_loss_coef=None, kl_clamp=None, max_new_tokens=W,
                         adam_mu_dtype="float32")  # 2 optimizer steps: off-policy


def _model():
    """A fresh model each call (an actor owns, and donates, its arrays), the same weights every time."""
    from flax import nnx

    from workers.models.decoder import CausalLM
    from workers.models.presets import preset_config

    return CausalLM(preset_config("tiny", vocab_size=2048).replace(num_hidden_layers=1), rngs=nnx.Rngs(0))


def _batches():
    """(the batch with its completion windows, the same batch without them)."""
    rng = np.random.default_rng(0)
    windowed = build_train_batch([rng.integers(1, 2000, n) for n in PROMPTS],
                                 [rng.integers(1, 2000, n) for n in COMPLETIONS],
                                 rng.normal(size=len(PROMPTS)).astype(np.float32), pad_id=0,
                                 logprobs=[rng.uniform(-9, -6, n).astype(np.float32) for n in COMPLETIONS],
                                 max_prompt_len=MAX_PROMPT, max_new_tokens=W)  # the sampler's: the gap metrics
    return windowed, dataclasses.replace(windowed, completion_start=None)


@pytest.fixture(scope="module")
def runs():
    """Per path: its actor's logprobs (policy, reference) before the update, its train metrics, its params after."""
    windowed, whole = _batches()
    out = {}
    for name, batch in (("window", windowed), ("whole", whole)):
        actor = ActorWorker(_model(), SETTINGS)
        before = jax.tree.map(np.asarray, actor.state.params)
        logp, ref = actor.logprobs(batch), actor.logprobs(batch, reference=True)
        metrics = actor.train(batch, step=0)
        out[name] = dict(actor=actor, batch=batch, logp=logp, ref=ref, metrics=metrics, before=before,
                         after=jax.tree.map(np.asarray, actor.state.params))
    return out


def test_the_batch_says_where_each_completion_can_be():
    windowed, _ = _batches()
    np.testing.assert_array_equal(windowed.completion_start, np.array(PROMPTS) - 1)  # position len(p) - 1 predicts c[0]
    assert windowed.tokens.shape == (8, MAX_PROMPT + W)
    assert "completion_start" in windowed.arrays()
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):  # the loss mask lies inside the window
        assert np.flatnonzero(windowed.loss_mask[i]).tolist() == list(range(p - 1, p - 1 + c))
    no_window = build_train_batch([np.arange(1, 4)], [np.arange(5, 7)], pad_id=0)  # no max_new_tokens: none known
    assert no_window.completion_start is None and "completion_start" not in no_window.with_advantages([1.0]).arrays()


def test_the_head_runs_on_the_windows_when_they_hold_the_completions(runs):
    actor, (windowed, whole) = runs["window"]["actor"], _batches()
    assert actor.windowed(windowed) and not actor.windowed(whole)
    # a window that misses a completion token, or overruns its row, or an actor of shorter completions: everywhere
    assert not actor.windowed(dataclasses.replace(windowed, completion_start=windowed.completion_start + 1))
    assert not actor.windowed(dataclasses.replace(windowed, completion_start=np.full(8, 16, np.int32)))
    shorter = ActorWorker.__new__(ActorWorker)
    shorter.settings = dataclasses.replace(SETTINGS, max_new_tokens=None)
    assert not shorter.windowed(windowed)


def test_window_logprobs_are_the_whole_heads_inside_the_windows_and_zero_outside(runs):
    """Every row, whatever its prompt's and completion's length (row 1's completion is empty): in its window the
    values the head on every position gives (float32: measured bit for bit on CPU; asserted to 1e-6), at the
    policy and at the reference, and 0 at every other position."""
    windowed = runs["window"]["batch"]
    pos = np.arange(windowed.loss_mask.shape[1])
    inside = (pos >= windowed.completion_start[:, None]) & (pos < windowed.completion_start[:, None] + W)
    assert inside.sum() == 8 * W
    for kind in ("logp", "ref"):
        got, want = runs["window"][kind], runs["whole"][kind]
        assert got.shape == want.shape == windowed.loss_mask.shape
        np.testing.assert_allclose(got[inside], want[inside], rtol=0, atol=1e-6)
        assert not np.any(got[~inside]), kind
        assert np.all(want[~inside] < 0)  # what the windows skip: real log-probabilities, nowhere read
    mask = windowed.loss_mask.astype(bool)
    assert mask[inside].sum() == mask.sum() == sum(COMPLETIONS)


def test_a_train_step_is_the_same_update_on_either_path(runs):
    """Two off-policy optimizer steps (old and reference logprobs, KL, entropy, the sampler's gap): the same metrics
    and the same new params to 1e-6 (float32; measured on CPU: every metric and param bit for bit)."""
    assert {"kl", "entropy", "logp_gap_mean", "logp_gap_max"} <= runs["whole"]["metrics"].keys()
    window, whole = runs["window"], runs["whole"]
    assert window["metrics"].keys() == whole["metrics"].keys()
    for k, v in whole["metrics"].items():
        np.testing.assert_allclose(window["metrics"][k], v, rtol=1e-6, atol=1e-6, err_msg=k)
    moved = 0.0
    for got, want, before in zip(jax.tree.leaves(window["after"]), jax.tree.leaves(whole["after"]),
                                 jax.tree.leaves(window["before"]), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        moved = max(moved, float(np.abs(want - before).max()))
    assert moved > 1e-3  # the update did move them: equal new params are no accident of an update of nothing


def test_the_train_program_runs_the_head_on_the_windows_positions_only(runs):
    """XLA's cost analysis of the two train programs (the ones the steps above ran). The head is a (H, V) matmul per
    position: 2 H V FLOPs forward and 2 x 2 H V for the gradients of the hidden state and of the (tied) embedding,
    6 H V in all (with one chunk of positions, as here, XLA computes its logits once: the rematerialised backward
    has no loop to recompute them in; at 2 chunks and more they cost 2 H V more). A micro-batch of M = 4 rows reads
    the head at T - 1 = 23 positions a row on the whole path, W = 8 in the window, so the program drops by
    M x (23 - 8) x 6 x 64 x 2,048 = 47.2 MFLOPs of matmuls, plus the softmax's elementwise work on those positions
    (a few x V each). Measured: 1.036 x that, 34.8 % of the whole path's 140.6 MFLOPs."""
    m, t, h, v = SETTINGS.micro_batch_size, MAX_PROMPT + W, 64, 2048
    flops = {}
    for name, run in runs.items():
        arrays = {**run["batch"].arrays(), "old_logp": run["logp"], "ref_logp": run["ref"]}
        assert (WINDOW in arrays) == (name == "window")
        actor = run["actor"]
        mini = {k: jax.ShapeDtypeStruct((1, m, *x.shape[1:]), x.dtype) for k, x in arrays.items()}
        program = actor._program("train", tuple(sorted(mini))).lower(actor._abstract, mini).compile()
        flops[name] = program.cost_analysis()["flops"]
    head = m * (t - 1 - W) * 6 * h * v
    drop = flops["whole"] - flops["window"]
    print(f"train program FLOPs: whole {flops['whole']:.4g}, window {flops['window']:.4g}; drop {drop:.4g} = "
          f"{drop / head:.3f} x the head's matmuls on the skipped positions, {drop / flops['whole']:.1%} of the whole")
    assert head <= drop <= 1.1 * head, (drop, head)
