"""Records a long-lived process keeps in memory, each with a bound: a service lives for weeks and must not grow.

    answers = RecentAnswers(1000)    # request id -> answer: the last 1000 (a client retries within minutes)
    lines = TailLines(1000)          # a task's lines: the last 1000 in memory, every line numbered from the first

What falls out of memory is not lost: a task's lines are all in its run's run.log (rlsched.service.server writes each
there as it comes), and `TailLines.read` says how many earlier ones are only there.
"""

from __future__ import annotations

import collections
from typing import Any


class RecentAnswers:
    """A mapping of the last `limit` keys set (oldest dropped first), with the dict methods the service uses."""

    def __init__(self, limit: int):
        self.limit = limit
        self._items: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)

    def setdefault(self, key: str, value: Any) -> Any:
        if key not in self._items:
            self[key] = value
        return self._items[key]


class TailLines:
    """The last `limit` lines of a task, numbered from its first line (0): offsets stay valid as old lines go."""

    def __init__(self, limit: int):
        self._lines: collections.deque[str] = collections.deque(maxlen=limit)
        self.dropped = 0  # lines that fell out of memory (the number of the first line kept)

    def append(self, line: str) -> None:
        if len(self._lines) == self._lines.maxlen:
            self.dropped += 1
        self._lines.append(line)

    def __len__(self) -> int:
        """Every line there has been (kept or not): the offset of the next one."""
        return self.dropped + len(self._lines)

    @property
    def kept(self) -> int:
        return len(self._lines)

    def read(self, offset: int = 0) -> tuple[list[str], int]:
        """(the lines from `offset` on that are still kept, how many lines before them are no longer kept)."""
        skipped = max(self.dropped - offset, 0)
        return list(self._lines)[max(offset - self.dropped, 0):], skipped
