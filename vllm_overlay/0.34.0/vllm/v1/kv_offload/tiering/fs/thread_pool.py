# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Thread pool:
Two queues (load, store) and two sets of threads:
- Load-priority threads: drain the load queue first, then the store queue.
- Store-priority threads: drain the store queue first, then the load queue.
Load jobs are enqueued to the load queue; store jobs to the store queue.

A job's outcome travels with it: each task's return value or exception is
kept in its JobState (under the state's lock) and handed back, with the
record the tier enqueued the job with, through the finished queue (under
the pool's condition), so that what a job's tasks found needs no other
hand-over between the I/O threads and the thread that collects jobs.
"""

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from vllm.logger import init_logger
from vllm.v1.kv_offload.tiering.base import JobId
from vllm.v1.kv_offload.tiering.fs.budget import BudgetRejection
from vllm.v1.kv_offload.tiering.fs.io import BlockIntegrityError
from vllm.v1.kv_offload.tiering.fs.report import Throttle

logger = init_logger(__name__)


class FailureReport:
    """Rate-limited, thread-safe report of failed block I/O.

    The first failure is logged at once; later ones at most once per
    REPORT_INTERVAL_S (report.Throttle), each line with the store and load
    jobs that failed since the previous line, their blocks not stored or
    loaded, the evicted files that could not be removed, and the last error.
    Counts not reported yet are logged by flush() (polled from the
    scheduler) once the interval has passed, and at shutdown (force).
    """

    def __init__(self, label: str) -> None:
        self._label = label
        self._lock = threading.Lock()
        self._jobs = {"store": 0, "load": 0}  # failed jobs
        self._blocks = {"store": 0, "load": 0}  # their blocks not stored/loaded
        # reads that failed their checksum or MAC (damaged or planted files)
        self._integrity = 0
        # evicted files (max_bytes) that could not be removed
        self._removals = 0
        self._last_error: str | None = None
        self._throttle = Throttle()

    def record(self, kind: str, blocks: int, error: str, integrity: int = 0) -> None:
        """A failed job of *kind* ("store" or "load"): *blocks* of its blocks
        were not stored or loaded, *integrity* of them failed their checksum
        or MAC."""
        with self._lock:
            self._jobs[kind] += 1
            self._blocks[kind] += blocks
            self._integrity += integrity
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
        with self._lock:
            line = self._take_line(force)
        if line is not None:
            logger.error(*line)

    def _take_line(self, force: bool) -> tuple | None:
        jobs, blocks = self._jobs, self._blocks
        if not (jobs["store"] or jobs["load"] or self._removals):
            return None
        if not self._throttle.due(force):
            return None
        parts = []
        if jobs["store"] or jobs["load"]:
            integrity = (
                f" ({self._integrity} of them failed the integrity check: "
                "damaged or planted files)"
                if self._integrity
                else ""
            )
            parts.append(
                f"{jobs['store']} store job(s) and {jobs['load']} load job(s) "
                f"failed: {blocks['store']} block(s) not stored, "
                f"{blocks['load']} not loaded and recomputed{integrity}"
            )
        if self._removals:
            parts.append(
                f"{self._removals} evicted block file(s) could not be removed "
                "(they take disk space beyond max_bytes)"
            )
        line = (
            "%s: %s since the previous report. Last error: %s",
            self._label,
            "; ".join(parts),
            self._last_error,
        )
        self._jobs = {"store": 0, "load": 0}
        self._blocks = {"store": 0, "load": 0}
        self._integrity = self._removals = 0
        return line


class FinishedJob(NamedTuple):
    """A job whose every task has run, as get_finished() hands it back."""

    job_id: JobId
    # what the tier enqueued the job with (its own record of the job)
    record: Any
    # per task, in submission order: its return value, or the exception it
    # raised (without its traceback, which would pin the I/O buffers)
    outcomes: list[Any]
    # seconds the job's tasks ran, summed
    transfer_time: float

    @property
    def failed(self) -> list[int]:
        """Indices of the tasks that raised."""
        return [i for i, o in enumerate(self.outcomes) if isinstance(o, Exception)]


class JobState:
    """Thread-safe completion tracker for a job's I/O tasks: each task calls
    task_done() with its outcome when it finishes."""

    __slots__ = (
        "job_id",
        "kind",
        "record",
        "blocks",
        "_outcomes",
        "_pending",
        "_transfer_time",
        "_lock",
    )

    def __init__(
        self, job_id: JobId, n_tasks: int, kind: str, record: Any, blocks: int
    ) -> None:
        self.job_id = job_id
        self.kind = kind  # "load" or "store"
        self.record = record
        self.blocks = blocks
        self._outcomes: list[Any] = [None] * n_tasks
        self._pending = n_tasks
        self._transfer_time = 0.0
        self._lock = threading.Lock()

    def task_done(
        self, task_idx: int, outcome: Any, transfer_time: float
    ) -> FinishedJob | None:
        """Record a task's outcome; the finished job once it was the last."""
        with self._lock:
            self._outcomes[task_idx] = outcome
            self._transfer_time += transfer_time
            self._pending -= 1
            if self._pending:
                return None
            return FinishedJob(
                self.job_id, self.record, self._outcomes, self._transfer_time
            )


def _failed_blocks(job: FinishedJob, blocks: int) -> tuple[int, int, str | None]:
    """The blocks of *job* not stored or loaded (those its failed tasks name
    in ``failed_indices``, else all of a failed task's), those that failed
    an integrity check, and the first error. A budget refusal is not a
    failure: the budget reports it."""
    per_task = blocks / max(1, len(job.outcomes))
    failed = integrity = 0.0
    error = None
    for outcome in job.outcomes:
        if not isinstance(outcome, Exception) or isinstance(outcome, BudgetRejection):
            continue
        indices = getattr(outcome, "failed_indices", None)
        failed += per_task if indices is None else len(indices)
        integrity += len(getattr(outcome, "integrity_failed", ())) or (
            per_task if isinstance(outcome, BlockIntegrityError) else 0
        )
        error = error or str(outcome)
    return round(failed), round(integrity), error


class DualQueueThreadPool:
    """Thread pool with two task queues (load and store) and two thread groups.

    Load-priority threads drain the load queue first, then fall back to the
    store queue.  Store-priority threads do the reverse.  Both queues, the
    finished queue and the in-flight count share a single condition variable.
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
        self._finished_q: deque[FinishedJob] = deque()
        self._inflight_jobs = 0  # guarded by _condition
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
        record: Any = None,
        blocks: int | None = None,
    ) -> None:
        """Enqueue load tasks for a job (high-priority for load-priority
        threads); *record* comes back with the finished job, and *blocks*
        (default: one a task) counts its blocks in failure reports."""
        self._enqueue("load", job_id, n_tasks, tasks, record, blocks)

    def enqueue_store(
        self,
        job_id: JobId,
        n_tasks: int,
        tasks: Iterable[Callable],
        record: Any = None,
        blocks: int | None = None,
    ) -> None:
        """Enqueue store tasks for a job (high-priority for store-priority
        threads); see enqueue_load()."""
        self._enqueue("store", job_id, n_tasks, tasks, record, blocks)

    def _enqueue(
        self,
        kind: str,
        job_id: JobId,
        n_tasks: int,
        tasks: Iterable[Callable],
        record: Any,
        blocks: int | None,
    ) -> None:
        task_list = list(tasks)
        if len(task_list) != n_tasks:
            raise ValueError(f"job {job_id}: {len(task_list)} tasks, not {n_tasks}")
        queue = self._load_q if kind == "load" else self._store_q
        state = JobState(
            job_id, n_tasks, kind, record, n_tasks if blocks is None else blocks
        )
        with self._condition:
            if n_tasks == 0:  # nothing to wait for: the job is done
                self._finished_q.append(FinishedJob(job_id, record, [], 0.0))
                return
            self._inflight_jobs += 1
            for task_idx, fn in enumerate(task_list):
                queue.append((fn, state, task_idx))
            self._condition.notify(n_tasks)

    def get_finished(self) -> list[FinishedJob]:
        """The jobs finished since the previous call."""
        self._failures.flush()
        with self._condition:
            jobs = list(self._finished_q)
            self._finished_q.clear()
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
                task, state, task_idx = (
                    primary.popleft() if primary else secondary.popleft()
                )
            self._run(task, state, task_idx)
            del task, state  # an idle worker pins no job

    def _run(self, task: Callable, state: JobState, task_idx: int) -> None:
        """Run a task and record its outcome; the job's last task reports
        its failures and hands the job back."""
        start_time = time.monotonic()
        try:
            outcome = task()
        except Exception as exc:
            logger.debug("Job %s block I/O failed: %s", state.job_id, exc)
            outcome = exc.with_traceback(None)
            outcome.__context__ = outcome.__cause__ = None
        job = state.task_done(task_idx, outcome, time.monotonic() - start_time)
        if job is None:
            return
        try:
            failed, integrity, error = _failed_blocks(job, state.blocks)
            if failed:
                self._failures.record(state.kind, failed, error or "", integrity)
        except Exception:  # a report must not cost the pool a thread
            logger.exception("Job %s: its failure report failed", state.job_id)
        with self._condition:
            self._finished_q.append(job)
            self._inflight_jobs -= 1
            self._condition.notify_all()
