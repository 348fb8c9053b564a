"""The service's monitor: a thread that runs one pass after another (rlsched.service.server's `_tick`: poll the
drivers, finish the tasks that ended, admit pending ones), supervised, so that one error does not end it.

    monitor = Monitor(service._tick, log=book.log, lock=service_lock)
    monitor.start()
    monitor.degraded    # None while its passes succeed; {"since", "cause", "failures"} while they fail

Without supervision, one error would end the thread, and no task would ever be finished or admitted again while
`status` still answered.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any


class Monitor:
    """Runs `tick` again and again in a daemon thread: a pass that raises is logged with its traceback, the monitor
    is `degraded` with the cause, and the next pass comes after a pause that doubles up to 30 s; the first pass that
    succeeds clears it."""

    def __init__(self, tick: Callable[[], None], *, log: Callable[[str], None], lock: threading.RLock):
        self.tick = tick  # looked up at every pass (a test replaces it to inject a fault)
        self.log = log
        self.lock = lock  # guards `degraded`, with the rest of the service's state
        self.degraded: dict[str, Any] | None = None  # the last error, until a pass succeeds
        self._thread = threading.Thread(target=self._watch, name="rlsched-service-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        failures = 0
        while True:
            try:
                self.tick()
            except Exception as err:  # noqa: BLE001 - any error: logged, shown, and the loop goes on
                failures += 1
                cause = f"{type(err).__name__}: {err}".splitlines()[0]
                with self.lock:
                    since = self.degraded["since"] if self.degraded else time.time()
                    self.degraded = {"since": since, "cause": cause, "failures": failures}
                self.log(f"the monitor failed ({failures} in a row), retrying: {traceback.format_exc()}")
                time.sleep(min(30.0, 0.5 * 2**failures))
                continue
            if failures:
                with self.lock:
                    self.degraded = None
                self.log(f"the monitor recovered after {failures} failed pass(es)")
                failures = 0
