"""LoRA adapters: which projections a task's adapter targets, the adapter's parameters by name and shape, and
the merged weights they stand for. Pure (numpy / jnp in, same out); the decoder's batched use of adapters and
the PEFT files build on this layout.

An adapter of rank r on a projection whose kernel is K (in, out) adds `scale * x A B` to its output, with
A (in, r), B (r, out) and scale = alpha / r: the kernel it stands for is K + scale * A B. A and B are stored in
the kernels' (in, out) orientation, named after the projection they adapt:

    model.layers.0.self_attn.q_proj.lora_a   (hidden, r)
    model.layers.0.self_attn.q_proj.lora_b   (r, heads * head_dim)
    lm_head.lora_a                           (hidden, r)
    lm_head.lora_b                           (r, vocab)

Design decisions:
- Targets are named as users of PEFT name them (q, k, v, o, gate, up, down) and checked against the family:
  a mixture-of-experts layer has no single gate/up/down projection, so those targets are refused there (the
  attention projections of every family can be adapted).
- The output head ("lm_head") is a target too, once per model rather than per layer, whether or not the model
  ties it to its embedding (tied, the head's kernel is the embedding's transpose (hidden, vocab) and there is no
  lm_head.kernel parameter). Without it an adapter can only move the final hidden state, and on a base whose
  embedding is small (a random one: std 0.02) no logit moves far enough for any token to become likely; PEFT
  adapts it the same way (target_modules=["lm_head"]).
- B starts at zero (as PEFT does): a fresh adapter computes exactly what its base computes, so step 0 of a LoRA
  task is its base model and the KL reference is the base with the adapter off.
- Several adapters run in one forward as an `AdapterBatch` (workers.models.lora_batch: JAX, kept apart so that
  the control plane checks a LoRA config without importing JAX): K adapters stacked per module and the adapter
  of each batch row (-1: the base).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from workers.models.config import ModelConfig, ModelConfigError

# Target name -> the projection's module path: under `model.layers.<i>.` for the per-layer ones (LAYER_TARGETS),
# from the model's root for the model-level ones (MODEL_TARGETS: the output head).
LAYER_TARGETS: dict[str, str] = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                                 "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                                 "down": "mlp.down_proj"}
MODEL_TARGETS: dict[str, str] = {"lm_head": "lm_head"}
TARGETS: dict[str, str] = LAYER_TARGETS | MODEL_TARGETS
MLP_TARGETS = ("gate", "up", "down")
HEAD = "lm_head"  # the output head's module path (tied or not)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """A task's adapter: its rank, its alpha (scale = alpha / rank) and the projections it targets."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ModelConfigError(f"lora.rank must be a positive integer, got {self.rank!r}")
        if self.alpha <= 0:
            raise ModelConfigError(f"lora.alpha must be > 0, got {self.alpha!r}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ModelConfigError(f"lora.targets {list(self.targets)}: each must be one of {list(TARGETS)} "
                                   "(and at least one)")
        if len(set(self.targets)) != len(self.targets):
            raise ModelConfigError(f"lora.targets {list(self.targets)} names a projection twice")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def check_targets(cfg: ModelConfig, targets: Sequence[str]) -> None:
    """ModelConfigError naming the layers where a target has no projection (an MLP target on a MoE layer)."""
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.moe_layer(i)]
    mlp = [t for t in targets if t in MLP_TARGETS]
    if moe and mlp:
        raise ModelConfigError(f"lora.targets {mlp}: {cfg.describe()} layers {moe[:4]}{'...' if len(moe) > 4 else ''} "
                               "are mixtures of experts, with no single gate/up/down projection to adapt; target "
                               "q, k, v and o there")


def adapted_modules(cfg: ModelConfig, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """{module path: (in, out)} of every projection the adapter targets, in layer order, the head last."""
    check_targets(cfg, spec.targets)
    shapes = cfg.param_shapes()
    out = {}
    for layer in range(cfg.num_hidden_layers):
        for t in spec.targets:
            if t in LAYER_TARGETS:
                module = f"model.layers.{layer}.{TARGETS[t]}"
                out[module] = shapes[f"{module}.kernel"]
    if HEAD in spec.targets:
        out[HEAD] = (cfg.hidden_size, cfg.vocab_size)  # tied or not: the head maps hidden -> vocab
    return out


def head_kernel(base: Mapping[str, np.ndarray]) -> np.ndarray:
    """The output head's kernel (hidden, vocab) of flat parameters: lm_head.kernel, or for a model that ties its
    embeddings the embedding's transpose."""
    if f"{HEAD}.kernel" in base:
        return np.asarray(base[f"{HEAD}.kernel"])
    return np.asarray(base["model.embed_tokens.weight"]).T


def adapter_shapes(cfg: ModelConfig, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """Every adapter parameter's flat name and shape: `<module>.lora_a` (in, r) and `<module>.lora_b` (r, out)."""
    out = {}
    for module, (d_in, d_out) in adapted_modules(cfg, spec).items():
        out[f"{module}.lora_a"] = (d_in, spec.rank)
        out[f"{module}.lora_b"] = (spec.rank, d_out)
    return out


def adapter_bytes(cfg: ModelConfig, spec: LoraSpec, itemsize: int = 4) -> int:
    """Bytes of one adapter's parameters (its optimizer moments are twice this in float32 AdamW)."""
    return sum(int(np.prod(s)) for s in adapter_shapes(cfg, spec).values()) * itemsize


def merged(base: Mapping[str, np.ndarray], adapter: Mapping[str, np.ndarray], spec: LoraSpec) -> dict[str, np.ndarray]:
    """The base's flat parameters with every adapted kernel replaced by K + scale * A B (in float32, cast back
    to the kernel's dtype): the full model the adapter stands for.

    An adapted head of a model that ties its embeddings is UNTIED: the result has its own lm_head.kernel
    (embedding^T + scale * A B) and the embedding unchanged (the adapter changes what the head computes, not
    what the embedding looks up), so the caller builds the model with tie_word_embeddings false."""
    out = dict(base)
    modules = {name.rsplit(".", 1)[0] for name in adapter}
    for module in sorted(modules):
        kernel = head_kernel(base) if module == HEAD else np.asarray(base[f"{module}.kernel"])
        a = np.asarray(adapter[f"{module}.lora_a"], np.float32)
        b = np.asarray(adapter[f"{module}.lora_b"], np.float32)
        out[f"{module}.kernel"] = (kernel.astype(np.float32) + spec.scale * (a @ b)).astype(kernel.dtype)
    return out

