# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
Unit tests for FileSystemTierManager.

These tests use real disk I/O to verify the Python filesystem tier implementation.
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
import regex as re
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
_MOCK_OFFLOADING_SPEC.offloaded_block_size = (16,)


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


def _make_tier(root_dir: str, rows: np.ndarray, **config) -> FileSystemTierManager:
    return FileSystemTierManager(
        offloading_spec=_MOCK_OFFLOADING_SPEC,
        primary_kv_view=memoryview(rows),
        tier_type="fs_python",
        root_dir=root_dir,
        n_read_threads=2,
        n_write_threads=2,
        **config,
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
        assert [r.success for r in _finish(tier)] == [True]
        tier.submit_load(make_job(2, keys, [2, 3], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        np.testing.assert_array_equal(rows[2:], expected)
    finally:
        tier.shutdown()
    (message,) = _io_mode_messages(caplog)
    assert message.startswith(
        f"'fs_python' KV offload tier at {tmp_path}: using buffered I/O for "
        "1280-byte blocks because the primary tier's rows (1280 bytes at address"
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
        assert [r.success for r in _finish(tier)] == [True]
    finally:
        tier.shutdown()
    (message,) = _io_mode_messages(caplog)
    prefix = f"'fs_python' KV offload tier at {tmp_path / 'fs'}: using "
    if _o_direct_works(str(tmp_path)):
        assert message == prefix + f"O_DIRECT I/O for {mmap.PAGESIZE}-byte blocks"
    else:
        assert message.startswith(prefix + "buffered I/O")
        assert "O_DIRECT I/O is not supported here" in message


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
    region = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    rows = np.frombuffer(region, dtype=np.uint8).reshape(4, mmap.PAGESIZE)
    rows[:2] = 5
    tier = _make_tier(str(tmp_path / "fs"), rows)
    try:
        assert tier._use_o_direct is False
        tier.submit_store(make_job(1, [key(1), key(2)], [0, 1]))
        assert [r.success for r in _finish(tier)] == [True]
        rows[:2] = 0
        tier.submit_load(make_job(2, [key(1), key(2)], [0, 1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[:2] == 5).all()
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


@pytest.mark.parametrize("error", ["ENOSPC", "EIO"])
def test_o_direct_is_probed_again_after_a_transient_failure(
    tmp_path, monkeypatch, caplog, error
):
    """The O_DIRECT probe at start-up fails because the disk is full (or an
    I/O error): the tier starts with buffered I/O, but once space is freed it
    switches to O_DIRECT with the first store after the re-probe interval,
    instead of using buffered I/O for the rest of the process."""
    import errno
    from types import SimpleNamespace

    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

    if not _o_direct_works(str(tmp_path)):
        pytest.skip("no O_DIRECT support here")
    real_write = os.write
    failing = {"on": True}

    def write(fd, data):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if failing["on"] and ".o_direct_probe" in path:
            code = getattr(errno, error)
            raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(
        fs_manager, "time", SimpleNamespace(monotonic=lambda: clock.now), raising=False
    )
    rows = _aligned_rows(4)
    rows[:] = 5
    with caplog.at_level("INFO", logger="vllm.v1.kv_offload.tiering.fs"):
        tier = _make_tier(str(tmp_path), rows)
    try:
        (message,) = _io_mode_messages(caplog)
        assert "using buffered I/O" in message
        assert tier._use_o_direct is False
        failing["on"] = False  # space was freed

        # within the interval: still buffered, no probe on the store path
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        assert tier._use_o_direct is False
        clock.now += 3600  # much later
        tier.submit_store(make_job(2, [key(2), key(3)], [1, 2]))
        assert [r.success for r in _finish(tier)] == [True]
        assert tier._use_o_direct is True, "still buffered after space was freed"
        assert "using O_DIRECT I/O" in _io_mode_messages(caplog)[-1]
        tier.submit_load(make_job(3, [key(1), key(3)], [3, 0], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows == 5).all()
    finally:
        tier.shutdown()


def test_failing_tier_reports_rate_limited_with_counts(tmp_path, monkeypatch, caplog):
    """A tier whose writes all fail (e.g. a full disk) says so at once, then at
    most once per interval with the counts since its previous line (also when
    the failures stop: polling reports what is pending), and flushes what is
    left at shutdown: never one line per block, never silent after the first
    report."""
    import errno
    from types import SimpleNamespace

    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager
    from vllm.v1.kv_offload.tiering.fs import report

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    clock = SimpleNamespace(now=1000.0)
    monkeypatch.setattr(report, "time", SimpleNamespace(monotonic=lambda: clock.now))
    monkeypatch.setattr(fs_manager, "store_group_files", disk_full)
    tier = _make_tier(str(tmp_path), np.zeros((8, 4096), dtype=np.uint8))

    def store_jobs(first_job_id: int, n: int) -> None:
        for job_id in range(first_job_id, first_job_id + n):
            keys = [key(2 * job_id), key(2 * job_id + 1)]
            tier.submit_store(make_job(job_id, keys, [0, 1]))
        results = _finish(tier, n)
        assert len(results) == n and not any(r.success for r in results)

    def reports() -> list[str]:
        lines = [r.getMessage() for r in caplog.records]
        return [line for line in lines if "since the previous report" in line]

    with caplog.at_level("ERROR", logger="vllm.v1.kv_offload.tiering.fs"):
        store_jobs(0, 1)
        assert len(reports()) == 1
        store_jobs(1, 3)  # within the interval: counted, not logged
        clock.now += report.REPORT_INTERVAL_S - 1
        list(tier.get_finished())
        assert len(reports()) == 1
        clock.now += 1  # the interval has passed: polling reports them
        list(tier.get_finished())
        assert len(reports()) == 2
        store_jobs(4, 1)  # within the new interval: left for shutdown
        tier.shutdown()
    prefix = f"'fs_python' KV offload tier at {tmp_path}: "
    error = "[Errno 28] No space left on device"
    assert reports() == [
        prefix + f"{j} store job(s) and 0 load job(s) failed: {n} block(s) not "
        "stored, 0 not loaded and recomputed since the previous report. Last "
        f"error: {error}"
        for n, j in [(2, 1), (6, 3), (2, 1)]
    ]


# ---------------------------------------------------------------------------
# Faults on disk: what is at a block's path is not what the tier wrote
# ---------------------------------------------------------------------------


def _aligned_rows(n_rows: int) -> np.ndarray:
    """Page-aligned rows of one page each, so that O_DIRECT can be used."""
    import mmap

    region = mmap.mmap(-1, n_rows * mmap.PAGESIZE)
    return np.frombuffer(region, dtype=np.uint8).reshape(n_rows, mmap.PAGESIZE)


# The names of the tier pool's I/O threads (not the start-up walk's thread).
_IO_THREAD = r"vllm_kv_py_fs_[ls]\d+"


def _io_thread_calls(monkeypatch, names: tuple[str, ...]) -> list:
    """The calls of os.<name> made from now on by the tier pool's I/O
    threads, as (name, first argument)."""
    calls: list[tuple[str, object]] = []

    def recording(name):
        real = getattr(os, name)

        def call(*args, **kwargs):
            if re.fullmatch(_IO_THREAD, threading.current_thread().name):
                calls.append((name, args[0] if args else kwargs))
            return real(*args, **kwargs)

        return call

    for name in names:
        monkeypatch.setattr(os, name, recording(name))
    return calls


def _has_io_threads() -> bool:
    """Whether the pool's I/O threads run under the names the spy matches
    (else a spy that recorded nothing proves nothing)."""
    return any(re.fullmatch(_IO_THREAD, t.name) for t in threading.enumerate())


def _refuse_user_xattrs(monkeypatch) -> None:
    """As on a root whose filesystem has no user extended attributes (an
    old tmpfs, some NFS mounts): every xattr call fails as there."""

    def unsupported(*args, **kwargs):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "setxattr", unsupported)
    monkeypatch.setattr(os, "getxattr", unsupported)


@pytest.fixture
def no_user_xattrs(monkeypatch):
    _refuse_user_xattrs(monkeypatch)


def _finish(tier: FileSystemTierManager, n_jobs: int = 1) -> list:
    """The results of the next n_jobs jobs to finish (no idle-time guess)."""
    results: list = []
    deadline = time.monotonic() + 60
    while len(results) < n_jobs:
        assert time.monotonic() < deadline, "the tier's jobs did not finish"
        results.extend(tier.get_finished())
        time.sleep(0.001)
    return results


def test_blocks_are_checked_by_default(tmp_path):
    """Without a 'checksum' setting a block file carries the CRC32C of its
    bytes in its user.vllm.kv_crc32c xattr (the upstream track's
    checksum_blocks files), set and checked with the block's I/O; a file
    overwritten in place with as many bytes fails its load and is removed."""
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    try:
        fs_io.probe_xattr(str(tmp_path))
    except OSError:
        pytest.skip("no user xattrs here: 'auto' checks nothing")
    rows = _aligned_rows(4)
    rows[0] = np.arange(rows.shape[1]) % 253
    tier = _make_tier(str(tmp_path), rows)
    try:
        assert tier._checksum is True
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        path = tier.file_mapper.get_file_name(key(1))
        with open(path, "rb") as f:
            stored = f.read()
        assert os.getxattr(path, fs_io.CRC_XATTR) == fs_io.crc32c(memoryview(stored))
        tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[1] == rows[0]).all()

        with open(path, "r+b") as f:
            f.write(bytes([stored[0] ^ 1]))
        tier.submit_load(make_job(3, [key(1)], [2], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [False]
        assert not os.path.exists(path)
    finally:
        tier.shutdown()


def test_auto_checks_nothing_on_a_root_without_user_xattrs(
    tmp_path, caplog, no_user_xattrs
):
    """Where the root has no user xattrs, the default ("auto") checks
    nothing, and says so at start with the fix; "crc32c" set explicitly is
    refused there, naming the setting."""
    rows = _aligned_rows(2)
    with caplog.at_level("WARNING", logger="vllm.v1.kv_offload.tiering.fs"):
        tier = _make_tier(str(tmp_path / "auto"), rows)
    tier.shutdown()
    assert tier._checksum is False
    (line,) = [
        r.getMessage() for r in caplog.records if "not checked" in r.getMessage()
    ]
    assert "set 'checksum' to 'none'" in line
    with pytest.raises(ValueError, match="checksum of the 'fs_python' tier needs"):
        _make_tier(str(tmp_path / "crc32c"), rows, checksum="crc32c")


def test_auto_without_fs_io_c_checks_nothing_and_says_so(tmp_path, monkeypatch, caplog):
    """Without the fs_io_C extension a CRC32C is computed in Python (under
    10 MB/s a thread): the default checks nothing then, and says which
    setting checks anyway; "crc32c" set explicitly checks, with a warning."""
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    monkeypatch.setattr(fs_io, "_HAS_FSIO_C", False)
    with caplog.at_level("WARNING", logger="vllm.v1.kv_offload.tiering.fs"):
        tier = _make_tier(str(tmp_path / "auto"), _aligned_rows(2))
    tier.shutdown()
    assert tier._checksum is False
    assert any("Set 'checksum' to 'crc32c'" in r.getMessage() for r in caplog.records)
    tier = _make_tier(str(tmp_path / "crc32c"), _aligned_rows(2), checksum="crc32c")
    tier.shutdown()
    assert tier._checksum is True


def test_checksums_no_longer_offered_are_refused_naming_the_fix(tmp_path):
    for name in ("xxh3_64", "crc32"):
        with pytest.raises(ValueError, match="set 'checksum' to 'auto' or 'crc32c'"):
            _make_tier(str(tmp_path), _aligned_rows(2), checksum=name)


@pytest.mark.parametrize(
    "in_the_way", ["empty file", "short file", "long file", "empty directory"]
)
def test_store_replaces_what_is_not_a_complete_block(tmp_path, in_the_way):
    """A store over a path that holds no complete block (an empty or short
    file left by a crash or a full disk, a longer file, an empty directory)
    writes the block instead of trusting that the path exists: a store never
    reports success for bytes it did not write."""
    rows = _aligned_rows(4)
    n = rows.shape[1]
    tier = _make_tier(str(tmp_path), rows)
    try:
        path = tier.file_mapper.get_file_name(key(1))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if in_the_way == "empty directory":
            os.mkdir(path)
        else:
            size = {"empty file": 0, "short file": n // 2, "long file": n + 1}
            with open(path, "wb") as f:
                f.write(b"\xff" * size[in_the_way])
        rows[0] = np.arange(n) % 251
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        assert os.path.isfile(path) and os.path.getsize(path) == n
        tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        np.testing.assert_array_equal(rows[1], rows[0])
    finally:
        tier.shutdown()


@pytest.mark.parametrize(
    "checksum,second",
    [("none", 5), (None, 4), (None, 5)],
    ids=["none", "same", "other"],
)
def test_a_complete_block_file_already_there_is_kept(tmp_path, checksum, second):
    """A store whose block file is already complete (another engine on the
    same root, or a store that raced a restart) keeps that file, and leaves
    no temp file. Without a checksum, whatever its bytes; with one (the default), if it
    holds this block's checksum: a file of other bytes is another block's,
    replaced (the temp file published: a new inode, the new bytes)."""
    rows = _aligned_rows(4)
    rows[0] = 4
    config = {} if checksum is None else {"checksum": checksum}
    tier = _make_tier(str(tmp_path), rows, **config)
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        path = tier.file_mapper.get_file_name(key(1))
        inode = os.stat(path).st_ino
        rows[0] = second
        tier.submit_store(make_job(2, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        replaced = checksum is None and second != 4
        assert (os.stat(path).st_ino != inode) == replaced
        assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
        tier.submit_load(make_job(3, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[1] == (second if replaced else 4)).all()
    finally:
        tier.shutdown()


def test_a_store_on_a_full_disk_keeps_the_block_already_there(tmp_path, monkeypatch):
    """A store of a key whose complete block file is on disk already
    succeeds when no byte can be written (here the file size limit: EFBIG):
    the block is there. A store of a new key fails, and leaves no temp
    file."""
    import resource
    import signal

    rows = _aligned_rows(4)
    rows[0] = 6
    tier = _make_tier(str(tmp_path), rows)
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        inode = os.stat(tier.file_mapper.get_file_name(key(1))).st_ino
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
        try:
            tier.submit_store(make_job(2, [key(1), key(2)], [0, 0]))
            (result,) = _finish(tier)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)
        assert not result.success
        assert list(result.successful_keys) == [key(1)]
        assert os.stat(tier.file_mapper.get_file_name(key(1))).st_ino == inode
        path = tier.file_mapper.get_file_name(key(2))
        assert not [n for n in os.listdir(os.path.dirname(path)) if ".tmp" in n]
        tier.submit_load(make_job(3, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[1] == 6).all()
    finally:
        tier.shutdown()


def test_store_fails_for_a_directory_it_cannot_replace(tmp_path, caplog):
    """A non-empty directory where a block file should be cannot be replaced:
    the store fails for that key only, instead of reporting it stored, and
    the failure report counts that one block. Its load fails; a store then
    fails again and the key stays a miss."""
    rows = _aligned_rows(4)
    tier = _make_tier(str(tmp_path), rows)
    try:
        path = tier.file_mapper.get_file_name(key(1))
        os.makedirs(os.path.join(path, "not_a_block"))
        with caplog.at_level("ERROR", logger="vllm.v1.kv_offload.tiering.fs"):
            tier.submit_store(make_job(1, [key(0), key(1), key(2)], [0, 1, 2]))
            (result,) = _finish(tier)
        assert not result.success
        assert list(result.successful_keys) == [key(0), key(2)]
        assert os.path.isdir(os.path.join(path, "not_a_block"))
        (line,) = [
            r.getMessage() for r in caplog.records if "not stored" in r.getMessage()
        ]
        assert "1 store job(s) and 0 load job(s) failed: 1 block(s) not stored" in line

        tier.submit_load(make_job(2, [key(1)], [3], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [False]
        assert tier.lookup(key(1), _CTX) is False
        tier.submit_store(make_job(3, [key(1)], [1]))
        (result,) = _finish(tier)
        assert not result.success and not result.successful_keys
        assert tier.lookup(key(1), _CTX) is False
    finally:
        tier.shutdown()


@pytest.mark.parametrize("size_delta", [-1, 1], ids=["shorter", "longer"])
def test_load_fails_for_a_file_that_is_not_one_block(tmp_path, size_delta):
    """A block file shorter or longer than a block (truncated, appended to,
    another layout's) fails that key's load before anything is read into the
    primary tier's slot, and is removed; the job's other keys load."""
    rows = _aligned_rows(4)
    n = rows.shape[1]
    tier = _make_tier(str(tmp_path), rows)
    try:
        rows[:2] = np.random.default_rng(0).integers(0, 256, (2, n), dtype=np.uint8)
        tier.submit_store(make_job(1, [key(1), key(2)], [0, 1]))
        assert [r.success for r in _finish(tier)] == [True]
        path = tier.file_mapper.get_file_name(key(1))
        with open(path, "r+b") as f:
            f.truncate(n + size_delta)

        rows[2:] = 0x5A
        tier.submit_load(make_job(2, [key(1), key(2)], [2, 3], is_promotion=True))
        (result,) = _finish(tier)
        assert not result.success
        assert list(result.successful_keys) == [key(2)]
        assert (rows[2] == 0x5A).all(), "read into the slot of a failed load"
        np.testing.assert_array_equal(rows[3], rows[1])
        assert not os.path.exists(path)
        assert tier.lookup(key(1), _CTX) is False
    finally:
        tier.shutdown()


def test_unloadable_path_is_a_miss_until_stored_again(tmp_path, caplog):
    """A path whose load fails and that is not removed (here an empty
    directory: not opened with O_DIRECT, or opened and not removable) is
    answered as a miss from then on, instead of a hit whose promotion fails
    every time; the failure names the path once; a store of the key replaces
    it and makes it a hit again."""
    rows = _aligned_rows(4)
    tier = _make_tier(str(tmp_path), rows)
    try:
        path = tier.file_mapper.get_file_name(key(1))
        os.makedirs(path)
        assert tier.lookup(key(1), _CTX) is True  # the path exists
        with caplog.at_level("ERROR", logger="vllm.v1.kv_offload.tiering.fs"):
            tier.submit_load(make_job(1, [key(1)], [0], is_promotion=True))
            assert [r.success for r in _finish(tier)] == [False]
        assert os.path.isdir(path)
        assert tier.lookup(key(1), _CTX) is False
        (report,) = [
            r.getMessage()
            for r in caplog.records
            if "since the previous report" in r.getMessage()
        ]
        assert path in report

        rows[1] = 7
        tier.submit_store(make_job(2, [key(1)], [1]))
        assert [r.success for r in _finish(tier)] == [True]
        assert tier.lookup(key(1), _CTX) is True
        tier.submit_load(make_job(3, [key(1)], [2], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[2] == 7).all()
    finally:
        tier.shutdown()


@pytest.mark.parametrize("error", ["EIO", "EMFILE"])
def test_a_block_whose_read_keeps_failing_is_stored_anew(tmp_path, monkeypatch, error):
    """A complete block file whose read fails for a reason that will not
    pass (EIO: a bad sector) is a miss from then on, and the next store of
    its key writes it anew instead of keeping it as stored: the key loads
    again. A reason that may pass (EMFILE) leaves the key a hit. Before:
    the key stayed a hit, every promotion of it failed, and stores kept
    the file."""
    import errno

    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    # the bad read is injected into Python's os.readv
    monkeypatch.setattr(fs_io, "_HAS_FSIO_C", False)
    rows = _aligned_rows(4)
    rows[0] = 3
    tier = _make_tier(str(tmp_path), rows, checksum="none")
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        path = tier.file_mapper.get_file_name(key(1))
        real_readv = os.readv

        def failing_readv(fd, buffers):
            code = getattr(errno, error)
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, "readv", failing_readv)
        tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [False]
        monkeypatch.setattr(os, "readv", real_readv)
        assert os.path.isfile(path)  # a complete block: not removed
        if error == "EMFILE":
            assert tier.lookup(key(1), _CTX) is True
            return
        assert tier.lookup(key(1), _CTX) is False
        rows[0] = 4
        tier.submit_store(make_job(3, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        assert tier.lookup(key(1), _CTX) is True
        tier.submit_load(make_job(4, [key(1)], [2], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[2] == 4).all(), "the file was kept, not written anew"
    finally:
        tier.shutdown()


def _make_unloadable(tier, rows, monkeypatch, keys, first_job):
    """Store *keys*, then fail their loads with EIO: they become misses."""
    import errno

    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    monkeypatch.setattr(fs_io, "_HAS_FSIO_C", False)
    real_readv = os.readv

    def failing_readv(fd, buffers):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    for n, k in enumerate(keys):
        tier.submit_store(make_job(first_job + 2 * n, [k], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        monkeypatch.setattr(os, "readv", failing_readv)
        tier.submit_load(make_job(first_job + 2 * n + 1, [k], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [False]
        monkeypatch.setattr(os, "readv", real_readv)


def test_a_rewrite_that_cannot_remove_the_old_file_stays_a_miss(tmp_path, monkeypatch):
    """A store of a key whose file cannot be read (EIO) and cannot be
    removed (a read-only remount) keeps the old file: the key stays a miss
    instead of a hit whose every promotion fails."""
    import errno

    rows = _aligned_rows(4)
    tier = _make_tier(str(tmp_path), rows, checksum="none")
    try:
        _make_unloadable(tier, rows, monkeypatch, [key(1)], 1)
        path = tier.file_mapper.get_file_name(key(1))
        real_remove = os.remove

        def read_only(target, *args, **kwargs):
            if target == path:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))
            return real_remove(target, *args, **kwargs)

        monkeypatch.setattr(os, "remove", read_only)
        tier.submit_store(make_job(9, [key(1)], [0]))
        _finish(tier)
        assert tier.lookup(key(1), _CTX) is False
    finally:
        tier.shutdown()


def test_keys_kept_as_misses_are_bounded(tmp_path, monkeypatch):
    """The keys answered as misses because their files cannot be loaded are
    at most MAX_UNLOADABLE_KEYS, the oldest going first."""
    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

    monkeypatch.setattr(fs_manager, "MAX_UNLOADABLE_KEYS", 2, raising=False)
    rows = _aligned_rows(4)
    tier = _make_tier(str(tmp_path), rows, checksum="none")
    try:
        _make_unloadable(tier, rows, monkeypatch, [key(1), key(2), key(3)], 1)
        assert list(tier._unloadable) == [key(2), key(3)]
    finally:
        tier.shutdown()


def test_a_failed_load_removes_only_the_file_it_read(tmp_path, monkeypatch):
    """Another engine sharing the root stores a block anew (renames a whole
    file into place) between a load's look at the damaged file it replaces
    and that load's removal of it: the new file is left alone."""
    import shutil
    import stat

    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    # the race is injected into Python's os.fstat: blocks take the Python path
    monkeypatch.setattr(fs_io, "_HAS_FSIO_C", False)
    rows = _aligned_rows(4)
    rows[0] = 5
    tier = _make_tier(str(tmp_path), rows)
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        path = tier.file_mapper.get_file_name(key(1))
        with open(path, "rb") as f:
            good = f.read()
        stored_anew = path + ".another-engine"
        shutil.copy2(path, stored_anew)  # with its checksum attribute
        os.remove(path)
        with open(path, "wb") as f:
            f.write(good[: len(good) // 2])  # a damaged file: half a block
        real_fstat = os.fstat

        def fstat_then_store_anew(fd):
            st = real_fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_size == len(good) // 2:
                os.rename(stored_anew, path)
            return st

        monkeypatch.setattr(os, "fstat", fstat_then_store_anew)
        tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [False]
        monkeypatch.undo()
        assert os.path.isfile(path), "the block stored anew was removed"
        with open(path, "rb") as f:
            assert f.read() == good
    finally:
        tier.shutdown()


@pytest.mark.parametrize(
    "checksum",
    [
        None,  # the default
        "crc32c",
        pytest.param(
            "none",
            marks=pytest.mark.xfail(
                raises=AssertionError,
                strict=True,
                reason="without a checksum, a damaged file is served",
            ),
        ),
    ],
)
@pytest.mark.parametrize(
    "damage",
    [
        "random bytes",
        "one flipped bit",
        "zeroed half",
        "another key's block",
        "another writer's file",
    ],
)
def test_load_fails_for_a_block_file_overwritten_in_place(
    tmp_path, damage, checksum, caplog
):
    """With a checksum, a block file overwritten with as many bytes as it had
    (random bytes, a flipped bit, a zeroed half, another key's block file,
    or another writer's file of that size renamed over it) is not served as
    the key's block: its load fails (the key becomes a miss, the file is
    removed) with one report naming the path, and the job's other keys
    load."""
    rows = _aligned_rows(6)
    n = rows.shape[1]
    config = {} if checksum is None else {"checksum": checksum}
    tier = _make_tier(str(tmp_path), rows, **config)
    try:
        rng = np.random.default_rng(1)
        rows[:3] = rng.integers(1, 256, (3, n), dtype=np.uint8)
        tier.submit_store(make_job(1, [key(1), key(2), key(3)], [0, 1, 2]))
        assert [r.success for r in _finish(tier)] == [True]
        path = tier.file_mapper.get_file_name(key(1))
        with open(path, "rb") as f:
            data = bytearray(f.read())
        if damage == "random bytes":
            data[:] = rng.bytes(len(data))
        elif damage == "one flipped bit":
            data[n // 3] ^= 0x10
        elif damage == "zeroed half":
            data[n // 2 : n] = bytes(n - n // 2)
        elif damage == "another key's block":
            with open(tier.file_mapper.get_file_name(key(2)), "rb") as f:
                data[:] = f.read()
        if damage == "another writer's file":
            with open(path + ".other", "wb") as f:
                f.write(rng.bytes(len(data)))
            os.replace(path + ".other", path)
        else:
            with open(path, "r+b") as f:
                assert f.write(data) == os.path.getsize(path)

        with caplog.at_level("ERROR", logger="vllm.v1.kv_offload.tiering.fs"):
            tier.submit_load(make_job(2, [key(1), key(3)], [3, 4], is_promotion=True))
            (result,) = _finish(tier)
        assert not result.success, "served a damaged block file as the key's block"
        assert list(result.successful_keys) == [key(3)]
        np.testing.assert_array_equal(rows[4], rows[2])
        assert not os.path.exists(path)
        assert tier.lookup(key(1), _CTX) is False
        lines = [r.getMessage() for r in caplog.records if path in r.getMessage()]
        assert len(lines) == 1 and "CRC32C mismatch" in lines[0]
    finally:
        tier.shutdown()


@pytest.mark.parametrize("xattr", ["removed", "another block's"])
def test_a_block_file_without_its_checksum_is_written_again(tmp_path, xattr):
    """A block file copied or restored without its extended attributes (cp,
    rsync without -X), or with another block's checksum, has the right size
    but not this block's checksum: a store of its key writes it again,
    instead of keeping a file whose load would fail."""
    from vllm.v1.kv_offload.tiering.fs.io import CRC_XATTR

    rows = _aligned_rows(4)
    rows[0] = 7
    tier = _make_tier(str(tmp_path), rows, checksum="crc32c")
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        path = tier.file_mapper.get_file_name(key(1))
        stored = os.getxattr(path, CRC_XATTR)
        if xattr == "removed":
            os.removexattr(path, CRC_XATTR)
        else:
            os.setxattr(path, CRC_XATTR, bytes(4))
        tier.submit_store(make_job(2, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        assert os.getxattr(path, CRC_XATTR) == stored
        tier.submit_load(make_job(3, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[1] == 7).all()
    finally:
        tier.shutdown()


def test_tier_recreates_its_config_when_its_root_is_removed(tmp_path, caplog):
    """The tier's root directory removed while it runs (an operator cleaning
    up, a tmpfs remounted): the next stores re-create the block directories
    and also config.json, which says what the files are; it is not left
    missing for the rest of the process."""
    import shutil

    root = tmp_path / "root"
    rows = _aligned_rows(4)
    rows[:2] = 9
    tier = _make_tier(str(root), rows)
    try:
        config_path = tier.file_mapper.get_config_file_path()
        with open(config_path) as f:
            config = json.load(f)
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]

        shutil.rmtree(root)
        with caplog.at_level("WARNING", logger="vllm.v1.kv_offload.tiering.fs"):
            tier.submit_store(make_job(2, [key(2), key(3)], [1, 1]))
            assert [r.success for r in _finish(tier)] == [True]
        assert os.path.isfile(tier.file_mapper.get_file_name(key(2)))
        assert os.path.isfile(config_path), "config.json was not re-created"
        with open(config_path) as f:
            assert json.load(f) == config
        (line,) = [
            r.getMessage() for r in caplog.records if "re-created" in r.getMessage()
        ]
        assert config_path in line
        tier.submit_load(make_job(3, [key(2)], [2], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[2] == 9).all()
    finally:
        tier.shutdown()
    assert not [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]


def test_config_re_creation_failures_are_reported_rate_limited(
    tmp_path, monkeypatch, caplog
):
    """The root is removed and config.json cannot be re-created (here its
    write fails with ENOSPC): the stores go on, and the tier says so with
    counts, at most once per interval (not once per new block directory)."""
    import errno
    import shutil

    import vllm.v1.kv_offload.tiering.fs.manager as fs_manager
    from vllm.v1.kv_offload.tiering.fs.report import Throttle

    def full_disk(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    root = tmp_path / "root"
    rows = _aligned_rows(4)
    tier = _make_tier(str(root), rows)

    def warnings() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if "could not re-create" in r.getMessage().lower()
        ]

    try:
        config_path = tier.file_mapper.get_config_file_path()
        shutil.rmtree(root)
        monkeypatch.setattr(fs_manager, "write_file_atomically", full_disk)
        with caplog.at_level("WARNING", logger="vllm.v1.kv_offload.tiering.fs"):
            for job_id in range(1, 9):  # keys in 8 new block directories
                tier.submit_store(make_job(job_id, [key(job_id << 56)], [0]))
                assert [r.success for r in _finish(tier)] == [True]
            (line,) = warnings()
            assert "(1 failed attempt(s) since the last warning" in line
            assert config_path in line
            tier._config_throttle = Throttle(0.0)  # the interval is over
            tier.submit_store(make_job(9, [key(9 << 56)], [0]))
            assert [r.success for r in _finish(tier)] == [True]
        assert len(warnings()) == 2
        assert "(8 failed attempt(s) since the last warning" in warnings()[1]
    finally:
        tier.shutdown()


def test_a_config_write_cut_short_leaves_no_partial_config(tmp_path):
    """config.json written as the disk fills up (here a file size limit cuts
    the write after 16 bytes): no truncated config.json is left to describe
    the directory for good; the next store writes it whole."""
    import resource
    import signal

    root = tmp_path / "root"
    tier = _make_tier(str(root), _aligned_rows(4))
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
        assert [r.success for r in _finish(tier)] == [True]
        with open(config_path, "rb") as f:
            assert f.read() == config
    finally:
        tier.shutdown()


class _JobSync:
    """Lets a test wait until the fs tier's submitted jobs have finished,
    so each simulated engine step sees the results of the previous one."""

    def __init__(self, tier: FileSystemTierManager) -> None:
        self.tier = tier
        self.outstanding = 0
        self.loads: list[list[OffloadKey]] = []
        submit_load, submit_store = tier.submit_load, tier.submit_store
        get_finished = tier.get_finished

        def counted_load(job):
            self.outstanding += 1
            self.loads.append(list(job.keys))
            submit_load(job)

        def counted_store(job):
            self.outstanding += 1
            submit_store(job)

        def counted_finished():
            results = list(get_finished())
            self.outstanding -= len(results)
            return results

        tier.submit_load = counted_load  # type: ignore[method-assign]
        tier.submit_store = counted_store  # type: ignore[method-assign]
        tier.get_finished = counted_finished  # type: ignore[method-assign]

    def wait(self) -> None:
        deadline = time.monotonic() + 60
        while len(self.tier._pool._finished_q) < self.outstanding:
            assert time.monotonic() < deadline, "the tier's jobs did not finish"
            time.sleep(0.001)


def test_request_settles_when_a_block_path_cannot_be_loaded(tmp_path, caplog):
    """Through the real TieringOffloadingManager: after a restart (empty CPU
    tier), a request's blocks of 2 KV cache groups are on disk, but one
    block's path is a non-empty directory (it cannot be read, removed or
    replaced). The request settles within a few engine steps, with a hit on
    the good block and a miss on the bad one, instead of being deferred while
    the bad block is promoted, fails and is promoted again, forever; the
    path is logged once, not once per attempt."""
    from vllm.v1.kv_offload.tiering.manager import (
        CPUPrimaryTierOffloadingManager,
        TieringOffloadingManager,
    )

    good, bad = make_offload_key(b"block-0", 0), make_offload_key(b"block-0", 1)
    rows = _aligned_rows(4)
    rows[0] = 3
    writer = _make_tier(str(tmp_path), rows)
    try:
        writer.submit_store(make_job(1, [good], [0]))
        assert [r.success for r in _finish(writer)] == [True]
        bad_path = writer.file_mapper.get_file_name(bad)
        os.makedirs(os.path.join(bad_path, "not_a_block"))
    finally:
        writer.shutdown()
    rows[:] = 0

    region = MagicMock()
    region.create_kv_memoryview.return_value = memoryview(rows)
    primary = CPUPrimaryTierOffloadingManager(num_blocks=4, mmap_region=region)
    tier = _make_tier(str(tmp_path), rows)
    sync = _JobSync(tier)
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])
    caplog.set_level("WARNING", logger="vllm.v1.kv_offload.tiering.fs")
    try:
        max_steps, settled = 60, None
        for step in range(1, max_steps + 1):
            # the connector looks the request's keys up in order, and defers
            # the request while any of them is not ready yet (None)
            results = []
            for k in (good, bad):
                results.append(manager.lookup(k, _CTX))
                if results[-1] is not True:
                    break
            list(manager.take_events())
            if None not in results:
                settled = step
                break
            sync.wait()
        bad_loads = sum(bad in keys for keys in sync.loads)
        assert settled is not None, (
            f"deferred for {max_steps} steps, {bad_loads} failed loads of the "
            "unloadable block"
        )
        assert settled <= 4
        assert results == [True, False]
        assert bad_loads == 1
        lines = [r for r in caplog.records if bad_path in r.getMessage()]
        assert len(lines) == 1
        assert os.path.isdir(os.path.join(bad_path, "not_a_block"))
        # the good block reached the CPU tier with its bytes
        spec = manager.prepare_load([good], _CTX)
        assert (rows[int(spec.block_ids[0])] == 3).all()
        manager.complete_load([good], _CTX)
    finally:
        manager.shutdown()


def test_start_up_removes_only_stale_temp_files(tmp_path):
    """A writer killed between writing a block's temp file and renaming it
    leaves the temp file behind. A tier starting on the directory removes the
    tier's temp files older than cleanup_stale_tmp_after_seconds (block,
    O_DIRECT probe and config.json temp files) and keeps recent ones (a
    writer of another engine sharing the directory may still rename them),
    blocks, and files the tier did not write."""
    rows = _aligned_rows(2)
    tier = _make_tier(str(tmp_path), rows)
    block = tier.file_mapper.get_file_name(key(1))
    config_dir = os.path.dirname(tier.file_mapper.get_config_file_path())
    tier.shutdown()

    os.makedirs(os.path.dirname(block), exist_ok=True)
    stale = [
        f"{block}_1.tmp",
        os.path.join(config_dir, ".direct_io_probe_2.tmp"),
        os.path.join(config_dir, "config.json_5.tmp"),
    ]
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
    tier = _make_tier(str(tmp_path), rows)  # default: older than an hour
    try:
        cleanup = getattr(tier, "_tmp_cleanup", None)  # the walk runs in the background
        if cleanup is not None:
            cleanup.join()
        assert [os.path.exists(p) for p in stale] == [False] * len(stale)
        assert all(os.path.exists(p) for p in recent + other)
    finally:
        tier.shutdown()

    write(stale, old=True)
    tier = _make_tier(str(tmp_path), rows, cleanup_stale_tmp_after_seconds=None)
    tier.shutdown()
    assert all(os.path.exists(p) for p in stale + recent + other)

    threads = set(threading.enumerate())
    # JSON gives strings and booleans too: refused, never compared or taken as 1 s
    for bad in (-1, "3600", True):
        with pytest.raises(ValueError, match="cleanup_stale_tmp_after_seconds"):
            _make_tier(str(tmp_path), rows, cleanup_stale_tmp_after_seconds=bad)
    assert set(threading.enumerate()) <= threads, "raised after starting threads"


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

    def finish() -> list:
        tier._pool.wait_idle()  # drain() alone stops after 50 ms without one
        return drain(tier)

    tier.submit_store(make_job(1, keys, [0, 1, 2, 3]))
    assert all(r.success for r in finish())
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
        assert [r.success for r in finish()] == [False]
    assert not set(real_paths[2:]) & set(looked_at)
    assert [tier.lookup(k, _CTX) for k in keys[2:]] == [True, True]
    tier.submit_load(make_job(3, keys[2:], [2, 3], is_promotion=True))
    assert all(r.success for r in finish())


@pytest.mark.parametrize("use_c_ext", [True, False])
def test_a_stop_ends_a_groups_later_batches(tmp_path, monkeypatch, use_c_ext):
    """A group's files gathered one per batch call: an error not of a block
    (ENAMETOOLONG, as a failing disk) in one batch raises that error, not an
    earlier batch's missing file, and the batches after it are neither read
    into their rows nor written (untried)."""
    import vllm.v1.kv_offload.tiering.fs.group_files as gf_mod
    import vllm.v1.kv_offload.tiering.fs.io as io_mod
    from vllm.v1.kv_offload.tiering.fs.files import PRIVATE_MODES

    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)
    size = mmap.PAGESIZE
    monkeypatch.setattr(gf_mod, "GATHER_BYTES", size)  # a file per batch
    group = gf_mod.GroupFile(0, size, ((0, size),))
    rows, offsets = mmap.mmap(-1, 4 * size), [0, size, 2 * size, 3 * size]
    names = ["missing", "ok", "x" * 300, "last"]
    paths = [str(tmp_path / name) for name in names]
    for path in paths[1::2]:
        with open(path, "wb") as f:
            f.write(b"\x07" * size)
    keys = [key(n) for n in range(4)]
    with pytest.raises(OSError) as e:
        gf_mod.load_group_files(
            group, paths, memoryview(rows), offsets, False, None, keys, False
        )
    assert e.value.errno == errno.ENAMETOOLONG
    assert (e.value.failed_indices, e.value.untried) == ([0, 2, 3], [3])
    assert rows[size : 2 * size] == b"\x07" * size
    assert rows[3 * size :] == bytes(size)  # never read
    os.remove(paths[3])
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "file").write_bytes(b"x")  # in the way of a store
    with pytest.raises(OSError) as e:
        gf_mod.store_group_files(
            group,
            [str(tmp_path / "dir"), *paths[1:]],
            memoryview(rows),
            offsets,
            False,
            PRIVATE_MODES,
            None,
            keys,
            False,
        )
    assert e.value.errno == errno.ENAMETOOLONG
    assert not os.path.exists(paths[3])  # never written


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
