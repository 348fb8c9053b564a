"""Qwen2 / Qwen2.5: the Qwen3 decoder without q/k norms, with biases on the q, k and v projections.

What differs from Qwen3, as transformers' Qwen2 has it:
- q/k/v projections always carry a bias, the output projection never does (config.json has no
  `attention_bias`; the biases are part of the architecture).
- No RMSNorm on q and k before RoPE.
- head_dim is hidden_size / num_attention_heads unless config.json says otherwise.
- Sliding-window attention (`use_sliding_window: true`, or a `sliding_attention` entry in `layer_types`)
  is refused at load time: every released Qwen2.5 checkpoint has it off, and attending to the whole
  sequence where the checkpoint attends to a window would silently change the model.

JAX-free: the control plane reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from workers.models.config import ModelConfig, ModelConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen2Config(ModelConfig):
    model_type: ClassVar[str] = "qwen2"
    architecture: ClassVar[str] = "Qwen2ForCausalLM"
    qk_norm: ClassVar[bool] = False

    def proj_bias(self, proj: str) -> bool:
        return proj in ("q", "k", "v")

    @classmethod
    def family_fields(cls, raw: dict[str, Any], source: str) -> dict[str, Any]:
        sliding = [i for i, kind in enumerate(raw.get("layer_types") or []) if kind == "sliding_attention"]
        if sliding:
            raise ModelConfigError(f"{source}: layers {sliding} use sliding-window attention, which rlsched does not "
                                   "implement; use a checkpoint with use_sliding_window false")
        return {}

    def family_hf_dict(self) -> dict[str, Any]:
        return {"max_window_layers": self.num_hidden_layers, "layer_types": ["full_attention"] * self.num_hidden_layers}
