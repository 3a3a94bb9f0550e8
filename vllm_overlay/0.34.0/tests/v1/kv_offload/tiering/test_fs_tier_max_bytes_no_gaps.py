# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fs tier's max_bytes budget writes no block past a gap: a key whose
predecessor in its prompt (for a sliding-window key: the full-attention
chunk covering it) is on no disk could never hit. Real fs tiers, real
files."""

import dataclasses

import numpy as np
import pytest

from tests.v1.kv_offload.tiering.test_fs_tier import (
    _make_offloading_spec,
    _page_aligned_zero_tensor,
    drain,
    lookup_and_wait,
)
from tests.v1.kv_offload.tiering.test_fs_tier_max_bytes import on_disk, page
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import OffloadingGroupConfig
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager


@pytest.fixture
def rows():
    return _page_aligned_zero_tensor(8, 1024)


def make_tier(root_dir, rows, group_tokens=(16,), windows=(), **config):
    """Groups of group_tokens tokens a chunk: full attention, or sliding
    window where windows[g] is not None."""
    spec = _make_offloading_spec()
    groups = tuple(
        OffloadingGroupConfig(
            tokens_per_block=tokens,
            layer_names=(f"l{g}",),
            group_id=g,
            sliding_window_size_in_chunks=windows[g] if windows else None,
        )
        for g, tokens in enumerate(group_tokens)
    )
    spec.config = dataclasses.replace(spec.config, groups=groups)
    view = memoryview(rows.numpy())
    return FileSystemTierManager(spec, view, "fs", str(root_dir), 2, 2, **config)


def prompt(name: str, n: int, group: int = 0) -> list[OffloadKey]:
    """Keys of n chunks of 16 tokens (the i-th ends at token 16 * (i + 1))."""
    return [make_offload_key(f"{name}{i}".encode().ljust(32), group) for i in range(n)]


def request(req_id: str, keys: list[OffloadKey]) -> ReqContext:
    """A request whose keys the scheduler recorded, 16 tokens a chunk."""
    ctx = ReqContext(req_id)
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, 16 * (i + 1))
    return ctx


def store(tier, ctx: ReqContext, keys, job_id: int) -> list[bool]:
    job = TransferJob(job_id, keys, np.arange(len(keys)), False, ctx)
    tier.submit_store(job)
    return [r.success for r in drain(tier)]


def test_a_key_whose_predecessor_was_never_stored_is_not_written(tmp_path, rows):
    """A store of a prompt's chunks 2 and 3 (its head stored by no one
    here): neither is written, the job succeeds and both stay misses. A
    job listing keys out of order writes each after the one before it."""
    tier = make_tier(tmp_path, rows, max_bytes=8 * page)
    keys = prompt("a", 6)
    ctx = request("a", keys)
    try:
        assert store(tier, ctx, keys[2:4], 0) == [True]
        assert on_disk(tier, keys[2:4]) == [False, False]
        assert tier._budget.unreachable_files == 2
        assert lookup_and_wait(tier, keys[2:4], ctx) == [LookupResult.MISS] * 2
        assert store(tier, ctx, keys[::-1], 1) == [True]
        assert on_disk(tier, keys) == [True] * 6
    finally:
        tier.shutdown()


def test_a_key_whose_predecessor_was_evicted_is_not_written(tmp_path, rows):
    """A prompt's second chunk is evicted (its head was hit since): a
    store of its third chunk writes nothing, evicting nothing for it."""
    tier = make_tier(tmp_path, rows, max_bytes=3 * page)
    a, b, c = prompt("a", 3), prompt("b", 1), prompt("c", 1)
    ctx = request("a", a)
    try:
        assert store(tier, ctx, a[:2], 0) == [True]
        assert store(tier, request("b", b), b, 1) == [True]
        assert lookup_and_wait(tier, a[:1], ctx) == [LookupResult.HIT]
        tier.on_schedule_end(ScheduleEndContext((), ()))  # no promotion
        assert store(tier, request("c", c), c, 2) == [True]
        assert on_disk(tier, a[:2]) == [True, False]  # a[1] evicted
        assert store(tier, ctx, a[2:], 3) == [True]
        assert on_disk(tier, a + b + c) == [True, False, False, True, True]
        assert tier._budget.unreachable_files == 1
    finally:
        tier.shutdown()


def test_a_sliding_window_file_is_written_only_with_its_covering_chunk(tmp_path, rows):
    """A full-attention group and a sliding-window group, 16 tokens a
    chunk: a store of sliding-window keys alone (the connector stores them
    apart when the CPU tier holds the chunk's other files) writes none
    whose full-attention chunk is on no disk. Once it is, it is written."""
    tier = make_tier(
        tmp_path, rows, group_tokens=(16, 16), windows=(None, 1), max_bytes=16 * page
    )
    full, window = prompt("p", 4, 0), prompt("p", 4, 1)
    ctx = request("req", full)
    for i, key in enumerate(window):
        ctx.set_offload_key_position(key, 16 * (i + 1))
    try:
        assert store(tier, ctx, full[:2] + window[:2], 0) == [True]
        # chunks 2 and 3: their full-attention files were not stored
        assert store(tier, ctx, window[2:], 1) == [True]
        assert on_disk(tier, full[:2] + window) == [True] * 4 + [False] * 2
        assert tier._budget.unreachable_files == 2
        assert store(tier, ctx, full[2:3], 2) == [True]
        assert store(tier, ctx, window[2:3], 3) == [True]
        assert on_disk(tier, [full[2], window[2], window[3]]) == [True, True, False]
    finally:
        tier.shutdown()


def test_the_requests_positions_kept_are_bounded(tmp_path, rows, monkeypatch):
    """The requests' keys kept for the gap check are bounded
    (MAX_TRACKED_KEYS, the least recently seen requests dropped first) and
    dropped when a request finishes."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    monkeypatch.setattr(budget_module, "MAX_TRACKED_KEYS", 16)
    tier = make_tier(tmp_path, rows, max_bytes=4 * page)
    budget = tier._budget
    try:
        for r in range(20):
            keys = prompt(f"r{r}-", 4)
            ctx = request(f"r{r}", keys)
            assert store(tier, ctx, keys, r) == [True]
            assert 0 < budget._tracked <= 16
            if r % 2:
                tier.on_request_finished(ctx)
            elif r:
                assert f"r{r - 1}" not in budget._requests  # finished
        assert on_disk(tier, keys) == [True] * 4
    finally:
        tier.shutdown()
