"""Memory accounting per device pool, and the one way to move a role on or off its devices.

Design decisions (and why):
- **Bytes belong to (task, role, kind).** Offload in the field freed far less than expected because
  pools were not tagged per task; here every number is reported under its owner, kind ∈
  params / opt / ref / kv, and totals are sums of those entries, never a separate counter that drifts.
- **Numbers come from the workers.** On CPU `memory_stats()` is None, so workers report the bytes of
  the live arrays they hold; this process's RSS is reported beside them (rlsched.observe.memprobe, stdlib only).
- **`Residency` is the only onload/offload path** (docs/design.md, "The words": Residency): it calls the worker's
  move, updates the pool and emits a timeline span, so accounting and timeline can't miss a move. A role stays where its
  last move put it: the policy decides when to evict it (memory-aware).
- A timeline is anything with a `span(name, **attrs)` context manager; rlsched.observe.timeline's `NullTimeline`
  records nothing.
- Not thread-safe: a pool lives in one single-threaded owner (the scheduler actor or a task driver).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rlsched.observe.memprobe import process_rss_bytes
from rlsched.observe.timeline import NullTimeline

KINDS = ("params", "opt", "ref", "kv")


class Timeline(Protocol):
    def span(self, name: str, **attrs: Any) -> contextlib.AbstractContextManager[Any]: ...


class MemoryPool:
    """Bytes held on one pool of devices, by (task, role, kind). `budget` (bytes or None) is for display:
    admission is decided by `policy.Policy`."""

    def __init__(self, name: str = "default", budget: int | None = None):
        self.name = name
        self.budget = budget
        self._bytes: dict[tuple[str, str, str], int] = {}

    def report(self, task: str, role: str, kind: str, nbytes: int) -> None:
        """Set (not add) the bytes `task`'s `role` holds of `kind`; 0 removes the entry."""
        if kind not in KINDS:
            raise ValueError(f"memory kind must be one of {KINDS}, got {kind!r}")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes for ({task}, {role}, {kind}) must be a non-negative int, got {nbytes!r}")
        key = (str(task), str(role), kind)
        if nbytes:
            self._bytes[key] = nbytes
        else:
            self._bytes.pop(key, None)

    def clear(self, task: str, role: str | None = None) -> None:
        """Forget everything `task` (or just its `role`) holds: it was offloaded or its process died."""
        for key in [k for k in self._bytes if k[0] == task and (role is None or k[1] == role)]:
            del self._bytes[key]

    def total(self, task: str | None = None, role: str | None = None, kind: str | None = None) -> int:
        """Sum of the entries matching every filter given."""
        return sum(n for (t, r, k), n in self._bytes.items()
                   if (task is None or t == task) and (role is None or r == role) and (kind is None or k == kind))

    def by(self, field: str) -> dict[str, int]:
        """Totals grouped by "task", "role" or "kind"."""
        index = ("task", "role", "kind").index(field)
        out: dict[str, int] = {}
        for key, n in self._bytes.items():
            out[key[index]] = out.get(key[index], 0) + n
        return out

    def snapshot(self) -> dict[str, Any]:
        """JSON-safe: totals, per task/role/kind, every entry, and process RSS."""
        return {
            "pool": self.name,
            "budget": self.budget,
            "total": self.total(),
            "by_task": self.by("task"),
            "by_role": self.by("role"),
            "by_kind": self.by("kind"),
            "entries": [{"task": t, "role": r, "kind": k, "bytes": n} for (t, r, k), n in sorted(self._bytes.items())],
            "rss_bytes": process_rss_bytes(),
        }


class Residency:
    """Where one role of one task lives, device or host; the only way to move it.

    `onload()` runs the worker's onload inside an "onload" span and records the bytes it reports
    (an int, recorded as `kind`, or a {kind: bytes} mapping) under (task, role); `offload()` runs the
    worker's offload inside an "offload" span and clears them. Both are no-ops when the role is
    already where it is asked to be. `on_change(task, role, sizes)` (optional) hears every change,
    e.g. to mirror it into the scheduler's pool.
    """

    def __init__(self, pool: MemoryPool, task: str, role: str, *, onload: Callable[[], int | Mapping[str, int]],
                 offload: Callable[[], None], timeline: Timeline | None = None, resident: bool = False,
                 sizes: int | Mapping[str, int] | None = None, kind: str = "params",
                 on_change: Callable[[str, str, dict[str, int]], None] | None = None):
        self.pool, self.task, self.role, self.kind = pool, str(task), str(role), kind
        self._onload, self._offload, self._on_change = onload, offload, on_change
        self.timeline = timeline or NullTimeline()
        self.resident = resident
        if resident and sizes is not None:
            self._record(self._sizes(sizes))

    def _sizes(self, reported: int | Mapping[str, int]) -> dict[str, int]:
        sizes = dict(reported) if isinstance(reported, Mapping) else {self.kind: reported}
        for k, n in sizes.items():
            if k not in KINDS or not isinstance(n, int) or n < 0:
                raise ValueError(f"onload of ({self.task}, {self.role}) returned {reported!r}: "
                                 f"expected bytes by kind in {KINDS}")
        return sizes

    def _record(self, sizes: dict[str, int]) -> None:
        self.pool.clear(self.task, self.role)  # a fresh onload replaces what was reported before
        for k, n in sizes.items():
            self.pool.report(self.task, self.role, k, n)
        if self._on_change is not None:
            self._on_change(self.task, self.role, sizes)

    @property
    def nbytes(self) -> int:
        return self.pool.total(self.task, self.role)

    def onload(self, **attrs: Any) -> int:
        """Bring the role onto its devices; returns the bytes resident. If the worker raises, the pool
        is unchanged."""
        if self.resident:
            return self.nbytes
        with self.timeline.span("onload", task=self.task, role=self.role, pool=self.pool.name, **attrs) as span:
            sizes = self._sizes(self._onload())
            if isinstance(span, dict):
                span["bytes"] = sum(sizes.values())
        self._record(sizes)
        self.resident = True
        return sum(sizes.values())

    def offload(self, **attrs: Any) -> None:
        """Move the role to host memory. If the worker raises, the entries stay: the bytes are
        presumably still on the device."""
        if not self.resident:
            return
        with self.timeline.span("offload", task=self.task, role=self.role, pool=self.pool.name, bytes=self.nbytes,
                                **attrs):
            self._offload()
        self.lost()  # the bytes are on host now: none left on the devices

    def replace_worker(self, *, onload: Callable[[], int | Mapping[str, int]], offload: Callable[[], None],
                       sizes: int | Mapping[str, int], **attrs: Any) -> None:
        """The role's process died and a new one took its place, created on its devices (`sizes`): moves go to
        the new one, and it is put where the old one was (moved to host at once if the old one was there)."""
        self._onload, self._offload = onload, offload
        was_resident, self.resident = self.resident, True
        self._record(self._sizes(sizes))
        if not was_resident:
            self.offload(**attrs)

    def lost(self) -> None:
        """Nothing of the role is on its devices any more: after an offload, or when its process died (what it
        held there went with it)."""
        self.pool.clear(self.task, self.role)
        self.resident = False
        if self._on_change is not None:
            self._on_change(self.task, self.role, {})
