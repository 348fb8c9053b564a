"""The service's task records (rlsched.service.records.TaskBook) stay within their bounds however many tasks end:
plain Python, no Ray. A CANCELLED or FAILED record past its bound moves to history.jsonl with what it was
submitted with, and is found there again (`rlsched resume` of it: tests/test_service_resume.py)."""

from __future__ import annotations

import json

from rlsched.service.records import CANCELLED, FAILED, FINISHED, TaskBook, TaskRecord
from rlsched.service.submissions import Given

LIMITS = {"lines": 4, "finished": 2, "unfinished": 3, "requests": 10}


def _given(name: str, run_dir: str) -> Given:
    return Given({"tasks": [{"name": name}]}, configs=[f"/c/{name}.yaml"], overrides=[f"tasks.0.name={name}"],
                 cwd="/home/me", run_dir=run_dir)


def _book(tmp_path) -> TaskBook:
    (tmp_path / "runs").mkdir()
    return TaskBook(tmp_path, LIMITS)


def _submit(book: TaskBook, name: str, run_dir: str) -> None:
    book.tasks[name] = TaskRecord(name, "exp", f"req-{name}", run_dir, steps=5)
    book.given[name] = _given(name, run_dir)
    for i in range(6):  # more than lines=4: the book keeps the last 4 (all are in run.log)
        book.say(name, f"[{name}] line {i}")


def test_cancelled_and_failed_records_stay_at_their_bound_and_move_to_history_with_their_config(tmp_path):
    book, run_dir = _book(tmp_path), str(tmp_path / "runs")
    ends = [CANCELLED, FAILED, FINISHED]
    for i in range(30):  # 10 of each; t1 and t10 .. t19 share a prefix (history is searched by whole name)
        name = f"t{i}"
        _submit(book, name, run_dir)
        book.end(name, ends[i % 3], None if ends[i % 3] == FINISHED else f"why {i}")
        if ends[i % 3] == FINISHED:
            book.given.pop(name)  # as rlsched.service.runs does: a finished task is not resumed
        states = [t.state for t in book.tasks.values()]
        assert states.count(FINISHED) <= 2 and states.count(CANCELLED) + states.count(FAILED) <= 3, states
        assert set(book.lines) == set(book.tasks) and set(book.given) <= set(book.tasks)
        assert all(lines.kept <= 4 for lines in book.lines.values())
    # The newest 3 cancelled/failed (t25 FAILED, t27 CANCELLED, t28 FAILED) and 2 finished (t26, t29) stay.
    assert list(book.tasks) == ["t25", "t26", "t27", "t28", "t29"]
    assert sorted(book.given) == ["t25", "t27", "t28"]
    rows = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert len(rows) == 30 - 5
    assert sorted(r["name"] for r in rows) == sorted(f"t{i}" for i in range(25))
    for row in rows:  # a cancelled or failed row carries its submission; a finished one none
        assert ("given" in row) == (row["state"] != FINISHED), row
    # Found again by name, whole: its state, why, and what it was submitted with.
    record, given = book.summarised("t1")
    assert (record.name, record.state, record.reason) == ("t1", FAILED, "why 1")
    assert given == _given("t1", run_dir)
    assert book.summarised("t3")[0].state == CANCELLED
    assert book.summarised("t2")[1] is None  # FINISHED: nothing to resume
    assert book.summarised("t25") is None and book.summarised("t") is None
    # Resumed and cancelled again, then moved out again: the last row is the one found.
    book.tasks["t1"], book.given["t1"] = record, given
    record.state = "RUNNING"
    book.end("t1", CANCELLED, "cancelled again")
    assert "t1" in book.tasks and "t25" not in book.tasks  # t25 is now the oldest of 4
    for i in range(3):
        _submit(book, f"u{i}", run_dir)
        book.end(f"u{i}", CANCELLED, None)
    assert "t1" not in book.tasks and book.summarised("t1")[0].reason == "cancelled again"
    # Forgotten: every row of the name leaves history.jsonl (t1 has two), the others stay as they were.
    before = (tmp_path / "history.jsonl").read_text().splitlines()
    assert book.forget_summarised("t1").reason == "cancelled again" and book.summarised("t1") is None
    after = (tmp_path / "history.jsonl").read_text().splitlines()
    assert after == [line for line in before if not line.startswith('{"name": "t1",')] and len(after) == len(before) - 2
    assert book.forget_summarised("t1") is None and book.summarised("t10")[0].name == "t10"
    # Every line is in the run's run.log, whatever memory kept.
    logged = (tmp_path / "runs" / "run.log").read_text()
    assert "[t0] line 0" in logged and "[t0] CANCELLED: why 0" in logged


def test_a_service_started_with_lower_limits_moves_the_older_records_out(tmp_path):
    book, run_dir = _book(tmp_path), str(tmp_path / "runs")
    big = TaskBook(tmp_path, {**LIMITS, "unfinished": 100})
    for i in range(6):
        _submit(big, f"t{i}", run_dir)
        big.end(f"t{i}", CANCELLED, None)
    _submit(big, "live", run_dir)  # RUNNING when the service died: FAILED by the next one
    big.tasks["live"].state = "RUNNING"
    big.save()
    book.load_previous()
    assert list(book.tasks) == ["t4", "t5", "live"] and sorted(book.given) == ["live", "t4", "t5"]
    assert book.tasks["live"].state == FAILED
    assert book.summarised("t0")[1] == _given("t0", run_dir)


def test_a_clean_up_that_fails_again_and_again_is_logged_once(tmp_path):
    book, run_dir = _book(tmp_path), tmp_path / "gone"
    _submit(book, "t", str(run_dir))  # its run directory does not exist: run.log cannot be written
    book.say("t", "one more")
    log = (tmp_path / "service.log").read_text()
    assert log.count("cannot be written") == 1 and f"{run_dir / 'run.log'}" in log, log
    assert book.lines["t"].read(0)[0][-1] == "one more"  # `logs` still has it
