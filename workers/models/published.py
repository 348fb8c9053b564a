"""The shapes of published Qwen models, from their Hugging Face config.json: a plan without the weights.

    cfg = published_config("qwen3-1.7b")          # a ModelConfig, as ModelConfig.from_dir would read it
    match_name("/models/Qwen2.5-7B-Instruct")     # "qwen2.5-7b": a directory named like a published model

`rlsched check` uses this where a task's model directory is absent (a fresh clone of a recipe): its meshes, its
positions and its bytes per device follow from these numbers alone. Only the keys that shape a model are here,
copied from each model's config.json on the Hugging Face hub (Qwen/<name>), and nothing is downloaded.

- Qwen3 dense: head_dim 128 whatever the width; 0.6B, 1.7B and 4B tie the embeddings, 8B and up do not.
- Qwen3-30B-A3B: 128 experts of width 768, 8 per token, in every layer.
- Qwen2.5: head_dim = hidden / heads, q/k/v biases (the family's); 7B has a vocabulary of 152,064, the smaller
  ones 151,936; 0.5B, 1.5B and 3B tie the embeddings. max_position_embeddings is the Instruct models' 32,768
  (the base 1.5B and 7B configs say 131,072): the smaller, so a check that passes here passes for both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.models.config import ModelConfig

_QWEN3 = {"model_type": "qwen3", "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
          "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16"}
_QWEN2P5 = {"model_type": "qwen2", "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-06, "use_sliding_window": False, "torch_dtype": "bfloat16"}


def _dense(family: dict[str, Any], hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
           tied: bool, **more: Any) -> dict[str, Any]:
    return {**family, "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "tie_word_embeddings": tied, **more}


# name -> config.json's shaping keys. hidden, intermediate, layers, heads, KV heads, tied embeddings.
PUBLISHED: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": _dense(_QWEN3, 1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _dense(_QWEN3, 2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _dense(_QWEN3, 2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _dense(_QWEN3, 4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _dense(_QWEN3, 5120, 17408, 40, 40, 8, False),
    "qwen3-32b": _dense(_QWEN3, 5120, 25600, 64, 64, 8, False),
    "qwen3-30b-a3b": _dense(_QWEN3, 2048, 6144, 48, 32, 4, False, model_type="qwen3_moe", num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen2.5-0.5b": _dense(_QWEN2P5, 896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": _dense(_QWEN2P5, 1536, 8960, 28, 12, 2, True),
    "qwen2.5-3b": _dense(_QWEN2P5, 2048, 11008, 36, 16, 2, True),
    "qwen2.5-7b": _dense(_QWEN2P5, 3584, 18944, 28, 28, 4, False, vocab_size=152064),
}
_SUFFIXES = ("-instruct", "-base")  # the same shapes as the name without them


class UnknownModelError(ValueError):
    """A name that is not in the table; the message lists the names that are."""


def published_config(name: str) -> ModelConfig:
    """The ModelConfig of published model `name` (case-insensitive, e.g. "Qwen3-1.7B", "qwen2.5-7b-instruct")."""
    key = _normal(name)
    if key not in PUBLISHED:
        raise UnknownModelError(f"no published shapes for {name!r}; known: {', '.join(PUBLISHED)}")
    return ModelConfig.from_hf_dict(PUBLISHED[key], source=f"the published {key} shapes")


def match_name(path: str | Path) -> str | None:
    """The table's name for a directory named like a published model ("/models/Qwen3-1.7B" -> "qwen3-1.7b"), or None."""
    key = _normal(Path(path).name)
    return key if key in PUBLISHED else None


def _normal(name: str) -> str:
    key = name.strip().lower()
    for suffix in _SUFFIXES:
        key = key.removesuffix(suffix)
    return key
