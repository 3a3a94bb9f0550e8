# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fs tier's max_bytes budget over the files of earlier runs: at start
they are indexed in the order of their mtimes and trimmed to max_bytes,
oldest first. Real fs tiers, real files."""

import contextlib
import os
import time

from tests.v1.kv_offload.tiering.test_fs_tier import (
    _page_aligned_zero_tensor,
    drain,
    lookup_and_wait,
    make_job,
)
from tests.v1.kv_offload.tiering.test_fs_tier_max_bytes import (
    block_key,
    make_tier,
    on_disk,
    page,
    store,
)
from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext


def set_mtime(tier, key, seconds_ago: int) -> None:
    t = time.time_ns() - seconds_ago * 10**9
    os.utime(tier.file_mapper.get_file_name(key), ns=(t, t))


def disk_bytes(root_dir) -> int:
    """The block files' bytes, while files are being removed."""
    total = 0
    for d, _, files in os.walk(root_dir):
        for f in files:
            if f.endswith((".bin", ".tmp")):
                with contextlib.suppress(FileNotFoundError):
                    total += os.path.getsize(os.path.join(d, f))
    return total


def wait_trimmed(tier, root_dir, max_bytes: int) -> None:
    """The tier's own calls (each engine step's) until its files fit."""
    deadline = time.monotonic() + 10
    while disk_bytes(root_dir) > max_bytes:
        assert time.monotonic() < deadline, (
            f"{disk_bytes(root_dir)} bytes of earlier runs' files on disk, "
            f"not trimmed to max_bytes={max_bytes}"
        )
        list(tier.get_finished_jobs())
        time.sleep(0.01)


def test_a_restart_trims_the_files_of_earlier_runs_oldest_first(tmp_path):
    """Six files of an unbounded earlier run, of mtimes in store order: a
    restart with room for three keeps the newest three, indexed (counted,
    and the oldest of them is the next evicted)."""
    rows = _page_aligned_zero_tensor(4, 1024)
    keys = [block_key(100 + i) for i in range(6)]
    tier = make_tier(tmp_path, rows)
    try:
        for i, key in enumerate(keys):
            assert store(tier, [key], 10 * i, rows)[0].success
            set_mtime(tier, key, 60 - 10 * i)
    finally:
        tier.shutdown()
    max_bytes = 3 * page + page // 2  # three files (under 95%)
    tier = make_tier(tmp_path, rows, max_bytes=max_bytes)
    try:
        wait_trimmed(tier, tmp_path, max_bytes)
        assert on_disk(tier, keys) == [False] * 3 + [True] * 3
        assert tier._budget is not None
        assert tier._budget.used == 3 * page
        new = block_key(200)
        assert store(tier, [new], 90, rows)[0].success
        assert on_disk(tier, keys[3:] + [new]) == [False, True, True, True]
        assert disk_bytes(tmp_path) == 3 * page
    finally:
        tier.shutdown()


def test_a_promoted_chunk_outlives_a_newer_one_through_a_restart(tmp_path):
    """Key a stored before key b, then a looked up and promoted: its mtime
    keeps that, and a restart with room for one file keeps a, not b."""
    rows = _page_aligned_zero_tensor(4, 1024)
    a, b = block_key(300), block_key(301)
    tier = make_tier(tmp_path, rows, max_bytes=4 * page)
    try:
        assert store(tier, [a], 0, rows)[0].success
        assert store(tier, [b], 10, rows)[0].success
        set_mtime(tier, a, 20)
        set_mtime(tier, b, 10)
        assert lookup_and_wait(tier, [a]) == [LookupResult.HIT]
        tier.submit_load(make_job(1, [a], [3], is_promotion=True))
        tier.on_schedule_end(ScheduleEndContext((), ()))
        assert all(r.success for r in drain(tier))
    finally:
        tier.shutdown()
    max_bytes = page + page // 2
    tier = make_tier(tmp_path, rows, max_bytes=max_bytes)
    try:
        wait_trimmed(tier, tmp_path, max_bytes)
        assert on_disk(tier, [a, b]) == [True, False]
    finally:
        tier.shutdown()
