# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Regression tests for the fs tier's byte budget (max_bytes).

Through the real TieringOffloadingManager with its CPU primary tier and the
real fs tier writing real files, with the keys and their prompt positions
the real connector scheduler derives from real requests (its
RequestOffloadState), and hits looked up through the real connector
scheduler: the tier's files stay within max_bytes after every store of a
workload larger than it, a prefix loses its tail before its head (no kept
file is unreachable), a restart over files beyond the budget trims them the
same way, and the budget is reported to vLLM's KV offload metrics. Bad
settings are refused.
"""

import contextlib
import dataclasses
import errno
import logging
import math
import os
import random
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from tests.v1.kv_offload.test_tiering_hma import (  # noqa: F401 (fixtures)
    Engine,
    _remove_shm_regions,
    _sha256_block_hashes,
    expected_hit_tokens,
    finish_tier_io,
    model_config,
    ref_cnts,
    settle_step,
    tiering_manager,
    write_chunks,
)
from tests.v1.kv_offload.tiering.test_fs_tier import (
    _CTX,
    _make_offloading_spec,
    _page_aligned_zero_tensor,
    drain,
    lookup_and_wait,
    make_job,
)
from tests.v1.kv_offload.tiering.test_fs_tier_security import key_file
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    RequestOffloadState,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import OffloadingGroupConfig
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs import manager as fs_manager
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.request import Request

# the budget's metrics (vllm/v1/kv_offload/tiering/fs/manager.py)
BUDGET_USED_BYTES = "vllm:kv_offload_fs_budget_used_bytes"
BUDGET_MAX_BYTES = "vllm:kv_offload_fs_budget_max_bytes"
BUDGET_EVICTED_FILES = "vllm:kv_offload_fs_budget_evicted_files"
BUDGET_REJECTED_FILES = "vllm:kv_offload_fs_budget_rejected_files"

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

_CHUNKS = 6  # chunks per prompt: a shared head of 3, a tail of 3


def block_files(root_dir: str) -> set[str]:
    """Stems (<hash hex>_g<group>) of the block files under root_dir."""
    return {
        f"{f[:-4]}_g{d.rsplit('_g', 1)[1]}"
        for d, _, files in os.walk(root_dir)
        for f in files
        if f.endswith(".bin")
    }


def disk_bytes(root_dir: str) -> int:
    """The bytes of the block and temp files under root_dir; a file the
    budget thread removes while it is read counts nothing."""
    total = 0
    for d, _, files in os.walk(root_dir):
        for f in files:
            if f.endswith((".bin", ".tmp")):
                with contextlib.suppress(FileNotFoundError):
                    total += os.path.getsize(os.path.join(d, f))
    return total


def stem(key: OffloadKey) -> str:
    return f"{key[:-4].hex()}_g{int.from_bytes(key[-4:], 'big')}"


def budget_engine(model_cfg, layout: str, root_dir: str, **tier) -> Engine:
    engine = Engine(model_cfg, layout, root_dir, 64)
    assert engine.vllm_config.kv_transfer_config is not None
    extra = engine.vllm_config.kv_transfer_config.kv_connector_extra_config
    extra["secondary_tiers"][0].update(tier)
    return engine


def chunk_bytes_on_disk(engine: Engine) -> int:
    """Bytes of one chunk on disk: one row of the CPU tier per group."""
    spec = engine.spec()
    return len(spec.config.groups) * spec.kv_bytes_per_chunk


def prompt(engine: Engine, p: int, num_heads: int = 2):
    """Prompt p: _CHUNKS chunks plus one token; its first half is shared
    with the other prompts of its head."""
    head = [(11 * i + 101 * (p % num_heads)) % 500 for i in range(3 * 16)]
    tail = [(7 * i + 13 * p + 1) % 500 for i in range(3 * 16 + 1)]
    return Request(
        request_id=f"req{p}",
        prompt_token_ids=head + tail,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(engine.hash_block_size, sha256),
    )


def store_prompt(sched, request, on_step=None) -> list[list[OffloadKey]]:
    """What the connector scheduler offloads of a request, in prompt order,
    one store job per chunk of the coarsest group (every group's keys of
    those tokens), each cascaded to the fs tier, with the keys and the
    positions the connector's RequestOffloadState gives them. Returns the
    request's keys per group."""
    manager = tiering_manager(sched)
    ctx = ReqContext(request.request_id)
    state = RequestOffloadState(
        config=sched.config, req=request, req_context=ctx, offloading_context=None
    )
    state.update_offload_keys()  # the keys, and their positions in ctx
    groups = [list(g.offload_keys) for g in state.group_states]
    with manager.lock:
        manager.on_new_request(ctx)
    step = math.lcm(*(c.tokens_per_chunk for c in sched.config.kv_group_configs))
    for end in range(step, request.num_tokens + step, step):
        keys = [
            k
            for g in groups
            for k in g
            if end - step < (ctx.get_offload_key_position(k) or 0) <= end
        ]
        if not keys:
            continue
        with manager.lock:
            out = manager.prepare_store(keys, ctx)
            assert out is not None
            if out.keys_to_store:  # not those the CPU tier holds already
                write_chunks(
                    manager,
                    out.keys_to_store,
                    out.store_spec.chunk_ids,  # type: ignore[attr-defined]
                )
                manager.complete_store(out.keys_to_store, ctx)  # to the fs tier
        finish_tier_io(manager)
        with manager.lock:
            manager.on_schedule_end(ScheduleEndContext((), ()))
        if on_step is not None:
            on_step()
    with manager.lock:
        manager.on_request_finished(ctx)
        manager.on_schedule_end(ScheduleEndContext((), ()))
    return groups


def unreachable_files(
    prompts: list[list[list[OffloadKey]]],
    files: set[str],
    sched,
    stem: Callable[[OffloadKey], str] = stem,
) -> set[str]:
    """Kept block files of a prompt's chunks past the first token a
    full-attention group lost: they can never hit."""
    configs = sched.config.kv_group_configs
    unreachable: set[str] = set()
    for groups in prompts:
        # the first token not covered by a kept full-attention chunk
        end = min(
            next((i for i, k in enumerate(keys) if stem(k) not in files), len(keys))
            * config.tokens_per_chunk
            for keys, config in zip(groups, configs)
            if config.sliding_window_size_in_chunks is None
        )
        for keys, config in zip(groups, configs):
            unreachable.update(
                stem(k)
                for j, k in enumerate(keys)
                if (j + 1) * config.tokens_per_chunk > end and stem(k) in files
            )
    return unreachable


# ---------------------------------------------------------------------------
# Through the real connector scheduler
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["llama", "gemma3", "gemma4"])
def test_budget_holds_and_prefixes_stay_whole(
    model_config,  # noqa: F811 (a fixture of test_tiering_hma)
    tmp_path,
    layout,
):
    """12 prompts with shared heads, four times the budget: after every
    store the tier's files take at most max_bytes plus one store job, at the
    end at most max_bytes; no kept file is unreachable (a prefix lost its
    tail first, every group's file of a chunk at once), and a cold engine
    hits the last prompt whole from disk through the connector scheduler."""
    root_dir = str(tmp_path / "fs")
    probe = Engine(model_config, layout, root_dir, 64)
    chunk = chunk_bytes_on_disk(probe)
    max_bytes = 10 * chunk
    engine = budget_engine(model_config, layout, root_dir, max_bytes=max_bytes)
    sched = engine.connector_scheduler()
    peak = [0]

    def measure():
        used = disk_bytes(root_dir)
        peak[0] = max(peak[0], used)
        assert used <= max_bytes + chunk, (used, max_bytes)

    prompts = []
    try:
        for p in range(12):
            prompts.append(store_prompt(sched, prompt(engine, p), measure))
        assert disk_bytes(root_dir) <= max_bytes
    finally:
        sched.shutdown()
    files = block_files(root_dir)
    assert peak[0] >= max_bytes - chunk  # the workload filled the budget
    assert not unreachable_files(prompts, files, sched)
    # the last prompt is kept whole: its chunks are the most recent
    assert all(stem(k) in files for keys in prompts[-1] for k in keys)

    sched = engine.connector_scheduler()  # cold: an empty CPU tier
    try:
        request = prompt(engine, 11)
        sched.on_new_request(request)
        settled: set[str] = set()
        for _ in range(3):
            settle_step(sched, [request], settled)
        hit, _ = sched.get_num_new_matched_tokens(request, 0)
        assert hit == expected_hit_tokens(sched, request.num_tokens)
    finally:
        sched.shutdown()


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "key_file"])
def test_restart_over_budget_trims_tails_first(
    model_config,  # noqa: F811 (a fixture of test_tiering_hma)
    tmp_path,
    keyed,
):
    """Files of an earlier run beyond the budget (a larger one then): at
    start the tier indexes them in the background and trims them to
    max_bytes, tail first (the kept files of each prompt are a prefix of it:
    the budget set each file's time to its order, heads newer than tails,
    though heads were written first). With a key_file the files are named by
    a keyed hash: the same, by those names."""
    layout = "gemma3"
    root_dir = str(tmp_path / "fs")
    key_config = {}
    if keyed:
        key_path = tmp_path / "tier.key"
        key_path.write_bytes(bytes(range(32)))
        key_path.chmod(0o600)
        key_config = {"key_file": str(key_path)}
    probe = Engine(model_config, layout, root_dir, 64)
    chunk = chunk_bytes_on_disk(probe)
    engine = budget_engine(
        model_config, layout, root_dir, max_bytes=100 * chunk, **key_config
    )
    sched = engine.connector_scheduler()
    try:
        prompts = [store_prompt(sched, prompt(engine, p, 6)) for p in range(6)]
    finally:
        sched.shutdown()
    assert len(block_files(root_dir)) == 6 * _CHUNKS * len(prompts[0])

    max_bytes = 10 * chunk
    engine = budget_engine(
        model_config, layout, root_dir, max_bytes=max_bytes, **key_config
    )
    sched = engine.connector_scheduler()
    try:
        (tier,) = tiering_manager(sched).secondary_tiers
        assert isinstance(tier, FileSystemTierManager)
        # the start-up index trims the files of the earlier run
        wait_until(lambda: disk_bytes(root_dir) <= max_bytes)
        assert tier._budget is not None and tier._budget.used <= max_bytes
    finally:
        sched.shutdown()
    files = block_files(root_dir)
    assert 0 < disk_bytes(root_dir) <= max_bytes

    def file_stem(key: OffloadKey) -> str:  # the name the tier gives key's file
        name = os.path.basename(tier.file_mapper.get_file_name(key))
        return f"{name[:-4]}_g{int.from_bytes(key[-4:], 'big')}"

    assert not unreachable_files(prompts, files, sched, file_stem)
    if keyed:  # the files are named by the keyed hash, not the block hash
        assert not set(files) & {stem(k) for p in prompts for g in p for k in g}


def test_budget_is_reported_to_kv_offload_metrics(
    model_config,  # noqa: F811 (a fixture of test_tiering_hma)
    tmp_path,
):
    """The tiering manager's stats carry the tier's bytes used, its budget,
    and the files it evicted and rejected (counters: deltas per report), and
    the spec declares those metrics."""
    layout = "llama"
    root_dir = str(tmp_path / "fs")
    probe = Engine(model_config, layout, root_dir, 64)
    chunk = chunk_bytes_on_disk(probe)
    max_bytes = 4 * chunk
    engine = budget_engine(model_config, layout, root_dir, max_bytes=max_bytes)
    assert engine.vllm_config.kv_transfer_config is not None
    definitions = TieringOffloadingSpec.build_metric_definitions(
        engine.vllm_config.kv_transfer_config.kv_connector_extra_config
    )
    for name in (
        BUDGET_USED_BYTES,
        BUDGET_MAX_BYTES,
        BUDGET_EVICTED_FILES,
        BUDGET_REJECTED_FILES,
    ):
        assert name in definitions
    sched = engine.connector_scheduler()
    manager = tiering_manager(sched)
    try:
        label = ("fs",)
        # 6 chunks into 4: the head is kept, the 5th does not fit (the 4th,
        # its parent, stays while it is written) and the 6th, after it, is
        # not written
        store_prompt(sched, prompt(engine, 0))
        with manager.lock:
            stats = manager.get_stats()
            assert stats is not None
            values = stats.data["data"]
        assert values[BUDGET_MAX_BYTES][label] == max_bytes
        assert values[BUDGET_USED_BYTES][label] == 4 * chunk
        assert values[BUDGET_EVICTED_FILES][label] == 0
        assert values[BUDGET_REJECTED_FILES][label] == 1
        # another prompt replaces the first, tail first
        store_prompt(sched, prompt(engine, 1))
        with manager.lock:
            stats = manager.get_stats()
            assert stats is not None
            values = stats.data["data"]
        assert values[BUDGET_USED_BYTES][label] == 4 * chunk
        assert values[BUDGET_EVICTED_FILES][label] == 4  # since the last report
        assert values[BUDGET_REJECTED_FILES][label] == 1
        assert all(c == 0 for c in ref_cnts(manager))
    finally:
        sched.shutdown()


def request_of(engine: Engine, req_id: str, tokens: list[int]) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(engine.hash_block_size, sha256),
    )


def test_a_chunk_past_a_gap_writes_no_file_of_any_group(
    model_config,  # noqa: F811 (a fixture of test_tiering_hma)
    tmp_path,
):
    """Sliding window + full attention (gemma3): a head of 4 chunks is
    evicted from disk by other prompts but stays in the CPU tier; a prompt
    of that head plus 4 chunks of its own stores only its 4 chunks (the CPU
    tier holds the head), whose full-attention files could never hit from
    disk (the chunk before them is not there). None of their files is
    written, the sliding-window ones included: they would take the budget's
    room and evict what can still hit."""
    layout = "gemma3"
    root_dir = str(tmp_path / "fs")
    probe = Engine(model_config, layout, root_dir, 64)
    max_bytes = 4 * chunk_bytes_on_disk(probe)
    engine = budget_engine(model_config, layout, root_dir, max_bytes=max_bytes)
    sched = engine.connector_scheduler()
    head = [(11 * i + 5) % 500 for i in range(4 * 16)]
    try:
        store_prompt(sched, request_of(engine, "head", head + [1]))
        for p in range(3):  # other prompts fill the budget: the head goes
            other = [(7 * i + 13 * p + 2) % 500 for i in range(4 * 16 + 1)]
            store_prompt(sched, request_of(engine, f"other{p}", other))
        tail = head + [(3 * i) % 500 for i in range(65)]
        keys = store_prompt(sched, request_of(engine, "tail", tail))
        files = block_files(root_dir)
    finally:
        sched.shutdown()
    assert stem(keys[0][3]) not in files  # the head's last chunk is gone
    written = {stem(k) for group in keys for k in group[4:]} & files
    assert not written, sorted(written)
    assert not unreachable_files([keys], files, sched)


@pytest.mark.parametrize("layout", ["gemma3", "gemma4"])
def test_no_kept_file_is_unreachable_with_sliding_window_groups(
    model_config,  # noqa: F811 (a fixture of test_tiering_hma)
    tmp_path,
    layout,
):
    """A shared-prefix workload with revisits over a budget of 16 chunks
    32 prompts of 4 shared heads and 4 chunks of
    their own, then 64 revisits, each looked up through the connector
    scheduler (promoting its disk hit) and then offloaded. Heads and tails
    leave the disk while the CPU tier still holds chunks before them, so
    stores come past gaps. After each request (its jobs done) no kept file
    is unreachable: no file of any group is written past a full-attention
    gap (gemma4: full-attention chunks of 32 tokens, sliding-window ones of
    16), and a chunk left with sliding-window files alone goes with its
    evicted full-attention child."""
    root_dir = str(tmp_path / "fs")
    probe = Engine(model_config, layout, root_dir, 64)
    max_bytes = 16 * chunk_bytes_on_disk(probe)
    engine = budget_engine(model_config, layout, root_dir, max_bytes=max_bytes)
    sched = engine.connector_scheduler()
    (tier,) = tiering_manager(sched).secondary_tiers
    budget = tier._budget  # type: ignore[attr-defined]
    heads = [[(11 * i + 101 * h + 3) % 500 for i in range(64)] for h in range(4)]
    prompts = [
        heads[p % 4] + [(7 * i + 13 * p + 1) % 500 for i in range(65)]
        for p in range(32)
    ]
    rng = random.Random(19)
    order = list(range(32)) + [
        max(rng.randrange(32), rng.randrange(32)) for _ in range(64)
    ]
    all_keys: list = []
    counts = []  # unreachable / kept files after each request
    try:
        for i, p in enumerate(order):
            lookup = request_of(engine, f"lookup{i}", prompts[p])
            sched.on_new_request(lookup)
            settled: set[str] = set()
            for _ in range(3):
                settle_step(sched, [lookup], settled)
            assert settled
            keys = store_prompt(sched, request_of(engine, f"req{i}", prompts[p]))
            if i < 32:
                all_keys.append(keys)
            # not halfway through the budget thread's removals, nor one that
            # started while the files were listed (a loaded machine)
            while True:
                wait_until(lambda: budget.unlinking == 0)
                evicted = budget.evicted_files
                files = block_files(root_dir)
                if budget.unlinking == 0 and budget.evicted_files == evicted:
                    break
            lost = unreachable_files(all_keys, files, sched)
            counts.append(f"{len(lost)}/{len(files)}")
    finally:
        sched.shutdown()
    assert all(c.startswith("0/") for c in counts), counts


# ---------------------------------------------------------------------------
# At the tier
# ---------------------------------------------------------------------------

_ROW_ELEMENTS = 1024  # float32: a 4 KiB block file


def make_tier(root_dir: str, rows, group_tokens=(), events=False, windows=(), **config):
    """An fs tier over rows (a page-aligned tensor), with a spec of KV cache
    groups of group_tokens tokens a chunk (none: no group known), full
    attention, or sliding-window ones of windows[g] chunks where that is
    not None."""
    spec = _make_offloading_spec(enable_kv_cache_events=events)
    spec.config = dataclasses.replace(
        spec.config,
        groups=tuple(
            OffloadingGroupConfig(
                tokens_per_block=tokens,
                layer_names=(f"l{g}",),
                group_id=g,
                sliding_window_size_in_chunks=windows[g] if windows else None,
            )
            for g, tokens in enumerate(group_tokens)
        ),
    )
    return FileSystemTierManager(
        offloading_spec=spec,
        primary_kv_view=memoryview(rows.numpy()),
        tier_type="fs",
        root_dir=root_dir,
        n_read_threads=2,
        n_write_threads=2,
        enable_kv_events=events,
        **config,
    )


def block_key(n: int) -> OffloadKey:
    return make_offload_key(f"budget-{n}".encode().ljust(32, b"\0"), 0)


def store_keys(tier, keys: list[OffloadKey], first_job: int, rows) -> list:
    """Store each key in its own job (row i % rows holds key i's bytes)."""
    results = []
    for i, k in enumerate(keys):
        rows[i % len(rows)] = float(first_job + i)
        tier.submit_store(make_job(first_job + i, [k], [i % len(rows)]))
        results.extend(drain(tier))
    return results


def applied(budget):
    """The budget once the events the scheduler thread posted so far are
    applied (the next store job's task or the budget thread would)."""
    with budget._lock:
        budget._apply()
    return budget


def wait_until(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def prompt_ctx(req_id: str, keys: list[OffloadKey]) -> ReqContext:
    """A request's context with its keys' positions, as the connector
    records them (16 tokens a chunk)."""
    ctx = ReqContext(req_id)
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, 16 * (i + 1))
    return ctx


def test_file_with_a_load_in_flight_is_not_evicted(tmp_path, monkeypatch):
    """A budget of two files, both stored; one has a load in flight (held
    in its read) and the other was reported present by lookup() in this
    step: a store of a new key evicts neither (it fails, and the budget's
    rejection warning says why), the load reads the stored bytes, and once
    the step ends and the load is done a store evicts."""
    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path), rows, max_bytes=2 * page)
    release = threading.Event()
    batch_load_block = fs_manager.batch_load_block

    def slow_load(*args, **kwargs):
        assert release.wait(30)
        return batch_load_block(*args, **kwargs)

    monkeypatch.setattr(fs_manager, "batch_load_block", slow_load)
    try:
        a, b, c, d = (block_key(i) for i in range(1, 5))
        assert all(r.success for r in store_keys(tier, [a, b], 40, rows))
        tier.submit_load(make_job(10, [a], [5], is_promotion=True))
        # reported present: its promotion follows at the end of the step
        assert lookup_and_wait(tier, [b]) == [LookupResult.HIT]
        tier.submit_store(make_job(20, [c], [2]))
        deadline = time.monotonic() + 30
        results: list = []
        while not results and time.monotonic() < deadline:
            results = list(tier.get_finished_jobs())
            time.sleep(0.01)
        ((result),) = results
        assert result.job_id == 20 and not result.success  # no room
        assert tier._budget.rejected_files == 1
        assert not os.path.exists(tier.file_mapper.get_file_name(c))
        release.set()
        (loaded,) = drain(tier)
        assert loaded.success
        assert (rows[5] == 40.0).all()  # a's bytes (its job's number)
        assert os.path.exists(tier.file_mapper.get_file_name(b))
        tier.on_schedule_end(ScheduleEndContext((), ()))  # the step ends
        # nothing in flight any more: the least recent is evicted for d
        (result,) = store_keys(tier, [d], 30, rows)
        assert result.success
        assert os.path.exists(tier.file_mapper.get_file_name(d))
        assert disk_bytes(str(tmp_path)) <= 2 * page
    finally:
        release.set()
        tier.shutdown()


def test_an_evicted_file_is_a_miss_until_it_is_removed(tmp_path):
    """A store evicts a chunk and an I/O thread removes its file later: in
    between, lookup() answers the evicted key as a miss (a promotion of it
    would load a file being removed), and a store of that key is not
    written (the pending removal would delete the new file)."""
    rows = _page_aligned_zero_tensor(4, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path), rows, max_bytes=page)  # one file
    budget = tier._budget
    release = threading.Event()
    try:
        assert budget.scan_done.wait(30)
        k1, k2 = block_key(1), block_key(2)
        store_keys(tier, [k1], 0, rows)
        path1 = tier.file_mapper.get_file_name(k1)
        real_remove = budget.remove_evicted

        def held_remove(evicted):
            release.wait(30)
            real_remove(evicted)

        budget.remove_evicted = held_remove
        tier.submit_store(make_job(1, [k2], [1]))
        # its task's admission evicts k1, whose file stays on disk until the
        # removal runs
        wait_until(lambda: budget.is_removing(k1))
        assert os.path.exists(path1)
        assert tier.lookup(k1, _CTX) is LookupResult.MISS
        tier.submit_store(make_job(2, [k1], [2]))
        release.set()
        assert all(r.success for r in drain(tier))
        assert not os.path.exists(path1)
        assert lookup_and_wait(tier, [k1, k2]) == [
            LookupResult.MISS,
            LookupResult.HIT,
        ]
        assert disk_bytes(str(tmp_path)) <= page
    finally:
        release.set()
        tier.shutdown()


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "key_file"])
def test_an_evicted_key_looked_up_before_is_a_miss(tmp_path, keyed):
    """A key lookup() found (the verdict is cached for its request) and
    then evicted: its next lookup is a miss, not a promotion of a file that
    is gone. Also with a key_file, whose file names do not give the block
    hash back."""
    rows = _page_aligned_zero_tensor(4, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    config = {"key_file": key_file(tmp_path / "key")} if keyed else {}
    # one file
    tier = make_tier(str(tmp_path / "kv"), rows, max_bytes=page, **config)
    try:
        k1, k2 = block_key(1), block_key(2)
        store_keys(tier, [k1], 0, rows)
        assert lookup_and_wait(tier, [k1]) == [LookupResult.HIT]
        tier.on_schedule_end(ScheduleEndContext((), ()))  # no promotion
        (result,) = store_keys(tier, [k2], 1, rows)  # evicts k1
        assert result.success
        assert not os.path.exists(tier.file_mapper.get_file_name(k1))
        assert tier.lookup(k1, _CTX) is LookupResult.MISS
    finally:
        tier.shutdown()


def test_a_load_that_fails_leaving_its_file_keeps_it_counted(tmp_path, monkeypatch):
    """A load that fails with its file still there (EMFILE, EIO, an
    unreadable MAC): the file stays counted in the budget and evictable,
    so that the next stores keep the tier's files within max_bytes."""
    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    root = str(tmp_path / "kv")
    tier = make_tier(root, rows, max_bytes=2 * page)
    try:
        assert tier._budget.scan_done.wait(30)
        a, b, c, d = (block_key(i) for i in range(1, 5))
        assert all(r.success for r in store_keys(tier, [a, b], 0, rows))
        real_load = fs_manager.batch_load_block

        def emfile(*args, **kwargs):
            e = OSError(errno.EMFILE, "Too many open files")
            e.failed_indices = [0]  # type: ignore[attr-defined]
            raise e

        monkeypatch.setattr(fs_manager, "batch_load_block", emfile)
        tier.submit_load(make_job(9, [a], [5], is_promotion=True))
        (result,) = drain(tier)
        assert not result.success
        monkeypatch.setattr(fs_manager, "batch_load_block", real_load)
        assert os.path.exists(tier.file_mapper.get_file_name(a))
        assert tier._budget.used == 2 * page
        tier.on_schedule_end(ScheduleEndContext((), ()))
        assert all(r.success for r in store_keys(tier, [c, d], 20, rows))
        assert disk_bytes(root) <= 2 * page
        assert not os.path.exists(tier.file_mapper.get_file_name(a))
    finally:
        tier.shutdown()


def test_a_load_that_removed_a_bad_file_uncounts_it(tmp_path):
    """A block file cut short on disk: its load fails, removes the file, and
    the budget no longer counts it (the other file stays counted)."""
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path / "kv"), rows, max_bytes=4 * page)
    try:
        a, b = block_key(1), block_key(2)
        assert all(r.success for r in store_keys(tier, [a, b], 0, rows))
        path = tier.file_mapper.get_file_name(a)
        os.truncate(path, page // 2)
        tier.submit_load(make_job(9, [a], [5], is_promotion=True))
        (result,) = drain(tier)
        assert not result.success
        assert not os.path.exists(path)
        tier.on_schedule_end(ScheduleEndContext((), ()))
        assert applied(tier._budget).used == page
    finally:
        tier.shutdown()


def test_a_store_that_fails_with_any_exception_counts_nothing(tmp_path, monkeypatch):
    """Whatever a store raises (an OSError, or another exception from a
    bug), the budget counts only the files that are there: jobs that wrote
    nothing leave it at 0 bytes."""
    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path / "kv"), rows, max_bytes=4 * page)
    try:
        assert tier._budget.scan_done.wait(30)

        def broken(*args, **kwargs):
            raise RuntimeError("a bug in the store path")

        monkeypatch.setattr(fs_manager, "batch_store_block", broken)
        results = store_keys(tier, [block_key(1), block_key(2)], 0, rows)
        assert [r.success for r in results] == [False, False]
        assert applied(tier._budget).used == 0
    finally:
        tier.shutdown()


def test_a_directory_in_a_blocks_way_is_not_counted(tmp_path):
    """A store that fails for a directory it cannot replace counts only the
    block it wrote, not the directory (before: both, so the budget evicted
    for bytes never written)."""
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path / "kv"), rows, max_bytes=4 * page)
    try:
        assert tier._budget.scan_done.wait(30)
        a, b = block_key(1), block_key(2)
        os.makedirs(os.path.join(tier.file_mapper.get_file_name(a), "not_a_block"))
        tier.submit_store(make_job(1, [a, b], [0, 1]))
        assert [r.success for r in drain(tier)] == [False]
        assert applied(tier._budget).used == page
    finally:
        tier.shutdown()


def test_an_evicted_file_that_cannot_be_removed_is_reported(tmp_path, caplog_vllm):
    """An evicted file whose removal fails for another reason than being
    gone (here a directory at its path; a read-only mount alike) is
    counted and reported in the tier's rate-limited failure report: it
    takes disk space beyond max_bytes."""
    rows = _page_aligned_zero_tensor(4, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path / "kv"), rows, max_bytes=page)  # one file
    try:
        assert tier._budget.scan_done.wait(30)
        k1, k2 = block_key(1), block_key(2)
        assert all(r.success for r in store_keys(tier, [k1], 0, rows))
        path = tier.file_mapper.get_file_name(k1)
        os.remove(path)
        os.makedirs(os.path.join(path, "x"))
        with caplog_vllm.at_level(logging.ERROR):
            (result,) = store_keys(tier, [k2], 1, rows)  # evicts k1
        assert result.success
        errors = [r.getMessage() for r in caplog_vllm.records if r.levelname == "ERROR"]
        assert any(
            "1 evicted block file(s) could not be removed" in m for m in errors
        ), errors
        assert tier._budget.removal_errors == 1
    finally:
        tier.shutdown()


def test_evicted_files_that_cannot_be_removed_stay_counted(tmp_path, monkeypatch):
    """Every removal fails (not ENOENT): the evicted files stay and stay
    counted, so stores are refused once they fill max_bytes, not written
    beyond it store after store."""
    rows = _page_aligned_zero_tensor(4, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path / "kv"), rows, max_bytes=2 * page)
    try:
        assert tier._budget.scan_done.wait(30)
        assert all(r.success for r in store_keys(tier, [block_key(0)], 0, rows))
        monkeypatch.setattr(os, "remove", os.rmdir)  # ENOTDIR on a file
        store_keys(tier, [block_key(n) for n in range(1, 10)], 1, rows)
        assert disk_bytes(str(tmp_path / "kv")) <= 2 * 2 * page
    finally:
        tier.shutdown()


def test_rejections_warn_rate_limited_and_failed_writes_stay_errors(
    tmp_path, caplog_vllm
):
    """A store refused for want of room (every file pinned) is the budget
    working, not the disk failing: it fails its job and is reported on the
    budget's own warning (at once, then at most one line per interval, with
    the counts and max_bytes), never on the tier's I/O failure line; a
    write that fails on the disk is still reported there."""
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path), rows, max_bytes=2 * page)
    a, b = block_key(1), block_key(2)
    try:
        with caplog_vllm.at_level(logging.WARNING):
            assert all(r.success for r in store_keys(tier, [a, b], 0, rows))
            # reported present: pinned until the step ends
            assert lookup_and_wait(tier, [a, b]) == [LookupResult.HIT] * 2
            tier.submit_store(make_job(10, [block_key(3)], [2]))
            assert [r.success for r in drain(tier)] == [False]
            # the first warning out before the second refusal: one tick of
            # the budget thread could refuse both and say so in one line
            wait_until(lambda: "not written" in caplog_vllm.text)
            tier.submit_store(make_job(20, [block_key(4)], [3]))
            assert [r.success for r in drain(tier)] == [False]
            assert tier._budget.rejected_files == 2
            tier.on_schedule_end(ScheduleEndContext((), ()))  # pins released
            # a write that fails on the disk: a non-empty directory in the way
            path = tier.file_mapper.get_file_name(block_key(5))
            os.makedirs(os.path.join(path, "x"))
            (failed,) = store_keys(tier, [block_key(5)], 30, rows)
            assert not failed.success
            tier.shutdown()
        records = caplog_vllm.records
        warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        errors = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
        rejections = [m for m in warnings if "not written" in m]
        # the first at once; the second, within the interval, at shutdown
        assert len(rejections) == 2, rejections
        assert "1 block file(s) of 1 store job(s)" in rejections[0]
        assert f"max_bytes={2 * page}" in rejections[0]
        assert "(2 and 2 since start)" in rejections[1]
        # the I/O failure line counts the failed write only
        assert len(errors) == 1, errors
        assert "1 store job(s) and 0 load job(s) failed" in errors[0]
        assert "no room in max_bytes" not in errors[0]
    finally:
        tier.shutdown()


def test_the_written_keys_of_a_partly_refused_store_are_reported_stored(tmp_path):
    """A store job the budget refuses part of fails, but the keys it wrote
    are on disk and counted: with KV events they are published as stored
    (so that their eviction later, published as removed, follows a store
    a router saw), the refused ones are not."""
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(
        str(tmp_path), rows, group_tokens=(16,), events=True, max_bytes=2 * page
    )
    a, c, d = block_key(1), block_key(3), block_key(4)
    try:
        assert all(r.success for r in store_keys(tier, [a], 0, rows))
        assert lookup_and_wait(tier, [a]) == [LookupResult.HIT]  # pinned
        # one file of room: c (its prompt's first chunk) is written, d not
        ctx = prompt_ctx("req", [c, d])
        tier.submit_store(TransferJob(10, [c, d], np.arange(1, 3), False, ctx))
        (result,) = drain(tier)
        assert not result.success
        assert tier._budget.rejected_files == 1
        assert os.path.exists(tier.file_mapper.get_file_name(c))
        assert not os.path.exists(tier.file_mapper.get_file_name(d))
        events = [(list(e.keys), e.removed) for e in tier.take_events()]
        assert events == [([a], False), ([c], False)]
        # c is counted and evictable: its eviction is published after it
        tier.on_schedule_end(ScheduleEndContext((), ()))
        store_keys(tier, [block_key(5), block_key(6)], 20, rows)
        events = [(list(e.keys), e.removed) for e in tier.take_events()]
        assert ([c], True) in events
        assert disk_bytes(str(tmp_path)) <= 2 * page
    finally:
        tier.shutdown()


def test_a_hit_makes_a_file_the_most_recently_used(tmp_path):
    """Recency comes from the tier's own lookups, not from touch() (which
    vLLM 0.34.0 removed): a file lookup() found is the most recently used
    once its step ends, so a store evicts the file stored after it and not
    looked up since."""
    rows = _page_aligned_zero_tensor(4, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path), rows, max_bytes=2 * page)
    a, b, c = block_key(1), block_key(2), block_key(3)
    try:
        assert all(r.success for r in store_keys(tier, [a, b], 0, rows))
        assert lookup_and_wait(tier, [a]) == [LookupResult.HIT]
        tier.on_schedule_end(ScheduleEndContext((), ()))  # no promotion
        (result,) = store_keys(tier, [c], 10, rows)  # evicts one file
        assert result.success
        on_disk = [os.path.exists(tier.file_mapper.get_file_name(k)) for k in (a, b, c)]
        assert on_disk == [True, False, True]
    finally:
        tier.shutdown()


def test_a_store_marks_present_only_the_keys_it_wrote(tmp_path):
    """A finished store turns its keys' cached lookup misses into hits
    (mark_present). With a budget a store may write fewer keys than it
    carries: one refused for room (the job fails, its written keys are
    stored), or one past a gap (its predecessor is on no disk; the job
    succeeds). Only the written keys become hits: the others stay misses,
    not promotions of files that are not there."""
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path), rows, group_tokens=(16,), max_bytes=2 * page)
    a, c, d, e = block_key(1), block_key(3), block_key(4), block_key(5)
    ctx = prompt_ctx("req", [c, d, e])
    try:
        # the request's lookups found nothing yet: cached misses
        assert lookup_and_wait(tier, [c, d, e], ctx) == [LookupResult.MISS] * 3
        assert all(r.success for r in store_keys(tier, [a], 0, rows))
        assert lookup_and_wait(tier, [a]) == [LookupResult.HIT]  # pinned
        # one file of room: c is written, d refused
        tier.submit_store(TransferJob(10, [c, d], np.arange(1, 3), False, ctx))
        (result,) = drain(tier)
        assert not result.success
        assert tier.lookup(c, ctx) is LookupResult.HIT
        assert tier.lookup(d, ctx) is LookupResult.MISS
        tier.on_schedule_end(ScheduleEndContext((), ()))
        # e follows d, which is on no disk: not written, the job succeeds
        tier.submit_store(TransferJob(11, [e], np.arange(3, 4), False, ctx))
        (result,) = drain(tier)
        assert result.success
        assert not os.path.exists(tier.file_mapper.get_file_name(e))
        assert tier.lookup(e, ctx) is LookupResult.MISS
    finally:
        tier.shutdown()


def test_no_filesystem_call_on_the_scheduler_thread_after_the_scan(
    tmp_path, monkeypatch
):
    """A store whose predecessor is not indexed, once the start-up scan is
    done: the predecessor is on no disk (not written: it could never hit),
    found without a filesystem call on the scheduler thread. A predecessor
    lookup() found (another engine's file) is on disk: written."""
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    root = str(tmp_path / "kv")
    tier = make_tier(root, rows, group_tokens=(16,), max_bytes=8 * page)
    other = make_tier(root, rows, group_tokens=(16,))  # another engine
    scheduler = threading.current_thread()
    calls: list[str] = []

    def on_scheduler_thread(name, real):
        def check(*args, **kwargs):
            if threading.current_thread() is scheduler:
                calls.append(f"{name}{args}")
            return real(*args, **kwargs)

        return check

    try:
        assert tier._budget.scan_done.wait(30)
        keys = [block_key(i) for i in range(4)]
        ctx = prompt_ctx("req", keys)
        store_keys(other, [keys[2]], 0, rows)
        assert lookup_and_wait(tier, [keys[2]]) == [LookupResult.HIT]
        for name in ("exists", "lexists"):
            monkeypatch.setattr(
                os.path, name, on_scheduler_thread(name, getattr(os.path, name))
            )
        for name in ("stat", "lstat"):
            monkeypatch.setattr(os, name, on_scheduler_thread(name, getattr(os, name)))
        # keys[0] was never stored: keys[1] could never hit
        tier.submit_store(TransferJob(1, [keys[1]], np.arange(1), False, ctx))
        # keys[2] (another engine's) was found by lookup(): keys[3] can hit
        ctx = prompt_ctx(_CTX.req_id, keys)
        tier.submit_store(TransferJob(2, [keys[3]], np.arange(1), False, ctx))
        assert calls == []
        monkeypatch.undo()
        assert all(r.success for r in drain(tier))
        assert tier._budget.unreachable_files == 1
        assert not os.path.exists(tier.file_mapper.get_file_name(keys[1]))
        assert os.path.exists(tier.file_mapper.get_file_name(keys[3]))
    finally:
        tier.shutdown()
        other.shutdown()


def test_eviction_is_published_as_removed_kv_events(tmp_path):
    """With KV events, an evicted block is published as removed (a router
    must not send requests for it here), after its store was published."""
    rows = _page_aligned_zero_tensor(4, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path), rows, events=True, max_bytes=page)
    try:
        k1, k2 = block_key(1), block_key(2)
        store_keys(tier, [k1, k2], 0, rows)
        events = [(list(e.keys), e.removed) for e in tier.take_events()]
        assert events == [([k1], False), ([k1], True), ([k2], False)]
    finally:
        tier.shutdown()


def test_the_files_times_are_their_prompts_order(tmp_path):
    """A restart reads the order back from the files' times: a prompt's
    files (written head first, in two jobs) end up with times that fall
    from its head to its tail, and a hit makes its chunk's file the newest."""
    rows = _page_aligned_zero_tensor(4, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path), rows, group_tokens=(16,), max_bytes=8 * page)
    keys = [block_key(i) for i in range(4)]
    other = block_key(10)

    def mtimes(ks):
        paths = [tier.file_mapper.get_file_name(k) for k in ks]
        return [os.stat(p).st_mtime_ns for p in paths]

    try:
        ctx = prompt_ctx("req", keys)
        for j in (0, 2):
            tier.submit_store(TransferJob(j, keys[j : j + 2], np.arange(2), False, ctx))
            drain(tier)
        assert all(r.success for r in store_keys(tier, [other], 10, rows))
        # written at once (one kernel tick), then set to their order
        wait_until(lambda: mtimes(keys) == sorted(set(mtimes(keys)), reverse=True))
        assert lookup_and_wait(tier, [keys[3]]) == [LookupResult.HIT]
        tier.on_schedule_end(ScheduleEndContext((), ()))
        wait_until(lambda: mtimes([keys[3]])[0] > max(mtimes([other] + keys[:3])))
    finally:
        tier.shutdown()


def test_a_chunk_a_coarser_group_stored_first_goes_before_its_head(tmp_path):
    """Groups of 32 and 16 tokens a chunk share the block hash at every
    32 tokens: that chunk is first stored by the coarse group (its first
    chunk) and then by the fine group, after the 16-token chunk before it.
    It is the prompt's tail: a store that needs room evicts it (both its
    files) and keeps the head."""
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path), rows, group_tokens=(32, 16), max_bytes=3 * page)
    try:
        head, tail = b"h" * 32, b"t" * 32
        coarse = make_offload_key(tail, 0)  # tokens 0-32
        fine = [make_offload_key(head, 1), make_offload_key(tail, 1)]
        ctx = ReqContext("req")
        ctx.set_offload_key_position(coarse, 32)
        ctx.set_offload_key_position(fine[0], 16)
        ctx.set_offload_key_position(fine[1], 32)
        tier.submit_store(TransferJob(0, [coarse, fine[0]], np.arange(2), False, ctx))
        drain(tier)
        tier.submit_store(TransferJob(1, [fine[1]], np.arange(1), False, ctx))
        drain(tier)
        assert len(block_files(str(tmp_path))) == 3
        # a newer request's key needs one file: the tail's two go
        assert all(r.success for r in store_keys(tier, [block_key(9)], 10, rows))
        on_disk = [
            os.path.exists(tier.file_mapper.get_file_name(k))
            for k in (fine[0], coarse, fine[1])
        ]
        assert on_disk == [True, False, False]
    finally:
        tier.shutdown()


def test_a_sliding_window_file_is_written_only_with_its_covering_chunk(tmp_path):
    """A full-attention group and a sliding-window group, 16 tokens a chunk:
    a store job of sliding-window keys alone (the connector stores them
    apart when the CPU tier holds the chunk's other files) writes no file
    past the request's last full-attention file on disk: such a file could
    never hit. Once its full-attention chunk is on disk, it is written."""
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(
        str(tmp_path),
        rows,
        group_tokens=(16, 16),
        windows=(None, 1),
        max_bytes=16 * page,
    )
    budget = tier._budget
    try:
        hashes = [bytes([i + 1]) * 32 for i in range(4)]
        full = [make_offload_key(h, 0) for h in hashes]
        window = [make_offload_key(h, 1) for h in hashes]
        ctx = ReqContext("req")
        for i in range(4):
            ctx.set_offload_key_position(full[i], 16 * (i + 1))
            ctx.set_offload_key_position(window[i], 16 * (i + 1))
        keys = full[:2] + window[:2]
        tier.submit_store(TransferJob(0, keys, np.arange(4), False, ctx))
        drain(tier)
        # chunks 2 and 3: their full-attention files were not stored (their
        # store failed, or was refused)
        tier.submit_store(TransferJob(1, window[2:], np.arange(2), False, ctx))
        drain(tier)
        on_disk = block_files(str(tmp_path))
        assert {stem(k) for k in keys} <= on_disk
        assert not {stem(k) for k in window[2:]} & on_disk
        assert budget.unreachable_files == 2
        # chunk 2's full-attention file is stored: its sliding-window file
        # can hit now
        tier.submit_store(TransferJob(2, [full[2]], np.arange(1), False, ctx))
        drain(tier)
        tier.submit_store(TransferJob(3, [window[2]], np.arange(1), False, ctx))
        drain(tier)
        on_disk = block_files(str(tmp_path))
        assert {stem(full[2]), stem(window[2])} <= on_disk
        assert stem(window[3]) not in on_disk
    finally:
        tier.shutdown()


def test_a_chunk_left_with_sliding_window_files_alone_goes_with_its_child(
    tmp_path,
):
    """Full attention of 32 tokens a chunk, sliding window of 16: the
    sliding-window file at 48 tokens hits only with the full-attention
    chunk at 64 (its child, with that chunk's sliding-window file). When
    the child is evicted, it is evicted with it, in the same eviction, not
    kept unreachable until a later one; the prefix before it stays."""
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(
        str(tmp_path),
        rows,
        group_tokens=(32, 16),
        windows=(None, 1),
        max_bytes=6 * page,
    )
    try:
        hashes = [bytes([i + 1]) * 32 for i in range(4)]  # at 16, 32, 48, 64
        full = [make_offload_key(hashes[1], 0), make_offload_key(hashes[3], 0)]
        window = [make_offload_key(h, 1) for h in hashes]
        ctx = ReqContext("req")
        for i, k in enumerate(full):
            ctx.set_offload_key_position(k, 32 * (i + 1))
        for i, k in enumerate(window):
            ctx.set_offload_key_position(k, 16 * (i + 1))
        keys = full + window
        tier.submit_store(TransferJob(0, keys, np.arange(6), False, ctx))
        drain(tier)
        assert {stem(k) for k in keys} == block_files(str(tmp_path))
        # another prompt's first chunk: room for its 2 files
        other = [make_offload_key(b"o" * 32, g) for g in range(2)]
        ctx = ReqContext("other")
        for k in other:
            ctx.set_offload_key_position(k, 32)
        tier.submit_store(TransferJob(1, other, np.arange(2), False, ctx))
        drain(tier)
        on_disk = block_files(str(tmp_path))
        gone = {stem(full[1]), stem(window[3]), stem(window[2])}
        assert not gone & on_disk
        assert {stem(full[0]), stem(window[0]), stem(window[1])} <= on_disk
        assert {stem(k) for k in other} <= on_disk
    finally:
        tier.shutdown()


def test_two_tiers_on_one_root_keep_their_budgets(tmp_path, monkeypatch):
    """Two engines' tiers on one root (the same model and layout: the same
    directory), each with a budget of three files, store the same key and
    then five of their own: each stays within its budget, the root within
    the sum, and a file the other engine removed is a miss for a tier that
    indexed it (no error, no wrong bytes)."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    # neither lists the root after its start (which would count the other's
    # files in one max_bytes), however slow this machine
    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 1e9)
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    root = str(tmp_path)
    first = make_tier(root, rows, max_bytes=3 * page)
    second = make_tier(root, rows, max_bytes=3 * page)
    try:
        shared = block_key(0)
        store_keys(first, [shared], 0, rows)
        store_keys(second, [shared], 0, rows)
        store_keys(first, [block_key(100 + i) for i in range(5)], 10, rows)
        store_keys(second, [block_key(200 + i) for i in range(5)], 10, rows)
        assert first._budget.used <= 3 * page
        assert second._budget.used <= 3 * page
        assert disk_bytes(root) <= 6 * page
        assert lookup_and_wait(first, [shared]) == [LookupResult.MISS]
        # a load of a key another engine removed under it: a miss, not bytes
        k = block_key(104)
        assert lookup_and_wait(first, [k]) == [LookupResult.HIT]
        os.remove(first.file_mapper.get_file_name(k))
        first.submit_load(make_job(50, [k], [6], is_promotion=True))
        (result,) = drain(first)
        assert not result.success and not result.successful_keys
    finally:
        first.shutdown()
        second.shutdown()


def _row_of(key: OffloadKey) -> float:
    """The value a key's block holds in the shared-root test (all its floats)."""
    return float(int.from_bytes(sha256(key)[:2], "big"))


def _engine_on_shared_root(root, engine, rounds, first_round, kill_in, report):
    """One engine of test_engines_on_one_root_survive_one_killed_mid_store (a
    process of its own): stores prompts of a shared head and chunks of its
    own, 8 keys a job, looks them up and loads them back, and reports per
    round its budget's bytes and the loads whose bytes were wrong. With
    kill_in, the store of that round writes half its files, reports
    "storing" and waits to be killed."""
    rows = _page_aligned_zero_tensor(16, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(root, rows, group_tokens=(16,), max_bytes=8 * page)
    store = fs_manager.batch_store_block

    def half_then_hang(paths, view, offsets, *args):
        store(paths[: len(paths) // 2], view, offsets[: len(offsets) // 2], *args)
        report.send((engine, "storing"))
        time.sleep(600)

    try:
        assert tier._budget.scan_done.wait(60)
        for r in range(first_round, first_round + rounds):
            head = [block_key(i) for i in range(4)]
            own = [block_key(10000 * engine + 10 * r + i) for i in range(4)]
            keys = head + own
            for i, k in enumerate(keys):
                rows[i] = _row_of(k)
            if r == kill_in:
                fs_manager.batch_store_block = half_then_hang
            ctx = prompt_ctx(f"e{engine}-r{r}", keys)
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
    import multiprocessing
    import signal

    # one layout for all: the same hash seed (the block hashes' NONE_HASH)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    ctx = multiprocessing.get_context("spawn")
    root = str(tmp_path / "fs")
    page = _page_aligned_zero_tensor(1, _ROW_ELEMENTS).numpy().nbytes
    reports = []  # one pipe per process: a killed one holds no shared lock

    def start(engine, rounds, first_round=0, kill_in=-1):
        received, sent = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_engine_on_shared_root,
            args=(root, engine, rounds, first_round, kill_in, sent),
        )
        p.start()
        reports.append(received)
        return p

    procs = [start(0, 6), start(1, 6), start(2, 6, kill_in=2)]
    rounds: list = []
    try:
        assert reports[2].poll(120), "engine 2 never reached its store"
        while (item := reports[2].recv()) != (2, "storing"):
            rounds.append(item)
        os.kill(procs[2].pid, signal.SIGKILL)
        procs[2].join(30)
        procs.append(start(2, 3, first_round=3))
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
        [(e, r) for e in (0, 1) for r in range(6)]
        + [(2, 0), (2, 1)]
        + [(2, r) for r in range(3, 6)]
    )
    assert all(used <= 8 * page for _, _, used, _ in rounds), rounds
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
            assert data.size == _ROW_ELEMENTS and (data == _row_of(key)).all(), name
    assert 0 < files <= 3 * 8


# ---------------------------------------------------------------------------
# The budget alone (FsTierBudget), as the tier's threads call it
# ---------------------------------------------------------------------------


def _budget_on(root: str, max_files: int, wait_scan: bool = True, **kwargs):
    """An FsTierBudget over real files of 4 KiB under root, 16 tokens a
    chunk, and the path of a key's file."""
    from vllm.v1.kv_offload.tiering.fs.budget import FsTierBudget

    def chunk_path(h: bytes, g: int) -> str:
        hex_h = h.hex()
        return os.path.join(root, hex_h[:3], f"{hex_h[3:5]}_g{g}", f"{hex_h}.bin")

    def path_of(key: OffloadKey) -> str:
        return chunk_path(key[:-4], 0)

    budget = FsTierBudget(
        max_files * 4096,
        [4096],
        root,
        path_of,
        chunk_path,
        "test tier",
        {0: 16},
        **kwargs,
    )
    assert not wait_scan or budget.scan_done.wait(30)
    return budget, path_of


def _store_one(budget, path_of, key: OffloadKey, req_id: str) -> None:
    """One key's store job, as the tier's store task runs it."""
    job = budget.admit_store([key], req_id, {key: 16})
    rejected, unreachable, evicted = budget.admitted(job)
    budget.remove_evicted(evicted)
    written = [] if key in rejected or key in unreachable else [key]
    _write_files(path_of, written)
    budget.written(job, written)
    budget.finish_job(job, [])


def _write_files(path_of, keys) -> None:
    for k in keys:
        os.makedirs(os.path.dirname(path_of(k)), exist_ok=True)
        with open(path_of(k), "wb") as f:
            f.write(b"\0" * 4096)


def test_a_store_builds_on_an_earlier_runs_file(tmp_path):
    """A prompt's head is on disk from an earlier run, neither indexed nor
    looked up: a store of its next chunk is written (no gap), and the head
    is indexed, counted in the budget."""
    budget, path_of = _budget_on(str(tmp_path), 8)
    budget.shutdown()
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(1, 3)]
    _write_files(path_of, keys[:1])
    budget, _ = _budget_on(str(tmp_path), 8)
    try:
        job = budget.admit_store(keys[1:], "req", {keys[0]: 16, keys[1]: 32})
        rejected, unreachable, _ = budget.admitted(job)
        assert not rejected and not unreachable
        assert budget.used == 2 * 4096  # the head, and the key being written
        budget.finish_job(job, [])
    finally:
        budget.shutdown()


def test_a_store_never_builds_on_a_chunk_being_removed(tmp_path):
    """A store evicts a prompt's head; before its task removes the head's
    file, a store of the same prompt's next chunk is admitted: the head is
    being removed, so the next chunk is past a gap (not written), and the
    head is not indexed again (no counted file without a file on disk)."""
    budget, path_of = _budget_on(str(tmp_path), 2)
    head, after = (make_offload_key(bytes([i]) * 32, 0) for i in (1, 2))
    others = [make_offload_key(bytes([i]) * 32, 0) for i in (3, 4)]
    try:
        job = budget.admit_store([head], "old", {head: 16})
        budget.admitted(job)
        _write_files(path_of, [head])
        budget.finish_job(job, [])
        time.sleep(0.001)  # "new" is first seen later: its chunks are newer
        for k in others:
            job = budget.admit_store([k], "new", {others[0]: 16, others[1]: 32})
            _, _, evicted = budget.admitted(job)
            _write_files(path_of, [k])
            budget.finish_job(job, [])
        assert [victim[0] for victim in evicted] == [head[:-4]]
        assert os.path.exists(path_of(head))  # its task has not removed it yet
        job = budget.admit_store([after], "old", {head: 16, after: 32})
        rejected, unreachable, _ = budget.admitted(job)
        assert unreachable == {after} and not rejected
        assert budget.used == 2 * 4096
        budget.finish_job(job, [])
        budget.remove_evicted(evicted)
    finally:
        budget.shutdown()


def test_a_chunk_lookup_found_is_not_evicted_by_a_store_before_it(tmp_path):
    """A store is submitted, then lookup() finds an old chunk and its load
    is submitted, then the store's task runs: the store must not evict the
    chunk lookup() answered as a hit (its load would fail); it evicts
    another one."""
    budget, path_of = _budget_on(str(tmp_path), 4)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(1, 5)]
    try:
        for i, k in enumerate(keys):  # full: four one-chunk prompts
            job = budget.admit_store([k], f"r{i}", {k: 16})
            budget.admitted(job)
            _write_files(path_of, [k])
            budget.finish_job(job, [])
        new = make_offload_key(bytes([9]) * 32, 0)
        job = budget.admit_store([new], "writer", {new: 16})
        assert budget.on_hit(keys[0], "reader", {keys[0]: 16})  # the oldest
        load = budget.pin_load([keys[0]])
        _, _, evicted = budget.admitted(job)
        assert [victim[0] for victim in evicted] == [keys[1][:-4]]
        budget.finish_job(load, [])
    finally:
        budget.shutdown()


@pytest.mark.parametrize("takes_keys", [True, False])
def test_an_evicted_chunk_waits_only_for_keys_its_tier_takes(tmp_path, takes_keys):
    """An evicted chunk is a miss until its files are gone and, for a tier
    that caches lookup() verdicts, until the tier took its keys. A tier
    that takes none is not waited for and keeps no keys, but the chunk stays
    a miss until the step ends: lookup() may have seen its file before the
    removal."""
    budget, path_of = _budget_on(
        str(tmp_path), 1, takes_evicted_keys=takes_keys, chunk_id=lambda h: h
    )
    k0, k1 = (make_offload_key(bytes([i]) * 32, 0) for i in (1, 2))
    try:
        _store_one(budget, path_of, k0, "r0")
        job = budget.admit_store([k1], "r1", {k1: 16})
        _, _, evicted = budget.admitted(job)  # evicts k0's chunk
        assert budget.is_removing(k0) and not budget.on_hit(k0, "r2", {k0: 16})
        budget.remove_evicted(evicted)
        assert not os.path.exists(path_of(k0))
        assert not budget.on_hit(k0, "r2", {k0: 16})  # in the same step
        assert budget.is_removing(k0) == takes_keys
        assert budget.take_evicted_keys() == ([[k0]] if takes_keys else [])
        assert bool(budget._hash_of) == takes_keys  # k1's block hash
        budget.end_step()
        assert not budget.is_removing(k0)
        _write_files(path_of, [k1])
        budget.finish_job(job, [])
    finally:
        budget.shutdown()


def test_a_restart_after_a_crash_keeps_prompt_heads(tmp_path):
    """The second store job of a prompt is written and the engine stops
    before the job is collected (a crash): its files already carry their
    order times, so a restart with room for two of the four files keeps the
    prompt's head, not its tail."""
    root = str(tmp_path)
    budget, path_of = _budget_on(root, 64)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(1, 5)]
    positions = {k: 16 * (i + 1) for i, k in enumerate(keys)}
    try:
        for part in (keys[:2], keys[2:]):
            job = budget.admit_store(part, "req", positions)
            budget.admitted(job)
            _write_files(path_of, part)
            budget.written(job, part)
        # no finish_job() for the second job: the engine stops here
    finally:
        budget.shutdown()
    budget, _ = _budget_on(root, 2)
    budget.shutdown()
    assert [os.path.exists(path_of(k)) for k in keys] == [True, True, False, False]


def test_a_load_of_a_file_the_scan_has_not_reached_keeps_it(tmp_path, monkeypatch):
    """lookup() finds a file of an earlier run before the start-up scan
    indexed it and its load is submitted: the scan's trim to max_bytes
    removes other files, not the one being loaded."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    root = str(tmp_path)
    budget, path_of = _budget_on(root, 64)
    budget.shutdown()
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(1, 5)]
    _write_files(path_of, keys)
    now = time.time_ns()
    for i, k in enumerate(keys):  # keys[0] the oldest
        os.utime(path_of(k), ns=(now - 10**9 * (4 - i),) * 2)
    gate = threading.Event()
    rescan = budget_module.FsTierBudget._rescan
    monkeypatch.setattr(
        budget_module.FsTierBudget,
        "_rescan",
        lambda b, **kw: (gate.wait(30), rescan(b, **kw)),
    )
    budget, _ = _budget_on(root, 3, wait_scan=False)
    try:
        assert budget.on_hit(keys[0], "r", {keys[0]: 16})
        load = budget.pin_load([keys[0]])
        budget.end_step()
        with budget._lock:
            budget._apply()
        gate.set()
        assert budget.scan_done.wait(30)
        assert os.path.exists(path_of(keys[0]))
        assert sum(os.path.exists(path_of(k)) for k in keys) == 3
        budget.finish_job(load, [])
    finally:
        gate.set()
        budget.shutdown()


def test_budgets_on_one_root_keep_it_within_one_max_bytes(tmp_path, monkeypatch):
    """Two engines' budgets on one root, max_bytes four files each (the
    root's budget). The first fills the root; the second counts its files
    once it lists the root, and its own stores evict them (the oldest); the
    first then indexes the second's files and evicts them for its own: the
    root never holds more than four files."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    # raising=False: the test also runs on a budget without listings
    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 0.05, raising=False)
    monkeypatch.setattr(budget_module, "LEDGER_POLL_S", 0.01, raising=False)
    monkeypatch.setattr(budget_module, "RESCAN_COST_FACTOR", 1, raising=False)
    root = str(tmp_path)
    first, path_of = _budget_on(root, 4)
    second, _ = _budget_on(root, 4)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(1, 9)]

    def store(budget, key: OffloadKey, req_id: str) -> None:
        _store_one(budget, path_of, key, req_id)

    try:
        listed = second.rescans
        for i, k in enumerate(keys[:4]):
            store(first, k, f"a{i}")
        # the first's ledger moved: the second lists the root again, and once
        # more after the last file's write, which a slow machine may delay
        wait_until(lambda: second.rescans > listed)
        second._relist = True
        wait_until(lambda: second.used == 4 * 4096)
        listed = first.rescans
        for i, k in enumerate(keys[4:]):
            store(second, k, f"b{i}")
            assert len(block_files(root)) <= 4
        # the root's oldest went first, the newest is kept
        assert not any(os.path.exists(path_of(k)) for k in keys[:4])
        assert os.path.exists(path_of(keys[7]))
        # the first indexes the second's files once it lists the root
        wait_until(lambda: first.rescans > listed)
        first._relist = True
        wait_until(
            lambda: all(
                first._cid(k[:-4]) in first._chunks
                for k in keys[4:]
                if os.path.exists(path_of(k))
            )
        )
        store(first, make_offload_key(bytes([9]) * 32, 0), "a4")
        # max_bytes and this engine's store job at most (a victim whose time
        # the other engine raised meanwhile is kept), then max_bytes
        assert len(block_files(root)) <= 5
        assert os.path.exists(path_of(make_offload_key(bytes([9]) * 32, 0)))
        wait_until(lambda: len(block_files(root)) <= 4)
    finally:
        first.shutdown()
        second.shutdown()


def test_engines_on_one_root_count_each_others_stores_at_once(tmp_path, monkeypatch):
    """Two engines' budgets on one root, max_bytes four files (the root's),
    neither listing the root after its start: once the first stored four
    files, the second counts them (the first's ledger) without a listing,
    so its store cannot take the root past max_bytes: refused, as no file it
    indexed could make room."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    # raising=False: the test also runs on a budget without listings
    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 1e9, raising=False)
    monkeypatch.setattr(budget_module, "LEDGER_POLL_S", 0.01, raising=False)
    monkeypatch.setattr(budget_module, "RESCAN_COST_FACTOR", 1, raising=False)
    root = str(tmp_path)
    first, path_of = _budget_on(root, 4)
    second, _ = _budget_on(root, 4)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(1, 6)]
    try:
        for i, k in enumerate(keys[:4]):
            _store_one(first, path_of, k, f"a{i}")
        wait_until(lambda: getattr(second, "others", 0) == 4 * 4096)
        _store_one(second, path_of, keys[4], "b0")
        assert len(block_files(root)) == 4
        assert second.rejected_files == 1
    finally:
        first.shutdown()
        second.shutdown()


def test_a_listing_counts_only_the_layouts_block_files(tmp_path):
    """Entries a listing of the root finds that are not block files of the
    layout (a group no KV cache group has, a name that is not a hash, a
    directory or a FIFO named like a block, a file not at its hash's path)
    are neither counted nor removed: a planted group directory cannot make
    a huge group mask."""
    root = str(tmp_path)
    h = "ab" * 32
    group_dir = os.path.join(root, h[:3], f"{h[3:5]}_g0")
    planted = [
        os.path.join(root, h[:3], f"{h[3:5]}_g100000", f"{h}.bin"),
        os.path.join(root, h[:3], f"{h[3:5]}_g 0", f"{h}.bin"),
        os.path.join(group_dir, "ab cd.bin"),
        os.path.join(root, "000", "00_g0", f"{h}.bin"),  # not where h goes
    ]
    for path in planted:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    os.makedirs(os.path.join(group_dir, f"{'cd' * 32}.bin"))
    os.mkfifo(os.path.join(group_dir, f"{'ef' * 32}.bin"))
    budget, _ = _budget_on(root, 4)
    try:
        assert budget.used == 0
    finally:
        budget.shutdown()
    assert all(os.path.exists(p) for p in planted)


def test_a_dead_engines_ledger_is_removed_once_stale(tmp_path, monkeypatch):
    """A ledger not rewritten for LEDGER_STALE_S (its engine died) is
    removed at a listing, a live one is kept, and an engine removes its own
    at shutdown: the ledgers are bounded by the engines alive or recently
    dead."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 0.05)
    monkeypatch.setattr(budget_module, "LEDGER_STALE_S", 60.0)
    root = str(tmp_path)
    ledgers = os.path.join(root, budget_module.LEDGER_DIR)
    os.makedirs(ledgers)
    for name, age in (("dead", 3600), ("alive", 0)):
        with open(os.path.join(ledgers, name), "wb") as f:
            f.write(struct.pack("<qq", 8192, 0))
        os.utime(os.path.join(ledgers, name), (time.time() - age,) * 2)
    budget, _ = _budget_on(root, 4)
    try:
        wait_until(lambda: not os.path.exists(os.path.join(ledgers, "dead")))
        assert len(os.listdir(ledgers)) == 2  # "alive" and the budget's own
    finally:
        budget.shutdown()
    assert os.listdir(ledgers) == ["alive"]


def test_a_link_at_the_ledger_directory_is_neither_read_nor_cleaned(tmp_path):
    """A link where the ledgers' directory goes (with group_access, a member
    of the group can put one there): no ledger is read through it, and the
    removal of stale ledgers removes nothing where it points."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    rank_dir = tmp_path / "rank"
    rank_dir.mkdir()
    target = tmp_path / "target"
    target.mkdir()
    old = target / "someones-file"
    old.write_bytes(struct.pack("<qq", 8192, 0))
    os.utime(old, (time.time() - 7200,) * 2)
    os.symlink(target, rank_dir / budget_module.LEDGER_DIR)
    ledgers = budget_module._Ledgers(str(rank_dir), 1 << 20, "fs")
    assert ledgers.read_others() == {}
    ledgers.remove_stale(60.0)
    assert old.exists()


def test_a_link_put_where_the_ledger_directory_was_made_is_not_followed(
    tmp_path, monkeypatch
):
    """The ledger directory just made is replaced by a link before its mode is
    set (with group_access, a member of the group can): the ledger is not
    written, counted as an error, and the link's target keeps its mode, where
    chmod(path) would have given it the rank directory's (02770)."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    rank_dir = tmp_path / "rank"
    rank_dir.mkdir()
    rank_dir.chmod(0o2770)
    target = tmp_path / "target"
    target.mkdir()
    target.chmod(0o700)
    ledgers = budget_module._Ledgers(str(rank_dir), 1 << 20, "fs")
    real_mkdir = os.mkdir

    def mkdir_then_link(path, mode=0o777, **kwargs):
        real_mkdir(path, mode, **kwargs)
        os.rmdir(path)
        os.symlink(target, path)

    monkeypatch.setattr(os, "mkdir", mkdir_then_link)
    ledgers.publish((4096, 0))
    monkeypatch.undo()
    assert ledgers.errors == 1
    assert oct(os.stat(target).st_mode & 0o7777) == oct(0o700)


def test_a_budget_on_a_root_not_made_yet_warns_of_no_ledger(tmp_path, caplog_vllm):
    """The tier makes its rank directory with its first store: until then
    the budget writes no ledger and says nothing of it; then it writes it."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    root = str(tmp_path / "rank")
    budget, path_of = _budget_on(root, 4)
    key = make_offload_key(bytes([1]) * 32, 0)
    try:
        with caplog_vllm.at_level(logging.WARNING):
            job = budget.admit_store([key], "r", {key: 16})
            budget.admitted(job)
            time.sleep(10 * budget_module.BUDGET_INTERVAL_S)  # ticks
        assert not [r for r in caplog_vllm.records if "ledger" in r.getMessage()]
        _write_files(path_of, [key])
        budget.written(job, [key])
        budget.finish_job(job, [])
        ledgers = os.path.join(root, budget_module.LEDGER_DIR)
        wait_until(lambda: os.path.isdir(ledgers) and len(os.listdir(ledgers)) == 1)
    finally:
        budget.shutdown()


def test_a_single_engine_never_lists_its_root_again(tmp_path, monkeypatch):
    """Alone on its root, an engine lists it once, at start, and counts
    nothing of other engines, whatever it stores and evicts: the cost and
    the budget of one engine."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 0.01)
    root = str(tmp_path)
    budget, path_of = _budget_on(root, 4)
    try:
        for i in range(12):
            _store_one(budget, path_of, make_offload_key(bytes([i]) * 32, 0), f"r{i}")
        time.sleep(20 * budget_module.BUDGET_INTERVAL_S)
        assert budget.rescans == 1 and budget.others == 0
        assert len(block_files(root)) == 4
    finally:
        budget.shutdown()


def test_an_engine_that_left_keeps_its_files_counted(tmp_path, monkeypatch):
    """An engine joins after the other's listing, stores two files and
    stops (its ledger goes, its files stay): the other keeps counting them,
    so that its own stores keep the root within max_bytes."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 1e9)
    monkeypatch.setattr(budget_module, "LEDGER_POLL_S", 0.01, raising=False)
    monkeypatch.setattr(budget_module, "RESCAN_COST_FACTOR", 1, raising=False)
    root = str(tmp_path)
    first, path_of = _budget_on(root, 4)
    second, _ = _budget_on(root, 4)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(1, 6)]
    try:
        # the first reads the second's ledger before its stores: a ledger's
        # first read counts nothing (a listing would, and none comes here)
        wait_until(lambda: first._ledgers.shared)
        for i, k in enumerate(keys[:2]):
            _store_one(second, path_of, k, f"b{i}")
        wait_until(lambda: first.others == 2 * 4096)
        second.shutdown()
        time.sleep(20 * budget_module.BUDGET_INTERVAL_S)
        assert first.others == 2 * 4096
        for i, k in enumerate(keys[2:]):
            _store_one(first, path_of, k, f"a{i}")
        # its own oldest went: the root stays within max_bytes
        on_disk = [os.path.exists(path_of(k)) for k in keys]
        assert on_disk == [True, True, False, True, True]
    finally:
        first.shutdown()


def test_a_hit_never_lowers_another_engines_mtime(tmp_path, monkeypatch):
    """On a shared root, lookup() finds a file another engine raised past
    this request's order time: indexing it here never lowers its mtime (the
    order all engines read)."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    monkeypatch.setattr(budget_module, "LEDGER_POLL_S", 0.01)
    root = str(tmp_path)
    first, path_of = _budget_on(root, 8)
    second, _ = _budget_on(root, 8)
    try:
        _store_one(second, path_of, make_offload_key(bytes([1]) * 32, 0), "b")
        wait_until(lambda: first._ledgers.shared)
        key = make_offload_key(bytes([2]) * 32, 0)
        _write_files(path_of, [key])
        raised = time.time_ns() + 3600 * 10**9
        os.utime(path_of(key), ns=(raised, raised))
        assert first.on_hit(key, "a", {key: 16})
        first.end_step()
        wait_until(lambda: first._cid(key[:-4]) in first._chunks)
        time.sleep(10 * budget_module.BUDGET_INTERVAL_S)  # times persisted
        assert os.stat(path_of(key)).st_mtime_ns == raised
    finally:
        first.shutdown()
        second.shutdown()


def test_a_ledger_that_is_not_one_is_not_believed(tmp_path, monkeypatch):
    """A FIFO in the ledgers' directory never blocks the budget thread, and
    a ledger that jumps by more than max_bytes is not believed: the engine
    stores as if they were not there, and stops."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    monkeypatch.setattr(budget_module, "LEDGER_POLL_S", 0.01)
    root = str(tmp_path)
    ledgers = os.path.join(root, budget_module.LEDGER_DIR)
    os.makedirs(ledgers)
    os.mkfifo(os.path.join(ledgers, "fifo"))
    liar = os.path.join(ledgers, "liar")
    with open(liar, "wb") as f:
        f.write(struct.pack("<qq", 0, 0))
    budget, path_of = _budget_on(root, 4)
    try:
        wait_until(lambda: budget._ledgers.shared)
        with open(liar, "r+b") as f:
            f.write(struct.pack("<qq", 2**40, 0))
        time.sleep(10 * budget_module.BUDGET_INTERVAL_S)
        for i in range(4):
            key = make_offload_key(bytes([i]) * 32, 0)
            _store_one(budget, path_of, key, f"r{i}")
        assert budget.others == 0 and budget.rejected_files == 0
        assert len(block_files(root)) == 4
    finally:
        stopping = threading.Thread(target=budget.shutdown)
        stopping.start()
        stopping.join(10)
        assert not stopping.is_alive()


def test_an_engine_counts_another_whose_ledger_it_first_read_late(
    tmp_path, monkeypatch
):
    """An engine that starts after another stored and removed more than
    max_bytes over its life takes that ledger as it finds it and counts its
    changes from then on (a ledger's history is no reason to ignore it)."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    monkeypatch.setattr(budget_module, "LEDGER_POLL_S", 0.01)
    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 1e9)
    root = str(tmp_path)
    ledgers = os.path.join(root, budget_module.LEDGER_DIR)
    os.makedirs(ledgers)
    other = os.path.join(ledgers, "other")
    with open(other, "wb") as f:
        f.write(struct.pack("<qq", 20 * 4096, 18 * 4096))
    budget, _ = _budget_on(root, 16)
    try:
        with open(other, "r+b") as f:
            f.write(struct.pack("<qq", 21 * 4096, 18 * 4096))
        wait_until(lambda: budget.others == 4096)
    finally:
        budget.shutdown()


def test_an_engine_alone_whose_files_went_keeps_storing(tmp_path):
    """Alone on its root, an engine whose files were removed behind its
    back (a wiped cache) evicts them as gone and stores again: nothing it
    could not remove is counted against the budget."""
    root = str(tmp_path)
    budget, path_of = _budget_on(root, 4)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(1, 9)]
    try:
        for i, k in enumerate(keys[:4]):
            _store_one(budget, path_of, k, f"a{i}")
        for k in keys[:4]:
            os.remove(path_of(k))
        for i, k in enumerate(keys[4:]):
            _store_one(budget, path_of, k, f"b{i}")
        assert budget.rejected_files == 0 and budget.others == 0
        assert len(block_files(root)) == 4
    finally:
        budget.shutdown()


@pytest.mark.parametrize("max_bytes", [0, -4096, 4095, "1G", 4096.0, True])
def test_bad_max_bytes_is_refused_before_any_thread_starts(tmp_path, max_bytes):
    """max_bytes <= 0, not an integer, or smaller than one chunk of every
    group: a ValueError naming the setting and the smallest valid value,
    before the tier starts a thread."""
    rows = _page_aligned_zero_tensor(2, _ROW_ELEMENTS)
    before = threading.active_count()
    with pytest.raises(
        ValueError, match=r"max_bytes of the 'fs' tier must be .*>= 4096"
    ):
        make_tier(str(tmp_path), rows, max_bytes=max_bytes)
    assert threading.active_count() == before


def test_budget_above_free_space_warns_once(tmp_path, caplog_vllm):
    """A budget larger than the filesystem's free space: one warning at
    start with both numbers."""
    rows = _page_aligned_zero_tensor(2, _ROW_ELEMENTS)
    huge = 1 << 62
    with caplog_vllm.at_level(logging.WARNING):
        tier = make_tier(str(tmp_path), rows, max_bytes=huge)
        tier.shutdown()
    warnings = [
        r.getMessage() for r in caplog_vllm.records if "free space" in r.getMessage()
    ]
    assert len(warnings) == 1 and str(huge) in warnings[0], warnings


def test_what_the_budget_remembers_is_bounded(tmp_path, monkeypatch):
    """The requests' keys kept for the order are bounded (MAX_TRACKED_KEYS,
    the least recently seen requests dropped first) and dropped when a
    request finishes, and the index holds the files on disk only: 50
    requests of 4 chunks over a budget of 4 files."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    monkeypatch.setattr(budget_module, "MAX_TRACKED_KEYS", 64)
    monkeypatch.setattr(budget_module, "SCAN_BATCH", 8)
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path), rows, group_tokens=(16,), max_bytes=4 * page)
    budget = tier._budget
    try:
        for r in range(50):
            keys = [block_key(1000 * r + i) for i in range(4)]
            ctx = prompt_ctx(f"req{r}", keys)
            # two store jobs: the second's first key follows the first's
            for j in (0, 2):
                tier.submit_store(
                    TransferJob(
                        2 * r + j // 2, keys[j : j + 2], np.arange(2), False, ctx
                    )
                )
                drain(tier)
            assert 0 < budget._tracked <= 64
            assert budget._tracked == sum(
                len(req.keys) for req in budget._requests.values()
            )
            if r % 2:
                tier.on_request_finished(ctx)
                assert ctx.req_id not in applied(budget)._requests
            assert len(budget._chunks) <= 4
            assert len(budget._heap) <= 2 * 4 + budget_module.SCAN_BATCH
        # the last request's chunks are kept, head newest
        last = [block_key(49000 + i) for i in range(4)]
        assert lookup_and_wait(tier, last) == [LookupResult.HIT] * 4
        times = [budget._chunks[k[:-4]][0] for k in last]
        assert times == sorted(times, reverse=True)
    finally:
        tier.shutdown()


def test_a_file_a_hit_indexed_counts_once_within_max_bytes(tmp_path, monkeypatch):
    """Another engine's files lookup() found, before this engine counted
    that engine's ledger, are counted once, in this engine's index (the
    others' bytes never go below zero): a store past max_bytes evicts for
    them at once, not at the next listing."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 1e9)  # hits index them
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    root = str(tmp_path / "kv")
    tier = make_tier(root, rows, max_bytes=4 * page)
    other = make_tier(root, rows, max_bytes=64 * page)
    try:
        assert tier._budget.scan_done.wait(30) and other._budget.scan_done.wait(30)
        keys = [block_key(i) for i in range(5)]
        assert all(r.success for r in store_keys(other, keys[:4], 0, rows))
        assert lookup_and_wait(tier, keys[:4]) == [LookupResult.HIT] * 4
        tier.on_schedule_end(ScheduleEndContext((), ()))  # no promotion
        assert all(r.success for r in store_keys(tier, keys[4:], 10, rows))
        assert disk_bytes(root) <= 4 * page
    finally:
        tier.shutdown()
        other.shutdown()


def test_the_files_lookup_found_are_indexed_within_the_budget(tmp_path, monkeypatch):
    """Files lookup() found that the budget had not indexed (another
    engine's on a shared root) are indexed at the hit's order and counted
    in max_bytes: the index stays within it, its mtimes say they are in
    use, and the requests' keys stay bounded (MAX_TRACKED_KEYS) and are
    dropped when a request finishes; with a key_file, the block hashes the
    budget keeps are one per indexed chunk at most."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    monkeypatch.setattr(budget_module, "MAX_TRACKED_KEYS", 8)
    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 1e9)  # hits index them
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    key = key_file(tmp_path / "key")
    tier, other = (
        make_tier(str(tmp_path / "kv"), rows, max_bytes=64 * page, key_file=key)
        for _ in range(2)
    )
    budget = tier._budget
    try:
        assert budget.scan_done.wait(30)
        keys = [block_key(i) for i in range(20)]
        assert all(r.success for r in store_keys(other, keys, 0, rows))
        contexts = [ReqContext(f"req{r}") for r in range(8)]
        for r, ctx in enumerate(contexts):
            # overlapping requests: keys 2r .. 2r+3
            found = lookup_and_wait(tier, keys[2 * r : 2 * r + 4], ctx)
            assert found == [LookupResult.HIT] * 4
            assert applied(budget)._tracked <= 8
            if r % 2:
                tier.on_request_finished(ctx)
                assert ctx.req_id not in applied(budget)._requests
        tier.on_schedule_end(ScheduleEndContext((), ()))
        for ctx in contexts:
            tier.on_request_finished(ctx)
        assert applied(budget)._tracked == 0 and not budget._requests
        assert len(budget._chunks) == len(budget._hash_of) == 18  # keys 0-17
        assert budget.used == 18 * page
        path = tier.file_mapper.get_file_name(keys[0])
        wait_until(
            lambda: (
                os.stat(path).st_mtime_ns
                == budget._chunks[budget._cid(keys[0][:-4])][0]
            )
        )
    finally:
        tier.shutdown()
        other.shutdown()


# ---------------------------------------------------------------------------
# Off the scheduler thread
# ---------------------------------------------------------------------------

_BUDGET_THREAD = "vllm_kv_py_fs_budget"


def test_the_scheduler_thread_never_waits_on_the_budget(tmp_path):
    """The budget's work (admission, eviction, pins, the gap check) runs
    off the scheduler thread: with the budget's lock held by another
    thread, lookup(), submit_store(), submit_load(), on_schedule_end(),
    get_finished_jobs() and on_request_finished() return at once; once the
    lock is free, the jobs finish and the budget holds."""
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path), rows, group_tokens=(16,), max_bytes=2 * page)
    budget = tier._budget
    try:
        assert budget.scan_done.wait(30)
        keys = [block_key(i) for i in range(4)]
        store_keys(tier, keys[:2], 40, rows)
        assert lookup_and_wait(tier, [keys[0]]) == [LookupResult.HIT]
        locked, release = threading.Event(), threading.Event()

        def hold_lock():
            with budget._lock:
                locked.set()
                release.wait(30)

        holder = threading.Thread(target=hold_lock)
        holder.start()
        assert locked.wait(30)
        results: list = []

        def scheduler_calls():
            assert tier.lookup(keys[0], _CTX) is LookupResult.HIT
            # keys[2]'s predecessor (key 9) is indexed nowhere: a gap
            ctx = prompt_ctx("req", [block_key(9), keys[2], keys[3]])
            tier.submit_store(TransferJob(5, keys[2:], np.arange(2, 4), False, ctx))
            tier.submit_load(make_job(6, [keys[0]], [6], is_promotion=True))
            tier.on_schedule_end(ScheduleEndContext((), ()))
            results.extend(tier.get_finished_jobs())
            tier.on_request_finished(ctx)

        calls = threading.Thread(target=scheduler_calls, name="scheduler")
        calls.start()
        calls.join(10)
        blocked = calls.is_alive()
        release.set()
        holder.join(30)
        calls.join(30)
        assert not blocked, "a scheduler-side call waited on the budget's lock"
        results.extend(drain(tier))
        assert sorted(r.job_id for r in results) == [5, 6]
        assert all(r.success for r in results)
        # keys[2] is not worth writing (its predecessor is on no disk), and
        # so is keys[3] after it; the load of keys[0] read its bytes
        assert budget.unreachable_files == 2
        assert not os.path.exists(tier.file_mapper.get_file_name(keys[2]))
        assert not os.path.exists(tier.file_mapper.get_file_name(keys[3]))
        assert (rows[6] == 40.0).all()
        assert disk_bytes(str(tmp_path)) <= 2 * page
    finally:
        release.set()
        tier.shutdown()


def test_the_budget_thread_evicts_ahead_to_the_low_water_mark(tmp_path, monkeypatch):
    """Past HIGH_WATER percent of max_bytes the budget thread evicts down to
    LOW_WATER percent, never below, and removes those files itself: stores
    at a full budget then find room, and their tasks remove no file."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path), rows, max_bytes=40 * page)
    budget = tier._budget
    low = 40 * page * getattr(budget_module, "LOW_WATER", 90) // 100
    high = 40 * page * getattr(budget_module, "HIGH_WATER", 95) // 100
    removers: list[str] = []
    remove = os.remove

    def recording_remove(path, *args, **kwargs):
        if path.endswith(".bin"):
            removers.append(threading.current_thread().name)
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", recording_remove)
    try:
        assert budget.scan_done.wait(30)
        for n in range(100):
            (result,) = store_keys(tier, [block_key(n)], n, rows)
            assert result.success
            if n == 0:  # a cached verdict, and no promotion in its step
                assert lookup_and_wait(tier, [block_key(0)]) == [LookupResult.HIT]
                tier.on_schedule_end(ScheduleEndContext((), ()))
            # at rest: under the high-water mark, its files all removed
            wait_until(
                lambda: budget.used <= high and not getattr(budget, "unlinking", 0),
                timeout=10,
            )
            assert budget.used <= 40 * page
            if n >= 40:
                assert budget.used >= low  # never below the low-water mark
        assert disk_bytes(str(tmp_path)) <= high
        assert budget.evicted_files >= 100 - 40
        assert removers and set(removers) == {_BUDGET_THREAD}, removers
        # the evicted keys reached the scheduler thread: the cached verdict
        # of key 0, evicted ahead, is a miss
        tier.on_schedule_end(ScheduleEndContext((), ()))
        assert tier.lookup(block_key(0), _CTX) is LookupResult.MISS
    finally:
        tier.shutdown()


def test_a_store_does_not_wait_for_the_budget_threads_removals(tmp_path, monkeypatch):
    """The budget thread's file removal hangs (a stuck filesystem): stores
    that need the room take over the removals it has not started, write,
    and the files stay within max_bytes."""
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path), rows, max_bytes=20 * page)
    budget = tier._budget
    stuck, release = threading.Event(), threading.Event()
    remove = os.remove

    def hanging_remove(path, *args, **kwargs):
        if threading.current_thread().name == _BUDGET_THREAD:
            stuck.set()
            release.wait(60)
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", hanging_remove)
    try:
        assert budget.scan_done.wait(30)
        store_keys(tier, [block_key(n) for n in range(20)], 0, rows)
        assert stuck.wait(30)  # evicting ahead, stuck in its first removal
        new = [block_key(100 + n) for n in range(10)]
        results = store_keys(tier, new, 20, rows)
        assert all(r.success for r in results)
        assert lookup_and_wait(tier, new) == [LookupResult.HIT] * 10
        assert disk_bytes(str(tmp_path)) <= 20 * page
    finally:
        release.set()
        tier.shutdown()


def test_a_file_the_budget_thread_cannot_remove_is_reported(tmp_path, caplog_vllm):
    """An evicted-ahead file whose removal fails (here a directory at its
    path) is counted and reported in the tier's rate-limited failure
    report, as a store's removal is."""
    rows = _page_aligned_zero_tensor(8, _ROW_ELEMENTS)
    page = rows.numpy().strides[0]
    tier = make_tier(str(tmp_path / "kv"), rows, max_bytes=20 * page)
    budget = tier._budget
    try:
        assert budget.scan_done.wait(30)
        keys = [block_key(n) for n in range(20)]
        assert all(r.success for r in store_keys(tier, keys[:19], 0, rows))
        path = tier.file_mapper.get_file_name(keys[0])  # the least recent
        os.remove(path)
        os.makedirs(os.path.join(path, "x"))
        with caplog_vllm.at_level(logging.ERROR):
            # past the high-water mark: the budget thread evicts ahead
            assert all(r.success for r in store_keys(tier, keys[19:], 19, rows))
            # the budget thread counts the failure, then reports it: wait for
            # the report itself
            wait_until(
                lambda: any(
                    "1 evicted block file(s) could not be removed" in r.getMessage()
                    for r in caplog_vllm.records
                    if r.levelname == "ERROR"
                ),
                timeout=10,
            )
        assert budget.removal_errors == 1
        assert os.path.isdir(path)
    finally:
        tier.shutdown()
