# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import random
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterable

import regex as re

try:
    import xxhash
except ImportError:  # optional: the crc32 checksum needs no package
    xxhash = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

# O_DIRECT is Linux-specific and not available on macOS
O_DIRECT = getattr(os, "O_DIRECT", 0)

# Thread-local storage for unique temporary file suffixes
_thread_local = threading.local()

# The fs tier's temp files, see _get_tmp_suffix(): a block's
# (<hash_hex>.bin_<n>.tmp), the O_DIRECT probe's (.direct_io_probe_<n>.tmp)
# and config.json's (config.json_<n>.tmp).
_TMP_NAME_RE = re.compile(r"(?:\.bin|\.direct_io_probe|^config\.json)_[0-9]+\.tmp$")


def _get_tmp_suffix() -> str:
    """Generate a thread-local unique suffix for temporary files."""
    try:
        return _thread_local.tmp_suffix
    except AttributeError:
        _thread_local.tmp_suffix = f"_{random.randint(0, 2**63 - 1)}.tmp"
        return _thread_local.tmp_suffix


def remove_stale_tmp_files(
    directories: Iterable[str], max_age_s: float, stop: threading.Event
) -> tuple[int, int]:
    """Remove this module's temp files under *directories* that were last
    modified more than *max_age_s* seconds ago: left by writers killed between
    writing a block and renaming it into place (a live writer renames within
    milliseconds). Several engines may share a directory, so age is the only
    evidence a writer is gone. Other files are kept. Returns the number and
    bytes of the removed files. Stops early when *stop* is set.
    """
    oldest_kept = time.time() - max_age_s
    removed = removed_bytes = 0
    for directory in directories:
        for dirpath, _, filenames in os.walk(directory):
            if stop.is_set():
                return removed, removed_bytes
            for name in filenames:
                if _TMP_NAME_RE.search(name) is None:
                    continue
                path = os.path.join(dirpath, name)
                with contextlib.suppress(OSError):
                    st = os.lstat(path)
                    if not stat.S_ISREG(st.st_mode) or st.st_mtime > oldest_kept:
                        continue
                    os.remove(path)
                    removed += 1
                    removed_bytes += st.st_size
    return removed, removed_bytes


# xxh3_64 is the fastest (about 4x zlib's crc32 on 64 KiB blocks). Off by
# default: on 64 KiB blocks it cost far more than 5% of the tier's store and
# load throughput (bench/disk_bench.py).
CHECKSUMS = ("none", "xxh3_64", "crc32")


class BlockChecksum:
    """A checksum of each block's key and bytes, stored in a trailer after
    the block in its file and verified by every load: a file overwritten
    with bytes of the same size (another key's block, a flipped bit, zeroed
    pages) fails its load instead of being served as the key's block.

    The trailer is a page for page-aligned blocks, so that O_DIRECT can
    write and read it with the block, else the 8 bytes of the checksum.
    """

    def __init__(self, algorithm: str, block_size: int) -> None:
        if algorithm == "xxh3_64" and xxhash is None:
            raise ValueError(
                "the fs_python tier's checksum 'xxh3_64' needs the xxhash "
                "package: install it (pip install xxhash) or set the tier's "
                "'checksum' to 'crc32' or 'none'"
            )
        self.algorithm = algorithm
        self.trailer_size = mmap.PAGESIZE if block_size % mmap.PAGESIZE == 0 else 8

    def describe(self) -> dict:
        """The fields that determine the file format, for FileMapper."""
        return {"algorithm": self.algorithm, "trailer_bytes": self.trailer_size}

    def compute(self, key: bytes, data: memoryview) -> bytes:
        if self.algorithm == "xxh3_64":
            value = xxhash.xxh3_64_intdigest(data, seed=xxhash.xxh3_64_intdigest(key))
        else:
            value = zlib.crc32(data, zlib.crc32(key))
        return value.to_bytes(8, "little")

    def trailer(self) -> memoryview:
        """This thread's page-aligned trailer buffer (O_DIRECT needs it)."""
        buf = getattr(_thread_local, "trailer", None)
        if buf is None:
            buf = _thread_local.trailer = mmap.mmap(-1, mmap.PAGESIZE)
        return memoryview(buf)[: self.trailer_size]


def _ensure_dirs(path: str, on_new_dir: Callable[[], None] | None = None) -> None:
    """Create parent directories of *path* if they don't exist, then call
    *on_new_dir* (e.g. to re-create what a removed root held)."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
        if on_new_dir is not None:
            on_new_dir()


# Errors of the O_DIRECT probe that say nothing about O_DIRECT support (a
# full disk or quota, a failing device, a signal): worth probing again later.
TRANSIENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EAGAIN, errno.EINTR, errno.ENOMEM}
)


def probe_direct_io(
    directory: str, buffer: memoryview, block_size: int
) -> tuple[str | None, bool]:
    """Check whether blocks of *buffer* can be written and read with O_DIRECT
    in *directory*.

    O_DIRECT needs the buffer address, the length and the file offset to be
    multiples of the device's logical block size (at most the page size on
    common devices), and a filesystem that supports it.

    Returns:
        (None, False) if O_DIRECT works, else the reason why buffered I/O is
        used and whether that failure may be transient (TRANSIENT_ERRNOS: a
        later probe may succeed).
    """
    if not O_DIRECT:
        return "O_DIRECT is not available on this platform", False
    flat = buffer.cast("B")
    address = ctypes.addressof(ctypes.c_char.from_buffer(flat)) if len(flat) else 0
    if block_size % mmap.PAGESIZE or address % mmap.PAGESIZE:
        return (
            f"the primary tier's rows ({block_size} bytes at address "
            f"{address:#x}) are not aligned to the page size ({mmap.PAGESIZE})"
        ), False
    probe_path = os.path.join(directory, f".direct_io_probe{_get_tmp_suffix()}")
    probe_buf = mmap.mmap(-1, block_size)
    try:
        # Created without O_DIRECT first: a directory that cannot be written
        # is a configuration error, not a reason for buffered I/O.
        os.close(os.open(probe_path, os.O_CREAT | os.O_WRONLY, 0o644))
        try:
            fd = os.open(probe_path, os.O_RDWR | O_DIRECT)
            try:
                os.write(fd, probe_buf)
                os.preadv(fd, [probe_buf], 0)
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno in TRANSIENT_ERRNOS:
                return f"the O_DIRECT probe failed ({e})", True
            return f"O_DIRECT I/O is not supported here ({e})", False
    finally:
        probe_buf.close()
        with contextlib.suppress(OSError):
            os.remove(probe_path)
    return None, False


def store_block(
    dest_path: str,
    buffer: memoryview,
    offset: int,
    block_size: int,
    direct_io: bool = True,
    overwrite: bool = False,
    key: bytes = b"",
    checksum: BlockChecksum | None = None,
    on_new_dir: Callable[[], None] | None = None,
) -> None:
    """
    Store callback: Writes to a temp file then atomically replaces the destination.
    Uses O_DIRECT if direct_io (see probe_direct_io()), else buffered I/O.

    An existing block file is kept (no redundant write) only if it is a
    regular file of exactly block_size bytes (plus the checksum's trailer);
    anything else at dest_path (a short or long file, an empty directory) is
    replaced, and a store that cannot replace it (a non-empty directory)
    fails: a store never reports success for bytes it did not write. With
    overwrite (the file's load failed), even a complete-looking file is
    replaced. With a checksum, the file holds the block followed by the
    checksum's trailer (of *key* and the block). *on_new_dir* is called
    after the block's directory had to be created.
    """
    file_size = block_size + (checksum.trailer_size if checksum else 0)
    try:
        st = os.lstat(dest_path)
    except FileNotFoundError:
        st = None
    if st is not None:
        complete = stat.S_ISREG(st.st_mode) and st.st_size == file_size
        if complete and not overwrite:
            return
        if stat.S_ISDIR(st.st_mode):
            try:
                os.rmdir(dest_path)
            except OSError as e:
                raise OSError(
                    f"cannot store block at {dest_path}: a directory is in the "
                    f"way and cannot be removed ({e})"
                ) from None

    tmp_path = dest_path + _get_tmp_suffix()
    # Ensure parent directories exist
    _ensure_dirs(dest_path, on_new_dir)

    # Write block atomically. Cast to a flat byte view so the slice uses byte
    # indices; the raw memoryview may be multi-dimensional with itemsize > 1.
    view_slice = buffer.cast("B")[offset : offset + block_size]
    chunks = [view_slice]
    if checksum is not None:
        trailer = checksum.trailer()
        trailer[:] = bytes(len(trailer))
        trailer[:8] = checksum.compute(key, view_slice)
        chunks.append(trailer)
    try:
        fd = os.open(
            tmp_path,
            os.O_CREAT
            | os.O_EXCL
            | os.O_WRONLY
            | os.O_TRUNC
            | (O_DIRECT if direct_io else 0),
            0o644,
        )
        try:
            written = os.writev(fd, chunks)
            if written < file_size:
                raise OSError(
                    f"Short write: expected {file_size} bytes, wrote {written}"
                )
        finally:
            os.close(fd)
        os.replace(tmp_path, dest_path)
    except Exception:
        try:
            os.remove(tmp_path)
        except OSError as cleanup_exc:
            logger.warning("Failed to remove temp file %s: %s", tmp_path, cleanup_exc)
        raise


def load_block(
    source_path: str,
    view: memoryview,
    offset: int,
    block_size: int,
    direct_io: bool = True,
    key: bytes = b"",
    checksum: BlockChecksum | None = None,
) -> None:
    """
    Load callback: read one KV block from disk. Remove the file on failure.
    Uses O_DIRECT if direct_io (see probe_direct_io()), else buffered I/O.
    Only a regular file of exactly block_size bytes (plus the checksum's
    trailer) holds a block: anything else (a shorter or longer file, a
    directory) fails the load, and so does a block whose checksum does not
    match its bytes and *key*.
    """
    fd: int | None = None
    view_slice = view.cast("B")[offset : offset + block_size]
    chunks = [view_slice]
    file_size = block_size
    if checksum is not None:
        chunks.append(checksum.trailer())
        file_size += checksum.trailer_size
    try:
        fd = os.open(source_path, os.O_RDONLY | (O_DIRECT if direct_io else 0))
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{source_path} is not a regular file")
        if st.st_size != file_size:
            raise OSError(
                f"{source_path} has {st.st_size} bytes, not a block of {file_size}"
            )
        bytes_read = os.readv(fd, chunks)
        if bytes_read < file_size:
            raise OSError(f"Short read: expected {file_size} bytes, read {bytes_read}")
        if checksum is not None and chunks[1][:8] != checksum.compute(key, view_slice):
            raise OSError(
                f"{source_path} does not hold the block stored for its key "
                f"({checksum.algorithm} checksum mismatch)"
            )
    except Exception as exc:
        try:
            os.remove(source_path)
        except OSError as cleanup_exc:
            # Reported with the load's error (rate-limited by the thread
            # pool), not logged here: the tier answers the key as a miss
            # from now on, so this happens once per key, not per retry.
            raise OSError(
                f"{exc}; {source_path} could not be removed either "
                f"({cleanup_exc}): a miss until stored again"
            ) from exc
        raise
    finally:
        if fd is not None:
            os.close(fd)
