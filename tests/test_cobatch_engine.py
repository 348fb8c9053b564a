"""Co-batched ROLLOUT on the engine side: JaxSampler.generate_many runs several requests in one program run and gives
each what `generate` gives it alone; the views of a base group's shared engine (workers.rollout.shared_engine) that
hold the rollout lock together (`Together`) meet in a gathering (workers.rollout.cobatch) and run as one, and a
member that fails or never comes does not hold the others up."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest

from workers.models import lora as L
from workers.models import sharding as S
from workers.rollout.base import EngineOffloadedError, RolloutInputError, SamplingParams, Together
from workers.rollout.jax_sampler import JaxSampler
from workers.rollout.shared_engine import open_view

SPECS = [L.LoraSpec(rank=4, alpha=8.0, targets=("q", "v", "down")), L.LoraSpec(rank=2, alpha=4.0, targets=("k", "up")),
         L.LoraSpec(rank=4, alpha=4.0, targets=("o", "gate"))]
SAMPLED = dict(temperature=1.0, max_new_tokens=8, stop_token_ids=(3,))
# Three tasks' requests: other prompts, prompt counts, n and seeds, one sampling setting
REQUESTS = [([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(n=2, seed=7, **SAMPLED)),
            ([[40, 41]], SamplingParams(n=3, seed=8, **SAMPLED)),
            ([[12, 13, 14], [15], [16, 17]], SamplingParams(n=1, seed=9, **SAMPLED))]
HOLDS = itertools.count(1)  # a fresh hold id per co-batched call (a group remembers the holds that ran)


def _adapter(cfg, spec, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0, 0.3, s).astype(np.float32) for n, s in L.adapter_shapes(cfg, spec).items()}


def _tokens(output) -> list[tuple[int, list[int], str]]:
    return [(s.prompt_index, [int(t) for t in s.token_ids], str(s.finish_reason)) for s in output.samples]


def _same(got, want, *, bitwise: bool = False) -> None:
    """Tokens exact; logprobs bit for bit, or to the float rounding of another batch size (measured: <= 5e-6,
    as test_rollout_jax_sampler's batching test allows)."""
    assert _tokens(got) == _tokens(want)
    for g, w in zip(got.samples, want.samples, strict=True):
        if bitwise:
            np.testing.assert_array_equal(g.logprobs, w.logprobs)
        else:
            np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)


# ---- JaxSampler.generate_many --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampler(tiny_model):
    engine = JaxSampler(tiny_model[0], max_prompt_len=16, max_new_tokens=8, max_batch_size=16, seed=5)
    engine.set_adapters([_adapter(engine.config, s, i) for i, s in enumerate(SPECS)], SPECS)
    return engine


def test_each_request_of_a_joint_run_gets_what_it_gets_alone(sampler):
    requests = [(*REQUESTS[0], [0, 1]), (*REQUESTS[1], [-1]), (*REQUESTS[2], [2, -1, 0]),
                ([[5, 6, 7, 8]], SamplingParams(n=4, seed=7, **SAMPLED), None),  # the base, no adapters at all
                ([[20, 21, 22, 23, 24, 25, 26, 27, 28, 29]], SamplingParams(n=2, seed=1, **SAMPLED), [1])]
    joint = sampler.generate_many(requests)
    assert len(joint) == len(requests) and all(o.cobatched == len(requests) for o in joint)
    for request, got in zip(requests, joint, strict=True):
        alone = sampler.generate(*request)
        assert alone.cobatched == 1 and len(got.samples) == len(request[0]) * request[1].n
        _same(got, alone)
    # Request 0 and request 3 share a seed and a first prompt, but not adapters: they differ
    assert _tokens(joint[0])[:1] != _tokens(joint[3])[:1]


def test_a_joint_run_with_the_shapes_of_the_request_s_own_run_is_bit_for_bit(sampler):
    # 3 + 1 rows: batch bucket 4 and prompt bucket 8, as the three-prompt request's own run (wherever its rows are)
    three = ([[5, 6, 7, 8], [9, 10, 11], [12, 13]], SamplingParams(n=1, seed=7, **SAMPLED), [0, 2, -1])
    one = ([[1, 2]], SamplingParams(n=1, seed=3, **SAMPLED), [1])
    want = sampler.generate(*three)
    _same(sampler.generate_many([three, one])[0], want, bitwise=True)
    _same(sampler.generate_many([one, three])[1], want, bitwise=True)


def test_unseeded_requests_draw_their_seeds_as_separate_calls_would(tiny_model):
    def engine():
        return JaxSampler(tiny_model[0], max_prompt_len=16, max_new_tokens=8, max_batch_size=16, seed=11)

    requests = [(REQUESTS[0][0], SamplingParams(n=2, **SAMPLED)), (REQUESTS[1][0], SamplingParams(n=3, **SAMPLED))]
    joint = engine().generate_many(requests)
    separate = engine()
    for request, got in zip(requests, joint, strict=True):
        _same(got, separate.generate(*request))


def test_a_joint_run_refuses_requests_of_other_sampling_settings(sampler):
    greedy = ([[5, 6]], SamplingParams(n=1, temperature=0.0, max_new_tokens=8, stop_token_ids=(3,)))
    with pytest.raises(RolloutInputError, match=r"request 1 samples with temperature=0\.0.*must agree"):
        sampler.generate_many([REQUESTS[0], greedy])
    with pytest.raises(RolloutInputError, match="request 1 samples with .*max_new_tokens=4"):
        sampler.generate_many([REQUESTS[0], ([[5]], SamplingParams(n=1, seed=1, temperature=1.0, max_new_tokens=4,
                                                                   stop_token_ids=(3,)))])
    with pytest.raises(RolloutInputError, match="request 1: prompt 0 has 20 tokens"):
        sampler.generate_many([REQUESTS[0], ([list(range(20))], REQUESTS[1][1])])
    with pytest.raises(RolloutInputError, match="at least one request"):
        sampler.generate_many([])


# ---- views of one base group, together ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def views(tiny_model_dir):
    """Three LoRA tasks' engines on one base (slots 0, 1, 2 of one SharedSampler), each with its adapter."""
    out = [open_view(tiny_model_dir, dtype=None, mesh=S.mesh({}, jax.devices()[:1]), spec=spec, max_prompt_len=16,
                     max_new_tokens=8, max_batch_size=16, seed=i) for i, spec in enumerate(SPECS)]
    assert len({id(v.group) for v in out}) == 1
    for i, view in enumerate(out):
        view.update_weights(_adapter(view.config, view.spec, 10 + i), 1)
    yield out
    for view in out:
        view.close()


@pytest.fixture(scope="module")
def alone(views):
    """What each task generates alone (its view, no hold shared)."""
    return [view.generate(*request) for view, request in zip(views, REQUESTS, strict=True)]


@pytest.fixture
def runs(views, monkeypatch):
    """Counts of the shared sampler's generate_many calls (the requests in each) and program runs (chunks)."""
    sampler = views[0].group.sampler
    counts = {"generate_many": [], "programs": 0}
    many, chunk = sampler.generate_many, sampler._run_chunk

    def generate_many(requests):
        counts["generate_many"].append(len(requests))
        return many(requests)

    def run_chunk(*args):
        counts["programs"] += 1
        return chunk(*args)

    monkeypatch.setattr(sampler, "generate_many", generate_many)
    monkeypatch.setattr(sampler, "_run_chunk", run_chunk)
    monkeypatch.setattr(views[0].group.gatherings, "wait_s", 60.0)  # success never comes from the wait running out
    return counts


def _together(calls, together: Together, timeout: float = 120) -> list:
    """Each (view, prompt_ids, params) generates from a thread of its own within the hold `together`; their
    outputs (a member's exception raised)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(view.generate, prompts, params, together=together) for view, prompts, params in calls]
        return [f.result(timeout=timeout) for f in futures]


def test_the_tasks_of_a_hold_run_as_one_program_run_and_each_gets_what_it_gets_alone(views, alone, runs):
    outputs = _together([(v, *r) for v, r in zip(views, REQUESTS, strict=True)], Together(next(HOLDS), 3))
    assert runs == {"generate_many": [3], "programs": 1}  # 2*2 + 3 + 3 = 10 rows: one chunk of the 16-row batch
    for view, got, want in zip(views, outputs, alone, strict=True):
        assert got.cobatched == 3 and got.weight_version == view.weight_version == 1
        _same(got, want)
    assert _tokens(outputs[0]) != _tokens(outputs[1])  # the tasks' own adapters and requests
    assert views[0].group.gatherings.open_holds() == []


def test_tasks_of_other_sampling_settings_in_one_hold_run_apart(views, alone, runs):
    greedy = ([[5, 6, 7, 8]], SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    want = views[2].generate(*greedy)
    runs["generate_many"].clear()
    outputs = _together([(views[0], *REQUESTS[0]), (views[1], *REQUESTS[1]), (views[2], *greedy)],
                        Together(next(HOLDS), 3))
    assert sorted(runs["generate_many"]) == [1, 2]
    assert [o.cobatched for o in outputs] == [2, 2, 1]
    _same(outputs[0], alone[0])
    _same(outputs[1], alone[1])
    _same(outputs[2], want, bitwise=True)  # alone in its run: its own shapes
    assert views[0].group.gatherings.open_holds() == []


def test_a_member_that_never_comes_holds_the_others_up_for_the_wait_only(views, alone, runs):
    gatherings = views[0].group.gatherings
    gatherings.wait_s = 1.0
    hold = Together(next(HOLDS), 3)
    start = time.monotonic()
    outputs = _together([(views[0], *REQUESTS[0]), (views[1], *REQUESTS[1])], hold)
    assert time.monotonic() - start >= 1.0  # they waited for the third, then ran without it
    assert [o.cobatched for o in outputs] == [2, 2] and runs["generate_many"] == [2]
    _same(outputs[0], alone[0])
    _same(outputs[1], alone[1])
    assert gatherings.open_holds() == []

    gatherings.wait_s = 60.0
    start = time.monotonic()
    late = views[2].generate(*REQUESTS[2], together=hold)  # its hold ran already: it runs alone, at once
    assert time.monotonic() - start < 30 and late.cobatched == 1
    _same(late, alone[2], bitwise=True)
    assert gatherings.open_holds() == []


@pytest.mark.parametrize("failure", ["withdraw", "bad request", "offloaded"])
def test_a_member_that_fails_before_generating_fails_alone_and_the_others_go_at_once(views, alone, runs, failure):
    hold = Together(next(HOLDS), 3)
    failing = views[2]
    if failure == "offloaded":
        failing.offload()
    calls = [(views[0], *REQUESTS[0]), (views[1], *REQUESTS[1])]
    start = time.monotonic()
    try:
        with ThreadPoolExecutor(1) as pool:
            others = pool.submit(_together, calls, hold)
            time.sleep(0.2)  # the others are waiting in the gathering (or about to)
            if failure == "withdraw":
                failing.withdraw(hold)  # e.g. its weight sync was refused
            elif failure == "bad request":
                with pytest.raises(RolloutInputError, match="more than this engine's max_prompt_len=16"):
                    failing.generate([list(range(20))], REQUESTS[2][1], together=hold)
            else:
                with pytest.raises(EngineOffloadedError):
                    failing.generate(*REQUESTS[2], together=hold)
            outputs = others.result(timeout=120)
    finally:
        failing.onload()
    assert time.monotonic() - start < 30  # not the 60 s wait
    assert [o.cobatched for o in outputs] == [2, 2] and runs["generate_many"] == [2]
    _same(outputs[0], alone[0])
    _same(outputs[1], alone[1])
    assert views[0].group.gatherings.open_holds() == []


def test_a_withdrawal_before_anyone_came_is_counted_and_a_hold_of_withdrawals_only_leaves_nothing(views, alone, runs):
    gatherings = views[0].group.gatherings
    hold = Together(next(HOLDS), 2)
    views[1].withdraw(hold)  # before the other member came: it will not wait for this one
    assert gatherings.open_holds() == [hold.hold]
    got = views[0].generate(*REQUESTS[0], together=hold)
    assert got.cobatched == 1 and runs["generate_many"] == [1]
    _same(got, alone[0], bitwise=True)
    both = Together(next(HOLDS), 2)
    views[0].withdraw(both)
    views[1].withdraw(both)
    assert gatherings.open_holds() == []


def test_prepare_compiles_the_joint_programs_of_a_hold_ahead(views, monkeypatch):
    sampler = views[0].group.sampler
    prompts = [list(range(30, 40)), [41, 42], list(range(50, 61))]  # prompt bucket 16
    params = SamplingParams(n=1, seed=3, temperature=0.7, max_new_tokens=8)  # 3 rows; 6 and 9 rows together
    assert views[0].prepare(prompts, params) >= 1
    assert views[0].prepare(prompts, params) == 0  # ready: alone, and two and three of the group's tasks together

    def compile_now(*_):
        raise AssertionError("a joint run compiled a program that prepare should have compiled")

    monkeypatch.setattr(sampler, "_jitted", compile_now)  # generate falls back to jit only for unprepared shapes
    for tasks in (2, 3):
        outputs = _together([(v, prompts, params) for v in views[:tasks]], Together(next(HOLDS), tasks))
        assert [o.cobatched for o in outputs] == [tasks] * tasks


@pytest.mark.slow
def test_a_hold_on_a_rollout_mesh_runs_as_one_and_each_gets_what_it_gets_alone(tiny_model_dir):
    """The layout accelerators use: the group's engine on a dp (x tp) mesh, request rows split over dp, the KV
    cache's heads over tp. The joint run's rows are split as one request's are, and each task still gets its own."""
    mesh = S.mesh({"dp": 2, "tp": 2}, jax.devices()[:4])
    views = [open_view(tiny_model_dir, dtype=None, mesh=mesh, spec=spec, max_prompt_len=16, max_new_tokens=8,
                       max_batch_size=16, seed=i) for i, spec in enumerate(SPECS)]
    try:
        assert len({id(v.group) for v in views}) == 1 and views[0].group.sampler.mesh.shape == mesh.shape
        for i, view in enumerate(views):
            view.update_weights(_adapter(view.config, view.spec, 10 + i), 1)
        alone = [view.generate(*request) for view, request in zip(views, REQUESTS, strict=True)]
        together = _together([(v, *r) for v, r in zip(views, REQUESTS, strict=True)], Together(next(HOLDS), 3))
        for got, want in zip(together, alone, strict=True):
            assert got.cobatched == 3
            _same(got, want)
    finally:
        for view in views:
            view.close()
