# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fs tier's rate limit for what it logs, one implementation for the
reports it makes as things happen (failed block I/O, the budget's refusals
and its thread's errors, a ledger or config.json that could not be
written): a failing tier is never silent, and never floods the log."""

import threading
import time

# The interval of every rate-limited report: a disk that fills up after an
# hour is as visible as one that fails at start, one line per interval.
REPORT_INTERVAL_S = 30.0


class Throttle:
    """Whether a rate-limited line is due: the first at once, then at most
    one per *interval_s* (REPORT_INTERVAL_S unless given). Thread-safe: of
    threads asking at the same time, one is told yes. The caller keeps its
    counts and says them in the line, with those since the previous one."""

    def __init__(self, interval_s: float | None = None) -> None:
        self._interval_s = interval_s  # None: REPORT_INTERVAL_S, read when due
        self._lock = threading.Lock()
        self._next = float("-inf")

    def due(self, force: bool = False) -> bool:
        """Whether to say a line now (*force*: whatever the interval, e.g.
        at shutdown); if so, the next is due an interval from now."""
        now = time.monotonic()
        with self._lock:
            if not force and now < self._next:
                return False
            interval = self._interval_s
            self._next = now + (REPORT_INTERVAL_S if interval is None else interval)
            return True
