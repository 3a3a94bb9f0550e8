# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fs tier's max_bytes budget (RFC #54779): real fs tiers, real files."""

import dataclasses
import logging
import os
import threading

import pytest

from tests.v1.kv_offload.tiering.test_fs_tier import (
    _CTX,
    _make_offloading_spec,
    _page_aligned_zero_tensor,
    drain,
    lookup_and_wait,
    make_job,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import OffloadingGroupConfig
from vllm.v1.kv_offload.tiering.fs import manager as fs_manager
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

page = 4096  # a block file: a row of 1024 float32


@pytest.fixture
def rows():
    return _page_aligned_zero_tensor(4, 1024)


def make_tier(root_dir, rows, num_groups: int = 0, **config) -> FileSystemTierManager:
    spec = _make_offloading_spec()
    groups = tuple(
        OffloadingGroupConfig(tokens_per_block=16, layer_names=(f"l{g}",), group_id=g)
        for g in range(num_groups)
    )
    spec.config = dataclasses.replace(spec.config, groups=groups)
    view = memoryview(rows.numpy())
    return FileSystemTierManager(spec, view, "fs", str(root_dir), 2, 2, **config)


def block_key(n: int, group: int = 0):
    return make_offload_key(f"max-bytes-{n}".encode().ljust(32, b"\0"), group)


def store(tier, keys, job_id: int, rows) -> list:
    """One store job of keys (key i from row i), run to its end."""
    for i in range(len(keys)):
        rows[i] = float(job_id + i)
    tier.submit_store(make_job(job_id, keys, list(range(len(keys)))))
    return drain(tier)


def on_disk(tier, keys) -> list[bool]:
    return [os.path.exists(tier.file_mapper.get_file_name(k)) for k in keys]


def disk_bytes(root_dir) -> int:
    return sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(root_dir)
        for f in files
        if f.endswith((".bin", ".tmp"))
    )


@pytest.mark.parametrize("max_bytes", [-1, 0, 4095, 1.5e9, "1GiB", True])
def test_bad_max_bytes_is_refused(tmp_path, rows, max_bytes):
    """max_bytes must be an int of at least one chunk of every group."""
    with pytest.raises(ValueError, match="max_bytes of the 'fs' tier must be"):
        make_tier(tmp_path, rows, num_groups=1, max_bytes=max_bytes)


def test_disk_use_stays_within_max_bytes(tmp_path, rows):
    """Many stores of two keys each over a budget of four files: after
    every store the files take at most max_bytes, and the budget fills."""
    tier = make_tier(tmp_path, rows, max_bytes=4 * page)
    try:
        peak = 0
        for n in range(0, 40, 2):
            assert store(tier, [block_key(n), block_key(n + 1)], n, rows)[0].success
            used = disk_bytes(tmp_path)
            assert used <= 4 * page, (n, used)
            peak = max(peak, used)
        assert peak >= 3 * page
        assert on_disk(tier, [block_key(38), block_key(39)]) == [True, True]
    finally:
        tier.shutdown()


def test_the_least_recently_used_chunk_goes_first(tmp_path, rows):
    """a, b stored, then a looked up (a hit): c evicts b, the least
    recently used; d then evicts a (c was stored after a's hit)."""
    tier = make_tier(tmp_path, rows, max_bytes=2 * page)
    a, b, c, d = (block_key(i) for i in range(4))
    try:
        assert store(tier, [a], 0, rows)[0].success
        assert store(tier, [b], 10, rows)[0].success
        assert lookup_and_wait(tier, [a]) == [LookupResult.HIT]
        tier.on_schedule_end(ScheduleEndContext((), ()))  # no promotion
        assert store(tier, [c], 20, rows)[0].success
        assert on_disk(tier, [a, b, c]) == [True, False, True]
        assert store(tier, [d], 30, rows)[0].success
        assert on_disk(tier, [a, b, c, d]) == [False, False, True, True]
    finally:
        tier.shutdown()


def test_a_chunk_with_a_load_in_flight_is_not_evicted(tmp_path, rows, monkeypatch):
    """The least recently used chunk, a, is being loaded: a store evicts b
    instead, and a's load reads a's bytes."""
    tier = make_tier(tmp_path, rows, max_bytes=2 * page)
    release = threading.Event()
    real_load = fs_manager.batch_load_block

    def held_load(*args, **kwargs):
        assert release.wait(30)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(fs_manager, "batch_load_block", held_load)
    a, b, c = (block_key(i) for i in range(3))
    try:
        assert store(tier, [a], 40, rows)[0].success
        assert store(tier, [b], 50, rows)[0].success
        tier.submit_load(make_job(1, [a], [3], is_promotion=True))
        tier.submit_store(make_job(2, [c], [2]))
        release.set()
        assert all(r.success for r in drain(tier))
        assert (rows[3] == 40.0).all()  # a's bytes
        assert on_disk(tier, [a, b, c]) == [True, False, True]
        assert disk_bytes(tmp_path) <= 2 * page
    finally:
        release.set()
        tier.shutdown()


def test_an_evicted_key_is_a_miss_at_once(tmp_path, rows):
    """A key lookup() found (its verdict cached) and then evicted: its next
    lookup is a miss, not a promotion of a file that is gone."""
    tier = make_tier(tmp_path, rows, max_bytes=page)
    k1, k2 = block_key(1), block_key(2)
    try:
        assert store(tier, [k1], 0, rows)[0].success
        assert lookup_and_wait(tier, [k1]) == [LookupResult.HIT]
        tier.on_schedule_end(ScheduleEndContext((), ()))  # no promotion
        assert store(tier, [k2], 10, rows)[0].success  # evicts k1
        assert on_disk(tier, [k1, k2]) == [False, True]
        assert tier.lookup(k1, _CTX) is LookupResult.MISS
    finally:
        tier.shutdown()


def test_a_store_that_cannot_fit_fails_with_a_warning(tmp_path, rows, caplog_vllm):
    """Both files of a two-file budget were hit in this step: a third key
    fails its store (no room), with the budget's warning and no I/O error;
    once the step ends it is stored."""
    tier = make_tier(tmp_path, rows, max_bytes=2 * page)
    a, b, c = (block_key(i) for i in range(3))
    try:
        with caplog_vllm.at_level(logging.WARNING):
            assert store(tier, [a, b], 0, rows)[0].success
            assert lookup_and_wait(tier, [a, b]) == [LookupResult.HIT] * 2
            assert [r.success for r in store(tier, [c], 10, rows)] == [False]
            assert on_disk(tier, [a, b, c]) == [True, True, False]
            tier.on_schedule_end(ScheduleEndContext((), ()))  # pins released
            assert store(tier, [c], 20, rows)[0].success
        assert "1 block file(s) of 1 store job(s) not written" in caplog_vllm.text
        assert f"no room in max_bytes={2 * page}" in caplog_vllm.text
        assert not [r for r in caplog_vllm.records if r.levelno >= logging.ERROR]
    finally:
        tier.shutdown()


def test_every_groups_file_of_a_chunk_is_evicted_at_once(tmp_path, rows):
    """Two groups (say sliding window + full attention), stored by separate
    jobs: the least recently used chunk loses both its files."""
    tier = make_tier(tmp_path, rows, num_groups=2, max_bytes=4 * page)
    chunks = [[block_key(n, g) for g in (0, 1)] for n in range(3)]
    try:
        for n, (k0, k1) in enumerate(chunks):
            assert store(tier, [k1], 10 * n, rows)[0].success
            assert store(tier, [k0], 10 * n + 5, rows)[0].success
        kept = [on_disk(tier, keys) for keys in chunks]
        assert kept == [[False, False], [True, True], [True, True]]
        assert disk_bytes(tmp_path) <= 4 * page
    finally:
        tier.shutdown()


def test_an_evicted_file_not_removed_stays_counted(tmp_path, rows, monkeypatch):
    """An evicted file os.remove could not remove (not ENOENT) stays, and
    stays counted: the next store makes room for it within max_bytes."""
    tier = make_tier(tmp_path, rows, max_bytes=2 * page)
    a, b, c, d = (block_key(i) for i in range(4))
    try:
        assert store(tier, [a], 0, rows)[0].success
        assert store(tier, [b], 10, rows)[0].success
        with monkeypatch.context() as m:
            m.setattr(os, "remove", os.rmdir)  # ENOTDIR on a file
            assert store(tier, [c], 20, rows)[0].success  # evicts a: it stays
        tier.on_schedule_end(ScheduleEndContext((), ()))
        assert on_disk(tier, [a]) == [True]
        store(tier, [d], 30, rows)
        tier.on_schedule_end(ScheduleEndContext((), ()))
        assert disk_bytes(tmp_path) <= 2 * page
    finally:
        tier.shutdown()
