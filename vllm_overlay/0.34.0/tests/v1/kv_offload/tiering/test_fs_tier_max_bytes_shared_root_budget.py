# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One max_bytes for the engines sharing an fs tier root: real fs tiers of
the same layout on one root_dir, real files."""

import os
import time

import pytest

from tests.v1.kv_offload.tiering.test_fs_tier import (
    _page_aligned_zero_tensor,
    lookup_and_wait,
)
from tests.v1.kv_offload.tiering.test_fs_tier_max_bytes import (
    block_key,
    make_tier,
    on_disk,
    page,
    store,
)
from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.tiering.fs import budget as budget_module


@pytest.fixture
def rows():
    return _page_aligned_zero_tensor(4, 1024)


@pytest.fixture(autouse=True)
def fast_listings(monkeypatch):
    # settings this change adds: on the budget without it, the tests run and
    # fail on what they assert, not on a missing name
    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 0.05, raising=False)
    monkeypatch.setattr(budget_module, "RESCAN_COST_FACTOR", 1, raising=False)


def files_on(root) -> int:
    return sum(f.endswith(".bin") for _, _, files in os.walk(root) for f in files)


def wait_for(cond, *tiers, timeout: float = 30.0) -> bool:
    """Poll cond, stepping the tiers (their scheduler thread's calls)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        for tier in tiers:
            tier.get_finished_jobs()
            tier.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(0.01)
    return True


def counted(tier) -> int:
    """The root's bytes the tier's budget counts."""
    budget = tier._budget
    assert budget is not None
    return budget.used


def mtime(tier, key) -> int:
    return os.stat(tier.file_mapper.get_file_name(key)).st_mtime_ns


def test_budgets_on_one_root_keep_it_within_one_max_bytes(tmp_path, rows):
    """Two engines on one root, max_bytes four files each (the root's). The
    second starts on the first's three files and counts them; its stores
    evict them (the oldest); the first then counts the second's files and
    evicts the oldest of them for its own: the root never holds more than
    four files but for the store that evicts a file another engine used."""
    first = make_tier(tmp_path, rows, max_bytes=4 * page)
    second = None
    keys = [block_key(i) for i in range(8)]
    try:
        for i in range(3):
            assert store(first, [keys[i]], 10 * i, rows)[0].success
        second = make_tier(tmp_path, rows, max_bytes=4 * page)
        assert wait_for(lambda: counted(second) == 3 * page, second), (
            "the second engine does not count the first's files"
        )
        for i in range(3, 7):
            assert store(second, [keys[i]], 10 * i, rows)[0].success
            assert files_on(tmp_path) <= 4
        assert on_disk(first, keys[:7]) == [False] * 3 + [True] * 4
        assert wait_for(lambda: counted(first) == 4 * page, first), (
            "the first engine does not count the second's files"
        )
        assert store(first, [keys[7]], 70, rows)[0].success
        assert files_on(tmp_path) <= 5 and on_disk(first, [keys[7]]) == [True]
        assert wait_for(lambda: files_on(tmp_path) <= 4, first)
        assert on_disk(first, [keys[3]]) == [False]  # the root's oldest
    finally:
        first.shutdown()
        if second is not None:
            second.shutdown()


def test_the_files_lookup_found_are_indexed_within_the_budget(tmp_path, rows):
    """Another engine's files lookup() found are counted in max_bytes (at
    the hit; a listing of the root may count them first), as the newest,
    and their mtimes raised (the other engines read them used): the root's
    least recently hit file is evicted to fit a store."""
    tier = make_tier(tmp_path, rows, max_bytes=4 * page)
    other = make_tier(tmp_path, rows, max_bytes=64 * page)
    keys = [block_key(i) for i in range(5)]
    try:
        for i, k in enumerate(keys[:4]):
            assert store(other, [k], 10 * i, rows)[0].success
        old = time.time_ns() - 3600 * 10**9
        for k in keys[:4]:
            os.utime(other.file_mapper.get_file_name(k), ns=(old, old))
        assert lookup_and_wait(tier, keys[:4]) == [LookupResult.HIT] * 4
        tier.on_schedule_end(ScheduleEndContext((), ()))  # no promotion

        def raised() -> bool:
            return all(mtime(tier, k) > old for k in keys[:4])

        assert wait_for(raised, tier), "the hits did not raise the files' mtimes"
        assert store(tier, [keys[4]], 40, rows)[0].success
        assert wait_for(lambda: files_on(tmp_path) <= 4, tier)
        assert on_disk(tier, keys) == [False] + [True] * 4
    finally:
        tier.shutdown()
        other.shutdown()


def test_a_file_another_engine_used_since_is_not_evicted(tmp_path, rows):
    """An engine's least recently used file was used by another engine
    since (its mtime raised, as the other's hit does): the engine's store
    keeps it, and evicts its next oldest instead."""
    first = make_tier(tmp_path, rows, max_bytes=3 * page)
    second = make_tier(tmp_path, rows, max_bytes=3 * page)
    keys = [block_key(i) for i in range(4)]
    try:
        for i in range(3):
            assert store(first, [keys[i]], 10 * i, rows)[0].success
        # for the series' later budget: it looks for the others' hits (the
        # mtimes) once it has read another engine's ledger on the root
        ledgers = getattr(first._budget, "_ledgers", None)
        assert wait_for(lambda: ledgers is None or ledgers.shared, first, second)
        now = time.time_ns()
        os.utime(first.file_mapper.get_file_name(keys[0]), ns=(now, now))
        assert store(first, [keys[3]], 30, rows)[0].success
        assert on_disk(first, [keys[0], keys[3]]) == [True, True]
        assert wait_for(lambda: files_on(tmp_path) <= 3, first)
        assert on_disk(first, keys) == [True, False, True, True]
    finally:
        first.shutdown()
        second.shutdown()


def plant(path: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(page)
    return path


@pytest.mark.parametrize("group", [None, 1 << 16], ids=["not_block_files", "group"])
def test_only_the_tiers_block_files_are_counted(tmp_path, rows, group):
    """Entries of the root that are not block files of the tier's layout
    are neither counted nor removed: a link, a directory, a misplaced file,
    a file of a KV cache group the tier lacks."""
    other = make_tier(tmp_path, rows)  # unbudgeted: an earlier run's file
    keys = [block_key(i) for i in range(7)]
    assert store(other, [keys[0]], 0, rows)[0].success
    path = other.file_mapper.get_file_name
    if group is None:
        planted = [plant(path(keys[1])), path(keys[2])]
        os.remove(planted[0])
        os.symlink(path(keys[0]), planted[0])
        os.mkdir(planted[1])
        rank_dir = os.path.dirname(os.path.dirname(os.path.dirname(path(keys[4]))))
        name = os.path.basename(path(keys[4]))
        planted.append(plant(os.path.join(rank_dir, "000", "00_g0", name)))
    else:
        planted = [plant(path(make_offload_key(keys[1][:-4], group)))]
    tier = make_tier(tmp_path, rows, max_bytes=2 * page)
    try:
        assert wait_for(lambda: counted(tier) == page, tier, timeout=10), (
            f"{counted(tier)} bytes counted, {page} are the tier's"
        )
        for i in (5, 6):  # the second evicts the tier's oldest: keys[0]
            assert store(tier, [keys[i]], 10 * i, rows)[0].success
        assert on_disk(tier, [keys[0], keys[5], keys[6]]) == [False, True, True]
    finally:
        tier.shutdown()
        other.shutdown()
    assert [os.path.lexists(p) for p in planted] == [True] * len(planted)
