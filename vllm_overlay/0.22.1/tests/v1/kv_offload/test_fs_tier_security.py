# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
Security of the fs_python tier: KV blocks are derived from users' prompts and
the tier's directory outlives the process and is often shared, so

- what the tier creates is private (0600 files, 0700 directories) whatever
  the umask, and wider modes found at start are reported;
- a root that others can write, or that another user owns, is refused, and
  a symbolic link at a block's path is a miss, never read through;
- with a key file, a shared store is a keyed namespace: file names cannot
  be computed without the key, and a planted or altered block file fails
  its MAC (a miss, counted); bad key files are refused before any thread
  starts, and the key is never logged;

Real files on disk throughout; the tier is driven as the tiering manager
drives it (submit_store / submit_load / get_finished / lookup).
"""

import contextlib
import mmap
import os
import stat
import threading

import numpy as np
import pytest
from test_fs_tier import _CTX, _MOCK_OFFLOADING_SPEC, _aligned_rows, _finish, make_job

from vllm.v1.kv_offload.base import OffloadKey, make_offload_key
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

_SPEC = _MOCK_OFFLOADING_SPEC
rows = _aligned_rows  # page-aligned rows of one page each: O_DIRECT works
finish = _finish


def key(n: int, group: int = 0) -> OffloadKey:
    return make_offload_key(n.to_bytes(8, "big"), group)


def job(job_id: int, keys: list[OffloadKey], block_ids: list[int], load=False):
    return make_job(job_id, keys, block_ids, is_promotion=load)


def make_tier(root_dir, kv_rows: np.ndarray, **config) -> FileSystemTierManager:
    return FileSystemTierManager(
        offloading_spec=_SPEC,
        primary_kv_view=memoryview(kv_rows),
        tier_type="fs_python",
        root_dir=str(root_dir),
        n_read_threads=2,
        n_write_threads=2,
        **config,
    )


def modes_under(top) -> dict[str, int]:
    """Mode bits of *top* and of every file and directory under it."""
    found = {str(top): stat.S_IMODE(os.lstat(top).st_mode)}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            found[path] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


@pytest.fixture
def permissive_umask():
    """umask 0, as some container images run with: os.makedirs and open()
    then create 0777 directories and 0666 files."""
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
    tmp_path, permissive_umask, config, file_mode, dir_mode
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
        assert [r.success for r in finish(tier)] == [True]
        tier.submit_store(job(2, [key(3)], [0]))
        assert [r.success for r in finish(tier)] == [True]
    finally:
        tier.shutdown()
    found = modes_under(tmp_path / "shared")
    files = {p: m for p, m in found.items() if os.path.isfile(p)}
    dirs = {p: m for p, m in found.items() if os.path.isdir(p)}
    assert len(files) == 4, files  # config.json and 3 blocks
    assert any(p.endswith("config.json") for p in files)
    assert {p: oct(m) for p, m in files.items()} == {p: oct(file_mode) for p in files}
    assert {p: oct(m) for p, m in dirs.items()} == {p: oct(dir_mode) for p in dirs}


@pytest.mark.parametrize(
    ("config", "umask", "file_mode"),
    [({"group_access": True}, 0o077, 0o640), ({}, 0o277, 0o600)],
    ids=["group_access-umask-077", "private-umask-277"],
)
def test_block_files_get_their_mode_under_a_narrowing_umask(
    tmp_path, config, umask, file_mode
):
    """A umask that clears bits of the tier's file mode (077, common for
    service accounts, clears the group's read bit of 0640): block files still
    get the exact mode, so the group's engines can read them. The tier skips
    the fchmod per block only where the umask cannot narrow the mode."""
    old = os.umask(umask)
    try:
        kv = rows(2)
        tier = make_tier(tmp_path / "kv", kv, **config)
        try:
            tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
            assert [r.success for r in finish(tier)] == [True]
        finally:
            tier.shutdown()
    finally:
        os.umask(old)
    blocks = {
        p: oct(m) for p, m in modes_under(tmp_path / "kv").items() if p.endswith(".bin")
    }
    assert len(blocks) == 2, blocks
    assert set(blocks.values()) == {oct(file_mode)}


def test_group_access_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match="group_access of the 'fs_python' tier"):
        make_tier(tmp_path, rows(2), group_access="yes")


def test_wider_modes_found_at_start_are_reported_once(tmp_path, caplog):
    """Block files and directories made readable by others (written before
    this change, or by hand) are reported once at start with their count, an
    example and the fix, instead of being used silently."""
    kv = rows(4)
    tier = make_tier(tmp_path, kv)
    try:
        tier.submit_store(job(1, [key(1), key(2)], [0, 1]))
        assert [r.success for r in finish(tier)] == [True]
        block = tier.file_mapper.get_file_name(key(1))
    finally:
        tier.shutdown()
    os.chmod(block, 0o644)
    os.chmod(os.path.dirname(block), 0o755)

    with caplog.at_level("WARNING", logger="vllm.v1.kv_offload.tiering.fs"):
        tier = make_tier(tmp_path, kv)
        try:
            walk = getattr(tier, "_tmp_cleanup", None)  # runs in the background
            if walk is not None:
                walk.join()
            tier.submit_load(job(2, [key(1)], [2], load=True))
            assert [r.success for r in finish(tier)] == [True]
        finally:
            tier.shutdown()
    lines = [r.getMessage() for r in caplog.records if "wider modes" in r.getMessage()]
    assert len(lines) == 1, "wider modes were not reported (once)"
    assert (
        f"'fs_python' KV offload tier at {tmp_path}: 2 file(s) and directories"
        in lines[0]
    )
    assert os.path.dirname(block) in lines[0]
    assert f"chmod -R go-rwx {tmp_path}" in lines[0]


def test_a_link_put_where_a_directory_was_made_is_not_followed(
    tmp_path, monkeypatch
):
    """A directory the tier made is replaced by a link before its mode is set
    (with group_access, any member of the group can): the store fails, and
    the link's target keeps its mode, where chmod(path) would have given it
    the tier's (02770: the engine user's directory, writable by the group)."""
    import vllm.v1.kv_offload.tiering.fs.io as io_mod

    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", False)
    tier = make_tier(tmp_path / "kv", rows(2), group_access=True)
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    target.chmod(0o700)
    real_mkdir = os.mkdir

    def mkdir_then_link(path, mode=0o777, **kwargs):
        real_mkdir(path, mode, **kwargs)
        os.rmdir(path)
        os.symlink(target, path)

    try:
        monkeypatch.setattr(os, "mkdir", mkdir_then_link)
        tier.submit_store(job(1, [key(1)], [0]))
        assert [r.success for r in finish(tier)] == [False]
    finally:
        monkeypatch.undo()
        tier.shutdown()
    assert oct(stat.S_IMODE(os.stat(target).st_mode)) == oct(0o700)


# ---------------------------------------------------------------------------
# (2) unsafe roots refused, symbolic links not followed
# ---------------------------------------------------------------------------


def _refused(root, **config) -> str:
    """The ValueError message of a tier refused at start, which must come
    before any thread starts or anything is created under *root*."""
    threads = set(threading.enumerate())
    before = sorted(os.listdir(root)) if os.path.isdir(root) else None
    with pytest.raises(ValueError) as refused:
        make_tier(root, rows(2), **config)
    assert set(threading.enumerate()) <= threads, "refused after starting threads"
    after = sorted(os.listdir(root)) if os.path.isdir(root) else None
    assert after == before, "refused after creating files"
    return str(refused.value)


@pytest.mark.parametrize(
    ("mode", "config", "refusal"),
    [
        (0o777, {}, "is writable by all users"),
        (0o777, {"group_access": True}, "is writable by all users"),
        (0o770, {}, "is writable by its group"),
        (0o757, {}, "is writable by all users"),
        (0o1777, {}, "is writable by all users (the sticky bit"),
        (0o1777, {"group_access": True}, "is writable by all users (the sticky bit"),
    ],
)
def test_a_root_others_can_write_is_refused(tmp_path, mode, config, refusal):
    """A root writable by other users (or by its group, unless the tier
    shares it with the group) is refused at start, naming the path, its mode
    and owner and the fix, before any thread starts; with the sticky bit too
    (1777), as anyone can still pre-create the tier's directories and plant
    config.json and block files in it. Before: used as is, anyone could
    plant block files."""
    root = tmp_path / "kv"
    root.mkdir()
    os.chmod(root, mode)
    message = _refused(root, **config)
    assert f"root_dir {str(root)!r} of the 'fs_python' tier is unsafe" in message
    assert f"{root} (mode {mode:04o}, owner uid {os.geteuid()}" in message
    assert refusal in message
    if mode & 0o1000:  # a scratch directory such as /tmp: not to chmod
        assert f"Fix: use a directory in it as root_dir, e.g. {root}/" in message
    else:
        assert f"Fix: chmod {'o-w' if config else 'go-w'} {root}" in message or (
            f"Fix: chmod g-w {root}" in message and "'group_access': true" in message
        )


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


def test_a_root_the_tier_created_is_used_again_under_umask_002(tmp_path):
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
                assert [r.success for r in finish(tier)] == [True]
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
    assert "of the 'fs_python' tier cannot be checked" in message
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
        assert [r.success for r in finish(tier)] == [True]
        assert tier.lookup(key(1), _CTX) is True
    finally:
        tier.shutdown()


def test_a_root_given_through_a_symlink_is_used_resolved(tmp_path):
    """A root_dir reached through a symbolic link is checked resolved, and
    the tier then uses that resolved directory for everything (file mapper,
    config.json, blocks): repointing the link after the check moves nothing."""
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
        assert os.path.isfile(tier.file_mapper.get_config_file_path())
        link.unlink()
        link.symlink_to(other, target_is_directory=True)
        tier.submit_store(job(1, [key(1)], [0]))
        assert [r.success for r in finish(tier)] == [True]
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


def test_the_o_direct_probe_never_writes_through_a_planted_link(tmp_path, monkeypatch):
    """The O_DIRECT probe creates its temp file exclusively and never
    follows a link: a symlink planted at its name (the root may be
    group-writable) leaves the file it points to as it was. Before: the
    probe wrote a block of zeros through it."""
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    if not fs_io.O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setattr(fs_io, "get_tmp_suffix", lambda: "_7.tmp")
    os.symlink(victim, root / ".o_direct_probe_7.tmp")
    with contextlib.suppress(OSError):
        fs_io.probe_o_direct(str(root))
    assert victim.read_bytes() == b"precious"


def test_a_symlink_at_a_block_path_is_a_miss(tmp_path):
    """A symbolic link planted at a block's path (to a file of the right
    size) is a miss: lookup says so, a load fails without reading through
    it (O_NOFOLLOW), and the target is left as it was. Before: the target's
    bytes were served as the key's KV, a successful load."""
    kv = rows(4)
    kv[0] = 1
    tier = make_tier(tmp_path / "kv", kv)
    try:
        tier.submit_store(job(1, [key(1)], [0]))
        assert [r.success for r in finish(tier)] == [True]
        path = tier.file_mapper.get_file_name(key(1))
        target = tmp_path / "elsewhere.bin"
        target.write_bytes(bytes([9]) * os.path.getsize(path))
        os.remove(path)
        os.symlink(target, path)

        looked_up = tier.lookup(key(1), _CTX)
        tier.submit_load(job(2, [key(1)], [1], load=True))
        (result,) = finish(tier)
        assert not (kv[1] == 9).all(), "served a symlink's target as the key's KV"
        assert not result.success
        assert looked_up is False
        assert tier.lookup(key(1), _CTX) is False
        assert target.read_bytes() == bytes([9]) * os.path.getsize(target)
    finally:
        tier.shutdown()


@pytest.mark.xfail(
    strict=True,
    reason="io.py (shared with the upstream track) guards only a block's own "
    "name (O_NOFOLLOW): a directory of the tree replaced by a link is "
    "followed. The tree is private (0700) unless group_access",
)
def test_a_symlinked_directory_in_the_tree_is_a_miss(tmp_path):
    """A block's directory replaced by a symbolic link to another directory
    holding a file of the block's name and size: the load fails without
    serving it or removing it (it is not the tier's), the key is a miss from
    then on, and a store does not write through the link either."""
    kv = rows(4)
    kv[0] = 1
    tier = make_tier(tmp_path / "kv", kv)
    try:
        tier.submit_store(job(1, [key(1)], [0]))
        assert [r.success for r in finish(tier)] == [True]
        path = tier.file_mapper.get_file_name(key(1))
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        planted = elsewhere / os.path.basename(path)
        planted.write_bytes(bytes([9]) * os.path.getsize(path))
        block_dir = os.path.dirname(path)
        os.remove(path)
        os.rmdir(block_dir)
        os.symlink(elsewhere, block_dir)

        tier.submit_load(job(2, [key(1)], [1], load=True))
        (result,) = finish(tier)
        assert not result.success, "served a file behind a symlinked directory"
        assert planted.read_bytes() == bytes([9]) * len(planted.read_bytes())
        assert tier.lookup(key(1), _CTX) is False
        kv[2] = 5
        tier.submit_store(job(3, [key(1)], [2]))
        (result,) = finish(tier)
        assert not result.success
        assert planted.read_bytes()[:1] == bytes([9])
        assert sorted(os.listdir(elsewhere)) == [planted.name]
    finally:
        tier.shutdown()


def test_a_link_behind_a_symlinked_directory_is_neither_read_nor_removed(
    tmp_path,
):
    """A block's directory replaced by a link to another directory in which
    the block's name is itself a link: the load fails as through a linked
    directory, and removes nothing there (not the link, not its target)."""
    kv = rows(4)
    tier = make_tier(tmp_path / "kv", kv)
    try:
        tier.submit_store(job(1, [key(1)], [0]))
        assert [r.success for r in finish(tier)] == [True]
        path = tier.file_mapper.get_file_name(key(1))
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        target = tmp_path / "target.bin"
        target.write_bytes(bytes([9]) * os.path.getsize(path))
        (elsewhere / os.path.basename(path)).symlink_to(target)
        block_dir = os.path.dirname(path)
        os.remove(path)
        os.rmdir(block_dir)
        os.symlink(elsewhere, block_dir)

        tier.submit_load(job(2, [key(1)], [1], load=True))
        (result,) = finish(tier)
        assert not result.success
        assert not (kv[1] == 9).all()
        assert os.path.islink(elsewhere / os.path.basename(path))
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


def _failure_lines(caplog) -> list[str]:
    lines = [r.getMessage() for r in caplog.records]
    return [line for line in lines if "since the previous report" in line]


@pytest.mark.parametrize("keyed", [True, False], ids=["key_file", "no_key"])
def test_a_planted_block_for_a_known_prefix(tmp_path, caplog, keyed):
    """Block hashes are deterministic (so that a restart hits), so anyone who
    can write to a shared store can compute the file name of a known prefix
    (a public system prompt) and plant a block file of the right size there.

    Without a key (documents today's behaviour) the tier serves it as that
    prefix's KV, checksum or not: anyone can compute an unkeyed checksum
    and set it with the file. With a key, the planted file at the computable
    name is never looked at; and one planted at the keyed name (right size,
    and a valid unkeyed CRC32C where the MAC is kept) fails the MAC on load:
    a miss, the file removed, and counted in the tier's failure report."""
    from vllm.v1.kv_offload.file_mapper import FileMapper
    from vllm.v1.kv_offload.tiering.fs.io import CRC_XATTR, crc32c

    config = {"key_file": key_file(tmp_path / "key")} if keyed else {}
    root = tmp_path / "kv"
    kv = rows(4)
    prefix = key(7)
    tier = make_tier(root, kv, **config)
    try:
        # the attacker: the unkeyed name of the prefix, computed without the key
        unkeyed = (
            FileMapper(root_dir=str(root), **_mapper_fields(tier.file_mapper))
            if keyed
            else tier.file_mapper  # today's names: anyone can compute them
        ).get_file_name(prefix)
        evil = bytes([0xEE]) * kv.shape[1]
        os.makedirs(os.path.dirname(unkeyed), exist_ok=True)
        with open(unkeyed, "wb") as f:
            f.write(evil)
        if keyed:
            from vllm.v1.kv_offload.tiering.fs.io import MAC_XATTR

            assert tier.file_mapper.get_file_name(prefix) != unkeyed
            assert tier.lookup(prefix, _CTX) is False
            # an insider who knows the keyed name still cannot forge the MAC:
            # a valid unkeyed CRC32C where the MAC is kept
            planted = tier.file_mapper.get_file_name(prefix)
            os.makedirs(os.path.dirname(planted), exist_ok=True)
            with open(planted, "wb") as f:
                f.write(evil)
            os.setxattr(planted, MAC_XATTR, crc32c(memoryview(evil)).ljust(32, b"\0"))
        else:
            planted = unkeyed
            if tier._checksum:  # on by default: anyone can compute a CRC32C
                os.setxattr(planted, CRC_XATTR, crc32c(memoryview(evil)))
        assert tier.lookup(prefix, _CTX) is True
        with caplog.at_level("ERROR", logger="vllm.v1.kv_offload.tiering.fs"):
            tier.submit_load(job(1, [prefix], [0], load=True))
            (result,) = finish(tier)
        served = result.success and (kv[0] == 0xEE).all()
        if not keyed:
            assert served, "today a planted file is served as the prefix's KV"
            return
        assert not served, "served a planted block file as the prefix's KV"
        assert not os.path.exists(planted)
        assert tier.lookup(prefix, _CTX) is False
        (line,) = _failure_lines(caplog)
        assert "0 store job(s) and 1 load job(s) failed" in line
        assert "1 not loaded and recomputed (1 of them failed the integrity " in line
        assert "hmac-sha256 MAC mismatch: not written with the tier's key" in line
    finally:
        tier.shutdown()


def _mapper_fields(mapper) -> dict:
    fields = dict(mapper.fields)
    return {
        "model_name": fields.pop("model_name"),
        "hash_block_size": fields.pop("hash_block_size"),
        "gpu_blocks_per_file": fields.pop("gpu_blocks_per_file"),
        "tp_size": fields.pop("tp_size"),
        "pp_size": fields.pop("pp_size"),
        "pcp_size": fields.pop("pcp_size"),
        "dcp_size": fields.pop("dcp_size"),
        "rank": mapper.rank,
        "dtype": fields.pop("dtype"),
        "kv_cache_groups": fields.pop("kv_cache_groups"),
        "checksum": fields.pop("checksum", None),
    }


@pytest.mark.parametrize("block_bytes", [mmap.PAGESIZE, 1280], ids=["aligned", "odd"])
def test_cold_restart_with_the_same_key_hits_another_key_misses(tmp_path, block_bytes):
    """Engines sharing a root and a key file share blocks across a restart;
    an engine with another key (another namespace) neither finds them nor
    loads them, and a keyed store never reuses unkeyed files."""
    root = tmp_path / "kv"
    same = key_file(tmp_path / "key")
    other = key_file(tmp_path / "other-key")
    kv = np.zeros((4, block_bytes), dtype=np.uint8)
    kv[0], kv[1] = 3, 4
    keys = [key(1), key(2, group=1)]
    writer = make_tier(root, kv, key_file=same)
    try:
        writer.submit_store(job(1, keys, [0, 1]))
        assert [r.success for r in finish(writer)] == [True]
        names = [writer.file_mapper.get_file_name(k) for k in keys]
    finally:
        writer.shutdown()
    for k, name in zip(keys, names):
        assert get_offload_hash_hex(k) not in name

    kv[:] = 0
    restarted = make_tier(root, kv, key_file=same)
    try:
        assert [restarted.lookup(k, _CTX) for k in keys] == [True, True]
        restarted.submit_load(job(2, keys, [2, 3], load=True))
        assert [r.success for r in finish(restarted)] == [True]
        assert (kv[2] == 3).all() and (kv[3] == 4).all()
    finally:
        restarted.shutdown()

    for config in ({"key_file": other}, {}):
        stranger = make_tier(root, kv, **config)
        try:
            assert [stranger.lookup(k, _CTX) for k in keys] == [False, False]
        finally:
            stranger.shutdown()


def get_offload_hash_hex(k: OffloadKey) -> str:
    from vllm.v1.kv_offload.base import get_offload_block_hash

    return get_offload_block_hash(k).hex()


@pytest.mark.parametrize(
    ("case", "refusal"),
    [
        ("missing", "does not exist"),
        ("empty", "is empty"),
        ("31 bytes", "is too short (31 bytes, at least 32 needed)"),
        ("readable by others", "is accessible by others (mode 0644)"),
        ("readable by its group", "is accessible by its group (mode 0640)"),
        ("a directory", "is not a regular file"),
        ("inline secret", "must be the absolute path of a file holding the key"),
    ],
)
def test_a_bad_key_file_is_refused_before_any_thread_starts(tmp_path, case, refusal):
    """A key file that is missing, empty, shorter than 32 bytes, readable by
    others (or by the group without group_access) or not a file is refused
    with a ValueError naming the path and the fix, before any thread starts
    and without the key's bytes in the message."""
    path = tmp_path / "key"
    secret = b"s3cr3t-" * 8
    if case == "empty":
        key_file(path, b"")
    elif case == "31 bytes":
        secret = secret[:31]
        key_file(path, secret)
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
        assert f"key_file {str(path)!r} of the 'fs_python' tier" in message
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
    assert (
        f"key_file {str(path)!r} of the 'fs_python' tier is not a regular file"
        in message
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


def test_the_key_is_never_logged_or_written(tmp_path, caplog):
    """Neither the key nor the keys derived from it appear in the logs (of a
    start, a store, a load, a failed load and a shutdown), in config.json,
    or in the repr of the tier's objects."""
    from vllm.v1.kv_offload.tiering.fs.security import _hkdf_sha256

    secret = os.urandom(48)
    path = key_file(tmp_path / "key", secret)
    derived = [_hkdf_sha256(secret, info) for info in (b"file names", b"block MAC")]
    kv = rows(4)
    with caplog.at_level("DEBUG"):
        tier = make_tier(tmp_path / "kv", kv, key_file=path)
        try:
            tier.submit_store(job(1, [key(1)], [0]))
            assert [r.success for r in finish(tier)] == [True]
            block = tier.file_mapper.get_file_name(key(1))
            with open(block, "r+b") as f:
                f.write(b"x")
            tier.submit_load(job(2, [key(1)], [1], load=True))
            assert [r.success for r in finish(tier)] == [False]
            texts = [repr(tier._checksum), repr(tier.file_mapper.__dict__)]
        finally:
            tier.shutdown()
    with open(tier.file_mapper.get_config_file_path()) as f:
        texts.append(f.read())
    texts += [r.getMessage() for r in caplog.records]
    assert texts
    for value in [secret, *derived]:
        for form in (value.hex(), repr(value), value.hex()[:16]):
            assert not [t for t in texts if form in t], "the key was logged"


def test_a_key_file_replaces_the_checksum(tmp_path):
    path = key_file(tmp_path / "key")
    message = _refused(tmp_path / "kv", key_file=path, checksum="crc32c")
    assert "key_file replaces its checksum" in message
