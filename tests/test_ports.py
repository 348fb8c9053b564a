"""The scheduler's coordinator ports (rlsched.scheduling.ports): never two groups on one port of a host."""

from __future__ import annotations

import pytest

from rlsched.scheduling.ports import PortAllocator, PortsExhausted


def test_groups_get_distinct_ports_and_a_released_task_gives_them_back():
    ports = PortAllocator(range(100, 104))
    a, b = ports.take("a/actor", "h1"), ports.take("b/actor", "h1")
    assert (a, b) == (100, 101)
    assert ports.take("c/actor", "h2") == 100  # another host: its own ports
    assert ports.take("a/actor", "h1", skip=[100, 102]) == 103  # asked again (the host found 100 busy): the old one
    assert ports.held() == {"a/actor": ["h1:103"], "b/actor": ["h1:101"], "c/actor": ["h2:100"]}  # goes back
    ports.release("a")
    assert ports.take("d/actor", "h1") == 100
    ports.take("e/actor", "h1")
    ports.take("f/actor", "h1")
    with pytest.raises(PortsExhausted, match=r"no free coordinator port on h1 in 100-103 \(5 held"):
        ports.take("g/actor", "h1")
    ports.release("ab")  # a prefix of no owner's task releases nothing
    assert len(ports.held()) == 5
