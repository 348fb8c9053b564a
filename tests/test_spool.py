"""A live submission's scheduler events on disk (rlsched.service.spool): what is appended reads back in order, a
line cut short by a killed service is left out, and the file goes when asked. Real files."""

from __future__ import annotations

from rlsched.observe.timeline import event_end
from rlsched.service.spool import EventSpool


def test_events_read_back_in_order_and_a_cut_line_is_left_out(tmp_path):
    spool = EventSpool(tmp_path / "spool" / "request.jsonl")
    assert spool.read() == []  # nothing spooled yet: no file
    first = [{"kind": "counter", "name": "queue/g0/rollout", "ts": 1.5, "values": {"waiting": 1.0}},
             {"kind": "span", "name": "fence", "start": 1.0, "end": 2.0, "args": {"cause": "hung"}}]
    assert spool.append(first) == 2 and spool.append([]) == 0
    assert spool.append(iter([{"kind": "counter", "name": "memory/g0", "ts": 3.0, "values": {}}])) == 1
    with open(spool.path, "a", encoding="utf-8") as f:
        f.write('{"kind": "counter", "name": "queue/g0/tr')  # the service died in the middle of a line
    assert spool.read() == [*first, {"kind": "counter", "name": "memory/g0", "ts": 3.0, "values": {}}]
    assert [event_end(e) for e in spool.read()] == [1.5, 2.0, 3.0]
    spool.remove()
    assert not spool.path.exists() and spool.read() == []
    spool.remove()  # twice: nothing to remove, no error
