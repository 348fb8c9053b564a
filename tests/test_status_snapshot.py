"""`rlsched status`'s PHASE and LOCK of a task come from one moment of its driver (TaskDriver.poll), and a task
compiling says so: the driver's own step loop, with a lock provider and a role that the test holds mid-call."""

from __future__ import annotations

import threading
import time

from rlsched.cli import DEMO_CONFIG
from rlsched.config.loading import load_configs
from rlsched.run.task import TaskDriver
from rlsched.scheduling.policy import Phase, Role
from rlsched.scheduling.scheduler import FreeLocks
from rlsched.service.client import render_status
from rlsched.service.server import status_rows


def test_rows_take_phase_and_lock_from_one_record():
    now = 1000.0
    records = [
        {"name": "a", "state": "RUNNING", "step": 3, "steps": 10, "reward": 0.5, "devices": {}, "reason": None,
         "phase": "train (g0/train)",
         "lock": {"phase": "train", "resource": "g0/train", "holds": True, "since": 996.75}},
        {"name": "b", "state": "RUNNING", "step": 0, "steps": 200, "reward": None, "devices": {}, "reason": None,
         "phase": "compiling", "lock": None},
        {"name": "c", "state": "RUNNING", "step": 0, "steps": 5, "reward": None, "devices": {}, "reason": None,
         "phase": "waiting for rollout",  # never granted yet: the resource is not known, the phase is
         "lock": {"phase": "rollout", "resource": None, "holds": False, "since": 999.0}},
    ]
    rows = status_rows(records, now)
    assert [(r["phase"], r["lock"]) for r in rows] == [
        ("train (g0/train)", "holds g0/train 3.2s"),  # 1000 - 996.75 = 3.25 -> 3.2 (half to even)
        ("compiling", None),
        ("waiting for rollout", "waits for rollout 1.0s")]
    assert records[0]["lock"]["holds"] is True  # the records are not changed
    text = render_status({"tasks": rows, "used_bytes": 0, "budget_bytes": None, "settings": {"policy": "fifo"}})
    assert "0/200" in text and "compiling" in text.splitlines()[2], text


class _HeldLocks(FreeLocks):
    """Always granted, but each acquire waits until the test lets it through (`go`)."""

    def __init__(self, task: str):
        super().__init__(task)
        self.asked, self.go = threading.Event(), threading.Event()

    def acquire(self, phase):
        self.asked.set()
        assert self.go.wait(30)
        return super().acquire(phase)


class _SlowEngine:
    """A role whose prepare (the compile before the ROLLOUT lock) takes until the test lets it end."""

    def __init__(self):
        self.started, self.done = threading.Event(), threading.Event()

    def prepare(self, *shapes):
        self.started.set()
        assert self.done.wait(30)
        return 1, []


def _driver(tmp_path, locks) -> TaskDriver:
    cfg = load_configs([DEMO_CONFIG], [f"experiment.output_dir={tmp_path}"])
    return TaskDriver(cfg.task_specs()[0], locks, echo=lambda *_: None)


def _in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_poll_says_compiling_then_waiting_then_holding_each_with_its_lock(tmp_path):
    locks = _HeldLocks("addition")
    driver, engine = _driver(tmp_path, locks), _SlowEngine()
    driver.roles[Role.ENGINE] = engine
    assert (driver.poll()["phase"], driver.poll()["lock"]) == (None, None)

    thread = _in_thread(lambda: driver.prepare({Role.ENGINE: ([[1, 2]], None)}))
    assert engine.started.wait(30)
    p = driver.poll()
    assert (p["phase"], p["lock"], p["step"]) == ("compiling", None, 0)  # not "0/80" and no word
    engine.done.set()
    thread.join(30)
    assert (driver.poll()["phase"], driver.poll()["lock"]) == (None, None)

    inside = {}

    def step():
        with driver.hold(Phase.ROLLOUT):
            inside["poll"] = driver.poll()

    before = time.time()
    thread = _in_thread(step)
    assert locks.asked.wait(30)
    p = driver.poll()
    assert p["phase"] == "waiting for rollout"
    assert p["lock"]["phase"] == "rollout" and p["lock"]["resource"] is None and p["lock"]["holds"] is False
    assert before - 1 <= p["lock"]["since"] <= time.time()
    locks.go.set()
    thread.join(30)
    p = inside["poll"]
    assert p["phase"] == "rollout (local/rollout)"
    assert p["lock"]["holds"] is True and p["lock"]["resource"] == "local/rollout", p
    assert (driver.poll()["phase"], driver.poll()["lock"]) == (None, None)  # released
    # The next wait for that phase names the resource the grant named
    locks.go.clear()
    thread = _in_thread(step)
    assert locks.asked.wait(30)
    [row] = status_rows([{"name": "addition", **driver.poll()}], time.time())
    assert row["phase"] == "waiting for rollout" and row["lock"].startswith("waits for local/rollout "), row
    locks.go.set()
    thread.join(30)


def test_phase_and_lock_never_disagree_while_a_task_steps(tmp_path):
    """A reader polling from another thread while the loop takes and releases locks as fast as it can: every
    sample's PHASE and LOCK name the same lock (they were two reads, 0-0.5 s apart, that disagreed about half the
    time)."""
    driver = _driver(tmp_path, FreeLocks("addition"))
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            for phase in (Phase.ROLLOUT, Phase.TRAIN):
                with driver.hold(phase):
                    pass

    thread = _in_thread(loop)
    seen: dict[str, int] = {}
    end = time.monotonic() + 20
    try:
        while min(seen.get("holds", 0), seen.get("waits", 0)) < 20 and time.monotonic() < end:
            [row] = status_rows([{"name": "addition", **driver.poll()}], time.time())
            if row["lock"] is None:
                assert row["phase"] is None, row
                continue
            phase, resource = row["phase"].split(" (")[0], row["lock"].split()[1]
            if row["phase"].startswith("waiting for "):
                assert row["lock"].startswith(f"waits for local/{row['phase'].removeprefix('waiting for ')}"), row
            else:
                assert row["lock"].startswith(f"holds local/{phase} ") and resource == f"local/{phase}", row
            seen[row["lock"].split()[0]] = seen.get(row["lock"].split()[0], 0) + 1
            time.sleep(0.0005)
    finally:
        stop.set()
        thread.join(30)
    assert seen.get("holds", 0) >= 20, seen  # the check looked at held locks, not only idle moments
