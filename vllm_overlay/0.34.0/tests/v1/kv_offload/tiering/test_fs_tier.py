# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests for FileSystemTierManager.

These tests use real disk I/O to verify the filesystem tier implementation.
The tier manager writes KV cache blocks to disk and reads them back, verifying
data integrity throughout the process.
"""

import errno
import json
import mmap
import os
import threading
import time
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingKVEventsConfig,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.async_lookup import LookupPhase
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.fs.manager import (
    FileSystemTierManager,
)
from vllm.v1.kv_offload.tiering.fs.report import Throttle
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

_NUM_BLOCKS = 8
_BLOCK_ELEMENTS = 128 * mmap.PAGESIZE  # 2MB per block for pagesize 4096.
_DTYPE: torch.dtype = torch.float32
_CTX = ReqContext(req_id="test")


def _make_offloading_spec(
    enable_kv_cache_events: bool = False,
    *,
    tp_size: int = 1,
    rank: int = 0,
    world_size: int | None = None,
    replicated_layout: bool = False,
    is_parallelism_agnostic: bool = False,
) -> MagicMock:
    """Mock spec with an explicit global KV events flag."""
    if world_size is None:
        world_size = tp_size
    spec = MagicMock()
    spec.config = OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=enable_kv_cache_events,
        extra_config={},
        engine_id="test-engine",
        model=OffloadingModelConfig(name="test-model", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=is_parallelism_agnostic,
        ),
        replicated_layout=replicated_layout,
    )
    spec.blocks_per_chunk = 1
    spec.kv_events_config = OffloadingKVEventsConfig(
        enable_kv_cache_events=enable_kv_cache_events,
        self_describing_kv_events=False,
    )
    return spec


_MOCK_OFFLOADING_SPEC = _make_offloading_spec(enable_kv_cache_events=False)


def key(n: int) -> OffloadKey:
    return make_offload_key(n.to_bytes(8, "big"), 0)


def make_job(
    job_id: int,
    keys: list[OffloadKey],
    chunk_ids: list[int] | None = None,
    is_promotion: bool = False,
) -> TransferJob:
    if chunk_ids is None:
        chunk_ids = list(range(len(keys)))
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(chunk_ids, dtype=np.int64),
        is_promotion=is_promotion,
        req_context=_CTX,
    )


def drain(tier: FileSystemTierManager) -> list:
    """Block until all in-flight jobs finish, then collect results."""
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def lookup_and_wait(
    tier: FileSystemTierManager,
    keys: list[OffloadKey],
    ctx: ReqContext = _CTX,
    timeout: float = 30.0,
) -> list[LookupResult]:
    """Perform a full async lookup cycle and return resolved results: waits
    until no key's probe is in flight (a cached verdict needs none), not a
    fixed time a slow machine may overrun."""
    for k in keys:
        tier.lookup(k, ctx)
    tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
    lookups = tier._lookup_manager
    deadline = time.monotonic() + timeout
    while True:
        lookups.drain_results()
        states = [lookups._lookup_state.get(k) for k in keys]
        if all(s is None or s.phase is not LookupPhase.IN_FLIGHT for s in states):
            break
        assert time.monotonic() < deadline, "the lookup did not resolve"
        time.sleep(0.005)
    return [tier.lookup(k, ctx) for k in keys]


def _page_aligned_zero_tensor(
    num_blocks: int, block_elements: int, dtype: torch.dtype = _DTYPE
) -> torch.Tensor:
    page_size = mmap.PAGESIZE
    dtype_num_bytes = torch.tensor([], dtype=dtype).element_size()

    num_bytes = num_blocks * block_elements * dtype_num_bytes
    num_bytes_aligned = num_bytes + page_size
    t = torch.zeros(num_bytes_aligned, dtype=torch.uint8)

    ptr = t.data_ptr()
    alignment_offset = ptr % page_size
    # Move tensor to next page regardless.
    shift = page_size - alignment_offset
    t = t[shift : shift + num_bytes]
    return t.view(dtype).view(num_blocks, block_elements)


def _page_aligned_rand_tensor(
    num_blocks: int, block_elements: int, dtype: torch.dtype = _DTYPE
) -> torch.Tensor:
    rand_tensor = _page_aligned_zero_tensor(num_blocks, block_elements)
    rand_tensor[:] = torch.rand(num_blocks, block_elements, dtype=dtype)
    return rand_tensor


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------


@pytest.fixture
def fs_tier(tmp_path):
    tensor = _page_aligned_zero_tensor(_NUM_BLOCKS, _BLOCK_ELEMENTS)
    mock_view = memoryview(tensor.numpy())
    tier = FileSystemTierManager(
        offloading_spec=_MOCK_OFFLOADING_SPEC,
        primary_kv_view=mock_view,
        tier_type="fs",
        root_dir=str(tmp_path),
        n_read_threads=4,
        n_write_threads=4,
    )
    yield tier, tensor
    tier.shutdown()


@pytest.fixture
def fs_tier_with_events(tmp_path):
    tensor = _page_aligned_zero_tensor(_NUM_BLOCKS, _BLOCK_ELEMENTS)
    mock_view = memoryview(tensor.numpy())
    tier = FileSystemTierManager(
        offloading_spec=_make_offloading_spec(enable_kv_cache_events=True),
        primary_kv_view=mock_view,
        tier_type="fs",
        root_dir=str(tmp_path),
        n_read_threads=4,
        n_write_threads=4,
        enable_kv_events=True,
        locality="LOCAL",
    )
    yield tier
    tier.shutdown()


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def test_lookup_empty_tier(fs_tier):
    tier, _ = fs_tier
    results = lookup_and_wait(tier, [key(1), key(2)])
    assert results == [LookupResult.MISS, LookupResult.MISS]


def test_store_creates_file_and_lookup_succeeds(fs_tier):
    tier, _ = fs_tier
    job = make_job(1, [key(1)], [0])
    tier.submit_store(job)
    results = drain(tier)
    assert len(results) == 1
    assert results[0].success
    assert lookup_and_wait(tier, [key(1)]) == [LookupResult.HIT]
    dest = tier.file_mapper.get_file_name(key(1))
    assert os.path.exists(dest), f"Expected file at {dest}"


def test_store_marks_a_cached_miss_present(fs_tier):
    tier, _ = fs_tier
    block_key = key(1)
    assert lookup_and_wait(tier, [block_key]) == [LookupResult.MISS]

    tier.submit_store(make_job(1, [block_key], [0]))
    results = drain(tier)
    assert len(results) == 1
    assert results[0].success
    assert lookup_and_wait(tier, [block_key]) == [LookupResult.HIT]


def test_store_accepts_block_published_by_another_writer(fs_tier, monkeypatch):
    """Losing the race to publish a block must not fail the store job.

    Another engine instance sharing the same root_dir can publish the block
    between the existence check and the rename, and some shared filesystems
    report that as EEXIST instead of replacing. Block file names are content
    hashes, so the file already in place holds the same data and the job has
    nothing left to do.
    """
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    # Python path only: EEXIST cannot be injected into the C extension.
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", False)
    tier, tensor = fs_tier
    dest = tier.file_mapper.get_file_name(key(1))

    tier.submit_store(make_job(1, [key(1)], [0]))
    assert all(r.success for r in drain(tier))
    with open(dest, "rb") as f:
        published = f.read()

    real_is_complete_block = io_mod._is_complete_block
    real_replace = os.replace
    hidden: list[str] = []

    def hiding_is_complete_block(path: str, block_size: int) -> bool:
        if path == dest and not hidden:
            hidden.append(path)
            return False
        return real_is_complete_block(path, block_size)

    def racing_replace(src: str, dst: str) -> None:
        if dst == dest:
            raise FileExistsError(errno.EEXIST, "File exists", dst)
        real_replace(src, dst)

    # Hide the published block from the check, then lose the rename to it.
    monkeypatch.setattr(io_mod, "_is_complete_block", hiding_is_complete_block)
    monkeypatch.setattr(io_mod.os, "replace", racing_replace)

    # Distinct bytes, so the comparison below fails if the loser overwrites.
    tensor[1] = 1.0
    tier.submit_store(make_job(2, [key(1)], [1]))
    results = drain(tier)
    assert len(results) == 1
    assert results[0].success
    assert os.listdir(os.path.dirname(dest)) == [os.path.basename(dest)]
    with open(dest, "rb") as f:
        assert f.read() == published


def test_store_then_load_roundtrip(fs_tier):
    tier, _ = fs_tier
    job_s = make_job(1, [key(1), key(2)], [0, 1])
    tier.submit_store(job_s)
    store_results = drain(tier)
    assert all(r.success for r in store_results)

    assert lookup_and_wait(tier, [key(1), key(2)]) == [
        LookupResult.HIT,
        LookupResult.HIT,
    ]

    job_l = make_job(2, [key(1), key(2)], [2, 3], is_promotion=True)
    tier.submit_load(job_l)
    load_results = drain(tier)
    assert all(r.success for r in load_results)
    # A successful load must NOT touch the file: the delete path fires only on
    # a provable short read, so a good block stays on disk (guards against an
    # over-eager delete regressing to upstream's delete-on-any-error).
    for k in (key(1), key(2)):
        assert os.path.exists(tier.file_mapper.get_file_name(k))
    # Blocks stay on disk after load
    assert lookup_and_wait(tier, [key(1), key(2)]) == [
        LookupResult.HIT,
        LookupResult.HIT,
    ]


def test_invalid_path_raises_at_construction():
    """Construction must fail immediately when the config file cannot be written."""
    tensor = _page_aligned_zero_tensor(32, _BLOCK_ELEMENTS)
    mock_view = memoryview(tensor.numpy())

    with pytest.raises(OSError):
        FileSystemTierManager(
            offloading_spec=_MOCK_OFFLOADING_SPEC,
            primary_kv_view=mock_view,
            tier_type="fs",
            root_dir="/dev/null/invalid_path",
        )


@pytest.mark.parametrize("locality", ["local", ""])
def test_invalid_locality_raises_at_construction(tmp_path, locality):
    tensor = _page_aligned_zero_tensor(4, _BLOCK_ELEMENTS)

    with pytest.raises(ValueError, match="Locality"):
        FileSystemTierManager(
            offloading_spec=_MOCK_OFFLOADING_SPEC,
            primary_kv_view=memoryview(tensor.numpy()),
            tier_type="fs",
            root_dir=str(tmp_path),
            locality=locality,
        )


def test_factory_forwards_locality_to_fs_tier(tmp_path):
    tensor = _page_aligned_zero_tensor(4, _BLOCK_ELEMENTS)
    tier = SecondaryTierFactory.create_secondary_tier(
        {
            "type": "fs",
            "root_dir": str(tmp_path),
            "n_read_threads": 1,
            "n_write_threads": 1,
            "locality": "LOCAL",
        },
        memoryview(tensor.numpy()),
        _MOCK_OFFLOADING_SPEC,
    )
    try:
        assert isinstance(tier, FileSystemTierManager)
        assert tier.locality is Locality.LOCAL
    finally:
        tier.shutdown()


def test_failed_load_missing_file(fs_tier):
    """Test that loading a block whose file does not exist results in a failed job."""
    tier, _ = fs_tier
    job = make_job(1, [key(99)], [0], is_promotion=True)
    tier.submit_load(job)
    results = drain(tier)
    assert len(results) == 1
    assert not results[0].success


def test_multiple_jobs_tracked_independently(fs_tier):
    tier, _ = fs_tier
    job1 = make_job(1, [key(1)], [0])
    job2 = make_job(2, [key(2)], [1])
    tier.submit_store(job1)
    tier.submit_store(job2)
    results = drain(tier)
    job_ids = {r.job_id for r in results}
    assert job_ids == {1, 2}
    assert lookup_and_wait(tier, [key(1), key(2)]) == [
        LookupResult.HIT,
        LookupResult.HIT,
    ]


def test_multi_block_job_partial_failure(fs_tier):
    """A load job where one block file is missing yields a single failed JobResult."""
    tier, _ = fs_tier
    # Store two of three keys
    tier.submit_store(make_job(1, [key(10), key(11)], [0, 1]))
    assert all(r.success for r in drain(tier))

    # Load all three — key(99) was never stored
    tier.submit_load(
        make_job(2, [key(10), key(11), key(99)], [0, 1, 2], is_promotion=True)
    )
    results = drain(tier)

    assert len(results) == 1
    assert results[0].job_id == 2
    assert not results[0].success


def test_shutdown_discards_pending_tasks(fs_tier):
    """Shutdown clears both queues and stops all worker threads without draining."""
    tier, _ = fs_tier
    # Submit many tasks to ensure some remain pending
    for i in range(10):
        tier.submit_store(make_job(i, [key(i)], [i % 4]))

    # Shutdown immediately without draining
    tier.shutdown()

    # Verify queues are cleared and threads stopped
    assert len(tier._pool._load_q) == 0
    assert len(tier._pool._store_q) == 0
    assert all(not t.is_alive() for t in tier._pool._threads)


@pytest.mark.parametrize("batch_size", [0, 1, 2, 5])
@pytest.mark.parametrize("use_c_ext", [True, False])
def test_store_load_data_integrity(fs_tier, monkeypatch, use_c_ext, batch_size):
    """Data written by store must be exactly recovered by load, for batches
    of any size -- including the empty batch."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)

    tier, tensor = fs_tier
    # Populate tensor with random data
    tensor[:] = _page_aligned_rand_tensor(_NUM_BLOCKS, _BLOCK_ELEMENTS)

    keys = [key(i) for i in range(batch_size)]
    store_chunk_ids = list(range(batch_size))
    load_chunk_ids = list(range(_NUM_BLOCKS - batch_size, _NUM_BLOCKS))
    expected = tensor[:batch_size].clone()

    tier.submit_store(make_job(1, keys, store_chunk_ids))
    store_results = drain(tier)
    assert len(store_results) == 1
    assert store_results[0].success
    assert all(os.path.exists(tier.file_mapper.get_file_name(k)) for k in keys)

    # reset tensor to prove data is read from disk
    tensor[:] = 0.0

    # Load into a range disjoint by index from the store ids, to also
    # exercise loading a chunk into a different id than it was stored from.
    tier.submit_load(make_job(2, keys, load_chunk_ids, is_promotion=True))
    load_results = drain(tier)
    assert len(load_results) == 1
    assert load_results[0].success

    for i, cid in enumerate(load_chunk_ids):
        assert torch.allclose(tensor[cid], expected[i]), (
            f"Chunk {cid} data mismatch after store+load"
        )


def test_store_load_roundtrip_without_o_direct(tmp_path, monkeypatch):
    """Buffered fallback must round-trip data when O_DIRECT is unsupported.

    Simulates filesystems (e.g. overlayfs, some NFS) that reject O_DIRECT by
    forcing the capability probe to report it unavailable.
    """
    monkeypatch.setattr(
        "vllm.v1.kv_offload.tiering.fs.manager.probe_o_direct",
        lambda _dir: False,
    )
    tensor = _page_aligned_rand_tensor(4, _BLOCK_ELEMENTS)
    tier = FileSystemTierManager(
        offloading_spec=_MOCK_OFFLOADING_SPEC,
        primary_kv_view=memoryview(tensor.numpy()),
        tier_type="fs",
        root_dir=str(tmp_path),
        n_read_threads=4,
        n_write_threads=4,
    )
    try:
        assert tier._use_o_direct is False

        keys = [key(0), key(1)]
        expected = tensor[:2].clone()
        tier.submit_store(make_job(1, keys, [0, 1]))
        assert all(r.success for r in drain(tier))

        tensor[:2] = 0.0
        tier.submit_load(make_job(2, keys, [2, 3], is_promotion=True))
        assert all(r.success for r in drain(tier))

        for i, bid in enumerate([2, 3]):
            assert torch.allclose(tensor[bid], expected[i])
    finally:
        tier.shutdown()


def test_wait_idle_blocks_until_tasks_complete():
    """wait_idle must not return while a task is still in flight."""
    pool = DualQueueThreadPool(n_read_threads=1, n_write_threads=1)
    gate = threading.Event()
    pool.enqueue_store(job_id=1, n_tasks=1, tasks=[lambda: gate.wait(timeout=5.0)])

    waiter = threading.Thread(target=pool.wait_idle)
    waiter.start()
    try:
        waiter.join(timeout=0.2)
        assert waiter.is_alive(), "wait_idle returned before task completed"
        gate.set()
        waiter.join(timeout=5.0)
        assert not waiter.is_alive(), "wait_idle did not unblock"
    finally:
        gate.set()
        pool.shutdown(wait=True)
        waiter.join(timeout=5.0)


def test_a_job_comes_back_with_its_record_and_every_task_outcome():
    """A job's outcome travels with it: what the tier enqueued it with and
    each task's return value or exception (without its traceback, which
    would pin the I/O buffers), in submission order, whichever thread ran
    which task; a job of no task is finished at once (wait_idle returns)."""
    pool = DualQueueThreadPool(n_read_threads=2, n_write_threads=2)
    record = object()

    def fail() -> None:
        raise OSError(errno.EIO, "injected")

    try:
        pool.enqueue_load(7, 3, [lambda: "a", fail, lambda: None], record, blocks=3)
        pool.enqueue_store(8, 0, [], "empty")
        pool.wait_idle()
        jobs = {job.job_id: job for job in pool.get_finished()}
    finally:
        pool.shutdown(wait=True)
    assert jobs.keys() == {7, 8}
    assert jobs[7].record is record
    first, error, last = jobs[7].outcomes
    assert (first, last) == ("a", None)
    assert isinstance(error, OSError) and error.__traceback__ is None
    assert jobs[7].failed == [1]
    assert jobs[8].record == "empty" and jobs[8].outcomes == []


def test_a_pool_keeps_no_job_it_handed_back():
    """Once a job is handed back, the pool holds nothing of it: an idle
    worker thread does not pin the last job it ran (its record holds a
    request's context); a job is refused if its task count is wrong."""
    import gc
    import weakref

    class Record:
        pass

    pool = DualQueueThreadPool(n_read_threads=1, n_write_threads=1)
    try:
        record = Record()
        held = weakref.ref(record)
        pool.enqueue_store(1, 1, [lambda: None], record)
        pool.wait_idle()
        assert [job.record for job in pool.get_finished()] == [record]
        del record
        # wait_idle() returns before the worker's frame is gone
        deadline = time.monotonic() + 5
        while held() is not None and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        assert held() is None, "an idle worker still holds the job"
        with pytest.raises(ValueError, match="2 tasks, not 1"):
            pool.enqueue_load(2, 1, [lambda: None, lambda: None])
    finally:
        pool.shutdown(wait=True)


def test_a_throttle_says_one_line_per_interval_whoever_asks(monkeypatch):
    """Every report of the fs tier is rate-limited by report.Throttle: the
    first line at once, then one per interval, told to one of the threads
    asking at the same time; force (shutdown) says it whatever the time."""
    from types import SimpleNamespace

    from vllm.v1.kv_offload.tiering.fs import report

    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(report, "time", SimpleNamespace(monotonic=lambda: clock.now))
    throttle = Throttle(30.0)
    start = threading.Barrier(8)
    answers: list[bool] = []

    def ask() -> None:
        start.wait()
        answers.append(throttle.due())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(answers) == [False] * 7 + [True]
    clock.now += 29.9
    assert not throttle.due()
    assert throttle.due(force=True)
    clock.now += 30.0
    assert throttle.due() and not throttle.due()


def test_batch_lookup_c_extension(tmp_path):
    """Validates batch_lookup_C: empty, single, all-existing, all-missing,
    mixed ordering, and input type validation."""
    try:
        from vllm.fs_io_C import batch_lookup as batch_lookup_C
    except ImportError:
        pytest.skip("fs_io_C extension not built")

    # Setup
    all_exist = [str(tmp_path / f"e{i}.bin") for i in range(3)]
    for p in all_exist:
        open(p, "w").close()
    all_missing = [str(tmp_path / f"m{i}.bin") for i in range(3)]

    # Empty list
    assert batch_lookup_C([]) == []

    # Single existing / missing
    assert batch_lookup_C([all_exist[0]]) == [True]
    assert batch_lookup_C([all_missing[0]]) == [False]

    # All existing / all missing
    assert batch_lookup_C(all_exist) == [True, True, True]
    assert batch_lookup_C(all_missing) == [False, False, False]

    # Mixed — verifies index ordering is preserved
    paths = [val for pair in zip(all_exist, all_missing) for val in pair]
    assert batch_lookup_C(paths) == [True, False, True, False, True, False]

    # Input validation: non-list argument
    with pytest.raises(TypeError):
        batch_lookup_C(("/tmp/foo",))
    with pytest.raises(TypeError):
        batch_lookup_C(None)

    # Input validation: non-str elements in list
    with pytest.raises(TypeError):
        batch_lookup_C([None])
    with pytest.raises(TypeError):
        batch_lookup_C([b"/tmp/foo"])
    with pytest.raises(TypeError):
        batch_lookup_C([42])
    with pytest.raises(TypeError):
        batch_lookup_C([all_exist[0], None])  # valid first, invalid mid-list


@pytest.mark.parametrize("use_c_ext", [True, False])
def test_batch_lookup_dispatch(fs_tier, monkeypatch, use_c_ext):
    import vllm.v1.kv_offload.tiering.fs.manager as mgr_mod

    if use_c_ext and not mgr_mod._HAS_BATCH_LOOKUP_C:
        pytest.skip("fs_io_C extension not built")

    monkeypatch.setattr(mgr_mod, "_HAS_BATCH_LOOKUP_C", use_c_ext)

    tier, _ = fs_tier
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert all(r.success for r in drain(tier))

    results = lookup_and_wait(tier, [key(1), key(2)])
    assert results == [LookupResult.HIT, LookupResult.MISS]


@pytest.mark.parametrize("use_c_ext", [True, False])
def test_out_of_bounds_block_id_smoke(fs_tier, monkeypatch, use_c_ext):
    """Smoke test: a block id beyond the primary tensor's block count must
    fail the job, for both the C extension and the Python fallback."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)

    tier, tensor = fs_tier
    out_of_bounds_bid = tensor.shape[0]  # one past the last valid block

    tier.submit_store(make_job(1, [key(1)], [out_of_bounds_bid]))
    store_results = drain(tier)
    assert len(store_results) == 1
    assert not store_results[0].success

    tier.submit_load(make_job(2, [key(1)], [out_of_bounds_bid], is_promotion=True))
    load_results = drain(tier)
    assert len(load_results) == 1
    assert not load_results[0].success


@pytest.mark.parametrize("use_c_ext", [True, False])
def test_failed_load_corrects_verdict_and_removes_corrupt_file(
    fs_tier, monkeypatch, use_c_ext
):
    """Failed-load livelock regression, covering the whole contract.

    A successful promotion leaves the cached HIT and the on-disk block intact.
    A promotion that short-reads a truncated (corrupt) block fails, and in
    get_finished_jobs() the tier removes the corrupt file (stores are atomic,
    so a too-short file is genuine corruption) and marks the cached verdict
    False. The SAME request's next lookup is then a MISS served from cache with
    NO re-probe, so the scheduler cannot re-issue the doomed promotion.
    """
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)

    tier, _ = fs_tier
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert all(r.success for r in drain(tier))
    path = tier.file_mapper.get_file_name(key(1))

    ctx = ReqContext(req_id="livelock-req")
    assert lookup_and_wait(tier, [key(1)], ctx=ctx) == [LookupResult.HIT]

    # A successful promotion must NOT touch the verdict or the file.
    tier.submit_load(make_job(2, [key(1)], [0], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and results[0].success
    assert tier.lookup(key(1), ctx) == LookupResult.HIT
    assert os.path.exists(path)

    # Truncate below block_size so the next promotion short-reads.
    with open(path, "wb") as f:
        f.write(b"x" * 10)
    tier.submit_load(make_job(3, [key(1)], [0], is_promotion=True))
    results = drain(tier)  # get_finished_jobs() marks the verdict False here
    assert len(results) == 1 and not results[0].success

    # Corrupt file removed; the SAME request now misses from cache, no re-probe.
    assert not os.path.exists(path)
    lm = tier._lookup_manager
    assert tier.lookup(key(1), ctx) == LookupResult.MISS
    assert lm._lookup_batch == []

    # A FRESH request re-probes the tier (no cached verdict) and misses too,
    # since the corrupt file is gone -- the real batch_lookup re-probe path.
    fresh = ReqContext(req_id="fresh-after-short-read")
    assert lookup_and_wait(tier, [key(1)], ctx=fresh) == [LookupResult.MISS]


def test_a_failed_load_removes_only_the_file_it_read(fs_tier, monkeypatch):
    """Another engine sharing the root stores a block anew (renames a whole
    file into place) between a load's look at the damaged file it replaces
    and that load's removal of it: the new file is left alone. (Python path:
    the C path makes the same check, and no test can step into it.)"""
    import shutil

    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", False)
    tier, tensor = fs_tier
    tensor[0] = 5
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert [r.success for r in drain(tier)] == [True]
    path = tier.file_mapper.get_file_name(key(1))
    with open(path, "rb") as f:
        good = f.read()
    stored_anew = path + ".another-engine"
    shutil.copy2(path, stored_anew)
    os.remove(path)
    with open(path, "wb") as f:
        f.write(good[: len(good) // 2])  # a damaged file: half a block
    damaged_ino = os.stat(path).st_ino
    real_fstat = os.fstat

    def fstat_then_store_anew(fd):
        st = real_fstat(fd)
        if st.st_ino == damaged_ino:
            os.rename(stored_anew, path)
        return st

    monkeypatch.setattr(os, "fstat", fstat_then_store_anew)
    tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
    assert [r.success for r in drain(tier)] == [False]
    assert os.path.isfile(path), "the block stored anew was removed"
    with open(path, "rb") as f:
        assert f.read() == good


def test_failed_load_after_abort_does_not_break_newer_probe(fs_tier):
    """A promotion for request A fails after A was aborted and request B
    re-probed the same key. The failure must not flip B's in-flight probe:
    B's next lookup drains its own result (MISS: the file is gone) instead of
    asserting on the scheduler thread."""
    tier, _ = fs_tier
    k = key(1)
    tier.submit_store(make_job(1, [k], [0]))
    assert all(r.success for r in drain(tier))
    ctx_a, ctx_b = ReqContext(req_id="A"), ReqContext(req_id="B")
    assert lookup_and_wait(tier, [k], ctx=ctx_a) == [LookupResult.HIT]

    os.remove(tier.file_mapper.get_file_name(k))
    tier.submit_load(make_job(2, [k], [1], is_promotion=True))
    tier.on_request_finished(ctx_a)

    assert tier.lookup(k, ctx_b) == LookupResult.RETRY
    tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
    deadline = time.monotonic() + 1.0
    while tier._lookup_manager._pending_results.empty():
        assert time.monotonic() < deadline
        time.sleep(0.01)

    assert [r.success for r in drain(tier)] == [False]
    assert tier.lookup(k, ctx_b) == LookupResult.MISS


@pytest.mark.parametrize("use_c_ext", [True, False])
def test_batched_partial_load_failure_keeps_loaded_blocks(
    fs_tier, monkeypatch, use_c_ext
):
    """A batched promotion reports the blocks that loaded (#50321). Corrupt
    the LAST block: the earlier blocks load fine, so the job reports
    successful_keys for them and marks only the failed block a miss. The
    earlier keys stay HIT — including for the same request — while the corrupt
    block stays a MISS (its file was removed)."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)

    tier, _ = fs_tier
    keys = [key(1), key(2), key(3)]  # last one is the "bad" block
    tier.submit_store(make_job(1, keys, [0, 1, 2]))
    assert all(r.success for r in drain(tier))
    bad_path = tier.file_mapper.get_file_name(key(3))

    ctx = ReqContext(req_id="batch-req")
    assert lookup_and_wait(tier, keys, ctx=ctx) == [LookupResult.HIT] * 3

    # Corrupt only the last block, then load the whole batch as one job.
    with open(bad_path, "wb") as f:
        f.write(b"x" * 10)
    tier.submit_load(make_job(2, keys, [0, 1, 2], is_promotion=True))
    results = drain(tier)
    # (a) the job fails but reports the two blocks that loaded before the bad one.
    assert len(results) == 1 and not results[0].success
    assert tuple(results[0].successful_keys) == (key(1), key(2))

    # (b) Only the failed tail is a miss; the loaded blocks stay HIT on the same
    # request, and nothing was re-probed.
    lm = tier._lookup_manager
    assert [tier.lookup(k, ctx) for k in keys] == [
        LookupResult.HIT,
        LookupResult.HIT,
        LookupResult.MISS,
    ]
    assert lm._lookup_batch == []

    # (c) A fresh request re-probes: the loaded blocks are still on disk (HIT),
    # only the corrupt block was removed (MISS).
    tier.on_request_finished(ctx)
    fresh = ReqContext(req_id="fresh-batch-req")
    assert lookup_and_wait(tier, keys, ctx=fresh) == [
        LookupResult.HIT,
        LookupResult.HIT,
        LookupResult.MISS,
    ]


@pytest.mark.parametrize("use_c_ext", [True, False])
def test_batched_load_first_block_fails_keeps_the_others(
    fs_tier, monkeypatch, use_c_ext
):
    """When the FIRST block fails, the blocks after it still load: the job
    reports them as successful_keys and only the bad block is a miss for the
    request."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)

    tier, _ = fs_tier
    keys = [key(1), key(2), key(3)]  # first one is the "bad" block
    tier.submit_store(make_job(1, keys, [0, 1, 2]))
    assert all(r.success for r in drain(tier))

    ctx = ReqContext(req_id="batch-first-fail")
    assert lookup_and_wait(tier, keys, ctx=ctx) == [LookupResult.HIT] * 3

    with open(tier.file_mapper.get_file_name(key(1)), "wb") as f:
        f.write(b"x" * 10)
    tier.submit_load(make_job(2, keys, [0, 1, 2], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    assert tuple(results[0].successful_keys) == (key(2), key(3))
    assert [tier.lookup(k, ctx) for k in keys] == [
        LookupResult.MISS,
        LookupResult.HIT,
        LookupResult.HIT,
    ]


@pytest.mark.parametrize("use_c_ext", [True, False])
def test_batched_load_failure_keeps_every_other_key(fs_tier, monkeypatch, use_c_ext):
    """An HMA promotion job holds the blocks of several KV cache groups. A
    truncated block of group 0 fails only its own key: every other block of
    the job, those after it and the other group's, is loaded intact and
    reported in successful_keys."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)

    tier, tensor = fs_tier
    keys = [
        make_offload_key(n.to_bytes(8, "big"), group)
        for group in (0, 1)
        for n in (1, 2, 3)
    ]
    bad = keys[1]  # group 0, block 1
    rows = list(range(len(keys)))
    tensor[:] = torch.rand_like(tensor)
    stored = tensor.clone()
    tier.submit_store(make_job(1, keys, rows))
    assert all(r.success for r in drain(tier))

    ctx = ReqContext(req_id="hma-partial-load")
    assert lookup_and_wait(tier, keys, ctx=ctx) == [LookupResult.HIT] * len(keys)

    with open(tier.file_mapper.get_file_name(bad), "r+b") as f:
        f.truncate(100)
    tensor.zero_()
    tier.submit_load(make_job(2, keys, rows, is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success
    good = [k for k in keys if k != bad]
    assert list(results[0].successful_keys) == good
    assert [tier.lookup(k, ctx) for k in keys] == [
        LookupResult.MISS if k == bad else LookupResult.HIT for k in keys
    ]
    for row, k in zip(rows, keys):
        if k != bad:
            assert torch.equal(tensor[row], stored[row])


def test_a_failing_directory_lookup_stops_a_store_batch(tmp_path, monkeypatch):
    """Python I/O: a block's directory is there but looking at it fails (EIO,
    a failing disk): the store batch stops at EIO, as at any error not of its
    block, instead of taking it for EEXIST, a block's own failure, and going
    on to the next blocks."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", False)
    size, failing = mmap.PAGESIZE, tmp_path / "failing"
    region, offsets = mmap.mmap(-1, 2 * size), [0, size]
    failing.mkdir()
    paths = [str(failing / "first.bin"), str(tmp_path / "ok" / "last.bin")]
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if path == str(failing):
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(OSError) as e:
        io_mod.batch_store_block(paths, memoryview(region), offsets, size, False)
    assert e.value.errno == errno.EIO
    assert not os.path.exists(paths[1])


@pytest.mark.parametrize("use_c_ext", [True, False])
def test_a_batch_stops_at_an_error_not_of_its_block(tmp_path, monkeypatch, use_c_ext):
    """A block's own failure (a missing file, a directory in a store's way) does
    not stop a batch, any other error does (ENAMETOOLONG: every path of the
    tier meets it alike, as a failing disk): the blocks after it are not tried."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)
    size, ends = mmap.PAGESIZE, [str(tmp_path / "first"), str(tmp_path / "last")]
    region, offsets = mmap.mmap(-1, 3 * size), [0, size, 2 * size]
    for path in ends:
        with open(path, "wb") as f:
            f.write(b"\x07" * size)
    for middle, failed in (("missing", [1]), ("x" * 300, [1, 2])):
        region[:] = bytes(3 * size)
        paths = [ends[0], str(tmp_path / middle), ends[1]]
        with pytest.raises(OSError) as e:
            io_mod.batch_load_block(paths, memoryview(region), offsets, size, False)
        assert e.value.failed_indices == failed
        assert region[2 * size :] == (bytes(size) if 2 in failed else b"\x07" * size)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "file").write_bytes(b"x")  # in the way of a store
    for middle, stored in (("dir", True), ("x" * 300, False)):
        os.remove(ends[1])
        with pytest.raises(OSError):
            paths = [ends[0], str(tmp_path / middle), ends[1]]
            io_mod.batch_store_block(paths, memoryview(region), offsets, size, False)
        assert os.path.exists(ends[1]) is stored


@pytest.mark.parametrize("use_c_ext", [True, False])
def test_a_stopped_load_leaves_the_blocks_it_did_not_read(
    fs_tier, tmp_path, monkeypatch, use_c_ext
):
    """A batch stopped by an error not of its block (ENAMETOOLONG, as a
    failing disk) raises that error, not an earlier block's, with the blocks
    after it as ``untried``; the tier neither looks at their paths nor makes
    their keys misses until stored again: they were never read."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)
    size, region = mmap.PAGESIZE, mmap.mmap(-1, 3 * mmap.PAGESIZE)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "file").write_bytes(b"x")  # in the way of a store
    for batch, first in (
        (io_mod.batch_load_block, "missing"),
        (io_mod.batch_store_block, "dir"),
    ):
        paths = [str(tmp_path / name) for name in (first, "x" * 300, "last")]
        with pytest.raises(OSError) as e:
            batch(paths, memoryview(region), [0, size, 2 * size], size, False)
        assert e.value.errno == errno.ENAMETOOLONG
        if batch is io_mod.batch_load_block:
            assert (e.value.failed_indices, e.value.untried) == ([0, 1, 2], [2])

    tier, _ = fs_tier
    keys = [key(n) for n in range(1, 5)]
    tier.submit_store(make_job(1, keys, [0, 1, 2, 3]))
    assert all(r.success for r in drain(tier))
    real_paths, offsets = tier._paths_and_offsets(keys, [0, 1, 2, 3])
    tier._tmp_cleanup.join(30)  # its start-up walk looks at the files too
    assert not tier._tmp_cleanup.is_alive()
    looked_at: list[str] = []
    lstat = os.lstat

    def second_path_too_long(keys, rows):
        return [real_paths[0] + ".gone", "x" * 300, *real_paths[2:]], offsets

    with pytest.MonkeyPatch.context() as m:
        m.setattr(tier, "_paths_and_offsets", second_path_too_long)
        m.setattr(os, "lstat", lambda p, **kw: looked_at.append(p) or lstat(p, **kw))
        tier.submit_load(make_job(2, keys, [0, 1, 2, 3], is_promotion=True))
        assert [r.success for r in drain(tier)] == [False]
    assert not set(real_paths[2:]) & set(looked_at)
    assert lookup_and_wait(tier, keys[2:]) == [LookupResult.HIT] * 2
    tier.submit_load(make_job(3, keys[2:], [2, 3], is_promotion=True))
    assert all(r.success for r in drain(tier))


@pytest.mark.parametrize("use_o_direct", [True, False])
@pytest.mark.parametrize("use_c_ext", [True, False])
def test_a_fifo_at_a_block_path_fails_its_load_at_once(
    tmp_path, monkeypatch, use_c_ext, use_o_direct
):
    """A FIFO at a block's path (planted by whoever may write into the tree)
    is not a block: its load fails at once as such (EBADMSG, which does not
    stop a batch), where the open blocked the I/O thread until a writer came,
    if ever, or refused O_DIRECT (EINVAL)."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    if use_o_direct and not io_mod.probe_o_direct(str(tmp_path)):
        pytest.skip("no O_DIRECT here")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)
    size, region = mmap.PAGESIZE, mmap.mmap(-1, mmap.PAGESIZE)
    fifo = str(tmp_path / "block")
    os.mkfifo(fifo)
    errors: list[int] = []

    def load() -> None:
        try:
            io_mod.batch_load_block([fifo], memoryview(region), [0], size, use_o_direct)
        except OSError as exc:
            errors.append(exc.errno)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=10)
    blocked = reader.is_alive()
    if blocked:  # a writer's open lets it go on
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
    assert not blocked and errors == [errno.EBADMSG]


@pytest.mark.parametrize("use_c_ext", [True, False])
def test_transient_load_failure_leaves_file(fs_tier, monkeypatch, use_c_ext):
    """A transient host error (here ELOOP on open) is NOT a short read: the job
    fails but the block file must survive untouched, on both the C and Python
    paths. Deleting on a transient error would turn a passing hiccup into
    permanent data loss."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)

    tier, _ = fs_tier
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert all(r.success for r in drain(tier))
    path = tier.file_mapper.get_file_name(key(1))
    with open(path, "rb") as f:
        original = f.read()

    # Make open() fail with ELOOP (fd < 0) without truncating the block. Not
    # chmod 000: CI runs as root, which bypasses permission bits, so open()
    # would succeed and the load would not fail at all.
    saved = path + ".saved"
    loop = path + ".loop"
    os.rename(path, saved)
    os.symlink(loop, path)
    os.symlink(path, loop)

    tier.submit_load(make_job(2, [key(1)], [0], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1 and not results[0].success

    # The path is left alone: a non-short-read error must not unlink.
    assert os.path.lexists(path)

    os.unlink(path)
    os.unlink(loop)
    os.rename(saved, path)
    with open(path, "rb") as f:
        assert f.read() == original


@pytest.mark.parametrize(
    "in_the_way",
    ["empty file", "short file", "long file", "empty directory", "symlink to a file"],
)
@pytest.mark.parametrize("use_c_ext", [True, False])
def test_store_replaces_what_is_not_a_complete_block(
    fs_tier, monkeypatch, use_c_ext, in_the_way
):
    """A store over a path that holds no complete block (an empty or short
    file left by a crash or a full disk, a longer file, an empty directory, a
    symlink) writes the block instead of trusting that the path exists: a
    store never reports success for bytes it did not write."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)

    tier, tensor = fs_tier
    block_size = tier._block_size
    path = tier.file_mapper.get_file_name(key(1))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if in_the_way == "empty directory":
        os.mkdir(path)
    elif in_the_way == "symlink to a file":  # v0.34.0 follows it
        os.symlink(os.path.abspath(__file__), path)
    else:
        size = {"empty file": 0, "short file": 10, "long file": block_size + 1}
        with open(path, "wb") as f:
            f.write(b"\xff" * size[in_the_way])

    tensor[0] = torch.rand_like(tensor[0])
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert [r.success for r in drain(tier)] == [True]
    assert not os.path.islink(path)
    assert os.path.isfile(path) and os.path.getsize(path) == block_size
    tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
    assert [r.success for r in drain(tier)] == [True]
    assert torch.equal(tensor[1], tensor[0])


@pytest.mark.parametrize("use_c_ext", [True, False])
def test_store_fails_for_a_directory_it_cannot_replace(
    fs_tier, monkeypatch, use_c_ext, caplog_vllm
):
    """A non-empty directory where a block file should be cannot be replaced:
    the store job fails instead of reporting that key stored, and the job's
    other keys are still stored; the failure report counts the one block
    not stored (before: every block of the job)."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)

    tier, _ = fs_tier
    path = tier.file_mapper.get_file_name(key(1))
    os.makedirs(os.path.join(path, "not_a_block"))
    with caplog_vllm.at_level("ERROR"):
        tier.submit_store(make_job(1, [key(1), key(2)], [0, 1]))
        assert [r.success for r in drain(tier)] == [False]
    assert os.path.isdir(os.path.join(path, "not_a_block"))
    other = tier.file_mapper.get_file_name(key(2))
    assert os.path.getsize(other) == tier._block_size
    (report,) = [
        r.getMessage() for r in caplog_vllm.records if "not stored" in r.getMessage()
    ]
    assert "1 store job(s) and 0 load job(s) failed: 1 block(s) not stored" in report


@pytest.mark.parametrize("error", ["EIO", "EMFILE"])
def test_a_block_whose_read_keeps_failing_is_stored_anew(fs_tier, monkeypatch, error):
    """A complete block file whose read fails for a reason that will not
    pass (EIO: a bad sector) is a miss from then on, and the next store of
    its key writes it anew instead of keeping it as stored: the key loads
    again. A reason that may pass (EMFILE) leaves the key a hit. Before:
    the key was a hit again after the next store, which kept the file, and
    every promotion of it failed."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    # the bad read is injected into Python's os.readv
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", False)
    tier, tensor = fs_tier
    tensor[0] = 3.0
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert [r.success for r in drain(tier)] == [True]
    path = tier.file_mapper.get_file_name(key(1))
    real_readv = os.readv

    def failing_readv(fd, buffers):
        code = getattr(errno, error)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "readv", failing_readv)
    tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
    assert [r.success for r in drain(tier)] == [False]
    monkeypatch.setattr(os, "readv", real_readv)
    assert os.path.isfile(path)  # a complete block: not removed
    if error == "EMFILE":
        assert key(1) not in tier._unloadable  # loaded again, not rewritten
        return
    assert lookup_and_wait(tier, [key(1)]) == [LookupResult.MISS]
    tensor[0] = 4.0
    tier.submit_store(make_job(3, [key(1)], [0]))
    assert [r.success for r in drain(tier)] == [True]
    assert lookup_and_wait(tier, [key(1)]) == [LookupResult.HIT]
    tier.submit_load(make_job(4, [key(1)], [2], is_promotion=True))
    assert [r.success for r in drain(tier)] == [True]
    assert (tensor[2] == 4.0).all(), "the file was kept, not written anew"


def _make_unloadable(tier, tensor, monkeypatch, keys, first_job):
    """Store *keys*, then fail their loads with EIO: they become misses."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", False)
    real_readv = os.readv

    def failing_readv(fd, buffers):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    for n, k in enumerate(keys):
        tier.submit_store(make_job(first_job + 2 * n, [k], [0]))
        assert [r.success for r in drain(tier)] == [True]
        monkeypatch.setattr(os, "readv", failing_readv)
        tier.submit_load(make_job(first_job + 2 * n + 1, [k], [1], is_promotion=True))
        assert [r.success for r in drain(tier)] == [False]
        monkeypatch.setattr(os, "readv", real_readv)


def test_a_rewrite_that_cannot_remove_the_old_file_stays_a_miss(fs_tier, monkeypatch):
    """A store of a key whose file cannot be read (EIO) and cannot be
    removed (a read-only remount) keeps the old file: the key stays a miss
    instead of a hit whose every promotion fails."""
    tier, tensor = fs_tier
    _make_unloadable(tier, tensor, monkeypatch, [key(1)], 1)
    path = tier.file_mapper.get_file_name(key(1))
    real_remove = os.remove

    def read_only(target, *args, **kwargs):
        if target == path:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_remove(target, *args, **kwargs)

    monkeypatch.setattr(os, "remove", read_only)
    tier.submit_store(make_job(9, [key(1)], [0]))
    drain(tier)
    assert key(1) in tier._unloadable
    assert lookup_and_wait(tier, [key(1)]) == [LookupResult.MISS]


def test_keys_kept_as_misses_are_bounded(fs_tier, monkeypatch):
    """The keys answered as misses because their files cannot be loaded are
    at most MAX_UNLOADABLE_KEYS, the oldest going first."""
    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

    monkeypatch.setattr(fs_manager, "MAX_UNLOADABLE_KEYS", 2, raising=False)
    tier, tensor = fs_tier
    _make_unloadable(tier, tensor, monkeypatch, [key(1), key(2), key(3)], 1)
    assert list(tier._unloadable) == [key(2), key(3)]


@pytest.mark.parametrize("size_delta", [-1, 1], ids=["shorter", "longer"])
@pytest.mark.parametrize("use_c_ext", [True, False])
def test_load_fails_for_a_file_that_is_not_one_block(
    fs_tier, monkeypatch, use_c_ext, size_delta
):
    """A block file shorter or longer than a block (truncated, appended to,
    another layout's) fails that key's load before anything is read into the
    primary tier's slot, and is removed; the job's other keys load."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)

    tier, tensor = fs_tier
    tensor[:2] = torch.rand_like(tensor[:2])
    tier.submit_store(make_job(1, [key(1), key(2)], [0, 1]))
    assert all(r.success for r in drain(tier))
    path = tier.file_mapper.get_file_name(key(1))
    with open(path, "r+b") as f:
        f.truncate(tier._block_size + size_delta)

    tensor[2:4] = 7.0
    tier.submit_load(make_job(2, [key(2), key(1)], [3, 2], is_promotion=True))
    (result,) = drain(tier)
    assert not result.success
    assert list(result.successful_keys) == [key(2)]
    assert (tensor[2] == 7.0).all(), "read into the slot of a failed load"
    assert torch.equal(tensor[3], tensor[1])
    assert not os.path.exists(path)


@pytest.mark.parametrize("use_c_ext", [True, False])
def test_unloadable_path_is_a_miss_until_stored_again(fs_tier, monkeypatch, use_c_ext):
    """A block path that holds something that can be neither loaded nor
    removed (here a non-empty directory) fails one promotion. Afterwards it is
    a miss for every request, not only the one whose load failed, so no new
    request sharing the prefix promotes it again; a store that replaces it
    makes the key a hit again."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)

    tier, tensor = fs_tier
    keys = [key(2), key(1)]
    tier.submit_store(make_job(1, keys, [0, 1]))
    assert all(r.success for r in drain(tier))
    path = tier.file_mapper.get_file_name(key(1))
    os.remove(path)
    os.makedirs(os.path.join(path, "not_a_block"))

    ctx_a = ReqContext(req_id="A")
    assert lookup_and_wait(tier, keys, ctx=ctx_a) == [LookupResult.HIT] * 2
    tier.submit_load(make_job(2, keys, [2, 3], is_promotion=True))
    (result,) = drain(tier)
    assert list(result.successful_keys) == [key(2)]
    tier.on_request_finished(ctx_a)

    # A new request does not promote the broken path again.
    ctx_b = ReqContext(req_id="B")
    assert lookup_and_wait(tier, keys, ctx=ctx_b) == [
        LookupResult.HIT,
        LookupResult.MISS,
    ]
    tier.on_request_finished(ctx_b)

    # A store that cannot replace the path leaves the key a miss...
    tier.submit_store(make_job(3, [key(1)], [0]))
    assert [r.success for r in drain(tier)] == [False]
    assert tier.lookup(key(1), ReqContext(req_id="C")) == LookupResult.MISS
    # ...one that replaces it makes the key a hit again.
    os.rmdir(os.path.join(path, "not_a_block"))
    tier.submit_store(make_job(4, [key(1)], [0]))
    assert [r.success for r in drain(tier)] == [True]
    ctx_d = ReqContext(req_id="D")
    assert lookup_and_wait(tier, [key(1)], ctx=ctx_d) == [LookupResult.HIT]
    tier.submit_load(make_job(5, [key(1)], [2], is_promotion=True))
    assert [r.success for r in drain(tier)] == [True]
    assert torch.equal(tensor[2], tensor[0])


def _fs_tier_on(root_dir, **kwargs) -> FileSystemTierManager:
    tensor = _page_aligned_zero_tensor(_NUM_BLOCKS, _BLOCK_ELEMENTS)
    return FileSystemTierManager(
        offloading_spec=_MOCK_OFFLOADING_SPEC,
        primary_kv_view=memoryview(tensor.numpy()),
        tier_type="fs",
        root_dir=str(root_dir),
        n_read_threads=1,
        n_write_threads=1,
        **kwargs,
    )


def test_start_up_removes_only_stale_temp_files(tmp_path):
    """A writer killed between writing a block's temp file and renaming it
    leaves the temp file behind. A tier starting on the directory removes the
    tier's temp files older than cleanup_stale_tmp_after_seconds (block and
    O_DIRECT probe temp files) and keeps recent ones (a writer of another
    engine sharing the directory may still rename them), blocks, and files
    the tier did not write."""
    tier = _fs_tier_on(tmp_path)
    block = tier.file_mapper.get_file_name(key(1))
    config_dir = os.path.dirname(tier.file_mapper.get_config_file_path())
    tier.shutdown()

    os.makedirs(os.path.dirname(block), exist_ok=True)
    stale = [f"{block}_1.tmp", os.path.join(config_dir, ".o_direct_probe_2.tmp")]
    recent = [f"{block}_3.tmp"]
    other = [block, f"{block}.tmp", os.path.join(config_dir, "notes_4.tmp")]
    two_hours_ago = time.time() - 7200

    def write(paths, old):
        for path in paths:
            with open(path, "wb") as f:
                f.write(b"x" * 10)
            if old:
                os.utime(path, (two_hours_ago, two_hours_ago))

    write(stale + other, old=True)
    write(recent, old=False)
    tier = _fs_tier_on(tmp_path)  # default: older than an hour
    try:
        cleanup = getattr(tier, "_tmp_cleanup", None)  # the walk runs in the background
        if cleanup is not None:
            cleanup.join()
        assert [os.path.exists(p) for p in stale] == [False] * len(stale)
        assert all(os.path.exists(p) for p in recent + other)
    finally:
        tier.shutdown()

    write(stale, old=True)
    tier = _fs_tier_on(tmp_path, cleanup_stale_tmp_after_seconds=None)
    tier.shutdown()
    assert all(os.path.exists(p) for p in stale + recent + other)

    # JSON gives strings and booleans too: refused, never compared or taken as 1 s
    for bad in (-1, "3600", True):
        with pytest.raises(ValueError, match="cleanup_stale_tmp_after_seconds"):
            _fs_tier_on(tmp_path, cleanup_stale_tmp_after_seconds=bad)


def test_failing_tier_reports_rate_limited_with_counts(
    tmp_path, monkeypatch, caplog_vllm
):
    """A tier whose jobs all fail (e.g. a full disk) logs the first failure at
    once, then at most one line per interval with the counts since its
    previous line (pending counts are reported when the tier is polled after
    the interval, and at shutdown): never one line per job."""
    from types import SimpleNamespace

    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager
    from vllm.v1.kv_offload.tiering.fs import report

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(report, "time", SimpleNamespace(monotonic=lambda: clock.now))
    monkeypatch.setattr(fs_manager, "batch_store_block", disk_full)
    tensor = _page_aligned_zero_tensor(_NUM_BLOCKS, _BLOCK_ELEMENTS)
    tier = FileSystemTierManager(
        offloading_spec=_MOCK_OFFLOADING_SPEC,
        primary_kv_view=memoryview(tensor.numpy()),
        tier_type="fs",
        root_dir=str(tmp_path),
        n_read_threads=2,
        n_write_threads=2,
    )

    def store_jobs(first_job_id: int, n: int) -> None:
        for job_id in range(first_job_id, first_job_id + n):
            tier.submit_store(make_job(job_id, [key(2 * job_id), key(2 * job_id + 1)]))
        assert [r.success for r in drain(tier)] == [False] * n

    def errors() -> list[str]:
        return [r.getMessage() for r in caplog_vllm.records if r.levelname == "ERROR"]

    try:
        store_jobs(0, 1)
        assert len(errors()) == 1  # the first failure: at once
        store_jobs(1, 3)  # within the interval: counted, not logged
        tier.submit_load(make_job(10, [key(99)], [0], is_promotion=True))
        assert [r.success for r in drain(tier)] == [False]  # no such file
        assert len(errors()) == 1, "one ERROR per failed job"
        clock.now += report.REPORT_INTERVAL_S - 1
        assert list(tier.get_finished_jobs()) == []
        assert len(errors()) == 1
        clock.now += 1  # the interval has passed: polling reports them
        assert list(tier.get_finished_jobs()) == []
        assert len(errors()) == 2
        store_jobs(20, 1)  # within the new interval: left for shutdown
    finally:
        tier.shutdown()
    label = f"'fs' KV offload tier at {tmp_path}"
    assert [line.split(" since the previous report")[0] for line in errors()] == [
        f"{label}: {stores} store job(s) and {loads} load job(s) failed: "
        f"{not_stored} block(s) not stored, {not_loaded} not loaded and recomputed"
        for stores, loads, not_stored, not_loaded in [
            (1, 0, 2, 0),
            (3, 1, 6, 1),
            (1, 0, 2, 0),
        ]
    ]
    assert errors()[0].endswith("[Errno 28] No space left on device")


def _make_small_tier(root_dir, tensor: torch.Tensor, **config):
    return FileSystemTierManager(
        offloading_spec=_MOCK_OFFLOADING_SPEC,
        primary_kv_view=memoryview(tensor.numpy()),
        tier_type="fs",
        root_dir=str(root_dir),
        n_read_threads=2,
        n_write_threads=2,
        **config,
    )


@pytest.mark.parametrize("use_c_ext", [True, False])
def test_tier_recreates_its_config_when_its_root_is_removed(
    tmp_path, monkeypatch, caplog_vllm, use_c_ext
):
    """The tier's root directory removed while it runs (an operator cleaning
    up, a tmpfs remounted): the next stores re-create the block directories
    and also config.json, which says what the files are; it is not left
    missing for the rest of the process."""
    import shutil

    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("C extension not available")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)
    root = tmp_path / "root"
    tensor = _page_aligned_zero_tensor(4, mmap.PAGESIZE)
    tier = _make_small_tier(root, tensor)
    try:
        config_path = tier.file_mapper.get_config_file_path()
        with open(config_path, "rb") as f:
            config = f.read()
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in drain(tier)] == [True]

        shutil.rmtree(root)
        tensor[1] = 9
        tier.submit_store(make_job(2, [key(2), key(3)], [1, 1]))
        assert [r.success for r in drain(tier)] == [True]
        assert os.path.isfile(tier.file_mapper.get_file_name(key(2)))
        assert os.path.isfile(config_path), "config.json was not re-created"
        with open(config_path, "rb") as f:
            assert f.read() == config
        (line,) = [
            r.getMessage()
            for r in caplog_vllm.records
            if "re-created" in r.getMessage()
        ]
        assert config_path in line
        tier.submit_load(make_job(3, [key(2)], [2], is_promotion=True))
        assert [r.success for r in drain(tier)] == [True]
        assert (tensor[2] == 9).all()
    finally:
        tier.shutdown()
    assert not [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]


@pytest.mark.parametrize("use_c_ext", [True, False])
def test_a_store_that_fails_after_writing_some_blocks_keeps_config(
    tmp_path, monkeypatch, use_c_ext
):
    """The root removed, then a store job whose second block cannot be
    written (a non-empty directory at its path): the first block is
    written, and config.json is re-created with it, though the job fails.
    Before: only a store that raised nothing re-created it."""
    import shutil

    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("C extension not available")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)
    root = tmp_path / "root"
    tensor = _page_aligned_zero_tensor(4, mmap.PAGESIZE)
    tier = _make_small_tier(root, tensor)
    try:
        config_path = tier.file_mapper.get_config_file_path()
        shutil.rmtree(root)
        os.makedirs(os.path.join(tier.file_mapper.get_file_name(key(3)), "x"))
        tier.submit_store(make_job(1, [key(2), key(3)], [1, 1]))
        assert [r.success for r in drain(tier)] == [False]
        assert os.path.isfile(tier.file_mapper.get_file_name(key(2)))
        assert os.path.isfile(config_path), "blocks stored without config.json"
    finally:
        tier.shutdown()


def test_config_re_creation_failures_are_reported_rate_limited(
    tmp_path, monkeypatch, caplog_vllm
):
    """The root is removed and config.json cannot be re-created (here its
    write fails with ENOSPC): the stores go on, and the tier says so with
    counts, at most once per interval, for as long as it lasts (not once,
    and not once per job)."""
    import shutil

    import vllm.v1.kv_offload.tiering.fs.manager as fs_manager

    root = tmp_path / "root"
    tensor = _page_aligned_zero_tensor(4, mmap.PAGESIZE)
    tier = _make_small_tier(root, tensor)

    def warnings():
        return [
            r.getMessage()
            for r in caplog_vllm.records
            if "Could not re-create" in r.getMessage()
        ]

    try:
        config_path = tier.file_mapper.get_config_file_path()
        shutil.rmtree(root)

        def full_disk(*args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(fs_manager, "write_file_atomically", full_disk)
        for job_id in range(1, 4):
            tier.submit_store(make_job(job_id, [key(job_id)], [0]))
            assert [r.success for r in drain(tier)] == [True]
        (line,) = warnings()
        assert "1 failed attempt(s)" in line and config_path in line
        tier._config_throttle = Throttle(0.0)  # the interval is over
        tier.submit_store(make_job(4, [key(4)], [0]))
        assert [r.success for r in drain(tier)] == [True]
        assert len(warnings()) == 2
        assert "3 failed attempt(s)" in warnings()[1]
    finally:
        tier.shutdown()


def test_a_config_write_cut_short_leaves_no_partial_config(tmp_path):
    """config.json written as the disk fills up (here a file size limit cuts
    the write after 16 bytes): no truncated config.json is left to describe
    the directory for good; the next store writes it whole."""
    import resource
    import signal

    root = tmp_path / "root"
    tensor = _page_aligned_zero_tensor(4, mmap.PAGESIZE)
    tier = _make_small_tier(root, tensor)
    try:
        config_path = tier.file_mapper.get_config_file_path()
        with open(config_path, "rb") as f:
            config = f.read()
        os.remove(config_path)
        # process-wide for a moment: the tier's threads are idle meanwhile
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        sigxfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        try:
            resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))
            with pytest.raises(OSError):
                tier._write_config()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, sigxfsz)
        assert not os.path.exists(config_path), "a partial config.json was left"
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in drain(tier)] == [True]
        with open(config_path, "rb") as f:
            assert f.read() == config
    finally:
        tier.shutdown()


def test_unaligned_rows_fall_back_to_buffered_io(tmp_path, caplog_vllm):
    """Rows that O_DIRECT cannot transfer (1280 bytes, as an unpadded mamba
    or odd-head-size layout gives) round-trip with buffered I/O instead of
    failing every job, and the tier says once which mode it uses and why.
    Before: O_DIRECT where the filesystem has it, and every store failed."""
    region = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    rows = np.frombuffer(region, dtype=np.uint8)[: 4 * 1280].reshape(4, 1280)
    rows[:2] = np.random.default_rng(0).integers(0, 256, (2, 1280), dtype=np.uint8)
    expected = rows[:2].copy()
    with caplog_vllm.at_level("INFO"):
        tier = FileSystemTierManager(
            offloading_spec=_MOCK_OFFLOADING_SPEC,
            primary_kv_view=memoryview(rows),
            tier_type="fs",
            root_dir=str(tmp_path),
        )
    try:
        tier.submit_store(make_job(1, [key(0), key(1)], [0, 1]))
        assert [r.success for r in drain(tier)] == [True]
        tier.submit_load(make_job(2, [key(0), key(1)], [2, 3], is_promotion=True))
        assert [r.success for r in drain(tier)] == [True]
        np.testing.assert_array_equal(rows[2:], expected)
    finally:
        tier.shutdown()
    (message,) = [
        r.getMessage() for r in caplog_vllm.records if " I/O for " in r.getMessage()
    ]
    assert message.startswith(
        f"'fs' KV offload tier at {tmp_path}: using buffered I/O for "
        "1280-byte blocks because the primary tier's rows (1280 bytes at address"
    )


def test_the_o_direct_probe_sets_it_as_loads_do(tmp_path, monkeypatch):
    """Loads set O_DIRECT with fcntl() on a file open for reading: where
    that is refused (EINVAL) though open(O_DIRECT) works, the probe says no
    O_DIRECT, and the tier stores and loads with buffered I/O instead of
    failing every load."""
    import fcntl
    from types import SimpleNamespace

    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if not io_mod.probe_o_direct(str(tmp_path)):
        pytest.skip("no O_DIRECT support here")

    def fcntl_refusing_o_direct(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & io_mod.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return fcntl.fcntl(fd, cmd, arg)

    fake = SimpleNamespace(
        fcntl=fcntl_refusing_o_direct, F_SETFL=fcntl.F_SETFL, F_GETFL=fcntl.F_GETFL
    )
    monkeypatch.setattr(io_mod, "fcntl", fake)
    assert io_mod.probe_o_direct(str(tmp_path)) is False
    assert os.listdir(tmp_path) == []
    tensor = _page_aligned_zero_tensor(4, mmap.PAGESIZE)
    tensor[:2] = 5
    tier = _make_small_tier(tmp_path / "root", tensor)
    try:
        assert tier._use_o_direct is False
        tier.submit_store(make_job(1, [key(1), key(2)], [0, 1]))
        assert [r.success for r in drain(tier)] == [True]
        tensor[:2] = 0
        tier.submit_load(make_job(2, [key(1), key(2)], [0, 1], is_promotion=True))
        assert [r.success for r in drain(tier)] == [True]
        assert (tensor[:2] == 5).all()
    finally:
        tier.shutdown()


@pytest.mark.parametrize("use_o_direct", [True, False])
def test_a_block_is_read_without_o_nonblock(tmp_path, monkeypatch, use_o_direct):
    """Python I/O: a block file is opened O_NONBLOCK (a FIFO there must not
    block the open) but read with it cleared, as the C path does: Lustre
    fails a read that another node's lock holds with EAGAIN under it."""
    import fcntl

    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    if use_o_direct and not io_mod.probe_o_direct(str(tmp_path)):
        pytest.skip("no O_DIRECT support here")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", False)
    size, path = mmap.PAGESIZE, str(tmp_path / "block")
    with open(path, "wb") as f:
        f.write(b"\x07" * size)
    region, flags = mmap.mmap(-1, size), []
    real_readv = os.readv

    def readv(fd, buffers):
        flags.append(fcntl.fcntl(fd, fcntl.F_GETFL))
        return real_readv(fd, buffers)

    monkeypatch.setattr(os, "readv", readv)
    io_mod.batch_load_block([path], memoryview(region), [0], size, use_o_direct)
    assert region[:] == b"\x07" * size
    (read_flags,) = flags
    assert not read_flags & os.O_NONBLOCK
    assert bool(read_flags & io_mod.O_DIRECT) is use_o_direct


@pytest.mark.parametrize("error", ["ENOSPC", "EIO", "EINVAL"])
def test_o_direct_is_probed_again_after_a_transient_failure(
    tmp_path, monkeypatch, error
):
    """The start-up O_DIRECT probe fails (disk full, I/O error): buffered I/O
    until the first store after the re-probe interval, then O_DIRECT; never
    again after EINVAL (no O_DIRECT)."""
    from types import SimpleNamespace

    import vllm.v1.kv_offload.tiering.fs.io as io_mod
    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

    if not io_mod.probe_o_direct(str(tmp_path)):
        pytest.skip("no O_DIRECT support here")
    real_write = os.write
    failing = {"on": True}

    def write(fd, data):
        if failing["on"] and ".o_direct_probe" in os.readlink(f"/proc/self/fd/{fd}"):
            code = getattr(errno, error)
            raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(
        fs_manager, "time", SimpleNamespace(monotonic=lambda: clock.now), raising=False
    )
    tensor = _page_aligned_zero_tensor(4, mmap.PAGESIZE)
    tensor[:3] = 5
    tier = _make_small_tier(tmp_path / "root", tensor)
    try:
        assert tier._use_o_direct is False
        failing["on"] = False  # space was freed
        tier.submit_store(make_job(1, [key(1)], [0]))  # within the interval
        assert [r.success for r in drain(tier)] == [True]
        assert tier._use_o_direct is False
        clock.now += 3600  # much later
        tier.submit_store(make_job(2, [key(2)], [1]))
        assert [r.success for r in drain(tier)] == [True]
        assert tier._use_o_direct is (error != "EINVAL")
        tier.submit_store(make_job(3, [key(3)], [2]))
        assert [r.success for r in drain(tier)] == [True]
        tensor[:3] = 0
        tier.submit_load(
            make_job(4, [key(1), key(2), key(3)], [0, 1, 2], is_promotion=True)
        )
        assert [r.success for r in drain(tier)] == [True]
        assert (tensor[:3] == 5).all()
    finally:
        tier.shutdown()


# ---------------------------------------------------------------------------
# KV events
# ---------------------------------------------------------------------------


def test_successful_store_emits_stored_event(fs_tier_with_events):
    """A completed store job emits one stored event with the job's keys."""
    tier = fs_tier_with_events
    keys = [key(1), key(2)]
    tier.submit_store(make_job(1, keys, [0, 1]))
    assert all(r.success for r in drain(tier))

    events = list(tier.take_events())
    assert len(events) == 1
    assert events[0].keys == keys
    assert events[0].medium == Medium.STORAGE
    assert events[0].locality is Locality.LOCAL
    assert not events[0].removed
    assert events[0].req_context is _CTX
    # take_events drains the buffer.
    assert list(tier.take_events()) == []


@pytest.mark.parametrize(
    ("locality", "expected"),
    [(None, None), ("REMOTE", Locality.REMOTE)],
)
def test_store_event_uses_configured_locality(tmp_path, locality, expected):
    tensor = _page_aligned_zero_tensor(4, _BLOCK_ELEMENTS)
    locality_config = {} if locality is None else {"locality": locality}
    tier = FileSystemTierManager(
        offloading_spec=_make_offloading_spec(enable_kv_cache_events=True),
        primary_kv_view=memoryview(tensor.numpy()),
        tier_type="fs",
        root_dir=str(tmp_path),
        enable_kv_events=True,
        **locality_config,
    )
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert all(r.success for r in drain(tier))

        events = list(tier.take_events())
        assert len(events) == 1
        assert events[0].locality is expected
    finally:
        tier.shutdown()


def test_load_job_emits_no_event(fs_tier_with_events):
    tier = fs_tier_with_events
    tier.submit_store(make_job(1, [key(1)], [0]))
    results = drain(tier)
    assert len(results) == 1
    assert results[0].success
    list(tier.take_events())

    tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
    results = drain(tier)
    assert len(results) == 1
    assert results[0].success
    assert list(tier.take_events()) == []


def test_mixed_job_results_emit_event_only_for_successful_job(
    fs_tier_with_events, monkeypatch
):
    """With a failed and a successful store job in flight, exactly one event
    is emitted and its keys belong to the successful job."""
    import vllm.v1.kv_offload.tiering.fs.manager as mgr_mod

    tier = fs_tier_with_events
    failing_path = tier.file_mapper.get_file_name(key(1))
    original_batch_store_block = mgr_mod.batch_store_block

    def flaky_batch_store_block(paths, *args, **kwargs):
        if failing_path in paths:
            raise OSError("injected store failure")
        return original_batch_store_block(paths, *args, **kwargs)

    monkeypatch.setattr(mgr_mod, "batch_store_block", flaky_batch_store_block)

    tier.submit_store(make_job(1, [key(1)], [0]))
    tier.submit_store(make_job(2, [key(2)], [1]))
    results = drain(tier)
    assert len(results) == 2
    by_id = {r.job_id: r for r in results}
    assert not by_id[1].success
    assert by_id[2].success

    events = list(tier.take_events())
    assert len(events) == 1
    assert events[0].keys == [key(2)]


def test_partially_failed_store_emits_no_event(fs_tier_with_events, monkeypatch):
    """A store job with any failed block emits no event for the whole job."""
    import vllm.v1.kv_offload.tiering.fs.manager as mgr_mod

    tier = fs_tier_with_events
    failing_path = tier.file_mapper.get_file_name(key(2))
    original_batch_store_block = mgr_mod.batch_store_block

    def flaky_batch_store_block(paths, *args, **kwargs):
        if failing_path in paths:
            raise OSError("injected store failure")
        return original_batch_store_block(paths, *args, **kwargs)

    monkeypatch.setattr(mgr_mod, "batch_store_block", flaky_batch_store_block)

    tier.submit_store(make_job(1, [key(1), key(2)], [0, 1]))
    results = drain(tier)
    assert len(results) == 1
    assert not results[0].success
    assert list(tier.take_events()) == []
    assert tier._pool._inflight_jobs == 0 and not tier._pool._finished_q


def test_events_disabled_by_default(fs_tier):
    tier, _ = fs_tier
    tier.submit_store(make_job(1, [key(1)], [0]))
    results = drain(tier)
    assert len(results) == 1
    assert results[0].success
    assert tier.events is None
    assert tier._pool._inflight_jobs == 0 and not tier._pool._finished_q
    assert list(tier.take_events()) == []


def test_events_require_global_kv_events_flag(tmp_path):
    """Tier-level opt-in alone is not enough; the global flag gates events."""
    tensor = _page_aligned_zero_tensor(4, _BLOCK_ELEMENTS)
    tier = FileSystemTierManager(
        offloading_spec=_make_offloading_spec(enable_kv_cache_events=False),
        primary_kv_view=memoryview(tensor.numpy()),
        tier_type="fs",
        root_dir=str(tmp_path),
        enable_kv_events=True,
    )
    try:
        assert tier.events is None
        tier.submit_store(make_job(1, [key(1)], [0]))
        results = drain(tier)
        assert len(results) == 1
        assert results[0].success
        assert list(tier.take_events()) == []
        assert tier._pool._inflight_jobs == 0 and not tier._pool._finished_q
    finally:
        tier.shutdown()


def test_cascade_store_emits_fs_event_through_tiering_manager(tmp_path):
    """A GPU->CPU->fs cascade surfaces the tier-owned FS stored event via the
    TieringOffloadingManager's aggregated take_events()."""
    from vllm.v1.kv_offload.tiering.manager import (
        CPUPrimaryTierOffloadingManager,
        TieringOffloadingManager,
    )

    tensor = _page_aligned_zero_tensor(4, _BLOCK_ELEMENTS)
    view = memoryview(tensor.numpy())
    mock_region = MagicMock()
    mock_region.create_kv_memoryview.return_value = view
    primary = CPUPrimaryTierOffloadingManager(num_chunks=4, mmap_region=mock_region)
    tier = FileSystemTierManager(
        offloading_spec=_make_offloading_spec(enable_kv_cache_events=True),
        primary_kv_view=primary.get_kv_memoryview(),
        tier_type="fs",
        root_dir=str(tmp_path),
        enable_kv_events=True,
    )
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])
    try:
        keys = [key(1), key(2)]
        manager.on_new_request(_CTX)
        assert manager.prepare_store(keys, _CTX) is not None
        manager.complete_store(keys, _CTX)  # cascades to the fs tier

        events: list[OffloadingEvent] = []
        ctx = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not events:
            manager.on_schedule_end(ctx)
            events.extend(manager.take_events())
            time.sleep(0.01)

        fs_events = [e for e in events if e.medium == Medium.STORAGE]
        assert len(fs_events) == 1
        assert set(fs_events[0].keys) == set(keys)
        assert not fs_events[0].removed
        assert fs_events[0].req_context is _CTX
    finally:
        tier.shutdown()


def test_fs_tier_cross_tp_round_trip(tmp_path):
    """TP=2 replicated writer and TP=4 reader share namespace and bytes."""
    root = str(tmp_path)
    writer_tensor = _page_aligned_rand_tensor(4, _BLOCK_ELEMENTS)
    expected = writer_tensor[0].clone()
    writer = FileSystemTierManager(
        offloading_spec=_make_offloading_spec(
            tp_size=2, world_size=2, rank=0, replicated_layout=True
        ),
        primary_kv_view=memoryview(writer_tensor.numpy()),
        tier_type="fs",
        root_dir=root,
        n_read_threads=2,
        n_write_threads=2,
    )
    try:
        writer.submit_store(make_job(1, [key(7)], [0]))
        assert all(r.success for r in drain(writer))
        writer_base = writer.file_mapper.base_path
        writer_path = writer.file_mapper.get_file_name(key(7))
    finally:
        writer.shutdown()

    reader_tensor = _page_aligned_zero_tensor(4, _BLOCK_ELEMENTS)
    reader = FileSystemTierManager(
        offloading_spec=_make_offloading_spec(
            tp_size=4, world_size=4, rank=3, replicated_layout=True
        ),
        primary_kv_view=memoryview(reader_tensor.numpy()),
        tier_type="fs",
        root_dir=root,
        n_read_threads=2,
        n_write_threads=2,
    )
    try:
        assert reader.file_mapper.base_path == writer_base
        assert reader.file_mapper.get_file_name(key(7)) == writer_path
        assert lookup_and_wait(reader, [key(7)]) == [LookupResult.HIT]
        reader.submit_load(make_job(2, [key(7)], [1], is_promotion=True))
        assert all(r.success for r in drain(reader))
        assert torch.allclose(reader_tensor[1], expected)
    finally:
        reader.shutdown()


# ---------------------------------------------------------------------------
# Storage namespace: KV cache layouts
# ---------------------------------------------------------------------------


def _hma_offloading_spec(tmp_path, head_size: int) -> MagicMock:
    """The offloading spec of a two-group (full + sliding window attention)
    model with the same layer names and block sizes whatever its head size;
    only the bytes per block differ (64 -> 4096 B, 48 -> 3072 B per block)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    model_dir = tmp_path / "tiny-model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 1,
                "num_key_value_heads": 1,
                "num_hidden_layers": 2,
                "vocab_size": 512,
                "max_position_embeddings": 1024,
                "torch_dtype": "float16",
            }
        )
    )
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            tokenizer=str(model_dir),
            skip_tokenizer_init=True,
            max_model_len=1024,
            dtype="float16",
        ),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id="test-engine",
        ),
    )
    full = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=head_size, dtype=torch.float16
    )
    sliding = SlidingWindowSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=head_size,
        dtype=torch.float16,
        sliding_window=32,
    )
    num_blocks = 4
    page = full.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks,
                layers=[layer],
                layer_stride=page,
                block_stride=page,
            )
            for layer in ("layers.0", "layers.1")
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(["layers.0"], full),
            KVCacheGroupSpec(["layers.1"], sliding),
        ],
    )
    spec = MagicMock()
    spec.config = build_offloading_config(vllm_config, kv_cache_config)
    assert spec.config.worker_kv_bytes_per_block == page
    spec.blocks_per_chunk = 1
    spec.kv_events_config = OffloadingKVEventsConfig(
        enable_kv_cache_events=False, self_describing_kv_events=False
    )
    return spec


def test_blocks_of_another_kv_cache_layout_are_never_read(tmp_path):
    """Two layouts with the same layer names and block sizes but other bytes
    per block (rows of 4096 B and 3072 B) use separate directories: a cold
    tier with one layout never finds the blocks the other layout stored."""
    root_dir = str(tmp_path / "fs")
    keys = [
        make_offload_key(n.to_bytes(8, "big"), group)
        for group in (0, 1)
        for n in (1, 2)
    ]
    tiers = []
    try:
        for head_size in (64, 48):
            tensor = _page_aligned_zero_tensor(_NUM_BLOCKS, _BLOCK_ELEMENTS)
            tier = FileSystemTierManager(
                offloading_spec=_hma_offloading_spec(tmp_path, head_size),
                primary_kv_view=memoryview(tensor.numpy()),
                tier_type="fs",
                root_dir=root_dir,
                n_read_threads=1,
                n_write_threads=1,
            )
            tiers.append(tier)
        writer, cold = tiers
        writer.submit_store(make_job(1, keys))
        assert all(r.success for r in drain(writer))
        assert lookup_and_wait(writer, keys) == [LookupResult.HIT] * len(keys)
        assert lookup_and_wait(cold, keys) == [LookupResult.MISS] * len(keys)
        assert writer.file_mapper.base_path != cold.file_mapper.base_path
    finally:
        for tier in tiers:
            tier.shutdown()


def test_c_store_creates_missing_directories_and_keeps_a_stored_block(tmp_path):
    """fs_io_C's store creates a block's missing directories (with exactly
    dir_mode) when its temp file cannot be created there, stores the next
    block into the directory that now exists, and keeps a block already
    stored."""
    try:
        from vllm.fs_io_C import batch_store_block as batch_store_block_C
    except ImportError:
        pytest.skip("fs_io_C extension not built")
    size = 4096
    buf = mmap.mmap(-1, 2 * size)
    view = memoryview(buf)
    view[:size] = b"a" * size
    view[size:] = b"b" * size
    block_dir = tmp_path / "x" / "y"
    first, second = (str(block_dir / f"{i}.bin") for i in range(2))

    def store(path: str, data: memoryview) -> None:
        batch_store_block_C([path + ".tmp"], [path], [data], False, 0o600, 0o700)

    store(first, view[:size])
    for d in (tmp_path / "x", block_dir):
        assert os.stat(d).st_mode & 0o777 == 0o700
    store(second, view[size:])
    store(first, view[size:])  # a complete block is there: kept
    with open(first, "rb") as f:
        assert f.read() == b"a" * size
    with open(second, "rb") as f:
        assert f.read() == b"b" * size
    assert sorted(os.listdir(block_dir)) == ["0.bin", "1.bin"]
    view.release()
    buf.close()
