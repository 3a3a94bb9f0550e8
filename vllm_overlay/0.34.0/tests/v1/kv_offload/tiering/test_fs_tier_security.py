# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Security of the fs tier: KV blocks are derived from users' prompts and the
tier's directory outlives the process and is often shared, so

- what the tier creates is private (0600 files, 0700 directories) whatever
  the umask, on the C and the Python I/O paths, and wider modes found at
  start are reported;
- a root that others can write, or that another user owns, is refused, and a
  symbolic link at a block's path is a miss, never read through;
- with a key file, a shared store is a keyed namespace: file names cannot be
  computed without the key, and a planted or altered block file fails its
  MAC (a miss, counted); bad key files are refused before any thread
  starts, and the key is never logged;

Real files on disk throughout; the tier is driven as the tiering manager
drives it (submit_store / submit_load / get_finished_jobs / lookup). The file
modes and the keyed namespace on their own are tested in
test_fs_tier_file_modes.py and test_fs_tier_keyed_namespace.py; here, what
they do together with the root check and group_access.
"""

import mmap
import os
import stat
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


# ---------------------------------------------------------------------------
# (1) private by default
# ---------------------------------------------------------------------------


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
        f"'fs' KV offload tier at {tmp_path}: 2 file(s) and directories of the tier"
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
        (
            0o1777,
            {},
            "is writable by all users (the sticky bit",
            "use a directory in it as root_dir, e.g.",
        ),
        (
            0o1777,
            {"group_access": True},
            "is writable by all users (the sticky bit",
            "use a directory in it as root_dir, e.g.",
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
    for mode in (0o777, 0o775):
        os.chmod(parent, mode)
        message = _refused(parent / "kv")
        assert f"a parent, {parent} (mode {mode:04o}" in message
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
    parent = tmp_path / "shared"
    parent.mkdir(mode=0o700)
    root = parent / "kv"
    root.mkdir(mode=0o700)
    other_uid = 54321
    os.chown(root if where == "root" else parent, other_uid, -1)
    message = _refused(root)
    assert f"owner uid {other_uid}" in message
    assert "is owned by another user" in message
    assert "Fix: run the engine as that user, or use a root_dir owned by" in message


def test_a_root_the_tier_created_is_used_again_under_umask_002(tmp_path, io_path):
    """The missing root is created 0700 whatever the umask: under umask 002
    it would be group-writable, and the next start would refuse the root the
    tier created itself. No directory the tier creates below it is writable
    by others either (they could plant blocks there)."""
    root = tmp_path / "new" / "kv"
    old = os.umask(0o002)
    try:
        for _ in range(2):
            tier = make_tier(root, rows(2))
            try:
                tier.submit_store(job(1, [key(1)], [0]))
                assert finish(tier) == [True]
            finally:
                tier.shutdown()
    finally:
        os.umask(old)
    for path in (tmp_path / "new", root):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700
    dirs = [d for d, _, _ in os.walk(root)]
    assert len(dirs) > 3  # the model's, the rank's and the blocks' directories
    for d in dirs:
        assert not stat.S_IMODE(os.lstat(d).st_mode) & 0o022, d


@pytest.mark.parametrize("planted", ["symlink", "foreign_dir"])
def test_a_root_planted_while_the_tier_starts_is_refused(
    tmp_path, monkeypatch, planted
):
    """A missing root is checked again once created: a link (or another
    user's directory) put at its name between the check and the creation,
    as in a sticky /tmp, is refused, not used."""
    if planted == "foreign_dir" and os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    root = tmp_path / "kv"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    real_mkdir = os.mkdir

    def squatted_mkdir(path, mode=0o777, *, dir_fd=None):
        if os.path.realpath(path) == os.path.realpath(root):  # another user wins
            if planted == "symlink":
                os.symlink(elsewhere, path)
            else:
                real_mkdir(path, 0o700)
                os.chown(path, 54321, -1)
            raise FileExistsError(path)
        return real_mkdir(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", squatted_mkdir)
    with pytest.raises(ValueError) as refused:
        make_tier(root, rows(2)).shutdown()
    message = str(refused.value)
    if planted == "symlink":
        assert "became a symbolic link while it was checked" in message
    else:
        assert "is owned by another user" in message
    assert os.listdir(elsewhere) == []


def test_a_root_created_with_group_access_is_the_groups(tmp_path):
    """With group_access the missing root is created 2770, as the tier's
    other directories: the group's engines store into it."""
    root = tmp_path / "new" / "kv"
    make_tier(root, rows(2), group_access=True).shutdown()
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o2770


def test_the_o_direct_probe_never_writes_through_a_planted_link(tmp_path, monkeypatch):
    """The O_DIRECT probe creates its temp file exclusively and never
    follows a link: a symlink planted at its name (the root may be
    group-writable) leaves the file it points to as it was. Before: the
    probe opened it with O_TRUNC and truncated the target."""
    if not io_mod.O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setattr(io_mod, "get_tmp_suffix", lambda: "_7.tmp")
    os.symlink(victim, root / ".o_direct_probe_7.tmp")
    io_mod.probe_o_direct(str(root))  # O_DIRECT or not: either answer
    assert victim.read_bytes() == b"precious"


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


# ---------------------------------------------------------------------------
# (3) keyed namespace: names and a MAC derived from a key file
# ---------------------------------------------------------------------------


def key_file(path, secret: bytes | None = None, mode: int = 0o600) -> str:
    path.write_bytes(os.urandom(32) if secret is None else secret)
    os.chmod(path, mode)
    return str(path)


def lookup_again(tier: FileSystemTierManager, k: OffloadKey) -> LookupResult:
    """lookup() after forgetting the verdicts the request cached."""
    tier.on_request_finished(_CTX)
    return lookup(tier, k)


def _failure_lines(caplog) -> list[str]:
    lines = [r.getMessage() for r in caplog.records]
    return [line for line in lines if "since the previous report" in line]


@pytest.mark.parametrize("keyed", [True, False], ids=["key_file", "no_key"])
def test_a_planted_block_for_a_known_prefix(tmp_path, caplog_vllm, io_path, keyed):
    """Block hashes are deterministic (so that a restart hits), so anyone who
    can write to a shared store can compute the file name of a known prefix
    (a public system prompt) and plant a block file of the right size there.

    Without a key (documents today's behaviour) the tier serves it as that
    prefix's KV. With a key, the planted file at the computable name is
    never looked at; and one planted at the keyed name (right size, by an
    insider who can list the store, with a made-up MAC attribute) fails the
    MAC on load: a miss, the file removed, and counted in the tier's
    failure report."""
    from vllm.v1.kv_offload.file_mapper import FileMapper

    config = {"key_file": key_file(tmp_path / "key")} if keyed else {}
    root = tmp_path / "kv"
    kv = rows(4)
    prefix = key(7)
    evil = bytes([0xEE]) * kv.shape[1]
    tier = make_tier(root, kv, **config)
    try:
        # the attacker: the prefix's name as anyone computes it, without a key
        unkeyed = FileMapper.from_offloading_spec(
            root_dir=str(root),
            offloading_spec=_make_offloading_spec(),
            parallel_agnostic=True,
        ).get_file_name(prefix)
        os.makedirs(os.path.dirname(unkeyed), exist_ok=True)
        with open(unkeyed, "wb") as f:
            f.write(evil)
        planted = unkeyed
        if keyed:
            from vllm.v1.kv_offload.tiering.fs.io import MAC_XATTR

            assert tier.file_mapper.get_file_name(prefix) != unkeyed
            assert lookup(tier, prefix) is LookupResult.MISS
            # an insider who knows the keyed name still cannot forge the MAC
            planted = tier.file_mapper.get_file_name(prefix)
            os.makedirs(os.path.dirname(planted), exist_ok=True)
            with open(planted, "wb") as f:
                f.write(evil)
                os.setxattr(f.fileno(), MAC_XATTR, os.urandom(32))
        assert lookup_again(tier, prefix) is LookupResult.HIT
        caplog_vllm.clear()
        tier.submit_load(job(1, [prefix], [0], load=True))
        (loaded,) = finish(tier)
        if not keyed:
            assert loaded and (kv[0] == 0xEE).all(), (
                "today a planted file is served as the prefix's KV"
            )
            return
        assert not loaded, "served a planted block file as the prefix's KV"
        assert not os.path.exists(planted)
        assert lookup_again(tier, prefix) is LookupResult.MISS
        (line,) = _failure_lines(caplog_vllm)
        assert "0 store job(s) and 1 load job(s) failed" in line
        assert "1 not loaded and recomputed (1 of them failed the integrity " in line
        assert "hmac-sha256 MAC mismatch: not written with the tier's key" in line
    finally:
        tier.shutdown()


def test_an_altered_block_or_one_without_a_mac_is_a_miss(tmp_path, io_path):
    """A block file whose bytes changed at the same size, or whose MAC
    attribute was removed (a copy without xattrs), fails its load and is
    removed; the other blocks of the same load are kept."""
    from vllm.v1.kv_offload.tiering.fs.io import MAC_XATTR

    kv = rows(6)
    kv[0], kv[1], kv[2] = 1, 2, 3
    keys = [key(1), key(2), key(3)]
    tier = make_tier(tmp_path / "kv", kv, key_file=key_file(tmp_path / "key"))
    try:
        tier.submit_store(job(1, keys, [0, 1, 2]))
        assert finish(tier) == [True]
        altered, stripped, intact = (tier.file_mapper.get_file_name(k) for k in keys)
        with open(altered, "r+b") as f:
            f.seek(100)
            f.write(b"x")
        os.removexattr(stripped, MAC_XATTR)

        tier.submit_load(job(2, keys, [3, 4, 5], load=True))
        tier.drain_jobs()
        (result,) = tier.get_finished_jobs()
        assert not result.success
        assert result.successful_keys == (keys[2],)
        assert (kv[5] == 3).all()
        assert not os.path.exists(altered) and not os.path.exists(stripped)
        assert os.path.exists(intact)
    finally:
        tier.shutdown()


def test_a_planted_block_that_cannot_be_removed_is_a_miss(
    tmp_path, io_path, monkeypatch
):
    """A block file that fails its MAC but cannot be removed (a read-only
    mount) is answered as a miss from then on, so that no request promotes
    it again and again."""
    kv = rows(4)
    tier = make_tier(tmp_path / "kv", kv, key_file=key_file(tmp_path / "key"))
    try:
        planted = tier.file_mapper.get_file_name(key(7))
        os.makedirs(os.path.dirname(planted))
        with open(planted, "wb") as f:
            f.write(bytes(kv.shape[1]))
        monkeypatch.setattr(io_mod, "_remove_corrupt_file", lambda path: None)
        assert lookup(tier, key(7)) is LookupResult.HIT
        tier.submit_load(job(1, [key(7)], [0], load=True))
        assert finish(tier) == [False]
        assert os.path.exists(planted)
        tier.on_request_finished(_CTX)
        # answered at once, without looking at the file again
        assert tier.lookup(key(7), _CTX) is LookupResult.MISS
    finally:
        tier.shutdown()


@pytest.mark.parametrize("found", ["planted", "without_mac"])
def test_a_keyed_store_replaces_a_file_without_its_mac(
    tmp_path, io_path, monkeypatch, found
):
    """A store of a key whose file is complete but does not hold this
    store's MAC replaces it: a planted file that could not be removed (else
    the store would succeed on it, clear the key's unloadable mark and the
    file would be a hit that fails again, in a loop), or a copy restored
    without its xattrs."""
    from vllm.v1.kv_offload.tiering.fs.io import MAC_XATTR

    kv = rows(4)
    kv[0] = 5
    tier = make_tier(tmp_path / "kv", kv, key_file=key_file(tmp_path / "key"))
    try:
        k = key(7)
        path = tier.file_mapper.get_file_name(k)
        if found == "planted":
            os.makedirs(os.path.dirname(path))
            with open(path, "wb") as f:
                f.write(bytes(kv.shape[1]))
            monkeypatch.setattr(io_mod, "_remove_corrupt_file", lambda path: None)
            assert lookup(tier, k) is LookupResult.HIT
            tier.submit_load(job(1, [k], [1], load=True))
            assert finish(tier) == [False]
            tier.on_request_finished(_CTX)
            assert tier.lookup(k, _CTX) is LookupResult.MISS
        else:
            tier.submit_store(job(1, [k], [0]))
            assert finish(tier) == [True]
            os.removexattr(path, MAC_XATTR)  # e.g. copied by rsync without -X

        tier.submit_store(job(2, [k], [0]))
        assert finish(tier) == [True]
        assert MAC_XATTR in os.listxattr(path), "the store kept the old file"
        assert lookup_again(tier, k) is LookupResult.HIT
        tier.submit_load(job(3, [k], [2], load=True))
        assert finish(tier) == [True]
        assert (kv[2] == 5).all()
    finally:
        tier.shutdown()


@pytest.mark.parametrize("read", ["valid", "planted"])
def test_a_block_stored_anew_during_its_load_is_left_alone(
    tmp_path, io_path, monkeypatch, read
):
    """Another engine sharing the root may store a block anew (other bytes,
    their valid MAC) between this engine's read of the block file and its
    MAC check. The check uses the MAC of the file that was read (a valid
    block loads), and a mismatch removes the file only if it still is the
    one read: the other engine's valid file is never removed."""
    from vllm.v1.kv_offload.tiering.fs.io import MAC_XATTR

    kv = rows(4)
    kv[0] = 1
    tier = make_tier(tmp_path / "kv", kv, key_file=key_file(tmp_path / "key"))
    try:
        k = key(7)
        path = tier.file_mapper.get_file_name(k)
        if read == "valid":
            tier.submit_store(job(1, [k], [0]))
            assert finish(tier) == [True]
        else:  # a file without a MAC
            os.makedirs(os.path.dirname(path))
            with open(path, "wb") as f:
                f.write(bytes(kv.shape[1]))
        theirs = bytes([7]) * kv.shape[1]
        assert tier._mac is not None
        their_mac = tier._mac.compute(k, memoryview(theirs))
        read_blocks = io_mod._batch_load_block

        def read_then_another_engine_stores(*args, **kwargs):
            found = read_blocks(*args, **kwargs)
            with open(path + ".theirs", "wb") as f:
                f.write(theirs)
                os.setxattr(f.fileno(), MAC_XATTR, their_mac)
            os.rename(path + ".theirs", path)
            return found

        monkeypatch.setattr(
            io_mod, "_batch_load_block", read_then_another_engine_stores
        )
        tier.submit_load(job(2, [k], [2], load=True))
        assert finish(tier) == [read == "valid"]
        if read == "valid":
            assert (kv[2] == 1).all()
        assert os.getxattr(path, MAC_XATTR) == their_mac, "removed their block"
    finally:
        tier.shutdown()


def assert_blocks_take_the_compiled_io_path(
    tmp_path, monkeypatch, what: str, **tier_config
) -> None:
    """A block stored and loaded by a tier of tier_config with fs_io_C: the
    Python per-block store and load are never called (what: the blocks'
    kind, for the failure)."""
    if not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")

    def python_path(*args, **kwargs):
        raise AssertionError(f"a {what} block took the Python I/O path")

    monkeypatch.setattr(io_mod, "_store_block", python_path)
    monkeypatch.setattr(io_mod, "_load_block", python_path)
    kv = rows(4)
    kv[0] = 5
    tier = make_tier(tmp_path / "kv", kv, **tier_config)
    try:
        tier.submit_store(job(1, [key(1)], [0]))
        assert finish(tier) == [True]
        tier.submit_load(job(2, [key(1)], [1], load=True))
        assert finish(tier) == [True]
        assert (kv[1] == 5).all()
    finally:
        tier.shutdown()


def test_keyed_blocks_take_the_compiled_io_path(tmp_path, monkeypatch):
    """With fs_io_C, keyed stores and loads run in C (the MAC set on the temp
    file, read back from the fd the block was read from), as unkeyed ones
    do: the Python per-block store and load are never called."""
    assert_blocks_take_the_compiled_io_path(
        tmp_path, monkeypatch, "keyed", key_file=key_file(tmp_path / "key")
    )


def test_a_group_readable_key_file_is_accepted_with_group_access(tmp_path):
    path = key_file(tmp_path / "key", mode=0o640)
    make_tier(tmp_path / "kv", rows(2), key_file=path, group_access=True).shutdown()


@pytest.mark.skipif(os.geteuid() != 0, reason="chgrp to a foreign group needs root")
def test_a_key_file_readable_by_a_stranger_group_is_refused(tmp_path):
    """With group_access, a key file may be readable by the engine's own
    group only: another group's members could plant blocks that load."""
    path = key_file(tmp_path / "key", mode=0o640)
    gid = _a_stranger_group()
    os.chown(path, -1, gid)
    message = _refused(tmp_path / "kv", key_file=path, group_access=True)
    assert f"is accessible by its group {gid}, which the engine's user" in message
    assert f"Fix: chgrp {os.getegid()} {path}, or chmod 600 {path}" in message


def test_a_key_file_gives_the_same_names_and_macs_on_every_release():
    """Known answers: one key file names and MACs blocks the same way on every
    vLLM release that reads the root; a change to the derivation would orphan
    every keyed store."""
    from vllm.v1.kv_offload.tiering.fs.io import BlockMac
    from vllm.v1.kv_offload.tiering.fs.security import TierKey

    tier_key = TierKey(bytes(range(32)))
    assert tier_key.file_stem(bytes(32)) == "e4d569d57304debf230f35bafbee06a9"
    block_mac = BlockMac(tier_key.mac_key, "layout")
    mac = block_mac.compute(b"key", memoryview(b"block"))
    assert mac.hex() == (
        "525a1f857175d8eedf984df344c8000b391f2e7372c7c39e844614e5640b4a62"
    )


def test_the_key_is_never_logged_or_written(tmp_path, caplog_vllm):
    """Neither the key nor the keys derived from it appear in the logs (of a
    start, a store, a load, a failed load and a shutdown), in config.json,
    or in the repr of the tier's objects."""
    import logging

    from vllm.v1.kv_offload.tiering.fs.security import _hkdf_sha256

    secret = os.urandom(48)
    path = key_file(tmp_path / "key", secret)
    derived = [_hkdf_sha256(secret, info) for info in (b"file names", b"block MAC")]
    kv = rows(4)
    caplog_vllm.set_level(logging.DEBUG)
    tier = make_tier(tmp_path / "kv", kv, key_file=path)
    try:
        tier.submit_store(job(1, [key(1)], [0]))
        assert finish(tier) == [True]
        block = tier.file_mapper.get_file_name(key(1))
        with open(block, "r+b") as f:
            f.write(b"x")
        tier.submit_load(job(2, [key(1)], [1], load=True))
        assert finish(tier) == [False]
        texts = [repr(tier._mac), repr(tier.file_mapper.__dict__)]
    finally:
        tier.shutdown()
    with open(tier.file_mapper.get_config_file_path()) as f:
        texts.append(f.read())
    texts += [r.getMessage() for r in caplog_vllm.records]
    assert any("MAC mismatch" in t for t in texts)
    for value in [secret, *derived]:
        for form in (value.hex(), repr(value), value.hex()[:16]):
            assert not [t for t in texts if form in t], "the key was logged"
