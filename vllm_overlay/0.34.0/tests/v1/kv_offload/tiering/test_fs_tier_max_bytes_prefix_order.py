# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fs tier's max_bytes budget keeps whole prefixes: a prompt loses its
tail before its head, and a sliding-window file goes with the
full-attention chunk covering it. Real fs tiers, real files."""

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


def request(req_id: str, positions: dict[OffloadKey, int]) -> ReqContext:
    """A request whose keys the scheduler recorded at positions."""
    ctx = ReqContext(req_id)
    for key, position in positions.items():
        ctx.set_offload_key_position(key, position)
    return ctx


def positions_of(keys: list[OffloadKey], tokens: int = 16) -> dict[OffloadKey, int]:
    return {k: tokens * (i + 1) for i, k in enumerate(keys)}


def store(tier, ctx: ReqContext, keys, job_id: int) -> list[bool]:
    job = TransferJob(job_id, keys, np.arange(len(keys)), False, ctx)
    tier.submit_store(job)
    return [r.success for r in drain(tier)]


def test_a_store_evicts_the_tail_before_the_head(tmp_path, rows):
    """A prompt of 4 chunks fills a budget of 4 files: another request's
    store evicts its last chunk, then the one before it, never its head."""
    tier = make_tier(tmp_path, rows, max_bytes=4 * page)
    a, b = prompt("a", 4), prompt("b", 2)
    try:
        assert store(tier, request("a", positions_of(a)), a, 0) == [True]
        ctx = request("b", positions_of(b))
        assert store(tier, ctx, b[:1], 1) == [True]
        assert on_disk(tier, a) == [True, True, True, False]
        assert store(tier, ctx, b[1:], 2) == [True]
        assert on_disk(tier, a + b) == [True, True, False, False, True, True]
    finally:
        tier.shutdown()


def test_a_store_keeps_the_shared_head_its_own_tail_needs(tmp_path, rows):
    """Two prompts share a head of 2 chunks; the second's head was served
    by another tier (no hit here), only its tail is stored: it evicts the
    first prompt's tail, not the head that it needs to hit."""
    tier = make_tier(tmp_path, rows, max_bytes=4 * page)
    a = prompt("a", 4)
    b = a[:2] + prompt("b", 4)[2:]
    try:
        assert store(tier, request("a", positions_of(a)), a, 0) == [True]
        assert store(tier, request("b", positions_of(b)), b[2:], 1) == [True]
        assert on_disk(tier, a + b[2:]) == [True, True, False, False, True, True]
    finally:
        tier.shutdown()


def test_a_hit_keeps_the_prefix_before_it(tmp_path, rows):
    """Prompts a and b of 2 chunks fill the budget; a request hits a's
    second chunk (its first served by another tier): a's head is kept with
    it, and b's tail, now the oldest, is evicted."""
    tier = make_tier(tmp_path, rows, max_bytes=4 * page)
    a, b, c = prompt("a", 2), prompt("b", 2), prompt("c", 1)
    try:
        assert store(tier, request("a", positions_of(a)), a, 0) == [True]
        assert store(tier, request("b", positions_of(b)), b, 1) == [True]
        hit = request("hit", positions_of(a))
        assert lookup_and_wait(tier, a[1:], hit) == [LookupResult.HIT]
        tier.on_schedule_end(ScheduleEndContext((), ()))  # no promotion
        assert store(tier, request("c", positions_of(c)), c, 2) == [True]
        assert on_disk(tier, a + b + c) == [True, True, True, False, True]
    finally:
        tier.shutdown()


def test_a_chunk_a_coarser_group_stored_first_goes_before_its_head(tmp_path, rows):
    """Groups of 32 and 16 tokens a chunk share the block hash at every 32
    tokens: that chunk is first stored by the coarse group (its first chunk)
    and then by the fine group, after the 16-token chunk before it. It is
    the prompt's tail: a store that needs room evicts it (both its files)
    and keeps the head."""
    tier = make_tier(tmp_path, rows, group_tokens=(32, 16), max_bytes=3 * page)
    head, tail = b"h" * 32, b"t" * 32
    coarse = make_offload_key(tail, 0)  # tokens 0-32
    fine = [make_offload_key(head, 1), make_offload_key(tail, 1)]
    ctx = request("req", {coarse: 32, fine[0]: 16, fine[1]: 32})
    try:
        assert store(tier, ctx, [coarse, fine[0]], 0) == [True]
        assert store(tier, ctx, fine[1:], 1) == [True]
        other = prompt("o", 1)
        assert store(tier, request("o", positions_of(other)), other, 2) == [True]
        assert on_disk(tier, [fine[0], coarse, fine[1]]) == [True, False, False]
    finally:
        tier.shutdown()


def test_a_chunk_left_with_sliding_window_files_alone_goes_with_its_child(
    tmp_path, rows
):
    """Full attention of 32 tokens a chunk, sliding window of 16: the
    sliding-window file at 48 tokens hits only with the full-attention chunk
    at 64 (its child). A store that needs room for 2 files evicts both, not
    the prefix before them."""
    tier = make_tier(
        tmp_path, rows, group_tokens=(32, 16), windows=(None, 1), max_bytes=6 * page
    )
    hashes = [bytes([i + 1]) * 32 for i in range(4)]  # at 16, 32, 48, 64
    full = [make_offload_key(hashes[1], 0), make_offload_key(hashes[3], 0)]
    window = [make_offload_key(h, 1) for h in hashes]
    positions = positions_of(full, 32) | positions_of(window)
    other = [make_offload_key(b"o" * 32, g) for g in range(2)]
    try:
        assert store(tier, request("req", positions), full + window, 0) == [True]
        ctx = request("other", {k: 32 for k in other})
        assert store(tier, ctx, other, 1) == [True]
        assert on_disk(tier, full + window) == [True, False] + [True] * 2 + [False] * 2
        assert on_disk(tier, other) == [True, True]
    finally:
        tier.shutdown()


def test_the_requests_positions_kept_are_bounded(tmp_path, rows, monkeypatch):
    """The requests' keys kept for the order are bounded (MAX_TRACKED_KEYS,
    the least recently seen requests dropped first) and dropped when a
    request finishes."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    monkeypatch.setattr(budget_module, "MAX_TRACKED_KEYS", 16)
    tier = make_tier(tmp_path, rows, max_bytes=4 * page)
    budget = tier._budget
    try:
        for r in range(20):
            keys = prompt(f"r{r}-", 4)
            ctx = request(f"r{r}", positions_of(keys))
            assert store(tier, ctx, keys, r) == [True]
            assert 0 < budget._tracked <= 16
            if r % 2:
                tier.on_request_finished(ctx)
            elif r:
                assert f"r{r - 1}" not in budget._requests  # finished
        assert on_disk(tier, keys) == [True] * 4
    finally:
        tier.shutdown()
