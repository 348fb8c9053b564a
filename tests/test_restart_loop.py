"""The restart loop's arithmetic (rlsched.run.task.TaskDriver._restart_after), without processes: a role whose
replacement dies while it is being put in place (its new process's first call) is the task's next death, counted
against max_restarts and reported with every cause. tests/test_restarts.py kills real processes; its chaos harness
hits this window only by timing."""

from __future__ import annotations

import types

import pytest

from rlsched.base.errors import RoleDied
from rlsched.observe.timeline import Timeline
from rlsched.run.task import TaskDriver
from rlsched.scheduling.policy import Role


class _Loader:
    def __init__(self):
        self.loaded = []

    def load_state(self, position):
        self.loaded.append(position)


def _driver(max_restarts: int, replacements: list) -> TaskDriver:
    """A TaskDriver with only what the restart loop reads; `replacements`: what each `_replace` does in turn (None:
    the new engine stands; an exception: its new process died while being put in place)."""
    driver = object.__new__(TaskDriver)
    driver.name, driver.spec = "t", types.SimpleNamespace(config=types.SimpleNamespace(max_restarts=max_restarts))
    driver.locks = types.SimpleNamespace(revoked=lambda: None)
    driver.restarts, driver._charged, driver.step_done = [], 0, 4
    driver.echoed = []
    driver.echo = driver.echoed.append
    driver.timeline, driver.host = Timeline("driver", task="t"), types.SimpleNamespace(loader=_Loader())
    driver.places = {"engine": {"pid": 0}}
    driver._lost_with = lambda died: [Role.ENGINE]
    driver._collateral = lambda died: None
    replaced = iter(replacements)

    def replace(role):
        outcome = next(replaced)
        driver.places["engine"] = {"pid": driver.places["engine"]["pid"] + 1}
        if outcome is not None:
            raise outcome

    driver._replace = replace
    return driver


def _death(what: str) -> RoleDied:
    return RoleDied(f"its engine process died during {what}: killed by signal 9", "engine")


def test_a_replacement_that_dies_while_put_in_place_is_the_next_death_and_is_replaced_in_turn():
    driver = _driver(3, [_death("memory()"), None])
    assert driver._restart_after(_death("rollout()"), 5, {"at": 7}) is True
    assert driver._charged == 2 and len(driver.restarts) == 2
    assert "rollout()" in driver.restarts[0] and "memory()" in driver.restarts[1]
    assert driver.host.loader.loaded == [{"at": 7}]  # the step is redone once, from where it started
    assert driver.places["engine"]["pid"] == 2


def test_without_restarts_left_the_replacement_s_death_fails_the_task_with_every_cause():
    driver = _driver(1, [_death("memory()")])
    with pytest.raises(RoleDied) as raised:
        driver._restart_after(_death("rollout()"), 5, {"at": 7})
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert "memory()" in str(raised.value) and "after 1 restart(s) (max_restarts=1)" in notes
    assert "rollout()" in notes  # the first death is named too, not only the last
    assert driver._charged == 1 and driver.host.loader.loaded == []
