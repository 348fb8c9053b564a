"""Model presets for `rlsched init-model`: random Qwen3 models built locally, with a tokenizer.

head_dim is 128 in every preset: sglang-jax's CPU path only handles that head size, and keeping it
lets one checkpoint serve both rollout backends.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from workers.models.config import Qwen3Config
from workers.models.tokenizer import write_tokenizer

PRESETS: dict[str, dict] = {
    # ~0.2M params: unit tests and the CI demo compile and run in seconds.
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=128, rope_theta=10_000.0, tie_word_embeddings=True,
                 max_position_embeddings=4096),
    # ~4.5M params: benchmarks, and the synthetic tasks a model learns from scratch.
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, rope_theta=1_000_000.0, tie_word_embeddings=False,
                  max_position_embeddings=4096),
}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def init_model(out_dir: str | Path, *, preset: str = "tiny", tokenizer: str = "byte", seed: int = 0,
               dtype: str = "float32", initializer_range: float = 0.02) -> Path:
    """Create a random Qwen3 of `preset` plus a `tokenizer` ("byte" or "qwen3") in out_dir."""
    from workers.models.checkpoint import abstract_model, save_pretrained  # JAX: only where a model is made

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out_dir = Path(out_dir)
    staging = out_dir.with_name(f".{out_dir.name}.tokenizer")
    staging.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(tokenizer, staging)
    cfg = Qwen3Config(
        # Embedding rows in multiples of 128 (as Qwen3 pads 151,669 tokens to 151,936) for aligned matmuls.
        vocab_size=_round_up(len(tok), 128), dtype=dtype, initializer_range=initializer_range,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **PRESETS[preset])
    try:
        return save_pretrained(abstract_model(cfg, seed), out_dir, tokenizer=tok)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
