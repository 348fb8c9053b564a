"""Memory probes for trackers: process RSS and per-device bytes, named like the field's weight-swap probe.

`memory_metrics()` -> `mem/process/rss_bytes`, `mem/device{i}/bytes_in_use`, `mem/device{i}/peak_bytes`
(and `mem/device{i}/bytes_limit` where the backend knows it), for local JAX device i (its position in
`jax.local_devices()`). `phase_memory(name, idx)` adds `phase/name` and `phase/idx`, so a run logs
one row per phase and a swap that ever holds two parameter sets shows as a peak (docs/design.md, "What the
design answers").

Design decisions:
- Accelerators report their allocator's numbers (`device.memory_stats()`). On CPU that is None, so
  bytes in use is the sum of the live JAX arrays' shards on that device (each shard counted on its
  own device), and the peak is the largest value this process's probe has seen: a peak between two
  probes is missed. Arrays that alias host buffers (a CPU `device_put` of a numpy array) count too.
- jax is imported inside the function: the control plane imports this module without jax.
"""

from __future__ import annotations

import os
import resource
from typing import Any

_cpu_peaks: dict[int, int] = {}  # device index -> largest bytes_in_use seen by this process's probe (CPU only)


def process_rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc), else its peak RSS (getrusage)."""
    try:
        with open("/proc/self/statm") as f:  # Linux: pages; no import, no subprocess
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _live_bytes_by_device(jax) -> dict[Any, int]:
    used: dict[Any, int] = {}
    from workers.offload import device_shards, on_device

    for array in jax.live_arrays():
        if not on_device(array):  # offloaded to pinned host memory: live, but not on the device
            continue
        for device, _, nbytes in device_shards(array):  # none if another thread deleted it meanwhile
            used[device] = used.get(device, 0) + nbytes
    return used


def memory_metrics(prefix: str = "mem") -> dict[str, int]:
    """Process RSS and, per local JAX device i, bytes in use, peak bytes and (when known) the limit.

    Keys: `{prefix}/process/rss_bytes`, `{prefix}/device{i}/bytes_in_use`, `{prefix}/device{i}/peak_bytes`,
    `{prefix}/device{i}/bytes_limit`. On devices without allocator stats (CPU), bytes in use is summed from
    live arrays and the peak is the largest value seen by this process's probe so far (not the true peak).
    Calling it initialises JAX's backend.
    """
    import jax

    out = {f"{prefix}/process/rss_bytes": process_rss_bytes()}
    live: dict[Any, int] | None = None
    for i, device in enumerate(jax.local_devices()):
        key = f"{prefix}/device{i}"
        stats = device.memory_stats()
        if stats is not None:
            in_use = int(stats.get("bytes_in_use", 0))
            out[f"{key}/bytes_in_use"] = in_use
            out[f"{key}/peak_bytes"] = int(stats.get("peak_bytes_in_use", in_use))
            if "bytes_limit" in stats:
                out[f"{key}/bytes_limit"] = int(stats["bytes_limit"])
            continue
        if live is None:
            live = _live_bytes_by_device(jax)  # one pass over the arrays for all devices
        in_use = live.get(device, 0)
        _cpu_peaks[i] = max(_cpu_peaks.get(i, 0), in_use)
        out[f"{key}/bytes_in_use"] = in_use
        out[f"{key}/peak_bytes"] = _cpu_peaks[i]
    return out


def phase_memory(phase_name: str, idx: int) -> dict[str, Any]:
    """`{"phase/name": phase_name, "phase/idx": idx, **memory_metrics()}`: one row of a per-phase memory log."""
    return {"phase/name": phase_name, "phase/idx": idx, **memory_metrics()}
