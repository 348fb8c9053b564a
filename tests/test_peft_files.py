"""PEFT's adapter files and the merged model (workers/models/peft_files.py), against peft and transformers (torch
CPU) as the references: peft loads save_adapter's directory onto transformers' base with the logits transformers
gives for save_merged's directory and rlsched's decoder gives for it (1e-4), on a Qwen3 (q, v, o, down) and a Qwen2
with biases (q, k, v, o); the file's tensor names and shapes are the ones peft's own state dict has; an adapter
saved by peft itself loads and merges to peft's logits; bad directories are refused naming the problem, and a
failed write leaves no directory behind (or the old one unchanged)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

from workers.models import ModelConfig, init_model, load_pretrained
from workers.models import peft_files as pf
from workers.models.lora import LoraSpec, adapter_shapes
from workers.models.peft_files import AdapterError, load_adapter, save_adapter, save_merged

CASES = {"tiny": ("q", "v", "o", "down"), "tiny-qwen2": ("q", "k", "v", "o")}


def _ids() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 259, (2, 12))  # byte tokens and the special ones


def _torch_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def _random_adapter(cfg: ModelConfig, spec: LoraSpec, seed: int = 0) -> dict[str, np.ndarray]:
    """A and B both non-zero (std 0.2, as the tiny bases' weights): a trained adapter, not a fresh one (B = 0)."""
    rng = np.random.default_rng(seed)
    return {name: rng.normal(0.0, 0.2, shape).astype(np.float32) for name, shape in adapter_shapes(cfg, spec).items()}


@pytest.fixture(scope="module")
def base_dirs(tiny_model_dir, tmp_path_factory):
    qwen2 = init_model(tmp_path_factory.mktemp("peft") / "tiny-qwen2", preset="tiny-qwen2", seed=0,
                       initializer_range=0.2)
    return {"tiny": tiny_model_dir, "tiny-qwen2": qwen2}


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, base_dirs, tmp_path_factory):
    """One adapter per preset, saved both ways, with every side's logits of the same ids."""
    preset = request.param
    base = base_dirs[preset]
    cfg = ModelConfig.from_dir(base)
    spec = LoraSpec(rank=4, alpha=8, targets=CASES[preset])
    adapter = _random_adapter(cfg, spec)
    out = tmp_path_factory.mktemp(f"export-{preset}")
    adapter_dir = save_adapter(out / "adapter", adapter, spec, cfg, base_model=str(base))
    merged_dir = save_merged(out / "merged", base, adapter, spec)
    ids = _ids()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)
    peft_model.eval()
    ours, _ = load_pretrained(merged_dir, with_tokenizer=False)
    return dict(preset=preset, base=base, cfg=cfg, spec=spec, adapter=adapter, adapter_dir=adapter_dir,
                merged_dir=merged_dir, peft_model=peft_model, load_warnings=caught,
                peft=_torch_logits(peft_model, ids),
                merged=_torch_logits(AutoModelForCausalLM.from_pretrained(merged_dir), ids),
                base_logits=_torch_logits(AutoModelForCausalLM.from_pretrained(base), ids),
                ours=np.asarray(ours(ids)))


def test_peft_on_the_base_equals_the_merged_model(exported):
    np.testing.assert_allclose(exported["peft"], exported["merged"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(exported["ours"], exported["merged"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(exported["ours"], exported["peft"], atol=1e-4, rtol=0)
    # Not a no-op: logits of the tiny bases are O(1-10), an adapter of this size moves them by whole units.
    assert np.abs(exported["peft"] - exported["base_logits"]).max() > 0.5


def test_peft_loads_it_without_complaint(exported):
    complaints = [str(w.message) for w in exported["load_warnings"] if issubclass(w.category, UserWarning)]
    assert complaints == []  # peft warns (UserWarning) of missing or unexpected adapter keys and config fields
    config = peft.PeftConfig.from_pretrained(exported["adapter_dir"])
    assert (config.peft_type, config.task_type, config.r, config.lora_alpha) == ("LORA", "CAUSAL_LM", 4, 8)
    assert set(config.target_modules) == {pf.HF_NAMES[t] for t in exported["spec"].targets}
    assert (config.lora_dropout, config.bias, config.fan_in_fan_out, config.inference_mode) == (0.0, "none", False,
                                                                                               True)
    assert config.base_model_name_or_path == str(exported["base"])


def test_the_file_has_peft_s_own_names_and_shapes(exported):
    """peft's state dict of the loaded model is the reference: same names, shapes, and values (lora_A = lora_a.T)."""
    reference = peft.get_peft_model_state_dict(exported["peft_model"])
    with safe_open(str(exported["adapter_dir"] / pf.ADAPTER_WEIGHTS), "np") as f:
        ours = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in reference.items()}
    for name, tensor in reference.items():
        np.testing.assert_array_equal(ours[name], tensor.numpy())
    module = "model.layers.1.self_attn.v_proj"
    np.testing.assert_array_equal(ours[f"base_model.model.{module}.lora_A.weight"],
                                  exported["adapter"][f"{module}.lora_a"].T)


def test_load_adapter_round_trips_exactly(exported):
    for cfg in (None, exported["cfg"]):
        adapter, spec = load_adapter(exported["adapter_dir"], cfg)
        assert spec == exported["spec"] and spec.targets == exported["spec"].targets
        assert adapter.keys() == exported["adapter"].keys()
        for name, value in exported["adapter"].items():
            assert adapter[name].dtype == value.dtype
            np.testing.assert_array_equal(adapter[name], value)


def test_an_adapter_saved_by_peft_loads_and_merges_to_peft_s_logits(base_dirs, tmp_path):
    base = base_dirs["tiny-qwen2"]
    torch.manual_seed(0)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=["k_proj", "o_proj", "up_proj"], lora_dropout=0.0, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)  # peft initialises B to zero: make it do something
    model.eval()
    model.save_pretrained(tmp_path / "by_peft")
    adapter, spec = load_adapter(tmp_path / "by_peft", ModelConfig.from_dir(base))
    assert (spec.rank, spec.alpha, sorted(spec.targets)) == (4, 16, ["k", "o", "up"])
    state = dict(model.named_parameters())
    a = state["base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight"].detach().numpy()
    np.testing.assert_array_equal(adapter["model.layers.0.mlp.up_proj.lora_a"], a.T)
    merged_dir = save_merged(tmp_path / "merged", base, adapter, spec)
    ids = _ids()
    expected = _torch_logits(model, ids)
    assert np.abs(expected - _torch_logits(AutoModelForCausalLM.from_pretrained(base), ids)).max() > 0.5
    np.testing.assert_allclose(_torch_logits(AutoModelForCausalLM.from_pretrained(merged_dir), ids), expected,
                               atol=1e-4, rtol=0)


# ---- errors -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_adapter(base_dirs, tmp_path_factory):
    """A saved adapter to spoil, copied per test."""
    cfg = ModelConfig.from_dir(base_dirs["tiny"])
    spec = LoraSpec(rank=2, alpha=4, targets=("q", "v"))
    adapter = _random_adapter(cfg, spec, seed=3)
    return cfg, spec, adapter, save_adapter(tmp_path_factory.mktemp("small") / "adapter", adapter, spec, cfg,
                                            base_model="tiny")


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_a_directory_without_adapter_config_is_refused(small_adapter, tmp_path):
    d = _copy(small_adapter[3], tmp_path / "a")
    (d / pf.ADAPTER_CONFIG).unlink()
    with pytest.raises(AdapterError, match=r"has no adapter_config\.json"):
        load_adapter(d)
    with pytest.raises(AdapterError, match="does not exist"):
        load_adapter(tmp_path / "nowhere")
    d = _copy(small_adapter[3], tmp_path / "b")
    (d / pf.ADAPTER_WEIGHTS).unlink()
    with pytest.raises(AdapterError, match=r"has no adapter_model\.safetensors"):
        load_adapter(d)


def test_a_non_lora_adapter_is_refused(base_dirs, tmp_path):
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base_dirs["tiny"]), peft.IA3Config(
        target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"], task_type="CAUSAL_LM"))
    model.save_pretrained(tmp_path / "ia3")
    with pytest.raises(AdapterError, match=r"peft_type is 'IA3'; rlsched reads LoRA adapters only"):
        load_adapter(tmp_path / "ia3")


def test_options_rlsched_cannot_express_are_refused_by_name(small_adapter, tmp_path):
    for key, value in (("use_dora", True), ("use_rslora", True), ("rank_pattern", {"q_proj": 8}), ("bias", "all")):
        d = _copy(small_adapter[3], tmp_path / key)
        config = json.loads((d / pf.ADAPTER_CONFIG).read_text())
        (d / pf.ADAPTER_CONFIG).write_text(json.dumps(config | {key: value}))
        with pytest.raises(AdapterError, match=key):
            load_adapter(d)


def test_a_tensor_of_the_wrong_shape_is_named(small_adapter, tmp_path):
    cfg, spec, adapter, saved = small_adapter
    d = _copy(saved, tmp_path / "a")
    with safe_open(str(d / pf.ADAPTER_WEIGHTS), "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    bad = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    tensors[bad] = tensors[bad][:1]  # rank 1 where the config says r = 2
    save_file(tensors, str(d / pf.ADAPTER_WEIGHTS))
    with pytest.raises(AdapterError, match=rf"tensor {bad} has shape \(1, 64\); with r = 2 .* must be \(r, in\)"):
        load_adapter(d)
    # The ranks agree but the model's projection is another size: named when the model's config is given.
    other = cfg.replace(hidden_size=32)
    with pytest.raises(AdapterError, match=r"does not fit the model: .*q_proj\.lora_a has shape \(64, 2\)"):
        load_adapter(saved, other)
    wrong = dict(adapter) | {"model.layers.0.self_attn.q_proj.lora_b": np.zeros((2, 7), np.float32)}
    with pytest.raises(AdapterError, match=r"q_proj\.lora_b has shape \(2, 7\).* needs \(2, 256\)"):
        save_adapter(tmp_path / "out", wrong, spec, cfg, base_model="tiny")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_failed_write_leaves_no_directory(small_adapter, tmp_path, monkeypatch):
    cfg, spec, adapter, _ = small_adapter
    lacking = {k: v for k, v in adapter.items() if k != "model.layers.1.self_attn.v_proj.lora_b"}
    with pytest.raises(AdapterError, match=r"missing tensors \['model\.layers\.1\.self_attn\.v_proj\.lora_b'\]"):
        save_adapter(tmp_path / "out", lacking, spec, cfg, base_model="tiny")
    assert list(tmp_path.iterdir()) == []  # neither out nor a temporary sibling

    def full_disk(tensors, filename, metadata=None):  # half a file written, then the disk is full
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pf, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_adapter(tmp_path / "out", adapter, spec, cfg, base_model="tiny")
    assert list(tmp_path.iterdir()) == []
    # Over an existing adapter: the old one stays, whole.
    monkeypatch.undo()
    save_adapter(tmp_path / "out", adapter, spec, cfg, base_model="tiny")
    before = {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()}
    monkeypatch.setattr(pf, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_adapter(tmp_path / "out", {k: v * 2 for k, v in adapter.items()}, spec, cfg, base_model="tiny")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()} == before


def test_save_merged_checks_the_adapter_before_writing(small_adapter, base_dirs, tmp_path):
    _, spec, adapter, _ = small_adapter
    # An adapter of the Qwen3 base (hidden 64, q out 256) on the Qwen2 base (q out 64): refused, nothing written.
    with pytest.raises(AdapterError, match=r"q_proj\.lora_b has shape \(2, 256\)"):
        save_merged(tmp_path / "merged", base_dirs["tiny-qwen2"], adapter, spec)
    assert list(tmp_path.iterdir()) == []


def test_adapter_files_are_written_and_read_without_jax_or_torch(small_adapter, base_dirs, tmp_path):
    """A process that holds only an adapter's arrays (a driver, an export) needs no framework for its files."""
    code = (f"import sys; from workers.models import ModelConfig; from workers.models.peft_files import *\n"
            f"adapter, spec = load_adapter({str(small_adapter[3])!r})\n"
            f"save_adapter({str(tmp_path / 'out')!r}, adapter, spec, ModelConfig.from_dir({str(base_dirs['tiny'])!r}),"
            f" base_model='tiny')\n"
            "print(sorted(m for m in ('jax', 'flax', 'torch', 'peft', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert load_adapter(tmp_path / "out")[1] == small_adapter[1]
