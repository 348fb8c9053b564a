"""Our Flax Qwen3 against transformers' Qwen3ForCausalLM (torch CPU) on the same weights."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers import Qwen3Config as HFQwen3Config

from workers.models import Qwen3Config, load_pretrained, save_pretrained
from workers.models.checkpoint import abstract_model

# Each config exercises a different piece: tying, rope_theta, head_dim != hidden / heads, GQA ratio.
CONFIGS = {
    "tied_theta1e4_gqa2": dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e4,
                               tie_word_embeddings=True),
    "untied_theta1e6_headdim128": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                       rope_theta=1e6, tie_word_embeddings=False),
    "untied_theta5e5_gqa3_bias": dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, rope_theta=5e5,
                                      tie_word_embeddings=False, attention_bias=True),
}


def _hf_reference(path, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_saved_model(request, tmp_path_factory):
    """A checkpoint written by transformers itself (its own random init), so loading is tested too."""
    torch.manual_seed(0)
    cfg = HFQwen3Config(**CONFIGS[request.param], initializer_range=0.1, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF inits norms to 1; perturb them so a mis-wired norm cannot hide.
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf") / request.param
    model.save_pretrained(path)
    return path, model.eval()


def test_fp32_logits_match_transformers(hf_saved_model):
    path, hf = hf_saved_model
    model, _ = load_pretrained(path, with_tokenizer=False)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(3, 37)).astype(np.int32)
    ours = np.asarray(model(jnp.asarray(ids)))
    assert ours.dtype == np.float32 and ours.shape == (3, 37, model.config.vocab_size)
    np.testing.assert_allclose(ours, _hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_config_is_read_not_assumed(hf_saved_model):
    path, hf = hf_saved_model
    model, _ = load_pretrained(path, with_tokenizer=False)
    assert model.config.rope_theta == hf.config.rope_parameters["rope_theta"]
    assert model.config.head_dim == hf.config.head_dim
    assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings


def test_left_padded_batch_with_positions_matches_unpadded(hf_saved_model):
    """The sampler's calling convention: left padding + per-row positions gives each row's own logits."""
    path, hf = hf_saved_model
    model, _ = load_pretrained(path, with_tokenizer=False)
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, model.config.vocab_size, size=n).astype(np.int32) for n in (5, 12, 9)]
    width = 12
    ids = np.zeros((3, width), np.int32)
    mask = np.zeros((3, width), bool)
    for r, row in enumerate(rows):
        ids[r, width - len(row):], mask[r, width - len(row):] = row, True
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    padded = np.asarray(model(jnp.asarray(ids), positions=jnp.asarray(positions), attention_mask=jnp.asarray(mask)))
    for r, row in enumerate(rows):
        ref = _hf_logits(hf, row[None])[0]
        np.testing.assert_allclose(padded[r, width - len(row):], ref, atol=1e-4, rtol=0)


def test_bf16_tracks_transformers_bf16(hf_saved_model):
    path, _ = hf_saved_model
    model, _ = load_pretrained(path, dtype="bfloat16", with_tokenizer=False)
    assert model.model.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
    hf = _hf_reference(path, dtype=torch.bfloat16)
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, size=(2, 16)).astype(np.int32)
    ours = np.asarray(model(jnp.asarray(ids)))
    ref = _hf_logits(hf, ids)
    assert ours.dtype == np.float32
    # bf16 has an 8-bit mantissa: both sides round differently, so compare against the logits' scale
    # and require the ranking of the top token to agree almost everywhere.
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 0.05 * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_round_trip_and_transformers_loads_ours(name, tmp_path):
    cfg = Qwen3Config(**CONFIGS[name], max_position_embeddings=512, initializer_range=0.1)
    model = abstract_model(cfg, seed=3)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, size=(2, 11)).astype(np.int32)
    before = np.asarray(model(jnp.asarray(ids)))
    path = save_pretrained(model, tmp_path / "ckpt")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    reloaded, _ = load_pretrained(path, with_tokenizer=False)
    np.testing.assert_array_equal(np.asarray(reloaded(jnp.asarray(ids))), before)
    hf = _hf_reference(path)
    np.testing.assert_allclose(_hf_logits(hf, ids), before, atol=1e-4, rtol=0)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3"


def test_init_model_loads_offline_in_transformers(tiny_model_dir, tiny_model):
    model, tok = tiny_model
    hf = _hf_reference(tiny_model_dir)
    hf_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Q: 17 + 25 = ?\nA:"
    assert hf_tok.encode(text) == tok.encode(text)
    assert hf_tok.decode(tok.encode(text)) == text
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.pad_token == "<|endoftext|>"
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = np.array([tok.encode(text)], np.int32)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), _hf_logits(hf, ids), atol=1e-4, rtol=0)
    # In the form transformers 4.x reads too (the sglang environment's 4.55 failed on 5.x's list-valued
    # `extra_special_tokens` with "'list' object has no attribute 'keys'"), so one directory serves both.
    cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert "extra_special_tokens" not in cfg and cfg["additional_special_tokens"] == ["<|im_start|>"]
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
