# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fs tier's max_bytes budget after failed jobs: the files a failed job
left missing are not counted, so no file is evicted for room that is free."""

import errno
import os

import pytest

from tests.v1.kv_offload.tiering.test_fs_tier import (
    _page_aligned_zero_tensor,
    drain,
    make_job,
)
from tests.v1.kv_offload.tiering.test_fs_tier_max_bytes import (
    block_key,
    disk_bytes,
    make_tier,
    on_disk,
    page,
    store,
)
from vllm.v1.kv_offload.base import ScheduleEndContext
from vllm.v1.kv_offload.tiering.fs import manager as fs_manager


@pytest.fixture
def rows():
    return _page_aligned_zero_tensor(4, 1024)


@pytest.mark.parametrize(
    "exc", [OSError(errno.EIO, "Input/output error"), RuntimeError("a bug")]
)
def test_a_failed_store_counts_only_the_files_it_wrote(
    tmp_path, rows, monkeypatch, exc
):
    """A store of b, c wrote b, then raised (an OSError, or another
    exception from a bug): the budget counts a and b, so d fits without
    evicting a; e evicts a, the least recently used (c never counts)."""
    tier = make_tier(tmp_path, rows, max_bytes=3 * page)
    real_store = fs_manager.batch_store_block

    def first_then_raise(paths, view, offsets, *args):
        real_store(paths[:1], view, offsets[:1], *args)
        raise exc

    a, b, c, d, e = (block_key(i) for i in range(5))
    try:
        assert store(tier, [a], 0, rows)[0].success
        monkeypatch.setattr(fs_manager, "batch_store_block", first_then_raise)
        assert [r.success for r in store(tier, [b, c], 10, rows)] == [False]
        monkeypatch.setattr(fs_manager, "batch_store_block", real_store)
        assert on_disk(tier, [a, b, c]) == [True, True, False]
        assert store(tier, [d], 20, rows)[0].success
        assert on_disk(tier, [a, b, c, d]) == [True, True, False, True]
        assert store(tier, [e], 30, rows)[0].success
        assert on_disk(tier, [a, b, d, e]) == [False, True, True, True]
        assert disk_bytes(tmp_path) <= 3 * page
    finally:
        tier.shutdown()


def test_a_load_that_removed_a_bad_file_uncounts_it(tmp_path, rows):
    """The file of a is cut short: the load of a, e fails and removes it. The
    budget uncounts a (c fits without evicting b) but not e, whose file is
    still there (d evicts b, the least recently used)."""
    tier = make_tier(tmp_path, rows, max_bytes=3 * page)
    a, b, c, d, e = (block_key(i) for i in range(5))
    try:
        assert store(tier, [b], 0, rows)[0].success
        assert store(tier, [a, e], 10, rows)[0].success
        path = tier.file_mapper.get_file_name(a)
        os.truncate(path, page // 2)
        tier.submit_load(make_job(1, [a, e], [2, 3], is_promotion=True))
        assert [r.success for r in drain(tier)] == [False]
        assert not os.path.exists(path)
        tier.on_schedule_end(ScheduleEndContext((), ()))
        assert store(tier, [c], 20, rows)[0].success
        assert on_disk(tier, [b, c, e]) == [True, True, True]
        assert store(tier, [d], 30, rows)[0].success
        assert on_disk(tier, [b, c, d, e]) == [False, True, True, True]
        assert disk_bytes(tmp_path) <= 3 * page
    finally:
        tier.shutdown()
