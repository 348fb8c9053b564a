"""Qwen3-MoE: the Qwen3 decoder with sparse mixture-of-experts MLPs (Qwen3-30B-A3B, Qwen3-235B-A22B).

What config.json says, and how it is read (as transformers' Qwen3MoE does):
- `num_experts` (transformers 5 writes `num_local_experts`), `num_experts_per_tok` (k), `moe_intermediate_size`
  (each expert's width), `norm_topk_prob` (renormalise the k router weights to sum to 1, or keep the softmax's).
- Which layers are sparse: layer i is a MoE layer when i is not in `mlp_only_layers` and
  (i + 1) % `decoder_sparse_step` == 0; the others have a dense MLP `intermediate_size` wide.
- `router_aux_loss_coef`: the weight of the load-balancing loss (workers.models.moe.load_balancing_loss) that
  the actor adds to GRPO's loss (`actor.router_aux_loss_coef` overrides it).
- Parameters: a MoE layer has `mlp.gate.kernel` (H, E), the router, and the experts stacked
  `mlp.experts.{gate,up}_proj.kernel` (E, H, I) and `mlp.experts.down_proj.kernel` (E, I, H). Checkpoints
  hold one tensor per expert (`mlp.experts.<e>.gate_proj.weight`, ...); workers.models.params stacks and
  splits them.

JAX-free: the control plane reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from workers.models.config import ModelConfig, ModelConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig(ModelConfig):
    model_type: ClassVar[str] = "qwen3_moe"
    architecture: ClassVar[str] = "Qwen3MoeForCausalLM"

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"config.{name} must be a positive integer, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ModelConfigError(f"config.num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                                   f"({self.num_experts})")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ModelConfigError(f"config.mlp_only_layers {bad} are not layers of a {self.num_hidden_layers}-layer "
                                   "model")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))

    def moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def mlp_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        if not self.moe_layer(layer):
            return super().mlp_shapes(layer)
        h, i, e = self.hidden_size, self.moe_intermediate_size, self.num_experts
        return {"gate.kernel": (h, e), "experts.gate_proj.kernel": (e, h, i), "experts.up_proj.kernel": (e, h, i),
                "experts.down_proj.kernel": (e, i, h)}

    def describe(self) -> str:
        return f"Qwen3-MoE ({self.num_experts} experts, top {self.num_experts_per_tok})"

    @classmethod
    def family_fields(cls, raw: dict[str, Any], source: str) -> dict[str, Any]:
        experts = raw.get("num_experts", raw.get("num_local_experts"))
        if experts is None:
            raise ModelConfigError(f"{source}: required key 'num_experts' (or 'num_local_experts') is missing")
        return {"num_experts": experts, "num_experts_per_tok": raw["num_experts_per_tok"],
                "moe_intermediate_size": raw["moe_intermediate_size"],
                "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),  # transformers' default
                "decoder_sparse_step": raw.get("decoder_sparse_step", 1),
                "mlp_only_layers": tuple(raw.get("mlp_only_layers") or ()),
                "router_aux_loss_coef": float(raw.get("router_aux_loss_coef", 0.001))}

    def family_hf_dict(self) -> dict[str, Any]:
        return {"num_experts": self.num_experts, "num_local_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok, "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob, "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers), "router_aux_loss_coef": self.router_aux_loss_coef,
                "output_router_logits": False}
