"""Every remote wait is bounded: an endpoint that never answers (a real Ray actor whose methods sleep far past the
bounds) makes each call fail within its timeout, with an error that names the call and what it waited on. The bounds
are lowered here (arguments, or the module's constant patched) so that each test waits half a second, not minutes."""

from __future__ import annotations

import sys
import time

import pytest
from ray import cloudpickle

from rlsched.base.waits import NoAnswer

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Silent and Prompt travel by value into their actors

BOUND_S = 0.5
SLACK_S = 10.0  # a loaded CI machine: the call returns within its bound plus this, never after the endpoint's sleep
NEVER_S = 60.0  # how long the silent endpoint's methods sleep: far longer than any bound plus the slack


class Silent:
    """Every method sleeps NEVER_S: whoever waits for an answer waits for one that does not come in time."""

    def _sleep(self, *args, **kwargs):
        time.sleep(NEVER_S)

    drop = port_free = node = ticket = call = state = fenced = shutdown = _sleep


class Prompt:
    """Answers at once (a device group's host that is well; a driver whose step loop raised)."""

    def drop(self, key):
        return None

    def run(self):
        raise RuntimeError("a role raised")

    def ticket(self):
        return 0

    def in_turn(self, turn, method, key, name, args, kwargs):
        return f"{key} {name}() ran as turn {turn}"


@pytest.fixture(scope="module")
def silent(ray_session):
    actor = ray_session.remote(num_cpus=0, max_concurrency=32)(Silent).remote()
    yield actor
    ray_session.kill(actor)


@pytest.fixture(scope="module")
def prompt(ray_session):
    actor = ray_session.remote(num_cpus=0)(Prompt).remote()
    ray_session.get(actor.drop.remote("t9/actor"), timeout=120)  # started: it answers as a well host does
    yield actor
    ray_session.kill(actor)


def _fails_in_time(call, match: str):
    start = time.monotonic()
    with pytest.raises(NoAnswer, match=match) as raised:
        call()
    elapsed = time.monotonic() - start
    assert elapsed + 0.05 >= BOUND_S and elapsed < BOUND_S + SLACK_S, elapsed
    return str(raised.value)


def test_a_role_drop_in_a_device_group_process_that_never_answers_fails_naming_it(silent):
    from rlsched.cluster.group_process import GroupProcessRole

    role = GroupProcessRole(silent, "t0/actor", "actor")
    role.pid = 4242
    message = _fails_in_time(lambda: role.terminate(timeout_s=BOUND_S), r"t0/actor's drop\(\)")
    assert "pid 4242" in message and f"did not answer in {BOUND_S:g} s" in message


def test_a_role_drop_across_hosts_names_only_the_host_that_never_answers(silent, prompt):
    from rlsched.cluster.group_process import GroupProcesses, GroupProcessesRole

    nodes = [{"host": "10.0.0.1", "pid": 11}, {"host": "10.0.0.2", "pid": 22}]
    role = GroupProcessesRole(GroupProcesses([prompt, silent], nodes, "10.0.0.1:1234"), "t0/actor", "actor",
                              call_timeout_s=BOUND_S)
    message = _fails_in_time(lambda: role.terminate(timeout_s=BOUND_S), r"t0/actor's drop\(\)")
    assert "member 1 of 2 (host 10.0.0.2, pid 22" in message and "member 0" not in message, message


def test_a_call_across_hosts_that_no_host_answers_fails_naming_it(silent, prompt):
    from rlsched.cluster.group_process import GroupProcesses, GroupProcessesRole

    well = GroupProcessesRole(GroupProcesses([prompt], [{"host": "10.0.0.1", "pid": 11}], "10.0.0.1:1234"),
                              "t0/actor", "actor", call_timeout_s=60.0)
    assert well.train() == "t0/actor train() ran as turn 0"  # a host that answers: its value, as before
    role = GroupProcessesRole(GroupProcesses([silent], [{"host": "10.0.0.1", "pid": 11}], "10.0.0.1:1234"),
                              "t0/actor", "actor", call_timeout_s=BOUND_S)
    message = _fails_in_time(lambda: role.train(), r"its actor group's train\(\)")
    assert "cluster.call_timeout_s" in message


def test_a_port_check_that_never_answers_fails_naming_the_port(silent, monkeypatch):
    from rlsched.cluster import rolegroup

    monkeypatch.setattr(rolegroup, "PORT_CHECK_TIMEOUT_S", BOUND_S)
    nodes = [{"host": "127.0.0.1", "pid": 7}]
    _fails_in_time(lambda: rolegroup.join_job([silent], "device-group", lambda kind, host, busy: 23456,
                                              lambda refs, name: nodes),
                   r"port_free\(127.0.0.1:23456\) of device-group's first process \(pid 7\)")


def test_train_asks_a_scheduler_that_never_answers_and_fails_naming_the_call(ray_session, silent, prompt,
                                                                              monkeypatch):
    from rlsched.run import experiment

    monkeypatch.setattr(experiment, "ASK_TIMEOUT_S", BOUND_S)
    ref = prompt.run.remote()
    ray_session.wait([ref])
    # A task whose step loop raised asks the scheduler whether it fenced it first (`_result`)
    _fails_in_time(lambda: experiment._result("t0", ref, silent, cfg=None), r"the scheduler's fenced\(\)")
    _fails_in_time(lambda: experiment._ask(silent, "state"), r"the scheduler's state\(\)")


def test_an_object_store_receive_that_never_answers_fails_naming_the_weights(silent, monkeypatch):
    from rlsched.cluster import comm

    monkeypatch.setattr(comm, "RECEIVE_TIMEOUT_S", BOUND_S)
    channel = comm.ObjectStoreChannel("exp/t0/actor->rollout")
    never = comm.WeightMessage(channel.name, 3, "sum", 2**21, silent.state.remote())  # a ref that never resolves
    _fails_in_time(lambda: channel.receive(never),
                   r"exp/t0/actor->rollout: the object store's read of the weights of v3 \(2 MiB\)")


def test_a_graceful_down_whose_shutdown_never_answers_says_so_in_time(silent):
    from rlsched.service.daemon import shut_down

    start = time.monotonic()
    line = shut_down(silent, False, grace_s=0.2, answer_s=0.3)  # waits 0.2 + 0.3 s at most
    assert time.monotonic() - start < BOUND_S + SLACK_S
    assert line.startswith("the shutdown did not finish: NoAnswer: the service's shutdown() did not answer in "
                           "0.5 s"), line
