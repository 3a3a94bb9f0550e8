# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fs tier's files are private: KV blocks are derived from users' prompts,
so what the tier creates is 0600 (files) and 0700 (directories) whatever the
umask, on the C and the Python I/O paths (0640 and 2770 with group_access, for
a root shared by one group's service accounts), and config.json is written
whole or not at all."""

import os
import resource
import signal
import stat

import pytest

import vllm.v1.kv_offload.tiering.fs.io as io_mod
from tests.v1.kv_offload.tiering.test_fs_tier import (
    _MOCK_OFFLOADING_SPEC,
    _page_aligned_zero_tensor,
    drain,
    key,
    make_job,
)
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager


def make_tier(root, **config) -> FileSystemTierManager:
    tensor = _page_aligned_zero_tensor(4, 1024)
    return FileSystemTierManager(
        offloading_spec=_MOCK_OFFLOADING_SPEC,
        primary_kv_view=memoryview(tensor.numpy()),
        tier_type="fs",
        root_dir=str(root),
        n_read_threads=1,
        n_write_threads=1,
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
    """A umask of 0, as some container images run with: os.makedirs and
    open() then create 0777 directories and 0666 files."""
    old = os.umask(0)
    yield
    os.umask(old)


@pytest.mark.parametrize("use_c_ext", [True, False], ids=["c_ext", "python"])
def test_tier_creates_private_files_under_a_permissive_umask(
    tmp_path, monkeypatch, permissive_umask, use_c_ext
):
    """Under umask 0, every file the tier creates (block files, config.json)
    is 0600 and every directory (the missing root and its parents included)
    0700. Before: 0644 block files, a 0666 config.json and 0777 directories:
    anyone could read the cached KV, and write into the tree."""
    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)
    tier = make_tier(tmp_path / "shared" / "kv")
    try:
        tier.submit_store(make_job(1, [key(1), key(2)], [0, 1]))
        tier.submit_store(make_job(2, [key(3)], [2]))
        assert [r.success for r in drain(tier)] == [True, True]
    finally:
        tier.shutdown()
    found = modes_under(tmp_path / "shared")
    files = {p: oct(m) for p, m in found.items() if os.path.isfile(p)}
    dirs = {p: oct(m) for p, m in found.items() if os.path.isdir(p)}
    assert len(files) == 4, files  # config.json and 3 blocks
    assert any(p.endswith("config.json") for p in files)
    assert files == dict.fromkeys(files, oct(0o600))
    assert dirs == dict.fromkeys(dirs, oct(0o700))


def test_a_link_put_where_a_directory_was_made_is_not_followed(tmp_path, monkeypatch):
    """A directory the tier made is replaced by a link before its mode is set
    (whoever may write its parent can): the store fails, and the link's
    target keeps its mode, where chmod(path) would have given it the tier's."""
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", False)
    tier = make_tier(tmp_path / "kv")
    target = tmp_path / "target"
    target.mkdir(mode=0o755)
    target.chmod(0o755)
    real_mkdir = os.mkdir

    def mkdir_then_link(path, mode=0o777, **kwargs):
        real_mkdir(path, mode, **kwargs)
        os.rmdir(path)
        os.symlink(target, path)

    try:
        monkeypatch.setattr(os, "mkdir", mkdir_then_link)
        tier.submit_store(make_job(1, [key(1)], [0]))
        assert [r.success for r in drain(tier)] == [False]
    finally:
        monkeypatch.undo()
        tier.shutdown()
    assert oct(stat.S_IMODE(os.stat(target).st_mode)) == oct(0o755)


def test_a_config_write_cut_short_leaves_no_partial_config(tmp_path):
    """config.json written as the disk fills up (here a file size limit cuts
    the write after 16 bytes): no truncated config.json is left to describe
    the directory for good; the next start writes it whole."""
    root = tmp_path / "root"
    make_tier(root).shutdown()
    config_path = next(root.rglob("config.json"))
    config = config_path.read_bytes()
    config_path.unlink()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    sigxfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))
        with pytest.raises(OSError):
            make_tier(root)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, sigxfsz)
    assert not config_path.exists(), "a partial config.json was left"
    assert [p.name for p in config_path.parent.iterdir()] == []
    make_tier(root).shutdown()
    assert config_path.read_bytes() == config


@pytest.mark.parametrize("umask", [0o077, 0o000], ids=["umask077", "umask000"])
@pytest.mark.parametrize("use_c_ext", [True, False], ids=["c_ext", "python"])
def test_group_access_modes_are_exact_whatever_the_umask(
    tmp_path, monkeypatch, use_c_ext, umask
):
    """With group_access the group must read blocks and write directories
    whatever the umask of the engine that created them (a stricter umask
    would lock the group's other engines out, a wider one let others in)."""
    if use_c_ext and not io_mod._HAS_FSIO_C:
        pytest.skip("fs_io_C extension not built")
    monkeypatch.setattr(io_mod, "_HAS_FSIO_C", use_c_ext)
    old = os.umask(umask)
    try:
        tier = make_tier(tmp_path / "kv", group_access=True)
        try:
            tier.submit_store(make_job(1, [key(1)], [0]))
            assert [r.success for r in drain(tier)] == [True]
        finally:
            tier.shutdown()
    finally:
        os.umask(old)
    found = modes_under(tmp_path / "kv")
    files = {p: oct(m) for p, m in found.items() if os.path.isfile(p)}
    dirs = {p: oct(m) for p, m in found.items() if os.path.isdir(p)}
    assert len(files) == 2, files  # config.json and the block
    assert files == dict.fromkeys(files, oct(0o640))
    assert dirs == dict.fromkeys(dirs, oct(0o2770))


def test_group_access_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match="group_access of the 'fs' tier"):
        make_tier(tmp_path, group_access="yes")
