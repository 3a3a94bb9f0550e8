# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
Regression tests for the fs_python tier's byte budget (max_bytes).

Through the real offloading connector scheduler, the real
TieringOffloadingManager with its CPU primary tier, and the real fs_python
tier writing real files (the GPU copies are replaced by writing known bytes
into the CPU tier's rows, as in test_tiering_hma.py): the tier's files stay
within max_bytes after every step of a workload larger than it, a prefix
loses its tail before its head (no kept file is unreachable), and a restart
over files beyond the budget trims them the same way. At the tier itself: a
file with a load in flight, or reported present by lookup(), is never
evicted under it; two tiers on one root keep their own budgets; bad
settings are refused.
"""

import contextlib
import json
import logging
import os
import random
import struct
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from test_fs_tier import _CTX, _MOCK_OFFLOADING_SPEC, _aligned_rows, _finish, make_job
from test_tiering_hma import (  # noqa: F401 (fixtures)
    _load_hit,
    _remove_shm_regions,
    block_bytes,
    cpu_rows,
    make_configs,
    model_config,
    ref_cnt,
    sha256_block_hashes,
    wait_for,
)

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.fs import layouts as fs_layouts
from vllm.v1.kv_offload.tiering.fs import manager as fs_manager
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def disk_bytes(root_dir: str) -> int:
    """Bytes of the tier's block files and temporary files under root_dir
    (a file removed while walking counts as gone)."""
    total = 0
    for d, _, files in os.walk(root_dir):
        for f in files:
            if f.endswith((".bin", ".tmp")):
                with contextlib.suppress(FileNotFoundError):
                    total += os.path.getsize(os.path.join(d, f))
    return total


def block_files(root_dir: str) -> set[str]:
    """Stems (<hash hex>_g<group>) of the block files under root_dir."""
    return {
        f"{f[:-4]}_g{d.rsplit('_g', 1)[1]}"
        for d, _, files in os.walk(root_dir)
        for f in files
        if f.endswith(".bin")
    }


def stem(key: OffloadKey) -> str:
    return f"{key[:-4].hex()}_g{int.from_bytes(key[-4:], 'big')}"


def tier_config(root_dir: str, **config) -> dict:
    return {
        "type": "fs_python",
        "root_dir": root_dir,
        "n_read_threads": 2,
        "n_write_threads": 2,
        **config,
    }


def file_bytes(spec: TieringOffloadingSpec) -> int:
    """Bytes of one block file: one row of the CPU tier (one worker)."""
    return spec.cpu_page_size_per_worker


def make_request(spec: TieringOffloadingSpec, req_id: str, tokens: list[int]):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(
        request_id=req_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(spec.hash_block_size, sha256),
    )


def serve(sched, request, on_step=None) -> int:
    """What the engine does with one request through the real connector
    scheduler: look it up (promotions from disk take steps), load the hit,
    schedule the rest of the prompt in one step, write the bytes its store
    job copies into the CPU tier's rows, report the job done (the cascade to
    disk follows) and finish the request. on_step() runs after every engine
    step. Returns the tokens hit."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    manager = sched.manager

    def end_step():
        list(sched.take_events())
        if on_step is not None:
            on_step()

    for _ in range(200):
        hit, _ = sched.get_num_new_matched_tokens(request, 0)
        if hit is not None:
            break
        end_step()
        time.sleep(0.002)
    else:
        raise AssertionError("lookup deferred forever")
    if hit:
        _load_hit(sched, request, hit, 1)
        end_step()
    request.num_computed_tokens = hit
    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = [
        SimpleNamespace(
            req_id=request.request_id,
            block_ids=tuple(
                list(range(1 + 4096 * g, 2 + 4096 * g + request.num_tokens // size))
                for g, size in enumerate(
                    c.gpu_block_size for c in sched.config.kv_group_configs
                )
            ),
        )
    ]
    output.num_scheduled_tokens = {request.request_id: request.num_tokens - hit}
    meta = sched.build_connector_meta(output)
    rows = cpu_rows(manager)
    worker_meta = OffloadingWorkerMetadata()
    stored: list[OffloadKey] = []
    for job_id in meta.store_jobs:
        for key in sched._jobs[job_id].keys:
            block = manager.primary_tier._policy.get(key)
            rows[block.block_id] = block_bytes(key, rows.shape[1])
            stored.append(key)
        worker_meta.mark_completed(job_id)
    sched.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=worker_meta)
    )
    request.status = RequestStatus.FINISHED_STOPPED
    sched.request_finished(request)
    end_step()
    # the cascade to disk finishes
    wait_for(lambda: all(ref_cnt(manager, k) in (0, None) for k in stored), manager)
    end_step()
    return hit


def max_hit_tokens(sched, request) -> int:
    """The most the connector can hit of a request: whole chunks of every
    group, one token short of the prompt for sliding-window layouts."""
    import math

    sizes = [c.offloaded_block_size for c in sched.config.kv_group_configs]
    limit = request.num_tokens - (1 if sched._sliding_window_groups else 0)
    return limit // math.lcm(*sizes) * math.lcm(*sizes)


def unreachable_share(
    prompt_keys: list[list[list[OffloadKey]]],
    files: set[str],
    group_configs=None,
) -> float:
    """Kept block files that can never hit because an earlier chunk of their
    prompt in a full-attention group is gone, over all kept files.
    prompt_keys: per prompt, per group, the keys in order; group_configs:
    the connector's (offloaded block size, sliding window or None) per
    group; None: group 0 is full attention and all have one block size."""
    unreachable: set[str] = set()
    for groups in prompt_keys:
        sizes = (
            [c.offloaded_block_size for c in group_configs]
            if group_configs
            else [1] * len(groups)
        )
        full = (
            [c.sliding_window_size_in_blocks is None for c in group_configs]
            if group_configs
            else [g == 0 for g in range(len(groups))]
        )
        # the first token not covered by a kept full-attention chunk
        end = min(
            next((i for i, k in enumerate(keys) if stem(k) not in files), len(keys))
            * size
            for keys, size, is_full in zip(groups, sizes, full)
            if is_full
        )
        for keys, size in zip(groups, sizes):
            unreachable.update(
                stem(k)
                for j, k in enumerate(keys)
                if (j + 1) * size > end and stem(k) in files
            )
    return len(unreachable) / max(1, len(files))


def sched_for(spec: TieringOffloadingSpec):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )

    return OffloadingConnectorScheduler(spec)


def prompt_keys_of(sched, request) -> list[list[OffloadKey]]:
    from test_tiering_hma import _sched_config_keys

    return _sched_config_keys(sched, request)


# ---------------------------------------------------------------------------
# Through the real connector scheduler
# ---------------------------------------------------------------------------

_CHUNKS = 6  # chunks per prompt: a shared head of 3, a tail of 3


def shared_prefix_prompts(n: int, num_heads: int = 2) -> list[list[int]]:
    """n prompts of _CHUNKS chunks (16 tokens each) plus one token: every
    prompt shares its first half with the others of its head."""
    prompts = []
    for p in range(n):
        head = [(11 * i + 101 * (p % num_heads)) % 500 for i in range(3 * 16)]
        tail = [(7 * i + 13 * p + 1) % 500 for i in range(3 * 16 + 1)]
        prompts.append(head + tail)
    return prompts


@pytest.mark.parametrize("layout", ["llama", "gemma3", "gemma4"])
def test_budget_holds_and_prefixes_stay_whole(
    model_config,  # noqa: F811 (a fixture of test_tiering_hma)
    tmp_path,
    sha256_block_hashes,  # noqa: F811
    layout,
):
    """A shared-prefix workload of 12 prompts, larger than the budget
    (about three prompts): after every engine step the tier's files take at
    most max_bytes plus one store job; at the end they take at most
    max_bytes, and no kept file is unreachable (every kept chunk's earlier
    chunks are kept, in every group: a prefix lost its tail first)."""
    root_dir = str(tmp_path / "fs")
    probe = TieringOffloadingSpec(*make_configs(model_config, layout, root_dir, 64))
    num_groups = len(probe.kv_cache_config.kv_cache_groups)
    chunk = num_groups * file_bytes(probe)
    max_bytes = 10 * chunk
    vllm_config, kv_cache_config = make_configs(
        model_config,
        layout,
        root_dir,
        64,
        {"secondary_tiers": [tier_config(root_dir, max_bytes=max_bytes)]},
    )
    spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    sched = sched_for(spec)
    manager = sched.manager
    assert isinstance(manager, TieringOffloadingManager)
    peak = [0]

    def measure():
        used = disk_bytes(root_dir)
        peak[0] = max(peak[0], used)
        # one store job writes at most one prompt's chunks
        assert used <= max_bytes + _CHUNKS * chunk, (used, max_bytes)

    all_keys = []
    try:
        for p, tokens in enumerate(shared_prefix_prompts(12)):
            request = make_request(spec, f"req{p}", tokens)
            all_keys.append(prompt_keys_of(sched, request))
            serve(sched, request, measure)
            assert disk_bytes(root_dir) <= max_bytes
    finally:
        sched.shutdown()
    files = block_files(root_dir)
    assert peak[0] > max_bytes // 2  # the workload filled the budget
    configs = sched.config.kv_group_configs
    assert unreachable_share(all_keys, files, configs) == 0
    # the last prompt is kept whole (its chunks are the most recent), and
    # a cold engine hits it from disk, in every group
    assert all(stem(k) in files for keys in all_keys[-1] for k in keys)
    sched = sched_for(TieringOffloadingSpec(vllm_config, kv_cache_config))
    try:
        last = make_request(spec, "again", shared_prefix_prompts(12)[-1])
        assert serve(sched, last) == max_hit_tokens(sched, last)
    finally:
        sched.shutdown()


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "key_file"])
def test_restart_over_budget_trims_tails_first(
    model_config,  # noqa: F811 (a fixture of test_tiering_hma)
    tmp_path,
    sha256_block_hashes,  # noqa: F811
    keyed,
):
    """Files of an earlier run beyond the budget (a larger one then): at
    start the tier indexes them in the background and trims them to
    max_bytes, tail first (the kept files of each prompt are a prefix of
    it: the order comes from the tier's journal, not file times), and a
    request of a kept prefix hits after the restart. With a key_file the
    files are named by a keyed hash: the same, by those names."""
    layout = "gemma3"
    root_dir = str(tmp_path / "fs")
    key_config = {}
    if keyed:
        key_path = tmp_path / "tier.key"
        key_path.write_bytes(bytes(range(32)))
        key_path.chmod(0o600)
        key_config = {"key_file": str(key_path)}
    probe = TieringOffloadingSpec(*make_configs(model_config, layout, root_dir, 64))
    # the earlier run: a budget it does not reach, 8 prompts of 6 chunks
    configs = make_configs(
        model_config,
        layout,
        root_dir,
        64,
        {
            "secondary_tiers": [
                tier_config(root_dir, max_bytes=4000 * file_bytes(probe), **key_config)
            ]
        },
    )
    spec = TieringOffloadingSpec(*configs)
    sched = sched_for(spec)
    # a chunk's files: one per group (a key_file adds a MAC to each)
    chunk = sum(sched.manager.secondary_tiers[0]._file_sizes)
    requests_tokens = shared_prefix_prompts(8, num_heads=8)
    all_keys = []
    try:
        for p, tokens in enumerate(requests_tokens):
            request = make_request(spec, f"req{p}", tokens)
            all_keys.append(prompt_keys_of(sched, request))
            serve(sched, request)
    finally:
        sched.shutdown()
    assert disk_bytes(root_dir) == 8 * _CHUNKS * chunk

    max_bytes = 9 * chunk
    vllm_config, kv_cache_config = make_configs(
        model_config,
        layout,
        root_dir,
        64,
        {"secondary_tiers": [tier_config(root_dir, max_bytes=max_bytes, **key_config)]},
    )
    spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    sched = sched_for(spec)
    try:
        (tier,) = sched.manager.secondary_tiers
        assert tier._budget.scan_done.wait(30)
        assert disk_bytes(root_dir) <= max_bytes
        # the block stems of the prompts' keys whose files are kept
        files = {
            stem(k)
            for keys in all_keys
            for group_keys in keys
            for k in group_keys
            if os.path.exists(tier.file_mapper.get_file_name(k))
        }
        assert len(files) == len(block_files(root_dir))
        assert unreachable_share(all_keys, files) == 0
        kept = [p for p, keys in enumerate(all_keys) if stem(keys[0][0]) in files]
        assert kept
        # a kept prefix hits after the restart
        p = kept[-1]
        request = make_request(spec, f"again{p}", requests_tokens[p])
        assert serve(sched, request) >= 16
    finally:
        sched.shutdown()


def budgeted_sched(model_config, layout: str, root_dir: str, chunks: int):  # noqa: F811
    """The real connector scheduler over a CPU tier of 64 blocks and a
    budgeted fs_python tier of `chunks` chunks (one file of every group)."""
    probe = TieringOffloadingSpec(*make_configs(model_config, layout, root_dir, 64))
    num_groups = len(probe.kv_cache_config.kv_cache_groups)
    max_bytes = chunks * num_groups * file_bytes(probe)
    spec = TieringOffloadingSpec(
        *make_configs(
            model_config,
            layout,
            root_dir,
            64,
            {"secondary_tiers": [tier_config(root_dir, max_bytes=max_bytes)]},
        )
    )
    return spec, sched_for(spec)


def test_a_chunk_past_a_gap_writes_no_file_of_any_group(
    model_config,  # noqa: F811 (a fixture of test_tiering_hma)
    tmp_path,
    sha256_block_hashes,  # noqa: F811
):
    """Sliding window + full attention (gemma3): a head of 4 chunks is
    evicted from disk by other prompts but stays in the CPU tier; a prompt
    of that head plus 4 chunks of its own hits the head in the CPU tier and
    stores its 4 chunks, whose full-attention files could never hit from
    disk (the chunk before them is not there). None of their files is
    written, the sliding-window ones included: they would take the budget's
    room and evict what can still hit."""
    root_dir = str(tmp_path / "fs")
    spec, sched = budgeted_sched(model_config, "gemma3", root_dir, 4)
    head = [(11 * i + 5) % 500 for i in range(4 * 16)]
    try:
        serve(sched, make_request(spec, "head", head + [1]))
        for p in range(3):  # other prompts fill the budget: the head goes
            other = [(7 * i + 13 * p + 2) % 500 for i in range(4 * 16 + 1)]
            serve(sched, make_request(spec, f"other{p}", other))
        request = make_request(spec, "tail", head + [(3 * i) % 500 for i in range(65)])
        keys = prompt_keys_of(sched, request)
        files = block_files(root_dir)
        assert stem(keys[0][3]) not in files  # the head's last chunk is gone
        assert serve(sched, request) == 4 * 16  # hit in the CPU tier
        files = block_files(root_dir)
    finally:
        sched.shutdown()
    assert not {stem(k) for group in keys for k in group[4:]} & files
    assert unreachable_share([keys], files, sched.config.kv_group_configs) == 0


@pytest.mark.parametrize("layout", ["gemma3", "gemma4"])
def test_no_kept_file_is_unreachable_with_sliding_window_groups(
    model_config,  # noqa: F811 (a fixture of test_tiering_hma)
    tmp_path,
    sha256_block_hashes,  # noqa: F811
    layout,
):
    """A shared-prefix workload with revisits over a budget of 16 chunks
    (issue 19's measurement): 32 prompts of 4 shared heads and 4 chunks of
    their own, then 64 revisits. The CPU tier keeps sliding-window blocks
    only near the end of a prompt, so revisits store jobs of
    sliding-window keys alone, some of chunks whose full-attention file was
    evicted. After each request (its jobs done) no kept file is
    unreachable: a sliding-window file is only written while the
    full-attention chunks up to its end are on disk or being written
    (gemma4: those of 32 tokens, the sliding-window ones of 16)."""
    root_dir = str(tmp_path / "fs")
    spec, sched = budgeted_sched(model_config, layout, root_dir, 16)
    configs = sched.config.kv_group_configs
    full = {i for i, c in enumerate(configs) if c.sliding_window_size_in_blocks is None}
    tier = sched.manager.secondary_tiers[0]
    submit_store = tier.submit_store
    alone = [0]  # store jobs of sliding-window keys alone

    def count_store(job):
        if all(int.from_bytes(k[-4:], "big") not in full for k in job.keys):
            alone[0] += 1
        return submit_store(job)

    tier.submit_store = count_store
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
    shares = []
    try:
        for i, p in enumerate(order):
            request = make_request(spec, f"req{i}", prompts[p])
            if i < 32:
                all_keys.append(prompt_keys_of(sched, request))
            serve(sched, request)
            shares.append(unreachable_share(all_keys, block_files(root_dir), configs))
    finally:
        sched.shutdown()
    assert alone[0] > 0  # the case this guards happened
    assert max(shares) == 0, [f"{s:.0%}" for s in shares]


# ---------------------------------------------------------------------------
# At the tier
# ---------------------------------------------------------------------------


def key(n: int) -> OffloadKey:
    return make_offload_key(f"budget-{n}".encode().ljust(32, b"\0"), 0)


def make_tier(root_dir: str, rows: np.ndarray, **config) -> FileSystemTierManager:
    return FileSystemTierManager(
        offloading_spec=_MOCK_OFFLOADING_SPEC,
        primary_kv_view=memoryview(rows),
        tier_type="fs_python",
        root_dir=root_dir,
        n_read_threads=2,
        n_write_threads=2,
        **config,
    )


def wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def store_keys(tier, keys: list[OffloadKey], first_job: int, rows) -> list:
    """Store each key in its own job (row i holds key i's bytes)."""
    results = []
    for i, k in enumerate(keys):
        rows[i % len(rows)] = block_bytes(k, rows.shape[1])
        tier.submit_store(make_job(first_job + i, [k], [i % len(rows)]))
        results.extend(_finish(tier))
    return results


def prompt_ctx(req_id: str, keys: list[OffloadKey]) -> ReqContext:
    """A request's context with its keys' positions, as the connector
    scheduler records them (16 tokens a chunk)."""
    ctx = ReqContext(req_id)
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, 16 * (i + 1))
    return ctx


def prompt_job(job_id: int, keys: list[OffloadKey], ctx: ReqContext):
    from vllm.v1.kv_offload.tiering.base import JobMetadata

    block_ids = np.arange(len(keys), dtype=np.int64)
    return JobMetadata(job_id, keys, block_ids, False, ctx)


def test_a_store_that_fails_with_any_exception_counts_nothing(tmp_path, monkeypatch):
    """Whatever a store raises (an OSError, or another exception from a
    bug), the budget counts only the files that are there: jobs that wrote
    nothing leave it at 0 bytes."""
    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

    rows = _aligned_rows(8)
    page = rows.shape[1]
    tier = make_tier(str(tmp_path), rows, max_bytes=4 * page)
    try:

        def broken(*args, **kwargs):
            raise RuntimeError("a bug in the store path")

        monkeypatch.setattr(fs_manager, "store_group_files", broken)
        results = store_keys(tier, [key(1), key(2)], 0, rows)
        assert [r.success for r in results] == [False, False]
        wait_until(lambda: tier._budget.used == 0)
    finally:
        tier.shutdown()


def test_file_with_a_load_in_flight_is_not_evicted(tmp_path, monkeypatch):
    """A budget of two files, both stored; one has a load in flight (held
    in its read) and the other was reported present by lookup() in this
    step: a store of new keys evicts neither (it fails, counted), the load
    reads the stored bytes, and once both are released a store evicts."""
    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

    rows = _aligned_rows(8)
    page = rows.shape[1]
    tier = make_tier(str(tmp_path), rows, max_bytes=2 * page)
    release = threading.Event()
    load_group_files = fs_manager.load_group_files

    def slow_load(*args, **kwargs):
        assert release.wait(30)
        return load_group_files(*args, **kwargs)

    monkeypatch.setattr(fs_manager, "load_group_files", slow_load)
    try:
        a, b, c, d = key(1), key(2), key(3), key(4)
        store_keys(tier, [a, b], 0, rows)
        tier.submit_load(make_job(10, [a], [5], is_promotion=True))
        assert tier.lookup(b, _CTX)  # reported present: its promotion follows
        (result,) = store_keys(tier, [c], 20, rows)
        assert not result.success  # no room: both files are in use
        assert tier.lookup(c, _CTX) is False
        release.set()
        (loaded,) = _finish(tier)
        assert loaded.success
        np.testing.assert_array_equal(rows[5], block_bytes(a, page))
        assert os.path.exists(tier.file_mapper.get_file_name(b))
        # nothing in flight any more: the least recent is evicted for d
        (result,) = store_keys(tier, [d], 30, rows)
        assert result.success and tier.lookup(d, _CTX)
        assert disk_bytes(str(tmp_path)) <= 2 * page
    finally:
        release.set()
        tier.shutdown()


def test_a_refused_job_still_removes_what_it_evicted(tmp_path):
    """A job that evicts a chunk and is then refused (the rest of the room
    is pinned by a lookup hit) still removes the evicted file: else it stays
    on disk uncounted, past max_bytes, and its key is a miss that is never
    written again. The job's first task removes it, whatever its key."""
    rows = _aligned_rows(8)
    page = rows.shape[1]
    max_bytes = 2 * page + page // 2
    tier = make_tier(str(tmp_path), rows, max_bytes=max_bytes)
    try:
        a, b = key(1), key(2)
        store_keys(tier, [a, b], 0, rows)
        assert tier.lookup(a, _CTX)  # pinned for this step
        h = b"two-groups".ljust(32, b"\0")
        c0, c1 = make_offload_key(h, 0), make_offload_key(h, 1)
        rows[3] = block_bytes(c0, page)
        rows[4] = block_bytes(c1, page)
        # room for one of the two files once b is evicted: the job is refused
        tier.submit_store(make_job(10, [c0, c1], [3, 4]))
        assert not all(r.success for r in _finish(tier))
        tier.get_finished()  # the next engine step: b's removal is over
        assert not os.path.exists(tier.file_mapper.get_file_name(b))
        assert disk_bytes(str(tmp_path)) <= max_bytes
        (stored,) = store_keys(tier, [b], 20, rows)
        assert stored.success and tier.lookup(b, _CTX)
        assert os.path.exists(tier.file_mapper.get_file_name(b))
        assert disk_bytes(str(tmp_path)) <= max_bytes
    finally:
        tier.shutdown()


def test_an_evicted_file_is_a_miss_until_it_is_removed(tmp_path):
    """A store evicts a chunk and an I/O thread removes its file later: in
    between, lookup() answers the evicted key as a miss (a promotion of it
    would load a file being removed), and a store of that key is not
    written (the pending removal would delete the new file)."""
    rows = _aligned_rows(4)
    page = rows.shape[1]
    tier = make_tier(str(tmp_path), rows, max_bytes=page)  # one file
    budget = tier._budget
    release = threading.Event()
    try:
        assert budget.scan_done.wait(30)
        store_keys(tier, [key(1)], 0, rows)
        path1 = tier.file_mapper.get_file_name(key(1))
        real_remove = budget.remove_evicted

        def held_remove(evicted):
            release.wait(30)
            real_remove(evicted)

        budget.remove_evicted = held_remove
        rows[1] = block_bytes(key(2), page)
        tier.submit_store(make_job(1, [key(2)], [1]))
        # key 1 is evicted (by the job's admission, on an I/O thread), its
        # file still on disk until the removal runs
        wait_until(lambda: budget.is_removing(key(1)))
        assert os.path.exists(path1)
        assert not tier.lookup(key(1), _CTX)
        rows[2] = block_bytes(key(1), page)
        tier.submit_store(make_job(2, [key(1)], [2]))
        release.set()
        assert all(r.success for r in _finish(tier, 2))
        assert not os.path.exists(path1)
        assert not tier.lookup(key(1), _CTX)
        assert tier.lookup(key(2), _CTX)
        assert disk_bytes(str(tmp_path)) <= page
    finally:
        release.set()
        tier.shutdown()


def test_the_files_times_are_their_prompts_order(tmp_path):
    """A restart reads the order back from the files' times: a prompt's
    files (written head first, in two jobs) end up with times that fall
    from its head to its tail, and a hit makes its chunk's file the newest."""
    rows = _aligned_rows(8)
    page = rows.shape[1]
    tier = make_tier(str(tmp_path), rows, max_bytes=8 * page)
    keys = [key(i) for i in range(4)]
    other = key(10)

    def mtimes(ks):
        paths = [tier.file_mapper.get_file_name(k) for k in ks]
        return [os.stat(p).st_mtime_ns for p in paths]

    try:
        ctx = prompt_ctx("req", keys)
        for j in (0, 2):
            tier.submit_store(prompt_job(j, keys[j : j + 2], ctx))
            _finish(tier)
        assert all(r.success for r in store_keys(tier, [other], 10, rows))
        # written at once (one kernel tick), then set to their order
        wait_until(lambda: mtimes(keys) == sorted(set(mtimes(keys)), reverse=True))
        assert tier.lookup(keys[3], _CTX)
        tier.get_finished()  # the step ends
        wait_until(lambda: mtimes([keys[3]])[0] > max(mtimes([other] + keys[:3])))
    finally:
        tier.shutdown()


def test_two_tiers_on_one_root_keep_their_budgets(tmp_path, monkeypatch):
    """Two engines' tiers on one root (the same model and layout: the same
    directory), each with a budget of three files, store the same key and
    then five of their own: each stays within its budget, the root within
    the sum, and a file the other engine evicted is a miss for a tier that
    indexed it (no error, no wrong bytes)."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    # neither lists the root after its start (which would count the other's
    # files in one max_bytes), however slow this machine
    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 1e9)
    rows = _aligned_rows(8)
    page = rows.shape[1]
    root = str(tmp_path)
    first = make_tier(root, rows, max_bytes=3 * page)
    second = make_tier(root, rows, max_bytes=3 * page)
    try:
        shared = key(0)
        store_keys(first, [shared], 0, rows)
        store_keys(second, [shared], 0, rows)
        store_keys(first, [key(100 + i) for i in range(5)], 10, rows)
        store_keys(second, [key(200 + i) for i in range(5)], 10, rows)
        assert first._budget.used <= 3 * page
        assert second._budget.used <= 3 * page
        assert disk_bytes(root) <= 6 * page
        assert first.lookup(shared, _CTX) is False  # evicted by both
        # a load of a key another engine removed under it: a miss, not bytes
        k = key(104)
        assert first.lookup(k, _CTX)
        os.remove(first.file_mapper.get_file_name(k))
        first.submit_load(make_job(50, [k], [6], is_promotion=True))
        (result,) = _finish(first)
        assert not result.success and not list(result.successful_keys)
    finally:
        first.shutdown()
        second.shutdown()


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


def _engine_on_shared_root(root, engine, rounds, first_round, kill_in, report):
    """One engine of test_engines_on_one_root_survive_one_killed_mid_store (a
    process of its own): stores prompts of a shared head and chunks of its
    own, 8 keys a job, looks them up and loads them back, and reports per
    round its budget's bytes and the loads whose bytes were wrong. With
    kill_in, the store of that round writes half its files, reports
    "storing" and waits to be killed."""
    from vllm.v1.kv_offload import file_mapper

    # the mock config's values differ between processes (reprs with ids):
    # one model identity for all, as engines of one model have
    file_mapper.describe_kv_values = lambda source: {"model": "test-model"}
    rows = _aligned_rows(16)
    page = rows.shape[1]
    tier = make_tier(root, rows, max_bytes=8 * page)
    store = fs_manager.store_group_files
    said = threading.Lock()

    def half_then_hang(gf, paths, view, offsets, o_direct, modes, mac, keys, crc):
        # the job's first half of files written, then killed mid-store
        half = len(paths) // 2
        store(
            gf,
            paths[:half],
            view,
            offsets[:half],
            o_direct,
            modes,
            mac,
            keys[:half],
            crc,
        )
        if said.acquire(blocking=False):
            report.send((engine, "storing"))
        time.sleep(600)

    try:
        assert tier._budget.scan_done.wait(60)
        for r in range(first_round, first_round + rounds):
            head = [key(i) for i in range(4)]
            own = [key(10000 * engine + 10 * r + i) for i in range(4)]
            keys = head + own
            for i, k in enumerate(keys):
                rows[i] = block_bytes(k, page)
            if r == kill_in:
                fs_manager.store_group_files = half_then_hang
            ctx = prompt_ctx(f"e{engine}-r{r}", keys)
            tier.submit_store(prompt_job(r, keys, ctx))
            _finish(tier)
            hits = [k for k in keys if tier.lookup(k, ctx)]
            rows[8:] = 0
            loaded = set(hits)
            if hits:
                slots = list(range(8, 8 + len(hits)))
                tier.submit_load(make_job(1000 + r, hits, slots, is_promotion=True))
                (result,) = _finish(tier)
                if not result.success:
                    loaded = set(result.successful_keys or ())
            tier.get_finished()  # the step ends
            wrong = [
                k.hex()
                for i, k in enumerate(hits)
                if k in loaded and not np.array_equal(rows[8 + i], block_bytes(k, page))
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
    loads its key's bytes, each engine's budget holds after every round,
    and the root holds at most the sum of the budgets."""
    import multiprocessing
    import signal

    # one layout for all: the same hash seed (the block hashes' NONE_HASH)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    ctx = multiprocessing.get_context("spawn")
    root = str(tmp_path / "fs")
    page = _aligned_rows(1).shape[1]
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
    expected = [(e, r) for e in (0, 1) for r in range(6)]
    expected += [(2, 0), (2, 1)] + [(2, r) for r in range(3, 6)]
    assert done == sorted(expected)
    assert all(used <= 8 * page for _, _, used, _ in rounds), rounds
    assert not [w for _, _, _, w in rounds if w], rounds
    # one layout: the engines shared their files
    assert len([n for n in os.listdir(root) if n.endswith("_r0")]) == 1
    on_disk = [
        make_offload_key(bytes.fromhex(name[:-4]), 0)
        for _, _, names in os.walk(root)
        for name in names
        if name.endswith(".bin")
    ]
    assert 0 < len(on_disk) <= 3 * 8
    from vllm.v1.kv_offload import file_mapper

    monkeypatch.setattr(
        file_mapper, "describe_kv_values", lambda source: {"model": "test-model"}
    )
    rows = _aligned_rows(len(on_disk))
    tier = make_tier(root, rows)  # no budget: loads what is there
    try:
        tier.submit_load(make_job(0, on_disk, list(range(len(on_disk))), True))
        (result,) = _finish(tier)
        assert result.success
        for i, k in enumerate(on_disk):
            np.testing.assert_array_equal(rows[i], block_bytes(k, page))
    finally:
        tier.shutdown()


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


def test_a_budget_on_a_root_not_made_yet_warns_of_no_ledger(tmp_path, caplog):
    """The tier makes its rank directory with its first store: until then
    the budget writes no ledger and says nothing of it; then it writes it."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    root = str(tmp_path / "rank")
    budget, path_of = _budget_on(root, 4)
    key = make_offload_key(bytes([1]) * 32, 0)
    try:
        with caplog.at_level(logging.WARNING):
            job = budget.admit_store([key], "r", {key: 16})
            budget.admitted(job)
            time.sleep(10 * budget_module.BUDGET_INTERVAL_S)  # ticks
        assert not [r for r in caplog.records if "ledger" in r.getMessage()]
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
    rows = _aligned_rows(2)
    before = threading.active_count()
    with pytest.raises(ValueError, match=r"max_bytes .* must be .*>= 4096"):
        make_tier(str(tmp_path), rows, max_bytes=max_bytes)
    assert threading.active_count() == before


def test_budget_above_free_space_warns_once(tmp_path, caplog):
    """A budget larger than the filesystem's free space: one warning at
    start with both numbers."""
    rows = _aligned_rows(2)
    huge = 1 << 62
    with caplog.at_level(logging.WARNING):
        tier = make_tier(str(tmp_path), rows, max_bytes=huge)
        tier.shutdown()
    warnings = [
        r.getMessage() for r in caplog.records if "free space" in r.getMessage()
    ]
    assert len(warnings) == 1 and str(huge) in warnings[0], warnings


def test_other_layouts_in_the_root_are_named_at_start(tmp_path, caplog):
    """This model's other layouts in the root (an earlier version's, another
    tier setting's) are never read, removed or counted by max_bytes: one line
    at start names them (five, then a count), a warning with a budget. Other
    models' layouts (likely live) get an info line. The tier's own
    directories (its config's, every rank's), links and files are not named."""
    rows = _aligned_rows(2)
    block_bytes = rows.shape[1]
    root = str(tmp_path)
    first = make_tier(root, rows)
    first.shutdown()
    own = os.path.basename(first.file_mapper.base_path)
    model = own[:-13]  # FileMapper's <model>_<12 hex digits>
    os.makedirs(os.path.join(root, f"{own}_r1"))  # another rank of this layout
    olds = [f"{model}_{i:012x}" for i in range(1, 7)]
    for old in olds:
        os.makedirs(os.path.join(root, old))
    old_block = os.path.join(root, f"{olds[0]}_r0", "abc", "de_g0", "abcde.bin")
    os.makedirs(os.path.dirname(old_block))
    with open(old_block, "wb") as f:
        f.write(bytes(block_bytes))
    os.makedirs(os.path.join(root, "other_model_0123456789ab_r0"))
    not_layouts = [f"{model}_{7:012x}", f"{model}_{8:012x}", "notes_0123456789ab.d"]
    os.symlink(os.path.join(root, olds[0]), os.path.join(root, not_layouts[0]))
    open(os.path.join(root, not_layouts[1]), "w").close()
    os.makedirs(os.path.join(root, not_layouts[2]))
    for max_bytes, level in ((4 * block_bytes, logging.WARNING), (None, logging.INFO)):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            make_tier(root, rows, max_bytes=max_bytes).shutdown()
        lines = [
            (r.getMessage(), r.levelno)
            for r in caplog.records
            if "are in the root" in r.getMessage()
        ]
        assert len(lines) == 2, lines
        (same, same_level), (other, other_level) = lines
        assert "6 other layout(s) of this model" in same and same_level == level
        assert all(repr(old) in same for old in olds[:5]), same
        assert repr(olds[5]) not in same and "and 1 more" in same, same
        assert "1 other model(s)'" in other and other_level == logging.INFO
        assert "'other_model_0123456789ab'" in other, other
        for name in (own, *not_layouts):
            assert name not in same + other, name
        assert ("max_bytes" in same) == (max_bytes is not None), same
    assert os.path.exists(old_block)


def test_other_layouts_are_named_least_recently_used_first(
    tmp_path, caplog, monkeypatch
):
    """A running tier marks its layout in use (its directory's mtime) at
    start and every LAYOUT_MARK_INTERVAL_S until shutdown, and the start-up
    line names the other layouts least recently used first, each with how
    long ago: an operator tells a layout nobody runs from another engine's."""
    monkeypatch.setattr(fs_layouts, "LAYOUT_MARK_INTERVAL_S", 0.05)
    rows = _aligned_rows(2)
    root = str(tmp_path)
    first = make_tier(root, rows)
    layout_dir = first.file_mapper.base_path
    old = int(time.time()) - 10 * 86400
    try:
        for _ in range(2):  # marked again and again, not only at start
            os.utime(layout_dir, (old, old))
            deadline = time.monotonic() + 10
            while os.stat(layout_dir).st_mtime == old:
                assert time.monotonic() < deadline, "the layout was not marked again"
                time.sleep(0.01)
    finally:
        first.shutdown()
    assert not first._marker.is_alive()
    model = os.path.basename(layout_dir)[:-13]  # FileMapper's <model>_<digest>
    now = int(time.time())
    expected = []
    for i, (age_s, age) in enumerate(
        ((40 * 86400, "40 days"), (3 * 3600, "3 h"), (5 * 60, "5 min")), 1
    ):
        other = os.path.join(root, f"{model}_{i:012x}")
        os.makedirs(other)
        os.utime(other, (now - age_s, now - age_s))
        expected.append(f"'{model}_{i:012x}' (last used {age} ago;")
    os.utime(layout_dir, (old, old))
    monkeypatch.setattr(fs_layouts, "LAYOUT_MARK_INTERVAL_S", 3600.0)
    with caplog.at_level(logging.INFO):
        make_tier(root, rows).shutdown()
    (line,) = [
        r.getMessage()
        for r in caplog.records
        if "other layout(s) of this model" in r.getMessage()
    ]
    positions = [line.find(name) for name in expected]
    assert -1 not in positions and positions == sorted(positions), line
    assert "mark theirs every 60 min" in line, line
    assert os.stat(layout_dir).st_mtime > old + 86400  # marked at start


def test_other_layouts_say_what_differs(tmp_path, caplog):
    """A model changed at its path (new weights, another config) starts a new
    layout; the start-up line names this model's old layouts with what
    differs in their config.json, so that an operator sees why they are
    unused and can remove them."""
    rows = _aligned_rows(2)
    root = str(tmp_path)
    first = make_tier(root, rows)
    first.shutdown()
    fields = first.file_mapper.fields
    values = fields["kv_values"]
    model = os.path.basename(first.file_mapper.base_path)[:-13]
    weights = {"source": "local", "revision": None, "digest": "0" * 32}
    old_fields = {
        "weights changed": {**fields, "kv_values": {**values, "weights": weights}},
        "model config changed": {
            **fields,
            "kv_values": {**values, "hf_config": "0" * 32},
        },
        "written before the model's values were recorded": {
            k: v for k, v in fields.items() if k != "kv_values"
        },
        "no readable config.json": None,
    }
    names = {}
    for i, (change, old) in enumerate(old_fields.items(), 1):
        names[change] = f"{model}_{i:012x}"
        os.makedirs(os.path.join(root, names[change]))
        if old is not None:
            with open(os.path.join(root, names[change], "config.json"), "w") as f:
                json.dump(old, f)
    with caplog.at_level(logging.INFO):
        make_tier(root, rows).shutdown()
    (line,) = [
        r.getMessage()
        for r in caplog.records
        if "other layout(s) of this model" in r.getMessage()
    ]
    for change, name in names.items():
        assert f"'{name}' (last used 0 min ago; {change})" in line, line


def test_a_failing_layout_mark_is_reported_rate_limited_with_counts(
    tmp_path, caplog, monkeypatch
):
    """A layout mark that keeps failing (a read-only root, another owner) is a
    warning at the first failure and then once every
    MARK_FAILURES_REPORTED_EVERY failures, with the count, and an info line
    once it works again: never silent, and not a line per interval for ever."""
    monkeypatch.setattr(fs_layouts, "LAYOUT_MARK_INTERVAL_S", 0.01)
    real_utime = os.utime
    state = {"fail": False, "failures": 0}

    def utime(*args, **kwargs):
        if state["fail"]:
            state["failures"] += 1
            raise PermissionError(13, "Permission denied")
        return real_utime(*args, **kwargs)

    monkeypatch.setattr(os, "utime", utime)

    def messages(text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if text in r.getMessage()]

    with caplog.at_level(logging.INFO):
        tier = make_tier(str(tmp_path), _aligned_rows(2))
        try:
            state["fail"] = True
            deadline = time.monotonic() + 10
            while state["failures"] < 30:
                assert time.monotonic() < deadline, state
                time.sleep(0.01)
            state["fail"] = False
            while not messages("again after"):
                assert time.monotonic() < deadline + 10, "no line on recovery"
                time.sleep(0.01)
        finally:
            tier.shutdown()
    failures = state["failures"]
    every = fs_layouts.MARK_FAILURES_REPORTED_EVERY
    warnings = messages("could not mark its layout in use")
    assert len(warnings) == -(-failures // every) >= 2, (failures, warnings)
    assert "(1 time(s) in a row; " in warnings[0], warnings
    assert f"({every + 1} time(s) in a row; " in warnings[1], warnings
    assert "Permission denied" in warnings[0], warnings
    (recovered,) = messages("again after")
    assert f"again after {failures} failure(s)" in recovered, recovered


def test_what_the_budget_remembers_is_bounded(tmp_path, monkeypatch):
    """The requests' keys kept for the order are bounded (MAX_TRACKED_KEYS,
    the least recently seen requests dropped first; 0.22.1 tiers hear of no
    finished request), and the index holds the files on disk only: 50
    requests of 4 chunks over a budget of 4 files."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    monkeypatch.setattr(budget_module, "MAX_TRACKED_KEYS", 64)
    monkeypatch.setattr(budget_module, "SCAN_BATCH", 8)
    rows = _aligned_rows(8)
    page = rows.shape[1]
    tier = make_tier(str(tmp_path), rows, max_bytes=4 * page)
    budget = tier._budget
    try:
        for r in range(50):
            keys = [key(1000 * r + i) for i in range(4)]
            tier.submit_store(prompt_job(r, keys, prompt_ctx(f"req{r}", keys)))
            _finish(tier)
            with budget._lock:
                assert 0 < budget._tracked <= 64
                assert budget._tracked == sum(
                    len(q.keys) for q in budget._requests.values()
                )
                assert len(budget._chunks) <= 4
                assert len(budget._heap) <= 2 * 4 + budget_module.SCAN_BATCH
        # the last request's chunks are kept, head newest
        last = [key(49000 + i) for i in range(4)]
        assert all(tier.lookup(k, _CTX) for k in last)
        times = [budget._chunks[k[:-4]][0] for k in last]
        assert times == sorted(times, reverse=True)
    finally:
        tier.shutdown()


def test_the_scheduler_thread_never_waits_on_the_budget(tmp_path):
    """The budget's work (admission, eviction, pins, the orphan check's
    filesystem call) runs off the scheduler thread: with the budget's lock
    held by another thread, lookup(), submit_store(),
    submit_load() and get_finished() return at once, and no budget path
    is made on the scheduler thread; once the lock is free, the jobs
    finish and the budget holds."""
    rows = _aligned_rows(8)
    page = rows.shape[1]
    tier = make_tier(str(tmp_path), rows, max_bytes=2 * page)
    budget = tier._budget
    chunk_path = budget._chunk_path
    path_threads: list[str] = []

    def recording_chunk_path(h, g):
        path_threads.append(threading.current_thread().name)
        return chunk_path(h, g)

    budget._chunk_path = recording_chunk_path
    try:
        assert budget.scan_done.wait(30)
        store_keys(tier, [key(1), key(2)], 0, rows)
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
            # key 3's predecessor (key 9) is on no disk: an orphan
            ctx = prompt_ctx("orphan", [key(9), key(3), key(4)])
            assert tier.lookup(key(1), _CTX)
            for n in (3, 4):
                rows[n] = block_bytes(key(n), page)
            job = prompt_job(5, [key(3), key(4)], ctx)
            job.block_ids[:] = (3, 4)
            tier.submit_store(job)
            tier.submit_load(make_job(6, [key(1)], [6], is_promotion=True))
            results.extend(tier.get_finished())

        calls = threading.Thread(target=scheduler_calls, name="scheduler")
        calls.start()
        calls.join(10)
        blocked = calls.is_alive()
        release.set()
        holder.join(30)
        calls.join(30)
        assert not blocked, "a scheduler-side call waited on the budget's lock"
        results.extend(_finish(tier, 2 - len(results)))
        assert len(results) == 2
        assert path_threads and "scheduler" not in path_threads, path_threads
        # key 3 is not worth writing (its predecessor is on no disk), and so
        # is key 4 after it; the load of key 1 read its bytes
        assert not tier.lookup(key(3), _CTX) and not tier.lookup(key(4), _CTX)
        np.testing.assert_array_equal(rows[6], block_bytes(key(1), page))
        assert disk_bytes(str(tmp_path)) <= 2 * page
    finally:
        tier.shutdown()


def test_the_budget_thread_evicts_ahead_to_the_low_water_mark(tmp_path, monkeypatch):
    """Past HIGH_WATER percent of max_bytes the budget thread evicts down to
    LOW_WATER percent, never below, and removes those files itself: stores
    at a full budget then find room, and their tasks remove no file."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    rows = _aligned_rows(8)
    page = rows.shape[1]
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
    # what the store tasks remove themselves (a store that had to evict)
    by_stores: list = []
    remove_evicted = budget.remove_evicted
    monkeypatch.setattr(
        budget,
        "remove_evicted",
        lambda evicted: (by_stores.extend(evicted), remove_evicted(evicted)),
    )
    try:
        assert budget.scan_done.wait(30)
        for n in range(100):
            assert all(r.success for r in store_keys(tier, [key(n)], n, rows))
            # at rest: under the high-water mark, files all removed
            wait_until(
                lambda: budget.used <= high and not getattr(budget, "unlinking", 0)
            )
            assert budget.used <= 40 * page
            if n >= 40:
                assert budget.used >= low  # never below the low-water mark
        assert disk_bytes(str(tmp_path)) <= high
        assert budget.evicted_files >= 100 - 40
        assert not by_stores
        assert len(removers) >= 100 - 40, removers
        assert set(removers) == {"vllm_kv_py_fs_budget"}, removers
    finally:
        tier.shutdown()


def test_a_store_does_not_wait_for_the_budget_threads_removals(tmp_path, monkeypatch):
    """The budget thread's file removal hangs (a stuck filesystem): stores
    that need the room evict for themselves, write, and the files stay
    within max_bytes."""
    rows = _aligned_rows(8)
    page = rows.shape[1]
    tier = make_tier(str(tmp_path), rows, max_bytes=20 * page)
    budget = tier._budget
    stuck, release = threading.Event(), threading.Event()
    remove = os.remove

    def hanging_remove(path, *args, **kwargs):
        if threading.current_thread().name == "vllm_kv_py_fs_budget":
            stuck.set()
            release.wait(60)
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", hanging_remove)
    try:
        assert budget.scan_done.wait(30)
        store_keys(tier, [key(n) for n in range(20)], 0, rows)
        assert stuck.wait(30)  # evicting ahead, stuck in its first removal
        results = store_keys(tier, [key(100 + n) for n in range(10)], 20, rows)
        assert all(r.success for r in results)
        assert all(tier.lookup(key(100 + n), _CTX) for n in range(10))
        assert disk_bytes(str(tmp_path)) <= 20 * page
    finally:
        release.set()
        tier.shutdown()


def test_a_file_that_cannot_be_removed_is_counted_and_reported(tmp_path, caplog):
    """An evicted file whose removal fails (here a directory in its place)
    is counted and reported through the tier's failure report."""
    rows = _aligned_rows(4)
    page = rows.shape[1]
    tier = make_tier(str(tmp_path), rows, max_bytes=page)
    budget = tier._budget
    try:
        assert budget.scan_done.wait(30)
        store_keys(tier, [key(1)], 0, rows)
        path1 = tier.file_mapper.get_file_name(key(1))
        os.remove(path1)
        os.mkdir(path1)
        with caplog.at_level(logging.ERROR):
            (result,) = store_keys(tier, [key(2)], 1, rows)
            assert result.success
            # the failure is counted, then reported: wait for the report itself
            wait_until(
                lambda: any(
                    "1 evicted block file(s) could not be removed" in r.getMessage()
                    for r in caplog.records
                )
            )
        assert getattr(budget, "removal_errors", 0) == 1
        assert os.path.isdir(path1)
    finally:
        tier.shutdown()


def test_evicted_files_that_cannot_be_removed_stay_counted(tmp_path, monkeypatch):
    """Every removal fails (not ENOENT): the evicted files stay and stay
    counted, so stores are refused once they fill max_bytes, not written
    beyond it store after store."""
    rows = _aligned_rows(4)
    page = rows.shape[1]
    tier = make_tier(str(tmp_path), rows, max_bytes=2 * page)
    try:
        assert tier._budget.scan_done.wait(30)
        assert all(r.success for r in store_keys(tier, [key(0)], 0, rows))
        monkeypatch.setattr(os, "remove", os.rmdir)  # ENOTDIR on a file
        store_keys(tier, [key(n) for n in range(1, 10)], 1, rows)
        assert disk_bytes(str(tmp_path)) <= 2 * 2 * page
    finally:
        tier.shutdown()


def test_a_file_a_hit_indexed_counts_once_within_max_bytes(tmp_path, monkeypatch):
    """Another engine's files lookup() found, before this engine counted
    that engine's ledger, are counted once, in this engine's index (the
    others' bytes never go below zero): a store past max_bytes evicts for
    them at once, not at the next listing."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 1e9)  # hits index them
    rows = _aligned_rows(8)
    page = rows.shape[1]
    root = str(tmp_path)
    tier = make_tier(root, rows, max_bytes=4 * page)
    other = make_tier(root, rows, max_bytes=64 * page)
    try:
        assert tier._budget.scan_done.wait(30) and other._budget.scan_done.wait(30)
        keys = [key(i) for i in range(5)]
        assert all(r.success for r in store_keys(other, keys[:4], 0, rows))
        assert all(tier.lookup(k, _CTX) for k in keys[:4])
        assert not list(tier.get_finished())  # the step ends: hits unpinned
        assert all(r.success for r in store_keys(tier, keys[4:], 10, rows))
        assert disk_bytes(root) <= 4 * page
    finally:
        tier.shutdown()
        other.shutdown()


def test_rejections_warn_rate_limited_and_failed_writes_stay_errors(tmp_path, caplog):
    """A store refused for want of room (every file pinned) is the budget
    working, not the disk failing: it fails its key and is reported on the
    budget's own warning (at once, then at most one line per interval, with
    the counts and max_bytes), never on the tier's I/O failure line; a
    write that fails on the disk is still reported there."""
    rows = _aligned_rows(8)
    page = rows.shape[1]
    tier = make_tier(str(tmp_path), rows, max_bytes=2 * page)
    budget = tier._budget
    a, b = key(1), key(2)
    try:
        with caplog.at_level(logging.WARNING):
            store_keys(tier, [a, b], 0, rows)
            assert tier.lookup(a, _CTX) and tier.lookup(b, _CTX)  # pinned
            # a job in the step of the hits (their pins hold until it ends)
            tier.submit_store(make_job(10, [key(3)], [2]))
            assert not _finish(tier)[0].success
            # the first warning out before the second refusal: one tick of
            # the budget thread could refuse both and say so in one line
            wait_until(lambda: "not written" in caplog.text)
            assert tier.lookup(a, _CTX) and tier.lookup(b, _CTX)  # this step's
            tier.submit_store(make_job(20, [key(4)], [3]))
            assert not _finish(tier)[0].success
            assert budget.rejected_files == 2
            tier.get_finished()  # the end of the step releases the pins
            # a write that fails on the disk: a non-empty directory in the way
            path = tier.file_mapper.get_file_name(key(5))
            os.makedirs(os.path.join(path, "x"))
            (r3,) = store_keys(tier, [key(5)], 30, rows)
            assert not r3.success
            tier.shutdown()
        warnings = [
            r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
        ]
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        rejections = [m for m in warnings if "not written" in m]
        # the first at once; the second within the interval at shutdown
        assert len(rejections) == 2, rejections
        assert "1 block file(s) of 1 store job(s)" in rejections[0]
        assert f"max_bytes={2 * page}" in rejections[0]
        assert "(2 and 2 since start)" in rejections[1]
        # the I/O failure line counts the failed write only
        assert len(errors) == 1, errors
        assert "1 store job(s) and 0 load job(s) failed" in errors[0]
        assert "1 block(s) not stored, 0 not loaded and recomputed" in errors[0]
        assert "no room in max_bytes" not in errors[0]
    finally:
        tier.shutdown()


def test_a_chunk_stored_during_the_scan_stays_behind_its_recovered_head(
    tmp_path, monkeypatch
):
    """A chunk stored while the start-up scan has not reached the chunk
    before it (a file of an earlier run, older) takes that file into the
    index at once, at its request's order: once the scan is done, the
    earlier chunk is still newer than the new one, so eviction takes the
    new chunk (the tail) first."""
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    rows = _aligned_rows(8)
    page = rows.shape[1]
    tier = make_tier(str(tmp_path), rows, max_bytes=8 * page)
    try:
        store_keys(tier, [key(1), key(2)], 0, rows)
    finally:
        tier.shutdown()
    now = time.time()
    for n, age in ((1, 100), (2, 50)):  # earlier runs' files: old
        path = tier.file_mapper.get_file_name(key(n))
        os.utime(path, (now - age, now - age))
    # one chunk per scan batch, the scan held after its first batch
    paused, resume = threading.Event(), threading.Event()

    class HeldTime:
        monotonic = staticmethod(time.monotonic)
        time_ns = staticmethod(time.time_ns)

        @staticmethod
        def sleep(seconds):
            paused.set()
            resume.wait(30)

    monkeypatch.setattr(budget_module, "SCAN_BATCH", 1)
    monkeypatch.setattr(budget_module, "time", HeldTime)
    tier = make_tier(str(tmp_path), rows, max_bytes=8 * page)
    budget = tier._budget
    try:
        assert paused.wait(30)
        # another prompt with the same first chunk, not indexed yet
        head = key(1)[:-4] if key(1)[:-4] not in budget._chunks else key(2)[:-4]
        first = key(1) if head == key(1)[:-4] else key(2)
        ctx = prompt_ctx("req", [first, key(5)])
        rows[0] = block_bytes(key(5), page)
        tier.submit_store(prompt_job(10, [key(5)], ctx))
        assert all(r.success for r in _finish(tier))
        resume.set()
        assert budget.scan_done.wait(30)
        with budget._lock:
            assert budget._chunks[head][0] > budget._chunks[key(5)[:-4]][0]
            assert len(budget._chunks) == 3
    finally:
        resume.set()
        tier.shutdown()


def test_a_fifo_for_another_layouts_config_is_not_waited_on(tmp_path):
    """Another layout's config.json that is a FIFO (planted by whoever may
    write into the root) reads as none: the tier's start does not wait for a
    writer, as it did, forever."""
    fifo = tmp_path / "other" / "config.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    fields: list = []
    reader = threading.Thread(
        target=lambda: fields.append(fs_layouts._read_fields(str(tmp_path), "other")),
        daemon=True,
    )
    reader.start()
    reader.join(timeout=10)
    blocked = reader.is_alive()
    if blocked:  # a writer's open lets it go on
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
    assert not blocked and fields == [None]
