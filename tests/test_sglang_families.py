"""The model families the sglang_jax rollout engine runs (workers/rollout/sglang_compat.py: SGLANG_CLASSES,
check_model) and the config-time refusal of the others (rlsched.config.meshes.check_meshes).

The unmarked tests run everywhere (no sglang-jax, no JAX: the control plane's check); the `sglang` ones in the
Python 3.12 stage (.ci/sglang_stage.sh), each engine in a Ray actor of its own as in a run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rlsched.config.loading import load_config
from rlsched.config.meshes import check_meshes
from rlsched.config.schema import ConfigError
from workers.models.presets import preset_config
from workers.rollout import sglang_compat

CONFIG = """\
experiment: {{name: families}}
tasks:
  - name: addition
    model: {{path: {path}, init_preset: {preset}}}
    data: {{kind: addition}}
    reward: {{name: addition}}
    rollout: {{engine: {engine}}}
    grpo: {{prompts_per_step: 2, num_generations: 2, mini_batch_size: 4, micro_batch_size: 4}}
    steps: 1
"""


def _check(tmp_path, *, preset: str, engine: str = "sglang_jax", path=None) -> None:
    """load_config + check_meshes (what `rlsched train` runs before any process starts) on a one-task config."""
    config = tmp_path / "families.yaml"
    config.write_text(CONFIG.format(path=path or tmp_path / "absent", preset=preset, engine=engine))
    check_meshes(load_config(config))


def test_check_family_names_the_family_and_the_built_in_sampler():
    for family in ("qwen3", "qwen2", "qwen3_moe"):
        sglang_compat.check_family(family)
    with pytest.raises(sglang_compat.UnsupportedModelError) as info:
        sglang_compat.check_family("llama")
    assert str(info.value) == ("sglang_jax does not run llama models (sglang-jax 0.0.2 implements qwen3, qwen2, "
                               "qwen3_moe); use rollout.engine: jax_sampler (the built-in sampler)")


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-qwen3moe"])
def test_every_family_passes_the_config_check(tmp_path, preset):
    _check(tmp_path, preset=preset)


def test_an_unsupported_family_is_refused_at_config_time(tmp_path, monkeypatch):
    """As a release of sglang-jax without a family's model would be: the family left out of the table."""
    monkeypatch.setattr(sglang_compat, "SGLANG_CLASSES",
                        {k: v for k, v in sglang_compat.SGLANG_CLASSES.items() if k != "qwen3_moe"})
    with pytest.raises(ConfigError) as info:
        _check(tmp_path, preset="tiny-qwen3moe")
    assert str(info.value) == (
        "tasks.0.rollout.engine: sglang_jax does not run qwen3_moe models (sglang-jax 0.0.2 implements qwen3, "
        "qwen2); use rollout.engine: jax_sampler (the built-in sampler) (model: the tiny-qwen3moe preset)")
    _check(tmp_path, preset="tiny-qwen3moe", engine="jax_sampler")  # the built-in sampler runs it


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("norm_topk_prob", False, "only with norm_topk_prob true (sglang-jax always renormalises the top-k router "
                              "weights), this model has false"),
    ("decoder_sparse_step", 2, "only with decoder_sparse_step 1 (sglang-jax makes every layer outside "
                               "mlp_only_layers sparse), this model has 2"),
])
def test_moe_settings_sglang_jax_would_ignore_are_refused(tmp_path, field, value, expected):
    """A Qwen3-MoE config.json with a setting sglang-jax's model does not read: refused, not run differently."""
    model = tmp_path / "model"
    model.mkdir()
    raw = preset_config("tiny-qwen3moe", vocab_size=384).to_hf_dict()
    (model / "config.json").write_text(json.dumps({**raw, field: value}))
    with pytest.raises(ConfigError) as info:
        _check(tmp_path, preset="tiny-qwen3moe", path=model)
    assert str(info.value) == (f"tasks.0.rollout.engine: sglang_jax runs Qwen3-MoE (4 experts, top 2) {expected}; "
                               f"use rollout.engine: jax_sampler (the built-in sampler) (model: {model}/config.json)")
    _check(tmp_path, preset="tiny-qwen3moe", path=model, engine="jax_sampler")


def test_the_config_check_imports_neither_sglang_nor_jax():
    code = ("import sys, rlsched.config.meshes, workers.rollout.sglang_compat as C; C.check_family('qwen2'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'sgl_jax', 'flax')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr[-2000:]


# ---- the installed sglang-jax ----------------------------------------------------------------------------------

STOP = 258  # <|im_end|> in the byte tokenizer
PROMPTS = [[72, 105], [50, 43, 50, 61], [1], list(range(60, 90))]
ENGINE_KW = dict(max_prompt_len=32, max_new_tokens=16, max_batch_size=16)


@pytest.mark.sglang
def test_the_families_table_is_the_installed_registry():
    """Every rlsched family whose architecture the installed sglang-jax registers, and no other, is in
    SGLANG_CLASSES, under the class of the family's own module (sgl_jax/srt/models/<family>.py)."""
    sglang_compat.apply_shims()  # its attention backend does not import without the first shim
    from sgl_jax.srt.models.registry import ModelRegistry

    from workers.models.config import SUPPORTED_MODEL_TYPES, family

    registered = ModelRegistry.models
    runs = {f: family(f).architecture for f in SUPPORTED_MODEL_TYPES if family(f).architecture in registered}
    assert runs == sglang_compat.SGLANG_CLASSES
    assert {f: registered[c].__module__ for f, c in runs.items()} == {f: f"sgl_jax.srt.models.{f}" for f in runs}


@pytest.fixture(scope="module", params=["tiny-qwen2", "tiny-qwen3moe"])
def family_model_dir(request, tmp_path_factory):
    """A tiny random model of the family, peaked (std 0.2) so that greedy decoding has no near-ties."""
    from workers.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / request.param, preset=request.param, seed=0,
                      initializer_range=0.2)


@pytest.mark.sglang
def test_greedy_output_equals_the_built_in_sampler(ray_session, family_model_dir):
    """After a weight update (checksum verified), sglang-jax decodes the family's model token for token as
    the built-in sampler does: fp32, tied head, peaked weights."""
    import ray

    from workers.models import load_pretrained
    from workers.models import params as P
    from workers.rollout import SamplingParams
    from workers.rollout.jax_sampler import JaxSampler
    from workers.rollout.sglang_jax import SglangJaxEngine

    model, _ = load_pretrained(family_model_dir)
    flat = P.host_params(model)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(STOP,))
    actor = ray.remote(SglangJaxEngine).options(num_cpus=0).remote(str(family_model_dir), seed=0, **ENGINE_KW)
    try:
        ray.get(actor.update_weights.remote(flat, 1, checksum=P.checksum(flat)))
        out = ray.get(actor.generate.remote(PROMPTS, greedy))
        # Offloaded and back: the same weights (hashed from the device) and the same tokens.
        ray.get(actor.offload.remote())
        ray.get(actor.onload.remote())
        again = ray.get(actor.generate.remote(PROMPTS, greedy))
        checksum = ray.get(actor.__ray_call__.remote(lambda e: e.weight_checksum))
    finally:
        ray.kill(actor)
    ref = JaxSampler(model, **ENGINE_KW).generate(PROMPTS, greedy)
    tokens = [s.token_ids.tolist() for s in out.samples]
    assert tokens == [s.token_ids.tolist() for s in ref.samples]
    assert [s.finish_reason for s in out.samples] == [s.finish_reason for s in ref.samples]
    assert [s.token_ids.tolist() for s in again.samples] == tokens and checksum == P.checksum(flat)


# ---- the families' shims: each defect in the installed version without its shim -------------------------------

START = """
import os
from workers.rollout.sglang_jax import SglangJaxEngine
e = SglangJaxEngine({path!r}, max_prompt_len=32, max_new_tokens=16, max_batch_size=16)
"""
LEAF_DTYPE = """
print(dict(zip(e._names, (str(x.dtype) for x in e._leaves)))[{name!r}]); os._exit(0)
"""


def _run_without(shim: str, code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "RLSCHED_SGLANG_SKIP_SHIMS": shim, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.sglang
def test_defect_moe_single_device_routing(tmp_path):
    from workers.models import init_model

    path = init_model(tmp_path / "moe", preset="tiny-qwen3moe", seed=0)
    code = START.format(path=str(path)) + """
from workers.rollout import SamplingParams
e.generate([[1, 2]], SamplingParams(temperature=0.0, max_new_tokens=2))
print("generated"); os._exit(0)
"""
    r = _run_without("moe_single_device_routing", code)
    assert "generated" not in r.stdout and "missing 1 required positional argument: 'top_k_weights'" in r.stderr, \
        r.stderr[-2000:]
    r = _run_without("", code)
    assert r.returncode == 0 and r.stdout.strip() == "generated", r.stderr[-2000:]


@pytest.mark.sglang
def test_defect_moe_gate_dtype(tmp_path):
    from workers.models import init_model

    path = init_model(tmp_path / "moe", preset="tiny-qwen3moe", seed=0, dtype="bfloat16")
    code = START.format(path=str(path)) + LEAF_DTYPE.format(name="model.layers.1.mlp.gate.kernel")
    r = _run_without("moe_gate_dtype", code)
    assert r.returncode == 0 and r.stdout.strip() == "float32", r.stderr[-2000:]
    r = _run_without("", code)
    assert r.returncode == 0 and r.stdout.strip() == "bfloat16", r.stderr[-2000:]


@pytest.mark.sglang
@pytest.mark.parametrize("preset", ["small-qwen2", "small-qwen3moe"])  # small: lm_head not tied
def test_defect_lm_head_dtype_in_every_family(tmp_path, preset):
    from workers.models import init_model

    path = init_model(tmp_path / preset, preset=preset, seed=0)
    code = START.format(path=str(path)) + LEAF_DTYPE.format(name="lm_head.kernel")
    r = _run_without("lm_head_dtype", code)
    assert r.returncode == 0 and r.stdout.strip() == "bfloat16", r.stderr[-2000:]
    r = _run_without("", code)
    assert r.returncode == 0 and r.stdout.strip() == "float32", r.stderr[-2000:]
