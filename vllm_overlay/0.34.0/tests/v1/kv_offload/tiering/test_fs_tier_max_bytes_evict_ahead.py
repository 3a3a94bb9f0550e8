# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fs tier's max_bytes budget evicts ahead of stores: past 95% of
max_bytes down to 90%, its files removed off the stores' path. Real fs
tiers, real files."""

import contextlib
import os
import threading
import time

from tests.v1.kv_offload.tiering.test_fs_tier import (
    _CTX,
    _page_aligned_zero_tensor,
    lookup_and_wait,
)
from tests.v1.kv_offload.tiering.test_fs_tier_max_bytes import (
    block_key,
    make_tier,
    page,
    store,
)
from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool


def disk_bytes(root_dir) -> int:
    """The block files' bytes, while files may be being removed."""
    total = 0
    for d, _, files in os.walk(root_dir):
        for f in files:
            if f.endswith((".bin", ".tmp")):
                with contextlib.suppress(FileNotFoundError):
                    total += os.path.getsize(os.path.join(d, f))
    return total


def test_stores_at_a_full_budget_remove_no_file_in_their_own_task(
    tmp_path, monkeypatch
):
    """100 stores of one key each over a budget of 40 files: past 95% of
    max_bytes the tier evicts down to 90%, never below, and no store's task
    removes a file (each store finds room)."""
    rows = _page_aligned_zero_tensor(4, 1024)
    tier = make_tier(tmp_path, rows, max_bytes=40 * page)
    budget = tier._budget
    assert budget is not None
    high, low = 38 * page, 36 * page  # 95% and 90%
    in_store = threading.local()
    by_stores: list[str] = []
    ahead: list[str] = []
    enqueue_store, remove = DualQueueThreadPool.enqueue_store, os.remove

    def flagged(task):
        def store_task(*args, **kwargs):
            in_store.on = True
            try:
                return task(*args, **kwargs)
            finally:
                in_store.on = False

        return store_task

    def flagging_enqueue_store(self, job_id, n_tasks, tasks, *args, **kwargs):
        tasks = [flagged(task) for task in tasks]
        return enqueue_store(self, job_id, n_tasks, tasks, *args, **kwargs)

    def recording_remove(path, *args, **kwargs):
        if str(path).endswith(".bin"):
            (by_stores if getattr(in_store, "on", False) else ahead).append(path)
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(DualQueueThreadPool, "enqueue_store", flagging_enqueue_store)
    monkeypatch.setattr(os, "remove", recording_remove)
    try:
        for n in range(100):
            assert store(tier, [block_key(n)], n, rows)[0].success
            assert not by_stores, f"store {n}'s task removed {len(by_stores)} file(s)"
            if n == 0:  # a cached verdict, and no promotion in its step
                assert lookup_and_wait(tier, [block_key(0)]) == [LookupResult.HIT]
                tier.on_schedule_end(ScheduleEndContext((), ()))
            # at rest (if it gets there): under 95%, the files evicted ahead gone
            deadline = time.monotonic() + 5
            while budget.used > high or getattr(budget, "unlinking", 0):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            if n >= 40:
                assert low <= budget.used <= high
        assert disk_bytes(tmp_path) <= high
        assert len(ahead) >= 100 - 38
        # key 0 was evicted ahead: its cached verdict is a miss
        tier.on_schedule_end(ScheduleEndContext((), ()))
        assert tier.lookup(block_key(0), _CTX) is LookupResult.MISS
    finally:
        tier.shutdown()
