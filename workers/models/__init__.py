"""Decoder LMs (Qwen3, Qwen2 / Qwen2.5, Qwen3-MoE) in Flax NNX with Hugging Face checkpoints.

    from workers.models import load_pretrained
    model, tokenizer = load_pretrained("runs/demo/model")
    logits = model(input_ids)  # int32 (B, T) -> float32 (B, T, V)

Names are imported on first use (PEP 562): a task's driver reads a tokenizer or a model config from
here without importing JAX, which only the processes that hold weights may start.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "load_pretrained": "checkpoint", "read_safetensors": "checkpoint", "save_pretrained": "checkpoint",
    "ModelConfig": "config", "ModelConfigError": "config", "Qwen3Config": "config",
    "Qwen2Config": "qwen2", "Qwen3MoeConfig": "qwen3_moe",
    "PRESETS": "presets", "init_model": "presets", "preset_config": "presets",
    "CausalLM": "decoder",
    "TokenizerError": "tokenizer", "load_tokenizer": "tokenizer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'workers.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"workers.models.{_WHERE[name]}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value
