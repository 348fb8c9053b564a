"""Rollout engines: the `RolloutEngine` protocol and its implementations.

- `jax_sampler` (default): KV-cached pure-JAX sampler over the Flax Qwen3 model.
- `fake`: seeded lengths and latency, no model; for scheduler tests.
"""

from workers.rollout.base import (
    EngineReleasedError,
    FinishReason,
    RolloutEngine,
    RolloutInputError,
    RolloutOutput,
    Sample,
    SamplingParams,
)

ENGINES = ("jax_sampler", "fake")


def make_engine(name: str, model_path: str | None = None, **kwargs) -> RolloutEngine:
    """Build a rollout engine by name; kwargs go to the engine's constructor."""
    if name == "jax_sampler":
        from workers.rollout.jax_sampler import JaxSampler

        if model_path is None:
            raise ValueError("the jax_sampler engine needs a model_path")
        return JaxSampler.from_pretrained(model_path, **kwargs)
    if name == "fake":
        from workers.rollout.fake import FakeEngine

        return FakeEngine(**kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; choose one of {ENGINES}")


__all__ = [
    "ENGINES", "EngineReleasedError", "FinishReason", "RolloutEngine", "RolloutInputError", "RolloutOutput",
    "Sample", "SamplingParams", "make_engine",
]
