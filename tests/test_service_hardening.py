"""A service left running for weeks: nothing stalls unseen, and a run directory it writes into is its own.

Each command is a process of its own against a service with a private RLSCHED_HOME. An exception is injected into
the live service's monitor loop (through Ray's `__ray_call__`, from a process that holds the cluster's token):
`status` says the service is degraded and why, the loop recovers, and the task it was running finishes whole; the
same for the scheduler's lease watchdog. A service command that meets a bug says so with its traceback (exit 1),
kept in crashes/, as `rlsched train` does; only input errors are one line, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_service import _metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "demo_addition.yaml")
STEPS = 300  # long enough to be running when the fault is injected (a step takes ~50 ms here)

# Run in a process of its own (this one may already be connected to another Ray): the live service's monitor
# pass raises FAILS times, then runs as before.
INJECT = textwrap.dedent("""
    from rlsched.service import daemon  # before Ray is imported: connect() tells Ray the cluster's auth mode

    FAILS = 4  # degraded for 1 + 2 + 4 + 8 s (its pauses): long enough for a `status` on a loaded machine (2-6 s)

    def inject(service):
        original, failed = service.monitor.tick, []

        def broken():
            if len(failed) < FAILS:
                failed.append(1)
                raise RuntimeError("injected: the monitor's pass failed")
            return original()

        service.monitor.tick = broken
        return "injected"

    def inject_watchdog(scheduler):  # its lease watchdog's passes fail for the next 15 s, then run as before
        import time

        expired, until = scheduler.policy.expired, time.monotonic() + 15

        def broken(now, timeout):
            if time.monotonic() < until:
                raise RuntimeError("injected: the watchdog's pass failed")
            return expired(now, timeout)

        scheduler.policy.expired = broken
        return "injected"

    handle, _ = daemon.connect()
    import ray

    print(ray.get(handle.__ray_call__.remote(inject), timeout=60))
    scheduler = ray.get(handle.__ray_call__.remote(lambda service: service.scheduler), timeout=60)
    print(ray.get(scheduler.__ray_call__.remote(inject_watchdog), timeout=60))
""")


@pytest.mark.slow
def test_a_failing_monitor_is_shown_degraded_recovers_and_loses_no_task(tmp_path, service):
    svc = service
    svc("up")
    svc.processes()
    sets = [w for s in (f"tasks.0.model.path={tmp_path / 'model'}", "tasks.0.rollout.engine=fake",
                        f"tasks.0.steps={STEPS}", "tasks.0.grpo.prompts_per_step=2", "tasks.0.grpo.num_generations=2",
                        "tasks.0.grpo.mini_batch_size=4") for w in ("--set", s)]
    svc("submit", CONFIG, *sets)
    svc.steps("demo-addition", "addition", 1)  # running, past its first step

    # The run directory is the service's while its task runs: a `train` into it is refused, naming who holds it.
    clash = svc("train", CONFIG, *sets, check=False, timeout=120)
    assert clash.returncode == 2, (clash.stdout, clash.stderr)
    assert "is in use by a live run" in clash.stderr and "rlsched up (the scheduler service)" in clash.stderr
    assert "`rlsched cancel TASK`" in clash.stderr

    injected = subprocess.run([sys.executable, "-c", INJECT], capture_output=True, text=True, timeout=120,
                              env={**__import__("os").environ, "RLSCHED_HOME": str(svc.home)})
    assert injected.stdout.split() == ["injected", "injected"], injected.stderr[-2000:]
    seen, shown_parts, deadline = [], set(), time.monotonic() + 180
    while time.monotonic() < deadline:  # degraded within a pass, then well again ~15 s later
        shown = svc("status").stdout
        seen.append("service DEGRADED" in shown)
        shown_parts |= {line.split(" failed")[0].split("its ")[-1] for line in shown.splitlines()
                        if line.startswith("service DEGRADED") and "injected: the" in line}
        if seen == [True]:  # a task submitted while the monitor fails waits, and is not lost
            svc("submit", CONFIG, *sets, "--set", "experiment.name=later", "--set", "tasks.0.steps=3",
                "--set", "tasks.0.name=addition-later")
        if any(seen) and not seen[-1]:
            break
        time.sleep(0.3)
    assert any(seen), "status never showed the service degraded"
    assert shown_parts == {"monitor", "lease watchdog"}, shown_parts  # each with its injected cause
    assert not seen[-1], "the service did not recover"
    degraded = json.loads(svc("status", "--json").stdout)["degraded"]
    assert degraded is None
    log = (svc.home / "service.log").read_text()
    assert "injected: the monitor's pass failed" in log and "the monitor recovered after 4 failed pass(es)" in log

    for experiment, task, steps in (("demo-addition", "addition", STEPS), ("later", "addition-later", 3)):
        row = svc.wait(task, lambda r: r["state"] in ("FINISHED", "FAILED", "CANCELLED"), timeout=600)
        assert row["state"] == "FINISHED", row
        assert [m["step"] for m in _metrics(svc.cwd / "runs", experiment, task)] == list(range(1, steps + 1))
        assert (svc.cwd / "runs" / experiment / "summary.json").is_file()
    svc("down")
    svc.assert_all_gone()


# Run in a process of its own: every run's outputs (timeline, summary) take 15 s longer to write in the live service
SLOW_OUTPUTS = textwrap.dedent("""
    from rlsched.service import daemon  # before Ray is imported: connect() tells Ray the cluster's auth mode

    def slow(service):
        import time

        write = service.runs._write_outputs

        def slowly(sub):
            time.sleep(15)
            return write(sub)

        service.runs._write_outputs = slowly
        return "slowed"

    handle, _ = daemon.connect()
    import ray

    print(ray.get(handle.__ray_call__.remote(slow), timeout=60))
""")


@pytest.mark.slow
def test_a_run_s_outputs_are_written_beside_the_monitor_and_down_waits_for_them(tmp_path, service):
    """A run's outputs (a long run's timeline and Gantt take seconds; 15 s here) are written beside the monitor,
    which meanwhile goes on reading a running task's progress; `down` right after a task ended waits for its run's
    outputs, and for those of the task it stops."""
    svc = service
    svc("up")
    svc.processes()
    slowed = subprocess.run([sys.executable, "-c", SLOW_OUTPUTS], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "RLSCHED_HOME": str(svc.home)})
    assert slowed.stdout.split() == ["slowed"], slowed.stderr[-2000:]
    sets = [w for s in (f"tasks.0.model.path={tmp_path / 'model'}", "tasks.0.rollout.engine=fake",
                        "tasks.0.grpo.prompts_per_step=2", "tasks.0.grpo.num_generations=2",
                        "tasks.0.grpo.mini_batch_size=4") for w in ("--set", s)]
    runs = svc.cwd / "runs"
    svc("submit", CONFIG, *sets, "--set", f"tasks.0.steps={STEPS}", "--set", "experiment.name=long",
        "--set", "tasks.0.name=long")
    svc.steps("long", "long", 1)
    svc("submit", CONFIG, *sets, "--set", "tasks.0.steps=2", "--set", "experiment.name=short",
        "--set", "tasks.0.name=short")
    svc.wait("short", lambda r: r["state"] == "FINISHED", timeout=300)
    ended = time.monotonic()
    before = svc.tasks()["long"]["step"]
    time.sleep(3)
    after = svc.tasks()["long"]["step"]
    assert time.monotonic() - ended < 15 and not (runs / "short" / "summary.json").exists()  # still being written
    assert after > before, (before, after)  # the monitor read its progress meanwhile
    svc("down")
    for experiment in ("short", "long"):
        assert json.loads((runs / experiment / "summary.json").read_text())
        assert (runs / experiment / "timeline.json").is_file()
    svc.assert_all_gone()


def test_a_bug_in_a_service_command_prints_its_traceback_and_is_kept(tmp_path):
    """A service command that meets a bug (here a service record that is not JSON: json's ValueError, which no input
    of the user's fixes) prints its traceback, keeps it in crashes/ as `rlsched train` does, and exits 1; before,
    every ValueError was one line, exit 2, as if the user had typed something wrong."""
    from test_service import _cli

    (tmp_path / "service.json").write_text("{not json")
    proc = _cli("status", home=tmp_path, cwd=tmp_path, check=False, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback (most recent call last)" in proc.stderr and "JSONDecodeError" in proc.stderr, proc.stderr
    [kept] = (tmp_path / "crashes").iterdir()
    assert f"the traceback is kept in {kept}" in proc.stderr and "-status-" in kept.name
    assert kept.read_text().startswith("rlsched status\n") and "JSONDecodeError" in kept.read_text()
    # An input error stays one line, exit 2.
    bad = _cli("up", "--limit", "finished=0", home=tmp_path / "fresh", cwd=tmp_path, check=False, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --limit finished=0: expected NAME=N with NAME one of requests, lines, finished, unfinished, grants, "
        "spool_s and N >= 1"], bad.stderr
