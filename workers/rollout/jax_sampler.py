"""`jax_sampler`: the built-in rollout engine — batched prefill plus KV-cached decode, in pure JAX.

Design decisions:
- One jitted program per (batch, prompt, new-token) bucket runs prefill *and* the whole decode loop
  (`lax.while_loop`), so Python dispatch is paid once per request, not once per token. Buckets are
  powers of two, so a run compiles a handful of programs, not one per request.
- Prompts are left-padded: every row writes its next token to the same cache slot, so one
  `dynamic_update_slice` serves the whole batch; each row's RoPE positions start at 0 regardless.
  `prompt_padding` says to what length: "bucket" the power-of-two bucket of a chunk's longest prompt (less work
  for short prompts, a compile per new bucket), "max" max_prompt_len always (one prompt shape for a run: no
  compile after the first request, at the cost of prefill and KV-cache reads for the longest prompt).
- Randomness is per sample: the key of sample j of prompt i is fold_in(fold_in(key(seed), i), j),
  then folded with the step. The n samples of a prompt differ, a seed reproduces them, and the
  result does not depend on how rows are batched.
- Co-batching: `generate_many` runs several requests (a base group's tasks) in one program run. The seed is
  a per-row vector of the program and each row keeps its request's prompt and sample index, so request m
  gets the tokens `generate(*requests[m])` gives alone.
  Logprobs are bit-equal where the run's chunk has the shapes of the request's own run; in a larger batch
  they agree to float rounding (a few 1e-6 in float32 on CPU), as one request alone does under another
  max_batch_size: XLA's matmuls sum in a batch-size-dependent order. The requests share the program's
  scalars (temperature, top_p, stop ids, max_new_tokens); `generate` is generate_many of one request.
- The loop stops as soon as every row has hit a stop token. At batch 128 the KV cache, not the weights, is most of
  what a step reads, and neither a row's left padding nor the slots not yet written need be. On GPUs a Pallas
  kernel attends (`decode_attention`, workers.models.decode_attention; on a mesh, on each device's shard of the
  cache): each row from its first prompt token to the slot written last, in one loop. With XLA's attention (the
  CPU's; a GPU's where `xla` is chosen or head_dim is not a power of two) the loop runs in segments on a GPU
  (`SEGMENTS`, `_segment_ends`), each attending to the static prefix of slots it can have written; on the CPU in one
  loop (each segment is a loop body compiled more).
- `prepare` compiles a request's programs ahead of time, from the weights' shapes and shardings only (no
  weights on the devices needed): the scheduler's caller does it before asking for the rollout lock, so
  no task compiles while it holds a lock. `generate` runs those executables; a shape nobody prepared
  compiles on first use, as jit does.
- The engine lives on a mesh (dp x tp, one device by default): weights laid out by
  workers.models.sharding, request rows over dp, the KV cache's heads over tp (whole on every device
  when tp exceeds the KV heads). The program is compiled with those shardings explicitly.
- LoRA adapters of one base: `set_adapters` puts K adapters on the devices, stacked
  (workers.models.lora_batch.AdapterBatch), and `generate(..., adapter_rows=)` runs each prompt's rows with its
  adapter (-1: the base). The adapters are an argument of the program: new adapter values, or another mix of
  rows, never recompile; only K, the padded rank and the adapted modules are part of the program's key.
  In a joint run, requests without adapter_rows run in chunks of their own, without adapters: a -1 row
  of the adapters' program agrees with that program to float rounding only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from workers.batch import PROMPT_PADDINGS, prompt_bucket
from workers.compiling import compile_once, find, kept, shared_at_once
from workers.models import params as P
from workers.models import sharding as S
from workers.models.checkpoint import load_pretrained
from workers.models.decode_attention import resolve as resolve_attention
from workers.models.decoder import CausalLM, init_cache
from workers.models.lora import LoraSpec
from workers.models.lora_batch import AdapterBatch, check_modules, stack
from workers.offload import (
    bytes_by_device,
    layout_bytes,
    offload,
    onload,
    per_device_bytes,
    reserved_bytes,
    room_for,
    shard_bytes,
)
from workers.rollout.base import (
    EngineOffloadedError,
    FinishReason,
    RolloutInputError,
    RolloutOutput,
    Sample,
    SamplingParams,
    validate_request,
)
from workers.rollout.sampling import sample_tokens
from workers.rollout.stamp import StampedWeights

_STOP_SLOTS = 8  # stop-id array size (static); more stop ids -> next multiple of 8


def _bucket(n: int, minimum: int, cap: int) -> int:
    """Smallest power of two >= n (at least `minimum`), never above `cap`."""
    b = max(minimum, 1 << max(0, (n - 1).bit_length()))
    return min(b, cap)


class JaxSampler(StampedWeights):
    """KV-cached JAX sampler over a `CausalLM`. See workers.rollout.base for the contract."""

    name = "jax_sampler"

    def __init__(self, model: CausalLM, *, max_prompt_len: int = 512, max_new_tokens: int = 256,
                 max_batch_size: int = 64, weight_version: int = 0, seed: int = 0, take_ownership: bool = False,
                 mesh=None, prompt_padding: str = "bucket", decode_attention: str = "auto"):
        """take_ownership: the engine may free the model's buffers (offload, update_weights);
        by default it copies them, so the caller's model stays usable.
        mesh: a `jax.sharding.Mesh` with axes (dp, fsdp, ep, tp) (workers.models.sharding.mesh); default: this
        process's first device.
        prompt_padding: "bucket" (a chunk's prompts padded to the power-of-two bucket of its longest) or "max"
        (to max_prompt_len): see the module docstring.
        decode_attention: how a decode step attends (workers.models.decode_attention): "auto" (the Pallas kernel on
        GPUs, partitioned as the KV cache on a mesh; XLA's attention elsewhere), "xla", "pallas" (a GPU's),
        "interpret" (the kernel under Pallas's interpreter: tests). A config sets it as
        rollout.engine_args.decode_attention."""
        cfg = model.config
        if prompt_padding not in PROMPT_PADDINGS:
            raise ValueError(f"prompt_padding={prompt_padding!r}; choose one of {PROMPT_PADDINGS}")
        if max_prompt_len + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"max_prompt_len + max_new_tokens = {max_prompt_len + max_new_tokens} exceeds the model's "
                f"max_position_embeddings={cfg.max_position_embeddings}")
        self.config = cfg
        self.max_prompt_len, self.max_new_tokens, self.max_batch_size = max_prompt_len, max_new_tokens, max_batch_size
        self.prompt_padding = prompt_padding
        self.mesh = mesh if mesh is not None else S.mesh({}, jax.devices()[:1])
        self.decode_attention = resolve_attention(decode_attention, platform=self.mesh.devices.flat[0].platform,
                                                  head_dim=cfg.head_dim)
        self._rows = S.batch_rows(dict(self.mesh.shape))  # request rows split this many ways
        self._graphdef, state = nnx.split(model)
        self._shardings = S.state_shardings(state, self.mesh, kv_heads=cfg.num_key_value_heads)
        # Committed placement from the start, as update_weights/onload produce: otherwise the
        # first weight update changes the arrays' committedness and recompiles every program.
        self._state = jax.tree.map(lambda x, sh: S.place(x, sh, copy=not take_ownership), state, self._shardings)
        self._host_state = None  # set while released, and while resumed but not yet used
        self._deferred = False  # resumed: the weights wait on host, their device memory counted as ours
        self._version = weight_version
        self._checksum: str | None = None
        self._rng = np.random.default_rng(seed)
        self.compiled_shapes: set[tuple[int, int, int, int]] = set()
        # program key -> the executable `prepare` compiled or found (workers.compiling.shared: held here, shared by
        # every engine of this process that holds it; it goes with the last of them)
        self._executables: dict = {}
        # What the weights look like, for compiling without them (`prepare`)
        self._abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                      self._state, self._shardings)
        self._adapters: AdapterBatch | None = None  # set_adapters: K stacked adapters, replicated on the mesh
        self._host_adapters = None  # the adapters while offloaded

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str | None = None, **kwargs) -> JaxSampler:
        model, _ = load_pretrained(path, dtype=dtype, with_tokenizer=False)
        return cls(model, take_ownership=True, **kwargs)

    # ---- weights and memory -------------------------------------------------------------------

    def _served_flat(self) -> dict[str, jax.Array]:
        return P.to_flat(self._live_state())

    def _live_state(self):
        if self._state is None:
            if self._host_state is None or not self._deferred:
                raise EngineOffloadedError("the engine is offloaded; call onload() first")
            self.restore_weights()
        return self._state

    def restore_weights(self) -> int:
        """Move weights that wait on host since `onload` to the devices; the bytes moved per device
        (0 when they are there already). Called on first use (generate, checksum) if not before."""
        if self._state is not None or not self._deferred:
            return 0
        self._state, self._host_state, self._deferred = onload(self._host_state), None, False
        return per_device_bytes(self._state)

    def update_weights(self, flat_params: Mapping[str, object], version: int, *,
                       checksum: str | None = None) -> dict[str, int]:
        """Swap in `flat_params` (host arrays, or device arrays in any layout) as weights `version`.

        A transaction. The new leaves are copied into the engine's layout (device to device when they are on this
        process's devices: the engine owns its buffers, so the sender may donate or overwrite its own), hashed on
        the devices and, with `checksum`, must match it; any failure (a bad tensor, a transfer error, a mismatch)
        leaves the engine on its previous version, never on a mix. Where the old weights are kept meanwhile:
        - on the devices, beside the new ones, when every device has room for both (workers.offload.room_for):
          the new leaves land in one program, the old ones are freed once the new verify, and no weight byte
          passes through host memory (`_update_beside`);
        - else in host memory, leaf by leaf: each old leaf goes to host, its device buffers are freed and the new
          leaf lands in its place, so a device never holds more than one extra leaf's shard (`_update_in_place`);
        - when they wait on host already (resumed, not yet used) they are the undo copy: nothing moves out, and a
          failure leaves them waiting (`_update_from_host`).
        Returns, per device: {"params_bytes", "largest_leaf_bytes" (the largest leaf's shard), "peak_extra_bytes"
        (over the steady state: the leaves the swap held at once), "undo_host_bytes" (the old weights this swap
        moved to host memory: 0 unless the devices lacked room)}."""
        if self._state is None and self._deferred:
            return self._update_from_host(flat_params, version, checksum)
        current = self._live_state()
        incoming = P.from_flat(current, flat_params, source=f"update_weights(version={version})")
        old, treedef = jax.tree.flatten(current)
        new = treedef.flatten_up_to(incoming)
        held = layout_bytes(old)  # what the new version takes on each device: the old one's layout
        if room_for(held):
            return self._update_beside(old, new, treedef, version, checksum, held)
        return self._update_in_place(old, new, treedef, version, checksum)

    def _update_beside(self, old: list, new: list, treedef, version: int, checksum: str | None,
                       held: dict) -> dict[str, int]:
        """The new version lands beside the old one; the old is freed once the new verifies (or, on a failure, the
        new is: the old never moved). Sizes come from the layout (`held`), not from the buffers: a model's few
        hundred leaves would cost more Python than the copy costs a GPU."""
        leaves: list = []
        try:
            leaves = S.place_all(new, [x.sharding for x in old])
            state = treedef.unflatten(leaves)
            digest = self._verify(state, version, checksum)
        except BaseException:
            for leaf in leaves:
                if not leaf.is_deleted():
                    leaf.delete()
            raise
        self._state, self._version, self._checksum = state, int(version), digest
        for leaf in old:
            leaf.delete()
        steady = max(held.values(), default=0)  # the new version, in the old one's layout; both were held at once
        return {"params_bytes": steady, "largest_leaf_bytes": max(map(shard_bytes, old), default=0),
                "peak_extra_bytes": steady, "undo_host_bytes": 0}

    def _update_in_place(self, old: list, new: list, treedef, version: int, checksum: str | None) -> dict[str, int]:
        """Leaf by leaf, each old leaf to host memory before the new one lands in its place (bounded peak)."""
        leaves, saved = list(old), {}  # saved: index -> the old leaf's host copy, while the new one lands
        extra: dict = {}  # device -> bytes the swap holds beyond the engine's steady state (a running tally)
        peak = largest = moved = 0
        try:
            for i, (was, arriving) in enumerate(zip(old, new, strict=True)):
                shards = bytes_by_device([was])
                largest = max(largest, *shards.values())
                saved[i] = offload(was)  # to host; frees the device buffers
                moved += max(shards.values())
                leaves[i] = S.place(arriving, was.sharding, copy=True)  # the engine owns its buffers
                for device, nbytes in bytes_by_device([leaves[i]]).items():
                    extra[device] = extra.get(device, 0) + nbytes - shards.get(device, 0)
                peak = max(peak, *extra.values())
            state = treedef.unflatten(leaves)
            digest = self._verify(state, version, checksum)
        except BaseException:
            for i, host in saved.items():  # back to the previous version, leaf by leaf
                if leaves[i] is not old[i] and not leaves[i].is_deleted():
                    leaves[i].delete()
                leaves[i] = onload(host)
            self._state = treedef.unflatten(leaves)
            raise
        self._state, self._version, self._checksum = state, int(version), digest
        for host in saved.values():  # pinned-host copies: freed now that the new version stands
            jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, host.tree)
        return {"params_bytes": self.memory_bytes()["params"], "largest_leaf_bytes": int(largest),
                "peak_extra_bytes": max(0, int(peak)), "undo_host_bytes": int(moved)}

    def _update_from_host(self, flat_params, version: int, checksum: str | None) -> dict[str, int]:
        """`update_weights` while the old weights wait on host: the new leaves land in their device memory
        (reserved by `onload`) and the host copy is dropped only once they verify."""
        waiting = self._host_state
        incoming = P.from_flat(waiting.tree, flat_params, source=f"update_weights(version={version})")
        treedef = jax.tree.structure(waiting.tree)
        shardings = treedef.flatten_up_to(waiting.shardings)
        leaves: list = []
        largest = 0
        try:
            for sharding, arriving in zip(shardings, treedef.flatten_up_to(incoming), strict=True):
                leaves.append(S.place(arriving, sharding, copy=True))
                largest = max(largest, *bytes_by_device(leaves[-1:]).values())
            state = treedef.unflatten(leaves)
            digest = self._verify(state, version, checksum)
        except BaseException:
            for leaf in leaves:  # the old version still waits on host, untouched
                if not leaf.is_deleted():
                    leaf.delete()
            raise
        self._state, self._host_state, self._deferred = state, None, False
        self._version, self._checksum = int(version), digest
        jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, waiting.tree)
        return {"params_bytes": self.memory_bytes()["params"], "largest_leaf_bytes": int(largest),
                "peak_extra_bytes": 0, "undo_host_bytes": 0}  # the reservation holds exactly the new leaves

    def _verify(self, state, version: int, checksum: str | None) -> str:
        digest = P.checksum(P.to_flat(state))
        refused = self._refusal(version, digest, checksum)
        if refused:
            raise refused
        return digest

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this engine holds on its devices by kind (weights waiting on host since `onload` count:
        their device memory is the engine's); the KV cache exists only inside `generate`."""
        if self._state is not None:
            params = per_device_bytes(self._state)
        else:
            params = reserved_bytes(self._host_state) if self._deferred else 0
        return {"params": params, "kv": 0}

    def offload(self) -> None:
        """Move weights to host memory (pinned host where the backend has it) and free them on the
        device; the KV cache lives only inside a generate call, so it is already gone."""
        if self._adapters is not None:
            self._host_adapters, self._adapters = offload(self._adapters), None
        if self._state is None:
            self._deferred = False  # resumed but never used: the weights are on host already
            return
        self._host_state = offload(self._state)
        self._state = None

    def onload(self) -> None:
        """Take the device memory back. The weights move on first use (`restore_weights`: generate or a
        checksum), or never, when `update_weights` replaces them first (the colocated step: onload, then
        sync to the actor's newer version); their host copy is then the swap's undo copy. The cached
        checksum is dropped: the next `weight_checksum` hashes what is on the devices, never assumed."""
        if self._state is not None or self._host_state is None:
            return
        self._deferred = True
        self._checksum = None

    def programs_compiled(self) -> int:
        """Executables this engine runs: those it prepared (shared with the other engines of its architecture and
        mesh in this process) and those its jitted program compiled on first use."""
        return self._jitted()._cache_size() + len(self._executables)

    def _jitted(self):
        """The jitted generate program of this engine's architecture and mesh (shared between engines)."""
        return _program(self._graphdef, self.mesh, self.config.num_key_value_heads, self._shardings,
                        self.decode_attention)

    @property
    def offloaded(self) -> bool:
        return self._state is None and not self._deferred

    # ---- LoRA adapters --------------------------------------------------------------------------

    def set_adapters(self, adapters: Sequence[Mapping[str, object]], specs: Sequence[LoraSpec]) -> None:
        """Serve these K adapters (flat `<module>.lora_a` / `.lora_b`, workers.models.lora's layout), adapter k
        being `adapter_rows` index k in `generate`; replaces the ones set before ([] drops them). Values of the
        same K, ranks and targets as before reuse the compiled programs."""
        if not adapters and not specs:
            self._adapters = self._host_adapters = None
            return
        batch = stack(adapters, specs, [])
        check_modules(self.config, batch, 0)  # a module this base does not have is refused here, not at generate
        repl = S.replicated(self.mesh)
        self._adapters = jax.tree.map(lambda x: S.place(x, repl, copy=True), batch)
        self._host_adapters = None
        if self.offloaded:  # they wait on host with the weights
            self._host_adapters, self._adapters = offload(self._adapters), None

    @property
    def num_adapters(self) -> int:
        """K, the adapters `set_adapters` put here (0: none)."""
        adapters = self._adapters if self._adapters is not None else getattr(self._host_adapters, "tree", None)
        return 0 if adapters is None else int(adapters.scale.shape[0])

    def _live_adapters(self) -> AdapterBatch | None:
        if self._adapters is None and self._host_adapters is not None:
            self._adapters, self._host_adapters = onload(self._host_adapters), None
        return self._adapters

    # ---- generation ---------------------------------------------------------------------------

    def prepare(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                adapter_rows: Sequence[int] | None = None, adapters: AdapterBatch | None = None) -> int:
        """Compile the programs `generate(prompt_ids, params, adapter_rows)` will run, ahead of it and without the
        weights on the devices; returns how many were compiled now (0: all were ready). `adapters`: the shapes of
        the adapters generate will serve (abstract), when they differ from those set now."""
        return self.prepare_many([(prompt_ids, params, adapter_rows)], adapters)

    def prepare_many(self, requests: Sequence[tuple], adapters: AdapterBatch | None = None) -> int:
        """`prepare` for the joint run `generate_many(requests)` will make."""
        return self.prepare_runs([requests], adapters)

    def prepare_runs(self, runs: Sequence[Sequence[tuple]], adapters: AdapterBatch | None = None) -> int:
        """`prepare_many` for each joint run of `runs`, their programs compiled at once (workers.compiling
        .shared_at_once: a co-batching group's runs of 1 .. K requests are programs of several batch sizes)."""
        adapters = adapters if adapters is not None else self._abstract_adapters()
        builds = {}  # key -> the program's arguments, each new program once
        for requests in runs:
            for key, args, _ in self._joint_chunks(requests, [0] * len(requests), adapters):
                if key not in self._executables and key not in builds:
                    builds[key] = args
        # engines in one process (a device group's) share each: built once
        built = shared_at_once([(("generate", *key), partial(self._compile, args)) for key, args in builds.items()])
        for key, (executable, _) in zip(builds, built, strict=True):
            self._executables[key] = executable
        return sum(fresh for _, fresh in built)

    def _compile(self, args):
        return compile_once(self._jitted().lower(self._abstract, *args))

    def _abstract_adapters(self) -> AdapterBatch | None:
        adapters = self._adapters if self._adapters is not None else getattr(self._host_adapters, "tree", None)
        if adapters is None:
            return None
        repl = S.replicated(self.mesh)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=repl), adapters)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                 adapter_rows: Sequence[int] | None = None) -> RolloutOutput:
        """adapter_rows: one adapter index per prompt (set_adapters' order; -1: the base), for all its n samples;
        None runs the base for every prompt."""
        return self.generate_many([(prompt_ids, params, adapter_rows)])[0]

    def generate_many(self, requests: Sequence[tuple]) -> list[RolloutOutput]:
        """Several requests `(prompt_ids, params, adapter_rows or None)` in one program run (chunked by
        max_batch_size, as one request is); output m is what `generate(*requests[m])` returns alone: each row keeps
        its request's seed and its own prompt and sample index. The requests must agree on temperature, top_p,
        stop_token_ids and max_new_tokens (they are the program's scalars); n, seed, prompts and adapters may
        differ. A seed of None draws one per request, as generate does. Each output's `cobatched` is
        len(requests) and its generate_seconds the whole run's."""
        t0 = time.perf_counter()
        requests = [_request(r) for r in requests]
        seeds = [p.seed if p.seed is not None else int(self._rng.integers(0, 2**31)) for _, p, _ in requests]
        # A bad request is refused first
        chunks = list(self._joint_chunks(requests, seeds, self._abstract_adapters()))
        state = self._live_state()
        adapters = self._live_adapters() if any(rows is not None for _, _, rows in requests) else None
        samples: list[list[Sample]] = [[] for _ in requests]
        for key, args, owners in chunks:
            self.compiled_shapes.add(key[-4:])
            if args[-3] is not None:  # the chunk's rows, with the adapters on the devices
                args = (*args[:-3], dataclasses.replace(adapters, rows=args[-3].rows), *args[-2:])
            out_tokens, out_logprobs, lengths, stopped = self._run_chunk(key, state, args)
            for r, (m, i) in enumerate(owners):
                samples[m].append(Sample(prompt_index=i, token_ids=out_tokens[r, : lengths[r]].copy(),
                                         logprobs=out_logprobs[r, : lengths[r]].copy(),
                                         finish_reason=FinishReason.STOP if stopped[r] else FinishReason.LENGTH))
        seconds = time.perf_counter() - t0
        return [RolloutOutput(samples=s, weight_version=self._version, generate_seconds=seconds,
                              cobatched=len(requests)) for s in samples]

    def _run_chunk(self, key, state, args):
        """One program run over one chunk's rows -> host arrays (tokens, logprobs, lengths, stopped)."""
        prepared = self._executables.get(key)
        if prepared is None:  # another engine of this process may hold it (prepared for a request like this one)
            prepared = find(("generate", *key))
        # A prepared executable has the static arguments (the bucket and the nucleus, the last two) built in
        out = prepared(state, *args[:-2]) if prepared is not None else self._jitted()(state, *args)
        return jax.device_get(out)

    def _chunks(self, prompt_ids, params: SamplingParams, seed: int, adapter_rows=None,
                adapters: AdapterBatch | None = None):
        """One request's chunks: (program key, program arguments), as `_joint_chunks` makes them."""
        for key, args, _ in self._joint_chunks([(prompt_ids, params, adapter_rows)], [seed], adapters):
            yield key, args

    def _joint_chunks(self, requests, seeds: Sequence[int], adapters: AdapterBatch | None = None):
        """Per chunk of at most max_batch_size rows: (its program's key, the program's arguments after the
        weights: tokens, mask, active, seed, prompt_idx, sample_idx, temperature, top_p, max_new, stop, the
        adapters (None, or `adapters` (abstract) with the chunk's rows), the static new-token bucket and whether top_p
        filters (static: workers.rollout.sampling), and each live row's (request, prompt) index). Rows are
        request-major, then prompt-major; the rows of requests without adapter_rows run in chunks of their own (the
        program without adapters: a -1 row of the adapters' program agrees with it to float rounding only,
        workers.models.lora_batch)."""
        requests = [_request(r) for r in requests]
        if not requests:
            raise RolloutInputError("generate_many needs at least one request (prompt_ids, params, adapter_rows)")
        checked = []  # (prompts, params, adapter index per prompt or None)
        for m, (prompt_ids, params, adapter_rows) in enumerate(requests):
            try:
                prompts = validate_request(prompt_ids, params, max_prompt_len=self.max_prompt_len,
                                           max_new_tokens=self.max_new_tokens, vocab_size=self.config.vocab_size)
                per_prompt = self._check_adapter_rows(adapter_rows, len(prompts), adapters)
            except RolloutInputError as e:
                if len(requests) == 1:
                    raise
                raise RolloutInputError(f"request {m}: {e}") from e
            if run_settings(params) != run_settings(requests[0][1]):
                raise RolloutInputError(
                    f"request {m} samples with {_describe(params)}, request 0 with {_describe(requests[0][1])}: "
                    "the requests of one run must agree on these (n and seed may differ); run the others apart")
            checked.append((prompts, params, per_prompt))
        params = requests[0][1]
        signature = None if all(p is None for _, _, p in checked) else (
            int(adapters.scale.shape[0]), tuple((m, adapters.a[m].shape[-1]) for m in adapters.a))
        # (request, prompt, sample) per row, request-major then prompt-major; base-only requests apart
        plain, adapted = [], []
        for m, (prompts, p, per_prompt) in enumerate(checked):
            rows = [(m, i, j) for i in range(len(prompts)) for j in range(p.n)]
            (plain if per_prompt is None else adapted).extend(rows)
        stop = np.full(_STOP_SLOTS * max(1, -(-len(params.stop_token_ids) // _STOP_SLOTS)), -1, np.int32)
        stop[: len(params.stop_token_ids)] = params.stop_token_ids
        new_bucket = _bucket(params.max_new_tokens, 8, self.max_new_tokens)
        nucleus = bool(params.top_p < 1.0)
        for rows, sig in ((plain, None), (adapted, signature)):
            for start in range(0, len(rows), self.max_batch_size):
                chunk = rows[start : start + self.max_batch_size]
                batch = -(-_bucket(len(chunk), 1, self.max_batch_size) // self._rows) * self._rows  # rows over dp
                longest = max(len(checked[m][0][i]) for m, i, _ in chunk)
                # "max": every chunk one prompt shape (left padding is masked: the same tokens either way)
                plen = prompt_bucket(self.max_prompt_len if self.prompt_padding == "max" else longest,
                                     self.max_prompt_len)
                tokens = np.zeros((batch, plen), np.int32)
                mask = np.zeros((batch, plen), bool)
                seed, prompt_idx, sample_idx = (np.zeros(batch, d) for d in (np.uint32, np.int32, np.int32))
                rows_adapter = np.full(batch, -1, np.int32)  # padding rows run the base
                for r, (m, i, j) in enumerate(chunk):
                    prompts, _, per_prompt = checked[m]
                    p = prompts[i]
                    tokens[r, plen - len(p):], mask[r, plen - len(p):] = p, True
                    seed[r], prompt_idx[r], sample_idx[r] = seeds[m], i, j
                    if per_prompt is not None:
                        rows_adapter[r] = per_prompt[i]
                active = np.arange(batch) < len(chunk)
                key = (self._graphdef, self.mesh, self.config.num_key_value_heads, sig, nucleus, batch, plen,
                       new_bucket, len(stop))
                # The adapters as their shapes (set by generate to those on the devices), with this chunk's rows
                chunk_adapters = None if sig is None else dataclasses.replace(adapters, rows=rows_adapter)
                yield key, (tokens, mask, active, seed, prompt_idx, sample_idx, np.float32(params.temperature),
                            np.float32(params.top_p), np.int32(params.max_new_tokens), stop, chunk_adapters,
                            new_bucket, nucleus), [(m, i) for m, i, _ in chunk]

    def _check_adapter_rows(self, adapter_rows, prompts: int, adapters: AdapterBatch | None) -> np.ndarray | None:
        if adapter_rows is None:
            return None
        k = 0 if adapters is None else int(adapters.scale.shape[0])
        rows = np.asarray(adapter_rows)
        if rows.shape != (prompts,) or not np.issubdtype(rows.dtype, np.integer):
            raise RolloutInputError(f"adapter_rows: give one integer per prompt ({prompts}), got "
                                    f"{list(adapter_rows)!r}")
        if rows.size and (rows.min() < -1 or rows.max() >= k):
            raise RolloutInputError(f"adapter_rows {rows.tolist()}: each must be in [-1, {k}) (-1: the base; "
                                    f"{k} adapters set by set_adapters)")
        return None if adapters is None else rows.astype(np.int32)  # no adapters: every row is -1, the base


def _request(request) -> tuple:
    """(prompt_ids, params) or (prompt_ids, params, adapter_rows) -> the three."""
    if not isinstance(request, tuple | list) or len(request) not in (2, 3):
        raise RolloutInputError(f"a request is (prompt_ids, params, adapter_rows or None), got {request!r:.80}")
    return (*request, None) if len(request) == 2 else tuple(request)


def run_settings(params: SamplingParams) -> tuple:
    """What the rows of one program run share (the program's scalars and stop ids)."""
    return (params.temperature, params.top_p, params.stop_token_ids, params.max_new_tokens)


def _describe(params: SamplingParams) -> str:
    return (f"temperature={params.temperature}, top_p={params.top_p}, stop_token_ids={list(params.stop_token_ids)}, "
            f"max_new_tokens={params.max_new_tokens}")


_PROGRAMS: dict = kept({})


def _program(graphdef, mesh, kv_heads: int, state_shardings, decode_attention: str = "xla"):
    """The generate program for one architecture on one mesh, compiled with explicit shardings: weights
    as the table says, rows over dp, scalars replicated. Cached at module level, so engines over the same
    architecture and mesh share compiled programs."""
    segments = segments_for(mesh.devices.flat[0].platform, decode_attention)
    key = (graphdef, mesh, kv_heads, segments, decode_attention)
    if key not in _PROGRAMS:
        rows, vec, repl = S.batch_sharding(mesh, 2), S.batch_sharding(mesh, 1), S.replicated(mesh)
        body = partial(_generate_program, graphdef, kv_sharding=S.kv_cache_sharding(mesh, kv_heads=kv_heads),
                       segments=segments, decode_attention=decode_attention)
        _PROGRAMS[key] = jax.jit(body, static_argnums=(12, 13),
                                 in_shardings=(state_shardings, rows, rows, vec, vec, vec, vec, *[repl] * 5),
                                 out_shardings=(rows, rows, vec, vec))
    return _PROGRAMS[key]


def _generate_program(graphdef, state, tokens, mask, active, seed, prompt_idx, sample_idx, temperature, top_p,
                      max_new, stop, adapters: AdapterBatch | None, new_bucket: int, nucleus: bool = True, *,
                      kv_sharding, segments: int = 1, decode_attention: str = "xla"):
    """tokens/mask (B, P) left-padded, seed/prompt_idx/sample_idx (B,) -> tokens (B, N), logprobs (B, N), lengths
    (B,), stopped (B,). adapters.rows (B,): each row's LoRA adapter (-1: the base); None: no adapters. `nucleus`:
    whether top_p (< 1) filters the tokens sampled from (False: top_p is 1, and no program reads it).
    `decode_attention`: workers.models.decode_attention.IMPLS (a kernel reads each row's filled slots itself)."""
    model = nnx.merge(graphdef, state)
    b, plen = tokens.shape
    # seed (B,): each row its request's (generate_many runs several requests' rows together)
    row_keys = jax.vmap(lambda s, i, j: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), i), j))(
        seed, prompt_idx, sample_idx)
    kv_mask = jnp.concatenate([mask, jnp.ones((b, new_bucket), bool)], axis=1)  # (B, P + N)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    prompt_len = mask.sum(axis=1).astype(jnp.int32)

    cache = [jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, kv_sharding), layer)
             for layer in init_cache(model.config, b, plen + new_bucket)]
    # the prompt attends to the prompt's slots alone: scores over the new-token slots would be masked out anyway
    hidden, cache = model.forward(tokens, positions, mask, cache, 0, adapters=adapters)
    logits = model.logits(hidden[:, -1], adapters)  # left padding: the last column is every row's last prompt token

    def emit(t, logits, out_tok, out_lp, done, length, stopped):
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, t)
        tok, lp = sample_tokens(logits, keys, temperature, top_p, nucleus)
        live = ~done
        out_tok = out_tok.at[:, t].set(jnp.where(live, tok, 0))
        out_lp = out_lp.at[:, t].set(jnp.where(live, lp, 0.0))
        length = length + live
        hit_stop = live & jnp.any(tok[:, None] == stop[None, :], axis=1)
        stopped = stopped | hit_stop
        done = done | hit_stop | (t + 1 >= max_new)
        return out_tok, out_lp, done, length, stopped

    zeros = jnp.zeros((b, new_bucket))
    carry = emit(0, logits, zeros.astype(jnp.int32), zeros.astype(jnp.float32), ~active,
                 jnp.zeros(b, jnp.int32), jnp.zeros(b, bool))

    def cond(c):
        t, _, _, _, done, _, _ = c
        return (t < max_new) & ~jnp.all(done)

    def body(c, slots):
        t, cache, out_tok, out_lp, done, length, stopped = c
        prev = out_tok[:, t - 1][:, None]  # (B, 1)
        # a finished row's attention reads nothing with the kernel: its token is dropped (emit), whatever it is
        h, cache = model.forward(prev, (prompt_len + t - 1)[:, None], kv_mask[:, :slots], cache, plen + t - 1,
                                 adapters=adapters, decode_attention=decode_attention, live=~done,
                                 kv_sharding=kv_sharding)
        return (t + 1, cache, *emit(t, model.logits(h[:, 0], adapters), out_tok, out_lp, done, length, stopped))

    # Segments of the loop, each attending to the slots it can have written (static, the end of its last step):
    # at batch 128 a step's KV cache reads are several times its weights', so a step reads what is filled
    c = (1, cache, *carry)
    for end in _segment_ends(new_bucket, segments):
        c = jax.lax.while_loop(lambda c, end=end: cond(c) & (c[0] < end), partial(body, slots=plen + end), c)
    _, _, out_tok, out_lp, _, length, stopped = c
    return out_tok, out_lp, length, stopped


# Decode loops per program with XLA's attention, by the devices' platform: more read less of the cache, and compile
# one loop body each. Measured by benchmarks/decode_cost.py (qwen3-0.6b, batch 128, 256 + 256 slots, XLA:GPU for an
# H100 without one, 2-core host): bytes a step 11.40 GiB with one loop, 10.46 with 2, 9.99 with 4; compile 20 s, 34 s,
# 43 s. One on the CPU, where a step is compute-bound and the compile is the cost (the tests compile many of these
# programs). A decode attention kernel reads each row's filled slots whatever the loop: one loop.
SEGMENTS = {"cpu": 1, "default": 4}


def segments_for(platform: str, decode_attention: str) -> int:
    """Decode loops of a generate program on `platform` (see SEGMENTS)."""
    if decode_attention != "xla":
        return 1
    return SEGMENTS.get(platform, SEGMENTS["default"])


def _segment_ends(new_bucket: int, segments: int) -> list[int]:
    """The last new-token slot + 1 of each decode segment: `segments` equal parts of the bucket (fewer when it is
    small), the last ending at the bucket."""
    parts = max(1, min(segments, new_bucket // 8))
    return [new_bucket * (i + 1) // parts for i in range(parts)]
