"""MemoryPool accounting and Residency, the one way a role moves, with a hand-written fake timeline."""

from __future__ import annotations

import contextlib
import json

import pytest

from rlsched.observe.memprobe import process_rss_bytes
from rlsched.observe.timeline import NullTimeline
from rlsched.scheduling.memory import MemoryPool, Residency


class FakeTimeline:
    """Records (event, name, attrs) so tests can check the order of spans and what ran inside them."""

    def __init__(self):
        self.events = []

    @contextlib.contextmanager
    def span(self, name, **attrs):
        self.events.append(("begin", name, attrs))
        yield
        self.events.append(("end", name, attrs))


class FakeWorker:
    def __init__(self, nbytes, timeline=None):
        self.nbytes, self.timeline, self.on_device, self.calls = nbytes, timeline, False, []

    def onload(self):
        self.calls.append("onload")
        if self.timeline is not None:  # the move must happen inside its span
            assert self.timeline.events[-1][:2] == ("begin", "onload")
        self.on_device = True
        return self.nbytes

    def offload(self):
        self.calls.append("offload")
        self.on_device = False


def test_pool_accounting_by_task_role_kind():
    pool = MemoryPool("g0/shared", budget=1000)
    pool.report("a", "actor", "params", 100)
    pool.report("a", "actor", "opt", 200)
    pool.report("a", "actor", "ref", 100)
    pool.report("a", "engine", "kv", 50)
    pool.report("b", "engine", "params", 70)
    pool.report("a", "actor", "params", 120)  # a report replaces, it doesn't add
    assert pool.total() == 120 + 200 + 100 + 50 + 70
    assert pool.total(task="a") == 470 and pool.total(task="a", role="actor") == 420
    assert pool.total(kind="params") == 190
    assert pool.by("task") == {"a": 470, "b": 70}
    assert pool.by("role") == {"actor": 420, "engine": 120}
    assert pool.by("kind") == {"params": 190, "opt": 200, "ref": 100, "kv": 50}
    pool.report("a", "engine", "kv", 0)  # zero removes the entry
    pool.clear("a", "actor")
    assert pool.by("task") == {"b": 70}
    pool.clear("b")
    assert pool.total() == 0


def test_pool_rejects_unknown_kinds_and_bad_sizes():
    pool = MemoryPool()
    with pytest.raises(ValueError, match="one of .*'grads'"):
        pool.report("a", "actor", "grads", 1)
    with pytest.raises(ValueError, match="non-negative int, got -1"):
        pool.report("a", "actor", "params", -1)


def test_snapshot_is_json_safe_and_rss_is_positive():
    pool = MemoryPool("g0/shared", budget=10)
    pool.report("a", "engine", "params", 7)
    snap = json.loads(json.dumps(pool.snapshot()))
    assert snap["total"] == 7 and snap["by_task"] == {"a": 7}
    assert snap["entries"] == [{"task": "a", "role": "engine", "kind": "params", "bytes": 7}]
    assert snap["rss_bytes"] > 0 and process_rss_bytes() > 1 << 20  # a Python process is > 1 MiB


def test_onload_and_offload_move_the_role_inside_their_spans_and_account_for_it():
    pool, timeline = MemoryPool("g0/shared"), FakeTimeline()
    worker = FakeWorker(300, timeline)
    r = Residency(pool, "a", "engine", onload=worker.onload, offload=worker.offload, timeline=timeline)
    assert r.onload() == 300 and worker.on_device
    assert pool.total(task="a", role="engine", kind="params") == 300
    assert r.onload() == 300 and worker.calls == ["onload"]  # already there: no second move
    r.offload()
    r.offload()  # already on host: no second move
    assert worker.calls == ["onload", "offload"] and not worker.on_device
    assert pool.total() == 0
    attrs = {"task": "a", "role": "engine", "pool": "g0/shared"}
    freed = {"bytes": 300, **attrs}
    assert timeline.events == [("begin", "onload", attrs), ("end", "onload", attrs),
                               ("begin", "offload", freed), ("end", "offload", freed)]


def test_an_onload_replaces_what_was_reported_before_and_records_bytes_by_kind():
    pool, worker = MemoryPool(), FakeWorker(300)
    r = Residency(pool, "a", "actor", onload=lambda: {"params": 100, "opt": 200}, offload=worker.offload,
                  resident=True, sizes=50)  # created on device: counted at once
    assert pool.by("kind") == {"params": 50}
    r.offload()
    r.onload()
    assert pool.by("kind") == {"params": 100, "opt": 200}  # replaced, not added to the 50 of before


def test_failed_onload_leaves_the_pool_unchanged():
    pool = MemoryPool()
    pool.report("b", "engine", "params", 5)
    offloads = []

    def broken():
        raise RuntimeError("device OOM")

    r = Residency(pool, "a", "engine", onload=broken, offload=lambda: offloads.append(1))
    with pytest.raises(RuntimeError, match="device OOM"):
        r.onload()
    assert pool.snapshot()["entries"] == [{"task": "b", "role": "engine", "kind": "params", "bytes": 5}]
    assert offloads == [] and not r.resident
    with pytest.raises(ValueError, match="returned -3"):
        Residency(pool, "a", "engine", onload=lambda: -3, offload=lambda: None).onload()
    assert pool.total() == 5


def test_a_failed_offload_keeps_the_bytes():
    pool, worker = MemoryPool(), FakeWorker(10)

    def stuck():
        raise RuntimeError("offload failed")

    r = Residency(pool, "a", "engine", onload=worker.onload, offload=stuck, timeline=NullTimeline())
    r.onload()
    with pytest.raises(RuntimeError, match="offload failed"):
        r.offload()
    assert pool.total(task="a") == 10 and r.resident  # the bytes are presumably still on the device


def test_a_replaced_worker_is_put_where_the_dead_one_was_and_a_lost_one_holds_nothing():
    """A role's process died: its bytes are gone (`lost`), and its replacement, created on device, takes the
    moves and is moved to host at once if the dead one was there, so the pool says what the policy counts."""
    pool, changes = MemoryPool("g0"), []
    dead, fresh = FakeWorker(100), FakeWorker(120)
    dead.on_device = True
    r = Residency(pool, "a", "engine", onload=dead.onload, offload=dead.offload, resident=True, sizes=100,
                  on_change=lambda *args: changes.append(args))
    r.lost()
    assert (r.resident, pool.total(task="a"), changes[-1]) == (False, 0, ("a", "engine", {}))
    fresh.on_device = True  # a new process starts with its state on its devices
    r.replace_worker(onload=fresh.onload, offload=fresh.offload, sizes=120)
    assert (r.resident, fresh.on_device, pool.total(task="a")) == (False, False, 0)  # back on host, like the dead one
    r.onload()
    assert fresh.on_device and pool.total(task="a") == 120 and dead.calls == []  # moves reach the new one only
    other = FakeWorker(80)
    r.replace_worker(onload=other.onload, offload=other.offload, sizes=80)  # the one on device died: stays there
    assert r.resident and pool.total(task="a") == 80 and changes[-1] == ("a", "engine", {"params": 80})
