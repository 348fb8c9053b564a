"""Rollout engines: the `RolloutEngine` protocol and its implementations.

- `jax_sampler` (default): KV-cached pure-JAX sampler over the Flax Qwen3 model.
- `fake`: seeded lengths and latency, no model; for scheduler tests.
- `sglang_jax`: the sglang-jax offline engine with rlsched's weight/memory/seed hooks (extra `sglang`,
  Python >= 3.12); run it in a process of its own (a Ray actor).
"""

from workers.rollout.base import (
    EngineOffloadedError,
    FinishReason,
    RolloutEngine,
    RolloutInputError,
    RolloutOutput,
    Sample,
    SamplingParams,
)

ENGINES = ("jax_sampler", "fake", "sglang_jax")
# Engines that must live in a process of their own, whatever the caller asked: sglang-jax's scheduler
# kills its whole process on any error (SIGQUIT), and its single-process mode aborts at exit.
OWN_PROCESS_ENGINES = frozenset({"sglang_jax"})
# The fewest threads XLA's CPU pool must have for an engine (1 unless listed): sglang-jax's CPU sampler
# sorts in a host callback inside its jitted step, which waits on the pool it runs in, so on a
# one-thread pool (a process pinned to one core when JAX starts) its first sampled step hangs.
XLA_CPU_THREADS = {"sglang_jax": 2}


def make_engine(name: str, model_path: str | None = None, *, lora=None, **kwargs) -> RolloutEngine:
    """Build a rollout engine by name; kwargs go to the engine's constructor. `lora` (a workers.models.lora
    LoraSpec): a LoRA task's engine, the base from `model_path` and the task's adapter (jax_sampler only)."""
    if lora is not None and name != "jax_sampler":
        raise ValueError(f"a LoRA task's rollout runs on the jax_sampler engine, not {name!r}")
    if name == "jax_sampler":
        from workers.rollout.jax_sampler import JaxSampler

        if model_path is None:
            raise ValueError("the jax_sampler engine needs a model_path")
        if lora is not None:
            from workers.rollout.adapter_engine import AdapterEngine

            version = kwargs.pop("weight_version", -1)
            return AdapterEngine(JaxSampler.from_pretrained(model_path, **kwargs), lora, weight_version=version)
        return JaxSampler.from_pretrained(model_path, **kwargs)
    if name == "fake":
        from workers.rollout.fake import FakeEngine

        return FakeEngine.for_model(model_path, **kwargs)
    if name == "sglang_jax":
        from workers.rollout.sglang_jax import SglangJaxEngine

        if model_path is None:
            raise ValueError("the sglang_jax engine needs a model_path")
        return SglangJaxEngine(model_path, **kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; choose one of {ENGINES}")


__all__ = [
    "ENGINES", "OWN_PROCESS_ENGINES", "XLA_CPU_THREADS", "EngineOffloadedError", "FinishReason", "RolloutEngine",
    "RolloutInputError", "RolloutOutput", "Sample", "SamplingParams", "make_engine",
]
