# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fs tier's keyed namespace: with a key file, a shared store's file
names cannot be computed without the key, and bad key files are refused
before any thread starts. Real files on disk throughout; the tier is driven
as the tiering manager drives it (submit_store / submit_load /
get_finished_jobs / lookup)."""

import contextlib
import mmap
import os
import threading
import time

import numpy as np
import pytest

import vllm.v1.kv_offload.tiering.fs.io as io_mod
import vllm.v1.kv_offload.tiering.fs.manager as manager_mod
from tests.v1.kv_offload.tiering.test_fs_tier import (
    _CTX,
    _make_offloading_spec,
    make_job,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager


def key(n: int, group: int = 0) -> OffloadKey:
    return make_offload_key(n.to_bytes(8, "big"), group)


def job(job_id: int, keys: list[OffloadKey], chunk_ids: list[int], load=False):
    return make_job(job_id, keys, chunk_ids, is_promotion=load)


def rows(n_rows: int) -> np.ndarray:
    """Page-aligned rows of one page each, so that O_DIRECT can be used."""
    region = mmap.mmap(-1, n_rows * mmap.PAGESIZE)
    return np.frombuffer(region, dtype=np.uint8).reshape(n_rows, mmap.PAGESIZE)


def make_tier(root_dir, kv_rows: np.ndarray, **config) -> FileSystemTierManager:
    return FileSystemTierManager(
        offloading_spec=_make_offloading_spec(),
        primary_kv_view=memoryview(kv_rows),
        tier_type="fs",
        root_dir=str(root_dir),
        n_read_threads=1,
        n_write_threads=1,
        **config,
    )


def finish(tier: FileSystemTierManager) -> list[bool]:
    """Whether each of the jobs in flight succeeded."""
    tier.drain_jobs()
    return [r.success for r in tier.get_finished_jobs()]


def lookup(tier: FileSystemTierManager, k: OffloadKey) -> LookupResult:
    """A full async lookup cycle of one key (submitted, flushed at the end of
    the schedule step, answered on the next lookup)."""
    tier.lookup(k, _CTX)
    tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
    deadline = time.monotonic() + 10
    while tier._lookup_manager._pending_results.empty():
        assert time.monotonic() < deadline, "the lookup did not resolve"
        time.sleep(0.01)
    return tier.lookup(k, _CTX)


@pytest.fixture(params=[True, False], ids=["c_ext", "python"])
def io_path(request, monkeypatch):
    """Both I/O paths: the fs_io_C extension and the Python fallback (loads,
    stores and lookups)."""
    if request.param and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", request.param)
    if not request.param:
        monkeypatch.setattr(manager_mod, "_HAS_BATCH_LOOKUP_C", False)
    return request.param


def _refused(root, **config) -> str:
    """The ValueError message of a tier refused at start, which must come
    before any thread starts or anything is created under *root*."""
    threads = set(threading.enumerate())
    before = sorted(os.listdir(root)) if os.path.isdir(root) else None
    with pytest.raises(ValueError) as refused:
        make_tier(root, rows(2), **config).shutdown()
    assert set(threading.enumerate()) <= threads, "refused after starting threads"
    after = sorted(os.listdir(root)) if os.path.isdir(root) else None
    assert after == before, "refused after creating files"
    return str(refused.value)


def key_file(path, secret: bytes | None = None, mode: int = 0o600) -> str:
    path.write_bytes(os.urandom(32) if secret is None else secret)
    os.chmod(path, mode)
    return str(path)


def test_cold_restart_with_the_same_key_hits_another_key_misses(tmp_path, io_path):
    """Engines sharing a root and a key file share blocks across a restart;
    an engine with another key, or none, finds none of them: keyed files
    live in a directory of their own."""
    from vllm.v1.kv_offload.base import get_offload_block_hash

    root = tmp_path / "kv"
    same = key_file(tmp_path / "key")
    other = key_file(tmp_path / "other-key")
    kv = rows(4)
    kv[0], kv[1] = 3, 4
    keys = [key(1), key(2, group=1)]
    writer = make_tier(root, kv, key_file=same)
    try:
        writer.submit_store(job(1, keys, [0, 1]))
        assert finish(writer) == [True]
        names = [writer.file_mapper.get_file_name(k) for k in keys]
        keyed_base = writer.file_mapper.base_path
    finally:
        writer.shutdown()
    for k, name in zip(keys, names):
        assert get_offload_block_hash(k).hex() not in name

    kv[:] = 0
    restarted = make_tier(root, kv, key_file=same)
    try:
        assert [lookup(restarted, k) for k in keys] == [LookupResult.HIT] * 2
        restarted.submit_load(job(2, keys, [2, 3], load=True))
        assert finish(restarted) == [True]
        assert (kv[2] == 3).all() and (kv[3] == 4).all()
    finally:
        restarted.shutdown()

    for config in ({"key_file": other}, {}):
        stranger = make_tier(root, kv, **config)
        try:
            assert [lookup(stranger, k) for k in keys] == [LookupResult.MISS] * 2
            if not config:  # another key shares the directory, not the names
                assert stranger.file_mapper.base_path != keyed_base
        finally:
            stranger.shutdown()


@pytest.mark.parametrize(
    ("case", "refusal"),
    [
        ("missing", "does not exist"),
        ("empty", "is empty"),
        ("31 bytes", "is too short (31 bytes, at least 32 needed)"),
        ("4097 bytes", "is longer than 4096 bytes"),
        ("readable by others", "is accessible by others (mode 0644)"),
        ("readable by its group", "is accessible by its group (mode 0640)"),
        ("a directory", "is not a regular file"),
        ("inline secret", "must be the absolute path of a file holding the key"),
    ],
)
def test_a_bad_key_file_is_refused_before_any_thread_starts(tmp_path, case, refusal):
    """A key file that is missing, empty, shorter than 32 or longer than 4096
    bytes, readable by others or by its group, or not a file is refused with
    a ValueError naming the path and the fix, before any thread starts and
    without the key's bytes in the message."""
    path = tmp_path / "key"
    secret = b"s3cr3t-" * 8
    if case == "empty":
        key_file(path, b"")
    elif case == "31 bytes":
        key_file(path, secret[:31])
    elif case == "4097 bytes":
        key_file(path, (secret * 80)[:4097])
    elif case == "readable by others":
        key_file(path, secret, 0o644)
    elif case == "readable by its group":
        key_file(path, secret, 0o640)
    elif case == "a directory":
        path.mkdir()
    value = secret.decode() if case == "inline secret" else str(path)
    message = _refused(tmp_path / "kv", key_file=value)
    assert refusal in message
    assert "s3cr3t" not in message
    if case != "inline secret":
        assert f"key_file {str(path)!r} of the 'fs' tier" in message
        assert "chmod 6" in message or "head -c 32 /dev/urandom" in message


def test_a_fifo_key_file_is_refused_at_once(tmp_path):
    """A FIFO at the key_file path is refused as not a regular file, at once:
    opening it to read (before the check) must not wait for a writer, which
    would hang the engine's start."""
    path = tmp_path / "key"
    os.mkfifo(path, 0o600)
    messages: list[str] = []
    start = threading.Thread(
        target=lambda: messages.append(_refused(tmp_path / "kv", key_file=str(path))),
        daemon=True,
    )
    start.start()
    start.join(10)
    waited = start.is_alive()
    if waited:  # unblock it: a writer opens the FIFO
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        start.join(10)
    assert not waited, "the start waited on the FIFO for a writer"
    (message,) = messages
    assert f"key_file {str(path)!r} of the 'fs' tier is not a regular file" in message


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_key_file_owned_by_another_user_is_refused(tmp_path):
    """A key file another user owns (who could rewrite it) is refused."""
    path = key_file(tmp_path / "key")
    os.chown(path, 54321, -1)
    message = _refused(tmp_path / "kv", key_file=path)
    assert "is owned by another user" in message
    assert f"chown it to uid {os.geteuid()}" in message
