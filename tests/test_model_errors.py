"""Bad model directories and tokenizers fail with errors that say what is wrong and how to fix it."""

from __future__ import annotations

import json
import shutil

import pytest

from workers.models import ModelConfigError, Qwen3Config, TokenizerError, load_pretrained


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_model_dir_points_at_init_model(tmp_path):
    with pytest.raises(ModelConfigError, match=r"does not exist; create a local one with `rlsched init-model"):
        load_pretrained(tmp_path / "nope")


def test_dir_without_config_is_not_a_model(tmp_path):
    with pytest.raises(ModelConfigError, match="has no config.json"):
        load_pretrained(tmp_path)


def test_non_qwen3_model_type_is_refused(tiny_model_dir, tmp_path):
    path = _copy(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="model_type 'llama' is not supported; rlsched implements qwen3"):
        load_pretrained(path)


def test_missing_weights_are_named(tiny_model_dir, tmp_path):
    path = _copy(tiny_model_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelConfigError, match="has no model.safetensors"):
        load_pretrained(path)


def test_unsupported_rope_scaling_is_an_error_not_an_approximation():
    raw = Qwen3Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, head_dim=8).to_hf_dict()
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    with pytest.raises(ModelConfigError, match="RoPE type 'yarn' is not implemented"):
        Qwen3Config.from_hf_dict(raw)


def test_gqa_heads_must_divide():
    with pytest.raises(ModelConfigError, match=r"num_attention_heads \(3\) must be a multiple of"):
        Qwen3Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=3,
                    num_key_value_heads=2, head_dim=8)


def test_tokenizer_without_eos_is_refused(tiny_model_dir, tmp_path):
    path = _copy(tiny_model_dir, tmp_path / "m")
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    tok_cfg["eos_token"] = None
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with pytest.raises(TokenizerError, match="has no EOS token, so generation could never stop"):
        load_pretrained(path)


def test_missing_tokenizer_is_named(tiny_model_dir, tmp_path):
    path = _copy(tiny_model_dir, tmp_path / "m")
    (path / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        load_pretrained(path)
    model, tok = load_pretrained(path, with_tokenizer=False)  # weights alone still load
    assert tok is None and model.config.vocab_size == 384
