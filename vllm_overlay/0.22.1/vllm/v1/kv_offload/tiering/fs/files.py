# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fs tier's files: the modes it creates them with, writes that leave a
file whole or not at all, and the start-up walk that removes the temp files
of killed writers and finds files with wider modes than the tier's."""

import contextlib
import os
import random
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import regex as re

from vllm.logger import init_logger

logger = init_logger(__name__)

# Thread-local storage for unique temporary file suffixes
_thread_local = threading.local()

# The tier's temp files, see get_tmp_suffix(): a block's
# (<hash_hex>.bin_<n>.tmp), the O_DIRECT and xattr probes'
# (.o_direct_probe_<n>.tmp, .direct_io_probe_<n>.tmp, .xattr_probe_<n>.tmp)
# and config.json's.
_TMP_NAME_RE = re.compile(
    r"(?:\.bin|\.o_direct_probe|\.direct_io_probe|\.xattr_probe|^config\.json)"
    r"_[0-9]+\.tmp$"
)


def get_tmp_suffix() -> str:
    """Generate a thread-local unique suffix for temporary files."""
    try:
        return _thread_local.tmp_suffix
    except AttributeError:
        _thread_local.tmp_suffix = f"_{random.randint(0, 2**63 - 1)}.tmp"
        return _thread_local.tmp_suffix


@dataclass(frozen=True)
class FileModes:
    """The modes of what the tier creates: KV blocks are users' data, so only
    the tier's own user (and, with group access, its group) may read them or
    write into the tree. Set exactly (fchmod after creating), whatever
    the process umask."""

    file: int
    dir: int


PRIVATE_MODES = FileModes(file=0o600, dir=0o700)
# For a root shared between service accounts of one group: the group reads
# blocks and stores into directories another account created (group write;
# setgid, so that what is created below keeps the group).
GROUP_MODES = FileModes(file=0o640, dir=0o2770)


def _is_dir(path: str) -> bool:
    """os.path.isdir() that raises what is not a missing path (EIO, ESTALE):
    a failing disk stops a batch, it must not pass for EEXIST, a block's own
    failure."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def make_dirs(path: str, modes: FileModes = PRIVATE_MODES) -> bool:
    """Create *path* and its missing parents with modes.dir (os.makedirs gives
    them 0o777 & ~umask). Returns whether any was created."""
    missing = []
    while path and not _is_dir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, modes.dir)
        except FileExistsError:
            if not _is_dir(directory):
                raise
            continue  # created by another thread or engine meanwhile
        # through an fd opened without following a link: whoever may write the
        # parent could have put one there meanwhile, and chmod(path) would
        # change the link's target
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, modes.dir)
        finally:
            os.close(fd)
    return bool(missing)


def write_file_atomically(path: str, data: bytes, modes: FileModes) -> None:
    """Write *data* to *path* through a temp file renamed into place, with
    modes.file: a reader (another engine sharing the root) never sees part
    of it, and a write cut short (a full disk, a crash) leaves no *path*."""
    tmp_path = path + get_tmp_suffix()
    try:
        fd = os.open(
            tmp_path,
            os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0),
            modes.file,
        )
        try:
            os.fchmod(fd, modes.file)
            view = memoryview(data)
            while view:  # a write may be short (a file size limit, NFS)
                view = view[os.write(fd, view) :]
            os.fsync(fd)  # a power cut after the rename leaves no empty file
        finally:
            os.close(fd)
        os.replace(tmp_path, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp_path)


@dataclass
class TierScan:
    """What scan_tier_files() found."""

    # stale temp files removed, and their bytes
    removed: int = 0
    removed_bytes: int = 0
    # files and directories with mode bits beyond the tier's modes
    too_open: int = 0
    too_open_example: tuple[str, int] | None = None  # (path, mode)


def scan_tier_files(
    directories: Iterable[str],
    max_tmp_age_s: float | None,
    modes: FileModes,
    stop: threading.Event,
) -> TierScan:
    """Walk the tier's *directories* once at start-up:

    - remove the tier's temp files (_TMP_NAME_RE) last modified more than
      *max_tmp_age_s*
      seconds ago (None: none): left by writers killed between writing a block
      and renaming it into place (a live writer renames within milliseconds).
      Several engines may share a directory, so age is the only evidence a
      writer is gone. Other files are kept;
    - count the files and directories with mode bits beyond *modes* (written
      before the tier created them private, or by hand), so that the tier
      reports them instead of silently serving from them.

    Stops early when *stop* is set.
    """
    oldest_kept = time.time() - (max_tmp_age_s or 0.0)
    scan = TierScan()

    def check_mode(path: str, mode: int, allowed: int) -> None:
        if stat.S_IMODE(mode) & ~allowed:
            scan.too_open += 1
            if scan.too_open_example is None:
                scan.too_open_example = (path, stat.S_IMODE(mode))

    for directory in directories:
        for dirpath, _, filenames in os.walk(directory):
            if stop.is_set():
                return scan
            with contextlib.suppress(OSError):
                check_mode(dirpath, os.lstat(dirpath).st_mode, modes.dir)
            for name in filenames:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if (
                    max_tmp_age_s is not None
                    and _TMP_NAME_RE.search(name) is not None
                    and stat.S_ISREG(st.st_mode)
                    and st.st_mtime <= oldest_kept
                ):
                    with contextlib.suppress(OSError):
                        os.remove(path)
                        scan.removed += 1
                        scan.removed_bytes += st.st_size
                    continue
                if not stat.S_ISLNK(st.st_mode):
                    check_mode(path, st.st_mode, modes.file)
    return scan


def scan_and_report(
    label: str,
    directories: Iterable[str],
    max_tmp_age_s: float | None,
    modes: FileModes,
    root_dir: str,
    stop: threading.Event,
) -> None:
    """scan_tier_files() (on a thread of its own), and say what it found:
    the stale temp files removed, and the files with wider modes (once, with
    an example and the fix)."""
    try:
        scan = scan_tier_files(directories, max_tmp_age_s, modes, stop)
    except Exception as e:
        logger.warning("%s: could not scan the tier's files: %s", label, e)
        return
    if scan.removed:
        logger.info(
            "%s: removed %d stale temp file(s) (%d bytes, not modified for %.0f s)",
            label,
            scan.removed,
            scan.removed_bytes,
            max_tmp_age_s,
        )
    if scan.too_open_example is not None:
        path, mode = scan.too_open_example
        group = modes is GROUP_MODES
        logger.warning(
            "%s: %d file(s) and directories of the tier have wider modes than "
            "%o (files) / %o (directories), e.g. %s (mode %o): users other "
            "than the tier's %s read or change cached KV blocks there. "
            "Restrict them, e.g. chmod -R %s %s",
            label,
            scan.too_open,
            modes.file,
            modes.dir,
            path,
            mode,
            "and its group may" if group else "may",
            "o-rwx" if group else "go-rwx",
            root_dir,
        )
