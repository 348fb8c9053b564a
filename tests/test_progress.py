"""What a person watching a run sees (rlsched.observe.progress): lines pulled from drivers, rows, the ETA."""

from __future__ import annotations

import pickle

from rlsched.observe.progress import LineBuffer, ProgressView, eta_s


def test_a_line_buffer_keeps_lines_until_drained_and_crosses_processes_empty():
    buf = LineBuffer()
    buf("[a] step 1/3")
    buf("[a] step 2/3")
    copy = pickle.loads(pickle.dumps(buf))
    assert copy.drain() == []  # what is pickled is the buffer, never lines another process printed
    assert buf.drain() == ["[a] step 1/3", "[a] step 2/3"] and buf.drain() == []


def test_rows_and_eta_read_as_a_person_expects():
    assert eta_s(2, 10, 1.5) == 12.0  # 8 steps left x 1.5 s
    assert eta_s(0, 10, None) is None and eta_s(10, 10, 1.0) == 0.0
    printed = []
    view = ProgressView(printed.append, live=False)
    with view:
        view.show("a", {"lines": ["[a] step    2/10  reward 0.250"], "state": "running", "step": 2, "steps": 10,
                        "reward": 0.25, "phase": "waiting for train", "step_s": 1.25, "mean_step_s": 7.5})
    assert printed == ["[a] step    2/10  reward 0.250"]
    assert view.row("a") == ("a", "running", "2/10", "0.250", "waiting for train", "1.25s", "1:00")
    assert view.row("b") == ("b", "starting", "0/?", "-", "-", "-", "-")


def test_a_live_view_draws_every_task_on_a_terminal(capsys):
    view = ProgressView(print, live=True)
    with view:
        view.show("a", {"lines": ["[a] started"], "state": "running", "step": 1, "steps": 4, "reward": 0.5,
                        "phase": "ROLLOUT (g0/shared)", "step_s": 2.0, "mean_step_s": 2.0})
    out = capsys.readouterr().out
    assert "[a] started" in out and "ROLLOUT (g0/shared)" in out and "0:06" in out  # 3 steps x 2 s left


def test_a_run_log_keeps_every_line_and_this_processs_warnings_off_the_terminal(tmp_path, capsys):
    import logging
    import warnings

    from rlsched.rundir.log import RunLog

    path = tmp_path / "run" / "run.log"
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with RunLog(path, echo=print) as log:
            log("[addition] step    1/3  reward 0.125")
            log.note("only in the log")
            warnings.warn("a library's deprecation", DeprecationWarning, stacklevel=1)
            logging.getLogger("some.library").warning("a library's warning")
        with RunLog(path, echo=print) as log:  # a resumed run appends
            log("[addition] step    2/3  reward 0.250")
    out = capsys.readouterr()
    assert out.out == "[addition] step    1/3  reward 0.125\n[addition] step    2/3  reward 0.250\n"
    from conftest import own_lines

    assert own_lines(out.err) == []
    text = path.read_text()
    for expected in ("step    1/3", "only in the log", "DeprecationWarning: a library's deprecation",
                     "WARNING some.library: a library's warning", "step    2/3"):
        assert expected in text, text
    assert text.count("=== pid ") == 2
    # Its handler is gone with it: later warnings are no longer written to a closed run's log
    assert not [h for h in logging.getLogger().handlers if getattr(getattr(h, "stream", None), "name", "") == str(path)]
