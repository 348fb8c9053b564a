"""The bounds of what a long-lived service keeps in memory (rlsched.service.bounded), against hand-counted sequences."""

from __future__ import annotations

from rlsched.service.bounded import RecentAnswers, TailLines


def test_recent_answers_keep_the_last_keys_set():
    answers = RecentAnswers(3)
    for i in range(5):
        answers[f"r{i}"] = i
    assert len(answers) == 3 and "r0" not in answers and "r1" not in answers and answers["r4"] == 4
    assert answers.setdefault("r2", 99) == 2  # kept: the first answer stands
    assert answers.setdefault("r5", 5) == 5 and "r2" not in answers  # r2 was set earliest of those left


def test_tail_lines_keep_offsets_valid_as_old_lines_go():
    lines = TailLines(3)
    for i in range(5):
        lines.append(f"line {i}")
    assert len(lines) == 5 and lines.kept == 3 and lines.dropped == 2
    assert lines.read(0) == (["line 2", "line 3", "line 4"], 2)  # two lines only in run.log
    assert lines.read(3) == (["line 3", "line 4"], 0)
    assert lines.read(5) == ([], 0)
