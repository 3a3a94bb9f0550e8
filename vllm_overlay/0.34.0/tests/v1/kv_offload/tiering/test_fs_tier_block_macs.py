# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fs tier's block MACs under a key_file: each block file carries an
HMAC-SHA256 of its identity and bytes in the xattr user.vllm.kv_mac, checked
on load, so a planted, altered or MAC-less file is a miss, removed. Real
files on disk; the tier driven as the tiering manager drives it."""

import errno
import os
import shutil
import threading

import pytest

import vllm.v1.kv_offload.tiering.fs.io as io_mod
import vllm.v1.kv_offload.tiering.fs.manager as manager_mod
from tests.v1.kv_offload.tiering.test_fs_tier_keyed_namespace import (
    _CTX,
    finish,
    job,
    key,
    key_file,
    lookup,
    make_tier,
    rows,
)
from vllm.v1.kv_offload.base import LookupResult

MAC_XATTR = "user.vllm.kv_mac"


@pytest.fixture(params=[True, False], ids=["c_ext", "python"])
def io_path(request, monkeypatch):
    """Both I/O paths: the fs_io_C extension and the Python fallback."""
    if request.param and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", request.param)
    if not request.param:
        monkeypatch.setattr(manager_mod, "_HAS_BATCH_LOOKUP_C", False)


def assert_load_fails_and_removes(tier, kv, k, path) -> None:
    tier.submit_load(job(9, [k], [3], load=True))
    assert finish(tier) == [False], "served a planted or altered block file"
    assert not os.path.exists(path), "the file that failed its MAC was kept"
    tier.on_request_finished(_CTX)
    assert lookup(tier, k) is LookupResult.MISS


@pytest.mark.parametrize("planted", ["raw", "another_block", "another_key"])
def test_a_planted_block_at_its_keyed_name_is_a_miss(
    tmp_path, caplog_vllm, io_path, planted
):
    """A file of the right size planted at a prefix's keyed name (by whoever
    can list and write the store): raw (no MAC), or copied with its MAC from
    another block or another key's store, fails its MAC on load: a miss, the
    file removed, the failure logged."""
    kv = rows(4)
    kv[0] = 0xEE
    tier = make_tier(tmp_path / "kv", kv, key_file=key_file(tmp_path / "key"))
    other = None
    try:
        path = tier.file_mapper.get_file_name(key(7))
        if planted == "raw":
            os.makedirs(os.path.dirname(path))
            with open(path, "wb") as f:
                f.write(bytes(kv[0]))
        else:
            source = tier
            if planted == "another_key":
                other = source = make_tier(
                    tmp_path / "kv", kv, key_file=key_file(tmp_path / "other")
                )
            stored = key(1) if planted == "another_block" else key(7)
            source.submit_store(job(1, [stored], [0]))
            assert finish(source) == [True]
            os.makedirs(os.path.dirname(path), exist_ok=True)
            shutil.copy2(source.file_mapper.get_file_name(stored), path)
        copied_mac = MAC_XATTR in os.listxattr(path)
        assert_load_fails_and_removes(tier, kv, key(7), path)
        assert copied_mac or planted == "raw", "the copy had no MAC"
        messages = [r.getMessage() for r in caplog_vllm.records]
        assert any("hmac-sha256 MAC mismatch" in m for m in messages)
    finally:
        tier.shutdown()
        if other is not None:
            other.shutdown()


@pytest.mark.parametrize("case", ["altered", "without_mac"])
def test_an_altered_or_mac_less_block_is_a_miss(tmp_path, io_path, case):
    """A stored block file whose bytes changed at the same size, or whose MAC
    attribute was removed (a copy without xattrs), fails its load and is
    removed; the block loaded before it in the same job is kept."""
    kv = rows(4)
    kv[0], kv[1] = 1, 2
    keys = [key(1), key(2)]
    tier = make_tier(tmp_path / "kv", kv, key_file=key_file(tmp_path / "key"))
    try:
        tier.submit_store(job(1, keys, [0, 1]))
        assert finish(tier) == [True]
        intact, bad = (tier.file_mapper.get_file_name(k) for k in keys)
        if case == "altered":
            with open(bad, "r+b") as f:
                f.seek(100)
                f.write(b"x")
        elif MAC_XATTR in os.listxattr(bad):
            os.removexattr(bad, MAC_XATTR)

        tier.submit_load(job(2, keys, [2, 3], load=True))
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        assert not result.success, "served an altered block file"
        assert result.successful_keys == (keys[0],)
        assert (kv[2] == 1).all()
        assert not os.path.exists(bad) and os.path.exists(intact)
    finally:
        tier.shutdown()


def test_a_store_sets_the_block_mac(tmp_path, io_path):
    """Both I/O paths set the MAC of the block's identity and bytes, replacing
    a file at the block's name without it."""
    kv = rows(2)
    kv[0] = 5
    tier = make_tier(tmp_path / "kv", kv, key_file=key_file(tmp_path / "key"))
    try:
        path = tier.file_mapper.get_file_name(key(1))
        os.makedirs(os.path.dirname(path))
        with open(path, "wb") as f:
            f.write(bytes(kv[1]))
        tier.submit_store(job(1, [key(1)], [0]))
        assert finish(tier) == [True]
        assert MAC_XATTR in os.listxattr(path), "stored without a MAC"
        mac = tier._mac
        assert mac is not None
        assert os.getxattr(path, MAC_XATTR) == mac.compute(key(1), kv[0].data)
    finally:
        tier.shutdown()


def test_keyed_blocks_take_the_compiled_io_path(tmp_path, monkeypatch):
    """With fs_io_C, keyed stores and loads run in C, the MAC set and read
    back there: the Python per-block store and load are never called."""
    if not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")

    def python_path(*args, **kwargs):
        raise AssertionError("a keyed block took the Python I/O path")

    monkeypatch.setattr(io_mod, "_store_block", python_path)
    monkeypatch.setattr(io_mod, "_load_block", python_path)
    kv = rows(4)
    kv[0] = 5
    tier = make_tier(tmp_path / "kv", kv, key_file=key_file(tmp_path / "key"))
    try:
        tier.submit_store(job(1, [key(1)], [0]))
        assert finish(tier) == [True]
        path = tier.file_mapper.get_file_name(key(1))
        assert MAC_XATTR in os.listxattr(path), "stored without a MAC"
        tier.submit_load(job(2, [key(1)], [1], load=True))
        assert finish(tier) == [True]
        assert (kv[1] == 5).all()
        with open(path, "r+b") as f:
            f.write(b"x")
        assert_load_fails_and_removes(tier, kv, key(1), path)
    finally:
        tier.shutdown()


def test_a_root_without_extended_attributes_is_refused(tmp_path, monkeypatch):
    """A root without user xattrs (where each block's MAC lives) is refused
    at start with the fix, before any thread starts or config.json is
    written."""

    def no_xattrs(*args, **kwargs):
        raise OSError(errno.ENOTSUP, os.strerror(errno.ENOTSUP))

    monkeypatch.setattr(os, "setxattr", no_xattrs)
    threads = set(threading.enumerate())
    with pytest.raises(ValueError) as refused:
        make_tier(tmp_path / "kv", rows(2), key_file=key_file(tmp_path / "key"))
    assert set(threading.enumerate()) <= threads, "refused after starting threads"
    assert not list((tmp_path / "kv").rglob("config.json")), "refused after writing"
    message = str(refused.value)
    assert "key_file of the 'fs' tier needs user extended attributes" in message
    assert "Fix: use a root_dir on a filesystem with user xattrs" in message


def test_a_key_file_gives_the_same_macs_on_every_release():
    """Known answer: one key file MACs a block the same way on every vLLM
    release that reads the root; a change would fail every keyed block."""
    from vllm.v1.kv_offload.tiering.fs.io import BlockMac
    from vllm.v1.kv_offload.tiering.fs.security import TierKey

    block_mac = BlockMac(TierKey(bytes(range(32))).mac_key, "layout")
    assert block_mac.compute(b"key", memoryview(b"block")).hex() == (
        "525a1f857175d8eedf984df344c8000b391f2e7372c7c39e844614e5640b4a62"
    )
