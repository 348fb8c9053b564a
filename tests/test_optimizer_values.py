"""The optimizer from traced values (workers.train_step.OptimizerValues, `schedule_from`, `optimizer_from`): what the
co-batched step builds each member's optimizer from, so that a sweep over learning rates, weight decay, warmup,
schedule length, clipping or Adam's betas runs one program (tests/test_cotrain.py runs one). It is `make_schedule` and
`make_optimizer`, the solo path's, with the settings as arrays."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from workers.train_step import (
    OPTIMIZER_ONLY,
    ActorSettings,
    OptimizerValues,
    make_optimizer,
    make_schedule,
    optimizer_from,
    optimizer_values,
    schedule_from,
)

SETTINGS = ActorSettings(remat="layers", adam_mu_dtype="float32", lr=1e-2, total_steps=6, warmup_steps=2,
                         min_lr_ratio=0.5, weight_decay=0.01, grad_clip=1.0, b1=0.9, b2=0.999, epsilon=0.2,
                         epsilon_high=None, beta=0.0, aggregation="token-mean", temperature=1.0, micro_batch_size=4,
                         mini_batch_size=8, epochs=1, router_aux_loss_coef=None, kl_clamp=None, max_new_tokens=None)
COUNTS = jnp.arange(0, 320, dtype=jnp.int32)


def _schedule(v: OptimizerValues, counts=COUNTS) -> np.ndarray:
    """`schedule_from(v)` at `counts`, the values traced (arguments of the program, as in the co-batched step)."""
    return np.asarray(jax.jit(lambda v, c: jax.vmap(schedule_from(v))(c))(v, counts))


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    """How many float32 steps apart `a` and `b` are at most (both >= 0)."""
    return int(np.max(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))))


def test_the_values_are_the_settings_only_the_optimizer_reads():
    assert tuple(OPTIMIZER_ONLY) == OptimizerValues._fields
    assert set(OptimizerValues._fields) <= {f.name for f in dataclasses.fields(ActorSettings)}
    v = optimizer_values(SETTINGS)
    assert {name: (x.dtype, x.shape) for name, x in v._asdict().items()} == {
        name: (np.dtype(np.int32 if name in ("total_steps", "warmup_steps") else np.float32), ())
        for name in OptimizerValues._fields}
    assert [float(x) for x in v] == [float(np.float32(getattr(SETTINGS, name))) for name in OptimizerValues._fields]


def test_the_schedule_from_values_at_hand_computed_steps():
    # lr 1e-2, 2 warmup steps from 0, then a cosine over the 4 steps left to lr * 0.5 at step 6 and after:
    # step 1: 1e-2 * 1/2; step 4: 2 of 4 cosine steps, 0.5 * (1 + cos(pi / 2)) = 0.5, so 1e-2 * (0.5 * 0.5 + 0.5)
    got = _schedule(optimizer_values(SETTINGS), jnp.arange(8, dtype=jnp.int32))
    np.testing.assert_allclose(got, [0.0, 5e-3, 1e-2, 1e-2 * (0.5 * (1 + np.cos(np.pi / 4)) * 0.5 + 0.5), 7.5e-3,
                                     1e-2 * (0.5 * (1 + np.cos(3 * np.pi / 4)) * 0.5 + 0.5), 5e-3, 5e-3], rtol=1e-6)
    # without warmup the first step runs at the peak
    assert _schedule(optimizer_values(dataclasses.replace(SETTINGS, warmup_steps=0)), jnp.zeros(1, jnp.int32)) == \
        np.float32(1e-2)


def test_the_schedule_from_values_is_make_schedule_s():
    """To the bit where 1 - min_lr_ratio rounds alike (optax folds it in float64, the values hold min_lr_ratio in
    float32), else within 2 ulp; over warmups (none, shorter and longer than the run), lengths and rates. Stacked
    under vmap, each member's schedule is its own."""
    grid = list(itertools.product([3e-6, 5e-3], [1, 12, 300], [0, 3, 50], [0.0, 0.1, 0.77]))
    for lr, total, warmup, ratio in grid:
        s = dataclasses.replace(SETTINGS, lr=lr, total_steps=total, warmup_steps=warmup, min_lr_ratio=ratio)
        want = np.asarray(jax.jit(jax.vmap(make_schedule(s)))(COUNTS))
        got = _schedule(optimizer_values(s))
        alike = np.float32(1 - ratio) == np.float32(1) - np.float32(ratio)
        assert _ulps(got, want) <= (0 if alike else 2), (s, _ulps(got, want))
    members = [dataclasses.replace(SETTINGS, lr=lr, total_steps=total, warmup_steps=warmup, min_lr_ratio=ratio)
               for lr, total, warmup, ratio in grid[::5]]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *[optimizer_values(s) for s in members])
    together = jax.jit(jax.vmap(lambda v: jax.vmap(schedule_from(v))(COUNTS)))(stacked)
    for row, s in zip(np.asarray(together), members, strict=True):
        np.testing.assert_array_equal(row, _schedule(optimizer_values(s)))


def _train(settings: ActorSettings, *, traced: bool):
    """Six steps of the optimizer on a small tree with fixed gradients (some clipped): (params, optimizer state),
    with `make_optimizer(settings)`, or `optimizer_from` its values passed as arguments."""
    rng = np.random.default_rng(0)
    params = {"a": rng.normal(size=(8, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}
    grads = [{k: (rng.normal(size=v.shape) * scale).astype(np.float32) for k, v in params.items()}
             for scale in (0.3, 2.0, 0.1, 0.3, 1.0, 0.05)]

    @jax.jit
    def run(params, values):
        tx = optimizer_from(values, settings.adam_mu_dtype) if traced else make_optimizer(settings)
        state = tx.init(params)
        for g in grads:
            updates, state = tx.update(g, state, params)
            params = jax.tree.map(jnp.add, params, updates)
        return params, state

    return params, run(params, optimizer_values(settings))


def test_the_optimizer_from_values_is_make_optimizer_s():
    """The same state's structure, and the same params after six steps, to the bit where the two fold the same
    constants. Where optax folds 1 - b1 and 1 - b2 in float64, the values compute them from b1, b2 in float32 (1.3e-5
    of 1 - b2 at b2 0.999, relative): the params measured up to 8.5e-6 of how far they moved apart (b2 0.99: 2.3e-6).
    A weight decay 0 is skipped by optax as a constant and applied as 0 * params traced: 2 ulp apart (measured), XLA
    fusing the two programs differently."""
    exact = dataclasses.replace(SETTINGS, b1=0.75, b2=0.5)  # 1 - b exact in float32 either way
    ulps = {exact: 0, dataclasses.replace(exact, weight_decay=0.0): 2}
    rounded = [dataclasses.replace(SETTINGS, warmup_steps=0, total_steps=12),
               dataclasses.replace(SETTINGS, weight_decay=0.0),
               dataclasses.replace(SETTINGS, b1=0.8, b2=0.99, grad_clip=0.5, min_lr_ratio=0.0)]
    for s in [*ulps, *rounded]:
        init, want = _train(s, traced=False)
        _, got = _train(s, traced=True)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        np.testing.assert_array_equal(got[1][1][0].count, want[1][1][0].count)  # AdamW's step count: 6
        pairs = [(np.asarray(g), np.asarray(w), i)
                 for g, w, i in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), jax.tree.leaves(init),
                                    strict=True)]
        moved = max(float(np.max(np.abs(w - i))) for _, w, i in pairs)
        assert moved > 1e-3
        if s in ulps:
            assert all(np.all(np.abs(g - w) <= ulps[s] * np.spacing(np.abs(w))) for g, w, _ in pairs), s
        else:
            apart = max(float(np.max(np.abs(g - w))) for g, w, _ in pairs)
            assert apart <= 2e-5 * moved, (s, apart / moved)
