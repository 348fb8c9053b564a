"""Version-gated shims for defects of the released sglang-jax, applied by `workers.rollout.sglang_jax`.

Each shim is a minimal wrapper around one upstream function (no upstream code is copied) and is
applied only for the sglang-jax versions listed in its `versions`. tests/test_sglang_jax.py (and
tests/test_sglang_families.py for the families' shims) shows each defect in the installed version *without*
the shim, so the day upstream releases a fix that test fails and the shim (and its version entry) is deleted.

Defects of sglang-jax 0.0.2 (PyPI) on CPU with the flax the `sglang` extra pins (0.12.6), and what
each shim does:
- `native_attention_pytree`: `NativeAttention` (an `nnx.Module`, which flax 0.12 already registers
  as a pytree) is decorated with `register_pytree_node_class` -> "Duplicate custom PyTreeDef type
  registration" when the CPU attention backend is imported. Shim: import it with a registration
  that keeps flax's registration on exactly that error.
- `loader_without_eager_sharding`: flax >= 0.12.1 shards variables eagerly, which needs a mesh
  context that 0.0.2's model loaders do not set -> "An auto mesh context or metadata is required"
  at engine start. Shim: run the loaders with eager sharding off (the engine shards the weights
  itself right after).
- `min_p_filter_operands`: the CPU sampling path passes 3 operands to `_apply_min_p_filter`, which
  unpacks 2 -> every non-greedy (and, since `lax.cond` traces both branches, every greedy) batch
  raises. Shim: drop the extra operand.
- `seeded_sampling`: per-request seeds (`sampling_seed`, our reproducible GRPO groups) go through
  `multinomial_with_seed`, which has two defects. (a) It softmaxes its input, but the CPU path hands
  it probabilities, so it samples from softmax(p) (close to uniform), not p. (b) Even fed logits, its
  noise is not independent across the vocabulary: every column's "uniform" is the same seed hash
  XOR a fixed per-column constant, so columns' Gumbel noises move together and the samples do not
  follow the distribution (measured over 384 tokens, 16,384 draws: total variation 0.25-0.38 from
  the target, vs 0.05-0.06 for an exact sampler). Samples from the wrong distribution make GRPO's
  importance ratios (the actor's logprobs of them) wrong. Shim: Gumbel-max with independent noise
  from `jax.random`, keyed by (request seed, position), on the log-probabilities; still one seed
  per request, so a seeded sample is the same whatever else is in the batch.
- `lm_head_dtype`: an untied LM head is built in bfloat16 whatever the model dtype, so greedy output
  diverges from fp32 at near-ties (every family's model). Shim: cast the head to the model dtype after
  construction.
- `moe_single_device_routing`: `EPMoE` (qwen3_moe's experts) defines `_single_device_forward` twice, the
  routing (top-k, softmax of the k logits) then the expert compute; the second shadows the first, so on one
  device (expert parallelism 1) every forward raises "missing 1 required positional argument:
  'top_k_weights'". The surviving expert half also wants (batch, tokens, hidden) where the engine passes
  (tokens, hidden). Shim: route, then call the expert half with the tokens as a batch of one.
- `moe_gate_dtype`: qwen3_moe's router kernel is built in float32 whatever the model dtype (its matmul
  casts it to the model dtype anyway), so a bfloat16 model's router cannot take rlsched's bfloat16 weights
  as they are. Shim: cast the kernel to the model dtype after construction (the same values a bfloat16
  checkpoint holds, the same matmul).
- `idle_scheduler_busy_wait`: the scheduler's event loop polls its sockets without blocking, so an
  idle engine burns a full core (measured: 2.0 CPU-s per 2 s idle) — on a shared 2-core machine
  that starves the other task's workers. Shim: when idle and nothing arrived, block in zmq poll.
- `watchdog_signals_own_process`: the scheduler's watchdog (a batch with no progress for
  `watchdog_timeout` s) sends SIGQUIT to `psutil.Process().parent()`, which in single-process mode
  is whoever started the engine's process: under Ray, the raylet, so one stuck engine took the
  whole Ray node down with every task on it (seen in a 2-task run). Shim: in single-process mode
  the watchdog signals the engine's own process, whose SIGQUIT handler ends it (and only it).

Which model families sglang-jax runs for rlsched (`SGLANG_CLASSES`, `check_model`) is also here, as
constants and pure functions: the control plane checks a config with them without sglang-jax or JAX.

Also here: `model_state_leaves(runner)`, the list of weight arrays the jitted forward reads. Later
upstream code keeps it as `model_runner.model_state_leaves`; 0.0.2 keeps it only in the closure of
`model_runner.jitted_run_model`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
from collections.abc import Callable

SGLANG_DIST = "sglang-jax"
# rlsched model_type -> the sglang-jax model class that runs it: the families sglang-jax 0.0.2 implements
# (sgl_jax/srt/models/{qwen3,qwen2,qwen3_moe}.py, its registry's EntryClass of each) whose weight names
# workers.rollout.sglang_jax maps. A constant, not a registry lookup, so that a config is checked without
# sglang-jax (tests/test_sglang_families.py holds it to the installed registry).
SGLANG_CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_IDLE_POLL_MS = 100  # how long an idle scheduler blocks before re-checking; a request wakes it at once


def installed_version() -> str:
    return importlib.metadata.version(SGLANG_DIST)


@dataclasses.dataclass(frozen=True)
class Shim:
    name: str
    versions: frozenset[str]  # released versions that have the defect
    apply: Callable[[], None]


# ---- the shims ----------------------------------------------------------------------------------


def _native_attention_pytree() -> None:
    import jax

    real = jax.tree_util.register_pytree_node_class

    def register_unless_flax_did(cls):
        try:
            return real(cls)
        except ValueError as e:
            if "Duplicate custom PyTreeDef" not in str(e):
                raise
            return cls  # flax registered this nnx.Module already; its flatten is the one to keep

    jax.tree_util.register_pytree_node_class = register_unless_flax_did
    try:
        importlib.import_module("sgl_jax.srt.layers.attention.native_backend")
    finally:
        jax.tree_util.register_pytree_node_class = real


def _loader_without_eager_sharding() -> None:
    from flax import nnx
    from sgl_jax.srt.model_loader import loader

    if not hasattr(nnx, "use_eager_sharding"):  # flax 0.12.0: variables are never sharded eagerly
        return
    for cls in (loader.JAXModelLoader, loader.JAXDummyModelLoader):
        real = cls.load_model

        def load_model(self, *args, _real=real, **kwargs):
            with nnx.use_eager_sharding(False):
                return _real(self, *args, **kwargs)

        cls.load_model = load_model


def _min_p_filter_operands() -> None:
    from sgl_jax.srt.layers import sampler

    real = sampler._apply_min_p_filter
    sampler._apply_min_p_filter = lambda operands: real(tuple(operands[:2]))


def _seeded_sampling() -> None:
    import jax
    import jax.numpy as jnp
    from sgl_jax.srt.layers import sampler

    real = sampler.multinomial_with_seed

    def multinomial_with_seed(operands):
        inputs, seeds, positions, _rng = operands
        if seeds is None:  # lax.cond traces this branch even when it is not taken
            return real(operands)
        # The TPU path passes (masked) logits, the others (masked) probabilities; zeros stay impossible.
        logp = jax.nn.log_softmax(inputs, axis=-1) if sampler.is_tpu_runtime() else jnp.log(inputs)

        def gumbel(seed, position):  # (V,): independent across tokens, a fresh stream per position
            return jax.random.gumbel(jax.random.fold_in(jax.random.key(seed), position), logp.shape[-1:], logp.dtype)

        noise = jax.vmap(gumbel)(seeds, positions)  # (B, V)
        return jnp.argmax(logp + noise, axis=-1, keepdims=True)  # (B, 1), as upstream returns

    sampler.multinomial_with_seed = multinomial_with_seed


def _lm_head_dtype() -> None:
    for cls in _model_classes():
        real_init = cls.__init__

        def __init__(self, config, dtype=None, *args, _real=real_init, **kwargs):
            _real(self, config, dtype, *args, **kwargs)
            head = getattr(self, "lm_head", None)
            if head is not None and dtype is not None and head.embedding.value.dtype != dtype:
                head.embedding.value = head.embedding.value.astype(dtype)
                head.dtype = dtype  # the compute dtype `attend` promotes to

        cls.__init__ = __init__


def _model_classes() -> list[type]:
    from sgl_jax.srt.models import qwen2, qwen3, qwen3_moe

    modules = {"qwen3": qwen3, "qwen2": qwen2, "qwen3_moe": qwen3_moe}
    return [getattr(modules[family], name) for family, name in SGLANG_CLASSES.items()]


def _moe_single_device_routing() -> None:
    import jax
    import jax.numpy as jnp
    from sgl_jax.srt.layers.moe import EPMoE

    experts = EPMoE._single_device_forward  # (inputs, top_k_indices, top_k_weights): the definition that won

    def _single_device_forward(self, inputs, router_logits, top_k_weights=None):
        if top_k_weights is not None:  # already routed (the expert half's own signature)
            return experts(self, inputs, router_logits, top_k_weights)
        # The shadowed routing: softmax over the k largest logits in float32, i.e. the top-k router
        # probabilities renormalised to sum to 1 (norm_topk_prob), cast to the compute dtype.
        top_logits, index = jax.lax.top_k(router_logits, self.num_experts_per_tok)
        weights = jax.nn.softmax(top_logits.astype(jnp.float32), axis=-1).astype(self.dtype)
        # The expert half counts tokens as inputs.shape[0] * inputs.shape[1], i.e. it wants (batch, tokens, H);
        # the engine's (tokens, H) goes in as a batch of one.
        return experts(self, inputs[None], index, weights)[0] if inputs.ndim == 2 else experts(self, inputs, index,
                                                                                                 weights)

    EPMoE._single_device_forward = _single_device_forward


def _moe_gate_dtype() -> None:
    from sgl_jax.srt.models.qwen3_moe import QWen3MoeDecoderLayer

    real_init = QWen3MoeDecoderLayer.__init__

    def __init__(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        gate, dtype = self.moe_gate, kwargs.get("dtype")  # upstream's model passes every argument by keyword
        if gate is not None and dtype is not None and gate.kernel.value.dtype != dtype:
            gate.kernel.value = gate.kernel.value.astype(dtype)
            gate.weight_dtype = dtype

    QWen3MoeDecoderLayer.__init__ = __init__


def _idle_scheduler_busy_wait() -> None:
    import zmq
    from sgl_jax.srt.managers.scheduler import Scheduler

    real = Scheduler.recv_requests

    def recv_requests(self):
        reqs = real(self)
        idle = (not reqs and self.recv_from_tokenizer is not None and self.cur_batch is None
                and self.last_batch is None and not self.waiting_queue and self.running_batch.is_empty()
                and self.chunked_req is None)
        if idle:
            poller = zmq.Poller()
            poller.register(self.recv_from_tokenizer, zmq.POLLIN)
            poller.register(self.recv_from_rpc, zmq.POLLIN)
            if poller.poll(_IDLE_POLL_MS):
                reqs = real(self)
        return reqs

    Scheduler.recv_requests = recv_requests


def _watchdog_signals_own_process() -> None:
    import psutil
    from sgl_jax.srt.managers.scheduler import Scheduler

    real_init = Scheduler.__init__

    def __init__(self, server_args, *args, **kwargs):
        real_init(self, server_args, *args, **kwargs)
        if server_args.enable_single_process:  # the scheduler is a thread of this process, not a child
            self.parent_process = psutil.Process()

    Scheduler.__init__ = __init__


V002 = frozenset({"0.0.2"})
SHIMS = (
    Shim("native_attention_pytree", V002, _native_attention_pytree),
    Shim("loader_without_eager_sharding", V002, _loader_without_eager_sharding),
    Shim("min_p_filter_operands", V002, _min_p_filter_operands),
    Shim("seeded_sampling", V002, _seeded_sampling),
    Shim("lm_head_dtype", V002, _lm_head_dtype),
    Shim("moe_single_device_routing", V002, _moe_single_device_routing),
    Shim("moe_gate_dtype", V002, _moe_gate_dtype),
    Shim("idle_scheduler_busy_wait", V002, _idle_scheduler_busy_wait),
    Shim("watchdog_signals_own_process", V002, _watchdog_signals_own_process),
)
_applied: set[str] = set()
# The versions the shims were written and tested against; any other is refused at engine start rather than
# run with fixes that silently do not apply (its sampler was wrong without them).
SUPPORTED_VERSIONS = frozenset({"0.0.2"})


def apply_shims(version: str | None = None) -> list[str]:
    """Apply (once per process) every shim whose versions include the installed sglang-jax; returns
    the names of the shims in effect. `RLSCHED_SGLANG_SKIP_SHIMS=name,...` leaves those out (the
    defect tests use it to show each defect still exists in the installed version)."""
    version = version or installed_version()
    if version not in SUPPORTED_VERSIONS:  # fail closed: another version would run without the fixes it needs
        supported = ", ".join(sorted(SUPPORTED_VERSIONS))
        raise RuntimeError(f"sglang-jax {version} is not supported: rlsched's fixes for its defects "
                           f"(workers/rollout/sglang_compat.py) are written for {supported}; install that "
                           "(pip install -e '.[sglang]'), or use rollout.engine=jax_sampler")
    skip = set(filter(None, os.environ.get("RLSCHED_SGLANG_SKIP_SHIMS", "").split(",")))
    unknown = skip - {s.name for s in SHIMS}
    if unknown:
        raise ValueError(f"RLSCHED_SGLANG_SKIP_SHIMS names unknown shims {sorted(unknown)}")
    for shim in SHIMS:
        if version in shim.versions and shim.name not in _applied and shim.name not in skip:
            shim.apply()
            _applied.add(shim.name)
    return sorted(_applied)


# ---- which models it runs (pure: no sglang-jax, no JAX) -------------------------------------------------


class UnsupportedModelError(ValueError):
    """The sglang_jax engine cannot run this model; the built-in sampler (jax_sampler) can."""


_USE_SAMPLER = "use rollout.engine: jax_sampler (the built-in sampler)"


def check_family(model_type: str) -> None:
    """UnsupportedModelError unless sglang-jax runs `model_type` models for rlsched (`SGLANG_CLASSES`)."""
    if model_type not in SGLANG_CLASSES:
        versions = ", ".join(sorted(SUPPORTED_VERSIONS))
        raise UnsupportedModelError(f"sglang_jax does not run {model_type} models (sglang-jax {versions} implements "
                                    f"{', '.join(SGLANG_CLASSES)}); {_USE_SAMPLER}")


def check_model(model) -> None:
    """`check_family`, then the settings of a family that sglang-jax's model would silently compute otherwise.
    model: a workers.models.config.ModelConfig (JAX-free). qwen3_moe: sglang-jax always renormalises the k
    router weights and makes every layer outside `mlp_only_layers` sparse."""
    check_family(model.model_type)
    if model.model_type == "qwen3_moe":
        if not model.norm_topk_prob:
            raise UnsupportedModelError(f"sglang_jax runs {model.describe()} only with norm_topk_prob true (sglang-jax "
                                        f"always renormalises the top-k router weights), this model has false; "
                                        f"{_USE_SAMPLER}")
        if model.decoder_sparse_step != 1:
            raise UnsupportedModelError(
                f"sglang_jax runs {model.describe()} only with decoder_sparse_step 1 (sglang-jax makes every layer "
                f"outside mlp_only_layers sparse), this model has {model.decoder_sparse_step}; {_USE_SAMPLER}")


# ---- reaching the engine's weights --------------------------------------------------------------


def model_state_leaves(model_runner) -> list:
    """The list of weight arrays `model_runner`'s jitted forward receives on every call. Callers
    replace its items in place (same list object), so the forward sees new weights with no rebuild."""
    leaves = getattr(model_runner, "model_state_leaves", None)
    if isinstance(leaves, list):
        return leaves
    fn = model_runner.jitted_run_model  # 0.0.2: a closure over the list
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
    if "model_state_leaves" not in cells:
        raise RuntimeError(
            f"sglang-jax {installed_version()}: cannot find the model's weight leaves (no "
            "model_runner.model_state_leaves and no closure variable of that name); "
            "workers/rollout/sglang_compat.py needs an accessor for this version")
    return cells["model_state_leaves"].cell_contents
