"""The scheduler's timeline events of a live submission, kept on disk until its run's outputs are written.

A submission's timeline (runs/<exp>/timeline.json, written when its last task ends) holds every scheduler event of
its time: its own tasks' lock waits and grants, and the other tasks' beside them. The scheduler used to keep all
events since the oldest live submission began, so a service's memory grew with the age of that submission: a task
that trains for a week kept a week of every task's events in the scheduler actor. The service's monitor now moves
the events that ended more than SPOOL_MARGIN_S ago out of the scheduler every SPOOL_EVERY_S, appending each to the
spool file of every live submission whose time it falls in (`$RLSCHED_HOME/spool/<request id>.jsonl`), and the
scheduler forgets them; at the end the run's outputs read the spool back, and the file goes.

    spool = EventSpool(state_dir / "spool" / f"{request_id}.jsonl")
    spool.append(events)       # JSON lines, appended and flushed
    spool.read()               # every event appended, in order
    spool.remove()

The margin: an event is recorded when it ends (rlsched.observe.timeline), so one that ended before the cut reached
the scheduler's timeline before it; the margin covers the time between the two clocks' readings.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SPOOL_EVERY_S = 10.0  # how often the service moves events to the spools
SPOOL_MARGIN_S = 5.0  # events that ended this recently stay in the scheduler until the next pass


class EventSpool:
    """One submission's spooled scheduler events: a JSON-lines file."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def append(self, events: Iterable[dict[str, Any]]) -> int:
        """Append `events`; returns how many. The file is flushed: a service that dies leaves whole lines."""
        lines = [json.dumps(e, default=str) + "\n" for e in events]
        if lines:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.writelines(lines)
        return len(lines)

    def read(self) -> list[dict[str, Any]]:
        """Every event appended (none when nothing was). A last line cut short (a service killed while writing)
        is left out."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        events = []
        for line in text.splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
        return events

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
