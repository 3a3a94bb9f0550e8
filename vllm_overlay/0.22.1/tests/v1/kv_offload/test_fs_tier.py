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
        assert [r.success for r in drain(tier)] == [True]
        tier.submit_load(make_job(2, keys, [2, 3], is_promotion=True))
        assert [r.success for r in drain(tier)] == [True]
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
        assert [r.success for r in drain(tier)] == [True]
    finally:
        tier.shutdown()
    (message,) = _io_mode_messages(caplog)
    prefix = f"'fs_python' KV offload tier at {tmp_path / 'fs'}: using "
    if _o_direct_works(str(tmp_path)):
        assert message == prefix + f"O_DIRECT I/O for {mmap.PAGESIZE}-byte blocks"
    else:
        assert message.startswith(prefix + "buffered I/O")
        assert "O_DIRECT I/O is not supported here" in message


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
        if failing["on"] and ".direct_io_probe" in path:
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
        assert tier._direct_io is False
        failing["on"] = False  # space was freed

        # within the interval: still buffered, no probe on the store path
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        assert tier._direct_io is False
        clock.now += 3600  # much later
        tier.submit_store(make_job(2, [key(2), key(3)], [1, 2]))
        assert [r.success for r in _finish(tier)] == [True]
        assert tier._direct_io is True, "still buffered after space was freed"
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
    monkeypatch.setattr(fs_manager, "store_block", disk_full)
    tier = _make_tier(str(tmp_path), np.zeros((8, 4096), dtype=np.uint8))

    def store_jobs(first_job_id: int, n: int) -> None:
        for job_id in range(first_job_id, first_job_id + n):
            keys = [key(2 * job_id), key(2 * job_id + 1)]
            tier.submit_store(make_job(job_id, keys, [0, 1]))
        results = drain(tier)
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


@pytest.fixture(params=["RENAME_NOREPLACE", "look, then rename"])
def publish(request, monkeypatch):
    """Both ways a store publishes its temp file: renameat2 with
    RENAME_NOREPLACE (it looks at the path only when the name is taken),
    and, where the libc, kernel or file system lacks it, a look at the
    path, then a rename."""
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    if request.param == "RENAME_NOREPLACE":
        if getattr(fs_io, "_renameat2", 0) is None:
            pytest.skip("no renameat2 here")
    else:
        monkeypatch.setattr(fs_io, "_renameat2", None, raising=False)
    return request.param


@pytest.fixture(params=["C", "Python"])
def io_path(request, monkeypatch):
    """Both ways the I/O threads store and load a block: fs_io_C
    (csrc/fs_io.cpp, the GIL released once per block) where it is built,
    and Python, which also takes every block C hands back."""
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    if request.param == "C":
        _require_c_path(fs_io)
    else:
        monkeypatch.setattr(fs_io, "fs_io_C", None)
    return request.param


def _require_c_path(fs_io) -> None:
    if getattr(fs_io, "_openat2", None) is None:
        pytest.skip("no openat2 here: fs_io_C is not used")
    assert getattr(fs_io, "fs_io_C", None) is not None, (
        "fs_io_C is not built: CMakeLists.txt's fs_io_C target compiles csrc/fs_io.cpp"
    )


def _python_io_only(monkeypatch) -> None:
    """For a test that injects faults into Python's calls (os.writev, the
    ctypes openat2 and renameat2): blocks take the Python path."""
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    monkeypatch.setattr(fs_io, "fs_io_C", None, raising=False)


class _RecordingFsIoC:
    """fs_io_C with each call's function and result recorded."""

    def __init__(self, real) -> None:
        self.HAVE_OPENAT2 = real.HAVE_OPENAT2
        self.crc32c = real.crc32c
        self.results: list[tuple[str, int]] = []
        for name in ("store_new_block", "load_block"):
            setattr(self, name, self._recording(name, getattr(real, name)))

    def _recording(self, name, function):
        def call(*args):
            rc = function(*args)
            self.results.append((name, rc))
            return rc

        return call


@pytest.fixture
def fs_io_c(monkeypatch) -> _RecordingFsIoC:
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    _require_c_path(fs_io)
    recording = _RecordingFsIoC(fs_io.fs_io_C)
    monkeypatch.setattr(fs_io, "fs_io_C", recording)
    return recording


def test_a_new_block_is_stored_and_loaded_in_c(tmp_path, monkeypatch, fs_io_c):
    """A new block is stored, and loaded, by fs_io_C in one call each: no
    write or read of Python's on the I/O threads (each of those is a GIL
    hand-over among them). Its bytes arrive."""
    written = _io_thread_calls(monkeypatch, ("writev", "readv", "fstat"))
    rows = _aligned_rows(4)
    rows[0] = np.arange(rows.shape[1]) % 251
    tier = _make_tier(str(tmp_path), rows)
    try:
        path = tier.file_mapper.get_file_name(key(1))
        os.makedirs(os.path.dirname(path))
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[1] == rows[0]).all()
        assert fs_io_c.results == [("store_new_block", 0), ("load_block", 0)]
        assert written == [] and _has_io_threads()
        assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
    finally:
        tier.shutdown()


def test_c_hands_a_block_it_cannot_take_to_python(tmp_path, fs_io_c):
    """fs_io_C takes only the common case. A store whose directory is
    missing, or whose name is taken, and a load of a file that is not one
    block (or a symbolic link) go on in Python, which decides as it always
    has: the directory made, a complete file kept, the others failed and
    removed."""
    rows = _aligned_rows(4)
    n = rows.shape[1]
    rows[0] = 7
    tier = _make_tier(str(tmp_path), rows)
    try:
        path = tier.file_mapper.get_file_name(key(1))
        tier.submit_store(make_job(1, [key(1)], [0]))  # no directory yet
        assert [r.success for r in _finish(tier)] == [True]
        assert fs_io_c.results == [("store_new_block", -errno.ENOENT)]
        fs_io_c.results.clear()
        inode = os.stat(path).st_ino
        tier.submit_store(make_job(2, [key(1)], [0]))  # the name is taken
        assert [r.success for r in _finish(tier)] == [True]
        assert fs_io_c.results == [("store_new_block", 1)]
        assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
        assert os.stat(path).st_ino == inode  # kept

        fs_io_c.results.clear()
        with open(path, "r+b") as f:
            f.truncate(n - 1)
        tier.submit_load(make_job(3, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [False]
        assert fs_io_c.results == [("load_block", -errno.EINVAL)]
        assert not os.path.lexists(path)

        fs_io_c.results.clear()
        target = tmp_path / "elsewhere.bin"
        target.write_bytes(bytes(n))
        os.symlink(target, path)
        tier.submit_load(make_job(4, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [False]
        assert fs_io_c.results == [("load_block", -errno.ELOOP)]
        assert target.read_bytes() == bytes(n)
        assert not os.path.lexists(path)  # the link at the block's path: removed

        # a linked directory: the file behind it is not the tier's
        fs_io_c.results.clear()
        block_dir = os.path.dirname(path)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        planted = elsewhere / os.path.basename(path)
        planted.write_bytes(bytes(n))
        os.rmdir(block_dir)
        os.symlink(elsewhere, block_dir)
        tier.submit_load(make_job(5, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [False]
        assert fs_io_c.results == [("load_block", -errno.ELOOP)]
        assert planted.read_bytes() == bytes(n)  # neither read nor removed
    finally:
        tier.shutdown()


def test_a_write_that_fails_in_c_leaves_no_temp_file(tmp_path, fs_io_c):
    """A block whose write fails in C (here the file size limit: EFBIG)
    leaves nothing behind; Python writes it again, fails the same way and
    fails the store: the key is not stored, no temp file is left."""
    import resource
    import signal

    rows = _aligned_rows(4)
    rows[0] = 3
    tier = _make_tier(str(tmp_path), rows)
    try:
        path = tier.file_mapper.get_file_name(key(1))
        os.makedirs(os.path.dirname(path))
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
        try:
            tier.submit_store(make_job(1, [key(1)], [0]))
            results = _finish(tier)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)
        assert [r.success for r in results] == [False]
        assert fs_io_c.results == [("store_new_block", -errno.EFBIG)]
        assert os.listdir(os.path.dirname(path)) == []
        assert tier.lookup(key(1), _CTX) is False
    finally:
        tier.shutdown()


@pytest.mark.parametrize(
    "reason", ["checksum crc32", "checksum in a trailer", "no openat2"]
)
def test_c_is_not_used_where_python_must_decide(
    tmp_path, monkeypatch, fs_io_c, reason, request
):
    """Blocks whose checksum (or MAC) C does not compute or keep - another
    algorithm than crc32c, a trailer on a root without user xattrs - and
    every block where openat2 is not in use (C opens files only with it)
    are stored and loaded in Python."""
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    config = {}
    if reason == "checksum crc32":
        config["checksum"] = "crc32"
    elif reason == "checksum in a trailer":
        request.getfixturevalue("no_user_xattrs")
        config["checksum"] = "crc32c"
    else:
        monkeypatch.setattr(fs_io, "_openat2", None)
    rows = _aligned_rows(4)
    rows[0] = 2
    tier = _make_tier(str(tmp_path), rows, **config)
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[1] == 2).all()
        assert fs_io_c.results == []
    finally:
        tier.shutdown()


def test_crc32c_is_the_castagnoli_crc_of_the_key_then_the_block():
    """The checksum "crc32c" (fs_io_C.crc32c, also what its stores set and
    its loads check): CRC-32C (Castagnoli, as iSCSI and ext4) of the key's
    bytes followed by the block's, 8 bytes little-endian."""
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    if getattr(fs_io, "fs_io_C", None) is None:
        pytest.fail("fs_io_C is not built: CMakeLists.txt's fs_io_C target")
    crc32c = fs_io.fs_io_C.crc32c
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)

    def reference(data: bytes) -> bytes:
        crc = 0xFFFFFFFF
        for b in data:
            crc = (crc >> 8) ^ table[(crc ^ b) & 0xFF]
        return (crc ^ 0xFFFFFFFF).to_bytes(8, "little")

    assert crc32c(b"", b"123456789") == (0xE3069283).to_bytes(8, "little")
    rng = np.random.default_rng(0)
    # through the tail, the short lanes (3 x 256 B) and the long (3 x 8 KiB)
    for n in (0, 7, 767, 768, 24575, 24576 + 769, 65549):
        block = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert crc32c(b"key", block) == reference(b"key" + block), n


def test_blocks_are_checked_in_c_by_default(tmp_path, fs_io_c):
    """Without a 'checksum' setting a block file carries the crc32c of its
    key and bytes in its xattr, set and checked by fs_io_C along with the
    block's I/O; a file overwritten in place with as many bytes fails its
    load in C (EBADMSG), and Python, reading it again, fails it as damaged
    and removes it."""
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    if fs_io.probe_user_xattrs(str(tmp_path)) is not None:
        pytest.skip("no user xattrs here: 'auto' checks nothing")
    rows = _aligned_rows(4)
    rows[0] = np.arange(rows.shape[1]) % 253
    tier = _make_tier(str(tmp_path), rows)
    try:
        assert tier._checksum.algorithm == "crc32c"
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        path = tier.file_mapper.get_file_name(key(1))
        with open(path, "rb") as f:
            stored = f.read()
        assert os.getxattr(path, "user.vllm.kv_checksum") == fs_io_c.crc32c(
            bytes(key(1)), stored
        )
        fs_io_c.results.clear()
        tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[1] == rows[0]).all()
        assert fs_io_c.results == [("load_block", 0)]

        with open(path, "r+b") as f:
            f.write(bytes([stored[0] ^ 1]))
        fs_io_c.results.clear()
        tier.submit_load(make_job(3, [key(1)], [2], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [False]
        assert fs_io_c.results == [("load_block", -errno.EBADMSG)]
        assert not os.path.exists(path)
    finally:
        tier.shutdown()


def test_auto_checks_nothing_on_a_root_without_user_xattrs(
    tmp_path, caplog, no_user_xattrs
):
    """Where the root has no user xattrs, the default ("auto") would cost a
    trailer page per file and keep every block on the Python path: it
    checks nothing instead, and says so at start, naming the setting that
    keeps a checksum in a trailer. Set explicitly, a checksum gets one."""
    rows = _aligned_rows(2)
    with caplog.at_level("WARNING", logger="vllm.v1.kv_offload.tiering.fs"):
        tier = _make_tier(str(tmp_path / "auto"), rows)
    tier.shutdown()
    assert tier._checksum is None
    (line,) = [
        r.getMessage() for r in caplog.records if "not checked" in r.getMessage()
    ]
    assert "Set the tier's 'checksum' to 'crc32c'" in line
    tier = _make_tier(str(tmp_path / "crc32c"), rows, checksum="crc32c")
    tier.shutdown()
    assert tier._checksum.describe() == {"algorithm": "crc32c", "trailer_bytes": 4096}


def test_crc32c_without_fs_io_c_is_refused_naming_the_setting(tmp_path, monkeypatch):
    """checksum "crc32c" where the fs_io_C extension is not built fails at
    start, naming the setting and what to set instead."""
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    monkeypatch.setattr(fs_io, "fs_io_C", None, raising=False)
    with pytest.raises(ValueError, match="set the tier's 'checksum' to 'auto'"):
        _make_tier(str(tmp_path), _aligned_rows(2), checksum="crc32c")


@pytest.mark.parametrize(
    "in_the_way", ["empty file", "short file", "long file", "empty directory"]
)
def test_store_replaces_what_is_not_a_complete_block(tmp_path, in_the_way, publish):
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
        trailer = tier._checksum.trailer_size if tier._checksum else 0
        assert os.path.isfile(path) and os.path.getsize(path) == n + trailer
        tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        np.testing.assert_array_equal(rows[1], rows[0])
    finally:
        tier.shutdown()


def test_a_new_block_is_stored_and_loaded_without_looking_at_its_path(
    tmp_path, monkeypatch, io_path
):
    """The I/O threads store a block whose name is free and load it without
    an lstat of its path or a readlink of its fd: openat2 refuses links in
    the open, RENAME_NOREPLACE publishes only where nothing is. Each
    syscall is a GIL hand-over among the threads. A guard of how, not
    what: the calls are recorded on the pool's threads, by their names."""
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    if None in (getattr(fs_io, "_openat2", 0), getattr(fs_io, "_renameat2", 0)):
        pytest.skip("no openat2 or renameat2 here")
    rows = _aligned_rows(4)
    rows[0] = 3
    tier = _make_tier(str(tmp_path), rows)
    try:
        # the block's directory exists, as in a tier that has run a while
        path = tier.file_mapper.get_file_name(key(1))
        os.makedirs(os.path.dirname(path))
        looked = _io_thread_calls(monkeypatch, ("lstat", "stat", "readlink"))
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[1] == 3).all()
        assert looked == [] and _has_io_threads()
    finally:
        tier.shutdown()


@pytest.mark.parametrize(
    "checksum,second",
    [("none", 5), (None, 4), (None, 5)],
    ids=["none", "same", "other"],
)
def test_a_complete_block_file_already_there_is_kept(
    tmp_path, publish, checksum, second
):
    """A store whose block file is already complete (another engine on the
    same root, or a store that raced a restart) keeps that file, and leaves
    no temp file: with RENAME_NOREPLACE, and where the flag is unsupported.
    Without a checksum, whatever its bytes; with one (the default), if it
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


def test_a_store_on_a_full_disk_keeps_the_block_already_there(
    tmp_path, monkeypatch, publish
):
    """A store of a key whose complete block file is on disk already
    succeeds when the disk is full (ENOSPC writing its temp file): the
    block is there. A store of a new key fails, and leaves no temp file."""
    _python_io_only(monkeypatch)  # the full disk is Python's os.writev
    rows = _aligned_rows(4)
    rows[0] = 6
    tier = _make_tier(str(tmp_path), rows)
    real_writev = os.writev

    def full_disk(fd, buffers):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        monkeypatch.setattr(os, "writev", full_disk)
        tier.submit_store(make_job(2, [key(1), key(2)], [0, 0]))
        (result,) = _finish(tier)
        monkeypatch.setattr(os, "writev", real_writev)
        assert not result.success
        assert list(result.successful_keys) == [key(1)]
        path = tier.file_mapper.get_file_name(key(2))
        assert not [n for n in os.listdir(os.path.dirname(path)) if ".tmp" in n]
        tier.submit_load(make_job(3, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[1] == 6).all()
    finally:
        tier.shutdown()


def test_a_file_system_without_rename_noreplace_is_remembered(tmp_path, monkeypatch):
    """Where renameat2 fails with EINVAL (a file system without
    RENAME_NOREPLACE: NFS, FUSE without rename2), the store looks, then
    renames, and so do the later stores, without trying the flag again."""
    import ctypes

    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    calls = []

    def unsupported(*args):
        calls.append(args)
        ctypes.set_errno(errno.EINVAL)
        return -1

    _python_io_only(monkeypatch)  # C would call the real renameat2
    monkeypatch.setattr(fs_io, "_renameat2", unsupported)
    rows = _aligned_rows(4)
    rows[:2] = 8
    tier = _make_tier(str(tmp_path), rows)
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        tier.submit_store(make_job(2, [key(2)], [1]))
        assert [r.success for r in _finish(tier, 2)] == [True, True]
        assert len(calls) == 1
        assert fs_io._renameat2 is None
        tier.submit_load(make_job(3, [key(1), key(2)], [2, 3], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[2:] == 8).all()
    finally:
        tier.shutdown()


def test_openat2_refused_after_the_probe_falls_back_for_good(tmp_path, monkeypatch):
    """openat2 refused after the start-up probe (ENOSYS: a seccomp filter
    installed later) falls back to open and the /proc/self/fd check, for
    this store and the later ones: no block lost, none served wrong."""
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    calls = []

    def refused(path, flags, mode):
        calls.append(path)
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), path)

    _python_io_only(monkeypatch)  # C would call the real openat2
    monkeypatch.setattr(fs_io, "_openat2", refused)
    rows = _aligned_rows(4)
    rows[0] = 9
    tier = _make_tier(str(tmp_path), rows)
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[1] == 9).all()
        assert len(calls) == 1
        assert fs_io._openat2 is None
    finally:
        tier.shutdown()


@pytest.mark.parametrize("call", ["openat2", "renameat2"])
def test_a_call_the_probe_finds_refused_is_not_used(monkeypatch, call):
    """A call refused at the start-up probe (EPERM or ENOSYS from a seccomp
    filter, an old kernel) is not used: the tier opens or publishes the
    way it replaces."""
    import ctypes

    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    def refused(*args):
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(fs_io, "_libc_function", lambda *args: refused)
    load = fs_io._load_openat2 if call == "openat2" else fs_io._load_renameat2
    assert load() is None


def test_store_fails_for_a_directory_it_cannot_replace(tmp_path):
    """A non-empty directory where a block file should be cannot be replaced:
    the store fails for that key only, instead of reporting it stored."""
    rows = _aligned_rows(4)
    tier = _make_tier(str(tmp_path), rows)
    try:
        path = tier.file_mapper.get_file_name(key(1))
        os.makedirs(os.path.join(path, "not_a_block"))
        tier.submit_store(make_job(1, [key(0), key(1)], [0, 1]))
        (result,) = _finish(tier)
        assert not result.success
        assert list(result.successful_keys) == [key(0)]
        assert os.path.isdir(os.path.join(path, "not_a_block"))
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


def test_a_failed_load_removes_only_the_file_it_read(tmp_path, monkeypatch):
    """Another engine sharing the root stores a block anew (renames a whole
    file into place) between a load's look at the damaged file it replaces
    and that load's removal of it: the new file is left alone."""
    import shutil
    import stat

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
        "xxh3_64",
        "crc32",
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
@pytest.mark.parametrize("where", ["xattr", "trailer"])
def test_load_fails_for_a_block_file_overwritten_in_place(
    tmp_path, damage, checksum, where, caplog, request
):
    """With a checksum, a block file overwritten with as many bytes as it had
    (random bytes, a flipped bit, a zeroed half, another key's block file,
    or another writer's file of that size renamed over it) is not served as
    the key's block: its load fails (the key becomes a miss, the file is
    removed) with one report naming the path, and the job's other keys
    load. The same whether the checksum is in the file's extended attribute
    or, on a root without user xattrs, in a trailer."""
    if checksum == "xxh3_64":
        pytest.importorskip("xxhash")
    if where == "trailer":
        if checksum is None:
            pytest.skip("the default checks nothing without user xattrs")
        request.getfixturevalue("no_user_xattrs")
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
        assert len(lines) == 1 and "checksum mismatch" in lines[0]
    finally:
        tier.shutdown()


@pytest.mark.parametrize("block_bytes", [4096, 1280], ids=["aligned", "odd"])
def test_checksum_in_an_xattr_else_in_a_trailer(tmp_path, caplog, block_bytes, request):
    """The checksum is kept in the block file's extended attribute
    user.vllm.kv_checksum, so that the file holds exactly the block; on a
    root without user xattrs (probed once at start, said once in the log)
    it is written in a trailer after the block instead: a page for
    page-aligned blocks (O_DIRECT), else its 8 bytes. Either round-trips."""
    rows = np.zeros((4, block_bytes), dtype=np.uint8)
    rows[0] = np.arange(block_bytes) % 251
    for where in ("xattr", "trailer"):
        if where == "trailer":
            request.getfixturevalue("no_user_xattrs")
        root = str(tmp_path / where)
        caplog.clear()
        with caplog.at_level("INFO", logger="vllm.v1.kv_offload.tiering.fs"):
            tier = _make_tier(root, rows, checksum="crc32")
        try:
            tier.submit_store(make_job(1, [key(1)], [0]))
            assert [r.success for r in _finish(tier)] == [True]
            path = tier.file_mapper.get_file_name(key(1))
            trailers = [r.getMessage() for r in caplog.records if "trailer" in r.msg]
            if where == "xattr":
                assert os.path.getsize(path) == block_bytes
                assert len(os.getxattr(path, "user.vllm.kv_checksum")) == 8
                assert trailers == []
            else:
                trailer = 4096 if block_bytes == 4096 else 8
                assert os.path.getsize(path) == block_bytes + trailer
                (line,) = trailers
                assert line == (
                    f"'fs_python' KV offload tier at {root}: keeping each "
                    "block's checksum in a trailer after the block because "
                    "user extended attributes are not supported here ([Errno "
                    "95] Operation not supported)"
                )
            tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
            assert [r.success for r in _finish(tier)] == [True]
            np.testing.assert_array_equal(rows[1], rows[0])
            rows[1] = 0
        finally:
            tier.shutdown()


@pytest.mark.parametrize("xattr", ["removed", "another block's"])
def test_a_block_file_without_its_checksum_is_written_again(tmp_path, xattr):
    """A block file copied or restored without its extended attributes (cp,
    rsync without -X), or with another block's checksum, has the right size
    but not this block's checksum: a store of its key writes it again,
    instead of keeping a file whose load would fail."""
    rows = _aligned_rows(4)
    rows[0] = 7
    tier = _make_tier(str(tmp_path), rows, checksum="crc32")
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        path = tier.file_mapper.get_file_name(key(1))
        stored = os.getxattr(path, "user.vllm.kv_checksum")
        if xattr == "removed":
            os.removexattr(path, "user.vllm.kv_checksum")
        else:
            os.setxattr(path, "user.vllm.kv_checksum", bytes(8))
        tier.submit_store(make_job(2, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        assert os.getxattr(path, "user.vllm.kv_checksum") == stored
        tier.submit_load(make_job(3, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[1] == 7).all()
    finally:
        tier.shutdown()


@pytest.mark.parametrize("expected", ["crc32c", "xxh3_64", "crc32"])
def test_checksum_auto_is_recorded_as_the_algorithm_it_chose(
    tmp_path, monkeypatch, expected
):
    """checksum "auto" is crc32c where the fs_io_C extension is built, else
    xxh3_64 where the xxhash package imports, else crc32, and config.json
    records the algorithm chosen: an engine that chose another one uses
    other files, never misreads these."""
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    if expected == "crc32c":
        _require_c_path(fs_io)
    else:
        monkeypatch.setattr(fs_io, "fs_io_C", None, raising=False)
    if expected == "xxh3_64":
        pytest.importorskip("xxhash")
    elif expected == "crc32":
        monkeypatch.setattr(fs_io, "xxhash", None)
    rows = _aligned_rows(2)
    tier = _make_tier(str(tmp_path), rows, checksum="auto")
    try:
        with open(tier.file_mapper.get_config_file_path()) as f:
            assert expected in json.dumps(json.load(f))
        assert tier._checksum.algorithm == expected
        rows[0] = 3
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in _finish(tier)] == [True]
        tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
        assert [r.success for r in _finish(tier)] == [True]
        assert (rows[1] == 3).all()
    finally:
        tier.shutdown()


def test_xattr_and_trailer_files_never_mix(tmp_path, monkeypatch):
    """Where the checksum is kept is part of the file layout (config.json):
    blocks stored with it in an xattr are not looked up by a tier on the
    same root without user xattrs (it would read them as blocks with a
    trailer), nor the other way round; each finds its own again."""
    rows = _aligned_rows(4)
    rows[0] = 5
    tier = _make_tier(str(tmp_path), rows, checksum="crc32")
    tier.submit_store(make_job(1, [key(1)], [0]))
    assert [r.success for r in _finish(tier)] == [True]
    tier.shutdown()
    xattr_base = tier.file_mapper.base_path
    with open(tier.file_mapper.get_config_file_path()) as f:
        assert json.load(f)["checksum"] == {
            "algorithm": "crc32",
            "xattr": "user.vllm.kv_checksum",
        }

    with monkeypatch.context() as mp:
        _refuse_user_xattrs(mp)
        tier = _make_tier(str(tmp_path), rows, checksum="crc32")
        try:
            assert tier.file_mapper.base_path != xattr_base
            with open(tier.file_mapper.get_config_file_path()) as f:
                assert json.load(f)["checksum"] == {
                    "algorithm": "crc32",
                    "trailer_bytes": 4096,
                }
            assert tier.lookup(key(1), _CTX) is False
            rows[1] = 6
            tier.submit_store(make_job(2, [key(2)], [1]))
            assert [r.success for r in _finish(tier)] == [True]
        finally:
            tier.shutdown()

    tier = _make_tier(str(tmp_path), rows, checksum="crc32")
    try:
        assert tier.file_mapper.base_path == xattr_base
        assert tier.lookup(key(1), _CTX) is True
        assert tier.lookup(key(2), _CTX) is False
    finally:
        tier.shutdown()


def test_checksum_is_part_of_the_file_layout(tmp_path):
    """Files with a checksum live apart from files without one (or with
    another), so that no file is read in a format it was not written in;
    the default is "auto". An unknown checksum is refused naming the
    setting."""
    rows = _aligned_rows(2)
    base_paths = {}
    for config in (
        {},
        {"checksum": "auto"},
        {"checksum": "none"},
        {"checksum": "crc32"},
    ):
        tier = _make_tier(str(tmp_path), rows, **config)
        tier.shutdown()
        base_paths[config.get("checksum", "default")] = tier.file_mapper.base_path
    assert base_paths["default"] == base_paths["auto"]
    assert len({base_paths[c] for c in ("auto", "none", "crc32")}) == 3
    with pytest.raises(ValueError, match="set 'checksum' to one of"):
        _make_tier(str(tmp_path), rows, checksum="md5")


def test_tier_recreates_its_config_when_its_root_is_removed(tmp_path, caplog):
    """The tier's root directory removed while it runs (an operator cleaning
    up, a tmpfs remounted): the next stores re-create the block directories
    and also config.json, which says what the files are; it is not left
    missing for the rest of the process."""
    import json
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
            if "could not re-create" in r.getMessage()
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
