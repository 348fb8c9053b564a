"""Model architecture hyper-parameters, read from and written to Hugging Face `config.json`: one class per
family, one base (`ModelConfig`) that every consumer uses.

    cfg = ModelConfig.from_dir("runs/demo/model")   # config.json's model_type picks the family
    cfg.param_shapes()                               # every parameter's flat name and shape, without JAX

Families (config.json `model_type` -> class): qwen3 -> Qwen3Config (here), qwen2 -> Qwen2Config
(workers.models.qwen2), qwen3_moe -> Qwen3MoeConfig (workers.models.qwen3_moe). A family is its config class
(what config.json says, which parameters exist and their shapes, which parts the decoder uses) plus rows in
the sharding table (workers.models.sharding) when it brings new parameters; the decoder
(workers.models.decoder.CausalLM) reads the parts from the config.

Design decisions:
- A frozen dataclass, not the transformers config class: the data plane must not depend on
  transformers' config internals, which change between major versions (v5 moved `rope_theta`
  into `rope_parameters`). We read both spellings and write both.
- Anything we do not implement (sliding windows, RoPE scaling) is an error at load time, never
  a silent approximation: a model that disagrees with its reference corrupts every reward curve.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, ClassVar

# model_type -> (module, class), imported on use: the control plane reads configs without importing JAX.
FAMILIES: dict[str, tuple[str, str]] = {
    "qwen3": ("workers.models.config", "Qwen3Config"),
    "qwen2": ("workers.models.qwen2", "Qwen2Config"),
    "qwen3_moe": ("workers.models.qwen3_moe", "Qwen3MoeConfig"),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
_DTYPES = ("float32", "bfloat16")


class ModelConfigError(ValueError):
    """A model directory or config.json that rlsched cannot use; the message says how to fix it."""


def family(model_type: str) -> type[ModelConfig]:
    """The config class of a model_type; ModelConfigError listing the supported ones otherwise."""
    import importlib

    if model_type not in FAMILIES:
        raise ModelConfigError(f"model_type {model_type!r} is not supported; rlsched implements "
                               f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    module, name = FAMILIES[model_type]
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer's hyper-parameters (the fields every family has) and the parts it is built
    of. Subclasses set `model_type`, `architecture` and the parts; `from_dir` returns the family's class."""

    model_type: ClassVar[str] = ""
    architecture: ClassVar[str] = ""
    qk_norm: ClassVar[bool] = True  # RMSNorm over each head's q and k before RoPE (Qwen3), or none (Qwen2)

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    # Independent of hidden_size // num_attention_heads in Qwen3 (e.g. 0.6B: 1024 / 16 = 64, head_dim 128).
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 40_960
    initializer_range: float = 0.02
    # Parameter storage dtype ("float32" or "bfloat16"); compute follows it, logits are always float32.
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"config.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"config.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"config.num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        if self.rope_theta <= 0:
            raise ModelConfigError(f"config.rope_theta must be > 0, got {self.rope_theta!r}")
        if self.dtype not in _DTYPES:
            raise ModelConfigError(f"config.dtype must be one of {_DTYPES}, got {self.dtype!r}")

    # ---- the parts the decoder is built of (a family overrides these) -----------------------------------

    def proj_bias(self, proj: str) -> bool:
        """Whether attention projection `proj` ("q", "k", "v", "o") has a bias."""
        return self.attention_bias

    def moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer`'s MLP is a mixture of experts (else dense, intermediate_size wide)."""
        return False

    def mlp_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """The MLP's parameters of one layer, by name under `model.layers.<layer>.mlp.`."""
        h, i = self.hidden_size, self.intermediate_size
        return {"gate_proj.kernel": (h, i), "up_proj.kernel": (h, i), "down_proj.kernel": (i, h)}

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's flat name (workers.models.params) and shape, without building the model: the
        control plane checks a mesh against these without importing JAX (a test holds them to the model's)."""
        h, v, d = self.hidden_size, self.vocab_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            out["lm_head.kernel"] = (h, v)
        for layer in range(self.num_hidden_layers):
            at = f"model.layers.{layer}"
            out |= {f"{at}.input_layernorm.weight": (h,), f"{at}.post_attention_layernorm.weight": (h,),
                    f"{at}.self_attn.q_proj.kernel": (h, q), f"{at}.self_attn.k_proj.kernel": (h, kv),
                    f"{at}.self_attn.v_proj.kernel": (h, kv), f"{at}.self_attn.o_proj.kernel": (q, h)}
            if self.qk_norm:
                out |= {f"{at}.self_attn.q_norm.weight": (d,), f"{at}.self_attn.k_norm.weight": (d,)}
            out |= {f"{at}.self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv), ("o", h))
                    if self.proj_bias(p)}
            out |= {f"{at}.mlp.{name}": shape for name, shape in self.mlp_shapes(layer).items()}
        return out

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for shape in self.param_shapes().values())

    def describe(self) -> str:
        """'Qwen3' / 'Qwen2' / 'Qwen3-MoE (8 experts, top 2)': how progress lines and errors name the family."""
        return self.architecture.removesuffix("ForCausalLM")

    # ---- Hugging Face config.json -------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """The family's config from config.json's contents (`model_type` picks the family, whatever `cls`)."""
        model_type = raw.get("model_type")
        try:
            fam = family(model_type)
        except ModelConfigError as err:
            raise ModelConfigError(
                f"{source}: {err}. Create a compatible model with `rlsched init-model --preset tiny DIR` "
                "(presets: rlsched init-model --help) or point at a checkpoint of a supported family.") from None
        if raw.get("use_sliding_window"):
            raise ModelConfigError(f"{source}: use_sliding_window=true is not implemented (every layer would "
                                   "attend to the whole sequence, unlike the checkpoint); set it to false")
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ModelConfigError(f"{source}: RoPE type {rope_type!r} is not implemented; only 'default' is")
        theta = rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        if dtype not in _DTYPES:
            raise ModelConfigError(f"{source}: dtype {dtype!r} is not supported; use one of {_DTYPES}")
        try:
            num_heads = raw["num_attention_heads"]
            return fam(
                vocab_size=raw["vocab_size"],
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=num_heads,
                num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
                head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
                rope_theta=float(theta),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                max_position_embeddings=raw.get("max_position_embeddings", 40_960),
                initializer_range=float(raw.get("initializer_range", 0.02)),
                dtype=dtype,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=raw.get("eos_token_id"),
                pad_token_id=raw.get("pad_token_id"),
                **fam.family_fields(raw, source),
            )
        except KeyError as missing:
            raise ModelConfigError(f"{source}: required key {missing} is missing") from None

    @classmethod
    def family_fields(cls, raw: dict[str, Any], source: str) -> dict[str, Any]:
        """The family's own fields from config.json (none for a plain decoder)."""
        return {}

    def family_hf_dict(self) -> dict[str, Any]:
        """The family's own config.json keys."""
        return {}

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: transformers < 5 reads rope_theta, >= 5 reads rope_parameters.
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "torch_dtype": self.dtype,
            "dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
            **self.family_hf_dict(),
        }

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """The config of a Hugging Face model directory, as its family's class."""
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelConfigError(
                f"{path} has no config.json; it is not a Hugging Face model directory. "
                f"Create one with `rlsched init-model --preset tiny {path}`.")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as err:
            raise ModelConfigError(f"{cfg_file} is not valid JSON: {err}") from None
        return cls.from_hf_dict(raw, source=str(cfg_file))

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3Config(ModelConfig):
    """Qwen3 (dense): q/k RMSNorm per head, biases only with attention_bias, head_dim independent of the width."""

    model_type: ClassVar[str] = "qwen3"
    architecture: ClassVar[str] = "Qwen3ForCausalLM"
