# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fs tier's checksum_blocks option (upstream #57912's shape): each block
file carries the CRC32C of its bytes in an extended attribute, set before the
rename and checked after each load, so that a block whose bytes changed at the
same size (bit rot, a torn copy) is a miss instead of being loaded as KV.

- a changed block, or one without a CRC32C, fails its load and is removed;
  the job's other blocks are kept; it is counted in the rate-limited failure
  report and in the tier's checksum failure metric;
- the C and the Python I/O paths write and check the same CRC32C;
- off (the default), no CRC or xattr call is made;
- with key_file, the MAC checks the bytes: no CRC32C is stored;
- a root without user extended attributes is refused at start;
- through the real connector scheduler, a cold engine's request hits only
  the chunks before a changed one.

Real files on disk throughout; the tier is driven as the tiering manager
drives it (submit_store / submit_load / get_finished_jobs / lookup).
"""

import errno
import mmap
import os
import threading

import numpy as np
import pytest

import vllm.v1.kv_offload.tiering.fs.io as io_mod
from tests.v1.kv_offload.test_tiering_hma import (  # noqa: F401 (fixtures)
    _COLD_SETTLE_STEPS,
    Engine,
    _remove_shm_regions,
    _sha256_block_hashes,
    allocate,
    end_step,
    group_keys,
    model_config,
    ref_cnts,
    store_requests,
    tiering_manager,
)
from tests.v1.kv_offload.tiering.test_fs_tier_security import (
    _failure_lines,
    assert_blocks_take_the_compiled_io_path,
    finish,
    job,
    key,
    key_file,
    lookup,
    lookup_again,
    make_tier,
    rows,
)
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

# The on-disk and metric names (upstream #57912's xattr), spelled out: they
# are formats others read.
CRC_XATTR = "user.vllm.kv_crc32c"
MAC_XATTR = "user.vllm.kv_mac"  # key_file's
CHECKSUM_FAILURES = "vllm:kv_offload_tiering_checksum_failures"


def crc32c(data) -> bytes:
    return io_mod.crc32c(memoryview(data))


@pytest.fixture(params=[True, False], ids=["c_ext", "python"])
def io_path(request, monkeypatch):
    """Both I/O paths: the fs_io_C extension and the Python fallback."""
    if request.param and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", request.param)
    return request.param


def checksum_failures(tier: FileSystemTierManager) -> int:
    """The checksum failures get_stats() reports (a delta per report)."""
    stats = tier.get_stats()
    assert stats is not None
    return stats.data["data"][CHECKSUM_FAILURES][("fs",)]


def test_crc32c_is_castagnoli():
    # the check value of CRC-32C (iSCSI, RFC 3720), little-endian
    assert crc32c(b"123456789") == (0xE3069283).to_bytes(4, "little")


def test_a_changed_block_or_one_without_a_crc_is_a_miss(tmp_path, caplog_vllm, io_path):
    """A block file whose bytes changed at the same size, or whose CRC32C
    attribute is gone (a copy without xattrs), fails its load and is removed;
    the other block of the same load is kept. Both are counted: in the
    failure report and in the checksum failure metric. Without the option
    (v0.34.0) the changed block loads as KV: the tier has no such option."""
    kv = rows(6)
    kv[0], kv[1], kv[2] = 1, 2, 3
    keys = [key(1), key(2), key(3)]
    tier = make_tier(tmp_path / "kv", kv, checksum_blocks=True)
    try:
        assert CHECKSUM_FAILURES in FileSystemTierManager.build_metric_definitions(
            {"checksum_blocks": True}
        )
        tier.submit_store(job(1, keys, [0, 1, 2]))
        assert finish(tier) == [True]
        changed, stripped, intact = (tier.file_mapper.get_file_name(k) for k in keys)
        for path, value in zip((changed, stripped, intact), (1, 2, 3)):
            expected = crc32c(bytes([value]) * kv.shape[1])
            assert os.getxattr(path, CRC_XATTR) == expected
        with open(changed, "r+b") as f:
            f.seek(100)
            f.write(b"x")  # one byte, same size
        os.removexattr(stripped, CRC_XATTR)
        assert checksum_failures(tier) == 0

        caplog_vllm.clear()
        tier.submit_load(job(2, keys, [3, 4, 5], load=True))
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        assert not result.success, "a changed block was loaded as KV"
        assert result.successful_keys == (keys[2],)
        assert (kv[5] == 3).all()
        assert not os.path.exists(changed) and not os.path.exists(stripped)
        assert os.path.exists(intact)
        assert lookup_again(tier, keys[0]) is LookupResult.MISS
        assert lookup_again(tier, keys[2]) is LookupResult.HIT
        (line,) = _failure_lines(caplog_vllm)
        assert "0 store job(s) and 1 load job(s) failed" in line
        assert "2 not loaded and recomputed (2 of them failed the integrity" in line
        assert "CRC32C mismatch, or none recorded" in line
        assert checksum_failures(tier) == 2
        assert checksum_failures(tier) == 0  # a delta per report
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
    kv = np.frombuffer(mmap.mmap(-1, 4 * row_bytes), dtype=np.uint8).reshape(
        4, row_bytes
    )
    kv[0] = np.arange(row_bytes) % 251
    kv[1] = 7
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", stored_by == "c_ext")
    tier = make_tier(tmp_path / "kv", kv, checksum_blocks=True)
    try:
        tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
        assert finish(tier) == [True]
        with open(tier.file_mapper.get_file_name(key(2)), "r+b") as f:
            f.write(b"\x08")
        monkeypatch.setattr(io_mod, "_HAS_FSIO_C", stored_by != "c_ext")
        tier.submit_load(job(2, [key(1), key(2)], [2, 3], load=True))
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        assert result.successful_keys == (key(1),)
        assert (kv[2] == kv[0]).all()
    finally:
        tier.shutdown()


def test_checksummed_blocks_take_the_compiled_io_path(tmp_path, monkeypatch):
    """With fs_io_C, stores and loads with checksum_blocks run in C (the
    CRC32C computed with the GIL released), as unchecked ones do: the Python
    per-block store and load are never called."""
    assert_blocks_take_the_compiled_io_path(
        tmp_path, monkeypatch, "checksummed", checksum_blocks=True
    )


def test_blocks_stored_without_checksums_are_misses_then_stored_anew(tmp_path, io_path):
    """Turning checksum_blocks on for an existing cache: its blocks have no
    CRC32C, so they cannot be checked and are misses (removed) rather than
    loaded unchecked; a store of the key replaces a file without its CRC32C
    (it is not kept as stored), and the block then loads."""
    kv = rows(4)
    kv[0] = 5
    root = tmp_path / "kv"
    tier = make_tier(root, kv)
    try:
        tier.submit_store(job(1, [key(1), key(2)], [0, 0]))
        assert finish(tier) == [True]
        path_1, path_2 = (tier.file_mapper.get_file_name(k) for k in (key(1), key(2)))
        assert os.listxattr(path_1) == []
    finally:
        tier.shutdown()

    tier = make_tier(root, kv, checksum_blocks=True)
    try:
        assert lookup(tier, key(1)) is LookupResult.HIT
        tier.submit_load(job(2, [key(1)], [1], load=True))
        assert finish(tier) == [False]
        assert not os.path.exists(path_1)
        # the store does not keep the complete file without its CRC32C
        tier.submit_store(job(3, [key(2)], [0]))
        assert finish(tier) == [True]
        assert os.getxattr(path_2, CRC_XATTR) == crc32c(kv[0])
        tier.submit_load(job(4, [key(2)], [2], load=True))
        assert finish(tier) == [True]
        assert (kv[2] == 5).all()
    finally:
        tier.shutdown()


def test_without_checksum_blocks_no_xattr_call_is_made(tmp_path, monkeypatch, io_path):
    """Off (the default): stores set no attribute, and loads read none (the
    Python path: no xattr call at all; both paths: a file whose CRC32C does
    not match its bytes still loads). As on v0.34.0, a block whose bytes
    changed at the same size is then loaded as KV."""
    calls: list[str] = []

    def counted(name):
        real = getattr(os, name)

        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return call

    for name in ("getxattr", "setxattr", "listxattr", "removexattr"):
        monkeypatch.setattr(os, name, counted(name))
    kv = rows(4)
    kv[0] = 9
    tier = make_tier(tmp_path / "kv", kv)
    try:
        tier.submit_store(job(1, [key(1)], [0]))
        assert finish(tier) == [True]
        path = tier.file_mapper.get_file_name(key(1))
        monkeypatch.undo()  # os's own functions for the checks below
        monkeypatch.setattr(io_mod, "_HAS_FSIO_C", io_path)
        # fs_io_C makes its xattr calls in C, where os.* cannot count them:
        # there the attribute list and the load below are what is checked
        if not io_path:
            assert calls == []
        assert os.listxattr(path) == []
        os.setxattr(path, CRC_XATTR, b"\x00\x00\x00\x00")
        with open(path, "r+b") as f:
            f.write(b"\x0a")  # one byte, same size
        for name in ("getxattr", "setxattr", "listxattr", "removexattr"):
            monkeypatch.setattr(os, name, counted(name))
        tier.submit_load(job(2, [key(1)], [1], load=True))
        assert finish(tier) == [True]
        assert kv[1][0] == 0x0A and (kv[1][1:] == 9).all()
        if not io_path:
            assert calls == []
    finally:
        tier.shutdown()
    assert CHECKSUM_FAILURES not in FileSystemTierManager.build_metric_definitions({})


def test_with_key_file_the_mac_checks_the_blocks(tmp_path, caplog_vllm, io_path):
    """key_file and checksum_blocks together: the block's HMAC-SHA256 already
    checks its bytes (and cannot be forged, unlike a CRC32C), so no CRC32C is
    stored, and a changed block fails its MAC: a miss, counted in the
    checksum failure metric too."""
    kv = rows(4)
    kv[0] = 4
    tier = make_tier(
        tmp_path / "kv", kv, key_file=key_file(tmp_path / "key"), checksum_blocks=True
    )
    try:
        assert any(
            "checksum_blocks is covered by key_file" in r.getMessage()
            for r in caplog_vllm.records
        )
        tier.submit_store(job(1, [key(1), key(2)], [0, 0]))
        assert finish(tier) == [True]
        changed = tier.file_mapper.get_file_name(key(1))
        assert sorted(os.listxattr(changed)) == [MAC_XATTR]
        with open(changed, "r+b") as f:
            f.write(b"\x05")
        tier.submit_load(job(2, [key(1), key(2)], [1, 2], load=True))
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        assert result.successful_keys == (key(2),)
        assert not os.path.exists(changed)
        assert checksum_failures(tier) == 1
    finally:
        tier.shutdown()


def test_a_root_without_extended_attributes_is_refused(tmp_path, monkeypatch):
    """Each block's CRC32C lives in an extended attribute: a root whose
    filesystem has none is refused at start with the setting and the fix,
    before any thread starts or file is written (before: config.json was),
    rather than failing every store."""

    def no_xattrs(*args, **kwargs):
        raise OSError(errno.ENOTSUP, os.strerror(errno.ENOTSUP))

    monkeypatch.setattr(os, "setxattr", no_xattrs)
    threads = set(threading.enumerate())
    with pytest.raises(ValueError) as refused:
        make_tier(tmp_path / "kv", rows(2), checksum_blocks=True)
    assert set(threading.enumerate()) <= threads, "refused after starting threads"
    message = str(refused.value)
    assert "checksum_blocks of the 'fs' tier needs user extended attributes" in (
        message
    )
    assert "each block's CRC32C is kept in one" in message
    assert "Fix: use a root_dir on a filesystem with user xattrs" in message
    assert "or set checksum_blocks to false" in message
    written = [f for _, _, files in os.walk(tmp_path) for f in files]
    assert written == [], "a refused start left files behind"


def test_checksum_blocks_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match="checksum_blocks of the 'fs' tier must be"):
        make_tier(tmp_path / "kv", rows(2), checksum_blocks="yes")


@pytest.mark.parametrize("layout", ["llama", "gemma3"])
def test_a_changed_block_on_disk_is_never_loaded_as_kv(
    model_config,  # noqa: F811 (a fixture of test_tiering_hma)
    tmp_path,
    layout,
):
    """Through the real connector scheduler: a previous engine stored a
    request's chunks to disk, then one byte of the file of its third chunk
    (first group) changed. A cold engine with checksum_blocks looks the
    request up, promotes its chunks from the fs tier, and reports a hit of
    the first two chunks only (the changed one failed its CRC32C, and what
    follows it is no prefix hit); the load job reads the right bytes of
    them (end_step's check); nothing stays pinned."""
    engine = Engine(model_config, layout, str(tmp_path / "fs"), 64)
    assert engine.vllm_config.kv_transfer_config is not None
    extra = engine.vllm_config.kv_transfer_config.kv_connector_extra_config
    extra["secondary_tiers"][0]["checksum_blocks"] = True
    sched = engine.connector_scheduler()
    tpc = max(g.tokens_per_chunk for g in sched.config.kv_group_configs)
    sched.shutdown()
    request = engine.request("req0", 4 * tpc + 5)
    assert store_requests(engine, [request]) > 0

    sched = engine.connector_scheduler()  # cold: an empty CPU tier
    manager = tiering_manager(sched)
    try:
        (fs_tier,) = manager.secondary_tiers
        assert isinstance(fs_tier, FileSystemTierManager)
        changed = fs_tier.file_mapper.get_file_name(group_keys(sched, request)[0][2])
        assert len(os.getxattr(changed, CRC_XATTR)) == 4
        with open(changed, "r+b") as f:
            f.seek(7)
            byte = f.read(1)
            f.seek(7)
            f.write(bytes([byte[0] ^ 0xFF]))

        sched.on_new_request(request)
        num_hit_tokens = None
        for _ in range(_COLD_SETTLE_STEPS + 1):  # one more: a failed promotion
            num_hit_tokens, _ = sched.get_num_new_matched_tokens(request, 0)
            if num_hit_tokens is not None:
                break
            end_step(sched)
        assert num_hit_tokens == 2 * tpc, "a changed block was loaded as KV"
        end_step(sched, {request.request_id: allocate(sched, request, 2 * tpc)})
        assert all(c == 0 for c in ref_cnts(manager))
        assert not os.path.exists(changed)
    finally:
        sched.shutdown()
