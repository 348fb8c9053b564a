"""Coordinator ports for role groups that span hosts: handed out by the scheduler, one owner each.

    ports = PortAllocator(range(29500, 29600))
    port = ports.take("addition/actor", host="10.0.0.3")    # never a port another group holds
    ports.take("addition/actor", host="10.0.0.3", skip=[port])  # the host said it is busy: the next one
    ports.release("addition")                                # the task's groups are gone

Design decisions (and why):
- **One allocator per scheduler.** Every task's role groups get their coordinator port from it, so two groups
  never share a port or a coordinator (a shared rendezvous was the field's first cause of hung weight syncs),
  whatever order they start in.
- **The host has the last word.** A port the allocator thinks free may be taken by something else on that
  host; the group's first member tries to bind it and the caller asks again with it in `skip`.
- Owners are "<task>/<role>"; releasing a task releases all its groups' ports. Pure: no Ray, no sockets.
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_RANGE = range(29500, 30500)


class PortsExhausted(RuntimeError):
    pass


class PortAllocator:
    def __init__(self, ports: Iterable[int] = DEFAULT_RANGE):
        self.ports = list(ports)
        self._held: dict[tuple[str, int], str] = {}  # (host, port) -> owner

    def take(self, owner: str, host: str, skip: Iterable[int] = ()) -> int:
        """A port on `host` that no other owner holds and not in `skip`; the owner's old port there is freed."""
        skip = set(skip)
        for key in [k for k, o in self._held.items() if o == owner and k[0] == host]:
            del self._held[key]
        for port in self.ports:
            if port not in skip and (host, port) not in self._held:
                self._held[host, port] = owner
                return port
        raise PortsExhausted(f"no free coordinator port on {host} in {self.ports[0]}-{self.ports[-1]} "
                             f"({len(self._held)} held, {len(skip)} found busy)")

    def release(self, task: str) -> None:
        """Free every port held by `task`'s groups (owners '<task>' and '<task>/...')."""
        for key in [k for k, o in self._held.items() if o == task or o.startswith(task + "/")]:
            del self._held[key]

    def held(self) -> dict[str, list[str]]:
        """{owner: ["host:port", ...]} (for status and tests)."""
        out: dict[str, list[str]] = {}
        for (host, port), owner in sorted(self._held.items()):
            out.setdefault(owner, []).append(f"{host}:{port}")
        return out
