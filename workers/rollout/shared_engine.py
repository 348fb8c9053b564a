"""One rollout engine per base group in a process: a JaxSampler over the shared base (workers.shared_base) with K
adapter slots, and a per-task view of it that keeps a LoRA task's engine contract (workers.rollout.adapter_engine).

    view = open_view(path, dtype=..., mesh=mesh, spec=spec, seed=3, max_prompt_len=..., ...)  # slot k of the group's
    view.update_weights(adapter_flat, version, checksum=...)  # this task's adapter alone, verified by read-back
    view.generate(prompt_ids, params)                           # every row with slot k's adapter
    view.generate(prompt_ids, params, together=Together(hold, 3))  # one program run with the hold's 2 other tasks
    view.close()                                                # the group's last view frees the sampler and base

Design decisions:
- **A slot per task, the stack per call.** Each view's adapter lives in its slot as its own device arrays
  (replicated on the mesh), so a view's offload frees exactly its adapter and nobody else's. The K adapters are
  stacked (workers.models.lora_batch.stack) into the sampler for a generate (once per hold when co-batched) and
  dropped after it, as the KV cache is: between calls the process holds the base once and each task's adapter
  once. A sync's read-back stacks its own slot alone and a prepare reuses the stack's shapes while no task comes
  or goes, so neither costs more as the group grows. An offloaded or closed slot is stacked as zeros, so K (part
  of the program's key) stays put while tasks come and go; a closed slot is reused by the next view.
- **A view's rows run its slot only.** Row b's delta gathers adapter rows[b] alone (AdapterBatch.delta), so what
  the other slots hold never reaches a view's rows: a view generates what its task would alone.
- **A sync is verified as a task's own engine verifies it**: names and shapes must be the adapter's, and the
  checksum is read back from the slot as the sampler stacks it, so a swap that changed nothing fails.
- **The base is never offloaded, swapped or freed by a view.** It is resident for the group's life: the group's
  sampler holds a lease (workers.shared_base) and releases it when its last view closes.
- One lock per group serialises the calls that stack (roles of several tasks call from their own threads in a
  device group's process); compiling runs outside it.
- **Co-batched ROLLOUT.** When the scheduler grants one hold to several tasks of the group (`Together`), their
  views' generate calls meet in a gathering (workers.rollout.cobatch: why it waits, and why only so long) and
  one thread runs them as one `generate_many` per group of equal sampling settings (temperature, top_p, stop ids,
  max_new_tokens: the program's scalars). Each task keeps its own seed stream (a view draws its seed before
  joining, as it does alone), so it gets the tokens it would get alone; logprobs agree to float rounding (bit for
  bit where the joint run's batch has its own run's shapes; JaxSampler's docstring). A member's bad request,
  or an offloaded view, fails that member alone, before it joins, and withdraws it so the others do not wait.
- `prepare` also compiles the joint shapes a hold of this group can have: c copies of the task's request for
  c = 2 .. the live slots, until the rows fill max_batch_size (distinct programs only; tasks whose requests
  differ in shape compile their joint program on first use).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from workers import shared_base
from workers.models import params as P
from workers.models import sharding as S
from workers.models.lora import LoraSpec, adapter_shapes
from workers.models.lora_batch import stack
from workers.offload import offload, onload
from workers.rollout.adapter_engine import check_adapter, sync_stats
from workers.rollout.base import EngineOffloadedError, RolloutOutput, SamplingParams, Together, validate_request
from workers.rollout.cobatch import Gatherings
from workers.rollout.stamp import StampedWeights


@dataclasses.dataclass
class _Slot:
    spec: LoraSpec
    shapes: dict[str, tuple[int, int]]
    device: dict[str, jax.Array] | None  # on the mesh (replicated); None while offloaded
    host: object = None  # workers.offload.Offloaded while offloaded


class SharedSampler:
    """A JaxSampler over a shared base serving the adapters of K slots. Built by `open_view`."""

    def __init__(self, lease: shared_base.Lease, *, max_prompt_len: int, max_new_tokens: int, max_batch_size: int,
                 prompt_padding: str = "bucket", decode_attention: str = "auto"):
        from workers.rollout.jax_sampler import JaxSampler

        self.lease = lease
        # take_ownership: the base's own arrays, not a copy (it lays them out as they already are)
        self.sampler = JaxSampler(nnx.merge(lease.graphdef, lease.params), max_prompt_len=max_prompt_len,
                                  max_new_tokens=max_new_tokens, max_batch_size=max_batch_size, take_ownership=True,
                                  mesh=lease.mesh, prompt_padding=prompt_padding, decode_attention=decode_attention)
        self.config, self.mesh = self.sampler.config, self.sampler.mesh
        self.slots: list[_Slot | None] = []
        self.lock = threading.RLock()
        self.gatherings = Gatherings(self._run_together)  # co-batched holds (wait_s: settable, e.g. by tests)
        self._abstract_of: tuple = (None, None)  # (the slots' specs, the stack's abstract shapes for them)

    # ---- slots -------------------------------------------------------------------------------------------------

    def add(self, spec: LoraSpec) -> int:
        """A slot for a new task's adapter, zero until its first sync; its index."""
        shapes = adapter_shapes(self.config, spec)
        repl = S.replicated(self.mesh)
        zero = {n: jax.device_put(np.zeros(s, np.float32), repl) for n, s in shapes.items()}
        with self.lock:
            slot = _Slot(spec, shapes, zero)
            free = [i for i, s in enumerate(self.slots) if s is None]
            if free:
                self.slots[free[0]] = slot
                return free[0]
            self.slots.append(slot)
            return len(self.slots) - 1

    def remove(self, k: int) -> bool:
        """Free slot k; whether it was the last live one (then the group is done)."""
        with self.lock:
            self.slots[k] = None
            return all(s is None for s in self.slots)

    def slot(self, k: int) -> _Slot:
        return self.slots[k]

    def _stack(self) -> None:
        """Put the K slots' adapters into the sampler (an offloaded or free slot as zeros)."""
        live = next(s for s in self.slots if s is not None)
        adapters, specs = [], []
        for s in self.slots:
            held = s if s is not None else live  # a free slot: zeros shaped as a live one's
            adapters.append(s.device if s is not None and s.device is not None
                            else {n: np.zeros(x, np.float32) for n, x in held.shapes.items()})
            specs.append(held.spec)
        self.sampler.set_adapters(adapters, specs)

    def _unstack(self) -> None:
        self.sampler.set_adapters([], [])

    def served(self, k: int) -> dict[str, jax.Array]:
        """Slot k's adapter as the sampler serves it: stacked as `_stack` stacks it (workers.models.lora_batch.stack,
        placed on the mesh), read back unpadded, in the flat layout. Slot k alone is stacked: what the other slots
        hold never enters row k's delta (AdapterBatch.delta gathers its own index), and a sync costs the same
        however many tasks share the group (stacking every slot for each task's sync was quadratic in them)."""
        with self.lock:
            slot = self.slots[k]
            repl = S.replicated(self.mesh)
            stacked = jax.tree.map(lambda x: S.place(x, repl, copy=True), stack([slot.device], [slot.spec], []))
            return {name: jax.numpy.copy(x) for name, x in stacked.adapter(0, slot.shapes).items()}

    def _abstract(self):
        """The stack's shapes and shardings (to compile without it), kept per set of slots: they change only when a
        task comes or goes, so a prepare does not stack every slot's adapter again."""
        composition = tuple(None if s is None else s.spec for s in self.slots)
        if self._abstract_of[0] != composition:
            self._stack()
            self._abstract_of = (composition, self.sampler._abstract_adapters())  # noqa: SLF001 - shapes only
            self._unstack()
        return self._abstract_of[1]

    # ---- generation --------------------------------------------------------------------------------------------

    def prepare(self, prompt_ids, params: SamplingParams, k: int) -> int:
        """Compile slot k's request alone and as c copies (c = 2 .. the live slots, until the rows fill
        max_batch_size): the joint runs a hold of this group's tasks makes when their requests are alike."""
        with self.lock:
            abstract = self._abstract()
            live = sum(s is not None for s in self.slots)
        request = (prompt_ids, params, [k] * len(prompt_ids))
        runs, rows = [[request]], len(prompt_ids) * params.n
        for copies in range(2, live + 1):
            if (copies - 1) * rows >= self.sampler.max_batch_size:  # full chunks already: nothing new past here
                break
            runs.append([request] * copies)
        return self.sampler.prepare_runs(runs, adapters=abstract)  # the runs' programs compile at once

    def generate(self, prompt_ids, params: SamplingParams, k: int) -> RolloutOutput:
        """Slot k's request alone: a run of one (`_run_together`)."""
        (result,) = self._run_together([(k, prompt_ids, params)])
        if isinstance(result, BaseException):
            raise result
        return result

    def validate(self, prompt_ids, params: SamplingParams) -> None:
        """The sampler's request checks (RolloutInputError), for a member before it joins a gathering."""
        sampler = self.sampler
        validate_request(prompt_ids, params, max_prompt_len=sampler.max_prompt_len,
                         max_new_tokens=sampler.max_new_tokens, vocab_size=self.config.vocab_size)

    def _run_together(self, requests) -> list:
        """A gathering's run: requests (slot, prompt_ids, params) -> per request its RolloutOutput or exception;
        one generate_many per group of equal sampling settings (cobatched: the requests in its run)."""
        from workers.rollout.jax_sampler import run_settings

        results: list = [None] * len(requests)
        runs: dict[tuple, list[int]] = {}
        for i, (_, _, params) in enumerate(requests):
            runs.setdefault(run_settings(params), []).append(i)
        with self.lock:
            self._stack()
            try:
                for members in runs.values():
                    live = []
                    for i in members:  # a slot offloaded (or closed) since its view joined: stacked as zeros
                        slot = self.slots[requests[i][0]]
                        if slot is None or slot.device is None:
                            results[i] = EngineOffloadedError("the engine is offloaded; call onload() first")
                        else:
                            live.append(i)
                    if not live:
                        continue
                    batch = [(prompts, p, [k] * len(prompts)) for k, prompts, p in (requests[i] for i in live)]
                    try:
                        outputs = self.sampler.generate_many(batch)
                    except Exception as e:  # noqa: BLE001 - each member of this run gets it
                        outputs = [e] * len(live)
                    for i, output in zip(live, outputs, strict=True):
                        results[i] = output
            finally:
                self._unstack()
        return results

    def close(self) -> None:
        self._unstack()
        self.sampler = None  # its state is the base's arrays: the lease frees them, never the sampler
        self.lease.release()


_LOCK = threading.Lock()
_GROUPS: dict[tuple, SharedSampler] = {}


def open_view(path, *, dtype: str | None, mesh, spec: LoraSpec, max_prompt_len: int, max_new_tokens: int,
              max_batch_size: int, seed: int = 0, weight_version: int = -1,
              prompt_padding: str = "bucket", decode_attention: str = "auto") -> AdapterView:
    """A LoRA task's engine: a slot of its base group's sampler in this process (made now if it has none). Tasks
    share a sampler only where they agree on its settings (prompt_padding and decode_attention included: they are
    the sampler's)."""
    key = (shared_base.base_key(path, dtype, mesh), max_prompt_len, max_new_tokens, max_batch_size, prompt_padding,
           decode_attention)
    with _LOCK:
        group = _GROUPS.get(key)
        if group is None:
            lease = shared_base.acquire(path, dtype=dtype, mesh=mesh)
            try:
                group = _GROUPS[key] = SharedSampler(lease, max_prompt_len=max_prompt_len,
                                                     max_new_tokens=max_new_tokens, max_batch_size=max_batch_size,
                                                     prompt_padding=prompt_padding,
                                                     decode_attention=decode_attention)
            except BaseException:
                lease.release()
                raise
        k = group.add(spec)
    return AdapterView(group, k, key, seed=seed, weight_version=weight_version)


def _close_slot(key: tuple, group: SharedSampler, k: int) -> None:
    with _LOCK:
        if group.remove(k) and _GROUPS.get(key) is group:
            del _GROUPS[key]
            group.close()


def groups() -> dict[tuple, int]:
    """{key: live slots} of the shared samplers in this process (for tools and tests)."""
    with _LOCK:
        return {key: sum(s is not None for s in g.slots) for key, g in _GROUPS.items()}


class AdapterView(StampedWeights):
    """One LoRA task's rollout engine (the RolloutEngine contract of workers.rollout.adapter_engine.AdapterEngine)
    over slot `k` of its base group's SharedSampler."""

    name = "jax_sampler"

    def __init__(self, group: SharedSampler, k: int, key: tuple, *, seed: int, weight_version: int):
        self.group, self.slot_index = group, k
        self.sampler = group.sampler
        self.config, self.mesh, self.spec = group.config, group.mesh, group.slot(k).spec
        self._shapes = group.slot(k).shapes
        self._version, self._checksum = weight_version, None
        self._rng = np.random.default_rng(seed)
        self._closer = weakref.finalize(self, _close_slot, key, group, k)

    @property
    def _slot(self) -> _Slot:
        return self.group.slot(self.slot_index)

    # ---- weights ---------------------------------------------------------------------------------------------

    def _served_flat(self) -> dict[str, jax.Array]:
        if self._slot.device is None:
            raise EngineOffloadedError("the engine is offloaded; call onload() first")
        return self.group.served(self.slot_index)

    def update_weights(self, flat: Mapping[str, object], version: int, *, checksum: str | None = None) -> dict:
        """Serve adapter `flat` ({<module>.lora_a / .lora_b: array}, host or device) as weights `version`, in this
        task's slot only; a refused sync keeps the previous adapter and version."""
        check_adapter(flat, self._shapes, self.spec, version)
        slot, repl = self._slot, S.replicated(self.mesh)
        with self.group.lock:
            before = slot.device  # None while offloaded: the host copy stays untouched until the new one verifies
            slot.device = {n: S.place(x, repl, copy=True) for n, x in flat.items()}
            digest = P.checksum(self.group.served(self.slot_index))  # what landed, read back as it is served
            refused = self._refusal(version, digest, checksum, "adapter")
            if refused:
                slot.device = before
                raise refused
            if before is None and slot.host is not None:  # offloaded: it stays where the task left it, on host
                slot.host, slot.device = offload(slot.device), None
        self._version, self._checksum = int(version), digest
        return sync_stats(self._shapes, self.memory_bytes()["params"])

    def restore_weights(self) -> int:
        return 0  # an onload brings the adapter back at once; the base never left

    # ---- memory ----------------------------------------------------------------------------------------------

    def memory_bytes(self) -> dict[str, int]:
        """This task's adapter (replicated: whole on every device) while on the devices; the shared base is not
        the task's to count (`shared_bytes`), and the KV cache exists only inside `generate`."""
        adapter = 0 if self.offloaded else sum(int(np.prod(s)) * 4 for s in self._shapes.values())
        return {"params": adapter, "kv": 0}

    def shared_bytes(self) -> int:
        """Per device, the shared base this engine serves: resident for the group's life, held once."""
        return self.group.lease.nbytes()

    def offload(self) -> None:
        """This task's adapter to host memory; the other slots and the base stay."""
        slot = self._slot
        with self.group.lock:
            if slot.device is not None:
                slot.host, slot.device = offload(slot.device), None

    def onload(self) -> None:
        slot = self._slot
        with self.group.lock:
            if slot.device is None and slot.host is not None:
                slot.device, slot.host = onload(slot.host), None
                self._checksum = None  # hashed again from the devices when asked, never assumed

    @property
    def offloaded(self) -> bool:
        return self._slot.device is None

    def close(self) -> None:
        """Free this task's slot; the group's last view frees its sampler and gives the base back."""
        self._closer()

    # ---- generation ------------------------------------------------------------------------------------------

    def prepare(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> int:
        """Compile this request's program, and the joint ones of a hold whose tasks' requests are alike."""
        return self.group.prepare(prompt_ids, params, self.slot_index)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *,
                 together: Together | None = None) -> RolloutOutput:
        """Every row with this task's adapter. `together` (a hold of several tasks of this group): the call waits
        for theirs and runs with them in one program run (workers.rollout.cobatch); the output is what this task
        gets alone, with `cobatched` the tasks in its run."""
        joint = together is not None and together.tasks > 1
        try:
            if self.offloaded:
                raise EngineOffloadedError("the engine is offloaded; call onload() first")
            if params.seed is None:  # this task's own stream, as its own engine would draw it
                params = dataclasses.replace(params, seed=int(self._rng.integers(0, 2**31)))
            if joint:
                self.group.validate(prompt_ids, params)  # a bad request fails this task alone, before it joins
        except BaseException:
            if joint:
                self.withdraw(together)
            raise
        if joint:
            output = self.group.gatherings.join(together.hold, together.tasks, (self.slot_index, prompt_ids, params))
        else:
            output = self.group.generate(prompt_ids, params, self.slot_index)
        return dataclasses.replace(output, weight_version=self._version)

    def withdraw(self, together: Together) -> None:
        """This task will not generate in the hold `together` (it failed before: a refused sync, a dead role):
        the hold's other tasks stop waiting for it."""
        if together.tasks > 1:
            self.group.gatherings.withdraw(together.hold, together.tasks)
