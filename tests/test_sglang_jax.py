"""The sglang-jax rollout backend (workers/rollout/sglang_jax.py) and its shims (sglang_compat.py).

These run in the Python 3.12 stage (.ci/sglang_stage.sh); elsewhere tests/conftest.py deselects
them. The engine always lives in a Ray actor of its own, as in a run: its crashes kill that process,
never pytest. Each shim's defect is shown in a fresh interpreter with that one shim left out.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from workers.models import params as P
from workers.rollout import EngineOffloadedError, FinishReason, SamplingParams

STOP = 258  # <|im_end|> in the byte tokenizer
PROMPTS = [[72, 105], [50, 43, 50, 61], [1], list(range(60, 90))]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(STOP,))
ENGINE_KW = dict(max_prompt_len=32, max_new_tokens=16, max_batch_size=16)


def test_missing_sglang_names_the_extra(monkeypatch, tiny_model_dir):
    """Runs everywhere (no marker): without sglang-jax the engine says how to get it."""
    from workers.rollout import make_engine

    monkeypatch.setitem(sys.modules, "sgl_jax", None)  # import sgl_jax... -> ImportError
    monkeypatch.delitem(sys.modules, "sgl_jax.srt.entrypoints.engine", raising=False)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[sglang\]' \(needs Python >= 3\.12\)"):
        make_engine("sglang_jax", str(tiny_model_dir), **ENGINE_KW)



def _tv(freq: np.ndarray, p: np.ndarray) -> float:
    """Total variation distance between an empirical distribution and p."""
    return float(0.5 * np.abs(freq - p).sum())


def _exact_tv(n: int, p: np.ndarray, seed: int) -> float:
    """The yardstick: the largest total variation from p of 20 exact samples of n draws (numpy),
    i.e. what sampling noise alone gives at this n."""
    rng = np.random.default_rng(seed)
    return max(_tv(rng.multinomial(n, p) / n, p) for _ in range(20))


def _tokens(out) -> list[list[int]]:
    return [s.token_ids.tolist() for s in out.samples]


@pytest.fixture(scope="module")
def remote(ray_session, tiny_model_dir):
    """One sglang-jax engine in its own Ray actor for the module; `remote(method, *args)` calls it."""
    import ray

    from workers.rollout.sglang_jax import SglangJaxEngine

    actor = ray.remote(SglangJaxEngine).options(num_cpus=0).remote(str(tiny_model_dir), seed=0, **ENGINE_KW)

    def call(method, *args, **kwargs):
        return ray.get(getattr(actor, method).remote(*args, **kwargs))

    call.actor = actor
    yield call
    ray.kill(actor)


def _attr(remote, fn):
    """Evaluate fn(engine) inside the engine's actor."""
    import ray

    return ray.get(remote.actor.__ray_call__.remote(fn))


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The built-in sampler on the same weights: what greedy output must equal."""
    from workers.rollout.jax_sampler import JaxSampler

    model, _ = tiny_model
    return JaxSampler(model, **ENGINE_KW)


@pytest.fixture
def synced(remote, tiny_model):
    """The engine holding the tiny model's weights as version 1."""
    flat = P.host_params(tiny_model[0])
    remote("update_weights", flat, 1)
    return flat


@pytest.mark.sglang
def test_is_a_rollout_engine(remote):
    from workers.rollout import RolloutEngine

    assert _attr(remote, lambda e: isinstance(e, RolloutEngine))


@pytest.mark.sglang
def test_update_weights_then_greedy_equals_builtin_sampler(remote, synced, reference):
    stats = remote("update_weights", synced, 2)
    # Leaf by leaf: the swap never holds more than one leaf beyond the steady state.
    assert stats["params_bytes"] == P.num_bytes(synced) and stats["peak_extra_bytes"] <= stats["largest_leaf_bytes"]
    out = remote("generate", PROMPTS, GREEDY)
    assert out.weight_version == 2
    ref = reference.generate(PROMPTS, GREEDY)
    assert _tokens(out) == _tokens(ref)  # fp32, tied head, peaked weights: no near-ties to flip
    assert [s.finish_reason for s in out.samples] == [s.finish_reason for s in ref.samples]


@pytest.mark.sglang
def test_samples_are_prompt_major_and_end_as_promised(remote, synced):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, stop_token_ids=(STOP,), seed=0)
    out = remote("generate", PROMPTS[:3], params)
    assert [s.prompt_index for s in out.samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for s in out.samples:
        assert s.token_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
        assert s.token_ids.shape == s.logprobs.shape and np.isnan(s.logprobs).all()  # not computed: see module doc
        assert STOP not in s.token_ids[:-1].tolist()
        if s.finish_reason == FinishReason.STOP:
            assert s.token_ids[-1] == STOP and 1 <= len(s.token_ids) <= 12
        else:
            assert len(s.token_ids) == 12


@pytest.mark.sglang
def test_stops_at_the_callers_stop_ids_and_nowhere_else(remote, synced, reference):
    # A stop id that greedy decoding of prompt 0 emits early: the sample ends on it, EOS included.
    first = _tokens(reference.generate(PROMPTS[:1], GREEDY))[0]
    stop_at = first[2]
    out = remote("generate", PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(stop_at,)))
    assert _tokens(out)[0] == first[: first.index(stop_at) + 1] and out.samples[0].finish_reason == FinishReason.STOP
    # No stop ids: the model's own EOS does not end a sample either.
    out = remote("generate", PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=16))
    assert all(len(s.token_ids) == 16 and s.finish_reason == FinishReason.LENGTH for s in out.samples)


@pytest.mark.sglang
def test_seeds_reproduce_and_diversify(remote, synced):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=9)
    a, b = remote("generate", PROMPTS[:2], params), remote("generate", PROMPTS[:2], params)
    assert _tokens(a) == _tokens(b)  # same seed, same samples
    assert len({tuple(t) for t in _tokens(a)[:4]}) == 4  # the n samples of one prompt differ
    c = remote("generate", PROMPTS[:2], SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=10))
    assert _tokens(c) != _tokens(a)
    unseeded = SamplingParams(n=4, temperature=1.0, max_new_tokens=10)
    assert _tokens(remote("generate", PROMPTS[:2], unseeded)) != _tokens(remote("generate", PROMPTS[:2], unseeded))
    # Sample j of prompt i depends on (seed, i, j) only, not on what else is in the batch.
    more = remote("generate", PROMPTS[:3], params)
    assert _tokens(more)[:8] == _tokens(a)


@pytest.mark.sglang
def test_samples_follow_the_models_distribution(remote, synced, tiny_model):
    """Sampled tokens follow softmax(logits / T) of the model: the property GRPO's importance ratios
    rest on (the actor scores the samples as if drawn from its policy). 2,048 seeded first tokens at
    T = 0.8; the yardstick is exact sampling of as many draws (numpy), whose total variation from
    the target is sampling noise alone. Unshimmed, 0.0.2's seeded sampler misses it by far
    (see test_defect_seeded_sampling)."""
    import jax
    import jax.numpy as jnp

    model, _ = tiny_model
    prompt, temperature, calls, rows = PROMPTS[1], 0.8, 16, 16
    logits = np.asarray(model(jnp.array([prompt], jnp.int32))[0, -1], np.float64)
    p = np.asarray(jax.nn.softmax(logits / temperature))
    first = [s.token_ids[0] for c in range(calls) for s in remote(
        "generate", [prompt] * rows, SamplingParams(n=8, temperature=temperature, max_new_tokens=1, seed=c)).samples]
    got, exact = _tv(np.bincount(first, minlength=p.size) / len(first), p), _exact_tv(len(first), p, seed=0)
    assert got < 1.25 * exact, (got, exact)


@pytest.mark.sglang
def test_weight_version_checksum_and_refusals(remote, synced):
    assert _attr(remote, lambda e: (e.weight_version, e.weight_checksum)) == (1, P.checksum(synced))
    before = _tokens(remote("generate", PROMPTS, GREEDY))
    bad_shape = {**synced, "model.norm.weight": np.ones(3, np.float32)}
    with pytest.raises(P.WeightMismatchError, match=r"model\.norm\.weight is float32\(3,\)"):
        remote("update_weights", bad_shape, 2)
    bad_dtype = {**synced, "model.norm.weight": synced["model.norm.weight"].astype(np.float16)}
    with pytest.raises(P.WeightMismatchError, match="float16"):
        remote("update_weights", bad_dtype, 2)
    missing = {k: v for k, v in synced.items() if k != "model.norm.weight"}
    with pytest.raises(P.WeightMismatchError, match=r"missing \['model\.norm\.weight'\]"):
        remote("update_weights", missing, 2)
    # Refused updates keep the old weights, version and checksum.
    assert _attr(remote, lambda e: (e.weight_version, e.weight_checksum)) == (1, P.checksum(synced))
    assert _tokens(remote("generate", PROMPTS, GREEDY)) == before
    # Different weights, different checksum: a driver comparing against the published one refuses.
    perturbed = {k: v + np.float32(0.01) for k, v in synced.items()}
    remote("update_weights", perturbed, 2)
    assert _attr(remote, lambda e: e.weight_checksum) == P.checksum(perturbed) != P.checksum(synced)


@pytest.mark.sglang
def test_offload_onload_frees_memory_and_keeps_outputs(remote, synced):
    from workers.offload import device_bytes

    before = _tokens(remote("generate", PROMPTS, GREEDY))
    held = remote("memory_bytes")
    assert held["params"] == P.num_bytes(synced) and held["kv"] > 0
    on_device = _attr(remote, lambda e: device_bytes())
    remote("offload")
    assert remote("memory_bytes") == {"params": 0, "kv": 0}
    # Measured from the live arrays in the engine's process: weights and KV cache left the device.
    assert on_device - _attr(remote, lambda e: device_bytes()) >= held["params"] + held["kv"]
    with pytest.raises(EngineOffloadedError):
        remote("generate", PROMPTS, GREEDY)
    with pytest.raises(EngineOffloadedError):
        remote("update_weights", synced, 3)
    remote("onload")
    # The checksum was dropped at onload and is hashed again from the device.
    assert _attr(remote, lambda e: e._checksum) is None
    assert _attr(remote, lambda e: e.weight_checksum) == P.checksum(synced)
    assert _tokens(remote("generate", PROMPTS, GREEDY)) == before


@pytest.mark.sglang
def test_checksum_after_onload_sees_a_corrupted_weight(remote, synced):
    remote("offload")
    remote("onload")

    def corrupt(e):
        import jax

        x = e._leaves[0]
        e._leaves[0] = jax.device_put(np.asarray(x) + np.float32(1.0), x.sharding)
        return e.weight_checksum

    assert _attr(remote, corrupt) != P.checksum(synced)  # hashed from the device, never assumed


@pytest.mark.sglang
def test_a_crash_inside_sglang_jax_kills_only_its_actor(ray_session, tiny_model_dir):
    import ray

    from workers.rollout.sglang_jax import SglangJaxEngine

    actor = ray.remote(SglangJaxEngine).options(num_cpus=0).remote(str(tiny_model_dir), **ENGINE_KW)
    assert ray.get(actor.__ray_call__.remote(lambda e: e.weight_version)) == -1  # dummy weights: no version
    # return_logprob=True raises in sglang-jax 0.0.2's scheduler thread: SIGQUIT -> its process tree dies.
    crash = actor.__ray_call__.remote(lambda e: e._engine.generate(
        input_ids=[[1, 2]], sampling_params={"max_new_tokens": 2}, return_logprob=True))
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(crash, timeout=300)
    # This process is alive and Ray still serves other work.
    assert ray.get(ray.remote(lambda: 1 + 1).remote()) == 2


# ---- each shim's defect, shown in the installed version without that shim ------------------------


def _run_without(shim: str, code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "RLSCHED_SGLANG_SKIP_SHIMS": shim, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout)


START = """
import os
from workers.rollout.sglang_jax import SglangJaxEngine
e = SglangJaxEngine({path!r}, max_prompt_len=32, max_new_tokens=16, max_batch_size=16)
"""


@pytest.mark.sglang
def test_shims_apply_to_the_supported_version_and_another_version_is_refused():
    from workers.rollout import sglang_compat as C

    assert C.installed_version() == "0.0.2"
    assert all(s.versions == {"0.0.2"} for s in C.SHIMS)
    assert {"0.0.2"} == C.SUPPORTED_VERSIONS
    r = _run_without("", "from workers.rollout import sglang_compat as C; print(C.apply_shims('9.9.9'))")
    assert r.returncode != 0 and "RuntimeError: sglang-jax 9.9.9 is not supported: rlsched's fixes for its " \
        "defects (workers/rollout/sglang_compat.py) are written for 0.0.2" in r.stderr, r.stderr[-2000:]


@pytest.mark.sglang
def test_defect_native_attention_pytree(tiny_model_dir):
    r = _run_without("native_attention_pytree", START.format(path=str(tiny_model_dir)) + "os._exit(0)")
    assert r.returncode != 0 and "Duplicate custom PyTreeDef type registration" in r.stderr, r.stderr[-2000:]


@pytest.mark.sglang
def test_defect_loader_without_eager_sharding(tiny_model_dir):
    r = _run_without("loader_without_eager_sharding", START.format(path=str(tiny_model_dir)) + "os._exit(0)")
    assert r.returncode != 0 and "An auto mesh context or metadata is required" in r.stderr, r.stderr[-2000:]


@pytest.mark.sglang
def test_defect_min_p_filter_operands(tiny_model_dir):
    code = START.format(path=str(tiny_model_dir)) + """
from workers.rollout import SamplingParams
e.generate([[1, 2]], SamplingParams(temperature=0.0, max_new_tokens=2))
print("generated"); os._exit(0)
"""
    r = _run_without("min_p_filter_operands", code)
    assert "generated" not in r.stdout and "too many values to unpack (expected 2)" in r.stderr, r.stderr[-2000:]


@pytest.mark.sglang
def test_defect_seeded_sampling():
    """Both defects of 0.0.2's seeded sampler, and the shim sampling exactly; n seeded draws each.
    (a) the CPU path hands it probabilities p = (0.9, 0.1), which it softmaxes: token 0 comes out
        near 0.5 (measured 0.499), not 0.9.
    (b) fed logits, as it expects, over 384 tokens: its hash noise is shared across tokens, so the
        draws are far from softmax(logits) (measured total variation 0.38), where exact sampling of
        as many draws lands near 0.056 (the same arithmetic with numpy's sampler: `exact`)."""
    code = """
import jax, jax.numpy as jnp, numpy as np
from workers.rollout import sglang_compat as C
C.apply_shims()
from sgl_jax.srt.layers import sampler as S
def draws(inputs, n, seed0):
    x = jnp.tile(jnp.asarray(inputs, jnp.float32)[None], (n, 1))
    seeds = jnp.arange(seed0, seed0 + n, dtype=jnp.int32) * 7919
    positions = jnp.arange(n, dtype=jnp.int32) % 50
    return np.asarray(S.multinomial_with_seed((x, seeds, positions, None))).ravel()
logits = np.random.default_rng(0).normal(0, 1, 384)
p = np.exp(logits - logits.max()); p /= p.sum()
tv = lambda idx: 0.5 * np.abs(np.bincount(idx, minlength=384) / idx.size - p).sum()
two = lambda: float((draws([0.9, 0.1], 4000, 1) == 0).mean())
before = (two(), tv(draws(logits, 16384, 1)))
C._seeded_sampling()
after = (two(), tv(draws(p, 16384, 1)))  # the CPU path's input: probabilities
print(*before, *after)
"""
    r = _run_without("seeded_sampling", code)
    assert r.returncode == 0, r.stderr[-2000:]
    two_before, tv_before, two_after, tv_after = map(float, r.stdout.split())
    logits = np.random.default_rng(0).normal(0, 1, 384)  # as in the subprocess
    p = np.exp(logits - logits.max())
    exact = _exact_tv(16384, p / p.sum(), seed=1)
    assert two_before < 0.75 and tv_before > 3 * exact, (two_before, tv_before, exact)
    # Binomial sd of the (0.9, 0.1) fraction over 4000 draws: sqrt(0.09 / 4000) = 0.0047; 0.02 is > 4 sd.
    assert abs(two_after - 0.9) < 0.02 and tv_after < 1.25 * exact, (two_after, tv_after, exact)


@pytest.mark.sglang
def test_defect_lm_head_dtype(tmp_path):
    from workers.models import init_model

    untied = init_model(tmp_path / "small", preset="small", seed=0)  # small: lm_head not tied
    code = START.format(path=str(untied)) + """
import numpy as np
print(dict(zip(e._names, (str(x.dtype) for x in e._leaves)))["lm_head.kernel"]); os._exit(0)
"""
    r = _run_without("lm_head_dtype", code)
    assert r.returncode == 0 and r.stdout.strip() == "bfloat16", r.stderr[-2000:]
    r = _run_without("", code)
    assert r.returncode == 0 and r.stdout.strip() == "float32", r.stderr[-2000:]


@pytest.mark.sglang
def test_defect_idle_scheduler_busy_wait(tiny_model_dir):
    code = START.format(path=str(tiny_model_dir)) + """
import time
t = time.process_time(); time.sleep(2.0); print(time.process_time() - t); os._exit(0)
"""
    busy, idle = _run_without("idle_scheduler_busy_wait", code), _run_without("", code)
    assert busy.returncode == 0 and idle.returncode == 0, busy.stderr[-2000:] + idle.stderr[-2000:]
    # CPU seconds over 2 s of idling: a spinning thread takes what the machine gives it (most of a core alone, 0.43
    # s measured at load ~8 on 2 cores), a blocked one ~none (0.006 s there): told apart by their ratio at any load.
    spun, slept = float(busy.stdout), float(idle.stdout)
    assert spun > 0.2 and slept < 0.2 and spun > 10 * slept, (spun, slept)


@pytest.mark.sglang
def test_defect_watchdog_signals_own_process(tiny_model_dir):
    """The process the engine's watchdog sends SIGQUIT to when a batch stalls: unshimmed, the parent of
    the engine's process (under Ray, the raylet: the whole node dies); shimmed, the engine's own."""
    code = START.format(path=str(tiny_model_dir)) + """
target = e._engine.scheduler_info["scheduler"].parent_process.pid
print({os.getppid(): "parent", os.getpid(): "self"}.get(target, target)); os._exit(0)
"""
    unshimmed, shimmed = _run_without("watchdog_signals_own_process", code), _run_without("", code)
    assert unshimmed.returncode == 0 and shimmed.returncode == 0, unshimmed.stderr[-2000:] + shimmed.stderr[-2000:]
    assert (unshimmed.stdout.strip(), shimmed.stdout.strip()) == ("parent", "self")


@pytest.mark.sglang
def test_generates_in_a_process_pinned_to_one_core(tiny_model_dir):
    """A rollout role pinned to one core (disaggregated on 2 cores) starts JAX with the XLA CPU threads
    the engine needs (workers.rollout.XLA_CPU_THREADS). Pinned before JAX starts, with a one-thread
    pool, sglang-jax's sampled steps hung within the first four calls in each of three tries (its host
    sort callback waits on the pool it runs in); a run that hangs here times out."""
    code = f"""
import os
from rlsched.cluster.pinning import pin_process
from workers.rollout import XLA_CPU_THREADS
pin_process([0], xla_threads=XLA_CPU_THREADS["sglang_jax"])
from workers.rollout import SamplingParams
from workers.rollout.sglang_jax import SglangJaxEngine
e = SglangJaxEngine({str(tiny_model_dir)!r}, max_prompt_len=16, max_new_tokens=4, max_batch_size=256)
for call in range(10):
    out = e.generate([[40 + i, 43, 50] for i in range(16)], SamplingParams(n=16, max_new_tokens=4, seed=call))
    assert out.num_tokens == 16 * 16 * 4
print("pinned", sorted({{c for t in os.listdir("/proc/self/task") for c in os.sched_getaffinity(int(t))}}))
os._exit(0)
"""
    r = _run_without("", code, timeout=240)
    assert r.returncode == 0 and r.stdout.strip() == "pinned [0]", r.stderr[-2000:]
