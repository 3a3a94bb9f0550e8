# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
Unit tests for FileSystemTierManager.

These tests use real disk I/O to verify the Python filesystem tier implementation.
The tier manager writes KV cache blocks to disk and reads them back, verifying
data integrity throughout the process.
"""

import os
import time
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import JobMetadata
from vllm.v1.kv_offload.tiering.fs.manager import (
    FileSystemTierManager,
)

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

_BLOCK_ELEMENTS = 512 * 1024  # 2 MB per block (float32 × 512K = 2MB)
_DTYPE = torch.float32
_CTX = ReqContext(req_id="test")

_MOCK_VLLM_CONFIG = MagicMock()
_MOCK_VLLM_CONFIG.model_config.model = "test-model"
_MOCK_VLLM_CONFIG.cache_config.block_size = 16
_MOCK_VLLM_CONFIG.cache_config.cache_dtype = "torch.float32"
_MOCK_VLLM_CONFIG.parallel_config.tensor_parallel_size = 1
_MOCK_VLLM_CONFIG.parallel_config.pipeline_parallel_size = 1
_MOCK_VLLM_CONFIG.parallel_config.prefill_context_parallel_size = 1
_MOCK_VLLM_CONFIG.parallel_config.decode_context_parallel_size = 1
_MOCK_VLLM_CONFIG.parallel_config.rank = 0

_MOCK_KV_CACHE_CONFIG = MagicMock()
_MOCK_KV_CACHE_CONFIG.kv_cache_groups = []

_MOCK_OFFLOADING_SPEC = MagicMock()
_MOCK_OFFLOADING_SPEC.vllm_config = _MOCK_VLLM_CONFIG
_MOCK_OFFLOADING_SPEC.kv_cache_config = _MOCK_KV_CACHE_CONFIG
_MOCK_OFFLOADING_SPEC.block_size_factor = 1
_MOCK_OFFLOADING_SPEC.hash_block_size = 16


def key(n: int) -> OffloadKey:
    return make_offload_key(n.to_bytes(8, "big"), 0)


def make_job(
    job_id: int,
    keys: list[OffloadKey],
    block_ids: list[int] | None = None,
    is_promotion: bool = False,
) -> JobMetadata:
    if block_ids is None:
        block_ids = list(range(len(keys)))
    return JobMetadata(
        job_id=job_id,
        keys=keys,
        block_ids=np.array(block_ids, dtype=np.int64),
        is_promotion=is_promotion,
        req_context=_CTX,
    )


def drain(tier: FileSystemTierManager, max_rounds: int = 40) -> list:
    """
    Call get_finished() repeatedly until no new results arrive for 5
    consecutive rounds or max_rounds is reached.
    """
    results = []
    idle = 0
    for _ in range(max_rounds):
        time.sleep(0.01)
        new = list(tier.get_finished())
        results.extend(new)
        if new:
            idle = 0
        else:
            idle += 1
            if idle >= 5:
                break
    return results


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------


@pytest.fixture
def fs_tier(tmp_path):
    tensor = torch.zeros((4, _BLOCK_ELEMENTS), dtype=_DTYPE)
    mock_view = memoryview(tensor.numpy())
    tier = FileSystemTierManager(
        offloading_spec=_MOCK_OFFLOADING_SPEC,
        primary_kv_view=mock_view,
        tier_type="fs_python",
        root_dir=str(tmp_path),
        n_read_threads=4,
        n_write_threads=4,
    )
    yield tier, tensor
    tier.shutdown()


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def test_lookup_empty_tier(fs_tier):
    tier, _ = fs_tier
    assert tier.lookup(key(1), _CTX) is False
    assert tier.lookup(key(2), _CTX) is False


def test_store_creates_file_and_lookup_succeeds(fs_tier):
    tier, _ = fs_tier
    job = make_job(1, [key(1)], [0])
    tier.submit_store(job)
    results = drain(tier)
    assert len(results) == 1
    assert results[0].success
    assert tier.lookup(key(1), _CTX) is True
    dest = tier.file_mapper.get_file_name(key(1))
    assert os.path.exists(dest), f"Expected file at {dest}"


def test_store_then_load_roundtrip(fs_tier):
    tier, _ = fs_tier
    job_s = make_job(1, [key(1), key(2)], [0, 1])
    tier.submit_store(job_s)
    store_results = drain(tier)
    assert all(r.success for r in store_results)

    assert tier.lookup(key(1), _CTX) is True
    assert tier.lookup(key(2), _CTX) is True

    job_l = make_job(2, [key(1), key(2)], [2, 3], is_promotion=True)
    tier.submit_load(job_l)
    load_results = drain(tier)
    assert all(r.success for r in load_results)
    # Blocks stay on disk after load
    assert tier.lookup(key(1), _CTX) is True
    assert tier.lookup(key(2), _CTX) is True


def test_invalid_path_raises_at_construction():
    """Construction must fail immediately when the config file cannot be written."""
    tensor = torch.zeros((32, _BLOCK_ELEMENTS), dtype=_DTYPE)
    mock_view = memoryview(tensor.numpy())

    with pytest.raises(OSError):
        FileSystemTierManager(
            offloading_spec=_MOCK_OFFLOADING_SPEC,
            primary_kv_view=mock_view,
            tier_type="fs_python",
            root_dir="/dev/null/invalid_path",
        )


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
    assert tier.lookup(key(1), _CTX) is True
    assert tier.lookup(key(2), _CTX) is True


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


def test_store_load_data_integrity(fs_tier):
    """Data written by store must be exactly recovered by load."""
    tier, tensor = fs_tier
    # Populate tensor with random data
    tensor[:] = torch.rand((4, _BLOCK_ELEMENTS), dtype=_DTYPE)

    # Store first 2 blocks
    num_store = 2
    expected = tensor[:num_store].clone()

    store_ids = list(range(num_store))
    keys = [key(i) for i in range(num_store)]

    tier.submit_store(make_job(1, keys, store_ids))
    results = drain(tier)
    assert all(r.success for r in results)

    # Overwrite source blocks to prove data is read from disk
    tensor[:num_store] = 0.0

    # Load into last 2 blocks
    load_ids = [2, 3]
    tier.submit_load(make_job(2, keys, load_ids, is_promotion=True))
    results = drain(tier)
    assert all(r.success for r in results)

    for i, bid in enumerate(load_ids):
        assert torch.allclose(tensor[bid], expected[i]), (
            f"Block {bid} data mismatch after store+load"
        )


def _make_tier(root_dir: str, rows: np.ndarray) -> FileSystemTierManager:
    return FileSystemTierManager(
        offloading_spec=_MOCK_OFFLOADING_SPEC,
        primary_kv_view=memoryview(rows),
        tier_type="fs_python",
        root_dir=root_dir,
        n_read_threads=2,
        n_write_threads=2,
    )


def _io_mode_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if " I/O for " in r.getMessage()]


def test_unaligned_rows_fall_back_to_buffered_io(tmp_path, caplog):
    """Rows that O_DIRECT cannot transfer (1280 bytes, as an unpadded mamba
    or odd-head-size layout gives) round-trip with buffered I/O instead of
    failing every job, and the tier says once which mode it uses and why."""
    rows = np.zeros((4, 1280), dtype=np.uint8)
    with caplog.at_level("INFO", logger="vllm.v1.kv_offload.tiering.fs"):
        tier = _make_tier(str(tmp_path), rows)
    try:
        rng = np.random.default_rng(0)
        rows[:2] = rng.integers(0, 256, (2, 1280), dtype=np.uint8)
        expected = rows[:2].copy()
        keys = [key(0), key(1)]
        tier.submit_store(make_job(1, keys, [0, 1]))
        assert [r.success for r in drain(tier)] == [True]
        tier.submit_load(make_job(2, keys, [2, 3], is_promotion=True))
        assert [r.success for r in drain(tier)] == [True]
        np.testing.assert_array_equal(rows[2:], expected)
    finally:
        tier.shutdown()
    (message,) = _io_mode_messages(caplog)
    assert message.startswith(
        f"fs_python tier at {tmp_path}: using buffered I/O for 1280-byte blocks "
        "because the primary tier's rows (1280 bytes at address"
    )


def _o_direct_works(directory: str) -> bool:
    """An independent check of O_DIRECT support for page-aligned I/O."""
    import mmap

    path = os.path.join(directory, "o_direct_check")
    buf = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | getattr(os, "O_DIRECT", 0))
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        return hasattr(os, "O_DIRECT")
    except OSError:
        return False
    finally:
        buf.close()
        if os.path.exists(path):
            os.remove(path)


def test_aligned_rows_use_o_direct_where_supported(tmp_path, caplog):
    """Page-aligned rows use O_DIRECT when the filesystem supports it, and
    the mode is logged exactly once."""
    import mmap

    region = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    rows = np.frombuffer(region, dtype=np.uint8).reshape(4, mmap.PAGESIZE)
    with caplog.at_level("INFO", logger="vllm.v1.kv_offload.tiering.fs"):
        tier = _make_tier(str(tmp_path / "fs"), rows)
    try:
        tier.submit_store(make_job(1, [key(0)], [0]))
        assert [r.success for r in drain(tier)] == [True]
    finally:
        tier.shutdown()
    (message,) = _io_mode_messages(caplog)
    prefix = f"fs_python tier at {tmp_path / 'fs'}: using "
    if _o_direct_works(str(tmp_path)):
        assert message == prefix + f"O_DIRECT I/O for {mmap.PAGESIZE}-byte blocks"
    else:
        assert message.startswith(prefix + "buffered I/O")
        assert "O_DIRECT I/O is not supported here" in message


def test_failing_tier_reports_rate_limited_with_counts(tmp_path, monkeypatch, caplog):
    """A tier whose writes all fail (e.g. a full disk) says so at once, then at
    most once per interval with the counts since its previous line (also when
    the failures stop: polling reports what is pending), and flushes what is
    left at shutdown: never one line per block, never silent after the first
    report."""
    import errno
    from types import SimpleNamespace

    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager
    from vllm.v1.kv_offload.tiering.fs import thread_pool

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(
        thread_pool, "time", SimpleNamespace(monotonic=lambda: clock.now)
    )
    monkeypatch.setattr(fs_manager, "store_block", disk_full)
    tier = _make_tier(str(tmp_path), np.zeros((8, 4096), dtype=np.uint8))

    def store_jobs(first_job_id: int, n: int) -> None:
        for job_id in range(first_job_id, first_job_id + n):
            keys = [key(2 * job_id), key(2 * job_id + 1)]
            tier.submit_store(make_job(job_id, keys, [0, 1]))
        results = drain(tier)
        assert len(results) == n and not any(r.success for r in results)

    def reports() -> list[str]:
        return [r.getMessage() for r in caplog.records if "failed in" in r.getMessage()]

    with caplog.at_level("ERROR", logger="vllm.v1.kv_offload.tiering.fs"):
        store_jobs(0, 1)
        assert len(reports()) == 1
        store_jobs(1, 3)  # within the interval: counted, not logged
        clock.now += thread_pool.FAILURE_REPORT_INTERVAL_S - 1
        list(tier.get_finished())
        assert len(reports()) == 1
        clock.now += 1  # the interval has passed: polling reports them
        list(tier.get_finished())
        assert len(reports()) == 2
        store_jobs(4, 1)  # within the new interval: left for shutdown
        tier.shutdown()
    prefix = f"fs_python tier at {tmp_path}: "
    error = "[Errno 28] No space left on device"
    assert reports() == [
        prefix + f"{n} of {n} block writes and 0 of 0 block reads failed in {j} "
        "job(s) since the previous report; failed writes are not stored and "
        f"failed reads are not served (recomputed instead). Last error: {error}"
        for n, j in [(2, 1), (6, 3), (2, 1)]
    ]
