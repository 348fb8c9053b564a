"""`rlsched plan`: what each role of an experiment holds on each of its devices, before anything starts.

    plan = device_plan(load_config("configs/gsm8k_qwen3_1p7b_mesh.yaml"))
    print(plan.render())                      # one row per task and role, then each device group's peak
    json.dumps(plan.as_dict())                # the same numbers, in bytes

Per role and device, by kind (bytes on one device of the role's mesh, laid out by workers.models.sharding):
    params       every parameter's shard, in the task's model.dtype; an actor of a bfloat16 model also holds its
                 float32 master copy (workers.actor: float32 master weights, bfloat16 for the forward and the engine)
    grads        actor: as the master (gradients have their parameter's shape and layout, in float32)
    optimizer    actor: AdamW's two moments (as the master: the first in actor.adam_mu_dtype, float32 or bfloat16,
                 the second float32) + two int32 step counts (Adam's and the schedule's)
    reference    actor, when grpo.beta > 0: the frozen reference copy of the params, in the model's dtype; none with
                 actor.offload_reference (it is on the devices for its log-probs alone, before the gradient exists:
                 the reference, in the model's dtype, and a forward's activations are less than the float32
                 gradient and the update's activations that follow it)
    (a LoRA task, tasks[i].lora: params are the base's plus its adapter's; grads and optimizer are the adapter's
    (float32, counted whole on every device: at most a few MiB); no reference, the base is it)
    kv_cache     engine: rollout.max_batch_size rows (rounded up to a multiple of dp x ep) x (max_prompt_len +
                 max_new_tokens) slots x layers x 2 (k and v) x KV heads x head_dim, split as the KV_CACHE rule:
                 the cache of every step under grpo.prompt_padding max, the largest one under bucket
    activations  actor: what the train programs allocate beside their arguments for one micro-batch, or for the
                 optimizer's step, the count below, by backend (`rlsched plan --backend`: XLA:GPU's by default,
                 or XLA:CPU's), fitted to that compiler's own memory analysis of the compiled programs
The activations follow the actor's real train program (workers.train_step.gradients: the GRPO loss over one
micro-batch, the output head by chunks of workers.token_logprobs, each decoder layer rematerialised or not as
`actor.remat` says), fitted to XLA's `memory_analysis().temp_size_in_bytes` of that compiled program. Per device:
rows = micro-batch / (dp x fsdp x ep), T = max_prompt_len + max_new_tokens positions, L layers, H hidden, Q = heads
x head_dim and KV = KV heads x head_dim and I the MLP's width (each / tp where tp splits it), N heads / tp; the
constants are FIT[backend][the model's dtype] (ActivationFit):
    a layer, per row      T x (h H + q Q + k KV + m I) + s N T^2 bytes (the values its backward reads, q/k/v, the
                          norms, the MLP's gate, up and product, attention's scores and probabilities of every
                          (head, query, key))
    remat off             L layers kept at once (`layer`), and the output head's chunk beside them (its backward
                          comes first, while every layer's values wait)
    remat layers          each layer's input (`remat_input` x T x H a row) kept, and the larger of one layer
                          recomputed with its backward (`remat_work`, the same form) and the head's chunk
    output head           `head` x one chunk of positions (workers.token_logprobs' chunks: at most 128, as even as
                          they split a run's completion window of max_new_tokens) x vocab / tp: the chunk's float32
                          logits, softmax and gradient, never the whole [rows, positions, vocab]. XLA:GPU places
                          it inside the embedding's float32 gradient, before writing that, where it fits
                          (2 x rows x chunk <= H) on one fsdp shard: not counted there (`head_in_gradient`)
    the rest              `rest` x T x H (the embedding's output, the final norm and their gradients)
    vocabulary gradients  XLA:GPU, a bfloat16 model: its embedding's (and an untied head's) gradient in bfloat16,
                          before the float32 sum (`vocab_grad` bytes a parameter of their shards)
    an fsdp mesh          fsdp > 1, in the model's dtype: with remat layers, the largest layer's weights gathered
                          whole (each layer gathers its own in the forward and again in its recompute, one layer at
                          a time: decoder._remat_backward); with remat off, every layer's, less the device's shard (the
                          forward's gathers wait for the backward); each vocabulary matrix gathered, and a
                          full-weight actor's float32 gradient of it whole, before the reduce-scatter that leaves
                          the device its shard (`fsdp_gathered_bytes`)
    accumulation          several micro-batches a step (mini_batch_size > micro_batch_size): ACCUMULATION_COPIES x
                          the trained params' float32 bytes (XLA:CPU keeps a float32 copy of bfloat16 weights
                          through the loop: 1.7 x; XLA:GPU little: 0.1 x)
    the update         the optimizer's step after the micro-batches, a program of its own (workers.train_step.update):
                       UPDATE_COPIES (by backend and actor.adam_mu_dtype) x the trained params' float32 bytes (the
                       master's, or a LoRA adapter's): nothing but XLA:CPU's float32 moment before its rounding to
                       a bfloat16 one; the activations are the larger of the micro-batch's and the update's, as one
                       program follows the other
    (a LoRA adapter on the head adds its float32 delta over the vocab shard. A bfloat16 model's forward reads the
    copy it serves, counted in `params`, rather than casting the master in the step; an update of several optimizer
    steps a GRPO step (mini-batches, epochs) casts the master again before each further one while the first copy
    waits in the task's channel, published: the params' shard in the model's dtype more, counted here)
What the compiled programs allocate beside those is the gradient of the master (the `grads` kind): the gradient
program's output, the update program's argument. XLA's temporaries are grads + activations, against which the fits
were measured (jax 0.10, benchmarks/plan_fit.py):
- XLA:CPU, least squares over 11 programs of each (dtype, remat) at small widths (the `small` preset's: hidden 256,
  MLP 768, 4 heads, 2 KV heads, head_dim 128, vocab 4,096, 2 layers, 4 x 512, and one variant each: MLP 1,536,
  hidden 128, 8 heads, 4 KV heads, head_dim 64, vocab 16k and 64k, 8 rows, 384 positions, 4 layers); with 12 more
  (vocab 4k-64k, 2-8 rows of 256-512 positions), 56 programs in all: 0.958-1.059. tests/test_plan_memory.py: 7 points,
  0.966-1.040, including a bfloat16 actor accumulating 4 micro-batches (XLA:CPU computes bfloat16 dots in float32
  and converts every weight before the compiled loop: 1.7 x the float32 master more than with one; Qwen3-0.6B at 8
  micro-batches 1.65 x, Qwen3-4B at 16 1.86 x). At real sizes XLA:CPU keeps more than the fit of small widths says
  (its float32 copies of the weights): Qwen3-0.6B, 16 x 512, 0.91 and 0.95 (1 and 8 micro-batches); Qwen3-4B, 8 x
  512, 0.79 and 0.86 (1 and 16; benchmarks/results/gpu_memory-cpu-*).
- XLA:GPU, compiled for an H100 without one (deviceless: benchmarks/gpu_memory.py's targets), fitted to 14 programs
  of Qwen3 0.6B, 1.7B and 4B shapes (2-32 rows of 256-2,048 positions, remat layers and off, one float32): 0.93-1.28
  x, 0.99-1.06 on 11. Where it over-counts (1.7B, 16 rows of 256 positions: 1.28; 4B remat off: 1.15) XLA put the
  head's chunk inside gradients' buffers where the count's rule does not expect it; where it under-counts (4B, 2
  rows: 0.93) it kept more than at 8 rows. Small widths allocate relatively more there (split-K partial sums: 0.5-1.4
  x of the count at the `small` widths), which matters little in bytes. No GPU's allocator measured it at run time.
- An fsdp mesh, XLA:GPU compiled for 2 and 4 H100s (benchmarks/gpu_memory.py --fsdp), Qwen3 0.6B, 1.7B and 4B shapes
  at 4-16 rows a device, remat layers: 1.03-1.19 x over 9 programs (0.30-0.96 without the fsdp count); remat off
  (0.6B on fsdp 2, 1.7B on fsdp 4, 4 and 2 rows): 0.94 and 0.95. XLA:CPU, Qwen3-0.6B on fsdp 2: 1.07 (its
  one-device count at that size is 0.91).
What it leaves out: a TPU's compiler, a LoRA adapter's own intermediates (rank-sized), and a LoRA actor on fsdp (its
frozen base's gathers are counted as a full-weight actor's, not measured). A mixture-of-experts layer
(workers.models.moe) runs every expert on every token, so instead of the MLP's share it keeps (B, T, E, I)
intermediates: the ep group's rows (gathered over ep) x E / ep experts x I / tp, which per device is the device's own
rows x E x I / tp; MOE_VALUES_PER_EXPERT float32 values of them per token. That count is XLA:CPU's, not the block's
three (gate, up, their product): the compiled train step of a 2- and a 4-layer model of Qwen3-30B-A3B's shapes on 8 CPU
devices (`memory_analysis()`, float32, remat off) holds 11-16 per token per MoE layer on fsdp 2 x ep 2 x tp 2, ep 4 x tp
2 and fsdp 2 x ep 4. The MoE share is not fitted to the remat-aware program nor to XLA:GPU: on one device, 16 experts
256 wide (hidden 256, 2-4 layers, 2-8 rows of 256 positions), XLA:CPU's temporaries were 1.4-1.9 x grads + activations
with remat layers, by the count before its refit (one layer's recompute of its (B, T, E, I) values, and per further
layer 0.3-0.4 x its float32 gradient more in bfloat16, the same at 2 and 8 rows, 1.6 x in float32) and 0.5-0.8 x with
remat off (float32: about 8 values per expert and token, not 12). The KV cache is jax_sampler's, the most it can hold.

LoRA tasks of one base group (the same base, dtype and role mesh) in a device group's process share one copy of
the base (workers.shared_base): their rows show the adapter, and one row `base` holds the base, resident for the
group's life. With cluster.processes per_role each role's process holds its own copy, as each row then says.

Device groups: colocated, one group of every device; every role of every task may be resident at once,
so a device's bytes are the sum over the roles that use it. Disaggregated: a rollout group (the engines'
devices) and a train group (the actors'). A group fits the budget (`cluster.memory_budget_gb`, per device)
when every role it holds fits at once; "with offload" when each role fits alone (the scheduler offloads
idle roles to host memory); otherwise it cannot run.

Only each model's config.json is read (never its weights), so a 30B recipe plans on a machine without
them; no Ray, no JAX.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, NamedTuple

from rlsched.base.units import format_bytes
from rlsched.config.meshes import ModelConfigs, check_meshes, read_model_config, role_devices
from rlsched.config.schema import ConfigError, ExperimentConfig, TaskConfig
from workers.models import sharding
from workers.models.config import ModelConfig

KINDS = ("params", "grads", "optimizer", "reference", "kv_cache", "activations")
ITEMSIZE = {"float32": 4, "bfloat16": 2}
LOGPROB_CHUNK = 128  # positions per chunk of the output head: workers.token_logprobs.DEFAULT_CHUNK (no JAX here)
MASTER_DTYPE = "float32"  # an actor's trained weights, moments and gradients, whatever the model's dtype
ADAM_COUNTS = 2 * 4  # int32 step counts of optax's scale_by_adam and of the learning-rate schedule, replicated
MOE_VALUES_PER_EXPERT = 12  # per token and MoE layer, x experts x expert width / tp (measured; module docstring)


class LayerBytes(NamedTuple):
    """Bytes a decoder layer keeps per token, by width (a row's layer: T x (hidden H + q Q + kv KV + mlp I) +
    scores x N T^2): XLA's temporaries of the compiled train step, fitted (module docstring)."""

    hidden: int  # x H: the residual stream, both norms' inputs and outputs
    q: int  # x heads x head_dim / tp: the query before and after its norm and rotary embedding, attention's output
    kv: int  # x KV heads x head_dim / tp: keys (normed, rotated) and values
    mlp: int  # x intermediate_size / tp: the gate, its silu, the up projection and their product
    scores: int  # per (head, query, key): float32 scores and probabilities (the (B, N, T, T) arrays)


class ActivationFit(NamedTuple):
    """What the gradient's program allocates per row beside the gradient, by the model's dtype (module docstring)."""

    layer: LayerBytes  # remat off: every layer's values, kept from its forward to its backward
    remat_input: int  # remat layers: each layer's input, per token x hidden
    remat_work: LayerBytes  # remat layers: the one layer recomputed, with its backward's own values
    rest: int  # per token x hidden: the embedding's output, the final norm, their gradients
    head: int  # per (chunk position, vocab entry / tp): a chunk's float32 logits, softmax and their gradient
    vocab_grad: int = 0  # per vocabulary parameter (embedding, untied head): their gradient in the model's dtype
    # whether the head's chunk is left out where it fits inside the embedding's float32 gradient (2 x rows x chunk <=
    # hidden): XLA:GPU puts it in that output's buffer before the backward writes the gradient there
    head_in_gradient: bool = False


# Fitted to each compiler's memory analysis (module docstring), by backend and the model's dtype: least squares over
# the programs of each (dtype, remat), rounded to whole bytes
FIT = {
    "cpu": {"float32": ActivationFit(layer=LayerBytes(hidden=20, q=16, kv=16, mlp=22, scores=12), remat_input=4,
                                     remat_work=LayerBytes(hidden=8, q=16, kv=17, mlp=33, scores=12), rest=24,
                                     head=12),
            "bfloat16": ActivationFit(layer=LayerBytes(hidden=23, q=16, kv=13, mlp=12, scores=11), remat_input=2,
                                      remat_work=LayerBytes(hidden=7, q=19, kv=12, mlp=21, scores=12), rest=21,
                                      head=15)},
    # XLA:GPU keeps far less: bfloat16 in bfloat16, the head's softmax fused (two float32 arrays of the chunk),
    # one layer's recompute small beside its input; its own fit (module docstring)
    "gpu": {"float32": ActivationFit(layer=LayerBytes(hidden=4, q=4, kv=4, mlp=4, scores=6), remat_input=4,
                                     remat_work=LayerBytes(hidden=8, q=8, kv=8, mlp=8, scores=2), rest=8, head=8,
                                     head_in_gradient=True),
            "bfloat16": ActivationFit(layer=LayerBytes(hidden=2, q=2, kv=2, mlp=2, scores=6), remat_input=2,
                                      remat_work=LayerBytes(hidden=4, q=4, kv=4, mlp=4, scores=2), rest=4, head=8,
                                      vocab_grad=2, head_in_gradient=True)},
}
BACKENDS = tuple(FIT)  # `rlsched plan --backend`: whose compiler's count (a TPU's is not measured)
VOCAB_MATRICES = ("model.embed_tokens.weight", "lm_head.kernel")  # (vocab, hidden) parameters: ActivationFit.vocab_grad
# The optimizer's step (workers.train_step.update, a program of its own) allocates this many float32 copies of the
# trained params beside the gradient, its argument, by backend and actor.adam_mu_dtype: none with a float32 first
# moment (the clipped gradient is written over the gradient, the moments and the params over themselves); with a
# bfloat16 one XLA:CPU makes the moment in float32 before rounding it (half a copy), XLA:GPU fuses the rounding in.
# XLA:CPU's temporaries of that program, bfloat16 models of the `small` widths, 2 and 4 layers: 0.001 and 0.500 x the
# master; XLA:GPU's (an H100, Qwen3-0.6B): 231 KiB either way. (optax's clip inside the chain, as one transformation,
# kept its clipped gradient: 1.0 and 1.5 on XLA:CPU; a branch on the step's finiteness, 4.0 on XLA:GPU.)
UPDATE_COPIES = {"cpu": {"float32": 0.0, "bfloat16": 0.5}, "gpu": {"float32": 0.0, "bfloat16": 0.0}}
# Accumulating micro-batches (mini_batch_size > micro_batch_size: workers.train_step.gradients' loop) allocates this
# many float32 copies of the trained params more in the gradient's program, by backend and the model's dtype: XLA:CPU
# computes bfloat16 dots in float32 and converts every weight before the loop, a float32 copy of them alive through it
# (4 layers of the `small` widths: 1.7 x; Qwen3-0.6B at 8 micro-batches 1.65 x, Qwen3-4B at 16 1.86 x); XLA:GPU keeps
# bfloat16 and adds little (Qwen3-0.6B 0.02 x, Qwen3-4B 0.09 x; float32 not measured there)
ACCUMULATION_COPIES = {"cpu": {"float32": 0.15, "bfloat16": 1.7}, "gpu": {"float32": 0.1, "bfloat16": 0.1}}
GiB = 2**30


def param_bytes(shapes: dict[str, tuple[int, ...]], mesh: dict[str, int], *, kv_heads: int, itemsize: int) -> int:
    """Bytes of every parameter's shard on one device of `mesh`."""
    specs = sharding.param_specs(shapes, mesh, kv_heads=kv_heads)
    return sum(sharding.shard_bytes(shape, specs[name], mesh, itemsize) for name, shape in shapes.items())


def actor_bytes(task: TaskConfig, model: ModelConfig, *, backend: str = "gpu") -> dict[str, int]:
    """Per device of the actor's mesh, by kind (see the module docstring); activations as `backend`'s compiler
    allocates them ("gpu" or "cpu": BACKENDS)."""
    mesh, item = task.actor.mesh.as_dict(), ITEMSIZE[task.model.dtype]
    params = param_bytes(model.param_shapes(), mesh, kv_heads=model.num_key_value_heads, itemsize=item)
    mu = ITEMSIZE[task.actor.adam_mu_dtype]  # AdamW's first moment; its second is float32
    if task.lora is not None:  # the base is frozen: only the adapter (float32) has gradients and moments
        trained = adapter = lora_bytes(task, model)
        out = {"params": params + adapter, "grads": adapter,
               "optimizer": adapter + adapter // ITEMSIZE[MASTER_DTYPE] * mu + ADAM_COUNTS}
    else:  # float32 master weights; a bfloat16 model's params are also held as the engine is served them
        shapes, kv_heads = model.param_shapes(), model.num_key_value_heads
        trained = master = param_bytes(shapes, mesh, kv_heads=kv_heads, itemsize=ITEMSIZE[MASTER_DTYPE])
        out = {"params": master + (params if item != ITEMSIZE[MASTER_DTYPE] else 0), "grads": master,
               "optimizer": master + param_bytes(shapes, mesh, kv_heads=kv_heads, itemsize=mu) + ADAM_COUNTS}
    if task.grpo.beta > 0 and task.lora is None and not task.actor.offload_reference:
        out["reference"] = params
    batches = task.batch_plan()
    rows = batches.micro_batch_size // sharding.batch_rows(mesh)
    positions = task.grpo.max_prompt_len + task.grpo.max_new_tokens
    # the output head runs on chunks of positions (workers.token_logprobs), a run's batches on their completion
    # windows of max_new_tokens (workers.batch): one chunk's float32 logits are alive at a time, over the vocab shard
    # (a LoRA adapter on the head adds its float32 delta)
    vocab = -(-model.vocab_size // mesh["tp"])
    lora_head = 4 * vocab if task.lora is not None and "lm_head" in task.lora.targets else 0
    fit, chunk = FIT[backend][task.model.dtype], head_chunk(task.grpo.max_new_tokens)
    head = chunk * (fit.head * vocab + lora_head)
    if fit.head_in_gradient and task.lora is None and mesh["fsdp"] == 1 and 2 * rows * chunk <= model.hidden_size:
        head = 0  # in the embedding's float32 gradient's buffer, before the backward writes it (ActivationFit)
    # a bfloat16 model's gradient of its vocabulary matrices (the embedding, an untied head), laid out as they are,
    # before their float32 sum (none for a LoRA actor's frozen base)
    matrices = {k: v for k, v in model.param_shapes().items() if k in VOCAB_MATRICES}
    vocab_grads = 0 if task.lora is not None or not fit.vocab_grad else \
        param_bytes(matrices, mesh, kv_heads=model.num_key_value_heads, itemsize=fit.vocab_grad)
    # a bfloat16 model's forward reads the copy it serves (workers.actor): a second one, cast for each further
    # optimizer step of a GRPO step, while the first waits in the channel
    several = batches.optimizer_steps_per_step > 1
    cast = params if task.lora is None and item != ITEMSIZE[MASTER_DTYPE] and several else 0
    micro_batch = rows * activation_bytes(model, mesh, positions, task.model.dtype, task.actor.remat, head=head,
                                          backend=backend) + vocab_grads
    micro_batch += fsdp_gathered_bytes(model, mesh, item, trained=task.lora is None, remat=task.actor.remat)
    if batches.grad_accumulation > 1:  # several micro-batches a step
        micro_batch += int(ACCUMULATION_COPIES[backend][task.model.dtype] * trained)
    out["activations"] = max(micro_batch, int(UPDATE_COPIES[backend][task.actor.adam_mu_dtype] * trained)) + cast
    return out


def fsdp_gathered_bytes(model: ModelConfig, mesh: dict[str, int], itemsize: int, *, trained: bool,
                        remat: str = "layers") -> int:
    """What the gradient's program of an actor on an fsdp mesh allocates beyond its shards (module docstring), in the
    model's dtype (`itemsize`): with remat layers, the largest layer's weights gathered whole over fsdp (each layer
    gathers its own in the forward and again in its recompute, one at a time); with remat off, every layer's gathered
    weights less the device's shard (the forward's gathers are kept for the backward); each vocabulary matrix
    gathered, and with `trained` (a full-weight actor) its float32 gradient whole, before the reduce-scatter that
    leaves the device its shard. 0 off fsdp."""
    if mesh["fsdp"] == 1:
        return 0
    whole, kv_heads = {**mesh, "fsdp": 1}, model.num_key_value_heads
    shapes = model.param_shapes()
    if remat == "off":  # every layer's gathers, less the shards the device holds anyway
        layers = {k: v for k, v in shapes.items() if k.startswith("model.layers.")}
        gathered = param_bytes(layers, whole, kv_heads=kv_heads, itemsize=itemsize) - \
            param_bytes(layers, mesh, kv_heads=kv_heads, itemsize=itemsize)
    else:  # the largest layer's, whole
        gathered = max(param_bytes({k: v for k, v in shapes.items() if k.startswith(f"model.layers.{i}.")}, whole,
                                   kv_heads=kv_heads, itemsize=itemsize) for i in range(model.num_hidden_layers))
    matrices = {k: v for k, v in shapes.items() if k in VOCAB_MATRICES}
    vocab = itemsize + (ITEMSIZE[MASTER_DTYPE] if trained else 0)
    return gathered + param_bytes(matrices, whole, kv_heads=kv_heads, itemsize=vocab)


def lora_bytes(task: TaskConfig, model: ModelConfig) -> int:
    """A LoRA task's adapter (float32), whole: what it adds to its base on every device of a role."""
    from workers.models.lora import LoraSpec, adapter_bytes  # numpy and the model's config only

    spec = LoraSpec(task.lora.rank, task.lora.alpha, tuple(task.lora.targets))
    return adapter_bytes(model, spec, itemsize=4)


def head_chunk(width: int) -> int:
    """Positions per chunk of the output head over `width` positions: workers.token_logprobs' chunks, as few as
    LOGPROB_CHUNK allows, each as short as they can be (a window of 192 runs two chunks of 96)."""
    chunks = -(-width // LOGPROB_CHUNK)
    return -(-width // chunks)


def activation_bytes(model: ModelConfig, mesh: dict[str, int], positions: int, dtype: str, remat: str, *,
                     head: int, backend: str) -> int:
    """Bytes the actor's gradient program allocates for one row of `positions` tokens beside the gradient (see the
    module docstring), its output head's chunk `head` bytes a row: the layers' activations as `remat` keeps them,
    the rest, and the head. Remat off: the head's backward runs while every layer's values wait for theirs (a sum);
    remat layers: only the layers' inputs wait, and one layer's recompute follows the head's (the larger of the two)."""
    fit = FIT[backend][dtype]
    per = fit.layer if remat == "off" else fit.remat_work
    tokens, scores = [], []  # per layer: bytes a token keeps, bytes of one row's (heads, T, T) arrays
    for layer in range(model.num_hidden_layers):
        tokens.append(per.hidden * model.hidden_size + layer_width_bytes(model, mesh, per, layer))
        scores.append(model.num_attention_heads // mesh["tp"] * positions * positions)
    rest = fit.rest * positions * model.hidden_size
    if remat == "off":  # every layer's values, kept until the backward reaches it
        return sum(positions * t + per.scores * s for t, s in zip(tokens, scores, strict=True)) + rest + head
    # each layer's input kept; the backward recomputes one layer at a time: the largest one's working set
    kept = model.num_hidden_layers * fit.remat_input * positions * model.hidden_size
    work = max(positions * t + per.scores * s for t, s in zip(tokens, scores, strict=True))
    return kept + rest + max(work, head)


def layer_width_bytes(model: ModelConfig, mesh: dict[str, int], per: LayerBytes, layer: int) -> int:
    """Per token of `layer`, the bytes its tp-split widths keep: attention's q and kv, and its MLP (dense: the
    intermediate width; MoE: MOE_VALUES_PER_EXPERT float32 values per expert and expert width, ep gathering its
    rows: E x I / tp per token of the device's own rows)."""
    tp, kv = mesh["tp"], model.num_key_value_heads * model.head_dim
    kv = kv // tp if model.num_key_value_heads % tp == 0 else kv  # KV heads that do not split are whole (sharding)
    if model.moe_layer(layer):
        mlp = 4 * MOE_VALUES_PER_EXPERT * model.num_experts * model.moe_intermediate_size // tp
    else:
        mlp = per.mlp * model.intermediate_size // tp
    return per.q * model.num_attention_heads * model.head_dim // tp + per.kv * kv + mlp


def engine_bytes(task: TaskConfig, model: ModelConfig) -> dict[str, int]:
    """Per device of the engine's mesh, by kind (see the module docstring)."""
    mesh, item = task.rollout.mesh.as_dict(), ITEMSIZE[task.model.dtype]
    k = model.num_key_value_heads
    split = sharding.batch_rows(mesh)
    rows = -(-task.rollout.max_batch_size // split) * split  # padded to split over dp x ep
    shape = (rows, k, task.grpo.max_prompt_len + task.grpo.max_new_tokens, model.head_dim)  # (B, K, S, D)
    layer = sharding.shard_bytes(shape, sharding.spec(sharding.KV_CACHE, shape, mesh, kv_heads=k, what="KV cache"),
                                 mesh, item)
    params = param_bytes(model.param_shapes(), mesh, kv_heads=k, itemsize=item)
    if task.lora is not None:
        params += lora_bytes(task, model)
    return {"params": params, "kv_cache": 2 * model.num_hidden_layers * layer}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolePlan:
    task: str
    role: str  # "actor" | "engine"
    mesh: dict[str, int]  # {"dp", "fsdp", "ep", "tp"}
    devices: list[int]  # indices into the experiment's device pool (rlsched.config.meshes.role_devices)
    bytes: dict[str, int]  # per device, by kind (KINDS order, only the kinds this role has)
    lora: bool = False  # a LoRA role reading its base group's base (the `base` row): its params are its adapter

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupPlan:
    name: str  # "shared" (colocated), "rollout" or "train" (disaggregated)
    devices: list[int]
    resident: int  # the most bytes on one of its devices with every role of the group resident
    largest_role: int  # the largest one role holds per device
    fits: str | None  # "yes", "with offload" (each role alone), "no"; None without a budget


@dataclasses.dataclass(frozen=True, kw_only=True)
class DevicePlan:
    placement: str
    num_devices: int
    num_devices_from: str  # "cluster.num_devices" or "the meshes" (it was None)
    budget: int | None  # bytes per device
    models: dict[str, str]  # task -> where its shapes came from, and its size
    roles: list[RolePlan]
    per_device: list[int]  # bytes on each device of the pool with every role resident
    groups: list[GroupPlan]
    rollout_batches: list[SharedHold] = dataclasses.field(default_factory=list)  # co-batched rollouts
    train_batches: list[SharedHold] = dataclasses.field(default_factory=list)  # co-batched updates
    backend: str = "gpu"  # whose compiler the activations are counted for (BACKENDS)

    @property
    def runnable(self) -> bool:
        return all(g.fits != "no" for g in self.groups)

    def as_dict(self) -> dict[str, Any]:
        roles = [dataclasses.asdict(r) | {"bytes": r.bytes | {"total": r.total}} for r in self.roles]
        return {"placement": self.placement, "backend": self.backend, "num_devices": self.num_devices,
                "num_devices_from": self.num_devices_from, "memory_budget_bytes": self.budget,
                "models": self.models, "roles": roles, "per_device": self.per_device,
                "groups": [dataclasses.asdict(g) for g in self.groups], "runnable": self.runnable,
                "rollout_batches": [dataclasses.asdict(b) for b in self.rollout_batches],
                "train_batches": [dataclasses.asdict(b) for b in self.train_batches]}

    def render(self) -> str:
        budget = "no memory budget" if self.budget is None else f"memory budget {_size(self.budget)} per device"
        lines = [f"{self.placement}, {_count(self.num_devices, 'device')} (from {self.num_devices_from}), {budget}"]
        lines += [f"task {task}: {text}" for task, text in self.models.items()]
        compiler = {"gpu": "XLA:GPU", "cpu": "XLA:CPU"}[self.backend]
        lines.append(f"bytes per device of each role's mesh (activations: {compiler}'s, an estimate, see "
                     "rlsched/config/plan.py):")
        header = ["task", "role", "mesh", "devices", *(k.replace("_", " ") for k in KINDS), "total"]
        rows = [[r.task, r.role + (" (lora)" if r.lora else ""), sharding.describe(r.mesh), _ranges(r.devices),
                 *(_size(r.bytes[k]) if k in r.bytes else "-" for k in KINDS), _size(r.total)] for r in self.roles]
        widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                  for row in [header, *rows]]
        for g in self.groups:
            peak = max(g.devices, key=lambda d: self.per_device[d])
            verdict = {None: "", "yes": "fits", "with offload": "fits one role at a time (idle roles offload)",
                       "no": "does NOT fit: a role alone is over the budget"}[g.fits]
            where = f"{'devices' if len(g.devices) > 1 else 'device'} {_ranges(g.devices)}"
            line = (f"group {g.name} ({where}): {_size(g.resident)} on device {peak} with every role resident; "
                    f"largest role {_size(g.largest_role)}")
            lines.append(f"{line}; {verdict}" if verdict else line)
        for b in self.rollout_batches + self.train_batches:
            if len(b.tasks) > 1:
                names = ", ".join(b.tasks) if len(b.tasks) <= 4 else f"{len(b.tasks)} tasks ({b.tasks[0]}, ...)"
                rows = f"up to {b.capacity} rows ({', '.join(map(str, sorted(set(b.rows))))} per task)"
                lines.append(f"co-batched rollout: {names} on one base; the waiting ones share a hold, their rows "
                             f"in one program run, {rows}" if b.phase == "rollout" else
                             f"co-batched train: {names}, one update program; the waiting ones share a hold, their "
                             f"optimizer steps in one program run, {rows}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SharedBase:
    """One base read by every LoRA role of its base group in a device group's process (workers.shared_base)."""

    key: tuple  # (resolved model path, dtype, role devices, mesh): the process registry's key
    mesh: dict[str, int]
    devices: list[int]
    nbytes: int  # per device of its mesh
    roles: list[tuple[str, str]]  # (task, "actor" | "engine") reading it


@dataclasses.dataclass(frozen=True, kw_only=True)
class SharedHold:
    """LoRA tasks whose waiting requests of `phase` share a hold (rlsched.scheduling.policy.CoBatch). ROLLOUT: their
    engines are slots of one shared sampler (one base, one mesh, the same engine sizes), their rows in one program
    run. TRAIN: their actors read one base and their update is one program (workers.actor_cobatch)."""

    phase: str  # "rollout" | "train"
    key: str
    tasks: list[str]
    rows: list[int]  # each task's rows: ROLLOUT prompts_per_step x num_generations, TRAIN its micro-batch
    capacity: int  # rows per hold: rollout.max_batch_size, actor.max_cobatch_rows

    def most_members(self, task: str) -> int:
        """The most tasks a hold of `task` can hold: it and the others, fewest rows first, while their rows fit the
        capacity (the scheduler's joiners: rlsched.scheduling.policy); 1 alone. Its actor compiles the co-batched
        programs of up to that many ahead, outside the locks (workers.actor.ActorWorker.prepare)."""
        i = self.tasks.index(task)
        rows, members = self.rows[i], 1
        for r in sorted(self.rows[:i] + self.rows[i + 1:]):
            if rows + r > self.capacity:
                break
            rows, members = rows + r, members + 1
        return members


def rollout_batches(cfg: ExperimentConfig, bases: list[SharedBase]) -> list[SharedHold]:
    """The co-batched rollouts of `cfg`'s base groups (tasks with rollout.cobatch false left out)."""
    found: dict[str, SharedHold] = {}
    by_name = {t.name: t for t in cfg.tasks}
    for b in bases:
        for name, role in b.roles:
            task = by_name[name]
            g, r = task.grpo, task.rollout
            if role != "engine" or not r.cobatch:
                continue
            key = repr((b.key, g.max_prompt_len, g.max_new_tokens, r.max_batch_size, g.prompt_padding))  # open_view's
            batch = found.setdefault(key, SharedHold(phase="rollout", key=key, tasks=[], rows=[],
                                                     capacity=r.max_batch_size))
            batch.tasks.append(name)
            batch.rows.append(g.prompts_per_step * g.num_generations)
    return list(found.values())


def train_batches(cfg: ExperimentConfig, bases: list[SharedBase]) -> list[SharedHold]:
    """The co-batched updates of `cfg`'s base groups: LoRA tasks whose actors read one base and whose update is one
    program (everything workers.train_step.ActorSettings is built from but the optimizer's settings, and the adapter's
    shape: data, rewards, seeds, `optim` and the schedule's length may differ); tasks with actor.cobatch false left
    out."""
    found: dict[str, SharedHold] = {}
    by_name = {t.name: t for t in cfg.tasks}
    for b in bases:
        for name, role in b.roles:
            task = by_name[name]
            if role != "actor" or not task.actor.cobatch:
                continue
            g, plan = task.grpo, task.batch_plan()
            # optim and the schedule's steps are each member's inputs of the program (train_step.OptimizerValues)
            shape = dataclasses.replace(plan, task="", steps=0, total_optimizer_steps=0, warmup_steps=0)
            update = (shape, task.lora.model_dump(), g.epsilon, g.epsilon_high, g.beta, g.loss_aggregation,
                      g.temperature, g.kl_clamp, g.max_new_tokens,
                      task.actor.router_aux_loss_coef, task.actor.remat, task.actor.adam_mu_dtype)
            key = repr((b.key, update, task.actor.max_cobatch_rows))
            batch = found.setdefault(key, SharedHold(phase="train", key=key, tasks=[], rows=[],
                                                     capacity=task.actor.max_cobatch_rows))
            batch.tasks.append(name)
            batch.rows.append(plan.micro_batch_size)
    return list(found.values())


def shares_base(cfg: ExperimentConfig, task: TaskConfig) -> bool:
    """Whether `task`'s roles read their base group's one copy of the base: a LoRA task in a device group's
    process (cluster.processes auto or per_device_group) on one host (rlsched.run.roles.shares_base, resolved)."""
    return task.lora is not None and cfg.cluster.processes != "per_role" and cfg.cluster.hosts == 1


def shared_bases(cfg: ExperimentConfig, models: dict[str, ModelConfig]) -> list[SharedBase]:
    """The bases of every base group: one per (base, dtype, role devices and mesh), however many roles read it."""
    found: dict[tuple, SharedBase] = {}
    for task in cfg.tasks:
        if not shares_base(cfg, task):
            continue
        model = models[task.name]
        devices = role_devices(cfg.cluster.placement, cfg.num_devices, task.actor.mesh.as_dict(),
                               task.rollout.mesh.as_dict())
        for role, mesh in (("actor", task.actor.mesh.as_dict()), ("engine", task.rollout.mesh.as_dict())):
            key = (str(Path(task.model.path).resolve()), task.model.dtype, tuple(devices[role]),
                   tuple(sorted(mesh.items())))
            if key not in found:
                nbytes = param_bytes(model.param_shapes(), mesh, kv_heads=model.num_key_value_heads,
                                     itemsize=ITEMSIZE[task.model.dtype])
                found[key] = SharedBase(key=key, mesh=mesh, devices=devices[role], nbytes=nbytes, roles=[])
            found[key].roles.append((task.name, role))
    return list(found.values())


def base_share(plan_bytes: dict[str, dict[str, int]], base: int) -> dict[str, dict[str, int]]:
    """A LoRA role's plan without its base (read from its base group's one copy): params are the adapter's."""
    return {role: {**kinds, "params": kinds["params"] - base} for role, kinds in plan_bytes.items()}


def device_plan(cfg: ExperimentConfig, model_config: ModelConfigs | None = None, *, backend: str = "gpu") -> DevicePlan:
    """Every task's roles: their meshes, devices and bytes per device; then each device group's peak. The actors'
    activations as `backend`'s compiler allocates them (BACKENDS).

    model_config(task, index) -> its architecture, for every task; default: its config.json or init_preset
    (rlsched.config.meshes.read_model_config). Raises ConfigError when a mesh does not split its model or a
    model's shapes cannot be found."""
    read = model_config or functools.partial(read_model_config, required=True)
    models = {t.name: read(t, i) for i, t in enumerate(cfg.tasks)}
    check_meshes(cfg, lambda task, _: models[task.name])
    n, placement = cfg.num_devices, cfg.cluster.placement
    roles: list[RolePlan] = []
    bases = shared_bases(cfg, models)
    base_of = {role: b.nbytes for b in bases for role in b.roles}  # (task, role) -> the shared base it reads
    for task in cfg.tasks:
        devices = role_devices(placement, n, task.actor.mesh.as_dict(), task.rollout.mesh.as_dict())
        model = models[task.name]
        for role, mesh, nbytes in (("actor", task.actor.mesh, actor_bytes(task, model, backend=backend)),
                                   ("engine", task.rollout.mesh, engine_bytes(task, model))):
            shared = base_of.get((task.name, role), 0)
            roles.append(RolePlan(task=task.name, role=role, mesh=mesh.as_dict(), devices=devices[role],
                                  bytes={**nbytes, "params": nbytes["params"] - shared}, lora=bool(shared)))
    for b in bases:  # once per base group, resident for its life
        readers = sorted({task for task, _ in b.roles})
        roles.append(RolePlan(task=",".join(readers) if len(readers) <= 3 else f"{len(readers)} tasks",
                              role="base", mesh=b.mesh, devices=b.devices, bytes={"params": b.nbytes}))
    per_device = [sum(r.total for r in roles if d in r.devices) for d in range(n)]
    budget = None if cfg.cluster.memory_budget_gb is None else int(cfg.cluster.memory_budget_gb * GiB)
    if placement == "colocated":
        groups = [_group("shared", list(range(n)), roles, per_device, budget)]
    else:
        groups = []
        for name, role in (("rollout", "engine"), ("train", "actor")):
            devices = sorted({d for r in roles if r.role == role for d in r.devices})
            held = [r for r in roles if r.role == role or (r.role == "base" and set(r.devices) & set(devices))]
            groups.append(_group(name, devices, held, per_device, budget))
    return DevicePlan(
        placement=placement, num_devices=n,
        num_devices_from="the meshes" if cfg.cluster.num_devices is None else "cluster.num_devices",
        budget=budget, models={t.name: _describe_model(t, models[t.name]) for t in cfg.tasks}, roles=roles,
        per_device=per_device, groups=groups, rollout_batches=rollout_batches(cfg, bases),
        train_batches=train_batches(cfg, bases), backend=backend)


def _group(name: str, devices: list[int], roles: list[RolePlan], per_device: list[int],
           budget: int | None) -> GroupPlan:
    # A shared base never offloads: one role at a time fits only beside every base on the group's devices
    bases = max(sum(r.total for r in roles if r.role == "base" and d in r.devices) for d in devices)
    resident, largest = max(per_device[d] for d in devices), max(r.total for r in roles if r.role != "base") + bases
    fits = None if budget is None else "yes" if resident <= budget else "with offload" if largest <= budget else "no"
    return GroupPlan(name=name, devices=devices, resident=resident, largest_role=largest, fits=fits)


def _describe_model(task: TaskConfig, model: ModelConfig) -> str:
    path = Path(task.model.path)
    source = (f"{path / 'config.json'}" if (path / "config.json").is_file()
              else f"init_preset {task.model.init_preset}, created at {path} by `rlsched train`"
              if task.model.init_preset is not None
              else f"shapes from --model, --model-config or its name: {path} has no config.json here")
    n = model.num_params
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    return (f"{model.describe()} of {size} params in {task.model.dtype}, {model.num_hidden_layers} "
            f"layers, {model.num_key_value_heads} KV heads ({source})")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _size(n: int) -> str:
    return format_bytes(n, digits=1)  # one decimal: the plan's table is read at a glance


def _ranges(devices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for d in devices:
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


# The kinds a role measures from its live arrays (ActorRole / EngineRole `memory()`), by their plan name.
MEASURED_KINDS = {"actor": {"params": "params", "opt": "optimizer", "ref": "reference"},
                  "engine": {"params": "params"}}  # an engine's KV cache exists only inside generate


def measured_vs_plan(task: str, step: int, measured: dict[str, dict[str, int]],
                     planned: dict[str, dict[str, int]]) -> str:
    """One line: each role's bytes per device by kind as measured after `step`, beside the plan's.

    >>> measured_vs_plan("a", 1, {"actor": {"params": 2048, "opt": 4104, "ref": 0}},
    ...                  {"actor": {"params": 2048, "optimizer": 4104, "grads": 2048}})
    '[a] bytes per device after step 1, measured / planned: actor params 2.0 KiB / 2.0 KiB, optimizer 4.0 KiB / 4.0 KiB'
    """
    parts = []
    for role, kinds in MEASURED_KINDS.items():
        if role not in measured:
            continue
        shown = [f"{name}{_shared(measured[role], kind)} {_size(_measured(measured[role], kind))} / "
                 f"{_size(planned[role][name])}" for kind, name in kinds.items() if name in planned.get(role, {})]
        parts.append(f"{role} " + ", ".join(shown))
    return f"[{task}] bytes per device after step {step}, measured / planned: " + "; ".join(parts)


def _measured(held: dict[str, int], kind: str) -> int:
    """A role's bytes of `kind`; a LoRA role reading a shared base (held["base"], counted once in its process,
    workers.shared_base) holds its params as that base plus its adapter, as the plan counts them."""
    return held.get(kind, 0) + (held.get("base", 0) if kind == "params" else 0)


def _shared(held: dict[str, int], kind: str) -> str:
    return " (base shared)" if kind == "params" and held.get("base") else ""


def planned_bytes(task: TaskConfig, index: int) -> dict[str, dict[str, int]]:
    """{"actor": actor_bytes, "engine": engine_bytes} of one task, from its model's config.json."""
    model = read_model_config(task, index, required=True)
    return {"actor": actor_bytes(task, model), "engine": engine_bytes(task, model)}


# What a role holds on a device between phases, the bytes admission counts: an engine's params and its
# largest KV cache, an actor's params, AdamW state and reference (gradients and activations live in a phase).
RESIDENT_KINDS = {"engine": ("params", "kv_cache"), "actor": ("params", "optimizer", "reference")}


def resident_bytes(planned: dict[str, dict[str, int]]) -> dict[str, int]:
    """{"engine": bytes, "actor": bytes} on one device, summed over RESIDENT_KINDS of `planned_bytes`."""
    return {role: sum(planned[role].get(k, 0) for k in kinds) for role, kinds in RESIDENT_KINDS.items()}


def check_budget(cfg: ExperimentConfig) -> None:
    """Every role fits `cluster.memory_budget_gb` on one device by itself (what the scheduler's admission
    counts: an engine's params and KV cache, an actor's params, AdamW state and reference), or one
    ConfigError line with the budget, the role's share by kind and what to change. Before any process."""
    budget = cfg.cluster.memory_budget_gb
    if budget is None:
        return
    for i, task in enumerate(cfg.tasks):
        planned = planned_bytes(task, i)  # a LoRA role reading a shared base: its base is counted in (resident)
        for role, kinds in RESIDENT_KINDS.items():
            parts = {k: planned[role][k] for k in kinds if k in planned[role]}
            need = sum(parts.values())
            if need > budget * GiB:
                shares = " + ".join(f"{k.replace('_', ' ')} {_size(v)}" for k, v in parts.items())
                fix = "rollout.max_batch_size or rollout.mesh" if role == "engine" else "actor.mesh (fsdp)"
                raise ConfigError(f"cluster.memory_budget_gb: {budget:g} GiB per device, but task {task.name}'s "
                                  f"{role} needs {need / GiB:.3g} GiB on one device ({shares}); raise the budget or "
                                  f"split the role wider with tasks.{i}.{fix}")
