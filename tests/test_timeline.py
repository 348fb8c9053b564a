"""Timeline: spans, the Chrome-trace export, checks and summaries from the file alone. Pure, no Ray."""

from __future__ import annotations

import json

import pytest

from rlsched.observe.gantt import plot_gantt, report
from rlsched.observe.timeline import (
    NullTimeline,
    Timeline,
    TimelineError,
    check_lock_exclusivity,
    chrome_trace,
    format_summary,
    overlaps,
    read_trace,
    summarize,
    write_chrome_trace,
)


def _two_tasks() -> list[dict]:
    """A hand-made schedule on one rollout and one train resource (seconds from 100):
    a: ROLLOUT [0, 2], TRAIN [2, 5];  b: waits [0, 2] then ROLLOUT [2, 4], TRAIN [5, 7]."""
    tl_a, tl_b = Timeline("driver", task="a"), Timeline("driver", task="b")
    t = 100.0
    tl_a.add_span("ROLLOUT", t + 0, t + 2, phase="rollout", resource="g0/rollout")
    tl_a.add_span("generate", t + 0.5, t + 2, phase="rollout", resource="g0/rollout")
    tl_a.add_span("sync_weights", t + 0, t + 0.5, phase="rollout", resource="g0/rollout", bytes=1000)
    tl_a.add_span("TRAIN", t + 2, t + 5, phase="train", resource="g0/train")
    tl_b.add_span("lock_wait", t + 0, t + 2, phase="rollout", resource="g0/rollout")
    tl_b.add_span("ROLLOUT", t + 2, t + 4, phase="rollout", resource="g0/rollout")
    tl_b.add_span("onload", t + 2, t + 2.25, phase="rollout", resource="g0/rollout")
    tl_b.add_span("reward", t + 4, t + 4.5)
    tl_b.add_span("TRAIN", t + 5, t + 7, phase="train", resource="g0/train")
    scheduler = Timeline("scheduler")
    scheduler.counter("memory/g0/shared", {"a": 3e6, "b": 0}, ts=t)
    scheduler.counter("memory/g0/shared", {"a": 3e6, "b": 3e6}, ts=t + 2.25)
    return tl_a.events() + tl_b.events() + scheduler.events()


def test_span_records_late_fields_and_errors():
    tl = Timeline("driver", task="a")
    with tl.span("generate", phase="rollout", resource="g0/rollout") as s:
        s["tokens"] = 12
        s["bytes"] = 64
    with pytest.raises(RuntimeError), tl.span("train", phase="train"):
        raise RuntimeError("boom")
    gen, train = tl.events()
    assert gen["name"] == "generate" and gen["args"] == {"tokens": 12} and gen["bytes"] == 64
    assert gen["task"] == "a" and gen["resource"] == "g0/rollout" and gen["end"] >= gen["start"]
    assert train["args"] == {"error": "RuntimeError"}  # a failed phase still shows, with why
    assert len(tl.drain()) == 2 and tl.events() == []


def test_clock_anchor_ignores_a_read_preempted_between_the_two_clocks(monkeypatch):
    """A process descheduled between reading the counter and the wall clock (CI: 4 tasks' processes starting
    on 2 cores) once shifted every span of a role by the pause, so its generate ended after the driver's
    ROLLOUT hold. The anchor keeps the tightest bracket of a few reads instead of the first."""
    from rlsched.observe import timeline

    # In call order (counter, wall, counter) per read; wall = counter + 1000 exactly. The first bracket
    # straddles a 50 ms pause before the wall read; the second is 2 us wide.
    reads = iter([10.0, 1010.050, 10.050,
                  10.100, 1010.100001, 10.100002])
    monkeypatch.setattr(timeline.time, "perf_counter", lambda: next(reads))
    monkeypatch.setattr(timeline.time, "time", lambda: next(reads))
    wall, at = timeline.clock_anchor(samples=2)
    assert abs((wall - at) - 1000.0) < 2e-6, (wall, at)  # the 50 ms bracket would give 1000.025


def test_null_timeline_records_nothing_with_the_same_api():
    tl = NullTimeline()
    with tl.span("generate", phase="rollout") as s:
        s["bytes"] = 1
    tl.add_span("x", 0, 1)
    tl.counter("memory/p", {"a": 1})
    tl.extend([{"kind": "span"}])
    assert tl.events() == [] and tl.drain() == []


def test_chrome_trace_rows_tracks_lock_events_and_nesting():
    events = _two_tasks()
    trace = chrome_trace(events)
    json.dumps(trace)  # valid JSON all the way down
    te = trace["traceEvents"]
    names = {e["args"]["name"] for e in te if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"task a", "task b", "scheduler"}
    tracks = {e["args"]["name"] for e in te if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks == {"g0/rollout", "g0/train", "host"}
    xs = [e for e in te if e["ph"] == "X"]
    assert all({"name", "ts", "dur", "pid", "tid"} <= e.keys() for e in xs)
    locks = [e for e in xs if e["name"] in ("ROLLOUT", "TRAIN")]
    assert len(locks) == 4 and all(e["args"]["task"] in ("a", "b") and e["args"]["resource"] for e in locks)
    # a's ROLLOUT: ts 0, dur 2 s; its generate and sync_weights sit inside it, on the same track.
    rollout_a = next(e for e in locks if e["args"]["task"] == "a" and e["name"] == "ROLLOUT")
    assert (rollout_a["ts"], rollout_a["dur"]) == (0.0, 2e6)
    for name in ("generate", "sync_weights"):
        inner = next(e for e in xs if e["name"] == name)
        assert inner["tid"] == rollout_a["tid"] and inner["pid"] == rollout_a["pid"]
        assert rollout_a["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= rollout_a["ts"] + rollout_a["dur"]
    # On a track, the parent comes before its children starting at the same time (sync_weights at 0).
    order = [e["name"] for e in xs if e["pid"] == rollout_a["pid"] and e["tid"] == rollout_a["tid"]]
    assert order.index("ROLLOUT") < order.index("sync_weights")
    counters = [e for e in te if e["ph"] == "C"]
    assert [c["args"] for c in counters] == [{"a": 3e6, "b": 0.0}, {"a": 3e6, "b": 3e6}]


def test_trace_file_round_trips_and_is_written_atomically(tmp_path):
    events = _two_tasks()
    path = write_chrome_trace(tmp_path / "timeline.json", events)
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.json"]  # no temporary left behind
    back = read_trace(path)
    spans = [e for e in events if e["kind"] == "span"]
    assert sorted(e["name"] for e in back if e["kind"] == "span") == sorted(e["name"] for e in spans)
    for e in spans:
        twin = next(b for b in back if b["kind"] == "span" and b["name"] == e["name"] and b["task"] == e["task"])
        assert twin == e
    counters = [e for e in back if e["kind"] == "counter"]
    assert [c["values"] for c in counters] == [{"a": 3e6, "b": 0.0}, {"a": 3e6, "b": 3e6}]
    assert counters[1]["ts"] == pytest.approx(102.25, abs=1e-6) and counters[1]["task"] is None


def test_lock_exclusivity_and_overlap_from_events():
    events = _two_tasks()
    assert check_lock_exclusivity(events) == []
    # a TRAIN [2, 5] vs b ROLLOUT [2, 4]: 2 s together; a ROLLOUT [0, 2] vs b TRAIN [5, 7]: none.
    assert overlaps(events, "a", "train", "b", "rollout") == pytest.approx(2.0)
    assert overlaps(events, "a", "rollout", "b", "train") == 0.0
    bad = events + [{"kind": "span", "task": "b", "name": "TRAIN", "phase": "train", "resource": "g0/train",
                     "start": 104.0, "end": 104.5, "args": {}}]
    problems = check_lock_exclusivity(bad)
    assert len(problems) == 1 and problems[0].startswith("g0/train: a TRAIN")
    # A long hold outlasting a short one of its own task still conflicts with a third that starts
    # inside it: a [0, 10] contains a [1, 2]; b [3, 4] starts after a [1, 2] ends but inside a [0, 10].
    nested = [{"kind": "span", "task": task, "name": "TRAIN", "phase": "train", "resource": "g1/train",
               "start": start, "end": end, "args": {}} for task, start, end in (("a", 0, 10), ("a", 1, 2), ("b", 3, 4))]
    problems = check_lock_exclusivity(nested)
    assert problems == ["g1/train: a TRAIN [0.000000, 10.000000] overlaps b TRAIN [3.000000, 4.000000]"]


def test_summary_against_hand_arithmetic():
    s = summarize(_two_tasks())
    # run: 100 .. 107 -> 7 s. a: ROLLOUT 2, TRAIN 3, switch 0.5 (sync); b: wait 2, ROLLOUT 2, TRAIN 2,
    # switch 0.25 (onload), reward 0.5, wall 7.
    assert s["wall_s"] == pytest.approx(7.0)
    a, b = s["tasks"]["a"], s["tasks"]["b"]
    assert (a["rollout_s"], a["train_s"], a["switch_s"], a["lock_wait_s"], a["steps"]) == (2.0, 3.0, 0.5, 0.0, 1)
    assert (b["lock_wait_s"], b["rollout_s"], b["train_s"], b["switch_s"], b["reward_s"]) == (2.0, 2.0, 2.0, 0.25, 0.5)
    assert b["wall_s"] == pytest.approx(7.0)
    # g0/rollout held [0, 2] + [2, 4] = 4 of 7 s; g0/train [2, 5] + [5, 7] = 5 of 7 s.
    assert s["resources"]["g0/rollout"]["busy_fraction"] == pytest.approx(4 / 7)
    assert s["resources"]["g0/train"]["busy_fraction"] == pytest.approx(5 / 7)
    table = format_summary(s)
    assert "g0/train" in table and "57%" in table and "71%" in table


def test_report_renders_png_and_errors_clearly(tmp_path):
    with pytest.raises(TimelineError, match=r"timeline.json does not exist: a run writes it when it ends"):
        report(tmp_path)
    (tmp_path / "timeline.json").write_text("{not json")
    with pytest.raises(TimelineError, match="is not a Chrome trace written by rlsched"):
        report(tmp_path)
    write_chrome_trace(tmp_path / "timeline.json", _two_tasks())
    table = report(tmp_path)
    assert table.splitlines()[0] == "run wall time 7.00s"
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("tasks", [1, 4])
def test_gantt_draws_one_to_four_tasks(tmp_path, tasks):
    events = []
    for i in range(tasks):
        tl = Timeline("driver", task=f"t{i}")
        for step in range(3):
            t = 10.0 * step + i
            tl.add_span("ROLLOUT", t, t + 1, phase="rollout", resource="g0/rollout")
            tl.add_span("generate", t + 0.1, t + 1, phase="rollout", resource="g0/rollout")
            tl.add_span("lock_wait", t + 1, t + 2, phase="train", resource="g0/train")
            tl.add_span("TRAIN", t + 2, t + 4, phase="train", resource="g0/train")
        events += tl.events()
    path = plot_gantt(events, tmp_path / "timeline.png", title="test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.png"]
    with pytest.raises(ValueError, match="no spans to draw"):
        plot_gantt([], tmp_path / "empty.png")


def test_a_tasks_startup_is_counted_apart_from_the_runs_steady_time():
    """Spans of phase startup (a task's start, its roles' imports, devices, model) come before the run's steady
    time: the summary counts their union as the task's startup_s and leaves them out of wall time and busy fractions."""
    start = [{"kind": "span", "task": task, "name": name, "phase": "startup", "resource": None, "start": s, "end": e,
              "args": {}} for task, name, s, e in (("a", "start", 90.0, 99.0), ("a", "load_model", 91.0, 95.0),
                                                    ("a", "make_engine", 94.0, 98.5), ("b", "start", 96.0, 100.0))]
    s = summarize(_two_tasks() + start)
    assert s["wall_s"] == pytest.approx(7.0)  # 100 .. 107, as without them
    assert s["resources"]["g0/rollout"]["busy_fraction"] == pytest.approx(4 / 7)
    assert (s["tasks"]["a"]["startup_s"], s["tasks"]["b"]["startup_s"]) == (pytest.approx(9.0), pytest.approx(4.0))
    assert s["tasks"]["a"]["wall_s"] == summarize(_two_tasks())["tasks"]["a"]["wall_s"]
    assert format_summary(s).splitlines()[3].split()[-1] == "9.00"  # task a's row, its start column
