"""Mixed precision as the field trains (workers.actor): a bfloat16 model trains float32 master weights, float32
Adam moments and float32 gradient sums, computes its forward and backward in bfloat16, and serves bfloat16.

Tiny model (the session's, weights of std 0.2). At |w| in [0.125, 0.25) a bfloat16 unit in the last place is
2^-3 x 2^-7 = 9.8e-4, so an AdamW step of lr 1e-4 (its update is about lr per element) is under half of it: stored
in bfloat16 alone, such a step is rounded away.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from rlsched.run.checkpoints import TaskCheckpointer
from workers.actor import ActorWorker
from workers.batch import build_train_batch
from workers.models import load_pretrained
from workers.models import params as P
from workers.train_step import ActorSettings, train_step

BF16 = np.dtype(ml_dtypes.bfloat16)
SETTINGS = ActorSettings(remat="layers", adam_mu_dtype="float32", lr=1e-4, total_steps=1000, warmup_steps=0,
                         min_lr_ratio=1.0, weight_decay=0.0, grad_clip=1.0, b1=0.9, b2=0.999, epsilon=0.2,
                         epsilon_high=None, beta=0.0,
                         aggregation="token-mean", temperature=1.0, micro_batch_size=4, mini_batch_size=16, epochs=1,
                         router_aux_loss_coef=None, kl_clamp=None, max_new_tokens=None)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    return build_train_batch([rng.integers(1, 200, 6) for _ in range(16)], [rng.integers(1, 200, 4) for _ in range(16)],
                             np.tile([0.0, 1.0, 0.0, 1.0], 4).astype(np.float32), pad_id=0)


def _mini() -> dict[str, np.ndarray]:
    """`_batch()` as one mini-batch of 4 micro-batches of 4 (A, M, ...)."""
    return {k: v.reshape(4, 4, *v.shape[1:]) for k, v in _batch().arrays().items()}


def _host(flat) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in flat.items()}


def _projections(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in flat.items() if any(f".{p}." in k for p in PROJECTIONS)}


def _moved(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> float:
    """The share of the projection weights' elements that differ."""
    b, a = _projections(before), _projections(after)
    return sum(int(np.sum(a[k] != b[k])) for k in b) / sum(v.size for v in b.values())


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """(float32 model, bfloat16 model) of the same values: the tiny model rounded to bfloat16, so both start from
    the same weights and differ only in how they train."""
    bf16, _ = load_pretrained(tiny_model_dir, dtype="bfloat16", with_tokenizer=False)
    f32, _ = load_pretrained(tiny_model_dir, dtype="bfloat16", with_tokenizer=False)
    from flax import nnx

    nnx.update(f32, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(f32, nnx.Param)))
    return f32, bf16


def test_the_state_is_float32_and_the_forward_and_what_is_served_bfloat16(models):
    _, bf16 = models
    actor = ActorWorker(bf16, dataclasses.replace(SETTINGS, beta=0.1))
    assert {x.dtype for x in jax.tree.leaves(actor.state.params)} == {np.dtype(np.float32)}
    moments = [x for x in jax.tree.leaves(actor.state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert len(moments) == 2 * len(jax.tree.leaves(actor.state.params))  # mu and nu, one per parameter
    assert {x.dtype for x in moments} == {np.dtype(np.float32)}
    assert {x.dtype for x in jax.tree.leaves(actor.ref_params)} == {BF16}  # frozen: the model's own params
    # The gradient summed over micro-batches: the lax.scan's carry holds it, float32
    mini = _mini()
    mini["ref_logp"] = np.zeros_like(mini["loss_mask"])
    jaxpr = jax.make_jaxpr(actor.step_function())(actor.state, mini)
    (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    carry = scan.outvars  # the body returns no per-micro-batch outputs: every output is the carry (JAX 0.11's scan
    # params have no "num_carry", measured on the GPU machine)
    floats = {v.aval.dtype for v in carry if jnp.issubdtype(v.aval.dtype, jnp.floating)}
    assert floats == {np.dtype(np.float32)}
    # ... while the forward computes in bfloat16: the jaxpr's matmuls take bfloat16 operands
    dots = [e for e in _eqns(scan.params["jaxpr"].jaxpr) if e.primitive.name == "dot_general"]
    assert dots and any(all(v.aval.dtype == BF16 for v in e.invars) for e in dots)
    snapshot = actor.export_weights()
    assert {v.dtype for v in snapshot.flat.values()} == {BF16}
    master = _host(P.to_flat(actor.state.params))
    for k, v in _host(snapshot.flat).items():  # rounded to nearest even on the devices, as numpy rounds
        np.testing.assert_array_equal(v.view(np.uint16), master[k].astype(BF16).view(np.uint16), err_msg=k)


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside its equations (a scan's body, a pjit's, a cond's)."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for inner in p if isinstance(p, tuple | list) else (p,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's own
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_a_float32_model_trains_its_own_params_and_serves_them_without_a_copy(models):
    f32, _ = models
    actor = ActorWorker(f32, SETTINGS)
    assert actor.dtype is None
    snapshot = actor.export_weights()
    flat = P.to_flat(actor.state.params)
    assert all(snapshot.flat[k] is flat[k] for k in flat)  # the state's own arrays: nothing was copied
    assert actor.memory_bytes()["params"] == sum(v.nbytes for v in flat.values())


def test_a_rate_below_bfloat16_resolution_learns_as_float32_does(models):
    """lr 1e-4, 6 optimizer steps on one batch: the master moves every step; what it serves moves once its steps
    add up, as the float32 run's weights rounded to bfloat16 do."""
    f32, bf16 = models
    runs = {}
    for name, model in (("f32", f32), ("bf16", bf16)):
        actor = ActorWorker(model, SETTINGS)
        start = _host(P.to_flat(actor.state.params))
        masters, served = [start], []
        for step in range(1, 7):
            metrics = actor.train(_batch(), step=step)
            assert metrics["skipped"] == 0 and metrics["grad_norm"] > 0
            masters.append(_host(P.to_flat(actor.state.params)))
            served.append(_host(actor.export_weights().flat))
        runs[name] = masters, served
    f32_masters, _ = runs["f32"]
    masters, served = runs["bf16"]
    for before, after in zip(masters, masters[1:], strict=False):  # every step moves (nearly) every master element
        assert _moved(before, after) > 0.9
    rounded = {k: v.astype(BF16) for k, v in f32_masters[-1].items()}
    start = {k: v.astype(BF16) for k, v in masters[0].items()}
    # After one step (1e-4 < half a unit for nearly every weight) few served weights move (12 % measured: the
    # weights near 0, whose unit is smaller); after six (6e-4 > 4.9e-4) most do (77 %). The bfloat16 forward gives
    # other gradients than the float32 one (a few per cent per element), but Adam's normalised step is about lr
    # whatever their scale, so the share of weights that crossed a rounding boundary is the float32 run's to within
    # those few per cent (measured 77.3 % against 76.5 %): 0.05.
    first, last = _moved(start, served[0]), _moved(start, served[-1])
    want = _moved(start, rounded)
    assert first < 0.2 and last > 0.5
    assert abs(last - want) < 0.05, (last, want)
    # ... and to the same bfloat16 values: they differ only where the two runs' masters lie on either side of a
    # rounding boundary (3.2 % measured). Served weights stuck at the start would agree on 1 - 0.77 of them.
    assert 1 - _moved(rounded, served[-1]) > 0.9


def test_offload_moves_the_master_and_serves_the_same_weights(models):
    _, bf16 = models
    actor = ActorWorker(bf16, SETTINGS)
    actor.train(_batch(), step=1)
    published = actor.export_weights()
    n = sum(int(np.prod(v.shape)) for v in published.flat.values())
    # float32 master (4 bytes) + what it serves (2) per parameter; two float32 moments + two int32 step counts
    assert actor.memory_bytes() == {"params": 6 * n, "opt": 8 * n + 8, "ref": 0}
    actor.offload()
    assert actor.memory_bytes() == {"params": 0, "opt": 0, "ref": 0}
    assert P.checksum(actor.params_flat()) == published.checksum  # the served copy, from host memory
    actor.onload()
    assert P.checksum(actor.params_flat()) == published.checksum
    assert {x.dtype for x in jax.tree.leaves(actor.state.params)} == {np.dtype(np.float32)}
    # Offloaded after an update that was never published: the host master is rounded as the devices would
    actor.train(_batch(1), step=2)
    actor.offload()
    on_host = P.checksum(actor.params_flat())
    actor.onload()
    assert on_host == actor.export_weights().checksum != published.checksum


def test_a_checkpoint_keeps_the_float32_master_and_resume_is_exact(models, tmp_path):
    _, bf16 = models
    actor = ActorWorker(bf16, SETTINGS)
    actor.train(_batch(), step=1)
    saver = TaskCheckpointer(tmp_path / "ckpt", background=False)
    saver.save(1, actor.state, {"step": 1})
    resumed = ActorWorker(bf16, SETTINGS)
    resumed.state, _ = saver.restore(resumed.state)
    saver.close()
    for a, b in zip(jax.tree.leaves(actor.state), jax.tree.leaves(resumed.state), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert {x.dtype for x in jax.tree.leaves(resumed.state.params)} == {np.dtype(np.float32)}
    for step in (2, 3):  # the same updates from there: what is below a bfloat16 unit was kept
        assert actor.train(_batch(step), step=step) == resumed.train(_batch(step), step=step)
    for a, b in zip(jax.tree.leaves(actor.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_train_step_without_a_dtype_is_the_float32_step(models):
    """A float32 actor's program is today's: `dtype` None adds no cast (the jaxpr has no convert of a param)."""
    f32, _ = models
    actor = ActorWorker(f32, SETTINGS)
    mini = _mini()
    step = jax.make_jaxpr(lambda s, b: train_step(s, b, graphdef=actor.graphdef, tx=actor.tx,
                                                  settings=actor.settings))(actor.state, mini)
    assert str(step) == str(jax.make_jaxpr(actor.step_function())(actor.state, mini))


def test_the_update_traces_its_platform_s_way_alone_and_either_way_steps_alike(models):
    """`update(platform=)` traces the way the program's platform keeps (workers.train_step.update: a branch on the
    CPU, a select elsewhere) and no other; None traces both for the lowering to pick (platform_dependent). Run
    here, the two ways give the same state and clipped gradient."""
    from workers.train_step import update

    f32, _ = models
    actor = ActorWorker(f32, SETTINGS)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 3e-2), actor.state.params)

    def primitives(platform) -> collections.Counter:
        jaxpr = jax.make_jaxpr(lambda s, g: update(s, g, jnp.asarray(True), tx=actor.tx, platform=platform))(
            actor.state, grads)
        return collections.Counter(e.primitive.name for e in _eqns(jaxpr.jaxpr))

    cpu, gpu, both = primitives("cpu"), primitives("gpu"), primitives(None)
    leaves = len(jax.tree.leaves(actor.state))
    assert cpu["cond"] == 1 and gpu["cond"] == 0 and cpu["platform_index"] == gpu["platform_index"] == 0
    assert gpu["select_n"] >= cpu["select_n"] + leaves  # the select: one per leaf of the state
    assert both["platform_index"] == 1 and both["cond"] == 2 and both["select_n"] == cpu["select_n"] + gpu["select_n"]
    ran = {platform: jax.jit(lambda s, g, p=platform: update(s, g, jnp.asarray(True), tx=actor.tx, platform=p))(
        actor.state, grads) for platform in ("cpu", "gpu")}
    for a, b in zip(jax.tree.leaves(ran["cpu"]), jax.tree.leaves(ran["gpu"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = [not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(ran["cpu"][0].params), jax.tree.leaves(actor.state.params), strict=True)]
    assert all(moved)  # it stepped


def test_a_step_whose_master_moves_under_a_bfloat16_unit_is_no_error(tmp_path, tiny_model_dir):
    """ActorRole.train refuses an update that left the served weights as they were when they had to move
    (tests/test_train.py). A bfloat16 task whose weights are all |w| >= 0.05 (half a bfloat16 unit there is
    2^-5 x 2^-8 = 1.2e-4) at lr 1e-7 (Adam's first step moves each weight with a gradient by exactly lr, over half
    a float32 unit below |w| = 1, 6e-8) serves the same weights after its step while its float32 master moved:
    right, and the task goes on."""
    from flax import nnx
    from test_train import DEMO_CONFIG, _driver, _quick  # the module pytest imported: its rewards registered once

    from rlsched.config.loading import load_config
    from rlsched.rundir.files import prepare_run_dir
    from rlsched.scheduling.policy import Role
    from workers.models import save_pretrained

    model, tokenizer = load_pretrained(tiny_model_dir)
    away = lambda w: jnp.where(w < 0, -1.0, 1.0) * jnp.maximum(jnp.abs(w), 0.05)  # noqa: E731 - no weight near 0
    nnx.update(model, jax.tree.map(away, nnx.state(model, nnx.Param)))
    model_dir = save_pretrained(model, tmp_path / "model", tokenizer)
    cfg = load_config(DEMO_CONFIG, _quick(tmp_path, model_dir, "tasks.0.optim.warmup_ratio=0",
                                          "tasks.0.optim.lr=1e-7", "tasks.0.model.dtype=bfloat16"))
    prepare_run_dir(cfg, resume=False, overwrite=False)
    driver = _driver(cfg)
    driver.start()
    actor = driver.roles[Role.ACTOR]
    before = _host(P.to_flat(actor.worker.state.params))
    rng = np.random.default_rng(0)
    batch = build_train_batch([rng.integers(1, 200, 6) for _ in range(16)],
                              [rng.integers(1, 200, 4) for _ in range(16)], pad_id=0)
    published = actor._published_checksum
    result = actor.train(batch, np.tile([0.0, 1.0, 0.0, 1.0], 4).astype(np.float32), step=1)
    assert result.message.checksum == published and result.value["grad_norm"] > 0
    assert _moved(before, _host(P.to_flat(actor.worker.state.params))) > 0.9
    driver.close()


def test_the_update_reads_the_copy_it_serves_and_is_the_step_that_casts_inside(models):
    """A bfloat16 actor's train program reads the bfloat16 copy it serves (workers.actor `served`) instead of casting
    its master inside the step. The gradient with respect to the bfloat16 params, cast to float32, is what the
    cast's own gradient is (the same operations), so the new state and the metrics are the other step's to the bit;
    and the program allocates fewer temporaries (XLA's memory analysis), as the cast is not made again."""
    _, bf16 = models
    actor = ActorWorker(bf16, SETTINGS)
    mini, served = _mini(), actor.served()
    programs = {name: jax.jit(actor.step_function(), donate_argnums=0).lower(actor.state, mini, *extra).compile()
                for name, extra in (("inside", ()), ("served", (None, served)))}
    inside = programs["inside"](jax.tree.map(jnp.copy, actor.state), mini)
    held = programs["served"](jax.tree.map(jnp.copy, actor.state), mini, None, served)
    for a, b in zip(jax.tree.leaves(inside), jax.tree.leaves(held), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    temp = {name: p.memory_analysis().temp_size_in_bytes for name, p in programs.items()}
    assert temp["served"] < temp["inside"]


def test_a_bfloat16_first_moment_is_adamw_storing_it_rounded(models):
    """actor.adam_mu_dtype bfloat16 (optax.adamw's mu_dtype): the first moment is stored in bfloat16 (2 bytes a
    parameter fewer), the second in float32, and three steps are AdamW's in float32 arithmetic with the first moment
    rounded to bfloat16 (nearest even) as it is stored, written out in numpy. One quirk of optax's: the stored moment
    is decayed by b1 rounded to its dtype (0.9 -> 0.8984375; XLA:CPU keeps that product in float32). The tolerance,
    1e-6 on params of |w| < 5 (two float32 units there), is the float32 run's own distance from the same numpy
    (XLA:CPU's power, square root and divide round apart from numpy's by a unit)."""
    from workers.train_step import make_optimizer

    settings = dataclasses.replace(SETTINGS, adam_mu_dtype="bfloat16", lr=1e-2, weight_decay=0.1, grad_clip=1e6)
    tx = make_optimizer(settings)
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(64, 48)).astype(np.float32)
    grads = [rng.normal(size=(64, 48)).astype(np.float32) for _ in range(3)]
    step = jax.jit(lambda p, state, g: (lambda u, state: (p + u, state))(*tx.update(g, state, p)))
    w, state = jnp.asarray(w0), tx.init(jnp.asarray(w0))
    for g in grads:
        w, state = step(w, state, g)
    adam = state[1][0]  # chain(clip, adamw(scale_by_adam, decay, lr))
    assert (adam.mu.dtype, adam.nu.dtype) == (BF16, np.dtype(np.float32))
    b1, b2, eps = np.float32(settings.b1), np.float32(settings.b2), np.float32(1e-8)
    lr, wd = np.float32(settings.lr), np.float32(settings.weight_decay)
    ref, mu, nu = w0, np.zeros_like(w0, BF16), np.zeros_like(w0)
    for t, g in enumerate(grads, 1):
        m = (1 - b1) * g + mu.astype(np.float32) * np.float32(np.asarray(settings.b1, BF16))
        nu = (1 - b2) * (g * g) + b2 * nu
        update = (m / (1 - b1 ** np.float32(t))) / (np.sqrt(nu / (1 - b2 ** np.float32(t))) + eps) + wd * ref
        ref, mu = ref + update * -lr, m.astype(BF16)
    np.testing.assert_array_equal(np.asarray(adam.mu).view(np.uint16), mu.view(np.uint16))
    np.testing.assert_allclose(np.asarray(w), ref, rtol=0, atol=1e-6)
    # the actor holds it so: 4 + 2 bytes of moments a parameter, as `rlsched plan` counts them
    actor = ActorWorker(models[1], dataclasses.replace(SETTINGS, adam_mu_dtype="bfloat16"))
    n = sum(x.size for x in jax.tree.leaves(actor.state.params))
    assert actor.memory_bytes()["opt"] == 6 * n + 8


def test_an_offloaded_reference_leaves_the_devices_for_the_update_and_changes_no_bit(tiny_model_dir):
    """actor.offload_reference: the frozen reference (a bfloat16 model's own params, beta > 0) comes onto the
    devices for its log-probs and leaves them after (two spans), so the update runs without it: from the step's start
    to its update, the live arrays in device memory (jax.live_arrays; the host copies are live arrays too, in pinned
    host memory) drop by exactly the reference's bytes more than where it stays. Two steps give every metric and
    state array of the actor that keeps its reference, to the bit: the second step's reference log-probs read the
    onloaded copy."""
    settings = dataclasses.replace(SETTINGS, beta=0.1)

    class Spans:  # a timeline: each span's name, the actor's reference bytes and the live device bytes at its start
        def __init__(self, actor):
            self.actor, self.seen = actor, []

        @contextlib.contextmanager
        def span(self, name, **_):
            live = sum(x.nbytes for x in jax.live_arrays() if x.sharding.memory_kind == "device")
            self.seen.append((name, self.actor.memory_bytes()["ref"], live))
            yield {}

    results = {}
    for offload_reference in (False, True):
        model, _ = load_pretrained(tiny_model_dir, dtype="bfloat16", with_tokenizer=False)
        actor = ActorWorker(model, settings, offload_reference=offload_reference)
        del model  # its arrays are the reference's (the actor's copy aliases them): nothing else holds them
        # device arrays left unreachable by earlier work (earlier tests', the other actor's) go now, not while
        # this actor's step is measured: jax.live_arrays() counts the whole process
        gc.collect()
        ref_bytes, timeline = actor.memory_bytes()["ref"], Spans(actor)
        metrics = [actor.train(_batch(seed), step=seed + 1, timeline=timeline) for seed in (0, 1)]
        results[offload_reference] = metrics, jax.tree.map(np.asarray, actor.state), timeline.seen
    (off_metrics, off_state, off_seen), (on_metrics, on_state, on_seen) = results[False], results[True]
    assert [name for name, *_ in off_seen] == ["logprobs", "update"] * 2
    assert [name for name, *_ in on_seen] == ["logprobs", "offload_reference", "update",
                                              "logprobs", "onload_reference", "offload_reference", "update"]
    assert ref_bytes == 2 * sum(x.size for x in jax.tree.leaves(on_state.params)) > 0  # bfloat16, as the model
    assert [ref for name, ref, _ in off_seen if name == "update"] == [ref_bytes] * 2
    assert [ref for name, ref, _ in on_seen if name == "update"] == [0, 0]
    drop = lambda seen: seen[0][2] - next(live for name, _, live in seen if name == "update")  # noqa: E731
    assert drop(on_seen) - drop(off_seen) == ref_bytes  # the first step's, each actor's own arrays alike
    assert off_metrics == on_metrics and off_metrics[1]["kl"] > 0  # the reference read, and read alike
    for a, b in zip(jax.tree.leaves(off_state), jax.tree.leaves(on_state), strict=True):
        np.testing.assert_array_equal(a, b)
