"""A device group's process lives as long as the scheduler service, and every compiled program it keeps holds memory
maps of JIT code (a process has at most vm.max_map_count of them; the next compile past it dies of a segfault). A
role's programs are shared with the roles that compile the same ones and go with the last of them; once the process
holds no role and builds none it drops everything it keeps; `held()` says how many programs it keeps and how many
maps it has. A real Ray actor, as the service starts it."""

from __future__ import annotations

import sys
import time
import types

from ray import cloudpickle

from rlsched.cluster.group_process import GroupProcess

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # CompilingRole travels by value into the Ray actor

PROGRAMS_PER_ROLE = 20


class CompilingRole:
    """A role whose start compiles PROGRAMS_PER_ROLE programs (x * n + i) through workers.compiling.shared and holds
    them, as a real role's prepare does; then it waits for `spec.gate` (a file) when it has one: a start in
    progress."""

    def __init__(self, spec, channel=None):
        import jax

        from workers import compiling

        self.programs = [compiling.shared(("test-role", spec.n, i),
                                          lambda i=i: jax.jit(lambda x: x * spec.n + i).lower(1.0).compile())[0]
                         for i in range(PROGRAMS_PER_ROLE)]
        while spec.gate is not None and not spec.gate.exists():
            time.sleep(0.01)

    def device_ids(self) -> list[int]:
        return [0]

    def run(self, x: float) -> list[float]:
        return [float(p(x)) for p in self.programs]


def _spec(n, gate=None):
    return types.SimpleNamespace(hosts=1, n=n, gate=gate)


def test_programs_live_while_a_role_holds_them_and_an_empty_process_keeps_none(ray_session, tmp_path):
    ray = ray_session
    process = ray.remote(num_cpus=0, max_concurrency=8)(GroupProcess).remote()
    held = lambda: ray.get(process.held.remote())  # noqa: E731
    run = lambda key: ray.get(process.call.remote(key, "run", (1.0,), {}))  # noqa: E731
    assert held()["programs"] == 0

    ray.get([process.start.remote(key, CompilingRole, _spec(n), None)
             for key, n in (("a/actor", 2), ("a2/actor", 2), ("b/actor", 3))])
    three = held()
    assert three["programs"] == 2 * PROGRAMS_PER_ROLE, three  # a2 took a's programs: the same ones
    ray.get(process.drop.remote("a/actor"))
    assert held()["programs"] == 2 * PROGRAMS_PER_ROLE and run("a2/actor") == [2.0 + i for i in range(20)]
    ray.get(process.drop.remote("a2/actor"))  # the last holder of n=2's programs: they go, b's stay
    one = held()
    assert one["programs"] == PROGRAMS_PER_ROLE and run("b/actor") == [3.0 + i for i in range(20)], one
    if three["memory_maps"] is not None:  # Linux: the 20 executables' maps of JIT code went with them
        assert one["memory_maps"] < three["memory_maps"] - PROGRAMS_PER_ROLE, (three, one)

    # c's start compiles, then waits at its gate; b leaves meanwhile: the process holds no role but builds one, so
    # it forgets nothing (c's programs stay shareable).
    gate = tmp_path / "gate"
    started = process.start.remote("c/actor", CompilingRole, _spec(5, gate), None)
    deadline = time.monotonic() + 60
    while held()["programs"] < 2 * PROGRAMS_PER_ROLE:
        assert time.monotonic() < deadline, "c's start never compiled its programs"
        time.sleep(0.05)
    ray.get(process.drop.remote("b/actor"))
    building = held()
    assert building["roles"] == [] and building["programs"] == PROGRAMS_PER_ROLE, building
    gate.touch()
    ray.get(started, timeout=60)
    assert run("c/actor") == [5.0 + i for i in range(PROGRAMS_PER_ROLE)]

    ray.get(process.drop.remote("c/actor"))
    empty = held()
    assert empty["roles"] == [] and empty["programs"] == 0, empty
    ray.kill(process)
