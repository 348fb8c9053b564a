"""One LoRA task's rollout engine: the built-in sampler holding the base (the task's `model.path`, loaded once and
never replaced) and serving the task's adapter (workers.models.lora) on every row.

    engine = AdapterEngine(JaxSampler.from_pretrained(path, ...), spec)
    engine.update_weights(adapter_flat, version, checksum=...)   # what a LoRA actor publishes: its adapter alone
    engine.generate(prompt_ids, params)                          # every row with the adapter

Design decisions:
- **A sync moves the adapter only**, verified as full weights are: the incoming names must be exactly the
  adapter's (a base tensor, a missing module or an extra one is refused before anything changes), and the
  checksum is of what the engine will use, read back from the sampler's stacked adapter after the swap, so a
  sync that silently did nothing (the bug LoRA weight syncs are known for) fails the checksum instead of
  rolling out with stale weights. A refused sync keeps the previous adapter and version.
- **A zero adapter stands in until the first sync**, so `prepare` compiles the program `generate` will run
  (the adapter's shapes are known from the spec) and nothing recompiles at the first step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from workers.models import params as P
from workers.models import sharding as S
from workers.models.lora import LoraSpec, adapter_shapes
from workers.rollout.base import RolloutOutput, SamplingParams
from workers.rollout.stamp import StampedWeights


def check_adapter(flat: Mapping[str, object], shapes: Mapping[str, tuple[int, int]], spec: LoraSpec,
                  version: int) -> None:
    """WeightMismatchError unless `flat` is exactly the adapter of `shapes` (names and shapes), before anything
    changes: a base tensor, a missing module or an extra one is refused (this engine and shared_engine's views)."""
    got = {name: tuple(np.shape(x)) for name, x in flat.items()}
    if got != shapes:
        missing, unexpected = sorted(shapes.keys() - got.keys()), sorted(got.keys() - shapes.keys())
        wrong = [f"{n} {got[n]} vs {shapes[n]}" for n in sorted(got.keys() & shapes.keys()) if got[n] != shapes[n]]
        raise P.WeightMismatchError(f"update_weights(version={version}): not this engine's LoRA adapter (rank "
                                    f"{spec.rank} on {list(spec.targets)}): missing {missing[:4]}, "
                                    f"unexpected {unexpected[:4]}, other shapes {wrong[:4]}")


def sync_stats(shapes: Mapping[str, tuple[int, int]], params_bytes: int) -> dict[str, int]:
    """An adapter sync's stats, as update_weights reports them (float32 leaves; the whole adapter is the extra)."""
    sizes = [int(np.prod(s)) * 4 for s in shapes.values()]
    return {"params_bytes": params_bytes, "largest_leaf_bytes": max(sizes), "peak_extra_bytes": sum(sizes)}


class AdapterEngine(StampedWeights):
    """A RolloutEngine (workers.rollout.base) for one LoRA task over a JaxSampler that holds its base."""

    name = "jax_sampler"

    def __init__(self, sampler, spec: LoraSpec, *, weight_version: int = -1):
        self.sampler, self.spec = sampler, spec
        self.config, self.mesh = sampler.config, sampler.mesh
        self._shapes = adapter_shapes(sampler.config, spec)
        self._version, self._checksum = weight_version, None
        zero = {name: np.zeros(shape, np.float32) for name, shape in self._shapes.items()}
        sampler.set_adapters([zero], [spec])

    # ---- weights ---------------------------------------------------------------------------------------------

    def update_weights(self, flat: Mapping[str, object], version: int, *, checksum: str | None = None) -> dict:
        """Serve adapter `flat` ({<module>.lora_a / .lora_b: array}, host or device) as weights `version`."""
        check_adapter(flat, self._shapes, self.spec, version)
        before = self._served_flat()
        repl = S.replicated(self.mesh)
        self.sampler.set_adapters([{n: S.place(x, repl, copy=True) for n, x in flat.items()}], [self.spec])
        digest = P.checksum(self._served_flat())  # what landed, read back from the sampler
        refused = self._refusal(version, digest, checksum, "adapter")
        if refused:
            self.sampler.set_adapters([before], [self.spec])
            raise refused
        self._version, self._checksum = int(version), digest
        return sync_stats(self._shapes, self.memory_bytes()["params"])

    def _served_flat(self) -> dict[str, jax.Array]:
        """The adapter the sampler serves, in the flat layout: its slot 0 of the stacked a/b, unpadded."""
        stacked = self.sampler._live_adapters()  # noqa: SLF001 - the one reader of the sampler's stacked adapters
        return stacked.adapter(0, self._shapes)

    def restore_weights(self) -> int:
        return self.sampler.restore_weights()

    # ---- memory ----------------------------------------------------------------------------------------------

    def memory_bytes(self) -> dict[str, int]:
        """The base's bytes and the adapter's (replicated: whole on every device), by kind."""
        held = self.sampler.memory_bytes()
        adapter = 0 if self.sampler.offloaded else sum(int(np.prod(s)) * 4 for s in self._shapes.values())
        return {"params": held["params"] + adapter, "kv": held["kv"]}

    def offload(self) -> None:
        self.sampler.offload()

    def onload(self) -> None:
        self.sampler.onload()

    @property
    def offloaded(self) -> bool:
        return self.sampler.offloaded

    # ---- generation ------------------------------------------------------------------------------------------

    def prepare(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> int:
        return self.sampler.prepare(prompt_ids, params, adapter_rows=[0] * len(prompt_ids))

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput:
        output = self.sampler.generate(prompt_ids, params, adapter_rows=[0] * len(prompt_ids))
        # The sampler's own version is its base's; the task's weights are the adapter's
        return dataclasses.replace(output, weight_version=self._version)
