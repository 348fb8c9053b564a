"""`sglang_jax`: a rollout engine over the sglang-jax offline Engine, with the RL hooks it lacks.

sglang-jax (the JAX serving engine people run on TPUs) has no weight-update API, its memory
release/resume requests have no handler, and its sampling RNG never advances. rlsched adds them
from outside, against the engine's own objects (single-process mode):

- **Weights**: the engine starts from `load_format="dummy"` (config only: the actor's weights are
  the only real weights), and `update_weights` replaces the items of the list of arrays its jitted
  forward receives on every call (`sglang_compat.model_state_leaves`), one leaf at a time, with the
  same shapes, dtypes and shardings: no recompile, and never two full copies on the device.
  Names map from rlsched's flat params (workers.models.params) to the engine's nnx paths:
  `model.X.weight` (norms) -> `transformer.X.scale`, `model.X.kernel` -> `transformer.X.weight`
  (both (in, out)), `model.embed_tokens.weight` -> `transformer.embed_tokens.embedding`, and
  `lm_head.kernel` (H, V) -> `lm_head.embedding` (V, H), transposed. qwen3_moe's model also renames
  `self_attn.o_proj` -> `self_attn.c_proj`, the router `mlp.gate.kernel` -> `moe_gate.kernel`, and the
  stacked experts `mlp.experts.{gate,up,down}_proj.kernel` -> `mlp.{wi_0,wi_1,wo}` (all (E, in, out)).
- **Families**: qwen3, qwen2 and qwen3_moe (`sglang_compat.SGLANG_CLASSES`; others are refused when the
  config is checked, `sglang_compat.check_model`). The engine runs the family's class whatever the
  checkpoint's config.json lists under `architectures`, so the names above are the ones it holds.
- **Memory**: `offload` offloads the weights to host memory (workers.offload) and frees the
  KV cache; `onload` brings the weights back and allocates a zeroed KV cache. The radix
  (prefix) cache is disabled: a cached prefix would carry KV computed with *old* weights into a
  rollout after a weight update, and across a release.
- **Seeds**: every sample gets its own `sampling_seed` derived from (call seed, prompt, sample), and
  the engine runs with deterministic sampling, so a seed reproduces a call whatever the batching,
  and the n samples of a prompt differ. The seeded draw itself is rlsched's (the `seeded_sampling`
  shim): 0.0.2's does not sample from the model's distribution.
- **Stops**: the engine stops only at the caller's stop ids (its model-config EOS set is emptied),
  and returns raw token ids (no tokenizer in the engine: rlsched tokenizes, the engine knows ids).
- **Logprobs**: `return_logprob=True` crashes sglang-jax 0.0.2's scheduler, so this engine does not
  compute them: every `Sample.logprobs` is NaN (float32, one per token). Training never reads them:
  the actor computes old/reference logprobs itself (workers/actor.py); a step on this engine logs no
  actor-sampler gap (`train/logp_gap_*`), only the policy's entropy.

The engine must live in a process of its own (a Ray actor): any exception in its scheduler thread
sends SIGQUIT to its own process, which then kills its process tree, and a single-process engine
aborts the interpreter at exit (code 134). Only that process dies; the caller sees the actor die.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from workers.models import params as P
from workers.models.config import ModelConfig
from workers.offload import device_bytes, offload, onload
from workers.rollout.base import (
    EngineOffloadedError,
    FinishReason,
    RolloutOutput,
    Sample,
    SamplingParams,
    validate_request,
)
from workers.rollout.stamp import StampedWeights

INSTALL_HINT = "pip install -e '.[sglang]' (needs Python >= 3.12)"


def import_sglang():
    """The sglang-jax Engine class, with this version's shims applied; a clear error without it."""
    try:
        from sgl_jax.srt.entrypoints.engine import Engine
    except ImportError as e:
        raise ImportError(
            f"the sglang_jax rollout engine needs sglang-jax, which is not importable here "
            f"(Python {sys.version_info.major}.{sys.version_info.minor}): {e}. Install it with {INSTALL_HINT}, "
            "or use rollout.engine: jax_sampler") from e
    from workers.rollout import sglang_compat

    sglang_compat.apply_shims()
    return Engine


# qwen3_moe's engine model names some modules differently: its attention output projection `c_proj`, its router
# `moe_gate` (a sibling of `mlp`), and its stacked experts `mlp.wi_0` / `wi_1` / `wo`, each (E, in, out) as ours.
_MODULES = {"c_proj": ["o_proj"], "moe_gate": ["mlp", "gate"]}
_EXPERTS = {"wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj"}
_LEAVES = {"embedding": "weight", "scale": "weight", "weight": "kernel", "bias": "bias", "kernel": "kernel"}


def _rlsched_name(path: tuple[str, ...]) -> tuple[str, bool]:
    """An engine nnx path -> (rlsched flat name, whether the tensor is transposed between them)."""
    *parents, leaf = path
    if parents == ["lm_head"] and leaf == "embedding":
        return "lm_head.kernel", True
    if not parents or parents[0] != "transformer":
        raise ValueError(f"no rlsched name for engine weight {'.'.join(path)}")
    if parents[-1] == "mlp" and leaf in _EXPERTS:
        return ".".join(["model", *parents[1:], "experts", _EXPERTS[leaf], "kernel"]), False
    if leaf not in _LEAVES:
        raise ValueError(f"no rlsched name for engine weight {'.'.join(path)}")
    modules = [part for p in parents[1:] for part in _MODULES.get(p, [p])]
    return ".".join(["model", *modules, _LEAVES[leaf]]), False


def _row_seed(seed: int, prompt: int, sample: int) -> int:
    """The engine's per-request seed (int32) for sample `sample` of prompt `prompt` in a call seeded `seed`."""
    return int(np.random.SeedSequence([seed, prompt, sample]).generate_state(1)[0] % (2**31 - 1))


class SglangJaxEngine(StampedWeights):
    """RolloutEngine over sglang-jax (see workers.rollout.base for the contract, this module's
    docstring for what is rlsched's and what is the engine's)."""

    name = "sglang_jax"

    def __init__(self, model_path: str | Path, *, dtype: str | None = None, max_prompt_len: int = 512,
                 max_new_tokens: int = 256, max_batch_size: int = 64, weight_version: int = -1, seed: int = 0,
                 max_total_tokens: int | None = None, server_args: Mapping | None = None):
        """weight_version: -1 by default, since the engine starts from dummy weights and so holds no
        published version until the first `update_weights`. server_args: extra sglang-jax ServerArgs
        fields, passed through (they override ours)."""
        Engine = import_sglang()
        from workers.rollout import sglang_compat

        model = ModelConfig.from_dir(model_path)
        sglang_compat.check_model(model)
        if model.model_type == "qwen3_moe" and len(jax.devices()) > 1:
            # The engine's mesh spans every device it sees, and its MoE then takes the multi-device path
            # (expert parallelism over them), which rlsched's weight names and tests do not cover.
            raise sglang_compat.UnsupportedModelError(
                f"sglang_jax runs {model.describe()} on one device only, this process sees {len(jax.devices())}; "
                "give the engine's process one device, or use rollout.engine: jax_sampler")
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        if max_prompt_len + max_new_tokens > cfg["max_position_embeddings"]:
            raise ValueError(
                f"max_prompt_len + max_new_tokens = {max_prompt_len + max_new_tokens} exceeds the model's "
                f"max_position_embeddings={cfg['max_position_embeddings']}")
        self.vocab_size = int(cfg["vocab_size"])
        self.max_prompt_len, self.max_new_tokens, self.max_batch_size = max_prompt_len, max_new_tokens, max_batch_size
        # The engine clips a request to context_len - prompt - 2 new tokens: leave it room.
        context = max_prompt_len + max_new_tokens + 8
        kv_tokens = max(max_total_tokens or max_batch_size * (max_prompt_len + max_new_tokens), context + 8)
        args = dict(
            model_path=str(model_path), load_format="dummy", skip_tokenizer_init=True,
            dtype=dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "auto",
            enable_single_process=True, disable_jax_precompile=True, skip_server_warmup=True,
            disable_overlap_schedule=True, disable_radix_cache=True, enable_deterministic_sampling=True,
            context_length=context, max_total_tokens=kv_tokens, max_running_requests=max_batch_size,
            random_seed=seed, log_level="error",
            json_model_override_args=json.dumps({"architectures": [sglang_compat.SGLANG_CLASSES[model.model_type]]}),
        )
        if jax.default_backend() != "tpu":
            # The engine's flash attention is a TPU Pallas kernel; its native backend runs anywhere.
            args.update(attention_backend="native")
        if jax.default_backend() == "cpu":
            # On CPU the engine sizes its KV pool from free host RAM; max_total_tokens caps it first.
            args.update(device="cpu", mem_fraction_static=0.5)
        args.update(server_args or {})
        t0 = time.perf_counter()
        self._engine = Engine(**args)
        self.start_seconds = time.perf_counter() - t0
        scheduler = self._engine.scheduler_info["scheduler"]
        scheduler.model_config.hf_eos_token_id = set()  # stop only at the caller's stop ids
        self._runner = scheduler.tp_worker.worker.model_runner
        self._leaves = sglang_compat.model_state_leaves(self._runner)
        self._names, self._transposed = self._map_leaves()
        self._kv_layout: list[tuple[tuple[int, ...], np.dtype, object]] | None = None  # set while released
        self._host_weights = None  # set while released
        self._version = int(weight_version)
        self._checksum: str | None = None
        self._rng = np.random.default_rng(seed)

    def _map_leaves(self) -> tuple[list[str], list[bool]]:
        """rlsched names of the engine's weight leaves, in the order its forward receives them."""
        from flax import nnx

        _, state = nnx.split(self._runner.model)
        with_paths, _ = jax.tree_util.tree_flatten_with_path(state)
        same = len(with_paths) == len(self._leaves) and all(
            x is y for (_, x), y in zip(with_paths, self._leaves, strict=False))
        if not same:
            raise RuntimeError("the engine's model state and its forward's weight list differ; cannot map weights")
        names, transposed = [], []
        for path, _ in with_paths:
            keys = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
            name, t = _rlsched_name(keys[:-1] if keys[-1] == "value" else keys)
            names.append(name)
            transposed.append(t)
        return names, transposed

    # ---- weights and memory -------------------------------------------------------------------

    def _served_flat(self) -> dict[str, np.ndarray]:
        """The weights on the device now, in rlsched's flat layout (hashed as the actor's and jax_sampler's are,
        so the driver compares the checksums directly)."""
        self._check_live()
        return {name: (np.asarray(x).T if t else np.asarray(x))
                for name, x, t in zip(self._names, self._leaves, self._transposed, strict=True)}

    def _check_live(self) -> None:
        if self._host_weights is not None:
            raise EngineOffloadedError("the engine is offloaded; call onload() first")

    def _validate(self, flat: Mapping[str, object], source: str) -> None:
        expected = set(self._names)
        missing, unexpected = sorted(expected - flat.keys()), sorted(flat.keys() - expected)
        if missing or unexpected:
            raise P.WeightMismatchError(
                f"{source}: tensor names differ from the engine's model: missing {missing[:5]}"
                f"{'…' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{'…' if len(unexpected) > 5 else ''}")
        for name, leaf, t in zip(self._names, self._leaves, self._transposed, strict=True):
            new = flat[name]
            want = tuple(leaf.shape[::-1]) if t else tuple(leaf.shape)
            if tuple(new.shape) != want or np.dtype(new.dtype) != np.dtype(leaf.dtype):
                raise P.WeightMismatchError(
                    f"{source}: {name} is {np.dtype(new.dtype).name}{tuple(new.shape)}, "
                    f"the engine's model expects {np.dtype(leaf.dtype).name}{want}")

    def update_weights(self, flat_params: Mapping[str, object], version: int, *,
                       checksum: str | None = None) -> dict[str, int]:
        """Swap in `flat_params` as weights `version`, leaf by leaf; returns {"params_bytes",
        "largest_leaf_bytes", "peak_extra_bytes"} (peak over the steady state, from live arrays).
        With `checksum`, the weights that landed must hash to it, else WeightMismatchError and the engine
        stays at version -1, refusing to generate (it keeps no host copy to roll back to)."""
        self._check_live()
        self._validate(flat_params, f"update_weights(version={version})")
        # Until the last leaf is in place the engine holds neither version (see jax_sampler).
        self._version, self._checksum = -1, None
        before = peak = device_bytes()
        largest = 0
        for i, (new, t) in enumerate(zip((flat_params[n] for n in self._names), self._transposed, strict=True)):
            old = self._leaves[i]
            sharding = old.sharding
            largest = max(largest, old.nbytes)
            old.delete()  # free before placing the successor: never two copies of a leaf's bytes
            host = np.asarray(jax.device_get(new))
            # may_alias=False: the engine owns its buffers (the caller's array may be a read-only
            # object-store view or the actor's live parameter).
            self._leaves[i] = jax.device_put(np.ascontiguousarray(host.T) if t else host, sharding, may_alias=False)
            peak = max(peak, device_bytes())
        self._sync_model()
        if checksum is not None and self.weight_checksum != checksum:
            raise P.WeightMismatchError(f"update_weights(version={version}): the weights that landed hash to "
                                        f"{self._checksum}, the sender's to {checksum}")
        self._version = int(version)
        return {"params_bytes": self.memory_bytes()["params"], "largest_leaf_bytes": int(largest),
                "peak_extra_bytes": max(0, peak - before)}

    def _sync_model(self) -> None:
        """Point the engine's nnx model at the live leaves too, so nothing in it keeps freed arrays."""
        from flax import nnx

        graphdef, state = nnx.split(self._runner.model)
        treedef = jax.tree_util.tree_structure(state)
        nnx.update(self._runner.model, jax.tree_util.tree_unflatten(treedef, list(self._leaves)))

    def memory_bytes(self) -> dict[str, int]:
        """Bytes on the engine's devices: weights (its forward's leaves) and the KV cache pool."""
        if self._host_weights is not None:
            return {"params": 0, "kv": 0}
        kv = self._runner.token_to_kv_pool.kv_buffer
        return {"params": int(sum(x.nbytes for x in self._leaves)), "kv": int(sum(x.nbytes for x in kv))}

    def offload(self) -> None:
        """Weights to host memory (pinned host where the backend has it); the KV cache is freed, not
        saved: no request is in flight between calls and the prefix cache is off, so nothing in it
        is ever read again."""
        if self._host_weights is not None:
            return
        self._host_weights = offload(list(self._leaves))
        kv = self._runner.token_to_kv_pool.kv_buffer
        self._kv_layout = [(x.shape, x.dtype, x.sharding) for x in kv]
        for x in kv:
            x.delete()

    def onload(self) -> None:
        """Weights back to their devices and shardings, a fresh (zeroed) KV cache. The cached
        checksum is dropped: the next `weight_checksum` hashes what is on the device."""
        if self._host_weights is None:
            return
        for i, x in enumerate(onload(self._host_weights)):
            self._leaves[i] = x
        kv = self._runner.token_to_kv_pool.kv_buffer
        for i, (shape, dtype, sharding) in enumerate(self._kv_layout):
            kv[i] = jnp.zeros(shape, dtype, device=sharding)
        self._host_weights, self._kv_layout, self._checksum = None, None, None
        self._sync_model()

    @property
    def offloaded(self) -> bool:
        return self._host_weights is not None

    # ---- generation ---------------------------------------------------------------------------

    def prepare(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> int:
        return 0  # sglang-jax compiles its own programs (its server's warm-up and its own cache)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput:
        t0 = time.perf_counter()
        prompts = validate_request(prompt_ids, params, max_prompt_len=self.max_prompt_len,
                                   max_new_tokens=self.max_new_tokens, vocab_size=self.vocab_size)
        self._check_live()
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        rows = [(i, j) for i in range(len(prompts)) for j in range(params.n)]  # prompt-major
        stop = list(params.stop_token_ids) or None
        sampling = [dict(max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                         stop_token_ids=stop, skip_special_tokens=False, sampling_seed=_row_seed(seed, i, j))
                    for i, j in rows]
        results = self._engine.generate(input_ids=[prompts[i].tolist() for i, _ in rows], sampling_params=sampling)
        if isinstance(results, dict):
            results = [results]
        samples = [self._sample(i, r, params) for (i, _), r in zip(rows, results, strict=True)]
        return RolloutOutput(samples=samples, weight_version=self._version, generate_seconds=time.perf_counter() - t0)

    def _sample(self, prompt_index: int, result: dict, params: SamplingParams) -> Sample:
        reason = result["meta_info"]["finish_reason"] or {}
        tokens = np.asarray(result["output_ids"], np.int32)
        kind = reason.get("type")
        stopped = tokens.size > 0 and int(tokens[-1]) in params.stop_token_ids
        if kind == "stop" and isinstance(reason.get("matched"), int) and stopped:
            finish = FinishReason.STOP
        elif kind == "length" and tokens.size == params.max_new_tokens:
            finish = FinishReason.LENGTH
        else:
            raise RuntimeError(f"sglang-jax ended a sample of prompt {prompt_index} with {reason!r} after "
                               f"{tokens.size} tokens; rlsched expects a stop token or max_new_tokens")
        # NaN: not computed (see the module docstring); training takes logprobs from the actor.
        return Sample(prompt_index=prompt_index, token_ids=tokens, logprobs=np.full(tokens.shape, np.nan, np.float32),
                      finish_reason=finish)

    def close(self) -> None:
        """Nothing to do in-process: the engine's threads end with its process (the Ray actor)."""
