# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
Thread pool:
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
from vllm.v1.kv_offload.tiering.fs.io import BlockIntegrityError

logger = init_logger(__name__)

# A failing tier reports at most one line per interval, with the counts since
# its previous line: a disk that fills up after an hour is as visible as one
# that fails at start, and a tier failing every block does not flood the log.
FAILURE_REPORT_INTERVAL_S = 30.0


class FailureReport:
    """Rate-limited, thread-safe report of failed block I/O.

    The first failure is logged at once; later ones at most once per
    FAILURE_REPORT_INTERVAL_S, each line with the block writes and reads that
    failed since the previous line and the last error. Counts not reported
    yet are logged by flush_if_due() (polled from the scheduler) once the
    interval has passed, and by flush() at shutdown.
    """

    def __init__(self, label: str) -> None:
        self._label = label
        self._lock = threading.Lock()
        self._jobs = 0
        self._failed = {"write": 0, "read": 0}
        self._blocks = {"write": 0, "read": 0}
        # reads that failed their checksum or MAC (damaged or planted files)
        self._integrity = 0
        # evicted files (max_bytes) that could not be removed
        self._removals = 0
        self._last_error: str | None = None
        self._next_report = 0.0

    def record(
        self,
        op: str,
        failed: int,
        blocks: int,
        error: str | None,
        integrity: int = 0,
    ) -> None:
        """op is "write" (a store) or "read" (a load) of a job's blocks;
        *integrity* of the *failed* failed their checksum or MAC."""
        with self._lock:
            self._jobs += 1
            self._failed[op] += failed
            self._blocks[op] += blocks
            self._integrity += integrity
            self._last_error = error
            line = self._take_line_if_due()
        if line is not None:
            logger.error(*line)

    def record_removals(self, failed: int, error: str) -> None:
        """Evicted block files (max_bytes) that could not be removed: they
        stay on disk beyond the budget until removed by hand."""
        with self._lock:
            self._jobs += 1
            self._removals += failed
            self._last_error = error
            line = self._take_line_if_due()
        if line is not None:
            logger.error(*line)

    def flush_if_due(self) -> None:
        with self._lock:
            line = self._take_line_if_due() if self._jobs else None
        if line is not None:
            logger.error(*line)

    def flush(self) -> None:
        with self._lock:
            line = self._take_line() if self._jobs else None
        if line is not None:
            logger.error(*line)

    def _take_line_if_due(self) -> tuple | None:
        now = time.monotonic()
        if now < self._next_report:
            return None
        self._next_report = now + FAILURE_REPORT_INTERVAL_S
        return self._take_line()

    def _take_line(self) -> tuple:
        integrity = (
            f" ({self._integrity} of them failed the integrity check: damaged "
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
            "%s: %d of %d block writes and %d of %d block reads%s failed in %d "
            "job(s) since the previous report; failed writes are not stored "
            "and failed reads are not served (recomputed instead)%s. Last "
            "error: %s",
            self._label,
            self._failed["write"],
            self._blocks["write"],
            self._failed["read"],
            self._blocks["read"],
            integrity,
            self._jobs,
            removals,
            self._last_error,
        )
        self._jobs = 0
        self._integrity = 0
        self._removals = 0
        self._failed = {"write": 0, "read": 0}
        self._blocks = {"write": 0, "read": 0}
        return line


class JobState:
    """
    Thread-safe completion tracker for a set of per-block I/O tasks.

    Each task calls task_done(success) when it finishes.
    """

    __slots__ = (
        "_job_id",
        "_n_tasks",
        "_completed",
        "failed",
        "first_error",
        "integrity_failures",
        "rejected",
        "op",
        "_lock",
    )

    def __init__(self, job_id: JobId, n_tasks: int, op: str) -> None:
        self._job_id: JobId = job_id
        # "read" (load) or "write" (store), for failure reports
        self.op = op
        self._n_tasks = n_tasks
        self._completed = 0
        # indices (in submission order) of the tasks that failed
        self.failed: list[int] = []
        # kept as text: an exception's traceback would pin the I/O buffers
        self.first_error: str | None = None
        # failed tasks whose block failed its checksum or MAC
        self.integrity_failures = 0
        # failed tasks the budget refused (no room): not failed I/O
        self.rejected = 0
        self._lock = threading.Lock()

    @property
    def job_id(self) -> JobId:
        return self._job_id

    @property
    def n_tasks(self) -> int:
        return self._n_tasks

    def task_done(self, task_idx: int, error: Exception | None = None) -> bool:
        """Record a task's outcome. Returns whether the job completed."""
        with self._lock:
            self._completed += 1
            if error is not None:
                self.failed.append(task_idx)
                if isinstance(error, BudgetRejection):
                    self.rejected += 1  # reported by the budget
                    return self._completed == self._n_tasks
                if isinstance(error, BlockIntegrityError):
                    self.integrity_failures += 1
                if self.first_error is None:
                    self.first_error = str(error)
            return self._completed == self._n_tasks


class DualQueueThreadPool:
    """
    Thread pool with two task queues (load and store) and two thread groups.

    Load-priority threads drain the load queue first, then fall back to the
    store queue.  Store-priority threads do the reverse.  Both queues share
    a single condition variable.
    """

    def __init__(
        self,
        n_read_threads: int,
        n_write_threads: int,
        thread_name_prefix: str = "fs_secondary_tier",
        label: str = "FileSystemTierManagerPython",
    ) -> None:
        self._load_q: deque = deque()
        self._store_q: deque = deque()
        self._condition = threading.Condition(threading.Lock())
        self._stop = False
        self._threads: list[threading.Thread] = []
        # (job_id, indices of the failed tasks)
        self._finished_q: deque[tuple[JobId, list[int]]] = deque()
        self._failures = FailureReport(label)

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
        self._enqueue(self._load_q, job_id, n_tasks, tasks)

    def enqueue_store(
        self,
        job_id: JobId,
        n_tasks: int,
        tasks: Iterable[Callable],
    ) -> None:
        """Enqueue store tasks for a job (high-priority for store-priority threads)."""
        self._enqueue(self._store_q, job_id, n_tasks, tasks)

    def _enqueue(
        self,
        queue: deque,
        job_id: JobId,
        n_tasks: int,
        tasks: Iterable[Callable],
    ) -> None:
        if n_tasks == 0:  # nothing to wait for: the job is done
            self._finished_q.append((job_id, []))
            return
        state = JobState(job_id, n_tasks, "read" if queue is self._load_q else "write")
        with self._condition:
            for task_idx, fn in enumerate(tasks):
                queue.append((fn, state, task_idx))
            self._condition.notify(n_tasks)

    def record_removal_errors(self, failed: int, error: str) -> None:
        """Evicted files that could not be removed, in the rate-limited
        failure report."""
        self._failures.record_removals(failed, error)

    def get_finished(self) -> list[tuple[JobId, list[int]]]:
        """Finished jobs, each with the indices of its failed tasks."""
        self._failures.flush_if_due()
        jobs = []
        while self._finished_q:
            jobs.append(self._finished_q.popleft())
        return jobs

    def shutdown(self, wait: bool = True) -> None:
        with self._condition:
            self._stop = True
            self._load_q.clear()
            self._store_q.clear()
            self._condition.notify_all()
        if wait:
            for t in self._threads:
                t.join()
        self._failures.flush()

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
                task, state, task_idx = (
                    primary.popleft() if primary else secondary.popleft()
                )
            try:
                task()
                job_finished = state.task_done(task_idx)
            except Exception as exc:
                job_finished = state.task_done(task_idx, exc)

            if job_finished:
                failed = len(state.failed) - state.rejected
                if failed:
                    self._failures.record(
                        state.op,
                        failed,
                        state.n_tasks,
                        state.first_error,
                        state.integrity_failures,
                    )
                self._finished_q.append((state.job_id, state.failed))
