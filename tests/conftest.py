"""Shared fixtures. Models are tiny and built locally; transformers (torch CPU) is the reference."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from workers.models import init_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """`rlsched init-model --preset tiny` output, with weights peaked enough (std 0.2) that greedy
    decoding has no near-ties for float rounding to flip."""
    return init_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0, initializer_range=0.2)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from workers.models import load_pretrained

    return load_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def ray_session():
    """One embedded local Ray for the whole test session (started on first use)."""
    import ray

    from rlsched.experiment import init_ray

    init_ray()
    yield ray
    ray.shutdown()
