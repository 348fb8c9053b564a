"""The JAX actor worker: a policy's TrainState on its mesh, its log-probs, the GRPO update, weight export.

The step's arithmetic is pure and lives in workers.train_step (`gradients`, `update`, the optimizer, the policy's
log-probs); this worker holds the state and runs that arithmetic as compiled programs. Design decisions:
- One optimizer step is two jitted programs, the gradient's (`train`) then the update's (`update`, the state and the
  gradient donated), so the update keeps no copy of the state beside the new one nor a clipped gradient beside the
  gradient; a non-finite step is skipped on the device's own flag, with no wait on the host.
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
  its copies' results dropped) so a base group compiles log2(K) programs. The optimizer's numeric settings (learning
  rate, schedule, weight decay, clipping, Adam's betas) are each member's inputs of that program, so a sweep over them
  shares it; members of another length bucket or other loss settings run in their own program of the same run.
  Each member's result is what it gets alone to float rounding (a batched program rounds row reductions differently;
  AdamW magnifies that in the params: actor_cobatch's docstring has the measurements), and bit for bit the same
  whoever its partners are. A full-weight actor, or a LoRA actor with a base of its own, trains alone whatever the
  hold.
- Mixed precision (workers.train_step): a bfloat16 model trains a float32 master. What the engine serves
  (`export_weights`, `params_flat`) is the master rounded to the model's dtype on the devices, once per state
  (`served`), and the gradient's program reads that very copy rather than casting the master again inside the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from workers import actor_cobatch, grpo
from workers.batch import TrainBatch
from workers.compiling import compile_once, shapes_key, shared, shared_at_once
from workers.models import lora as L
from workers.models import lora_batch as LB
from workers.models import params as P
from workers.models import sharding as S
from workers.models.decoder import CausalLM
from workers.multihost import global_array, host_value
from workers.offload import offload, onload, per_device_bytes
from workers.train_step import (
    MASTER_DTYPE,
    OPTIMIZER_ONLY,
    ROW_KEYS,
    WINDOW,
    ActorSettings,
    TrainState,
    compute_params,
    floating,
    gradients,
    make_optimizer,
    make_schedule,
    master_params,
    optimizer_from,
    router_aux_coef,
    token_logprobs,
    train_step,
    update,
    window_token_logprobs,
)


@dataclasses.dataclass(frozen=True)
class WeightSnapshot:
    flat: dict[str, jax.Array]  # the live params by rlsched flat name (workers.models.params), on the mesh:
    # valid until the next update or offload frees them (a channel copies or sends them before that)
    version: int  # bumps after every TRAIN
    checksum: str  # params.checksum, computed on the devices


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
        # The residual stream's layout where the mesh splits rows, held by every layer (CausalLM.forward's `rows`:
        # else XLA's partitioner gathered activations over fsdp inside the layers)
        self._rows = S.residual_sharding(self.mesh)
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
        elif any(floating(x) and x.dtype != MASTER_DTYPE for x in jax.tree.leaves(params)):
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
        self._ahead = None  # the thread compiling smaller co-batched holds' programs (actor_cobatch.compile_ahead)
        self._ahead_due = None  # what it is to compile, from `prepare`, started after the next update
        self._schedule = None  # `lr`'s compiled make_schedule
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
        layout = (lora, self.mesh, jax.tree.structure(self._abstract), tuple(jax.tree.leaves(self._abstract)))
        self._signature = ("actor", self.graphdef, settings, *layout)
        # The gradient's and the log-probs' programs read no optimizer setting: a sweep over learning rates (or
        # schedules, weight decay, clipping, Adam's betas) shares them too, and compiles its own update alone. So does
        # the co-batched step, which takes those settings as each member's arrays (`cotrain_function`).
        self._loss_signature = ("actor", self.graphdef, dataclasses.replace(settings, **OPTIMIZER_ONLY), *layout)

    def step_function(self):
        """`train_step` with this actor's static parts bound: (state, batch[, base]) -> (state, metrics), not yet
        jitted (workers.actor_cobatch vmaps it over a hold's members)."""
        return partial(train_step, graphdef=self.graphdef, tx=self.tx, settings=self.settings, lora=self.lora,
                       dtype=self.dtype)

    def cotrain_function(self):
        """`train_step` as the co-batched step runs it for one member: (state, batch, values[, base]) -> (state,
        metrics), its optimizer built from `values` (workers.train_step.optimizer_values of its settings) inside, so
        that members whose settings differ there alone share one program (workers.actor_cobatch vmaps it). The loss
        reads the settings without them (None), so that none of a member's can become the program's constant."""
        graphdef, lora, dtype, rows = self.graphdef, self.lora, self.dtype, self._rows
        settings = dataclasses.replace(self.settings, **OPTIMIZER_ONLY)
        platform = self.mesh.devices.flat[0].platform

        # `rows` as alone: each member's residual stream held on its rows (under vmap the members' axis is left
        # unsplit), so that an fsdp mesh gathers each layer's weights rather than shuffling activations
        def step(state, batch, values, *base):
            return train_step(state, batch, *base, graphdef=graphdef, tx=optimizer_from(values, settings.adam_mu_dtype),
                              settings=settings, lora=lora, dtype=dtype, platform=platform, rows=rows)

        return step

    def gradient_function(self):
        """`gradients` with this actor's static parts bound: (state, batch[, base[, served]]) -> (grads, metrics)."""
        return partial(gradients, graphdef=self.graphdef, settings=self.settings, lora=self.lora, dtype=self.dtype,
                       rows=self._rows)

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
            platform = self.mesh.devices.flat[0].platform  # the one the program is lowered for: its way alone
            fn = jax.jit(lambda state, grads, skipped: update(state, grads, skipped == 0, tx=self.tx,
                                                               platform=platform),
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
                                 dtype=self.dtype, rows=self._rows),
                         in_shardings=(param_sh, rows, rows, *starts, *base_sh), out_shardings=rows)
        self._programs[kind, keys] = fn
        return fn

    def prepare(self, size: int, length: int, *, cohort: int = 1) -> int:
        """Compile the programs `train` runs on a batch of `size` rows of `length` tokens, ahead of it and
        without the state on the devices; returns how many were compiled now (0: all were ready). `cohort`: the most
        tasks a train hold of this one holds (its `train_cohort`): a LoRA actor on a shared base compiles that hold's
        joint programs too (workers.actor_cobatch), where the hold would have."""
        s, compiled = self.settings, 0
        m, off_policy = s.micro_batch_size, self._off_policy(size)
        # a run's batches carry completion windows (workers.batch, built with this max_new_tokens): their programs
        window = (WINDOW,) if s.max_new_tokens is not None and length - 1 >= s.max_new_tokens else ()
        shapes = {"tokens": ((m, length), np.int32), "attention_mask": ((m, length), np.bool_)}
        shapes |= {WINDOW: ((m,), np.int32)} if window else {}
        wanted = {"logprobs": off_policy or (s.beta > 0 and self._abstract_ref is None),
                  "reference_logprobs": s.beta > 0 and self._abstract_ref is not None}
        builds = []  # (our key, the process's key, build): built at once below
        for kind, params in (("logprobs", self._abstract.params), ("reference_logprobs", self._abstract_ref)):
            key = (kind, window, shapes_key(shapes))
            if wanted[kind] and key not in self._prepared:
                rows = [jax.ShapeDtypeStruct(*shapes[k]) for k in ("tokens", "attention_mask", *window)]
                args = (params, *rows, *self._abstract_base)
                builds.append((key, (self._loss_signature, key),
                               lambda kind=kind, args=args: compile_once(self._program(kind, window).lower(*args))))
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
            builds.append((key, (self._loss_signature, key),
                           lambda: compile_once(self._program("train", keys).lower(
                               self._abstract, batch, *self._train_args(abstract=True)))))
        joint, smaller = set(), []  # the keys `_run_group` reads a co-batched hold's programs under; smaller holds'
        if self.lora is not None and self.shares_base and cohort > 1:
            shapes = {k: (v[0], np.dtype(v[1])) for k, v in mini.items()}
            padded = actor_cobatch.padded_size(cohort)
            key = actor_cobatch.program_key(padded, keys, shapes)
            if key not in self._prepared:  # the largest hold's, a first step's (actor_cobatch): now
                joint.add(key)
                builds += [((key, i), shared_key, build)
                           for i, (shared_key, build) in enumerate(actor_cobatch.builds(self, padded, keys, shapes))]
            smaller = [p for p in (1 << i for i in range(1, padded.bit_length() - 1))
                       if actor_cobatch.program_key(p, keys, shapes) not in self._prepared]
        key = ("update", (), shapes_key({}))  # no batch: the state's shapes, the actor's own (`_run`'s key)
        if key not in self._prepared:
            skipped = jax.ShapeDtypeStruct((), np.float32)
            builds.append((key, (self._signature, key), lambda: compile_once(
                self._program("update").lower(self._abstract, self._abstract.params, skipped))))
        # the programs compile side by side (the gradient's is the longest: the step waits for it, not for the sum)
        parts: dict[tuple, list] = {}
        for (key, _, _), (executable, built) in zip(
                builds, shared_at_once([(shared_key, build) for _, shared_key, build in builds]), strict=True):
            if key[0] in joint:
                parts.setdefault(key[0], []).append(executable)
            else:
                self._prepared[key] = executable
            compiled += built
        for key, programs in parts.items():  # in builds' order: stack, step, unstack
            self._prepared[key] = tuple(programs)
        if smaller:  # later steps' holds: in the background once this actor's first update is done (`train`)
            self._ahead_due = (smaller, keys, shapes)
        if self._schedule is None:  # the metrics' learning rate (`lr`)
            compiled += self._compile_schedule()
        return compiled

    def lr(self, step) -> float:
        """The learning rate of optimizer step `step` (an int, or the state's counter), by make_schedule: compiled
        once (`prepare` does it), where evaluated eagerly its dozen operations each compiled at the first step, in
        the TRAIN lock."""
        if self._schedule is None:
            self._compile_schedule()
        return float(self._schedule(np.asarray(step, np.int32)))

    def _compile_schedule(self) -> int:
        """Compile `lr`'s schedule (actors of like schedules in one process share it); 1 if compiled now, else 0."""
        s = self.settings
        self._schedule, built = shared(
            ("lr_schedule", s.lr, s.warmup_steps, s.total_steps, s.min_lr_ratio),
            lambda: jax.jit(make_schedule(s)).lower(jax.ShapeDtypeStruct((), np.int32)).compile())
        return built

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
        if self._ahead_due is not None and (self._ahead is None or not self._ahead.is_alive()):
            # after an update, not in `prepare`: beside a first step's own compiles they took the cores those need
            # (configs/demo_lora.yaml, 8 tasks, this 2-core CPU: step 1 26 s of compile where 19 s without them)
            self._ahead, self._ahead_due = actor_cobatch.compile_ahead(self, *self._ahead_due), None
        out = {k: float(np.mean([float(m[k]) for m in history])) for k in history[0]}
        out |= {k: float(np.max([float(m[k]) for m in history])) for k in grpo.MAX_METRICS}
        out = {k: v for k, v in out.items() if not (k in grpo.MEASURED_METRICS and np.isnan(v))}  # not measured
        out["skipped"] = float(sum(float(m["skipped"]) for m in history))
        out["lr"] = self.lr(self.state.step)  # the rate the next update will use
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
        step = first
        # Decay alone scales each parameter by (1 - lr * wd): it moves them only if that change is more than
        # half a unit in the last place (bfloat16 at lr 3e-6, wd 0.1: 3e-7 against 3.9e-3, nothing moves).
        eps = float(jax.numpy.finfo(jax.tree.leaves(self.state.params)[0].dtype).eps)
        for m in history:
            if float(m["skipped"]):
                continue  # a skipped update leaves the step count, and the params, as they were
            lr = self.lr(step)
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
            served = jax.tree.map(lambda x: np.asarray(x).astype(self.dtype) if floating(x) else x, state.params)
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
