"""The GRPO optimizer step as pure functions: the actor's settings and TrainState, the optimizer, log-probabilities
of a policy, and one step's gradient and update (workers.actor runs them as jitted programs on its mesh).

Design decisions:
- `train_step(state, batch) -> (state, metrics)` is one pure function per optimizer step:
  the mini-batch arrives shaped (accumulation, micro, ...) and a `lax.scan` accumulates micro-batch
  gradients, each micro-batch dividing by the whole mini-batch's denominator, so gradient
  accumulation gives exactly the mini-batch gradient. It is two functions, `gradients` then `update`, which the
  actor runs as two jitted programs: the update alone in its program keeps no copy of the state beside the new one,
  and writes the clipped gradient over the gradient (`update`); the co-batched step vmaps the two as one.
- A non-finite loss or gradient skips the update on the device (state unchanged, `skipped` = 1), with no wait
  on the host: one bad batch must never poison the params or a checkpoint.
- On-policy with one optimizer step per GRPO step, `old_logp` is the current logp under
  stop_gradient (ratio == 1), saving a full forward pass; otherwise the caller passes the logprobs
  computed before the first update.
- Logprobs are of logits / temperature: the distribution the rollout engine sampled from. The output head runs on
  chunks of positions (workers.token_logprobs), and with a batch's completion windows (`WINDOW`) on those alone.
- Mixed precision as the field trains (verl's FSDP, MaxText, levanter): a model stored in bfloat16 trains float32
  master weights. The TrainState's params, both Adam moments and the gradient accumulated over micro-batches are
  float32; the forward and the backward run in the model's dtype (`compute_params`). The step's forward may read a
  copy already cast (`gradients`' `served`): the gradient is taken with respect to the model-dtype params and cast
  to float32 before it is summed, which is what the cast's own gradient is, so the update is the same to the bit,
  without the cast beside the copy the actor holds anyway (XLA:CPU kept part of it alive at the step's peak: 3.7 of
  the params' 8.1 MB of bfloat16 on 2 layers of the `small` preset's widths, 2 rows of 512). In bfloat16 alone an
  update under half a unit in the last place is lost (at |w| = 0.02 that is 6e-5, above the field's learning rates)
  and Adam's second moment at b2 0.999 never decays (0.1 % a step is under half an ulp). A float32 model is
  unchanged: its params are its master, no copy is made. A LoRA actor's adapter is float32 already (its master).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from workers import grpo
from workers.models import lora as L
from workers.models import lora_batch as LB
from workers.token_logprobs import target_logprobs, window_logprobs


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActorSettings:
    """Everything the update needs. No defaults here: the control plane builds it from a task's config
    (rlsched.config.spec.actor_settings), so every value that changes results is a config key."""

    lr: float
    total_steps: int  # optimizer steps over the whole run (schedule length)
    warmup_steps: int
    min_lr_ratio: float  # cosine decays to lr * min_lr_ratio, not to zero
    weight_decay: float
    grad_clip: float
    b1: float
    b2: float
    epsilon: float
    epsilon_high: float | None
    beta: float
    aggregation: str
    temperature: float
    micro_batch_size: int
    mini_batch_size: int
    epochs: int
    # Models with experts: weight of the load-balancing loss (workers.models.moe); None: the checkpoint's.
    router_aux_loss_coef: float | None
    # The field's GRPO variants (workers.grpo): kl_clamp clips the k3 KL to [-kl_clamp, kl_clamp] (None: not);
    # max_new_tokens is the completion length the seq-mean-token-sum-norm aggregation divides by.
    kl_clamp: float | None
    max_new_tokens: int | None
    # What each decoder layer's forward keeps for the backward (workers.models.decoder.REMAT_POLICIES): memory and
    # time only, never a result (the backward recomputes the same values)
    remat: str
    # The dtype AdamW stores its first moment in ("float32" or "bfloat16": optax.adamw's mu_dtype)
    adam_mu_dtype: str


class OptimizerValues(NamedTuple):
    """The settings only the optimizer reads, as scalar arrays: the co-batched step's per-member input
    (`optimizer_from`), so that tasks differing in them (a sweep over learning rates, weight decay, warmup, schedule
    length, clipping or Adam's betas) run one program. Nothing else of the optimizer's program depends on their values:
    optax's clip and AdamW compute with traced scalars as with constants, and the schedule (`schedule_from`) takes
    its steps traced. Shapes () each, or (K,) stacked over a co-batched step's members."""

    lr: Any  # float32
    total_steps: Any  # int32
    warmup_steps: Any  # int32
    min_lr_ratio: Any  # float32
    weight_decay: Any  # float32
    grad_clip: Any  # float32
    b1: Any  # float32
    b2: Any  # float32


# The settings OptimizerValues holds: the loss's programs and the co-batched step are the same whatever they are
# (ActorWorker shares them across a sweep of these); None in their place names no value
OPTIMIZER_ONLY = dict.fromkeys(OptimizerValues._fields)
_STEP_FIELDS = ("total_steps", "warmup_steps")  # the int32 ones


class TrainState(NamedTuple):
    params: Any  # nnx.State of the policy, float32 (the master); a LoRA actor's: its adapter (float32),
    # {<module>.lora_a / .lora_b: array}
    opt_state: Any  # optax state
    step: jax.Array  # optimizer steps taken (int32 scalar)


def make_schedule(s: ActorSettings) -> optax.Schedule:
    """Linear warmup to lr, then cosine decay to lr * min_lr_ratio at total_steps."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if s.warmup_steps else s.lr, peak_value=s.lr, warmup_steps=s.warmup_steps,
        decay_steps=max(s.total_steps, s.warmup_steps + 1), end_value=s.lr * s.min_lr_ratio)


class Optimizer(NamedTuple):
    """`optax.chain(clip, step)` kept as its two stages, so that `update` can hand the clipped gradient back.
    `init` is the chain's: its state is the chain's (clip's state, step's state)."""

    clip: optax.GradientTransformation
    step: optax.GradientTransformation

    def init(self, params):
        return optax.chain(self.clip, self.step).init(params)

    def update(self, updates, state, params=None):
        """The chain's update in one: (updates, state)."""
        return optax.chain(self.clip, self.step).update(updates, state, params)


def make_optimizer(s: ActorSettings) -> Optimizer:
    """Gradient clipping by the global norm, then AdamW on `make_schedule`."""
    return Optimizer(optax.clip_by_global_norm(s.grad_clip),
                     optax.adamw(make_schedule(s), b1=s.b1, b2=s.b2, weight_decay=s.weight_decay,
                                 mu_dtype=jnp.dtype(s.adam_mu_dtype)))


def optimizer_values(s: ActorSettings) -> OptimizerValues:
    """`s`'s OPTIMIZER_ONLY settings as numpy scalars (float32, the steps int32): what `optimizer_from` takes."""
    return OptimizerValues(*(np.asarray(getattr(s, name), np.int32 if name in _STEP_FIELDS else np.float32)
                             for name in OptimizerValues._fields))


def schedule_from(v: OptimizerValues) -> optax.Schedule:
    """`make_schedule` from traced values: optax.warmup_cosine_decay_schedule's arithmetic, which checks its steps in
    Python (it needs them static), written out with the steps as arrays. It equals `make_schedule` to the bit where
    1 - min_lr_ratio is the same in float32 as optax's float64 folded to float32 (0, 0.1, 0.3, 1: yes; 0.77: no), else
    within 2 ulp (tests/test_optimizer_values.py)."""
    warmup = v.warmup_steps
    decay = jnp.maximum(v.total_steps, warmup + 1) - warmup  # make_schedule's decay_steps, less the warmup
    init = jnp.where(warmup > 0, 0.0, v.lr)  # no warmup starts at the peak (the ramp below is then never taken)

    def schedule(count):
        # optax.linear_schedule(init, lr, warmup); max(.., 1): no warmup divides nothing by 0 in the branch not taken
        ramp = (init - v.lr) * (1 - jnp.clip(count, 0, warmup) / jnp.maximum(warmup, 1)) + v.lr
        # optax.cosine_decay_schedule(lr, decay, alpha=min_lr_ratio) on the steps after the warmup
        after = jnp.minimum(count - warmup, decay).astype(jnp.float32)
        cosine = 0.5 * (1 + jnp.cos(jnp.pi * after / decay))
        return jnp.where(count < warmup, ramp, v.lr * ((1 - v.min_lr_ratio) * cosine + v.min_lr_ratio))

    return schedule


def optimizer_from(v: OptimizerValues, adam_mu_dtype: str) -> Optimizer:
    """`make_optimizer` from traced values (`OptimizerValues`): the same transformations, whose state has the same
    structure (a weight decay traced is applied even at 0, adding 0 * params: the same values). Its arithmetic is
    `make_optimizer`'s but for three constants optax folds in float64 there and computes here from float32 values:
    1 - b1, 1 - b2 and 1 - min_lr_ratio, apart by the rounding of b1, b2, min_lr_ratio to float32 (1.3e-5 of 1 - b2
    at b2 0.999, relative; tests/test_optimizer_values.py), which a co-batched step's own rounding covers
    (tests/test_cotrain.py)."""
    return Optimizer(optax.clip_by_global_norm(v.grad_clip),
                     optax.adamw(schedule_from(v), b1=v.b1, b2=v.b2, weight_decay=v.weight_decay,
                                 mu_dtype=jnp.dtype(adam_mu_dtype)))


# The batch key of each row's completion window start (workers.batch), and the keys with one value per row
WINDOW = "completion_start"
ROW_KEYS = ("advantages", WINDOW)

MASTER_DTYPE = jnp.float32  # what the optimizer updates, whatever the model's dtype


def floating(x) -> bool:
    """Whether `x` holds floating-point values (what a cast between precisions changes)."""
    return jnp.issubdtype(x.dtype, jnp.floating)


def master_params(params):
    """The float32 master copy of a model's params; the params themselves where they are float32 already."""
    return jax.tree.map(lambda x: x.astype(MASTER_DTYPE) if floating(x) and x.dtype != MASTER_DTYPE else x, params)


def compute_params(params, dtype):
    """`params` in the model's dtype `dtype` (what the forward computes in and the engine serves), rounded to
    nearest even; the params themselves where they are in it already (a float32 model: nothing is done)."""
    dtype = jnp.dtype(dtype)
    return jax.tree.map(lambda x: x.astype(dtype) if floating(x) and x.dtype != dtype else x, params)


def policy_model(graphdef, params, base, lora, rows: int, *, row=0, dtype=None):
    """(the policy's model, its adapter batch or None) for a batch of `rows`. `base` None: `params` is the whole
    model's state, cast to `dtype` (the model's, when `params` is a float32 master) before the forward. Else `base`
    is the frozen model's state and `params` one LoRA adapter (flat) of LoraSpec `lora`, applied to every row; `row`
    -1 turns it off (the base: a LoRA actor's reference)."""
    if base is None:
        params = params if dtype is None else compute_params(params, dtype)
        return nnx.merge(graphdef, params), None
    return nnx.merge(graphdef, base), LB.stack([params], [lora], jnp.full(rows, row, jnp.int32), dense=True)


def policy_logprobs(graphdef, params, base, lora, tokens, attention_mask, *, temperature, router_loss: bool = False,
                    row=0, dtype=None, remat: str = "off", start=None,
                    width: int | None = None, rows=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`policy_model`'s log p(tokens[:, 1:]) (B, T-1), its entropy there (B, T-1, no gradient) and the MoE
    load-balancing loss (0 without `router_loss`), all float32, for tokens, attention_mask (B, T): the output head
    runs on chunks of positions (workers.token_logprobs), so no [B, T, V] float32 logits are ever alive, in the
    forward or the backward. `remat`: what each decoder layer keeps for a backward (the update's: `layers`).
    `start` int (B,) and a static `width`: the head runs on logprob positions [start_i, start_i + width) of each row
    only (a train batch's completion windows: workers.batch), log p and entropy are 0 elsewhere. `rows`: the
    residual stream's layout on the actor's mesh (CausalLM.forward; None on one device)."""
    if (start is None) != (width is None):
        raise ValueError(f"give a completion window's start and width together, got start {start!r}, width {width!r}")
    model, adapters = policy_model(graphdef, params, base, lora, tokens.shape[0], row=row, dtype=dtype)
    hidden, aux = model.hidden_states(tokens, attention_mask=attention_mask, adapters=adapters,
                                      router_loss=router_loss, remat=remat, rows=rows)
    head = lambda h: model.logits(h, adapters)  # noqa: E731
    if start is None:
        logp, entropy = target_logprobs(head, hidden[:, :-1], tokens[:, 1:], temperature=temperature)
    else:
        logp, entropy = window_logprobs(head, hidden[:, :-1], tokens[:, 1:], start, width, temperature=temperature)
    return logp, entropy, aux


def token_logprobs(graphdef, params, tokens, attention_mask, base=None, row=0, *, temperature,
                   lora=None, dtype=None, rows=None) -> jax.Array:
    """tokens, attention_mask (B, T) -> log p(tokens[:, 1:]) (B, T-1), float32 (`policy_logprobs`). A LoRA
    actor passes `row` as a traced int32 (0: its policy, -1: its reference, the base): both are one executable,
    so a fresh adapter's logprobs equal its reference's bit for bit (XLA fuses a program without the adapter
    otherwise, about 1e-6 away)."""
    return policy_logprobs(graphdef, params, base, lora, tokens, attention_mask, temperature=temperature, row=row,
                           dtype=dtype, rows=rows)[0]


def window_token_logprobs(graphdef, params, tokens, attention_mask, start, base=None, row=0, *, width: int,
                          temperature, lora=None, dtype=None, rows=None) -> jax.Array:
    """`token_logprobs` in each row's completion window only: start int (B,), positions [start_i, start_i + width)
    of the (B, T-1) result; 0 elsewhere (`policy_logprobs`)."""
    return policy_logprobs(graphdef, params, base, lora, tokens, attention_mask, temperature=temperature, row=row,
                           dtype=dtype, start=start, width=width, rows=rows)[0]


def router_aux_coef(settings: ActorSettings, config) -> float:
    """The load-balancing loss weight a model trains with: 0 without experts, else the setting, else the
    checkpoint's `router_aux_loss_coef`."""
    if not getattr(config, "num_experts", 0):
        return 0.0
    coef = settings.router_aux_loss_coef
    return float(config.router_aux_loss_coef if coef is None else coef)


def train_step(state: TrainState, batch: dict, base=None, served=None, *, graphdef, tx, settings: ActorSettings,
               lora: L.LoraSpec | None = None, dtype=None, platform: str | None = None, rows=None):
    """One optimizer step over a mini-batch shaped (A, micro, ...) -> (new state, metrics): `gradients`, then
    `update` where they are finite, in one function (the co-batched step vmaps it, workers.actor_cobatch).
    ActorWorker alone runs them as two programs, the same arithmetic (see `update`, and its `platform`). `rows`:
    the residual stream's layout (`gradients`)."""
    grads, metrics = gradients(state, batch, base, served, graphdef=graphdef, settings=settings, lora=lora,
                               dtype=dtype, rows=rows)
    return update(state, grads, metrics["skipped"] == 0, tx=tx, platform=platform)[0], metrics


def gradients(state: TrainState, batch: dict, base=None, served=None, *, graphdef, settings: ActorSettings,
              lora: L.LoraSpec | None = None, dtype=None, rows=None):
    """The gradient of one optimizer step's loss over a mini-batch shaped (A, micro, ...) -> (grads, metrics):
    grads as state.params (the master's dtype), summed over the micro-batches; metrics["skipped"] 1 where the loss or
    the gradient is not finite (`update` then leaves the state as it was).

    batch keys: tokens, attention_mask (A, M, T); loss_mask (A, M, T-1); advantages (A, M);
    optional old_logp, ref_logp (A, M, T-1); optional completion_start (A, M): the output head then runs on each
    row's window of settings.max_new_tokens positions from it, where every loss-mask position lies.
    `base`: a LoRA actor's frozen model (state.params its adapter).
    `dtype`: the model's, which the forward and backward compute in (state.params are the float32 master); the
    gradients, their sum over micro-batches and the optimizer's moments are the master's dtype. `served` (with
    `dtype`): state.params already cast to `dtype` (`compute_params`), which the forward reads; the gradient with
    respect to it, cast to the master's dtype, is the cast's gradient, so the step is the one that casts inside
    (served None), without the params-sized temporary that cast allocates. `rows`: the residual stream's layout on
    the actor's mesh (policy_logprobs).
    """
    s = settings
    # a batch with completion windows (workers.batch; ActorWorker.windowed checks them) runs the head on those alone
    width = s.max_new_tokens if WINDOW in batch else None
    denominator = grpo.loss_denominator(batch["loss_mask"].reshape(-1, batch["loss_mask"].shape[-1]), s.aggregation,
                                        s.max_new_tokens)
    aux_coef = s.router_aux_loss_coef or 0.0  # resolved against the model by ActorWorker (router_aux_coef)
    micro_batches = batch["tokens"].shape[0]

    # What the gradient is taken with respect to: the held copy in the model's dtype, else the master (cast inside)
    wrt, cast = (state.params, dtype) if served is None else (served, None)

    def micro_loss(params, mb):
        # with aux_coef, the router's load-balancing loss too, averaged over the mini-batch's micro-batches
        logp, entropy, aux = policy_logprobs(graphdef, params, base, lora, mb["tokens"], mb["attention_mask"],
                                             temperature=s.temperature, router_loss=bool(aux_coef), dtype=cast,
                                             remat=s.remat, start=mb.get(WINDOW), width=width, rows=rows)
        old = mb["old_logp"] if "old_logp" in mb else jax.lax.stop_gradient(logp)
        loss, m = grpo.policy_loss(logp, old, mb.get("ref_logp"), mb["advantages"], mb["loss_mask"],
                                   epsilon=s.epsilon, epsilon_high=s.epsilon_high, beta=s.beta,
                                   aggregation=s.aggregation, denominator=denominator, kl_clamp=s.kl_clamp,
                                   entropy=entropy, sampler_logp=mb.get("sampler_logp"))
        aux = aux / micro_batches
        return loss + aux_coef * aux, {**m, "router_aux_loss": aux}  # the metric: the unweighted loss

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def accumulate(carry, mb):
        grads, sums = carry
        (_, m), g = grad_fn(wrt, mb)
        tok = m["tokens"]
        sums = {"loss": sums["loss"] + m["loss"], "tokens": sums["tokens"] + tok,
                "router_aux_loss": sums["router_aux_loss"] + m["router_aux_loss"],
                **{k: sums[k] + m[k] * tok for k in grpo.TOKEN_MEAN_METRICS},
                **{k: jnp.maximum(sums[k], m[k]) for k in grpo.MAX_METRICS}}
        # a model-dtype gradient (`served`) to the master's dtype, as the cast's gradient does, then summed there
        return (jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g), sums), None

    zeros = jax.tree.map(jnp.zeros_like, state.params)  # the master's dtype: float32 sums of the micro-batches
    init = {k: jnp.zeros((), jnp.float32) for k in ("loss", "tokens", "router_aux_loss", *grpo.TOKEN_MEAN_METRICS,
                                                     *grpo.MAX_METRICS)}
    (grads, sums), _ = jax.lax.scan(accumulate, (zeros, init), batch)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)
    tokens = jnp.maximum(sums["tokens"], 1.0)
    metrics = {"loss": sums["loss"], "grad_norm": grad_norm, "skipped": (~finite).astype(jnp.float32),
               **{k: sums[k] / tokens for k in grpo.TOKEN_MEAN_METRICS}, **{k: sums[k] for k in grpo.MAX_METRICS}}
    if aux_coef:
        metrics["router_aux_loss"] = sums["router_aux_loss"]
    return grads, metrics


def update(state: TrainState, grads, finite, *, tx: Optimizer, platform: str | None = None) -> tuple[TrainState, Any]:
    """The optimizer's step with `grads` (as state.params) where `finite` (a bool scalar), else `state` as it is:
    (the new state, the clipped gradient, or `grads` where the step was skipped).

    Which of a branch and a select of the new state against the old keeps no copy of the state beside the new one
    (alone in its program, ActorWorker's `update`) depends on the compiler, so each backend gets the one that does:
    XLA:GPU's conditional copies its operands in and out (4 x the float32 master, 60 GiB of temporaries at 4B, for
    an H100 without a GPU: benchmarks/gpu_memory.py), its select fuses into the step and writes in place (none);
    XLA:CPU keeps the branch in place (8e-4 MiB at 4B) and materialises the select's operands (1.6 x the master at
    0.6B). The clipped gradient is an output so that its program can write it over the gradient it is given
    (donated): as a temporary it was a float32 copy of the params, alive through the step (optax.clip_by_global_norm's
    select, which XLA:CPU materializes for the two moments it feeds). XLA:CPU's temporaries, float32 params beside
    their gradient: 1.0 x the params with optax.chain(clip, adamw) as one transformation, none this way. The
    arithmetic is the chain's (the clip's output, then AdamW on it), though XLA rounded the chain's second moment
    differently in the last bit where it fused the clip into it. The same branch inside the gradient's program kept
    more (1.65 x, bfloat16 models), hence two programs. Under vmap (the co-batched step) a batched `finite` makes
    the branch a select too.

    `platform`: the devices' the program is lowered for ("cpu", "gpu", ...), where the caller knows it: only that
    platform's way is traced. None: both are, and the lowering keeps its platform's (jax.lax.platform_dependent);
    tracing the optimizer's step twice was ~40 % of the update program's trace and lowering (Qwen3-0.6B's shape:
    the step's ~310 leaves)."""

    def apply(params, opt_state, grads):
        clip_state, step_state = opt_state  # optax.chain's state: one per stage
        grads, clip_state = tx.clip.update(grads, clip_state, params)
        updates, step_state = tx.step.update(grads, step_state, params)
        return optax.apply_updates(params, updates), (clip_state, step_state), grads

    def keep(params, opt_state, grads):
        return params, opt_state, grads

    def branch(*args):
        return jax.lax.cond(finite, apply, keep, *args)

    def select(*args):
        return jax.tree.map(lambda new, old: jnp.where(finite, new, old), apply(*args), keep(*args))

    if platform is not None:
        params, opt_state, grads = (branch if platform == "cpu" else select)(state.params, state.opt_state, grads)
    else:  # resolved as the program is lowered for its one platform: only that platform's function is in it
        params, opt_state, grads = jax.lax.platform_dependent(state.params, state.opt_state, grads, cpu=branch,
                                                              default=select)
    return TrainState(params, opt_state, state.step + finite.astype(jnp.int32)), grads
