#!/usr/bin/env python3
"""tier-disk-budget's admission when every indexed chunk is pinned: does it grow linearly?

A store job of K keys meets a budget full of chunks with stores in flight (pinned): every key
is refused. Before session 36's fix each refused key walked the index again, O(K * (K + P)).
This times FsTierBudget.admit_store (the scheduler thread's work) for K = 1000, 2000, 4000
and prints each time and the ratio t(4000) / t(1000): about 4 when linear, 16 when quadratic.
No files, no threads: the core's in-memory admission alone.

Runs on the PR unit's branch (its budget API is the core's, not the series'):

    VLLM_VERSION=0.34.0 make pr PR_ARGS=tier-disk-budget
    PYTHONPATH=build/pr/0.34.0/tier-disk-budget/site .venv-0.34.0/bin/python \\
        bench/core_admission.py
"""

import time

from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.tiering.fs.budget import FsTierBudget

FILE_BYTES = 4096
SIZES = (1000, 2000, 4000)
REPEATS = 5  # the best of these: the least disturbed by other jobs


def key(n: int):
    return make_offload_key(f"admission-{n}".encode().ljust(32, b"\0"), 0)


def refused_job_seconds(k: int) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        budget = FsTierBudget(k * FILE_BYTES, FILE_BYTES, "bench")
        budget.admit_store([key(n) for n in range(k)])  # fills it; in flight: pinned
        keys = [key(n) for n in range(k, 2 * k)]
        start = time.perf_counter()
        job = budget.admit_store(keys)
        best = min(best, time.perf_counter() - start)
        if job.rejected != k:
            raise SystemExit(f"expected {k} refused keys, got {job.rejected}")
    return best


def main() -> None:
    times = {k: refused_job_seconds(k) for k in SIZES}
    for k, t in times.items():
        print(f"K={k}: {t * 1e3:.2f} ms, {t / k * 1e6:.2f} us per key")
    print(f"ratio t({SIZES[-1]}) / t({SIZES[0]}) = {times[SIZES[-1]] / times[SIZES[0]]:.1f} "
          f"(linear: {SIZES[-1] / SIZES[0]:.0f})")


if __name__ == "__main__":
    main()
