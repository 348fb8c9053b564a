"""Qwen3 in Flax NNX with Hugging Face checkpoints.

    from workers.models import load_pretrained
    model, tokenizer = load_pretrained("runs/demo/model")
    logits = model(input_ids)  # int32 (B, T) -> float32 (B, T, V)
"""

from workers.models.checkpoint import load_pretrained, read_safetensors, save_pretrained
from workers.models.config import ModelConfigError, Qwen3Config
from workers.models.presets import PRESETS, init_model
from workers.models.qwen3 import Qwen3ForCausalLM
from workers.models.tokenizer import TokenizerError, load_tokenizer

__all__ = [
    "PRESETS", "ModelConfigError", "Qwen3Config", "Qwen3ForCausalLM", "TokenizerError",
    "init_model", "load_pretrained", "load_tokenizer", "read_safetensors", "save_pretrained",
]
