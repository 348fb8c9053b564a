"""Waiting for another process's answer, never for ever.

    value = answer(scheduler.state.remote(), what="the scheduler's state()", timeout_s=ASK_TIMEOUT_S,
                   check="is the scheduler's process alive (`ray list actors`)?")

Why: a process that hangs (a deadlock, a wedged device, a lost node whose death Ray has not noticed yet) never
answers, and a caller waiting without a bound hangs with it, silently, holding whatever it holds. Every remote
wait of rlsched has a bound, a named constant beside the call (or a config key where a user would tune it,
`cluster.call_timeout_s`), and one that runs out raises `NoAnswer` naming the call, on what, after how long, and
what to check. Calls that wait for others by design (a lock's `acquire`, a driver's lifeline) are the exceptions,
and say why where they are made.

Ray is imported inside the function: importing this module costs nothing without Ray.
"""

from __future__ import annotations

from typing import Any

from rlsched.base.errors import TaskError


class NoAnswer(TaskError):
    """A remote call did not answer within its bound; the message names the call, on what, after how long, and
    what to check."""


def no_answer(what: str, timeout_s: float, check: str) -> NoAnswer:
    """The error for `what` (a call and where it ran, e.g. "task t0's actor drop() in the device group's process
    pid 7") that did not answer in `timeout_s`; `check`: what a person should look at."""
    return NoAnswer(f"{what} did not answer in {timeout_s:g} s; {check}")


def answer(ref, *, what: str, timeout_s: float, check: str) -> Any:
    """`ray.get(ref)` within `timeout_s`, else `NoAnswer` (see `no_answer`). A ref that answers with an error
    raises it as `ray.get` does; only the wait is bounded."""
    import ray

    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise no_answer(what, timeout_s, check) from None
