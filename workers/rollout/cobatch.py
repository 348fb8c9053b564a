"""Co-batched ROLLOUT in one process: the generate calls of a base group's tasks that hold the rollout lock together
(workers.rollout.base.Together) meet in a gathering, and one of their threads runs them all at once.

    gatherings = Gatherings(run)               # run(requests) -> one result (or exception) per request
    gatherings.join(hold, tasks, request)      # each member, from its own thread: its own result
    gatherings.withdraw(hold, tasks)           # a member that will not come (it failed before generating)

Design decisions:
- **Why a gathering.** The scheduler grants one hold to several tasks, but each task's engine role calls generate
  from its own thread, at its own moment (after its own weight sync). For their rows to share one program run the
  engine must wait until the members have come; then the thread whose arrival completes the gathering runs them
  all (`run`, once) and hands each member its own result. Nothing else coordinates the threads: the gathering is
  keyed by the hold's id, which every member's Together carries.
- **The wait is bounded.** A member can fail before it generates (a refused weight sync, a bad request, its role
  dying), and the others hold the rollout lock meanwhile. A member that never comes must not hang them: after
  `wait_s` (GATHER_WAIT_S) from the first arrival, whoever has come runs without it. `withdraw` makes that
  immediate where the member knows it will not come; it is always cheaper than the wait.
- **A late arrival runs alone.** A member whose gathering already ran (it came after the wait) runs its own
  request at once, as a gathering of one: its result is the same, only not co-batched.
- **Nothing grows.** A gathering leaves the table when it runs. The holds that ran are remembered in a bounded
  FIFO (_RAN_KEPT), so that a late arrival runs at once instead of opening a new gathering that waits a whole
  window for members already gone; a gathering of withdrawals only (no member thread to close it) is dropped
  once its wait is over.
- A member's result is what `run` gives its request: determinism is `run`'s (workers.rollout.jax_sampler's
  generate_many gives each request the tokens it gets alone).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

GATHER_WAIT_S = 30.0  # the longest the members of one hold wait for the rest, from the first arrival
_RAN_KEPT = 1024  # holds remembered after they ran (a late arrival then runs at once)


@dataclasses.dataclass(eq=False)
class _Member:
    request: object
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


@dataclasses.dataclass(eq=False)
class _Gathering:
    expected: int  # the hold's tasks
    deadline: float  # time.monotonic() after which the members that came run without the rest
    members: list[_Member] = dataclasses.field(default_factory=list)
    withdrawn: int = 0
    closed: bool = False  # no member joins any more; it left the table
    led: bool = False  # a member's thread has taken the run


class Gatherings:
    """The open gatherings of one engine (a base group's SharedSampler), by hold. `run(requests)` returns one
    result or exception per request, in order; it runs in the thread of one member."""

    def __init__(self, run: Callable[[Sequence[object]], Sequence[object]], wait_s: float = GATHER_WAIT_S):
        self._run = run
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._open: dict[int, _Gathering] = {}
        self._ran: collections.OrderedDict[int, None] = collections.OrderedDict()

    def join(self, hold: int, tasks: int, request: object) -> object:
        """This member's request, run with those of the hold's other members (or without the ones that did not
        come within the wait); its own result, or its own exception raised."""
        me = _Member(request)
        with self._cond:
            gathering = self._gathering(hold, tasks)
            if gathering is None:  # it ran already: this member runs alone
                lead = [me]
            else:
                gathering.members.append(me)
                self._close_if_complete(hold, gathering)
                while not gathering.closed:
                    left = gathering.deadline - time.monotonic()
                    if left <= 0:  # the rest did not come: those here run without them
                        self._close(hold, gathering)
                        break
                    self._cond.wait(left)
                lead = None if gathering.led else gathering.members
                gathering.led = True
        if lead is not None:
            self._execute(lead)
        me.done.wait()  # the leader sets it whatever happens (_execute's finally)
        if me.error is not None:
            raise me.error
        return me.result

    def withdraw(self, hold: int, tasks: int) -> None:
        """A member of the hold that will not join (it failed before generating): the others stop waiting for it."""
        with self._cond:
            gathering = self._gathering(hold, tasks)
            if gathering is not None:
                gathering.withdrawn += 1
                self._close_if_complete(hold, gathering)

    def open_holds(self) -> list[int]:
        """Holds whose gathering waits for members now (for tools and tests)."""
        with self._cond:
            return list(self._open)

    def _gathering(self, hold: int, tasks: int) -> _Gathering | None:
        """The hold's open gathering (opened now if it has none); None when it ran already."""
        now = time.monotonic()
        for stale in [h for h, g in self._open.items() if not g.members and g.deadline <= now]:
            self._close(stale, self._open[stale])  # withdrawals only, and its wait is over: nobody will close it
        if hold in self._ran:
            return None
        if hold not in self._open:
            self._open[hold] = _Gathering(max(1, int(tasks)), now + self.wait_s)
        return self._open[hold]

    def _close_if_complete(self, hold: int, gathering: _Gathering) -> None:
        if len(gathering.members) + gathering.withdrawn >= gathering.expected:
            self._close(hold, gathering)

    def _close(self, hold: int, gathering: _Gathering) -> None:
        gathering.closed = True
        del self._open[hold]
        self._ran[hold] = None
        while len(self._ran) > _RAN_KEPT:
            self._ran.popitem(last=False)
        self._cond.notify_all()  # the members waiting: one of them leads when the closer is not a member

    def _execute(self, members: list[_Member]) -> None:
        results, failure = None, None
        try:
            results = list(self._run([m.request for m in members]))
            if len(results) != len(members):
                raise RuntimeError(f"a co-batched run gave {len(results)} results for {len(members)} requests")
        except BaseException as e:  # every member learns it; the leader's own member raises it in its thread
            failure = e
        finally:
            for i, member in enumerate(members):
                outcome = failure if failure is not None or results is None else results[i]
                if isinstance(outcome, BaseException):
                    member.error = outcome
                else:
                    member.result = outcome
                member.done.set()
