"""Comm channels: weights arrive intact, only on their own task's channel, across processes too."""

from __future__ import annotations

import numpy as np
import pytest

from rlsched.cluster.comm import (
    ChannelError,
    FakeChannel,
    LocalChannel,
    ObjectStoreChannel,
    WeightMessage,
    make_channel,
)
from rlsched.config.spec import comm_group_name


def _flat():
    rng = np.random.default_rng(0)
    return {"model.embed_tokens.weight": rng.standard_normal((6, 4)).astype(np.float32),
            "model.norm.weight": np.ones(4, np.float32)}


def test_local_channel_delivers_the_message_with_its_version_checksum_and_size():
    channel = LocalChannel(comm_group_name("exp", "a"))
    flat = _flat()
    message = channel.send(flat, 3, "abc")
    assert (message.group, message.version, message.checksum) == ("exp/a/actor->rollout", 3, "abc")
    assert message.nbytes == 6 * 4 * 4 + 4 * 4  # float32: 24 + 4 values x 4 bytes
    got = channel.receive(message)
    assert got.keys() == flat.keys() and all(np.array_equal(got[k], flat[k]) for k in flat)


def test_a_message_never_crosses_to_another_tasks_channel():
    a, b = LocalChannel("exp/a/actor->rollout"), LocalChannel("exp/b/actor->rollout")
    with pytest.raises(ChannelError, match="'exp/b/actor->rollout' received a message of group 'exp/a/actor->rollout'"):
        b.receive(a.send(_flat(), 1, "x"))


def test_channel_names_are_checked_and_kinds_named():
    with pytest.raises(ValueError, match="looks like '<experiment>/<task>/actor->rollout'"):
        LocalChannel("shared")
    with pytest.raises(ValueError, match="unknown weight channel 'nccl'; choose one of"):
        make_channel("nccl", "e/t/actor->rollout")
    assert isinstance(make_channel("fake", "e/t/actor->rollout"), FakeChannel)


def test_fake_channel_records_messages_and_corrupts_on_request():
    channel = FakeChannel("e/t/actor->rollout")
    flat = _flat()
    clean = channel.receive(channel.send(flat, 0, "c0"))
    channel.corrupt_next = True
    bad = channel.receive(channel.send(flat, 1, "c1"))
    assert [m.version for m in channel.sent] == [0, 1] and not channel.corrupt_next
    assert np.array_equal(clean["model.norm.weight"], flat["model.norm.weight"])
    np.testing.assert_allclose(bad["model.norm.weight"], 1.01)  # scaled: a checksum of it must differ
    assert bad["model.norm.weight"].dtype == np.float32


def test_object_store_channel_carries_weights_between_processes(ray_session):
    ray = ray_session
    name = comm_group_name("exp", "t")

    @ray.remote(num_cpus=0)
    class Sender:
        def send(self, flat):
            return ObjectStoreChannel(name).send(flat, 7, "sum7")

    @ray.remote(num_cpus=0)
    class Receiver:
        def receive(self, message):
            flat = ObjectStoreChannel(name).receive(message)
            return {k: (v.copy(), v.flags.writeable) for k, v in flat.items()}

    sender, receiver = Sender.remote(), Receiver.remote()
    message = ray.get(sender.send.remote(_flat()))
    assert isinstance(message, WeightMessage) and message.version == 7 and message.checksum == "sum7"
    got = ray.get(receiver.receive.remote(message))
    expected = _flat()
    assert all(np.array_equal(got[k][0], expected[k]) for k in expected)
    # Object-store arrays are read-only views: the engine must copy them into buffers of its own.
    assert not any(writeable for _, writeable in got.values())
    ray.kill(sender)
    ray.kill(receiver)


def test_a_local_message_carries_no_arrays_and_is_received_only_where_it_was_sent():
    """The message is what a driver forwards between two roles hosted in one process: only the version
    travels, the weights wait in the process's slot (the latest version), and a closed channel drops them."""
    import pickle

    channel = LocalChannel(comm_group_name("exp", "slot"))
    first = channel.send(_flat(), 1, "c1")
    assert first.payload is None and len(pickle.dumps(first)) < 300
    second = channel.send(_flat(), 2, "c2")
    with pytest.raises(ChannelError, match="v1 was not sent in this process \\(its slot holds v2\\)"):
        channel.receive(first)
    assert channel.receive(second).keys() == _flat().keys()
    channel.close()
    with pytest.raises(ChannelError, match="its slot holds nothing"):
        channel.receive(second)


def test_a_local_message_survives_its_senders_offload_through_follow():
    """An actor evicted between the TRAIN that published and the ROLLOUT that syncs: its offload frees the device
    arrays the slot held, and `follow` points the slot at the host copies, so the engine receives the published
    values (from host memory). A move for another version leaves the slot alone."""
    import jax.numpy as jnp

    from workers.models.params import checksum
    from workers.offload import offload, on_device, onload

    channel = LocalChannel(comm_group_name("exp", "evicted"))
    live = {k: jnp.asarray(v) for k, v in _flat().items()}
    message = channel.send(live, 4, "c4")
    held = {}

    def evict():
        held["off"] = offload(live)  # deletes the device arrays the slot holds
        return held["off"].tree

    channel.follow(4, evict)
    with channel.receiving(message) as got:
        assert not any(on_device(v) for v in got.values())  # host copies, not a second set on the device
        assert all(np.array_equal(np.asarray(got[k]), v) for k, v in _flat().items())
        assert checksum(got) == checksum(_flat())  # host-memory arrays hash (on the host) like any layout
    back = onload(held["off"])
    channel.follow(3, lambda: back)  # not the published version: the slot keeps what it holds
    with pytest.raises(ChannelError, match="freed by their sender"):
        channel.receive(message)  # the onload freed the host copies the slot still points at
    channel.follow(4, lambda: back)
    assert all(np.array_equal(np.asarray(channel.receive(message)[k]), v) for k, v in _flat().items())
    assert all(on_device(v) for v in channel.receive(message).values())
    channel.close()
