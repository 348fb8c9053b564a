"""Comm groups: the named, per-task channel that carries weights from a task's actor to its engine.

    channel = ObjectStoreChannel("exp/addition/actor->rollout")
    message = channel.send(flat, version, checksum)     # in the actor's process
    flat = channel.receive(message)                      # in the engine's process

Design decisions (and why):
- **One channel per (experiment, task, actor->rollout), nothing global.** The task makes its channel
  from the name the scheduler hands out and gives it to its own two roles only, so two tasks cannot
  share a group or a port by construction (shared groups were the first cause of the field's
  weight-sync hang). A message names its group, and a channel refuses a message of another group.
- **A message is (group, version, checksum, bytes, payload).** The payload is opaque to the driver
  that forwards it: an object reference here, a rendezvous id for a collective later. The driver never
  holds the weights, only the message.
- **Arrays in, arrays out; the receiver copies.** The sender hands its arrays as they lie (device arrays
  on its mesh). `LocalChannel` passes them through, so an engine in the actor's process copies them
  device to device into its layout, no weight byte through host memory (workers.rollout.jax_sampler, where the
  devices have room for both versions); `ObjectStoreChannel` moves them to host one leaf at a time into the
  object store (the transfer between processes). The receiver copies onto its own devices and layout
  (the engine must own its buffers: object-store arrays are read-only views, local ones the actor's), then
  hashes what it holds on its devices, and the driver compares that with `message.checksum`:
  verification never trusts the transport.
- **Published weights survive their sender's moves.** A local channel holds the sender's own arrays until
  the engine takes them, and a memory budget may evict the actor in between (another task needs the room).
  The sender moves through `follow`: its offload keeps the published params in host memory, the slot points
  at those, and the engine's sync reads them from host into its own buffers; no receive reads arrays that a
  move is freeing (`receiving` and `follow` exclude each other). Never a second copy on the device.
- Implementations: `LocalChannel` (one process: the weights wait in a slot of the process), `ObjectStoreChannel`
  (one node, several processes: `ray.put` in the sender, `ray.get` in the receiver), `FakeChannel`
  (tests: records what was sent and can corrupt a payload to prove verification catches it). A
  cross-node collective (an NCCL/ICI broadcast from the actor's ranks to the engine's) fills the same
  two methods: `send` starts the broadcast and returns its rendezvous, `receive` joins it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

Flat = Mapping[str, np.ndarray]

# The longest an engine waits for the weights of a message from the object store: they were put before the message
# left their sender, so on one node the read is a copy from shared memory (~1 s per GB); from another node, a transfer.
RECEIVE_TIMEOUT_S = 600.0


class ChannelError(RuntimeError):
    """A message reached the wrong channel or its payload is gone."""


@dataclasses.dataclass(frozen=True)
class WeightMessage:
    group: str  # the channel's name: "<experiment>/<task>/actor->rollout"
    version: int  # the actor's weight version after the TRAIN that published it
    checksum: str  # params.checksum of the payload, computed by the sender before it left
    nbytes: int  # total bytes of the params carried
    payload: Any  # transport-specific: the dict itself, or an object reference


class WeightChannel(Protocol):
    name: str

    def send(self, flat: Flat, version: int, checksum: str) -> WeightMessage: ...

    def receive(self, message: WeightMessage) -> Flat: ...

    def receiving(self, message: WeightMessage) -> contextlib.AbstractContextManager[Flat]: ...

    def follow(self, version: int, move: Callable[[], Flat]) -> None: ...

    def close(self) -> None: ...


def _nbytes(flat: Flat) -> int:
    return int(sum(v.nbytes for v in flat.values()))  # from the arrays' metadata: nothing moves


class _Channel:
    def __init__(self, name: str):
        if not name or "->" not in name:
            raise ValueError(f"a comm group name looks like '<experiment>/<task>/actor->rollout', got {name!r}")
        self.name = name

    def _check(self, message: WeightMessage) -> None:
        if message.group != self.name:
            raise ChannelError(f"channel {self.name!r} received a message of group {message.group!r}: "
                               "weights never cross between tasks")

    @contextlib.contextmanager
    def receiving(self, message: WeightMessage) -> Iterator[Flat]:
        """`receive`, for as long as the receiver copies what it got: the sender's arrays stay where they are."""
        yield self.receive(message)

    def follow(self, version: int, move: Callable[[], Flat]) -> None:
        """The sender moves its weights (an offload or onload, `move`, returning where its params of `version` lie
        after it): a channel that holds the sender's arrays points at the new ones. Here nothing is held."""
        move()

    def close(self) -> None:
        """Free what this process keeps for the channel (nothing, unless a subclass keeps something)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class LocalChannel(_Channel):
    """Sender and receiver in one process: the weights wait in this process's slot for the channel, and the
    message carries only their version. Nothing is copied here (the receiver copies onto its devices and
    layout, device to device), and a message that travels through another process (a driver forwarding it
    between two roles hosted in one process, rlsched.cluster.group_process) carries no arrays. The slot holds the latest
    version only, and holds the sender's arrays wherever they lie: a sender that offloads (evicted between the
    TRAIN that published and the ROLLOUT that syncs) moves through `follow`, and the slot then holds its host
    copies, which the engine copies from host onto its devices. An actor whose arrays span the processes of a
    device group across hosts (rlsched.cluster.group_process) sends them gathered, leaf by leaf, into the first host's
    memory, where its engine is: every process takes part in each gather."""

    def send(self, flat: Flat, version: int, checksum: str) -> WeightMessage:
        nbytes = _nbytes(flat)
        gathered = any(not getattr(v, "is_fully_addressable", True) for v in flat.values())
        if gathered:
            flat = _gathered(flat)  # an actor across a device group's processes (rlsched.cluster.group_process) to an
                                    # engine on one
        with _lock(self.name):
            _SLOTS[self.name] = (int(version), dict(flat), gathered)
        return WeightMessage(self.name, int(version), checksum, nbytes, None)

    @contextlib.contextmanager
    def receiving(self, message: WeightMessage) -> Iterator[Flat]:
        with _lock(self.name):  # the sender does not move the arrays while the receiver copies them
            yield self.receive(message)

    def follow(self, version: int, move: Callable[[], Flat]) -> None:
        with _lock(self.name):
            flat = move()
            held = _SLOTS.get(self.name)
            if held is not None and held[0] == version and not held[2]:  # gathered copies are the slot's own
                _SLOTS[self.name] = (version, dict(flat), False)

    def receive(self, message: WeightMessage) -> Flat:
        self._check(message)
        version, flat, _ = _SLOTS.get(self.name, (None, {}, False))
        if version != message.version:
            held = "nothing" if version is None else f"v{version}"
            raise ChannelError(f"{self.name}: v{message.version} was not sent in this process (its slot holds "
                               f"{held}); a local channel joins two roles of one process only")
        gone = [k for k, v in flat.items() if getattr(v, "is_deleted", lambda: False)()]
        if gone:
            raise ChannelError(f"{self.name}: the weights of v{message.version} were freed by their sender before "
                               f"they were received ({len(gone)} tensors, e.g. {gone[0]})")
        return flat

    def close(self) -> None:
        """Drop this channel's slot (the sender's last weights) in this process."""
        _SLOTS.pop(self.name, None)


def _gathered(flat: Flat) -> Flat:
    """Arrays that span processes (an actor across hosts), each gathered in turn into host numpy: every process
    of the job takes part (a collective; at most one whole leaf beyond the shards on any device), process 0
    keeps the values (the engine is on its host), the others keep nothing."""
    from workers.multihost import host_value, is_primary

    primary, host = is_primary(), {}
    for k, v in flat.items():
        value = host_value(v)
        if primary:
            host[k] = value
    return host


_SLOTS: dict[str, tuple[int, dict, bool]] = {}  # LocalChannel name -> (version, weights, gathered) last sent here
_LOCKS: dict[str, threading.RLock] = {}  # LocalChannel name -> its slot's lock (the roles hold copies of the channel)
_LOCKS_LOCK = threading.Lock()


def _lock(name: str) -> threading.RLock:
    with _LOCKS_LOCK:
        return _LOCKS.setdefault(name, threading.RLock())


class ObjectStoreChannel(_Channel):
    """One node, several processes: the params go through Ray's shared-memory object store once.

    The reference is created in the sender's process, which owns it: if that process dies, so do
    the weights it published, and the receiver's `ray.get` fails with the cause.
    """

    def send(self, flat: Flat, version: int, checksum: str) -> WeightMessage:
        import ray

        if any(not getattr(v, "is_fully_addressable", True) for v in flat.values()):
            return self._send_from_group(flat, version, checksum)
        host = {k: np.asarray(v) for k, v in flat.items()}  # device -> host one leaf at a time
        return WeightMessage(self.name, int(version), checksum, _nbytes(flat), ray.put(host))

    def _send_from_group(self, flat: Flat, version: int, checksum: str) -> WeightMessage:
        """An actor across hosts (rlsched.cluster.rolegroup): every process gathers each leaf in turn (a collective;
        at most one whole leaf beyond the shards on any device), and process 0 alone puts them in the store.
        The others' message carries no payload; the driver forwards member 0's."""
        import ray

        from workers.multihost import is_primary

        payload = ray.put(_gathered(flat)) if is_primary() else None
        return WeightMessage(self.name, int(version), checksum, _nbytes(flat), payload)

    def receive(self, message: WeightMessage) -> Flat:
        import ray

        from rlsched.base.waits import answer

        self._check(message)
        try:
            return answer(message.payload, timeout_s=RECEIVE_TIMEOUT_S,
                          what=f"{self.name}: the object store's read of the weights of v{message.version} "
                               f"({message.nbytes / 2**20:.0f} MiB)",
                          check="their sender's node may be lost or its object store full (`ray memory` shows the "
                                "object; `ray status`, the nodes)")
        except ray.exceptions.ObjectLostError as err:
            raise ChannelError(f"{self.name}: the weights of v{message.version} are gone from the object store "
                               f"(their sender died?): {err}") from err


class FakeChannel(_Channel):
    """For tests: keeps every message sent; `corrupt_next` scales the next payload so that the
    receiver ends up with weights whose checksum differs from the message's."""

    def __init__(self, name: str):
        super().__init__(name)
        self.sent: list[WeightMessage] = []
        self.corrupt_next = False

    def send(self, flat: Flat, version: int, checksum: str) -> WeightMessage:
        payload = {k: np.array(v, copy=True) for k, v in flat.items()}
        if self.corrupt_next:
            payload = {k: (v * 1.01).astype(v.dtype) if np.issubdtype(v.dtype, np.floating) else v
                       for k, v in payload.items()}
            self.corrupt_next = False
        message = WeightMessage(self.name, int(version), checksum, _nbytes(flat), payload)
        self.sent.append(message)
        return message

    def receive(self, message: WeightMessage) -> Flat:
        self._check(message)
        return message.payload


def make_channel(kind: str, name: str) -> WeightChannel:
    channels = {"local": LocalChannel, "object_store": ObjectStoreChannel, "fake": FakeChannel}
    if kind not in channels:
        raise ValueError(f"unknown weight channel {kind!r}; choose one of {sorted(channels)}")
    return channels[kind](name)
