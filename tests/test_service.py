"""The long-lived scheduler as a user drives it: `rlsched up / submit / status / logs / cancel / down` as real
processes, each command a process of its own, the service in its own session with its own embedded Ray
(RLSCHED_HOME in a temporary directory), and what they leave: task states, metrics equal to a solo run,
checkpoints, and no process once it is down."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "demo_multitask.yaml")
SMALL = [f"tasks.{i}.{k}" for i in (0, 1) for k in (
    "checkpoint_every=0", "grpo.prompts_per_step=4", "grpo.num_generations=4", "grpo.mini_batch_size=8",
    "rollout.max_batch_size=16", "eval=null")]
# B's steps (~10-200 ms each here; held from its start, then from its first step on, while commands run): enough left,
# once the test resumes it, for its cancel to land first (it lands after step 2 or 3)
A_STEPS, B_STEPS = 60, 60
# The mesh tasks' (0.2-1 s a step in the service): subtraction is cancelled after its step 1 or 2; addition, going on
# meanwhile (~0.2 s a step), still runs when the third starts in subtraction's room (at 20 steps, 4-9 s to spare)
MESH_A_STEPS, MESH_B_STEPS = 30, 5


def _cli(*args: str, home: Path, cwd: Path, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "rlsched.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=os.environ | {"RLSCHED_HOME": str(home)})
    if check:
        assert proc.returncode == 0, f"rlsched {' '.join(args)} -> {proc.returncode}\n{proc.stdout[-3000:]}" \
                                     f"\n{proc.stderr[-3000:]}"
    return proc


def _sets(*extra: str) -> list[str]:
    return [w for s in [*SMALL, *extra] for w in ("--set", s)]


def _solo(config: str, overrides: list[str], out: Path) -> None:
    """The reference run: the tasks alone, one after the other, `rlsched train --in-process` as a function in this
    process (a process of its own would add seconds of imports); it also creates the models."""
    from rlsched.run.experiment import train

    results = train(config, overrides=[*overrides, f"experiment.output_dir={out}"], in_process=True)
    assert {r["status"] for r in results.values()} == {"ok"}, results


class _Service:
    def __init__(self, home: Path, cwd: Path):
        self.home, self.cwd, self.seen = home, cwd, set()
        self.report: dict = {}  # the last `status --json` that `tasks` read

    def __call__(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return _cli(*args, home=self.home, cwd=self.cwd, **kw)

    @property
    def pid(self) -> int:
        return json.loads((self.home / "service.json").read_text())["pid"]

    def processes(self) -> set[psutil.Process]:
        """Every process the service process started (kept, to check that each one ends)."""
        service = psutil.Process(self.pid)
        self.seen |= {service, *service.children(recursive=True)}
        return self.seen

    def tasks(self) -> dict[str, dict]:
        self.report = json.loads(self("status", "--json").stdout)  # all of it, the last one (its group_processes)
        return {t["name"]: t for t in self.report["tasks"]}

    def wait(self, task: str, until, timeout: float = 300) -> dict:
        """The task's `status` row once `until(row)` holds. `status` (a command: seconds) is asked again as soon as
        the service has saved a change (tasks.json, rewritten at every change of a task's state: read directly),
        and every 5 s besides, for what `until` reads that is not saved at once (a step)."""
        end, asked, seen = time.monotonic() + timeout, -float("inf"), None
        while True:
            saved = self.saved()
            if saved != seen or time.monotonic() - asked >= 5:
                seen, asked = saved, time.monotonic()
                self.processes()
                row = self.tasks().get(task)
                if row is not None and until(row):
                    return row
            assert time.monotonic() < end, f"{task}: {row}"
            time.sleep(0.1)

    def saved(self) -> str | None:
        """tasks.json as the service last wrote it (atomically), None before it did."""
        with contextlib.suppress(FileNotFoundError):
            return (self.home / "tasks.json").read_text()
        return None

    def started_driver(self, *known: int, timeout: float = 120) -> list[int]:
        """The pid of the task driver that started last (a `ray::TaskDriver` process of the service's other than
        `known`), within milliseconds of its start: `status` names it seconds later on a loaded machine, time enough
        for a tiny task to run hundreds of steps before the test holds it (compare its `driver_pid` after)."""
        end = time.monotonic() + timeout
        while True:
            for p in self.processes():
                with contextlib.suppress(psutil.Error):
                    if p.pid not in known and p.is_running() and "ray::TaskDriver" in " ".join(p.cmdline()):
                        return [p.pid]
            assert time.monotonic() < end, "no new task driver"
            time.sleep(0.02)

    def steps(self, experiment: str, task: str, steps: int) -> None:
        """Wait until the task has done `steps` steps (its metrics file, read directly: a command takes seconds)."""
        metrics = self.cwd / "runs" / experiment / "tasks" / task / "metrics.jsonl"
        while not metrics.exists() or len(metrics.read_text().splitlines()) < steps:
            time.sleep(0.02)

    def clean_up(self) -> None:
        """After the test, whatever happened in it: a service still up is stopped at once, and anything it
        started that is still there is killed (a failed test must not leave tasks running beside the next)."""
        if (self.home / "service.json").exists():
            self("down", "--force", check=False, timeout=120)
        for p in self.seen:
            with contextlib.suppress(psutil.Error):
                p.kill()

    def assert_all_gone(self, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while True:
            alive = [p for p in self.seen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                return
            assert time.monotonic() < end, [(p.pid, p.name()) for p in alive]
            time.sleep(0.5)


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        os.kill(pid, sig)


def _metrics(out: Path, experiment: str, task: str) -> list[dict]:
    path = out / experiment / "tasks" / task / "metrics.jsonl"
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "mem/"))}
            for line in path.read_text().splitlines()]


def _same(got: list[dict], expected: list[dict]) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in expected]
    for g, e in zip(got, expected, strict=True):
        assert g.keys() == e.keys()
        for k, v in e.items():
            assert g[k] == pytest.approx(v, rel=1e-6, abs=1e-6), (g["step"], k)


def test_no_service_says_how_to_start_one(tmp_path):
    for command in (["status"], ["logs", "addition"], ["cancel", "addition"], ["locks"], ["down"]):
        proc = _cli(*command, home=tmp_path, cwd=tmp_path, check=False, timeout=60)
        assert proc.returncode == 1, (command, proc.stdout, proc.stderr)
        assert "no scheduler running" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr




@pytest.mark.slow
def test_tasks_come_and_go_and_each_computes_what_it_computes_alone(tmp_path, service):
    """Up (twice); a bad config refused with nothing sent; A alone, then B and C arrive while A runs; C waits
    PENDING for memory (a retried submit with its request id changes nothing); B cancelled mid-run keeps a
    checkpoint and `--resume` continues it; A and B equal their solo runs; a graceful `down` checkpoints the
    task still running and ends every process; a service that dies leaves its task FAILED for the next `up`, which
    `rlsched resume` continues from its last checkpoint, and `down --force` ends everything at once."""
    from rlsched.config.loading import load_config
    from rlsched.run.experiment import estimate_bytes

    svc = service
    home, out = svc.home, svc.cwd
    models = [f"tasks.0.model.path={tmp_path / 'models' / 'a'}", f"tasks.1.model.path={tmp_path / 'models' / 's'}"]
    _solo(CONFIG, [*SMALL, *models, f"tasks.0.steps={A_STEPS}", f"tasks.1.steps={B_STEPS}"], tmp_path / "solo")
    # A memory budget for two tasks resident at once, not three.
    engine, actor = estimate_bytes(load_config(CONFIG, [*SMALL, *models]).tasks[0])
    budget_gb = 2.5 * (engine + actor) / 2**30

    started = svc("up", "--memory-budget-gb", f"{budget_gb:.6f}")
    assert "scheduler running: pid" in started.stdout
    assert "running already" in svc("up").stdout
    svc.processes()

    bad = svc("submit", CONFIG, *_sets("tasks.0.grpo.beta=-1"), check=False)
    assert bad.returncode == 2 and "tasks.0.grpo.beta" in bad.stderr, bad.stderr
    assert svc.tasks() == {}  # nothing was sent

    common = [CONFIG, *_sets(*models)]
    assert svc("submit", *common, "--set", f"tasks.0.steps={A_STEPS}", "--tasks", "addition").stdout.split() == [
        "addition"]
    # SIGSTOP / SIGCONT of a task's driver process, as a user may: a step of these tiny tasks takes milliseconds and
    # a command seconds, so the test holds a task mid-run while it sends the next commands.
    a_driver = svc.started_driver()
    svc.steps("demo-multitask", "addition", 2)
    _signal(a_driver, signal.SIGSTOP)  # A stays RUNNING, mid-run, while B and the third arrive
    svc("submit", *common, "--set", f"tasks.1.steps={B_STEPS}", "--tasks", "subtraction")
    b_driver = svc.started_driver(*a_driver)
    _signal(b_driver, signal.SIGSTOP)  # B too, in its first steps at most
    third = [*common, "--set", "experiment.name=third", "--set", "tasks.1.name=third", "--set", "tasks.1.steps=4000",
             "--tasks", "third", "--request-id", "third-1"]
    assert svc("submit", *third).stdout.split() == ["third"]
    assert svc("submit", *third).stdout.split() == ["third"]  # the retry: the same answer, no second task
    rows = svc.tasks()
    assert list(rows) == ["addition", "subtraction", "third"], rows
    assert rows["addition"]["state"] == "RUNNING" and rows["subtraction"]["state"] == "RUNNING", rows
    assert rows["subtraction"]["submitted_at"] > rows["addition"]["started_at"]
    assert rows["third"]["state"] == "PENDING", rows
    # The small demo's tasks need a few MiB each: the three numbers in one unit, none of them below 1
    # (rlsched.base.units)
    assert re.fullmatch(r"needs [1-9]\d*\.\d\d (KiB|MiB) per device, [1-9]\d*\.\d\d \1 free in group g0 \(memory "
                        r"budget [1-9]\d*\.\d\d \1 per device\)", rows["third"]["reason"]), rows["third"]["reason"]
    text = svc("status").stdout
    assert "PENDING" in text and "addition" in text, text

    _signal(a_driver + b_driver, signal.SIGCONT)
    svc.steps("demo-multitask", "subtraction", 1)
    _signal(b_driver, signal.SIGSTOP)  # mid-run when the cancel comes
    assert "RUNNING" in svc("cancel", "subtraction").stdout
    _signal(b_driver, signal.SIGCONT)
    cancelled = svc.wait("subtraction", lambda r: r["state"] != "RUNNING")
    assert cancelled["state"] == "CANCELLED" and cancelled["step"] < B_STEPS, cancelled
    assert cancelled["driver_pid"] == b_driver[0], cancelled  # the process the test held is the one status names
    checkpoints = out / "runs" / "demo-multitask" / "tasks" / "subtraction" / "checkpoints"
    assert (checkpoints / str(cancelled["step"])).is_dir(), list(checkpoints.iterdir())
    svc.wait("third", lambda r: r["state"] == "RUNNING")  # the room subtraction left
    again = svc("submit", *common, "--set", f"tasks.1.steps={B_STEPS}", "--tasks", "subtraction", check=False)
    assert again.returncode == 2 and "--resume" in again.stderr, again.stderr  # its directory holds its run
    svc("submit", *common, "--set", f"tasks.1.steps={B_STEPS}", "--tasks", "subtraction", "--resume")

    for task in ("addition", "subtraction"):
        row = svc.wait(task, lambda r: r["state"] in ("FINISHED", "FAILED", "CANCELLED"))
        assert row["state"] == "FINISHED", row
        assert task != "addition" or row["driver_pid"] == a_driver[0], row
        _same(_metrics(out / "runs", "demo-multitask", task), _metrics(tmp_path / "solo", "demo-multitask", task))
    logs = svc("logs", "addition").stdout
    assert f"[addition] step {A_STEPS:4d}/{A_STEPS}" in logs and "[addition] FINISHED" in logs, logs

    # A graceful down: the task still running saves its step and is CANCELLED; nothing it started is left.
    assert svc.tasks()["third"]["state"] == "RUNNING"
    svc.processes()
    svc("down", timeout=600)
    svc.assert_all_gone()
    rows = json.loads((home / "tasks.json").read_text())["tasks"]
    stopped = next(r for r in rows if r["name"] == "third")
    assert stopped["state"] == "CANCELLED", stopped
    assert (out / "runs" / "third" / "tasks" / "third" / "checkpoints" / str(stopped["step"])).is_dir()

    # A service that dies: its task is FAILED with the reason on the next `up`; `down --force` ends all at once.
    svc.seen = set()
    svc("up")
    svc("submit", *third[:-2], "--resume")
    svc.steps("third", "third", stopped["step"] + 1)
    svc.wait("third", lambda r: r["state"] == "RUNNING" and r["step"] > stopped["step"])
    service = next(p for p in svc.processes() if "ray::Service" in " ".join(p.cmdline()))
    service.send_signal(signal.SIGKILL)
    svc.assert_all_gone(timeout=90)  # the service process notices and shuts its Ray down
    svc("up")
    row = svc.tasks()["third"]
    assert row["state"] == "FAILED" and "service stopped" in row["reason"], row
    assert "rlsched resume third" in row["reason"], row
    # What the dead service kept of it outlives it: `rlsched resume` (from another directory) continues it by name
    # from its last checkpoint.
    saved = out / "runs" / "third" / "tasks" / "third" / "checkpoints"
    last = max(int(p.name) for p in saved.iterdir() if p.name.isdigit())
    resumed = _cli("resume", "third", home=home, cwd=tmp_path)
    assert f"continues after step {last} of 4000" in resumed.stdout, resumed.stdout
    svc.steps("third", "third", last + 1)
    svc.wait("third", lambda r: r["state"] == "RUNNING" and r["step"] > last, timeout=300)
    svc.processes()
    svc("down", "--force", timeout=120)
    svc.assert_all_gone()
    assert _cli("status", home=home, cwd=out, check=False).returncode == 1


@pytest.mark.slow
def test_sharded_tasks_share_the_services_device_group_process_and_leave_nothing_in_it(tmp_path, service):
    """`rlsched up --num-devices 8` (auto: one process holds the device group, as on a GPU or TPU node) with a memory
    budget for two demo_mesh tasks (actor fsdp 2 x tp 2, engine tp 2), not three: both run in that one process while
    a third waits PENDING for memory; subtraction, cancelled mid-run, leaves no role in the process and the third
    starts in its room; resumed, it continues from its checkpoint; both compute what they compute alone, and once
    every task has ended the process holds no role and no byte on its devices."""
    from rlsched.config.loading import load_config
    from rlsched.run.experiment import estimate_bytes

    svc, out = service, service.cwd
    mesh = str(ROOT / "configs" / "demo_mesh.yaml")
    over = [f"tasks.0.model.path={tmp_path / 'models' / 'a'}", f"tasks.1.model.path={tmp_path / 'models' / 's'}",
            f"tasks.0.steps={MESH_A_STEPS}", f"tasks.1.steps={MESH_B_STEPS}"]
    sets = _sets(*over)
    # (a process of its own, with the 8 host devices the mesh needs: `rlsched train` sets them before JAX starts)
    _cli("train", mesh, *sets, "--set", f"experiment.output_dir={tmp_path / 'solo'}", "--in-process",
         home=svc.home, cwd=out, timeout=600)
    # A memory budget per device for two of these tasks resident at once, not three: colocated, admission counts a
    # task's engine and actor bytes on its busiest device (Admission.needs), the three tasks' the same
    engine, actor = estimate_bytes(load_config(mesh, [*SMALL, *over]).tasks[0])
    need = engine + actor
    up = svc("up", "--num-devices", "8", "--memory-budget-gb", f"{2.5 * need / 2**30:.6f}").stdout
    assert "8 device(s) colocated" in up and "roles in per_device_group processes" in up, up
    svc("submit", mesh, *sets)
    # Both held mid-run (SIGSTOP of their drivers, as in the test above) while the third arrives and one is cancelled;
    # held and let go together, so which driver is which needs no `status`
    first = svc.started_driver()
    drivers = first + svc.started_driver(*first)
    for task in ("addition", "subtraction"):
        svc.steps("demo-mesh", task, 1)
    _signal(drivers, signal.SIGSTOP)
    third = [mesh, *sets, "--set", "experiment.name=third", "--set", "tasks.1.name=third", "--set", "tasks.1.steps=2",
             "--tasks", "third"]
    assert svc("submit", *third).stdout.split() == ["third"]
    rows, report = svc.tasks(), svc.report
    assert [rows[t]["state"] for t in ("addition", "subtraction", "third")] == ["RUNNING", "RUNNING", "PENDING"], rows
    assert report["used_bytes"] == 2 * need and report["budget_bytes"] < 3 * need, report
    assert re.fullmatch(r"needs [1-9]\d*\.\d\d (KiB|MiB) per device, [1-9]\d*\.\d\d \1 free in group g0 \(memory "
                        r"budget [1-9]\d*\.\d\d \1 per device\)", rows["third"]["reason"]), rows["third"]["reason"]
    [process] = report["group_processes"]
    assert {k for k in process["roles"] if k.startswith("subtraction/")} == {"subtraction/actor", "subtraction/engine"}

    # Cancelled while its driver is held: it stops after its step in progress, saves it, and its roles go
    assert "RUNNING" in svc("cancel", "subtraction").stdout
    _signal(drivers, signal.SIGCONT)
    cancelled = svc.wait("subtraction", lambda r: r["state"] != "RUNNING")
    assert cancelled["state"] == "CANCELLED" and 1 <= cancelled["step"] < MESH_B_STEPS, cancelled
    checkpoints = out / "runs" / "demo-mesh" / "tasks" / "subtraction" / "checkpoints"
    assert (checkpoints / str(cancelled["step"])).is_dir(), list(checkpoints.iterdir())
    svc.wait("third", lambda r: r["state"] != "PENDING")
    [process] = svc.report["group_processes"]  # of the same moment
    assert not [k for k in process["roles"] if k.startswith("subtraction/")], process
    svc("submit", mesh, *sets, "--tasks", "subtraction", "--resume")  # PENDING until room frees again

    rows = {t: svc.wait(t, lambda r: r["state"] in ("FINISHED", "FAILED", "CANCELLED"), timeout=600)
            for t in ("addition", "subtraction", "third")}
    assert {r["state"] for r in rows.values()} == {"FINISHED"}, rows
    # The third started in the room subtraction left, while addition still ran; subtraction again once one ended
    assert cancelled["ended_at"] <= rows["third"]["started_at"] < rows["addition"]["ended_at"], rows
    assert rows["subtraction"]["started_at"] >= min(rows["addition"]["ended_at"], rows["third"]["ended_at"]), rows
    run_log = (out / "runs" / "demo-mesh" / "run.log").read_text()
    assert f"[subtraction] resumed after step {cancelled['step']} (weights v{cancelled['step']})" in run_log, run_log
    pids = {p["pid"] for r in rows.values() for p in r["devices"].values()}
    assert len(pids) == 1, rows  # every role of the three tasks in the device group's one process
    assert {tuple(p["devices"]) for r in rows.values() for p in r["devices"].values()} == {(0, 1, 2, 3), (0, 1)}
    for task in ("addition", "subtraction"):  # subtraction's across its cancel and resume too
        _same(_metrics(out / "runs", "demo-mesh", task), _metrics(tmp_path / "solo", "demo-mesh", task))
    report = json.loads(svc("status", "--json").stdout)
    assert report["settings"]["processes"] == "per_device_group" and report["used_bytes"] == 0, report
    [host] = report["group_processes"]
    assert host["pid"] in pids and host["roles"] == [] and host["device_bytes"] == 0, host
    assert "device-group process pid" in svc("status").stdout
    svc("down", timeout=300)
    svc.assert_all_gone()


def test_a_task_across_hosts_is_refused_before_anything_is_sent():
    from rlsched.config.schema import ConfigError
    from rlsched.service.client import service_config

    settings = {"num_devices": 1, "placement": "colocated", "memory_budget_gb": None, "policy": "fifo",
                "starvation_limit": 8, "lease_timeout_s": 600.0}
    with pytest.raises(ConfigError, match=r"cluster.hosts is 2: the scheduler service runs device groups of one host"):
        service_config([ROOT / "configs" / "demo_mesh.yaml"], ["cluster.hosts=2", "cluster.num_devices=4"], None,
                       settings, echo=lambda *_: None)


@pytest.mark.slow
def test_lora_tasks_of_one_base_are_admitted_with_the_base_counted_once(tmp_path, service, tiny_model_dir):
    """Two LoRA tasks on one base, and a memory budget with room for the base once and both tasks' own bytes, not
    for the base twice: the service admits both at once (their base group reads one copy in the device group's
    process), where counting the base in each task would have kept the second waiting for the first to end."""
    from rlsched.config.loading import load_config
    from rlsched.run.experiment import estimate_bytes, task_bases

    svc = service
    lora = [f"tasks.{i}.{k}" for i in (0, 1) for k in (f"model.path={tiny_model_dir}", "model.init_preset=null",
                                                       "lora.rank=4", "steps=3")]
    cfg = load_config(CONFIG, [*SMALL, *lora])
    own = {}
    for task in cfg.tasks:
        bases = task_bases(cfg, task.name, "per_device_group")
        shared = {role: b.nbytes for b in bases for name, role in b.roles if name == task.name}
        own[task.name] = sum(estimate_bytes(task, shared))
    (base,) = {b.nbytes for t in cfg.tasks for b in task_bases(cfg, t.name, "per_device_group")}
    budget = base + sum(own.values()) + 4096
    assert budget < 2 * base + sum(own.values())  # the old count (a base per task) would not fit both
    svc("up", "--memory-budget-gb", repr(budget / 2**30))
    svc("submit", CONFIG, *_sets(*lora))
    rows = {t: svc.wait(t, lambda r: r["state"] in ("FINISHED", "FAILED", "CANCELLED"), timeout=600)
            for t in ("addition", "subtraction")}
    assert {r["state"] for r in rows.values()} == {"FINISHED"}, rows
    first, second = sorted(rows.values(), key=lambda r: r["started_at"])
    assert second["started_at"] < first["ended_at"], rows  # both ran at once
    assert all(r["bases"] == {next(iter(first["bases"])): base} for r in rows.values()), rows
    logs = svc("logs", second["name"]).stdout
    assert "its base is held once for its base group, already running" in logs, logs
    svc("down", timeout=300)
    svc.assert_all_gone()


@pytest.mark.slow
def test_locks_shows_free_and_held_locks_as_the_json_says(tmp_path, service):
    """`rlsched locks` of a live service: with no task every lock reads free (it raised TypeError on a free lock);
    with both demo tasks (submitted with `--set 'tasks.*.steps=N'`) frozen mid-run (their drivers SIGSTOPped, so
    the report holds still between two commands) each lock reads as its `--json` says: `free` or `held by TASK for
    N.Ns`, and its waiters."""
    svc = service
    svc("up")
    idle = json.loads(svc("locks", "--json").stdout)
    text = svc("locks").stdout.splitlines()
    assert idle and all(v["holder"] is None for v in idle.values()), idle
    assert text == [f"{r}: free; waiting: nobody" for r in idle], text

    models = [f"tasks.0.model.path={tmp_path / 'models' / 'a'}", f"tasks.1.model.path={tmp_path / 'models' / 's'}"]
    steps = 200  # more than they run in the tries below (~50 ms each)
    svc("submit", CONFIG, *_sets(*models, f"tasks.*.steps={steps}"))  # `*`: every task
    first = svc.started_driver()
    drivers = first + svc.started_driver(*first)  # the two tasks'
    assert {t: r["steps"] for t, r in svc.tasks().items()} == {"addition": steps, "subtraction": steps}
    svc.steps("demo-multitask", "addition", 1)
    for _ in range(50):  # until the frozen moment has a lock held and a lock free (a step is mostly in a phase)
        _signal(drivers, signal.SIGSTOP)
        report = json.loads(svc("locks", "--json").stdout)
        if {v["holder"] is None for v in report.values()} == {True, False}:
            break
        _signal(drivers, signal.SIGCONT)
        time.sleep(0.05)
    else:
        pytest.fail(f"no moment with a lock held and one free: {report}")
    lines = svc("locks").stdout.splitlines()
    _signal(drivers, signal.SIGCONT)
    assert len(lines) == len(report), (lines, report)
    for line, (resource, lock) in zip(lines, report.items(), strict=True):
        waiting = ", ".join(rf"{w['task']} \(\d+\.\ds\)" for w in lock["waiting"]) or "nobody"
        held = "free" if lock["holder"] is None else rf"held by {', '.join(lock['holders'])} for \d+\.\ds"
        assert re.fullmatch(rf"{re.escape(resource)}: {held}; waiting: {waiting}", line), (line, lock)
    svc("down", "--force", timeout=120)


def test_the_service_makes_its_drivers_actor_class_once():
    """Each `ray.remote(TaskDriver)` is a class of its own to Ray (its descriptor holds a random hash), whose method
    metadata Ray keeps for the process's life: ~33 KiB for every task the service started, for weeks. The service
    makes that class once (rlsched.service.runs._driver_class), so Ray keeps one entry for it however many start."""
    from ray.actor import _ActorClassMethodMetadata

    from rlsched.service.runs import _driver_class

    def kept() -> int:  # other tests of this process may have made driver classes of their own (rlsched train)
        return sum(d.class_name == "TaskDriver" for d in _ActorClassMethodMetadata._cache)

    before = kept()
    classes = {id(_driver_class()) for _ in range(5)}  # one call per task the service starts
    assert len(classes) == 1 and kept() - before <= 1, (classes, before, kept())
