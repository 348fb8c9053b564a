"""Co-batched TRAIN (workers.actor_cobatch): the LoRA actors of one base group that share a train hold (`Together`)
run their optimizer steps as one vmapped program per step. Each member gets its own update: the same as its twin
trained alone (to the float rounding of a batched program; measured below), and bit for bit the same whoever its
partners are. A member that fails before its update does not hold the others up, and nothing is left open. Both paths
of the output head (workers.actor): the hold's main tasks carry completion windows (a run's batches; the head on the
windows alone), the five-member hold's do not (the head on every position)."""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest

from workers import actor_cobatch, shared_base
from workers.actor import ActorWorker
from workers.batch import build_train_batch
from workers.models import load_pretrained
from workers.models import lora as L
from workers.models import sharding as S
from workers.rollout.base import Together
from workers.train_step import WINDOW, ActorSettings

SPEC = L.LoraSpec(rank=4, alpha=8.0, targets=("q", "v", "o", "down"))
W, MAX_PROMPT = 4, 16  # max_new_tokens (every completion here is 4 tokens), the prompts' longest bucket
# Off-policy: 16 rows, mini-batches of 8, two epochs -> 4 optimizer steps per train, old and ref logprobs (beta > 0).
# This module's own settings (two epochs): no other test module's programs share their signature, so compile counts
# here are this module's. SWEEP's tasks differ from them in the optimizer's settings alone.
SETTINGS = ActorSettings(remat="layers", adam_mu_dtype="float32",
                         lr=5e-3, total_steps=12, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.01, grad_clip=1.0,
                         b1=0.9, b2=0.999, epsilon=0.2, epsilon_high=None, beta=0.04, aggregation="token-mean",
                         temperature=1.0, micro_batch_size=4, mini_batch_size=8, epochs=2, router_aux_loss_coef=None,
                         kl_clamp=None, max_new_tokens=W)
STEPS = (1, 2, 3)
# Prompt tokens (+ 4 completion tokens). A run's batch (window=True, built with max_new_tokens: its completion windows,
# the output head on them alone; workers.train_step.WINDOW) of LONG prompts is 8 + 4 = 12 positions long; a batch built
# without (the head on every position) of LONG prompts 16, of SHORT prompts 8.
LONG, SHORT = 6, 2
HOLDS = itertools.count(1)
# Measured on CPU (tiny model, float32): a batched program sums a few row reductions (RMSNorm over the 64-wide hidden
# size) in another order than one member's program does: a few ulp (<= 4e-6 in logprobs). AdamW magnifies the
# rounding of gradient elements near 0 (update = lr * m / (sqrt(v) + 1e-8)). Worst measured over these tests after
# 3 x 4 steps at lr 5e-3: metrics 3.2e-5 apart (2e-4 relative), the adapters 1.1e-3 of how far they moved (most
# members 2e-6 .. 7e-6), the moments 5.8e-6 relative. The bounds below leave 5-10x of that. Against partners of the
# same count, a member's update is bit for bit its own (the isolation test below).
METRICS_RTOL, METRICS_ATOL = 1e-3, 1e-5
PARAMS_RTOL, OPT_RTOL = 1e-2, 1e-4


def _mesh():
    return S.mesh({}, jax.devices()[:1])


def _actor(path, seed: int, mesh=None, settings: ActorSettings = SETTINGS) -> ActorWorker:
    mesh = mesh if mesh is not None else _mesh()
    return ActorWorker(None, settings, lora=SPEC, seed=seed, mesh=mesh,
                       base=shared_base.acquire(path, dtype=None, mesh=mesh))


def _batch(seed: int, prompt: int, rows: int = 16, *, window: bool = True):
    rng = np.random.default_rng(seed)
    windows = dict(max_prompt_len=MAX_PROMPT, max_new_tokens=W) if window else {}
    return build_train_batch([rng.integers(1, 200, prompt) for _ in range(rows)],
                             [rng.integers(1, 200, 4) for _ in range(rows)],
                             rng.normal(size=rows).astype(np.float32), pad_id=0, **windows)


def _together(actors, batches, step: int, together: Together, timeout: float = 300, *, errors: bool = False) -> list:
    """Each actor trains its batch from a thread of its own within the hold `together`: their metrics (a member's
    exception raised, or with `errors` returned in its place)."""
    with ThreadPoolExecutor(len(actors)) as pool:
        futures = [pool.submit(a.train, b, step=step, together=together) for a, b in zip(actors, batches, strict=True)]
        if errors:
            return [f.exception(timeout=timeout) or f.result() for f in futures]
        return [f.result(timeout=timeout) for f in futures]


def _task(seed: int, prompt: int, *, window: bool = True, settings: ActorSettings = SETTINGS):
    """A task: its actor's seed and settings, and its batch at each step (with completion windows or without)."""
    return {"seed": seed, "settings": settings,
            "batches": {s: _batch(1000 * seed + s, prompt, window=window) for s in STEPS}}


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _norm(a, b) -> float:
    """||a - b|| over every leaf."""
    return float(np.sqrt(sum(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)
                             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))))


def _run(path, tasks, *, cobatch: bool, mesh=None, keep: list | None = None):
    """Train `tasks` (a fresh actor each) for STEPS, all in one hold per step or each alone: ({"params", "opt",
    "metrics": per step, "windowed": whether each step's batch ran the head on its windows alone, "keys": the batch
    keys of the train programs it ran, alone ("train") and co-batched ("cotrain")}, per task), the actors released
    (their device arrays freed; `keep` keeps the objects, and with them the programs they hold)."""
    actors = [_actor(path, t["seed"], mesh, t["settings"]) for t in tasks]
    if keep is not None:
        keep.extend(actors)
    init = [_host(a.state.params) for a in actors]
    metrics = []
    try:
        for step in STEPS:
            batches = [t["batches"][step] for t in tasks]
            if cobatch:
                metrics.append(_together(actors, batches, step, Together(next(HOLDS), len(tasks))))
            else:
                metrics.append([a.train(b, step=step) for a, b in zip(actors, batches, strict=True)])
        return [{"init": init[i], "params": _host(a.state.params), "opt": _host(a.state.opt_state),
                 "step": int(a.state.step), "metrics": [m[i] for m in metrics],
                 "shardings": jax.tree.map(lambda x: x.sharding, a.state),
                 "windowed": [a.windowed(tasks[i]["batches"][step]) for step in STEPS],
                 "keys": {"train": {keys for kind, keys in a._programs if kind == "train"},  # noqa: SLF001
                          "cotrain": {k[2] for k in a._prepared if k[0] == "cotrain"}}}  # noqa: SLF001
                for i, a in enumerate(actors)], actors[0].shardings
    finally:
        for a in actors:
            a.release()


def _compare(got: dict, want: dict, *, cobatched: float) -> dict[str, float]:
    """A co-batched member against its twin alone: the same metrics, params and moments to the measured bounds;
    the measured max differences."""
    assert got["step"] == want["step"] == len(STEPS) * 4
    assert [m["cobatched"] for m in got["metrics"]] == [cobatched] * len(STEPS)
    assert [m["cobatched"] for m in want["metrics"]] == [1.0] * len(STEPS)
    worst = {"params": _max_diff(got["params"], want["params"]), "opt": _max_diff(got["opt"], want["opt"]),
             "params_rel": _norm(got["params"], want["params"]) / _norm(want["params"], want["init"]),
             "opt_rel": _norm(got["opt"], want["opt"]) / _norm(want["opt"], jax.tree.map(np.zeros_like, want["opt"])),
             "metrics": 0.0, "metrics_rel": 0.0}
    for g, w in zip(got["metrics"], want["metrics"], strict=True):
        assert set(g) == set(w)
        assert g["moved"] == w["moved"] == 1.0 and g["skipped"] == w["skipped"] == 0.0 and g["lr"] == w["lr"]
        for k in set(g) - {"cobatched"}:
            worst["metrics"] = max(worst["metrics"], abs(g[k] - w[k]))
            worst["metrics_rel"] = max(worst["metrics_rel"], abs(g[k] - w[k]) / max(abs(w[k]), 1e-3))
            np.testing.assert_allclose(g[k], w[k], rtol=METRICS_RTOL, atol=METRICS_ATOL, err_msg=k)
    assert worst["params_rel"] <= PARAMS_RTOL and worst["opt_rel"] <= OPT_RTOL, worst
    print(f"co-batched ({cobatched:.0f}) vs alone, max abs diff: {worst}")
    return worst


# Four tasks of one hold: three with completion windows (one vmapped program of the head on the windows alone, K = 3
# padded to 4), one without, in the short bucket (alone: the head on every position)
TASKS = [_task(0, LONG), _task(1, LONG), _task(2, LONG), _task(3, SHORT, window=False)]
# Task 0 again, with other partners of the same count and bucket (other seeds and batches)
OTHERS = [TASKS[0], _task(7, LONG), _task(8, LONG), _task(9, SHORT, window=False)]


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    """TASKS alone and co-batched, task 0 among OTHERS, and a hold of four long tasks, their actors kept; then
    TASKS co-batched again once those actors are gone. The programs each compiled."""
    import gc

    built, kept = [], []
    compile_once = actor_cobatch.compile_once

    def counted(lowered):
        built.append(lowered)
        return compile_once(lowered)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(actor_cobatch, "compile_once", counted)
        alone, _ = _run(tiny_model_dir, TASKS, cobatch=False)
        assert built == []  # alone: the actor's own programs, not co-batched ones
        together, _ = _run(tiny_model_dir, TASKS, cobatch=True, keep=kept)
        first = len(built)
        others, _ = _run(tiny_model_dir, OTHERS, cobatch=True, keep=kept)
        four, _ = _run(tiny_model_dir, [TASKS[0], TASKS[1], TASKS[2], OTHERS[1]], cobatch=True, keep=kept)
        meanwhile = len(built) - first
        kept.clear()
        gc.collect()
        _run(tiny_model_dir, TASKS, cobatch=True)
    return dict(alone=alone, together=together, others=others, four=four,
                compiled=(first, meanwhile, len(built) - first - meanwhile))


def test_the_members_of_a_hold_each_get_their_alone_update(trained):
    # The long tasks ran the head on their completion windows alone, co-batched as alone; the short one everywhere,
    # its plain program in both runs
    for run in ("alone", "together"):
        assert [t["windowed"] for t in trained[run]] == [[True] * len(STEPS)] * 3 + [[False] * len(STEPS)]
        assert [WINDOW in keys for keys in trained[run][3]["keys"]["train"]] == [False]
    assert [[WINDOW in keys for keys in t["keys"]["train"]] for t in trained["alone"][:3]] == [[True]] * 3
    assert [[WINDOW in keys for keys in t["keys"]["cotrain"]] for t in trained["together"][:3]] == [[True]] * 3
    assert [t["keys"]["train"] for t in trained["together"][:3]] == [set()] * 3  # every step in the vmapped program
    worst = {}
    for got, want, cobatched in zip(trained["together"], trained["alone"], [3.0, 3.0, 3.0, 1.0], strict=True):
        for k, v in _compare(got, want, cobatched=cobatched).items():
            worst[k] = max(worst.get(k, 0.0), v)
    # The short task ran alone in the joint run (its own bucket): its plain program, bit for bit
    last = trained["together"][3]
    assert _max_diff(last["params"], trained["alone"][3]["params"]) == 0.0
    assert _max_diff(last["opt"], trained["alone"][3]["opt"]) == 0.0
    # Each member's own: the tasks' adapters differ (other seeds and batches)
    assert _max_diff(trained["together"][0]["params"], trained["together"][1]["params"]) > 1e-3
    print(f"worst over the hold: {worst}")


def test_a_member_s_update_is_its_own_bit_for_bit_whoever_its_partners_are(trained):
    got, want = trained["others"][0], trained["together"][0]  # task 0, among other tasks' adapters and batches
    assert [m["cobatched"] for m in got["metrics"]] == [3.0] * len(STEPS)
    assert _max_diff(got["params"], want["params"]) == 0.0 and _max_diff(got["opt"], want["opt"]) == 0.0
    assert got["metrics"] == want["metrics"]
    # ... and whether the fourth slot of the padded program holds a padding copy or a real task
    four = trained["four"][0]
    assert [m["cobatched"] for m in four["metrics"]] == [4.0] * len(STEPS)
    assert _max_diff(four["params"], want["params"]) == 0.0
    assert [{k: v for k, v in m.items() if k != "cobatched"} for m in four["metrics"]] == [
        {k: v for k, v in m.items() if k != "cobatched"} for m in want["metrics"]]


def test_three_and_four_members_run_one_compiled_program_while_an_actor_holds_it(trained):
    # Three members compiled stack, step and unstack for K = 4 (padded); four members and other partners none, while
    # the first ones live; once every actor that held them is gone, so are they (workers.compiling.shared)
    assert trained["compiled"] == (3, 0, 3)


def test_the_states_come_back_in_their_own_layout_and_nothing_is_left_open(trained):
    for got, want in zip(trained["together"], trained["alone"], strict=True):
        assert got["shardings"] == want["shardings"]
    assert actor_cobatch.open_holds() == []


def test_five_members_run_padded_to_eight_and_each_gets_its_alone_update(tiny_model_dir):
    """... on batches without completion windows: the head on every position, co-batched as alone."""
    tasks = [_task(20 + i, SHORT, window=False) for i in range(5)]
    together, _ = _run(tiny_model_dir, tasks, cobatch=True)
    alone, _ = _run(tiny_model_dir, tasks, cobatch=False)
    for got, want in zip(together, alone, strict=True):
        assert got["windowed"] == want["windowed"] == [False] * len(STEPS)
        assert [WINDOW in keys for keys in got["keys"]["cotrain"]] == [False]
        assert [WINDOW in keys for keys in want["keys"]["train"]] == [False]
        _compare(got, want, cobatched=5.0)
    assert actor_cobatch.open_holds() == []


def test_actors_prepared_for_their_cohort_compile_its_joint_programs_before_the_hold(tiny_model_dir, monkeypatch):
    """`prepare(cohort=3)` (a task's train_cohort) compiles stack, step and unstack for a hold of 3 (padded to 4),
    once for the actors of a signature, and after the first update a hold of 2's, in the background; holds of three
    and of two then compile nothing in them. An actor that cannot be co-batched (a base of its own) compiles none."""
    settings = dataclasses.replace(SETTINGS, kl_clamp=10.0)  # a signature of its own: no other test holds its programs
    built, compile_once = [], actor_cobatch.compile_once
    monkeypatch.setattr(actor_cobatch, "compile_once", lambda lowered: built.append(lowered) or compile_once(lowered))
    assert [actor_cobatch.padded_size(n) for n in (2, 3, 4, 5, 8, 9)] == [2, 4, 4, 8, 8, 16]
    tasks = [_task(50 + i, LONG, settings=settings) for i in range(3)]
    batches = [t["batches"][1] for t in tasks]
    size, length = batches[0].size, batches[0].tokens.shape[1]
    own = ActorWorker(load_pretrained(tiny_model_dir)[0], settings, lora=SPEC, seed=0)
    own.prepare(size, length, cohort=3)
    own.train(batches[0], step=1)
    assert built == [] and own._ahead is None  # noqa: SLF001
    actors = [_actor(tiny_model_dir, t["seed"], settings=settings) for t in tasks]
    try:
        for actor in actors:
            actor.prepare(size, length, cohort=3)
            assert actor._ahead is None  # noqa: SLF001 - the smaller hold's: after the first update
        assert len(built) == 3  # stack, step and unstack of a hold of 4, by the first actor; the others found them
        metrics = _together(actors, batches, 1, Together(next(HOLDS), 3))
        assert [m["cobatched"] for m in metrics] == [3.0] * 3
        for actor in actors:  # each compiles (or finds) a hold of 2's programs, in the background
            actor._ahead.join(timeout=300)  # noqa: SLF001
            assert not actor._ahead.is_alive() and actor._ahead.error is None  # noqa: SLF001
        assert len(built) == 6  # once
        metrics = _together(actors[:2], [t["batches"][2] for t in tasks[:2]], 2, Together(next(HOLDS), 2))
        assert [m["cobatched"] for m in metrics] == [2.0] * 2
        assert len(built) == 6  # nothing compiled in either hold
    finally:
        for actor in actors:
            actor.release()
    assert actor_cobatch.open_holds() == []


# A sweep on one base: tasks that differ only in the optimizer's settings (workers.train_step.OptimizerValues). Task
# 42's weight decay 0 is skipped by optax alone (a Python 0) and applied as 0 * params co-batched; task 43 differs in
# every one of them (warmup: its first step runs at lr 0).
SWEEP = [_task(40, LONG), _task(41, LONG, settings=dataclasses.replace(SETTINGS, lr=2e-3)),
         _task(42, LONG, settings=dataclasses.replace(SETTINGS, weight_decay=0.0)),
         _task(43, LONG, settings=dataclasses.replace(SETTINGS, lr=1e-2, total_steps=20, warmup_steps=3,
                                                      min_lr_ratio=0.0, grad_clip=0.5, b1=0.8, b2=0.99))]


def test_a_sweep_over_optimizer_settings_trains_in_one_program_each_task_its_alone_update(tiny_model_dir, monkeypatch):
    import gc

    gc.collect()  # earlier tests' actors, and the programs they held (workers.compiling.shared), are gone
    built = []
    compile_once = actor_cobatch.compile_once
    monkeypatch.setattr(actor_cobatch, "compile_once", lambda lowered: built.append(lowered) or compile_once(lowered))
    together, _ = _run(tiny_model_dir, SWEEP, cobatch=True)
    assert len(built) == 3  # stack, step and unstack of K = 4: one vmapped step program for the four settings
    alone, _ = _run(tiny_model_dir, SWEEP, cobatch=False)
    for got, want in zip(together, alone, strict=True):
        assert got["keys"]["train"] == set()  # every optimizer step in the vmapped program
        _compare(got, want, cobatched=4.0)  # its own rate, decay, clip and betas: another's would move it elsewhere
    assert actor_cobatch.open_holds() == []


@pytest.mark.parametrize("failure", ["bad batch", "offloaded"])
def test_a_member_that_fails_before_its_update_fails_alone_and_the_others_go_at_once(tiny_model_dir, failure):
    actors = [_actor(tiny_model_dir, seed) for seed in (0, 1, 2)]
    wait = actor_cobatch.gatherings(actors[0])
    try:
        wait_s, wait.wait_s = wait.wait_s, 60.0  # success never comes from the wait running out
        twin = _actor(tiny_model_dir, 0)
        want = twin.train(TASKS[0]["batches"][1], step=1)
        twin.release()
        failing = actors[2]
        bad = _batch(5, LONG, rows=12) if failure == "bad batch" else TASKS[2]["batches"][1]
        if failure == "offloaded":
            failing.offload()
        hold = Together(next(HOLDS), 3)
        start = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            others = pool.submit(_together, actors[:2], [TASKS[0]["batches"][1], TASKS[1]["batches"][1]], 1, hold)
            time.sleep(0.2)  # the others are waiting in the gathering (or about to)
            with pytest.raises(ValueError if failure == "bad batch" else RuntimeError,
                               match="do not split into mini-batches" if failure == "bad batch" else "offloaded"):
                failing.train(bad, step=1, together=hold)
            outputs = others.result(timeout=300)
        assert time.monotonic() - start < 30  # not the 60 s wait
        assert [o["cobatched"] for o in outputs] == [2.0, 2.0]
        np.testing.assert_allclose(outputs[0]["loss"], want["loss"], rtol=0, atol=METRICS_ATOL)
        assert failing.version == 0 and actor_cobatch.open_holds() == []
    finally:
        wait.wait_s = wait_s
        for a in actors:
            a.release()


def test_an_error_in_the_joint_run_reaches_every_member_and_leaves_their_states_as_they_were(tiny_model_dir,
                                                                                             monkeypatch):
    actors = [_actor(tiny_model_dir, seed) for seed in (0, 1)]
    try:
        before = [_host(a.state) for a in actors]

        def broken(*_):
            raise RuntimeError("the device fell over")

        monkeypatch.setattr(actor_cobatch, "_programs", broken)
        outcomes = _together(actors, [TASKS[0]["batches"][1], TASKS[1]["batches"][1]], 1, Together(next(HOLDS), 2),
                             errors=True)
        assert [str(e) for e in outcomes] == ["the device fell over"] * 2
        for a, b in zip(actors, before, strict=True):
            assert a.version == 0 and _max_diff(_host(a.state), b) == 0.0
        assert actor_cobatch.open_holds() == []
    finally:
        for a in actors:
            a.release()


def test_actors_that_cannot_share_a_program_train_alone_at_once(tiny_model_dir):
    """A full-weight actor, or a LoRA actor with a base of its own, trains alone whatever hold it is in: no
    gathering, no wait."""
    batch = TASKS[0]["batches"][1]
    full = ActorWorker(load_pretrained(tiny_model_dir)[0], dataclasses.replace(SETTINGS, lr=1e-3))
    own = ActorWorker(load_pretrained(tiny_model_dir)[0], SETTINGS, lora=SPEC, seed=0)
    hold = Together(next(HOLDS), 3)
    for actor in (full, own):
        start = time.monotonic()
        assert actor.train(batch, step=1, together=hold)["cobatched"] == 1.0
        assert time.monotonic() - start < 30 and not actor.cobatches(hold)
    assert actor_cobatch.open_holds() == []


@pytest.mark.slow
def test_a_hold_on_a_dp_fsdp_mesh_gives_each_member_its_alone_update_in_its_own_layout(tiny_model_dir):
    """dp 2 x fsdp 2: the stacked states keep each member's layout with a leading unsplit axis, batch rows split
    over dp x fsdp; each member gets what it gets alone on that mesh, and its state comes back laid out as before."""
    mesh = S.mesh({"dp": 2, "fsdp": 2}, jax.devices()[:4])
    tasks = TASKS[:3]
    together, shardings = _run(tiny_model_dir, tasks, cobatch=True, mesh=mesh)
    alone, _ = _run(tiny_model_dir, tasks, cobatch=False, mesh=mesh)
    assert any(len(set(sh.spec) - {None}) for sh in jax.tree.leaves(shardings.params))  # the adapter is split
    for got, want in zip(together, alone, strict=True):
        assert got["windowed"] == want["windowed"] == [True] * len(STEPS)  # the windows' starts split over dp x fsdp
        _compare(got, want, cobatched=3.0)
        assert got["shardings"] == want["shardings"] == shardings
    assert actor_cobatch.open_holds() == []


@pytest.mark.slow
def test_a_cobatched_step_on_fsdp_gathers_weights_and_keeps_each_members_activations_on_its_rows(tiny_model_dir):
    """On fsdp 2 the co-batched step (the vmapped train_step) holds each member's residual stream on its rows, as an
    actor's own gradient program does (CausalLM.forward's `rows`; the members' axis left unsplit): the partitioner
    gathers each layer's weights rather than shuffling activations within every layer. Without it this program had
    12 all-to-alls and 27 all-reduces for the tiny model's 2 layers (1 and 5 with it)."""
    import json

    mesh = S.mesh({"fsdp": 2}, jax.devices()[:2])
    actor = _actor(tiny_model_dir, 0, mesh, dataclasses.replace(SETTINGS, epochs=1, max_new_tokens=None))
    m, length = SETTINGS.micro_batch_size, 16
    shapes = {"tokens": ((2, m, length), np.int32), "attention_mask": ((2, m, length), np.bool_),
              "loss_mask": ((2, m, length - 1), np.float32), "advantages": ((2, m), np.float32),
              "sampler_logp": ((2, m, length - 1), np.float32), "old_logp": ((2, m, length - 1), np.float32),
              "ref_logp": ((2, m, length - 1), np.float32)}
    (_, _), (key, build_step), (_, _) = actor_cobatch.builds(actor, 2, tuple(sorted(shapes)), shapes)
    assert key[1] == "cotrain-step"
    hlo = build_step().as_text()
    count = {op: len(re.findall(rf"= [^\n]*? {op}(?:-start)?\(", hlo)) for op in ("all-gather", "all-to-all")}
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    assert count["all-gather"] >= 2 * 4 * layers, count  # q, v, o, down (and the rest), gathered per use
    assert count["all-to-all"] < layers, count  # no activation shuffle per layer
    actor.release()


def test_an_actor_role_whose_advantages_fail_withdraws_from_its_train_hold():
    """rlsched.run.roles.ActorRole.train computes the group advantages before the worker's train: if they raise (the
    rewards do not split into groups), the hold's other members are told at once, not after the 30 s wait."""
    import types

    from rlsched.observe.timeline import Timeline
    from rlsched.run.roles import ActorRole

    withdrawn = []
    role = types.SimpleNamespace(
        spec=types.SimpleNamespace(config=types.SimpleNamespace(
            grpo=types.SimpleNamespace(num_generations=4, normalize_advantage_std=True, advantage_std_ddof=0))),
        timeline=Timeline("actor", task="t"),
        worker=types.SimpleNamespace(withdraw=withdrawn.append, train=None), _advantage_programs={})
    role._advantages = types.MethodType(ActorRole._advantages, role)  # compiles the advantages' program: it raises
    batch = types.SimpleNamespace(size=6)
    together = Together(hold=7, tasks=3)
    with pytest.raises(ValueError, match="rewards must be"):
        ActorRole.train(role, batch, np.zeros(6, np.float32), 1, together)  # 6 rewards, groups of 4
    assert withdrawn == [together]
    with pytest.raises(ValueError, match="rewards must be"):
        ActorRole.train(role, batch, np.zeros(6, np.float32), 1)  # alone: nothing to withdraw from
    assert withdrawn == [together]
