# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""fs tiers of several engines on one root, each with a max_bytes budget:
each tier bounds the files it stored, the root holds at most the sum of the
budgets, and no engine loads a torn block or another key's bytes, not even
with one engine killed in the middle of a store."""

import contextlib
import logging
import multiprocessing
import os
import signal
import time

import numpy as np

from tests.v1.kv_offload.tiering.test_fs_tier import (
    _page_aligned_zero_tensor,
    drain,
    lookup_and_wait,
    make_job,
)
from tests.v1.kv_offload.tiering.test_fs_tier_max_bytes import (
    block_key,
    disk_bytes,
    make_tier,
    page,
)
from vllm.utils.hashing import sha256
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

_ROUNDS = 6  # of each engine
_FILES = 8  # each engine's budget, in block files


def store_each(tier, keys: list[OffloadKey], first_job: int, rows) -> list:
    """Store each key in a job of its own (row i holds key i's bytes)."""
    results = []
    for i, k in enumerate(keys):
        rows[i] = float(first_job + i)
        tier.submit_store(make_job(first_job + i, [k], [i]))
        results += drain(tier)
    return results


def test_two_tiers_on_one_root_keep_their_budgets(tmp_path, caplog_vllm):
    """Two engines' tiers on one root (the same layout: the same directory),
    each with a budget of three files, store the same key and then five of
    their own: each stays within its budget, the root within the sum, and a
    file the other engine removed is a miss for a tier that indexed it, or a
    failed load if it was looked up before: no error, no wrong bytes."""
    rows = _page_aligned_zero_tensor(8, 1024)
    first = make_tier(tmp_path, rows, max_bytes=3 * page)
    second = make_tier(tmp_path, rows, max_bytes=3 * page)
    try:
        with caplog_vllm.at_level(logging.WARNING):  # the stores warn of nothing
            shared = block_key(0)
            results = store_each(first, [shared], 0, rows)
            results += store_each(second, [shared], 0, rows)
            results += store_each(
                first, [block_key(100 + i) for i in range(5)], 10, rows
            )
            # second indexes shared; first evicted it and removed its file
            assert lookup_and_wait(second, [shared]) == [LookupResult.MISS]
            # second evicts shared too: its file is gone already
            results += store_each(
                second, [block_key(200 + i) for i in range(5)], 20, rows
            )
            assert [r.success for r in results] == [True] * 12
            assert first._budget is not None and second._budget is not None
            assert first._budget.used <= 3 * page
            assert second._budget.used <= 3 * page
            assert disk_bytes(tmp_path) <= 6 * page
            assert lookup_and_wait(first, [shared]) == [LookupResult.MISS]
        assert not [r for r in caplog_vllm.records if r.levelno >= logging.WARNING]

        # first found k; second, which stored it too, evicts it before
        # first's load: the load fails, no bytes are loaded
        k = block_key(104)
        assert lookup_and_wait(first, [k]) == [LookupResult.HIT]
        others = [block_key(300 + i) for i in range(3)]
        assert all(r.success for r in store_each(second, [k] + others, 30, rows))
        assert not os.path.exists(first.file_mapper.get_file_name(k))
        rows[6] = -1.0
        first.submit_load(make_job(50, [k], [6], is_promotion=True))
        (result,) = drain(first)
        assert not result.success and not result.successful_keys
        assert (rows[6] == -1.0).all()
        first.on_schedule_end(ScheduleEndContext((), ()))
        assert lookup_and_wait(first, [k]) == [LookupResult.MISS]
        assert disk_bytes(tmp_path) <= 6 * page
    finally:
        first.shutdown()
        second.shutdown()


def _row_of(key: OffloadKey) -> float:
    """The value every float of a key's block holds in the shared-root test."""
    return float(int.from_bytes(sha256(key)[:2], "big"))


def _engine_on_shared_root(root, engine, rounds, first_round, kill_in, report):
    """One engine of test_engines_on_one_root_survive_one_killed_mid_store (a
    process of its own): per round, stores a prompt of a shared head and
    chunks of its own (8 keys, one job), looks them up, loads the hits back,
    and reports its budget's bytes and the keys loaded with wrong bytes.
    With kill_in, that round's store writes half its files, reports
    "storing" and waits to be killed."""
    rows = _page_aligned_zero_tensor(16, 1024)
    tier = make_tier(root, rows, num_groups=1, max_bytes=_FILES * page)
    store = fs_manager.batch_store_block

    def half_then_hang(paths, view, offsets, *args):
        store(paths[: len(paths) // 2], view, offsets[: len(offsets) // 2], *args)
        report.send((engine, "storing"))
        time.sleep(600)

    try:
        for r in range(first_round, first_round + rounds):
            head = [block_key(i) for i in range(4)]
            keys = head + [block_key(10000 * engine + 10 * r + i) for i in range(4)]
            ctx = ReqContext(f"e{engine}-r{r}")
            for i, k in enumerate(keys):
                rows[i] = _row_of(k)
                ctx.set_offload_key_position(k, 16 * (i + 1))
            if r == kill_in:
                fs_manager.batch_store_block = half_then_hang
            tier.submit_store(TransferJob(r, keys, np.arange(8), False, ctx))
            drain(tier)
            found = lookup_and_wait(tier, keys, ctx)
            hits = [k for k, f in zip(keys, found) if f is LookupResult.HIT]
            tier.on_schedule_end(ScheduleEndContext((), ()))
            rows[8:] = 0.0
            loaded = set(hits)
            if hits:
                slots = list(range(8, 8 + len(hits)))
                tier.submit_load(make_job(1000 + r, hits, slots, True))
                (result,) = drain(tier)
                if not result.success:
                    loaded = set(result.successful_keys or ())
            wrong = [
                k.hex()
                for i, k in enumerate(hits)
                if k in loaded and not bool((rows[8 + i] == _row_of(k)).all())
            ]
            assert tier._budget is not None
            report.send((engine, r, tier._budget.used, wrong))
    finally:
        tier.shutdown()


def test_engines_on_one_root_survive_one_killed_mid_store(tmp_path, monkeypatch):
    """Three engines (processes) share one root, each with a budget of 8
    files: they store overlapping prompts (a shared head, chunks of their
    own) in rounds, look them up and load them back. One is killed
    (SIGKILL) in the middle of a store, after half its files, and started
    again on the root. No load returns wrong bytes, every file on the root
    holds its key's bytes, each engine's budget holds after every round,
    and the root holds at most the sum of the budgets."""
    # one layout for all: the same hash seed (the block hashes' NONE_HASH)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    mp = multiprocessing.get_context("spawn")
    root = str(tmp_path / "fs")
    reports = []  # one pipe per process: a killed one holds no shared lock

    def start(engine, rounds, first_round=0, kill_in=-1):
        received, sent = mp.Pipe(duplex=False)
        p = mp.Process(
            target=_engine_on_shared_root,
            args=(root, engine, rounds, first_round, kill_in, sent),
        )
        p.start()
        reports.append(received)
        return p

    procs = [start(0, _ROUNDS), start(1, _ROUNDS), start(2, _ROUNDS, kill_in=2)]
    rounds: list = []
    try:
        assert reports[2].poll(120), "engine 2 never reached its store"
        while (item := reports[2].recv()) != (2, "storing"):
            rounds.append(item)
        os.kill(procs[2].pid, signal.SIGKILL)
        procs[2].join(30)
        procs.append(start(2, _ROUNDS - 3, first_round=3))
        for p, received in zip(procs, reports):
            p.join(240)  # what it sent is small: in the pipe's buffer
            with contextlib.suppress(EOFError):  # all read
                while p.exitcode == 0:
                    rounds.append(received.recv())
        assert [p.exitcode for p in procs] == [0, 0, -signal.SIGKILL, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    done = sorted((e, r) for e, r, _, _ in rounds)
    assert done == sorted(
        [(e, r) for e in (0, 1) for r in range(_ROUNDS)]
        + [(2, 0), (2, 1)]
        + [(2, r) for r in range(3, _ROUNDS)]
    )
    assert all(used <= _FILES * page for _, _, used, _ in rounds), rounds
    assert not [w for _, _, _, w in rounds if w], rounds
    # one layout: the engines shared their files
    assert len([n for n in os.listdir(root) if n.endswith("_r0")]) == 1
    files = 0
    for d, _, names in os.walk(root):
        for name in names:
            if not name.endswith(".bin"):
                continue
            files += 1
            data = np.fromfile(os.path.join(d, name), dtype=np.float32)
            key = make_offload_key(bytes.fromhex(name[:-4]), 0)
            assert data.size == 1024 and (data == _row_of(key)).all(), name
    assert 0 < files <= 3 * _FILES
