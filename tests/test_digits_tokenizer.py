"""The digits tokenizer and the presets over it: ids by hand, a round trip through the files transformers reads, and a
model whose embedding has one row per token (no padding rows a random policy could pick in place of the end)."""

from __future__ import annotations

import json

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.models import load_pretrained
from workers.models.tokenizer import load_tokenizer, write_tokenizer

# The vocabulary's order: <|endoftext|> 0, <|im_end|> 1, <unk> 2, '0'-'9' 3-12, '+' 13, '-' 14, '=' 15.
IDS = {"pad": 0, "eos": 1, "unk": 2, **{str(d): 3 + d for d in range(10)}, "+": 13, "-": 14, "=": 15}


def test_digits_round_trip_through_its_files(tmp_path):
    write_tokenizer("digits", tmp_path)
    for tok in (load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)):
        assert len(tok) == 16
        assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
        assert tok.encode("12+7=19") == [IDS[c] for c in "12+7=19"] == [4, 5, 13, 10, 15, 4, 12]
        assert tok.encode("9-3=6") == [12, 14, 6, 15, 9]
        assert tok.decode(tok.encode("18-9=9")) == "18-9=9"  # characters joined, no spaces between them
        # An answer then the end (or the padding) decodes to the answer alone, as completions are scored.
        assert tok.decode([IDS["7"], IDS["eos"], IDS["pad"]], skip_special_tokens=True) == "7"
        assert tok.encode("3 x") == [IDS["3"], IDS["unk"], IDS["unk"]]  # outside the alphabet: <unk>, not dropped


def test_digits_preset_has_one_row_per_token(tmp_path):
    from rlsched.config.meshes import read_model_config
    from rlsched.config.schema import TaskConfig
    from workers.models.presets import init_model

    path = init_model(tmp_path / "m", preset="tiny-digits")
    config = json.loads((path / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"], config["pad_token_id"]) == (16, 1, 0)
    model, tok = load_pretrained(path)
    ids = np.asarray([tok.encode("3+5=")], np.int32)
    ours = np.asarray(model(ids))
    assert ours.shape == (1, 4, 16)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
    # What `rlsched check` / `plan` count before the model exists: 16 rows here, the byte tokenizer's 384 for tiny.
    for preset, rows in (("tiny-digits", 16), ("small-digits", 16), ("tiny", 384)):
        model = {"path": str(tmp_path / "absent"), "init_preset": preset}
        task = TaskConfig.model_validate({"name": "t", "model": model, "data": {"kind": "addition"},
                                          "reward": {"name": "addition"}, "steps": 1})
        assert read_model_config(task, 0).vocab_size == rows
