# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fs tier's checksum_blocks option (upstream #57912's shape): each block
file's CRC32C in an extended attribute, checked on load, so that a block whose
bytes changed at the same size is a miss instead of being loaded as KV. Real
files on disk; the tier driven as the tiering manager drives it, and through
the real connector scheduler."""

import contextlib
import errno
import json
import mmap
import os
import threading
import time

import numpy as np
import pytest
import torch

import vllm.v1.kv_offload.tiering.fs.io as io_mod
from tests.v1.kv_offload.tiering.test_fs_tier import (
    _make_offloading_spec,
    key,
    make_job,
)
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
    RequestOffloadState,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.async_lookup import LookupPhase
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

# The on-disk and metric names (upstream #57912's), spelled out: they are
# formats others read.
CRC_XATTR = "user.vllm.kv_crc32c"
CHECKSUM_FAILURES = "vllm:kv_offload_tiering_checksum_failures"
_CTX = ReqContext(req_id="test")


def rows(n_rows: int) -> np.ndarray:
    """Page-aligned rows of one page each, so that O_DIRECT can be used."""
    region = mmap.mmap(-1, n_rows * mmap.PAGESIZE)
    return np.frombuffer(region, dtype=np.uint8).reshape(n_rows, mmap.PAGESIZE)


def make_tier(root_dir, kv_rows: np.ndarray, **config) -> FileSystemTierManager:
    view = memoryview(kv_rows)
    spec = _make_offloading_spec()
    return FileSystemTierManager(spec, view, "fs", str(root_dir), 1, 1, **config)


def finish(tier: FileSystemTierManager) -> list:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def lookup(tier: FileSystemTierManager, k) -> LookupResult:
    """A full async lookup cycle of one key, with no verdict cached."""
    tier.on_request_finished(_CTX)
    tier.lookup(k, _CTX)
    tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
    deadline = time.monotonic() + 10
    while (result := tier.lookup(k, _CTX)) is LookupResult.RETRY:
        assert time.monotonic() < deadline, "the lookup did not resolve"
        time.sleep(0.01)
        tier._lookup_manager.drain_results()
    return result


def checksum_failures(tier: FileSystemTierManager) -> int:
    """The checksum failures get_stats() reports (a delta per report)."""
    stats = tier.get_stats()
    assert stats is not None
    return stats.data["data"][CHECKSUM_FAILURES][("fs",)]


def crc32c(data: bytes) -> bytes:
    return io_mod.crc32c(memoryview(data))


@pytest.fixture(params=[True, False], ids=["c_ext", "python"])
def io_path(request, monkeypatch):
    """Both I/O paths: the fs_io_C extension and the Python fallback."""
    if request.param and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", request.param)
    return request.param


def test_crc32c_is_castagnoli():
    # the check value of CRC-32C (iSCSI, RFC 3720), little-endian
    assert crc32c(b"123456789") == (0xE3069283).to_bytes(4, "little")


def test_a_changed_block_is_a_miss_removed_and_counted(tmp_path, io_path):
    """A block changed at the same size fails its load and is removed, the
    blocks before it in the job load, and the failure is counted."""
    kv = rows(6)
    kv[0], kv[1], kv[2] = 1, 2, 3
    keys = [key(1), key(2), key(3)]
    tier = make_tier(tmp_path / "kv", kv, checksum_blocks=True)
    try:
        tier.submit_store(make_job(1, keys, [0, 1, 2]))
        assert [r.success for r in finish(tier)] == [True]
        paths = [tier.file_mapper.get_file_name(k) for k in keys]
        for path, value in zip(paths, (1, 2, 3)):
            assert os.getxattr(path, CRC_XATTR) == crc32c(bytes([value]) * kv.shape[1])
        with open(paths[2], "r+b") as f:
            f.seek(100)
            f.write(b"x")  # one byte, same size
        assert checksum_failures(tier) == 0

        tier.submit_load(make_job(2, keys, [3, 4, 5], is_promotion=True))
        (result,) = finish(tier)
        assert not result.success, "a changed block was loaded as KV"
        assert result.successful_keys == (keys[0], keys[1])
        assert (kv[3] == 1).all() and (kv[4] == 2).all()
        assert not os.path.exists(paths[2])
        assert os.path.exists(paths[0]) and os.path.exists(paths[1])
        assert lookup(tier, keys[2]) is LookupResult.MISS
        assert checksum_failures(tier) == 1
        assert checksum_failures(tier) == 0  # a delta per report
    finally:
        tier.shutdown()


def test_a_block_without_a_crc_is_a_miss_then_stored_anew(tmp_path, io_path):
    """Turning checksum_blocks on for an existing cache: its blocks have no
    CRC32C, so they cannot be checked and are misses (removed, counted)
    rather than loaded unchecked; a store of the key replaces a file without
    its CRC32C (it is not kept as stored), and the block then loads."""
    kv = rows(4)
    kv[0] = 5
    root = tmp_path / "kv"
    tier = make_tier(root, kv)
    try:
        tier.submit_store(make_job(1, [key(1), key(2)], [0, 0]))
        assert [r.success for r in finish(tier)] == [True]
        path_1, path_2 = (tier.file_mapper.get_file_name(k) for k in (key(1), key(2)))
    finally:
        tier.shutdown()

    tier = make_tier(root, kv, checksum_blocks=True)
    try:
        tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
        assert [r.success for r in finish(tier)] == [False]
        assert not os.path.exists(path_1)
        assert lookup(tier, key(1)) is LookupResult.MISS
        assert checksum_failures(tier) == 1
        tier.submit_store(make_job(3, [key(2)], [0]))
        assert [r.success for r in finish(tier)] == [True]
        assert os.getxattr(path_2, CRC_XATTR) == crc32c(bytes(kv[0]))
        tier.submit_load(make_job(4, [key(2)], [2], is_promotion=True))
        assert [r.success for r in finish(tier)] == [True]
        assert (kv[2] == 5).all()
    finally:
        tier.shutdown()


def test_without_checksum_blocks_no_xattr_call_is_made(tmp_path, monkeypatch):
    """Off (the default): no xattr call is made (on the Python I/O path,
    where os's calls can be counted); as before the option, a block whose
    bytes changed at the same size is loaded as KV."""
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", False)
    calls: list[tuple] = []
    for name in ("getxattr", "setxattr", "listxattr", "removexattr"):
        monkeypatch.setattr(os, name, lambda *args, **kw: calls.append(args))
    kv = rows(4)
    kv[0] = 9
    tier = make_tier(tmp_path / "kv", kv)
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in finish(tier)] == [True]
        path = tier.file_mapper.get_file_name(key(1))
        with open(path, "r+b") as f:
            f.write(b"\x0a")  # one byte, same size
        tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
        assert [r.success for r in finish(tier)] == [True]
        assert kv[1][0] == 0x0A and (kv[1][1:] == 9).all()
        assert calls == []
        assert tier.get_stats() is None
    finally:
        tier.shutdown()


def test_checksum_blocks_setting(tmp_path):
    defs = FileSystemTierManager.build_metric_definitions
    assert CHECKSUM_FAILURES in defs({"checksum_blocks": True})
    assert CHECKSUM_FAILURES not in defs({})
    with pytest.raises(ValueError, match="checksum_blocks of the 'fs' tier must be"):
        make_tier(tmp_path / "kv", rows(2), checksum_blocks="yes")


def test_a_root_without_extended_attributes_is_refused(tmp_path, monkeypatch):
    """Each block's CRC32C lives in an extended attribute: a root whose
    filesystem has none is refused at start with the setting and the fix,
    before any thread starts, rather than failing every store."""

    def no_xattrs(*args, **kwargs):
        raise OSError(errno.ENOTSUP, os.strerror(errno.ENOTSUP))

    monkeypatch.setattr(os, "setxattr", no_xattrs)
    threads = set(threading.enumerate())
    with pytest.raises(ValueError) as refused:
        make_tier(tmp_path / "kv", rows(2), checksum_blocks=True)
    assert set(threading.enumerate()) <= threads, "refused after starting threads"
    message = str(refused.value)
    assert "checksum_blocks of the 'fs' tier needs user extended" in message
    assert "each block's CRC32C is kept in one" in message
    assert "Fix: use a root_dir on a filesystem with user xattrs" in message
    assert "or set checksum_blocks to false" in message


def test_checksummed_blocks_take_the_compiled_io_path(tmp_path, monkeypatch):
    """With fs_io_C, stores and loads with checksum_blocks run in C (the
    CRC32C computed with the GIL released), as unchecked ones do: the Python
    per-block store and load are never called."""
    if not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    python_calls: list[str] = []
    monkeypatch.setattr(io_mod, "_store_block", lambda *a: python_calls.append("s"))
    monkeypatch.setattr(io_mod, "_load_block", lambda *a: python_calls.append("l"))
    kv = rows(4)
    kv[0] = 5
    tier = make_tier(tmp_path / "kv", kv, checksum_blocks=True)
    try:
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in finish(tier)] == [True]
        tier.submit_load(make_job(2, [key(1)], [1], is_promotion=True))
        assert [r.success for r in finish(tier)] == [True]
        assert python_calls == [], "checksummed blocks took the Python I/O path"
        assert (kv[1] == 5).all()
        path = tier.file_mapper.get_file_name(key(1))
        assert os.getxattr(path, CRC_XATTR) == crc32c(bytes(kv[0]))
    finally:
        tier.shutdown()


@pytest.mark.parametrize("row_pages", [1, 17])
@pytest.mark.parametrize("stored_by", ["c_ext", "python"])
def test_the_c_and_python_paths_agree_on_the_crc32c(
    tmp_path, monkeypatch, stored_by, row_pages
):
    """A block stored by one I/O path loads on the other (engines of one
    root may differ in whether fs_io_C is built), and a changed one fails on
    the other too; at one page and at 17 (the C path's three interleaved
    lanes, combined, and a tail)."""
    if not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    row_bytes = row_pages * mmap.PAGESIZE
    region = mmap.mmap(-1, 4 * row_bytes)
    kv = np.frombuffer(region, dtype=np.uint8).reshape(4, row_bytes)
    kv[0] = np.arange(row_bytes) % 251
    kv[1] = 7
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", stored_by == "c_ext")
    tier = make_tier(tmp_path / "kv", kv, checksum_blocks=True)
    try:
        tier.submit_store(make_job(1, [key(1), key(2)], [0, 1]))
        assert [r.success for r in finish(tier)] == [True]
        changed = tier.file_mapper.get_file_name(key(2))
        assert os.getxattr(changed, CRC_XATTR) == crc32c(bytes(kv[1]))
        with open(changed, "r+b") as f:
            f.write(b"\x08")
        monkeypatch.setattr(io_mod, "_HAS_FSIO_C", stored_by != "c_ext")
        tier.submit_load(make_job(2, [key(1), key(2)], [2, 3], is_promotion=True))
        (result,) = finish(tier)
        assert result.successful_keys == (key(1),)
        assert (kv[2] == kv[0]).all()
        assert not os.path.exists(changed)
        assert checksum_failures(tier) == 1
    finally:
        tier.shutdown()


# ---------------------------------------------------------------------------
# Through the real connector scheduler (a one-group, Llama-like model)
# ---------------------------------------------------------------------------


@pytest.fixture
def connector_scheduler(tmp_path):
    """Real OffloadingConnectorSchedulers (a tiny local Llama config) over
    one fs root with checksum_blocks; block hashes sha256, as the engine's."""
    from vllm.v1.core import kv_cache_utils

    saved_none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    init_none_hash(sha256)
    (tmp_path / "model").mkdir()
    hf_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (tmp_path / "model/config.json").write_text(json.dumps(hf_config))
    fs_tier = {"type": "fs", "root_dir": str(tmp_path / "fs"), "n_read_threads": 2}
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20}
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(tmp_path / "model"), skip_tokenizer_init=True, dtype="float16"
        ),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra
            | {"secondary_tiers": [fs_tier | {"checksum_blocks": True}]},
        ),
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.kv_cache_layout = "LBNHC"
    attn = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=256,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0", "layer.1"], attn)],
        hash_block_size=16,
    )

    def make() -> OffloadingConnectorScheduler:
        config = build_offloading_config(vllm_config, kv_cache_config)
        spec = TieringOffloadingSpec(config)
        return OffloadingConnectorScheduler(spec, vllm_config, kv_cache_config)

    yield make
    assert vllm_config.kv_transfer_config is not None
    engine_id = vllm_config.kv_transfer_config.engine_id
    with contextlib.suppress(FileNotFoundError):
        os.remove(f"/dev/shm/vllm_offload_{engine_id}.mmap")
    if saved_none_hash is not None:
        kv_cache_utils.NONE_HASH = saved_none_hash


def _cpu_rows(manager) -> np.ndarray:
    return np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)


def _finish_tier_io(manager) -> None:
    """Wait for the fs tier's transfers and file lookups of the last step."""
    deadline = time.monotonic() + 30
    with manager.lock:
        (tier,) = manager.secondary_tiers
        tier.drain_jobs()
        lookups = tier._lookup_manager  # type: ignore[attr-defined]
        while True:
            lookups.drain_results()
            states = lookups._lookup_state.values()
            if all(s.phase is not LookupPhase.IN_FLIGHT for s in states):
                break
            assert time.monotonic() < deadline, "timed out waiting for tier I/O"
            time.sleep(0.001)


def _end_step(sched: OffloadingConnectorScheduler, loads: dict) -> None:
    """An engine step's end: the workers run its load jobs (whose CPU rows
    must hold what was stored) and report them done; the fs tier's I/O."""
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert isinstance(meta, OffloadingConnectorMetadata)
    rows = _cpu_rows(sched.manager)
    assert sorted(job.req_id for job in meta.load_jobs.values()) == sorted(loads)
    worker_meta = OffloadingWorkerMetadata()
    for job_id, job in meta.load_jobs.items():
        assert isinstance(job.src_spec, CPULoadStoreSpec)
        chunk_ids = job.src_spec.chunk_ids
        assert len(chunk_ids) == loads[job.req_id]  # the first chunks, in order
        for i, chunk_id in enumerate(chunk_ids):
            assert (rows[chunk_id] == i + 1).all()
        worker_meta.mark_completed(job_id)
    sched.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=worker_meta)
    )
    _finish_tier_io(sched.manager)


def test_a_changed_block_on_disk_is_never_loaded_as_kv(connector_scheduler):
    """A previous engine stored a request's four chunks to disk, then one
    byte of its third chunk's file changed. A cold engine with
    checksum_blocks looks the request up, promotes its chunks from the fs
    tier, and reports a hit of the first two chunks only; the load job reads
    the right bytes of them; nothing stays pinned."""
    tokens = [(7 * i) % 500 for i in range(4 * 16 + 5)]
    hasher = get_request_block_hasher(16, sha256)
    request = Request("req0", tokens, SamplingParams(), None, block_hasher=hasher)
    sched = connector_scheduler()
    manager = sched.manager
    # the previous engine: stores every chunk, cascaded to the fs tier
    ctx = ReqContext(request.request_id)
    state = RequestOffloadState(sched.config, request, ctx, None)  # type: ignore[arg-type]
    state.update_offload_keys()
    (group,) = state.group_states
    keys = list(group.offload_keys)
    assert len(keys) == 4
    with manager.lock:
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
        assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)
        for i, chunk_id in enumerate(out.store_spec.chunk_ids):
            _cpu_rows(manager)[chunk_id] = i + 1  # the GPU->CPU copy
        manager.complete_store(keys, ctx)  # cascades to the fs tier
        manager.on_request_finished(ctx)
    for _ in range(2):  # steps: the cascade's completion is processed
        _finish_tier_io(manager)
        with manager.lock:
            manager.on_schedule_end(ScheduleEndContext((), ()))
    sched.shutdown()

    sched = connector_scheduler()  # cold: an empty CPU tier
    manager = sched.manager
    try:
        (fs_tier,) = manager.secondary_tiers
        assert isinstance(fs_tier, FileSystemTierManager)
        paths = [fs_tier.file_mapper.get_file_name(k) for k in keys]
        assert all(len(os.getxattr(p, CRC_XATTR)) == 4 for p in paths)
        with open(paths[2], "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0xFF]))

        sched.on_new_request(request)
        for _ in range(4):  # lookup, promotion, a failed promotion's retry
            num_hit_tokens, _ = sched.get_num_new_matched_tokens(request, 0)
            if num_hit_tokens is not None:
                break
            _end_step(sched, {})
        assert num_hit_tokens == 2 * 16, "a changed block was loaded as KV"
        blocks = [KVCacheBlock(1000 + i) for i in range(2)]
        sched.update_state_after_alloc(request, KVCacheBlocks((blocks,)), 32)
        _end_step(sched, {request.request_id: 2})
        chunks = manager.primary_tier._policy.chunks.values()  # type: ignore[attr-defined]
        assert all(c.ref_cnt == 0 for c in chunks)
        assert not os.path.exists(paths[2])
    finally:
        sched.shutdown()
