"""Shared fixtures. Models are tiny and built locally; transformers (torch CPU) is the reference."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session's processes (this one, Ray's role processes, CLI
# subprocesses: they inherit the environment): the many runs of the same tiny models compile each program once.
# With a size limit, JAX takes a file lock around each read and write, so concurrent processes never see half
# an entry. A test speed measure only: results are the same programs' (the bit-for-bit tests still hold).
import tempfile  # noqa: E402

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"rlsched-tests-jax-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 * 2**30))
# 8 XLA host devices in this process, for the sharded-role tests (a mesh needs as many devices as it
# has); programs not given a mesh still run on the first device only. Not in the sglang stage's
# environment: it runs only the sglang tests, and sglang-jax fills unspecified mesh axes with every
# device it sees.
import importlib.util  # noqa: E402

if (importlib.util.find_spec("sgl_jax") is None
        and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pytest  # noqa: E402

from workers.models import init_model  # noqa: E402


def own_lines(err: str) -> list[str]:
    """The lines of `err` (a test's captured stderr) that this process wrote: Ray forwards the session cluster's
    worker output (another test's, at times) to it, each line behind a coloured `(Worker pid=...)` prefix."""
    return [line for line in err.splitlines() if not line.startswith("\x1b[")]


def one_task_fits_gb(task) -> float:
    """A per-device memory budget (GiB) with room for one task's engine and actor and half of one more role: one
    task fits, two never do, so colocated tasks evict each other's roles all along. `task`: a TaskConfig."""
    from rlsched.run.experiment import estimate_bytes

    engine, actor = estimate_bytes(task)
    return (engine + actor + min(engine, actor) // 2) / 2**30


def lora_task_dir(root, base_dir, lora: dict, actor, step: int = 2):
    """A LoRA task's directory under `root` as a run leaves it, for `rlsched export`: hparams.json naming its base
    (`base_dir`) and adapter (`lora`: {rank, alpha, targets}), and the adapter `actor` (a LoRA ActorWorker) holds
    saved as checkpoint `step`."""
    import json

    from rlsched.run.checkpoints import TaskCheckpointer

    task = root / "run" / "tasks" / "add"
    task.mkdir(parents=True)
    (task / "hparams.json").write_text(json.dumps({"model": {"path": str(base_dir)}, "lora": lora}))
    saver = TaskCheckpointer(task / "checkpoints", background=False)
    saver.save(step, actor.state, {"step": step, "version": actor.version})
    saver.close()
    return task


def rlsched_export(task, *args):
    """`rlsched export TASK ARGS...` in a process of its own, as a user runs it (the finished process)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "rlsched.cli", "export", str(task), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def host_transfers():
    """`with host_transfers() as seen:` lists each device array whose bytes are read into host memory inside the
    block, as (how, shape, dtype name, bytes). JAX's transfer guard cannot tell on the CPU backend (device memory
    is host memory there: a guard set to "disallow_explicit" lets `jax.device_get` and a move to pinned_host
    through), so the ways code reads a device array's bytes on the host are wrapped instead: `jax.device_get`,
    `jax.device_put` into a host memory kind, numpy's `asarray` / `array` / `ascontiguousarray` of a jax.Array, and
    the array's own host value (`float(x)`, `.item()`, `.tolist()`). A read may be listed twice (device_get reads
    the host value): the lists are for asserting what crossed, not for summing."""
    import contextlib

    import jax
    import numpy as np
    from jax._src import array as jax_array

    from workers.offload import on_device

    @contextlib.contextmanager
    def record():
        seen: list[tuple[str, tuple, str, int]] = []

        def note(how, tree):
            for x in jax.tree.leaves(tree):
                if isinstance(x, jax.Array) and on_device(x):
                    seen.append((how, tuple(x.shape), x.dtype.name, int(x.nbytes)))

        get, put, value = jax.device_get, jax.device_put, jax_array.ArrayImpl._value
        numpy = {name: getattr(np, name) for name in ("asarray", "array", "ascontiguousarray")}

        def device_get(tree):
            note("device_get", tree)
            return get(tree)

        def device_put(x, device=None, *args, **kwargs):
            if any(getattr(d, "memory_kind", None) in ("pinned_host", "unpinned_host")
                   for d in jax.tree.leaves(device)):
                note("device_put to host memory", x)
            return put(x, device, *args, **kwargs)

        def to_numpy(name):
            def wrapped(x, *args, **kwargs):
                note(f"np.{name}", x if isinstance(x, jax.Array) else None)
                return numpy[name](x, *args, **kwargs)
            return wrapped

        def host_value(self):
            note("host value", self)
            return value.fget(self)

        jax.device_get, jax.device_put, jax_array.ArrayImpl._value = device_get, device_put, property(host_value)
        for name in numpy:
            setattr(np, name, to_numpy(name))
        try:
            yield seen
        finally:
            jax.device_get, jax.device_put, jax_array.ArrayImpl._value = get, put, value
            for name, fn in numpy.items():
                setattr(np, name, fn)

    return record


@pytest.fixture(autouse=True, scope="module")
def _forget_compiled_programs():
    """After each test module, free the programs it compiled in this process. Each holds a few memory maps of JIT
    code, and Linux caps a process at vm.max_map_count (65530): the whole suite in one process reached it at test
    606 of 753 (34k maps by test 330), and the next compile died of a segfault. Programs a later module needs are
    compiled again (session fixtures keep theirs while they hold them)."""
    yield
    import gc

    from workers import compiling

    compiling.forget()  # with the sampler's programs and JAX's own caches
    gc.collect()


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

    from rlsched.cluster.ray_cluster import init_ray

    init_ray()
    yield ray
    ray.shutdown()


# ---- the `sglang` marker: sglang-jax tests run only where sglang-jax is installed ------------------
# They are deselected (not skipped) elsewhere, with a line in the summary naming the stage that runs
# them; where sglang-jax is installed (the Python 3.12 stage) they run, and fail if it breaks.

_SGLANG_DESELECTED: list = []


def _sglang_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("sgl_jax") is not None


def pytest_collection_modifyitems(config, items):
    if _sglang_installed():
        return
    chosen = [item for item in items if item.get_closest_marker("sglang") is None]
    _SGLANG_DESELECTED[:] = [item for item in items if item.get_closest_marker("sglang") is not None]
    if _SGLANG_DESELECTED:
        config.hook.pytest_deselected(items=list(_SGLANG_DESELECTED))
        items[:] = chosen


def pytest_terminal_summary(terminalreporter):
    if _SGLANG_DESELECTED:
        terminalreporter.write_line(
            f"{len(_SGLANG_DESELECTED)} sglang-marked tests deselected: sglang-jax is not installed in this "
            "environment; they run in the Python 3.12 stage, .ci/sglang_stage.sh")


@pytest.fixture
def service(tmp_path):
    """A scheduler service for one test, driven through the CLI with a private RLSCHED_HOME (tests/test_service.py's
    _Service: `svc("up")`, `svc("submit", ...)`, ...); whatever it started is stopped after the test."""
    from test_service import _Service

    (tmp_path / "work").mkdir()
    svc = _Service(tmp_path / "home", tmp_path / "work")
    yield svc
    svc.clean_up()
