# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Security of the fs tier: KV blocks are derived from users' prompts and the
tier's directory outlives the process and is often shared, so

- what the tier creates is private (0600 files, 0700 directories) whatever
  the umask, on the C and the Python I/O paths, and wider modes found at
  start are reported;
- a root that others can write, or that another user owns, is refused, and a
  symbolic link at a block's path is a miss, never read through;

Real files on disk throughout; the tier is driven as the tiering manager
drives it (submit_store / submit_load / get_finished_jobs / lookup).
"""

import mmap
import os
import stat
import threading
import time
from unittest.mock import MagicMock

import numpy as np
import pytest

import vllm.v1.kv_offload.tiering.fs.io as io_mod
from vllm.v1.kv_offload.base import (
    LookupResult,
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
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

_CTX = ReqContext(req_id="test")


def _spec() -> MagicMock:
    spec = MagicMock()
    spec.config = OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="test-engine",
        model=OffloadingModelConfig(name="test-model", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        replicated_layout=False,
    )
    spec.blocks_per_chunk = 1
    spec.kv_events_config = OffloadingKVEventsConfig(
        enable_kv_cache_events=False, self_describing_kv_events=False
    )
    return spec


def key(n: int, group: int = 0) -> OffloadKey:
    return make_offload_key(n.to_bytes(8, "big"), group)


def job(job_id: int, keys: list[OffloadKey], chunk_ids: list[int], load=False):
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(chunk_ids, dtype=np.int64),
        is_promotion=load,
        req_context=_CTX,
    )


def rows(n_rows: int) -> np.ndarray:
    """Page-aligned rows of one page each, so that O_DIRECT can be used."""
    region = mmap.mmap(-1, n_rows * mmap.PAGESIZE)
    return np.frombuffer(region, dtype=np.uint8).reshape(n_rows, mmap.PAGESIZE)


def make_tier(root_dir, kv_rows: np.ndarray, **config) -> FileSystemTierManager:
    return FileSystemTierManager(
        offloading_spec=_spec(),
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


def modes_under(top) -> dict[str, int]:
    """Mode bits of *top* and of every file and directory under it."""
    found = {str(top): stat.S_IMODE(os.lstat(top).st_mode)}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            found[path] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


@pytest.fixture(params=[True, False], ids=["c_ext", "python"])
def io_path(request, monkeypatch):
    """Both I/O paths: the fs_io_C extension and the Python fallback."""
    if request.param and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", request.param)
    return request.param


@pytest.fixture
def permissive_umask():
    """A umask of 0, as some container images run with: os.makedirs and
    open() then create 0777 directories and 0666 files."""
    old = os.umask(0)
    yield
    os.umask(old)


# ---------------------------------------------------------------------------
# (1) private by default
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "file_mode", "dir_mode"),
    [({}, 0o600, 0o700), ({"group_access": True}, 0o640, 0o2770)],
    ids=["private", "group_access"],
)
def test_tier_creates_private_files_under_a_permissive_umask(
    tmp_path, io_path, permissive_umask, config, file_mode, dir_mode
):
    """Under umask 0, every file the tier creates (block files, config.json)
    is 0600 and every directory (the missing root and its missing parents
    included) 0700; with group_access 0640 and 2770. Before: 0666 files and
    0777 directories, anyone could read the cached KV and plant files."""
    root = tmp_path / "shared" / "kv"
    kv = rows(4)
    kv[:2] = 7
    tier = make_tier(root, kv, **config)
    try:
        tier.submit_store(job(1, [key(1), key(2, group=1)], [0, 1]))
        assert finish(tier) == [True]
        tier.submit_store(job(2, [key(3)], [0]))
        assert finish(tier) == [True]
    finally:
        tier.shutdown()
    found = modes_under(tmp_path / "shared")
    files = {p: m for p, m in found.items() if os.path.isfile(p)}
    dirs = {p: m for p, m in found.items() if os.path.isdir(p)}
    assert len(files) == 4, files  # config.json and 3 blocks
    assert any(p.endswith("config.json") for p in files)
    assert {p: oct(m) for p, m in files.items()} == {p: oct(file_mode) for p in files}
    assert {p: oct(m) for p, m in dirs.items()} == {p: oct(dir_mode) for p in dirs}


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask022", "umask077"])
def test_group_access_modes_are_exact_whatever_the_umask(tmp_path, io_path, umask):
    """With group_access the group must read blocks and write directories
    whatever the umask of the engine that created them (a stricter umask
    would lock the group's other engines out)."""
    old = os.umask(umask)
    try:
        tier = make_tier(tmp_path / "kv", rows(2), group_access=True)
        try:
            tier.submit_store(job(1, [key(1)], [0]))
            assert finish(tier) == [True]
            block = tier.file_mapper.get_file_name(key(1))
        finally:
            tier.shutdown()
    finally:
        os.umask(old)
    assert oct(stat.S_IMODE(os.stat(block).st_mode)) == oct(0o640)
    assert oct(stat.S_IMODE(os.stat(os.path.dirname(block)).st_mode)) == oct(0o2770)


def test_group_access_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match="group_access of the 'fs' tier"):
        make_tier(tmp_path, rows(2), group_access="yes")


def test_wider_modes_found_at_start_are_reported_once(tmp_path, caplog_vllm):
    """Block files and directories made readable by others (written before
    this change, or by hand) are reported once at start with their count, an
    example and the fix, instead of being used silently; also with the
    temp-file cleanup off."""
    kv = rows(4)
    tier = make_tier(tmp_path, kv)
    try:
        tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
        assert finish(tier) == [True]
        block = tier.file_mapper.get_file_name(key(1))
    finally:
        tier.shutdown()
    os.chmod(block, 0o644)
    os.chmod(os.path.dirname(block), 0o755)

    caplog_vllm.clear()
    tier = make_tier(tmp_path, kv, cleanup_stale_tmp_after_seconds=None)
    try:
        if tier._tmp_cleanup is not None:  # the walk runs in the background
            tier._tmp_cleanup.join()
        tier.submit_load(job(2, [key(1)], [2], load=True))
        assert finish(tier) == [True]
    finally:
        tier.shutdown()
    lines = [
        r.getMessage() for r in caplog_vllm.records if "wider modes" in r.getMessage()
    ]
    assert len(lines) == 1, "wider modes were not reported (once)"
    assert (
        f"2 file(s) and directories of the 'fs' KV offload tier at {tmp_path}"
        in (lines[0])
    )
    assert os.path.dirname(block) in lines[0]
    assert f"chmod -R go-rwx {tmp_path}" in lines[0]


# ---------------------------------------------------------------------------
# (2) unsafe roots refused, symbolic links not followed
# ---------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    ("mode", "config", "refusal", "fix"),
    [
        (0o777, {}, "is writable by all users", "chmod go-w"),
        (0o777, {"group_access": True}, "is writable by all users", "chmod o-w"),
        (0o770, {}, "is writable by its group", "chmod g-w"),
        (0o757, {}, "is writable by all users", "chmod go-w"),
        (0o1777, {}, "is writable by all users (the sticky bit", "chmod go-w"),
        (
            0o1777,
            {"group_access": True},
            "is writable by all users (the sticky bit",
            "chmod o-w",
        ),
    ],
)
def test_a_root_others_can_write_is_refused(tmp_path, mode, config, refusal, fix):
    """A root writable by other users (or by its group, unless the tier
    shares it with the group) is refused at start, naming the path, its mode
    and owner and the fix, before any thread starts; with the sticky bit too
    (1777), as anyone can still pre-create the tier's directories and plant
    config.json and block files in it. Before: used as is, anyone could plant
    block files."""
    root = tmp_path / "kv"
    root.mkdir()
    os.chmod(root, mode)
    message = _refused(root, **config)
    assert f"root_dir {str(root)!r} of the 'fs' tier is unsafe" in message
    assert f"{root} (mode {mode:04o}, owner uid {os.geteuid()}" in message
    assert refusal in message
    assert f"Fix: {fix} {root}" in message
    if refusal == "is writable by its group":
        assert "'group_access': true" in message


def test_a_parent_others_can_write_is_refused(tmp_path):
    """A parent of the root that others can write (they could rename the
    root away and put their own tree in its place) is refused; one with the
    sticky bit, as /tmp has, is fine."""
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o777)
    message = _refused(parent / "kv")
    assert f"a parent, {parent} (mode 0777" in message
    os.chmod(parent, 0o1777)
    make_tier(parent / "kv", rows(2)).shutdown()
    # an existing private root in a sticky parent, as /tmp/kv
    (parent / "kv2").mkdir(mode=0o700)
    make_tier(parent / "kv2", rows(2)).shutdown()


def _a_stranger_group() -> int:
    """A gid the engine's user is not a member of."""
    mine = {os.getegid(), *os.getgroups()}
    return next(gid for gid in range(54321, 60000) if gid not in mine)


@pytest.mark.skipif(os.geteuid() != 0, reason="chgrp to a foreign group needs root")
@pytest.mark.parametrize("where", ["root", "parent"])
def test_group_access_trusts_only_the_engines_groups(tmp_path, where):
    """group_access shares the root with the engine's own group: a root (or
    parent) writable by a group the engine's user is not in is refused, as
    its members are strangers to the engine."""
    parent = tmp_path / "shared"
    parent.mkdir(mode=0o700)
    root = parent / "kv"
    root.mkdir(mode=0o700)
    target = root if where == "root" else parent
    gid = _a_stranger_group()
    os.chown(target, -1, gid)
    os.chmod(target, 0o770)
    message = _refused(root, group_access=True)
    assert f"{target} (mode 0770" in message
    assert f"is writable by its group {gid}, which the engine's user" in message
    assert f"Fix: chgrp {os.getegid()} {target}" in message
    os.chown(target, -1, os.getegid())
    make_tier(root, rows(2), group_access=True).shutdown()


def test_a_root_that_cannot_be_checked_is_refused(tmp_path):
    """A root_dir whose path runs through a file is refused with an OSError
    (as a root_dir the tier cannot create) that names root_dir and the fix,
    before any thread starts."""
    (tmp_path / "file").write_bytes(b"")
    threads = set(threading.enumerate())
    with pytest.raises(OSError) as refused:
        make_tier(tmp_path / "file" / "kv", rows(2))
    assert set(threading.enumerate()) <= threads, "refused after starting threads"
    message = str(refused.value)
    assert "of the 'fs' tier cannot be checked" in message
    assert "Not a directory" in message
    assert "Fix: use a root_dir whose parents are directories" in message


@pytest.mark.parametrize(
    ("mode", "config"),
    [(0o700, {}), (0o755, {}), (0o770, {"group_access": True})],
)
def test_a_safe_root_is_used(tmp_path, mode, config):
    root = tmp_path / "kv"
    root.mkdir()
    os.chmod(root, mode)
    kv = rows(2)
    kv[0] = 4
    tier = make_tier(root, kv, **config)
    try:
        tier.submit_store(job(1, [key(1)], [0]))
        assert finish(tier) == [True]
        assert lookup(tier, key(1)) is LookupResult.HIT
    finally:
        tier.shutdown()


def test_a_root_given_through_a_symlink_is_used_resolved(tmp_path):
    """A root_dir reached through a symbolic link is checked resolved, and
    the tier then uses that resolved directory for everything (file mapper,
    config.json, blocks): repointing the link after the check moves nothing.
    Before: the resolved directory was checked but the tier used the link,
    which could be repointed to an unchecked directory."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    resolved = os.path.realpath(real)
    kv = rows(2)
    kv[0] = 7
    tier = make_tier(link, kv)
    try:
        assert tier.file_mapper.base_path.startswith(resolved + os.sep)
        assert tier.file_mapper.get_config_file_path().startswith(resolved + os.sep)
        assert os.path.isfile(tier.file_mapper.get_config_file_path())
        link.unlink()
        link.symlink_to(other, target_is_directory=True)
        tier.submit_store(job(1, [key(1)], [0]))
        assert finish(tier) == [True]
        path = tier.file_mapper.get_file_name(key(1))
        assert path.startswith(resolved + os.sep)
        assert os.path.isfile(path)
        assert os.listdir(other) == []
    finally:
        tier.shutdown()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
@pytest.mark.parametrize("where", ["root", "parent"])
def test_a_root_owned_by_another_user_is_refused(tmp_path, where):
    """A root (or parent) owned by another user, who could change its modes
    or replace what is in it at any time, is refused at start."""
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    other_uid = 54321
    os.chown(root if where == "root" else tmp_path, other_uid, -1)
    message = _refused(root)
    assert f"owner uid {other_uid}" in message
    assert "is owned by another user" in message
    assert "Fix: run the engine as that user, or use a root_dir owned by" in message


def test_a_symlink_at_a_block_path_is_a_miss(tmp_path, io_path):
    """A symbolic link planted at a block's path (to a file of the right
    size) is a miss: lookup says so, a load fails without reading through
    it and leaves its target alone, and a store puts the block in the link's
    place. Before: the target's bytes were served as the key's KV, a
    successful load."""
    kv = rows(4)
    kv[0] = 1
    tier = make_tier(tmp_path / "kv", kv)
    try:
        tier.submit_store(job(1, [key(1)], [0]))
        assert finish(tier) == [True]
        path = tier.file_mapper.get_file_name(key(1))
        target = tmp_path / "elsewhere.bin"
        target.write_bytes(bytes([9]) * os.path.getsize(path))
        os.remove(path)
        os.symlink(target, path)

        looked_up = lookup(tier, key(1))
        tier.submit_load(job(2, [key(1)], [1], load=True))
        loaded = finish(tier)
        assert not (kv[1] == 9).all(), "served a symlink's target as the key's KV"
        assert loaded == [False]
        assert looked_up is LookupResult.MISS
        assert target.read_bytes() == bytes([9]) * os.path.getsize(target)

        tier.submit_store(job(3, [key(1)], [0]))
        assert finish(tier) == [True]
        assert not os.path.islink(path)
        with open(path, "rb") as f:
            assert f.read(1) == bytes([1])
        assert target.read_bytes() == bytes([9]) * os.path.getsize(target)
    finally:
        tier.shutdown()
