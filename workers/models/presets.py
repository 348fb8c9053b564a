"""Model presets for `rlsched init-model`: random models of each family built locally, with a tokenizer.

    tiny, small                 Qwen3 (the benchmarks' models)
    tiny-digits, small-digits   Qwen3 of tiny's / small's shapes over the 16-token digits tokenizer (the demo's
                                arithmetic models: an answer's end is 1 choice in 16, not 1 in 384)
    tiny-qwen2, small-qwen2     Qwen2 / Qwen2.5 (q/k/v biases, no q/k norm)
    tiny-qwen3moe, small-qwen3moe   Qwen3-MoE (tiny: 4 experts, top 2, layer 0 dense; small: 8 experts, top 2)
    qwen3-0.6b, qwen3-1.7b, qwen3-4b   the published Qwen3 shapes, random weights, the real tokenizer by default

head_dim is 128 in the Qwen3 presets: sglang-jax's CPU path only handles that head size, and keeping it
lets one checkpoint serve both rollout backends.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from workers.models.config import ModelConfig, family

PRESETS: dict[str, dict] = {
    # ~0.2M params: unit tests and the CI demo compile and run in seconds.
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=128, rope_theta=10_000.0, tie_word_embeddings=True,
                 max_position_embeddings=4096),
    # ~4.5M params: benchmarks, and the synthetic tasks a model learns from scratch.
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, rope_theta=1_000_000.0, tie_word_embeddings=False,
                  max_position_embeddings=4096),
    # The arithmetic demo's models: tiny's and small's shapes over the digits tokenizer (PRESET_TOKENIZERS).
    "tiny-digits": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=128, rope_theta=10_000.0, tie_word_embeddings=True,
                        max_position_embeddings=4096),
    "small-digits": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=128, rope_theta=1_000_000.0, tie_word_embeddings=False,
                         max_position_embeddings=4096),
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, rope_theta=10_000.0,
                       tie_word_embeddings=True, max_position_embeddings=4096),
    "small-qwen2": dict(model_type="qwen2", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=1_000_000.0,
                        tie_word_embeddings=False, max_position_embeddings=4096),
    "tiny-qwen3moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=128, rope_theta=10_000.0,
                          tie_word_embeddings=True, max_position_embeddings=4096, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                          mlp_only_layers=(0,)),
    "small-qwen3moe": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=128, rope_theta=1_000_000.0,
                           tie_word_embeddings=False, max_position_embeddings=4096, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=192, norm_topk_prob=True),
}


# Random models of published shapes (workers.models.published: layers, widths, heads, the 151,936-row vocabulary),
# with the real Qwen3 tokenizer by default: every benchmark runs at a real size anywhere, nothing downloaded.
PUBLISHED_PRESETS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b")

# The tokenizer a preset gets when none is named; a preset not listed gets "byte".
PRESET_TOKENIZERS = {"tiny-digits": "digits", "small-digits": "digits", **dict.fromkeys(PUBLISHED_PRESETS, "qwen3")}


def preset_tokenizer(preset: str, tokenizer: str | None = None) -> str:
    """The tokenizer kind `init_model` writes for `preset`: `tokenizer` when given, else the preset's own."""
    return tokenizer or PRESET_TOKENIZERS.get(preset, "byte")


def vocab_rows(tokenizer: str, num_tokens: int) -> int:
    """Embedding rows of a preset model over `num_tokens` tokens of kind `tokenizer`: byte's 259 in multiples of
    128 (384, as Qwen3 pads 151,669 tokens to 151,936) for aligned matmuls; digits' 16 as they are, since every
    padding row is one more choice a random policy makes in place of the end token."""
    return num_tokens if tokenizer == "digits" else _round_up(num_tokens, 128)


def preset_vocab_size(preset: str, tokenizer: str | None = None) -> int:
    """`vocab_rows` of a preset (not a published one) without writing its tokenizer."""
    from workers.models.tokenizer import BYTE_VOCAB_SIZE, DIGITS_VOCAB_SIZE, TokenizerError

    kind = preset_tokenizer(preset, tokenizer)
    sizes = {"byte": BYTE_VOCAB_SIZE, "digits": DIGITS_VOCAB_SIZE}
    if kind not in sizes:
        raise TokenizerError(f"preset {preset!r} with the {kind} tokenizer has its published vocabulary; "
                             "preset_vocab_size is for the byte and digits tokenizers")
    return vocab_rows(kind, sizes[kind])


def preset_config(preset: str, **fields) -> ModelConfig:
    """The config of `preset` (its family's class), with `fields` (vocab_size, dtype, ...) set."""
    if preset in PUBLISHED_PRESETS:
        from workers.models.published import published_config

        return published_config(preset).replace(**fields)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS) + list(PUBLISHED_PRESETS)}")
    spec = dict(PRESETS[preset])
    return family(spec.pop("model_type", "qwen3"))(**spec, **fields)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def init_model(out_dir: str | Path, *, preset: str = "tiny", tokenizer: str | None = None, seed: int = 0,
               dtype: str = "float32", initializer_range: float = 0.02) -> Path:
    """Create a random model of `preset` plus a `tokenizer` ("byte", "digits" or "qwen3"; None: the preset's own,
    `preset_tokenizer`) in out_dir."""
    # JAX only where a model is made; transformers (~1 s of CPU) only where a tokenizer is written: an actor
    # imports this module for init_model but calls it only when its preset model is missing.
    from workers.models.checkpoint import abstract_model, save_pretrained
    from workers.models.tokenizer import write_tokenizer

    published = preset in PUBLISHED_PRESETS
    if not published and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS) + list(PUBLISHED_PRESETS)}")
    tokenizer = preset_tokenizer(preset, tokenizer)
    out_dir = Path(out_dir)
    staging = out_dir.with_name(f".{out_dir.name}.tokenizer")
    staging.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(tokenizer, staging)
    if published and len(tok) > preset_config(preset).vocab_size:
        raise ValueError(f"the {tokenizer} tokenizer has {len(tok)} tokens, more than {preset}'s vocabulary")
    # The published shapes keep their own vocabulary.
    vocab = {} if published else {"vocab_size": vocab_rows(tokenizer, len(tok))}
    cfg = preset_config(preset, **vocab, dtype=dtype, initializer_range=initializer_range,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    try:
        return save_pretrained(abstract_model(cfg, seed), out_dir, tokenizer=tok)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
