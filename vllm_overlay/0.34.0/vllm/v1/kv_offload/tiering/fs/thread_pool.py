# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Thread pool:
Two queues (load, store) and two sets of threads:
- Load-priority threads: drain the load queue first, then the store queue.
- Store-priority threads: drain the store queue first, then the load queue.
Load jobs are enqueued to the load queue; store jobs to the store queue.
"""

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from vllm.logger import init_logger
from vllm.v1.kv_offload.tiering.base import JobId
from vllm.v1.kv_offload.tiering.fs.budget import BudgetRejection

logger = init_logger(__name__)

# A tier whose every job fails (a full or read-only disk) reports at most one
# line per interval, with the counts since its previous line.
FAILURE_REPORT_INTERVAL_S = 30.0


class _FailureReport:
    """Thread-safe, rate-limited report of failed jobs: the first failure is
    logged at once, later ones at most once per FAILURE_REPORT_INTERVAL_S."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._lock = threading.Lock()
        self._failed = {"store": 0, "load": 0}
        # blocks that failed their MAC (damaged or planted files)
        self._integrity = 0
        # evicted files (max_bytes) that could not be removed
        self._removals = 0
        self._last_error: Exception | str | None = None
        self._next_report = float("-inf")

    def record(self, kind: str, error: Exception) -> None:
        with self._lock:
            self._failed[kind] += 1
            self._integrity += len(getattr(error, "integrity_failed", ()))
            self._last_error = error
            line = self._take_line(force=False)
        if line is not None:
            logger.error(*line)

    def record_removals(self, failed: int, error: str) -> None:
        """Evicted block files (max_bytes) that could not be removed: they
        stay on disk beyond the budget until removed by hand."""
        with self._lock:
            self._removals += failed
            self._last_error = error
            line = self._take_line(force=False)
        if line is not None:
            logger.error(*line)

    def flush(self, force: bool = False) -> None:
        """Log the failures not reported yet: once the interval has passed
        (polled), or now (force, at shutdown)."""
        if not (self._failed["store"] or self._failed["load"] or self._removals):
            return
        with self._lock:
            line = self._take_line(force)
        if line is not None:
            logger.error(*line)

    def _take_line(self, force: bool) -> tuple | None:
        now = time.monotonic()
        if not (self._failed["store"] or self._failed["load"] or self._removals) or (
            not force and now < self._next_report
        ):
            return None
        self._next_report = now + FAILURE_REPORT_INTERVAL_S
        integrity = (
            f"; {self._integrity} block(s) failed the integrity check (damaged "
            "or planted files)"
            if self._integrity
            else ""
        )
        removals = (
            f"; {self._removals} evicted block file(s) could not be removed "
            "(they take disk space beyond max_bytes)"
            if self._removals
            else ""
        )
        line = (
            (
                "%s: %d store job(s) and %d load job(s) failed since the previous "
                "report (the blocks of failed stores are not stored, those that "
                "failed to load are recomputed)%s%s; last error: %s"
            ),
            self._label,
            self._failed["store"],
            self._failed["load"],
            integrity,
            removals,
            self._last_error,
        )
        self._failed = {"store": 0, "load": 0}
        self._integrity = 0
        self._removals = 0
        return line


class JobState:
    """Thread-safe completion tracker for a set of per-block I/O tasks.

    Each task calls task_done(success) when it finishes.
    """

    __slots__ = (
        "_job_id",
        "_n_tasks",
        "_completed",
        "_success",
        "_transfer_time",
        "_lock",
        "kind",
    )

    def __init__(self, job_id: JobId, n_tasks: int, kind: str) -> None:
        self._job_id: JobId = job_id
        self.kind = kind  # "load" or "store"
        self._n_tasks = n_tasks
        self._completed = 0
        self._success = True
        self._transfer_time = 0.0
        self._lock = threading.Lock()

    @property
    def job_id(self) -> JobId:
        return self._job_id

    def task_done(
        self, success: bool, transfer_time: float
    ) -> tuple[bool, bool, float]:
        """Returns if job completed and success flag."""
        with self._lock:
            self._completed += 1
            self._transfer_time += transfer_time
            if not success:
                self._success = False
            return self._completed == self._n_tasks, self._success, self._transfer_time


class DualQueueThreadPool:
    """Thread pool with two task queues (load and store) and two thread groups.

    Load-priority threads drain the load queue first, then fall back to the
    store queue.  Store-priority threads do the reverse.  Both queues share
    a single condition variable.
    """

    def __init__(
        self,
        n_read_threads: int,
        n_write_threads: int,
        thread_name_prefix: str = "fs_secondary_tier",
        label: str = "fs_secondary_tier",
    ) -> None:
        self._load_q: deque = deque()
        self._store_q: deque = deque()
        self._condition = threading.Condition(threading.Lock())
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._finished_q: deque[tuple[JobId, bool, float]] = deque()
        self._inflight_jobs = 0  # guarded by _condition
        self._failures = _FailureReport(label)

        for i in range(n_read_threads):
            t = threading.Thread(
                target=self._worker,
                args=(True,),
                name=f"{thread_name_prefix}_l{i}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)

        for i in range(n_write_threads):
            t = threading.Thread(
                target=self._worker,
                args=(False,),
                name=f"{thread_name_prefix}_s{i}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)

    def enqueue_load(
        self,
        job_id: JobId,
        n_tasks: int,
        tasks: Iterable[Callable],
    ) -> None:
        """Enqueue load tasks for a job (high-priority for load-priority threads)."""
        state = JobState(job_id, n_tasks, "load")
        with self._condition:
            self._inflight_jobs += 1
            for fn in tasks:
                self._load_q.append((fn, state))
            self._condition.notify(n_tasks)

    def enqueue_store(
        self,
        job_id: JobId,
        n_tasks: int,
        tasks: Iterable[Callable],
    ) -> None:
        """Enqueue store tasks for a job (high-priority for store-priority threads)."""
        state = JobState(job_id, n_tasks, "store")
        with self._condition:
            self._inflight_jobs += 1
            for fn in tasks:
                self._store_q.append((fn, state))
            self._condition.notify(n_tasks)

    def get_finished(self) -> list[tuple[JobId, bool, float]]:
        # No lock needed: deque is thread-safe for concurrent append/popleft,
        # and the manager is the sole popper.
        self._failures.flush()
        jobs = []
        while self._finished_q:
            jobs.append(self._finished_q.popleft())
        return jobs

    def record_removal_errors(self, failed: int, error: str) -> None:
        """Evicted files that could not be removed, in the rate-limited
        failure report."""
        self._failures.record_removals(failed, error)

    def wait_idle(self) -> None:
        """Block until there are no in-flight jobs.

        After this returns, every submitted job has had its last task
        finish, so no worker thread is still copying data. Note:
        completed jobs may still be sitting in ``_finished_q`` waiting
        for ``get_finished()`` to drain them.
        """
        with self._condition:
            self._condition.wait_for(lambda: self._inflight_jobs == 0)

    def shutdown(self, wait: bool = True) -> None:
        with self._condition:
            self._stop = True
            self._load_q.clear()
            self._store_q.clear()
            # Cancelled tasks will not decrement _inflight_jobs; reset it so a
            # subsequent wait_idle() returns instead of hanging.
            self._inflight_jobs = 0
            self._condition.notify_all()
        if wait:
            for t in self._threads:
                t.join()
        self._failures.flush(force=True)

    def _worker(self, load_priority: bool) -> None:
        # Wait for tasks, process from primary queue first, fall back to secondary.
        while True:
            with self._condition:
                self._condition.wait_for(
                    lambda: self._stop or self._load_q or self._store_q
                )
                if self._stop:
                    return
                primary = self._load_q if load_priority else self._store_q
                secondary = self._store_q if load_priority else self._load_q
                task, state = primary.popleft() if primary else secondary.popleft()
            try:
                start_time = time.monotonic()
                task()
                transfer_time = time.monotonic() - start_time
                job_finished, success, total_time = state.task_done(True, transfer_time)
            except Exception as exc:
                transfer_time = time.monotonic() - start_time
                logger.debug("Job %s block I/O failed: %s", state.job_id, exc)
                if not isinstance(exc, BudgetRejection):
                    # a refusal is reported by the budget, not as failed I/O
                    self._failures.record(state.kind, exc)
                job_finished, success, total_time = state.task_done(
                    False, transfer_time
                )

            if job_finished:
                with self._condition:
                    self._finished_q.append((state.job_id, success, total_time))
                    self._inflight_jobs -= 1
                    self._condition.notify_all()
