"""The JAX actor worker: a TrainState, per-token logprobs, the GRPO update, weight export.

Design decisions:
- `train_step(state, batch) -> (state, metrics)` is one pure function per optimizer step:
  the mini-batch arrives shaped (accumulation, micro, ...) and a `lax.scan` accumulates micro-batch
  gradients, each micro-batch dividing by the whole mini-batch's denominator, so gradient
  accumulation gives exactly the mini-batch gradient. It is two functions, `gradients` then `update`, which the
  actor runs as two jitted programs: the update alone in its program keeps no copy of the state beside the new one
  (`update`), the same arithmetic to the bit; the co-batched step vmaps the two as one.
- A non-finite loss or gradient skips the update on the device (state unchanged, `skipped` = 1), with no wait
  on the host: one bad batch must never poison the params or a checkpoint.
- On-policy with one optimizer step per GRPO step, `old_logp` is the current logp under
  stop_gradient (ratio == 1), saving a full forward pass; otherwise the caller passes the logprobs
  computed before the first update.
- Logprobs are of logits / temperature: the distribution the rollout engine sampled from.
- Sequences arrive right-padded [prompt, completion, pad] to a length bucket (workers.batch, host
  work in the task's driver) so a run compiles a few programs, not one per step.
- The output head runs only where completions can be: a run's batch carries each row's `completion_start`, and its
  completion lies in the static window [start, start + max_new_tokens) of log-prob positions, so every program that
  computes logprobs for training (`train`, `logprobs`, `reference_logprobs`, the co-batched step) gathers those
  positions' hidden states, runs the head there (workers.token_logprobs.window_logprobs) and scatters the results
  back to (N, T-1), zeros elsewhere (nothing reads them: the loss reads where loss_mask is 1). The same values at
  completion positions as the head on every position, to float rounding (tests/test_window.py); a batch without
  windows, or with completions outside them, runs the head everywhere (`windowed`). Programs of the two paths differ
  by their batch keys.
- `prepare(size, length)` compiles a batch's programs ahead of time from the state's shapes and shardings
  only (the state may be on host): the task does it before asking for the train lock, so no task compiles
  while it holds one. `train` runs those executables; a shape nobody prepared compiles on first use.
- The actor lives on a mesh (dp x fsdp x ep x tp, one device by default) and every program is compiled
  with explicit in/out shardings from workers.models.sharding: parameters and optimizer moments as
  the table says, batch rows over dp x fsdp x ep, metrics replicated. The state comes back in the layout it
  went in, so nothing is ever gathered whole onto one device between steps.
- A LoRA actor (`lora`: workers.models.lora) trains its adapter only: the TrainState's params are the adapter's
  A and B matrices (a flat dict, each laid out like the projection it adapts), the optimizer holds their moments
  only, and the base's params are a frozen argument of every program (never differentiated, never donated). Its
  KL reference is the base with the adapter off, so it keeps no reference copy; what it publishes is the adapter.
- Co-batched TRAIN (`train(..., together=)`, workers.actor_cobatch): when the scheduler grants one train hold to
  several LoRA tasks of a base group, each task's thread computes its own logprobs (old and ref) and its own
  mini-batches (its own rng), then the members meet and one thread runs all their optimizer steps, one program per
  step: `jax.vmap(train_step)` over their stacked states and mini-batches, the shared base unbatched. vmap, not a
  loop: one pass over the base's weights serves every member's rows (bigger matmuls, one launch), and each member's
  gradient, optimizer state and schedule stay its own. K members are padded to a power of two (member 0 repeated,
  its copies' results dropped) so a base group compiles log2(K) programs; members of another length bucket or
  settings run in their own program of the same run. Each member's result is what it gets alone to float rounding
  (a batched program rounds row reductions differently; AdamW magnifies that in the params: actor_cobatch's
  docstring has the measurements), and bit for bit the same whoever its partners are. A full-weight actor, or a
  LoRA actor with a base of its own, trains alone whatever the hold.
- Mixed precision as the field trains (verl's FSDP, MaxText, levanter): a model stored in bfloat16 trains float32
  master weights. The TrainState's params, both Adam moments and the gradient accumulated over micro-batches are
  float32; the forward and the backward run in the model's dtype; what the engine serves (`export_weights`,
  `params_flat`) is the master rounded to the model's dtype on the devices, once per state (`served`). The update's
  forward reads that very copy (the train program's `served` argument) rather than casting the master again inside
  the step: the gradient is taken with respect to the model-dtype params and cast to float32 before it is summed,
  which is what the cast's own gradient is, so the update is the same to the bit, without the cast beside the copy
  the actor holds anyway (XLA:CPU kept part of it alive at the step's peak: 3.7 of the params' 8.1 MB of bfloat16
  on 2 layers of the `small` preset's widths, 2 rows of 512). In bfloat16 alone an update under half a unit in the
  last place is lost (at |w| = 0.02 that is 6e-5, above the field's learning rates) and Adam's second moment at b2
  0.999 never decays (0.1 % a step is under half an ulp). A float32 model is unchanged: its params are its master, no
  copy is made. A LoRA actor's adapter is float32 already (its master); its base stays frozen in the model's dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from workers import actor_cobatch, grpo
from workers.batch import TrainBatch
from workers.compiling import compile_once, shapes_key, shared
from workers.models import lora as L
from workers.models import lora_batch as LB
from workers.models import params as P
from workers.models import sharding as S
from workers.models.decoder import CausalLM
from workers.multihost import global_array, host_value
from workers.offload import offload, onload, per_device_bytes
from workers.token_logprobs import target_logprobs, window_logprobs


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActorSettings:
    """Everything the update needs. No defaults here: the control plane builds it from a task's config
    (rlsched.run.roles.actor_settings), so every value that changes results is a config key."""

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


class TrainState(NamedTuple):
    params: Any  # nnx.State of the policy, float32 (the master); a LoRA actor's: its adapter (float32),
    # {<module>.lora_a / .lora_b: array}
    opt_state: Any  # optax state
    step: jax.Array  # optimizer steps taken (int32 scalar)


@dataclasses.dataclass(frozen=True)
class WeightSnapshot:
    flat: dict[str, jax.Array]  # the live params by rlsched flat name (workers.models.params), on the mesh:
    # valid until the next update or offload frees them (a channel copies or sends them before that)
    version: int  # bumps after every TRAIN
    checksum: str  # params.checksum, computed on the devices


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


# The batch key of each row's completion window start (workers.batch), and the keys with one value per row
WINDOW = "completion_start"
ROW_KEYS = ("advantages", WINDOW)

MASTER_DTYPE = jnp.float32  # what the optimizer updates, whatever the model's dtype


def _floating(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def master_params(params):
    """The float32 master copy of a model's params; the params themselves where they are float32 already."""
    return jax.tree.map(lambda x: x.astype(MASTER_DTYPE) if _floating(x) and x.dtype != MASTER_DTYPE else x, params)


def compute_params(params, dtype):
    """`params` in the model's dtype `dtype` (what the forward computes in and the engine serves), rounded to
    nearest even; the params themselves where they are in it already (a float32 model: nothing is done)."""
    dtype = jnp.dtype(dtype)
    return jax.tree.map(lambda x: x.astype(dtype) if _floating(x) and x.dtype != dtype else x, params)


def policy_model(graphdef, params, base, lora, rows: int, *, row=0, dtype=None):
    """(the policy's model, its adapter batch or None) for a batch of `rows`. `base` None: `params` is the whole
    model's state, cast to `dtype` (the model's, when `params` is a float32 master) before the forward. Else `base`
    is the frozen model's state and `params` one LoRA adapter (flat) of LoraSpec `lora`, applied to every row; `row`
    -1 turns it off (the base: a LoRA actor's reference)."""
    if base is None:
        params = params if dtype is None else compute_params(params, dtype)
        return nnx.merge(graphdef, params), None
    return nnx.merge(graphdef, base), LB.stack([params], [lora], jnp.full(rows, row, jnp.int32))


def policy_logprobs(graphdef, params, base, lora, tokens, attention_mask, *, temperature, router_loss: bool = False,
                    row=0, dtype=None, remat: str = "off", start=None,
                    width: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`policy_model`'s log p(tokens[:, 1:]) (B, T-1), its entropy there (B, T-1, no gradient) and the MoE
    load-balancing loss (0 without `router_loss`), all float32, for tokens, attention_mask (B, T): the output head
    runs on chunks of positions (workers.token_logprobs), so no [B, T, V] float32 logits are ever alive, in the
    forward or the backward. `remat`: what each decoder layer keeps for a backward (the update's: `layers`).
    `start` int (B,) and a static `width`: the head runs on logprob positions [start_i, start_i + width) of each row
    only (a train batch's completion windows: workers.batch), log p and entropy are 0 elsewhere."""
    if (start is None) != (width is None):
        raise ValueError(f"give a completion window's start and width together, got start {start!r}, width {width!r}")
    model, adapters = policy_model(graphdef, params, base, lora, tokens.shape[0], row=row, dtype=dtype)
    hidden, aux = model.hidden_states(tokens, attention_mask=attention_mask, adapters=adapters,
                                      router_loss=router_loss, remat=remat)
    head = lambda h: model.logits(h, adapters)  # noqa: E731
    if start is None:
        logp, entropy = target_logprobs(head, hidden[:, :-1], tokens[:, 1:], temperature=temperature)
    else:
        logp, entropy = window_logprobs(head, hidden[:, :-1], tokens[:, 1:], start, width, temperature=temperature)
    return logp, entropy, aux


def token_logprobs(graphdef, params, tokens, attention_mask, base=None, row=0, *, temperature,
                   lora=None, dtype=None) -> jax.Array:
    """tokens, attention_mask (B, T) -> log p(tokens[:, 1:]) (B, T-1), float32 (`policy_logprobs`). A LoRA
    actor passes `row` as a traced int32 (0: its policy, -1: its reference, the base): both are one executable,
    so a fresh adapter's logprobs equal its reference's bit for bit (XLA fuses a program without the adapter
    otherwise, about 1e-6 away)."""
    return policy_logprobs(graphdef, params, base, lora, tokens, attention_mask, temperature=temperature, row=row,
                           dtype=dtype)[0]


def window_token_logprobs(graphdef, params, tokens, attention_mask, start, base=None, row=0, *, width: int,
                          temperature, lora=None, dtype=None) -> jax.Array:
    """`token_logprobs` in each row's completion window only: start int (B,), positions [start_i, start_i + width)
    of the (B, T-1) result; 0 elsewhere (`policy_logprobs`)."""
    return policy_logprobs(graphdef, params, base, lora, tokens, attention_mask, temperature=temperature, row=row,
                           dtype=dtype, start=start, width=width)[0]


def router_aux_coef(settings: ActorSettings, config) -> float:
    """The load-balancing loss weight a model trains with: 0 without experts, else the setting, else the
    checkpoint's `router_aux_loss_coef`."""
    if not getattr(config, "num_experts", 0):
        return 0.0
    coef = settings.router_aux_loss_coef
    return float(config.router_aux_loss_coef if coef is None else coef)


def train_step(state: TrainState, batch: dict, base=None, served=None, *, graphdef, tx, settings: ActorSettings,
               lora: L.LoraSpec | None = None, dtype=None):
    """One optimizer step over a mini-batch shaped (A, micro, ...) -> (new state, metrics): `gradients`, then
    `update` where they are finite, in one function (the co-batched step vmaps it, workers.actor_cobatch).
    ActorWorker alone runs them as two programs, the same arithmetic (see `update`)."""
    grads, metrics = gradients(state, batch, base, served, graphdef=graphdef, settings=settings, lora=lora,
                               dtype=dtype)
    return update(state, grads, metrics["skipped"] == 0, tx=tx)[0], metrics


def gradients(state: TrainState, batch: dict, base=None, served=None, *, graphdef, settings: ActorSettings,
              lora: L.LoraSpec | None = None, dtype=None):
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
    (served None), without the params-sized temporary that cast allocates.
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
                                             remat=s.remat, start=mb.get(WINDOW), width=width)
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


def update(state: TrainState, grads, finite, *, tx: Optimizer) -> tuple[TrainState, Any]:
    """The optimizer's step with `grads` (as state.params) where `finite` (a bool scalar), else `state` as it is:
    (the new state, the clipped gradient, or `grads` where the step was skipped).

    A branch, not a select of the new state against the old: alone in its program (ActorWorker's `update`), the
    branch keeps no copy of the state beside the new one. The clipped gradient is an output so that its program can
    write it over the gradient it is given (donated): as a temporary it was a float32 copy of the params, alive
    through the step (optax.clip_by_global_norm's select, which XLA:CPU materializes for the two moments it feeds).
    XLA:CPU's temporaries, float32 params beside their gradient: 1.0 x the params with optax.chain(clip, adamw) as one
    transformation, none this way. The arithmetic is the chain's (the clip's output, then AdamW on it), though XLA
    rounded the chain's second moment differently in the last bit where it fused the clip into it. The same branch
    inside the gradient's program kept more (1.65 x, bfloat16 models), hence two programs. Under vmap (the co-batched
    step) a batched `finite` makes it that select."""

    def apply(params, opt_state, grads):
        clip_state, step_state = opt_state  # optax.chain's state: one per stage
        grads, clip_state = tx.clip.update(grads, clip_state, params)
        updates, step_state = tx.step.update(grads, step_state, params)
        return optax.apply_updates(params, updates), (clip_state, step_state), grads

    params, opt_state, grads = jax.lax.cond(finite, apply, lambda params, opt_state, grads: (params, opt_state, grads),
                                            state.params, state.opt_state, grads)
    return TrainState(params, opt_state, state.step + finite.astype(jnp.int32)), grads


@contextlib.contextmanager
def _no_span(name: str, **attrs):
    yield {}


class ActorWorker:
    """Holds the policy's TrainState (and frozen reference params when beta > 0) on its mesh; a LoRA actor holds
    its adapter's TrainState and the frozen base it adapts (which is also its reference)."""

    def __init__(self, model: CausalLM | None, settings: ActorSettings, *, seed: int = 0, mesh=None,
                 lora: L.LoraSpec | None = None, base=None, offload_reference: bool = False):
        """mesh: a `jax.sharding.Mesh` with axes (dp, fsdp, ep, tp) (workers.models.sharding.mesh); default:
        this process's first device. The actor owns `model`'s arrays: where they are laid out as its mesh wants, it
        holds them as they are (no copy), and its updates donate them, so `model` is not read after training.
        `lora`: train a fresh adapter (B = 0: step 0 is the base) on `model`.
        `base` (a LoRA actor only, `model` None): a workers.shared_base.Lease on the base, laid out on `mesh`, whose
        arrays other holders read too: this actor never offloads or frees them, and `release` gives the lease back.
        `offload_reference` (a full-weight actor with beta > 0; nothing for the others): the frozen reference's params
        lie in host memory but while its log-probs are computed (`train`), so the update's programs run without them,
        at the cost of a host round trip of the reference per step (actor.offload_reference)."""
        if settings.mini_batch_size % settings.micro_batch_size:
            raise ValueError(f"mini_batch_size {settings.mini_batch_size} is not a multiple of micro_batch_size "
                             f"{settings.micro_batch_size}")
        if (base is None) == (model is None) or (base is not None and lora is None):
            raise ValueError("give an ActorWorker its model, or (a LoRA actor) a shared base's lease, not both")
        self.config = model.config if base is None else base.config
        self.settings = dataclasses.replace(settings, router_aux_loss_coef=router_aux_coef(settings, self.config))
        self.mesh = mesh if mesh is not None else S.mesh({}, jax.devices()[:1])
        rows = S.batch_rows(dict(self.mesh.shape))
        if settings.micro_batch_size % rows:
            raise S.ShardingError(f"micro_batch_size {settings.micro_batch_size} does not split over "
                                  f"{S.describe_rows(dict(self.mesh.shape))}")
        self.tx = make_optimizer(settings)
        self._lease = base
        if base is None:
            self.graphdef, params = nnx.split(model)
            param_sh = S.state_shardings(params, self.mesh, kv_heads=self.config.num_key_value_heads)
            params = jax.device_put(params, param_sh)
        else:  # the shared base's arrays as they are (workers.shared_base): laid out for this very mesh
            if base.mesh != self.mesh:
                raise ValueError(f"the shared base is laid out on {base.mesh}, this actor's mesh is {self.mesh}")
            self.graphdef, params, param_sh = base.graphdef, base.params, base.shardings
        self.lora = lora
        # A LoRA actor's frozen base (None for a full-weight actor): an argument of every program, never donated
        self.base, self.base_shardings = (params, param_sh) if lora is not None else (None, None)
        # The dtype the forward computes in and the engine is served, where it is not the master's: a full-weight
        # bfloat16 model (None: the params are what is served, a float32 model or a LoRA adapter)
        self.dtype = None
        if lora is not None:  # what it trains is the adapter, laid out like the projections it adapts
            adapter = LB.init_adapter(self.config, lora, jax.random.key(seed))
            param_sh = S.adapter_shardings(P.to_flat(param_sh), adapter)
            params = jax.device_put(adapter, param_sh)
        elif any(_floating(x) and x.dtype != MASTER_DTYPE for x in jax.tree.leaves(params)):
            self.dtype = jnp.dtype(self.config.dtype)
            served, params = params, jax.jit(master_params, in_shardings=(param_sh,), out_shardings=param_sh)(params)
        repl = S.replicated(self.mesh)
        opt_sh = optax.tree_map_params(self.tx, lambda _, sh: sh, jax.eval_shape(self.tx.init, params), param_sh,
                                       transform_non_params=lambda _: repl)
        self.shardings = TrainState(param_sh, opt_sh, repl)
        opt_state = jax.jit(self.tx.init, in_shardings=(param_sh,), out_shardings=opt_sh)(params)
        self.state = TrainState(params, opt_state, jax.device_put(jnp.zeros((), jnp.int32), repl))
        # A separate copy: the policy's buffers are donated to train_step and change every update (a master's are
        # another array: the model's own params are the reference, in its dtype). A LoRA actor's reference is its
        # base, adapter off (the `logprobs` program with row -1).
        self.ref_params = self.base if lora is not None else None if settings.beta <= 0 else \
            served if self.dtype is not None else jax.tree.map(jnp.copy, params)
        # The reference in host memory between its log-probs (`train`, with offload_reference): workers.offload's
        self.offload_reference = offload_reference and lora is None and self.ref_params is not None
        self._ref_host = None
        self._served: tuple | None = None  # (the state, its params in self.dtype): what export_weights last cast
        self.version = 0
        self.seed = seed
        self._host = None  # (state, ref_params, served or None) while offloaded
        self._programs: dict = {}
        self._prepared: dict = {}  # (kind, batch keys, shapes) -> executable compiled ahead (`prepare`)
        abstract = lambda tree, sh: jax.tree.map(  # noqa: E731
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
        self._abstract = abstract(self.state, self.shardings)
        self._abstract_base = () if lora is None else (abstract(self.base, self.base_shardings),
                                                       jax.ShapeDtypeStruct((), jnp.int32, sharding=repl))
        # The served copy a bfloat16 actor's train program reads (`served`): the model's dtype, the master's layout
        self._abstract_served = None if self.dtype is None else abstract(
            jax.eval_shape(partial(compute_params, dtype=self.dtype), self._abstract.params), param_sh)
        # The reference's params, where they are not the policy's shapes and dtypes (a master's reference is in the
        # model's dtype): a logprobs program of its own, `reference_logprobs`
        self._abstract_ref = abstract(self.ref_params, param_sh) if self.dtype is not None and settings.beta > 0 \
            else None
        # What this worker's programs depend on besides the batch: actors of tasks with the same model, settings
        # and layout (a sweep over seeds or data) share their executables within a process (compiling.shared).
        self._signature = ("actor", self.graphdef, settings, lora, self.mesh, jax.tree.structure(self._abstract),
                           tuple(jax.tree.leaves(self._abstract)))

    def step_function(self):
        """`train_step` with this actor's static parts bound: (state, batch[, base]) -> (state, metrics), not yet
        jitted (workers.actor_cobatch vmaps it over a hold's members)."""
        return partial(train_step, graphdef=self.graphdef, tx=self.tx, settings=self.settings, lora=self.lora,
                       dtype=self.dtype)

    def gradient_function(self):
        """`gradients` with this actor's static parts bound: (state, batch[, base[, served]]) -> (grads, metrics)."""
        return partial(gradients, graphdef=self.graphdef, settings=self.settings, lora=self.lora, dtype=self.dtype)

    def _program(self, kind: str, keys: tuple[str, ...] = ()):
        """The jitted train step's gradient program (per set of batch keys), its update program, or a logprobs
        program, with explicit shardings."""
        if (kind, keys) in self._programs:
            return self._programs[kind, keys]
        repl, param_sh = S.replicated(self.mesh), self.shardings.params
        # A LoRA actor's frozen base (and the logprobs' adapter row): arguments, never constants
        base_sh = () if self.lora is None else (self.base_shardings, repl)
        if kind == "train":  # the gradient: batch arrays (A, M, ...), rows (M) over dp x fsdp x ep; then `_train_args`
            batch_sh = {k: S.batch_sharding(self.mesh, 2 if k in ROW_KEYS else 3, leading=1) for k in keys}
            frozen_sh = base_sh[:1] if self.dtype is None else (None, param_sh)
            fn = jax.jit(self.gradient_function(), in_shardings=(self.shardings, batch_sh, *frozen_sh),
                         out_shardings=(self.shardings.params, repl))
        elif kind == "update":  # (state, grads, the gradient's metrics["skipped"]) -> (state, clipped grads), both
            # in place of their arguments (`update`)
            fn = jax.jit(lambda state, grads, skipped: update(state, grads, skipped == 0, tx=self.tx),
                         in_shardings=(self.shardings, self.shardings.params, repl),
                         out_shardings=(self.shardings, self.shardings.params), donate_argnums=(0, 1))
        elif kind == "served":  # the master's params -> the model's dtype, laid out alike
            fn = jax.jit(partial(compute_params, dtype=self.dtype), in_shardings=(param_sh,), out_shardings=param_sh)
        else:  # (params, tokens, mask[, completion_start][, base, row]) -> logprobs (B, T-1), rows over
            # dp x fsdp x ep; `logprobs` and `reference_logprobs` (a master's reference, in the model's dtype) are one
            # function; keys (WINDOW,): the head on the completion windows only
            rows, window = S.batch_sharding(self.mesh, 2), keys == (WINDOW,)
            fn = partial(window_token_logprobs, width=self.settings.max_new_tokens) if window else token_logprobs
            starts = (S.batch_sharding(self.mesh, 1),) if window else ()
            fn = jax.jit(partial(fn, self.graphdef, temperature=self.settings.temperature, lora=self.lora,
                                 dtype=self.dtype),
                         in_shardings=(param_sh, rows, rows, *starts, *base_sh), out_shardings=rows)
        self._programs[kind, keys] = fn
        return fn

    def prepare(self, size: int, length: int) -> int:
        """Compile the programs `train` runs on a batch of `size` rows of `length` tokens, ahead of it and
        without the state on the devices; returns how many were compiled now (0: all were ready)."""
        s, compiled = self.settings, 0
        m, off_policy = s.micro_batch_size, self._off_policy(size)
        # a run's batches carry completion windows (workers.batch, built with this max_new_tokens): their programs
        window = (WINDOW,) if s.max_new_tokens is not None and length - 1 >= s.max_new_tokens else ()
        shapes = {"tokens": ((m, length), np.int32), "attention_mask": ((m, length), np.bool_)}
        shapes |= {WINDOW: ((m,), np.int32)} if window else {}
        wanted = {"logprobs": off_policy or (s.beta > 0 and self._abstract_ref is None),
                  "reference_logprobs": s.beta > 0 and self._abstract_ref is not None}
        for kind, params in (("logprobs", self._abstract.params), ("reference_logprobs", self._abstract_ref)):
            key = (kind, window, shapes_key(shapes))
            if wanted[kind] and key not in self._prepared:
                rows = [jax.ShapeDtypeStruct(*shapes[k]) for k in ("tokens", "attention_mask", *window)]
                args = (params, *rows, *self._abstract_base)
                self._prepared[key], built = shared(
                    (self._signature, key),
                    lambda kind=kind, args=args: compile_once(self._program(kind, window).lower(*args)))
                compiled += built
        acc = s.mini_batch_size // m
        mini = {"tokens": ((acc, m, length), np.int32), "attention_mask": ((acc, m, length), np.bool_),
                "loss_mask": ((acc, m, length - 1), np.float32), "advantages": ((acc, m), np.float32),
                "sampler_logp": ((acc, m, length - 1), np.float32)}
        for extra, wanted in (("old_logp", off_policy), ("ref_logp", s.beta > 0)):
            if wanted:
                mini[extra] = ((acc, m, length - 1), np.float32)
        if window:
            mini[WINDOW] = ((acc, m), np.int32)
        keys = tuple(sorted(mini))
        key = ("train", keys, shapes_key(mini))
        if key not in self._prepared:
            batch = {k: jax.ShapeDtypeStruct(*v) for k, v in mini.items()}
            self._prepared[key], built = shared(
                (self._signature, key),
                lambda: compile_once(self._program("train", keys).lower(self._abstract, batch,
                                                                       *self._train_args(abstract=True))))
            compiled += built
        key = ("update", (), shapes_key({}))  # no batch: the state's shapes, the actor's own (`_run`'s key)
        if key not in self._prepared:
            skipped = jax.ShapeDtypeStruct((), np.float32)
            self._prepared[key], built = shared(
                (self._signature, key),
                lambda: compile_once(self._program("update").lower(self._abstract, self._abstract.params, skipped)))
            compiled += built
        return compiled

    def _run(self, kind: str, keys: tuple[str, ...], arrays: dict, *args):
        """Program `kind` on `args`: the executable `prepare` made for these shapes, else the jitted one."""
        shapes = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in arrays.items()}
        prepared = self._prepared.get((kind, keys, shapes_key(shapes)))
        return (prepared or self._program(kind, keys))(*args)

    def _base_args(self) -> tuple:
        """The programs' trailing argument: a LoRA actor's frozen base, nothing for a full-weight actor."""
        return () if self.lora is None else (self.base,)

    def _train_args(self, *, abstract: bool = False) -> tuple:
        """The train program's arguments after (state, batch): a LoRA actor's frozen base; a bfloat16 actor's
        `served` copy of its current master, which the forward reads (after the base's None: it has none); nothing
        for a float32 actor. Shapes only with `abstract` (the state may be on host)."""
        if self.dtype is None:
            return self._abstract_base[:1] if abstract else self._base_args()
        return (None, self._abstract_served if abstract else self.served())

    def _off_policy(self, size: int) -> bool:
        """Whether the policy moves between this batch's optimizer steps (then old_logp must be frozen)."""
        return self.settings.epochs > 1 or size > self.settings.mini_batch_size

    # ---- logprobs -------------------------------------------------------------------------------

    def windowed(self, batch: TrainBatch) -> bool:
        """Whether the output head runs on `batch`'s completion windows only (workers.token_logprobs.window_logprobs):
        the batch carries them (a run's do: workers.batch), each settings.max_new_tokens wide lies inside its row and
        holds every position of the row's loss mask. Else (a batch built without max_new_tokens, or for longer
        completions than this actor's) the head runs on every position: the same values where the loss reads them."""
        w, start = self.settings.max_new_tokens, batch.completion_start
        if w is None or start is None:
            return False
        pos = np.arange(batch.loss_mask.shape[1])
        inside = (pos >= start[:, None]) & (pos < start[:, None] + w)
        return bool((start >= 0).all() and (start + w <= len(pos)).all()
                    and not (batch.loss_mask.astype(bool) & ~inside).any())

    def logprobs(self, batch: TrainBatch, *, reference: bool = False) -> np.ndarray:
        """Per-token logprobs (N, T-1) under the current (or reference) params, micro-batched: at every position,
        or where `windowed(batch)`, in the completion windows only (0 elsewhere)."""
        params = self.ref_params if reference else self.state.params
        if params is None:
            raise ValueError("no reference params: this actor was built with beta == 0")
        # A LoRA actor's policy is its base with its adapter; its reference is the base alone (its adapter's row off)
        base = () if self.lora is None else (self.base, np.int32(-1 if reference else 0))
        params = self.state.params if self.lora is not None else params
        kind = "reference_logprobs" if reference and self._abstract_ref is not None else "logprobs"
        window = (WINDOW,) if self.windowed(batch) else ()
        m, out = self.settings.micro_batch_size, []
        for i in range(0, batch.size, m):
            rows = {"tokens": batch.tokens[i : i + m], "attention_mask": batch.attention_mask[i : i + m]}
            rows |= {WINDOW: batch.completion_start[i : i + m]} if window else {}
            on_mesh = {k: global_array(v, S.batch_sharding(self.mesh, v.ndim)) for k, v in rows.items()}
            out.append(self._run(kind, window, rows, params,
                                 *(on_mesh[k] for k in ("tokens", "attention_mask", *window)), *base))
        return np.concatenate([host_value(x) for x in out])

    # ---- update ---------------------------------------------------------------------------------

    def train(self, batch: TrainBatch, *, step: int, timeline=None, together=None) -> dict[str, float]:
        """The GRPO update for one step's samples: epochs x mini-batches of optimizer steps.

        Returns metrics averaged over the optimizer steps (skipped counts them; cobatched: the members whose
        updates ran in one program with this one's, 1 alone). `timeline` (anything with `span(name, **attrs)`) gets
        a `logprobs` and an `update` span. `together` (workers.rollout.base.Together): the train hold this task shares
        with others of its base group; a LoRA actor on a shared base then runs its optimizer steps in one vmapped
        program with theirs (workers.actor_cobatch), each member's result its own update's.
        """
        span = timeline.span if timeline is not None else _no_span
        s = self.settings
        joint = self.cobatches(together)
        try:
            if self.state is None:
                raise RuntimeError("this actor is offloaded; call onload() before train")
            if batch.size % s.mini_batch_size:
                raise ValueError(f"{batch.size} samples do not split into mini-batches of {s.mini_batch_size}")
            arrays = batch.arrays()
            if not self.windowed(batch):  # the head on every position (the batch's windows, if any, unread)
                arrays.pop(WINDOW, None)
            off_policy = self._off_policy(batch.size)
            with span("logprobs", samples=batch.size):
                if off_policy:  # the policy moves between optimizer steps: freeze the rollout-time logprobs
                    arrays["old_logp"] = self.logprobs(batch)
                if s.beta > 0:
                    with self._reference(span):
                        arrays["ref_logp"] = self.logprobs(batch, reference=True)
            minis = self._minis(arrays, off_policy, np.random.default_rng([self.seed, step]))
            first = int(self.state.step)
        except BaseException:
            if joint:  # it will not come: the hold's other members must not wait for it
                self.withdraw(together)
            raise
        with span("update", samples=batch.size) as update:
            if joint:
                history, cobatched = actor_cobatch.join(self, together, minis)
                if cobatched > 1:
                    update["cobatched"] = cobatched
            else:
                history, cobatched = [], 1
                self._steps(minis, history)
        self.version += 1
        out = {k: float(np.mean([float(m[k]) for m in history])) for k in history[0]}
        out |= {k: float(np.max([float(m[k]) for m in history])) for k in grpo.MAX_METRICS}
        out = {k: v for k, v in out.items() if not (k in grpo.MEASURED_METRICS and np.isnan(v))}  # not measured
        out["skipped"] = float(sum(float(m["skipped"]) for m in history))
        out["lr"] = float(make_schedule(s)(self.state.step))  # the rate the next update will use
        out["moved"] = float(self._moved(history, first))
        out["cobatched"] = float(cobatched)
        return out

    @contextlib.contextmanager
    def _reference(self, span):
        """The reference's params on the devices inside (a no-op unless `offload_reference`): onloaded where they lie
        in host memory, offloaded again after, each move a span of its own (`onload_reference`,
        `offload_reference`), so the gradient's and the update's programs run without them."""
        if self._ref_host is not None:
            with span("onload_reference"):
                self.ref_params, self._ref_host = onload(self._ref_host), None
        yield
        if self.offload_reference:
            with span("offload_reference"):
                self._ref_host, self.ref_params = offload(self.ref_params), None

    def cobatches(self, together) -> bool:
        """Whether `train(..., together=together)` runs co-batched: a hold of several tasks, and a LoRA actor on a
        shared base (a full-weight actor, or one with a base of its own, always trains alone)."""
        return together is not None and together.tasks > 1 and self.lora is not None and self.shares_base

    def withdraw(self, together) -> None:
        """This task will not train in the hold `together` (it failed before its update): the hold's other members
        stop waiting for it."""
        if self.cobatches(together):
            actor_cobatch.withdraw(self, together)

    def _moved(self, history: list[dict], first: int) -> bool:
        """Whether the weights it serves should differ after these updates: one was applied (not skipped) at a
        non-zero rate (warmup's first step runs at lr 0) with a gradient, or a weight decay large enough to show in
        the params' dtype, to apply (a batch whose groups all scored alike has no gradient). The caller checks
        that they do (rlsched.run.roles.ActorRole). Never for a float32 master serving bfloat16: the master moves,
        and what it serves may rightly stay put until the master's steps add up to half a bfloat16 unit."""
        import jax

        if self.dtype is not None:
            return False
        schedule, step = make_schedule(self.settings), first
        # Decay alone scales each parameter by (1 - lr * wd): it moves them only if that change is more than
        # half a unit in the last place (bfloat16 at lr 3e-6, wd 0.1: 3e-7 against 3.9e-3, nothing moves).
        eps = float(jax.numpy.finfo(jax.tree.leaves(self.state.params)[0].dtype).eps)
        for m in history:
            if float(m["skipped"]):
                continue  # a skipped update leaves the step count, and the params, as they were
            lr = float(schedule(step))
            if lr > 0 and (float(m["grad_norm"]) > 0 or lr * self.settings.weight_decay > eps / 2):
                return True
            step += 1
        return False

    def _minis(self, arrays: dict[str, np.ndarray], off_policy: bool, rng) -> list[dict[str, np.ndarray]]:
        """The host mini-batches (A, M, ...) of epochs x mini-batches, in the order the optimizer steps take them."""
        s, size = self.settings, len(arrays["tokens"])
        acc, minis = s.mini_batch_size // s.micro_batch_size, []
        for _ in range(s.epochs):
            order = rng.permutation(size) if off_policy else np.arange(size)
            for start in range(0, size, s.mini_batch_size):
                idx = order[start : start + s.mini_batch_size]
                minis.append({k: v[idx].reshape(acc, s.micro_batch_size, *v.shape[1:]) for k, v in arrays.items()})
        return minis

    def _steps(self, minis: list[dict[str, np.ndarray]], history: list) -> None:
        """One optimizer step per mini-batch, this actor alone; each step's metrics appended to `history`."""
        for mini in minis:
            # Across processes each one lays its devices' rows out of the same host batch (workers.multihost)
            on_mesh = {k: global_array(v, S.batch_sharding(self.mesh, v.ndim - 1, leading=1)) for k, v in mini.items()}
            # a bfloat16 actor's forward reads the copy it serves: the one published before the first step (held
            # anyway), a fresh cast of the master before each further step (`served`)
            grads, metrics = self._run("train", tuple(sorted(mini)), mini, self.state, on_mesh, *self._train_args())
            # the optimizer's step in a program of its own (`update`), on the device's word that the step is finite
            self.state, grads = self._run("update", (), {}, self.state, grads, metrics["skipped"])
            del grads  # the clipped gradient, written over the gradient: freed before the next step's are made
            history.append(metrics)
        jax.block_until_ready((self.state, history))  # the update span ends when the work does, not at dispatch

    # ---- weights --------------------------------------------------------------------------------

    def export_weights(self) -> WeightSnapshot:
        """The policy's params as the engine is served them (never the optimizer state) as they lie on the mesh,
        with their version and logical checksum, hashed on the devices. Nothing is copied, except a float32
        master's cast to the model's dtype, made on the devices once per state (`served`). Whoever moves them
        copies one leaf at a time (rlsched.cluster.comm)."""
        flat = self._flat(self.served())
        return WeightSnapshot(flat, self.version, P.checksum(flat))

    def served(self):
        """The policy's params in the model's dtype, on the mesh: the state's own for a float32 model or a LoRA
        adapter, else the master's cast, kept until the state changes (one copy, `memory_bytes` counts it)."""
        if self.dtype is None:
            return self.state.params
        if self._served is None or self._served[0] is not self.state:
            self._served = (self.state, self._program("served")(self.state.params))
        return self._served[1]

    def _flat(self, params) -> dict[str, Any]:
        """Params by flat name: a model's nnx state flattened, or a LoRA adapter (flat already)."""
        return dict(params) if self.lora is not None else P.to_flat(params)

    def params_flat(self) -> dict[str, Any]:
        """The params the engine is served (`served`), by flat name, wherever they lie: on the mesh, or in host
        memory while offloaded (the host copies `offload` made; valid until `onload` brings them back and frees
        them)."""
        if self._host is None:
            return self._flat(self.served())
        state, _, served = self._host.tree
        if self.dtype is None:
            return self._flat(state.params)
        if served is None:  # offloaded before its cast was made: round the host master, to nearest even as XLA does
            served = jax.tree.map(lambda x: np.asarray(x).astype(self.dtype) if _floating(x) else x, state.params)
        return self._flat(served)

    # ---- memory ---------------------------------------------------------------------------------

    @property
    def shares_base(self) -> bool:
        """Whether this actor's base is a shared one (workers.shared_base): resident for its base group's life."""
        return self._lease is not None

    def offload(self) -> None:
        """Offload: params (a float32 master and its cast the engine is served, if it was made), optimizer state and
        reference params to host memory (pinned host where the backend has it), freed on the device. A shared
        base stays where it is: only the adapter's state moves."""
        served = self._served[1] if self._served is not None and self._served[0] is self.state else None
        if self._host is None and self._served is not None and served is None:  # an earlier state's: freed too, as a
            for x in jax.tree.leaves(self._served[1]):  # donated state's params are
                x.delete()
        if self._host is None and self.shares_base:
            self._host = offload((self.state, None, None))
            self.state = None
        elif self._host is None:  # a LoRA actor's own base goes too (its reference is the base: one copy moves)
            self._host = offload((self.state, self.base if self.lora is not None else self.ref_params, served))
            self.state = self.ref_params = self.base = self._served = None

    def onload(self) -> None:
        """Onload what offload saved."""
        if self._host is not None:
            self.state, frozen, served = onload(self._host)
            self._served = None if served is None else (self.state, served)
            self._host = None
            if self.shares_base:
                pass  # the base never left
            elif self.lora is not None:
                self.base = self.ref_params = frozen
            else:
                self.ref_params = frozen

    def memory_bytes(self) -> dict[str, int]:
        """Bytes on the devices by kind (params, opt, ref), from the live arrays this worker holds."""
        def size(tree) -> int:  # per device: a budget is per device, and a mesh holds a share on each
            return per_device_bytes(tree) if tree is not None else 0

        if self.state is None:
            return {"params": 0, "opt": 0, "ref": 0}
        if self.shares_base:  # the adapter alone: the shared base is counted once, by `shared_bytes`
            return {"params": size(self.state.params), "opt": size(self.state.opt_state), "ref": 0}
        if self.lora is not None:  # the base (its reference too) and the adapter are the params it holds
            return {"params": size(self.base) + size(self.state.params), "opt": size(self.state.opt_state), "ref": 0}
        served = self._served[1] if self.dtype is not None and self._served is not None else None  # what it serves
        return {"params": size(self.state.params) + size(served), "opt": size(self.state.opt_state),
                "ref": size(self.ref_params)}

    def shared_bytes(self) -> int:
        """Per device, the shared base this actor reads (0 without one): resident for its base group's life, held
        once in the process however many actors and engines read it."""
        return self._lease.nbytes() if self.shares_base and not self._lease.released else 0

    def release(self) -> None:
        """Give a shared base's lease back (idempotent; nothing for an actor with its own base). The actor can no
        longer compute after it."""
        if self._lease is not None:
            self._lease.release()
            self.base = self.ref_params = None

    def model(self) -> CausalLM:
        """The policy as one model (a LoRA actor's: its base with the adapter merged in; an adapted head of a base
        that ties its embeddings gives an untied model, as workers.models.lora.merged does)."""
        if self.lora is None:
            return nnx.merge(self.graphdef, self.served())
        merged = L.merged(P.to_flat(self.base), jax.device_get(self.state.params), self.lora)
        if self.config.tie_word_embeddings and "lm_head.kernel" in merged:  # one more matrix than the base's graph
            untied = self.config.replace(tie_word_embeddings=False)
            model = nnx.eval_shape(lambda: CausalLM(untied, rngs=nnx.Rngs(0)))  # shapes only: filled below
            nnx.update(model, P.from_flat(nnx.state(model, nnx.Param), merged))
            return model
        return nnx.merge(self.graphdef, P.from_flat(self.base, merged))
