"""`rlsched resume TASK` and `rlsched forget TASK` as a user drives them, each command a process of its own against a
service with a private RLSCHED_HOME: a cancelled task stays in `status` (the newest ones; older ones are summarised
into history.jsonl, and resume all the same), resumes by name from another directory
exactly as it was submitted, and computes what it computes uninterrupted; one with no checkpoint is refused on
the command's own output; `forget` drops a record, never a live task's."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from test_service import _cli, _metrics, _same, _signal, _solo

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "demo_addition.yaml")
STEPS = 20  # a step takes 10-200 ms in the service: room for the test to hold the task before its cancel lands (it is
# held from its start, then after step 2 until the cancel is sent)
SMALL = [f"tasks.0.{k}" for k in ("checkpoint_every=1", "grpo.prompts_per_step=4", "grpo.num_generations=4",
                                  "grpo.mini_batch_size=8", "rollout.max_batch_size=16", f"steps={STEPS}")]


def _sets(*extra: str) -> list[str]:
    return [w for s in [*SMALL, *extra] for w in ("--set", s)]


def _one_line_error(proc, *words: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def _ended(row: dict) -> bool:
    return row["state"] in ("FINISHED", "FAILED", "CANCELLED")


@pytest.mark.slow
def test_a_cancelled_task_resumes_by_name_from_anywhere_and_computes_what_it_computes_uninterrupted(tmp_path, service):
    from rlsched.config.loading import load_config
    from rlsched.run.experiment import estimate_bytes

    svc = service
    sets = _sets(f"tasks.0.model.path={tmp_path / 'models' / 'a'}")
    # The reference: the same config uninterrupted, in one process (this also creates the model).
    _solo(CONFIG, [*SMALL, f"tasks.0.model.path={tmp_path / 'models' / 'a'}"], tmp_path / "solo")
    engine, actor = estimate_bytes(load_config(CONFIG, [*SMALL, f"tasks.0.model.path={tmp_path / 'models' / 'a'}"])
                                   .tasks[0])
    # Room for one task at a time; one CANCELLED or FAILED record kept in memory (older ones: history.jsonl)
    svc("up", "--memory-budget-gb", f"{1.5 * (engine + actor) / 2**30:.6f}", "--limit", "unfinished=1")
    svc.processes()

    svc("submit", CONFIG, *sets)  # from svc.cwd: its outputs go to svc.cwd/runs/demo-addition
    driver = svc.started_driver()  # held from its start: `status` would name it seconds and maybe all STEPS later
    svc.steps("demo-addition", "addition", 2)
    _signal(driver, signal.SIGSTOP)  # held mid-run (a step takes ms, a command seconds) while the commands below run
    # A second task waits PENDING behind it (no room) and is cancelled before it starts: it has no checkpoint.
    svc("submit", CONFIG, *sets, "--set", "tasks.0.name=second", "--set", "tasks.0.steps=3")
    rows = svc.tasks()
    assert rows["addition"]["state"] == "RUNNING" and rows["second"]["state"] == "PENDING", rows
    _one_line_error(svc("resume", "addition", check=False), "addition is RUNNING", "nothing to resume")
    _one_line_error(svc("forget", "addition", check=False), "addition is RUNNING", "rlsched cancel addition")
    svc("cancel", "second")
    cancel = svc("cancel", "addition").stdout
    assert "RUNNING" in cancel and "rlsched resume addition" in cancel, cancel
    _signal(driver, signal.SIGCONT)
    cancelled = svc.wait("addition", _ended)
    step = cancelled["step"]
    assert cancelled["state"] == "CANCELLED" and 2 <= step < STEPS, cancelled
    assert "rlsched resume addition" in cancelled["reason"], cancelled
    checkpoints = svc.cwd / "runs" / "demo-addition" / "tasks" / "addition" / "checkpoints"
    assert (checkpoints / str(step)).is_dir(), list(checkpoints.iterdir())
    # The last one stays in status until forgotten; the one before it (past --limit unfinished=1) is summarised
    # into history.jsonl with what it was submitted with, its lines and config out of the service's memory.
    text = svc("status").stdout
    assert {r["name"]: r["state"] for r in svc.tasks().values()} == {"addition": "CANCELLED"}
    assert "CANCELLED" in text and "addition" in text and "second" not in text, text
    [summarised] = [json.loads(line) for line in (svc.home / "history.jsonl").read_text().splitlines()]
    assert summarised["name"] == "second" and summarised["state"] == "CANCELLED", summarised
    assert "tasks.0.name=second" in summarised["given"]["overrides"], summarised
    saved = json.loads((svc.home / "tasks.json").read_text())
    assert [t["name"] for t in saved["tasks"]] == ["addition"] and list(saved["given"]) == ["addition"], saved

    # From another directory: the obvious resubmit would resume another run (its runs/ is elsewhere): refused ...
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    trap = _cli("submit", CONFIG, *sets, "--resume", home=svc.home, cwd=elsewhere, check=False)
    _one_line_error(trap, "addition is CANCELLED", "rlsched resume addition", str(elsewhere / "runs"))
    # ... the task with no checkpoint (summarised: read back from history.jsonl) says so, and does not start ...
    _one_line_error(_cli("resume", "second", home=svc.home, cwd=elsewhere, check=False), "second has no checkpoint",
                    "--fresh")
    assert "second" not in svc.tasks()
    # ... and `rlsched resume TASK` continues the cancelled one where it was submitted, from its checkpoint.
    resumed = _cli("resume", "addition", home=svc.home, cwd=elsewhere)
    assert f"addition: continues after step {step} of {STEPS}" in resumed.stdout, resumed.stdout
    assert str(svc.cwd / "runs" / "demo-addition") in resumed.stdout and str(svc.cwd) in resumed.stdout
    assert "tasks.0.checkpoint_every=1" in resumed.stdout, resumed.stdout  # its overrides, as submitted
    done = svc.wait("addition", _ended)
    assert done["state"] == "FINISHED", (done, svc("logs", "addition").stdout)
    assert not (elsewhere / "runs").exists()  # nothing was written where `resume` ran
    _same(_metrics(svc.cwd / "runs", "demo-addition", "addition"), _metrics(tmp_path / "solo", "demo-addition",
                                                                            "addition"))
    logs = svc("logs", "addition").stdout
    assert f"[addition] resumed after step {step}" in logs and "[addition] CANCELLED" in logs, logs
    _one_line_error(svc("resume", "addition", check=False), "addition is FINISHED", "nothing to resume")

    # `submit --resume TASK` is `resume TASK`; `--fresh` runs a task without a checkpoint again from step 0 (here
    # the summarised one, with the config, overrides and run directory it was submitted with).
    _one_line_error(svc("submit", "--resume", "second", check=False), "no checkpoint")
    fresh = _cli("resume", "second", "--fresh", home=svc.home, cwd=elsewhere)
    assert "second: no checkpoint: starts again from step 0" in fresh.stdout, fresh.stdout
    assert svc.wait("second", _ended)["state"] == "FINISHED"
    assert [m["step"] for m in _metrics(svc.cwd / "runs", "demo-addition", "second")] == [1, 2, 3]

    # `forget` drops a record (its files stay); the records on disk agree.
    assert "forgot addition (FINISHED)" in svc("forget", "addition").stdout
    assert list(svc.tasks()) == ["second"]
    assert (checkpoints / str(STEPS)).is_dir()
    saved = json.loads((svc.home / "tasks.json").read_text())
    assert [t["name"] for t in saved["tasks"]] == ["second"] and "addition" not in saved["given"], saved
    _one_line_error(svc("forget", "addition", check=False), "no task 'addition'")
    # `second` ran afresh after its CANCELLED record was summarised: forgetting it drops that history row too, so
    # `resume` finds no earlier run of the name to continue (before, it resumed the cancelled one).
    assert "second" in (svc.home / "history.jsonl").read_text()
    assert "forgot second (FINISHED)" in svc("forget", "second").stdout
    assert "second" not in (svc.home / "history.jsonl").read_text() and svc.tasks() == {}
    _one_line_error(svc("resume", "second", check=False), "no task 'second'")
    svc.processes()
    svc("down", timeout=300)
    svc.assert_all_gone()


# A task left FAILED by a service that died resumes by name in the next one: the end of test_service.py's come-and-go
# test (that service's task killed with it, its record and its checkpoint kept).


def test_without_a_service_resume_and_forget_say_how_to_start_one(tmp_path):
    for command in (["resume", "addition"], ["forget", "addition"], ["submit", "--resume", "addition"]):
        proc = _cli(*command, home=tmp_path, cwd=tmp_path, check=False, timeout=120)
        assert proc.returncode == 1, (command, proc.stdout, proc.stderr)
        assert "no scheduler running" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_submit_resume_task_takes_nothing_else(tmp_path):
    """`submit --resume TASK` resumes the task as submitted: a config or an override beside it is refused before
    anything is sent (no service needed to say so)."""
    proc = _cli("submit", "--resume", "addition", "--set", "tasks.0.steps=3", home=tmp_path, cwd=tmp_path,
                check=False, timeout=120)
    _one_line_error(proc, "submit --resume addition", "no --set")
    _one_line_error(_cli("submit", home=tmp_path, cwd=tmp_path, check=False, timeout=120), "submit needs a CONFIG")


def test_what_the_service_keeps_gives_back_the_config_it_ran_under_the_running_services_settings(tmp_path):
    from rlsched.config.loading import load_config, select_tasks, with_absolute_paths
    from rlsched.service.submissions import Given, last_checkpoint, resume_notes

    cfg = with_absolute_paths(select_tasks(load_config(ROOT / "configs" / "demo_multitask.yaml",
                                                       ["tasks.1.steps=7"]), ["subtraction"]), tmp_path)
    given = Given.of(cfg, configs=["/c/demo.yaml"], overrides=["tasks.1.steps=7"], cwd=str(tmp_path))
    kept = Given.from_row(json.loads(json.dumps(given.row())))  # through tasks.json
    again = kept.config({"num_devices": 2, "policy": "fair"})
    assert again.cluster.num_devices == 2 and again.cluster.policy == "fair"
    assert again.model_dump()["tasks"] == cfg.model_dump()["tasks"]  # the seed pinned by --tasks included
    assert again.tasks[0].seed == 1 and again.tasks[0].steps == 7 and again.run_dir == tmp_path / "runs" / \
        "demo-multitask"
    assert kept.describe() == f"/c/demo.yaml --set tasks.1.steps=7, submitted from {tmp_path}"
    # Checkpoints are found by name (a step's directory appears whole); anything else there is not one.
    [spec] = cfg.task_specs()
    assert last_checkpoint(spec.checkpoint_dir) is None
    assert resume_notes(cfg) == [f"subtraction: --resume found no checkpoint in {spec.checkpoint_dir}; it starts "
                                 "from step 0"]
    for name in ("3", "5", ".tmp-6-123"):
        (spec.checkpoint_dir / name).mkdir(parents=True)
    (spec.checkpoint_dir / "9").touch()  # a file, not a checkpoint
    assert last_checkpoint(spec.checkpoint_dir) == 5
    assert resume_notes(cfg) == [f"subtraction: resumes after step 5 (checkpoint in {spec.checkpoint_dir})"]
    (spec.checkpoint_dir / "7").mkdir()
    assert resume_notes(cfg) == ["subtraction: its last checkpoint is step 7 of 7: nothing is left to run (a larger "
                                 "`steps` trains on)"]
