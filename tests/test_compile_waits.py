"""A task that waits for another's build of a shared program spent that time compiling: `compiling.waits` counts
it for the caller (and rlsched.run.roles puts it on a compile span), the builder's own time being its build."""

from __future__ import annotations

import threading
import time

from workers.compiling import shared, waits


class Executable:
    """What a build returns, as a JAX executable is: an object a weak reference can point at."""


def test_a_wait_for_anothers_build_is_counted_for_the_waiter_only():
    started = threading.Event()

    def build():
        started.set()
        time.sleep(0.3)  # the compile the other caller waits for
        return Executable()

    mine = {}

    def builder():
        with waits() as waited:
            mine["builder"] = shared(("test", "waits"), build), waited["seconds"]

    thread = threading.Thread(target=builder)
    thread.start()
    assert started.wait(30)
    with waits() as waited:
        executable, built = shared(("test", "waits"), build)
    thread.join(30)
    (their_executable, their_built), their_wait = mine["builder"]
    assert (built, their_built) == (False, True) and executable is their_executable
    assert 0.15 <= waited["seconds"] <= 30, waited  # most of the 0.3 s build (it started before we asked)
    assert their_wait == 0.0  # building is not waiting
    with waits() as again:
        assert shared(("test", "waits"), build) == (executable, False)
    assert again["seconds"] == 0.0  # ready already: no wait
    shared(("test", "waits"), build)  # outside `waits()`: nothing is counted, nothing fails
