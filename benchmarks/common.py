"""What every benchmark shares: a CPU, offline setup; the environment record; atomic result files.

Importing this module sets JAX to CPU (unless JAX_PLATFORMS is set) and the model hubs offline, so a
benchmark imports it before anything imports jax or transformers.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np

from rlsched.rundir.files import write_atomic

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # checkpoints are local; nothing may come from a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def environment() -> dict:
    import flax
    import jax
    import transformers

    env = dict(python=platform.python_version(), jax=jax.__version__, flax=flax.__version__,
               transformers=transformers.__version__, numpy=np.__version__, jax_devices=[str(d) for d in jax.devices()],
               cpu_count=os.cpu_count(), cpus_usable=len(os.sched_getaffinity(0)), machine=platform.machine())
    try:  # the torch reference is a test extra: benchmarks that compare against it need it, others don't
        import torch

        env.update(torch=torch.__version__, torch_num_threads=torch.get_num_threads())
    except ImportError:
        pass
    return env


def count_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):  # headers only; no tensor is read
        with safe_open(str(file), framework="numpy") as f:
            total += sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())  # noqa: SIM118
    return total


def save_results(out: Path, title: str, results: dict, report: str) -> None:
    """Print the report and save results.json + report.md into `out`, each atomically."""
    import json

    print("\n" + report)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "results.json", json.dumps(results, indent=2) + "\n")
    write_atomic(out / "report.md", f"# {title}\n\n{report}\n")
    print(f"\nsaved {out / 'results.json'} and {out / 'report.md'}")
