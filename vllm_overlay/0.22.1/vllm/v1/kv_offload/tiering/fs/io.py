# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

import contextlib
import errno
import fcntl
import hmac
import logging
import mmap
import os
import stat
from collections.abc import Sequence
from typing import NamedTuple

try:
    from vllm.fs_io_C import (  # pyright: ignore[reportMissingImports]
        batch_load_block as batch_load_block_C,
    )
    from vllm.fs_io_C import (
        batch_store_block as batch_store_block_C,
    )

    _HAS_FSIO_C = True
except ImportError:
    _HAS_FSIO_C = False

from vllm.v1.kv_offload.tiering.fs.files import (
    PRIVATE_MODES,
    FileModes,
    get_tmp_suffix,
    make_dirs,
)

logger = logging.getLogger(__name__)

# O_DIRECT is Linux-specific and not available on macOS
O_DIRECT = getattr(os, "O_DIRECT", 0)
# A symbolic link at a block's path (planted by whoever could write into the
# tree) is never read through: its target's bytes would be served as the
# key's KV.
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


# A block's own failures (missing, not a whole block): a batch goes on past
# them, and stops at any other, which the next blocks would meet too.
BLOCK_ERRNOS = frozenset(
    {errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.EBADMSG}
    | {errno.ENOTEMPTY, errno.EEXIST}
)


def has_compiled_io() -> bool:
    """Whether blocks are read and written by the fs_io_C extension."""
    return _HAS_FSIO_C


# The extended attribute that holds a block file's MAC (keyed namespace). It
# is set on the temp file before the rename, so a block file appears with it.
MAC_XATTR = "user.vllm.kv_mac"


class BlockIntegrityError(OSError):
    """A block file whose MAC (or CRC32C) does not match: damaged, planted
    or another key's. Counted apart in the tier's failure report."""


# The extended attribute that holds a block file's CRC32C (the tier's
# checksum_blocks option; upstream #57912's name), 4 bytes little-endian, set
# on the temp file before the rename like MAC_XATTR. Unkeyed: it detects
# damage (bit rot, a torn copy), not a file planted with its own CRC32C; that
# is key_file's job.
CRC_XATTR = "user.vllm.kv_crc32c"


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: memoryview) -> bytes:
    """The CRC32C (Castagnoli, as iSCSI and ext4) of *data*, as CRC_XATTR
    holds it. Byte by byte: the Python fallback's, under 10 MB/s; the
    compiled path computes it in C (the tier warns at start without it)."""
    table = _CRC32C_TABLE
    crc = 0xFFFFFFFF
    for byte in data.cast("B"):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return (crc ^ 0xFFFFFFFF).to_bytes(4, "little")


class BlockMac:
    """A keyed MAC (HMAC-SHA256) of each block's identity and bytes, kept in
    the block file's extended attribute MAC_XATTR (as upstream #57912 keeps
    its CRC32C), so that the file holds exactly one block and the compiled
    I/O path reads and writes the data unchanged. The identity is the tier's
    layout (FileMapper.layout_id(): model, layout, rank) and the block's key
    (block hash and group). Unlike a checksum, nobody without the tier's key
    can compute it, so a planted or altered file - right size, or another
    engine's block of another key or layout - fails its load. A file
    without the attribute was not written with the key: it fails too.

    HMAC-SHA256 because it was the fastest keyed MAC of the standard library
    (OpenSSL's SHA-256, with the CPU's SHA extensions; measured for 0.22.1's
    patch 0028: 1.8 GB/s on 2 MiB blocks, keyed BLAKE2b 0.75).
    """

    algorithm = "hmac-sha256"

    def __init__(self, mac_key: bytes, layout_id: str) -> None:
        self._keyed = hmac.new(mac_key, digestmod="sha256")
        layout = layout_id.encode()
        self._keyed.update(len(layout).to_bytes(2, "little") + layout)

    def compute(self, key: bytes, data: memoryview) -> bytes:
        mac = self._keyed.copy()
        mac.update(len(key).to_bytes(2, "little") + key)
        mac.update(data)  # hashlib releases the GIL on large buffers
        return mac.digest()

    def check(self, path: str, key: bytes, data: memoryview, read: "FileMac") -> None:
        """Raise BlockIntegrityError unless *read* (the MAC attribute of the
        file *data* was just read from, read from the same open file) is the
        MAC of *data* for *key*. The file is then removed, but only if *path*
        still is that file: another engine may have stored the block anew
        meanwhile, and its valid file is left alone."""
        if not hmac.compare_digest(read.mac, self.compute(key, data)):
            _remove_if_same_file(path, read)
            raise BlockIntegrityError(
                errno.EBADMSG,
                f"does not hold the block stored for its key ({self.algorithm} "
                "MAC mismatch: not written with the tier's key)",
                path,
            )

    def __repr__(self) -> str:
        return "BlockMac(hmac-sha256, key redacted)"


class FileMac(NamedTuple):
    """A block file's MAC_XATTR (b"" when it has none), read from the open
    file its block was read from, and that file's identity."""

    mac: bytes
    st_dev: int
    st_ino: int


def _read_mac(fd: int) -> bytes:
    try:
        return os.getxattr(fd, MAC_XATTR)
    except OSError as e:
        if e.errno != errno.ENODATA:
            raise  # the file is left, and the block fails with this error
        return b""


def _holds_mac(path: str, mac: bytes, name: str = MAC_XATTR) -> bool:
    """Whether the file at *path* has *mac* as its attribute *name*."""
    try:
        stored = os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return False
    return hmac.compare_digest(stored, mac)


def _check_crc(path: str, fd: int, data: memoryview, st: os.stat_result) -> None:
    """Raise BlockIntegrityError unless *data* (just read from *fd*) matches
    the CRC_XATTR of that open file; a file without one fails too. The file
    is then removed if *path* still is that file (see BlockMac.check)."""
    try:
        stored = os.getxattr(fd, CRC_XATTR)
    except OSError as e:
        if e.errno not in (errno.ENODATA, errno.ERANGE):
            raise  # the file is left, and the block fails with this error
        stored = b""
    if stored != crc32c(data):
        _remove_if_same_file(path, st)
        raise BlockIntegrityError(
            errno.EBADMSG,
            "does not hold the block stored (CRC32C mismatch, or none recorded)",
            path,
        )


def probe_xattr(directory: str) -> None:
    """Raise OSError unless a file in *directory* can hold a user extended
    attribute, MAC_XATTR or CRC_XATTR (some filesystems have none: older
    tmpfs, some NFS)."""
    path = os.path.join(directory, f".xattr_probe{get_tmp_suffix()}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | O_NOFOLLOW, 0o600)
    try:
        os.setxattr(fd, MAC_XATTR, bytes(32))
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(path)


# Errors of the O_DIRECT probe that say nothing about O_DIRECT support (a
# full disk or quota, a failing device, a signal): worth probing again later.
TRANSIENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EAGAIN, errno.EINTR, errno.ENOMEM}
)


def probe_o_direct(directory: str) -> bool:
    """Return whether ``O_DIRECT`` I/O works in *directory*.

    ``O_DIRECT`` is unsupported on some filesystems (e.g. the overlayfs backing
    a container ``/tmp``, older tmpfs, or some NFS mounts), where opening or
    writing a file with it fails with ``EINVAL``. Probe once with an aligned
    single-page write, and a read of it with ``O_DIRECT`` set by ``fcntl()``
    as loads set it (a filesystem may refuse it there, or at the read only,
    as an overlayfs over one without it), so callers can fall back to
    buffered I/O instead of failing on every block. A failure that says
    nothing about ``O_DIRECT`` support (TRANSIENT_ERRNOS, e.g. a full disk,
    or the probe's file replaced meanwhile) raises its ``OSError``, so that
    the caller can probe again later.
    """
    if not O_DIRECT:
        return False
    path = os.path.join(directory, f".o_direct_probe{get_tmp_suffix()}")
    page = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        # exclusive and never through a link: the root may be group-writable
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | O_NOFOLLOW | O_DIRECT
        fd = os.open(path, flags, 0o600)
        try:
            os.write(fd, page)
            written = os.fstat(fd)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (written.st_dev, written.st_ino):
                raise OSError(errno.EAGAIN, "The probe's file was replaced", path)
            fcntl.fcntl(fd, fcntl.F_SETFL, O_DIRECT)
            return os.readv(fd, [page]) == mmap.PAGESIZE
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno in TRANSIENT_ERRNOS:
            raise
        return False
    finally:
        page.close()
        with contextlib.suppress(OSError):
            os.remove(path)


def _ensure_dirs(path: str, modes: FileModes) -> None:
    """Create parent directories of *path* if they don't exist."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        make_dirs(parent, modes)


def _validate_offsets(view: memoryview, offsets: list[int], block_size: int) -> None:
    """Raise if any block would read/write past the bounds of `view`.

    Without this, an out-of-range offset silently clips to a shorter (or
    empty) slice instead of failing, since memoryview slicing follows
    Python's slice-clamping semantics rather than raising.
    """
    total_len = len(view.cast("B"))
    for offset in offsets:
        if offset < 0 or offset + block_size > total_len:
            raise ValueError(
                f"block offset {offset} (block_size {block_size}) is out of "
                f"bounds for a buffer of size {total_len}"
            )


def _is_complete_block(path: str, block_size: int) -> bool:
    """Whether *path* is a regular file of exactly one block (not a symlink).

    Stores are atomic and write exactly block_size bytes, so anything else at
    the path (an empty, truncated or longer file, a directory) is not a block
    this tier wrote.
    """
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == block_size


def is_block_path(path: str) -> bool:
    """Whether something other than a symbolic link is at *path* (lookup: a
    link is never read through, so it is a miss)."""
    try:
        return not stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def holds_no_block(path: str, block_size: int) -> bool:
    """Whether something that is not a complete block (see
    _is_complete_block) is at *path*, e.g. a directory, or a bad file that a
    failed load could not remove."""
    return os.path.lexists(path) and not _is_complete_block(path, block_size)


def _store_block(
    dest_path: str,
    buffer: memoryview,
    offset: int,
    block_size: int,
    use_o_direct: bool = True,
    modes: FileModes = PRIVATE_MODES,
    mac: bytes | None = None,
    checksum: bool = False,
) -> None:
    """Store callback: write to a temp file then atomically replace the target.
    Files and directories are created with *modes*; a *mac* is set as the
    file's MAC_XATTR before the rename, with *checksum* the block's CRC32C
    as its CRC_XATTR."""
    view_slice = buffer.cast("B")[offset : offset + block_size]
    crc = crc32c(view_slice) if checksum else None

    def is_stored() -> bool:
        return (
            _is_complete_block(dest_path, block_size)
            and (mac is None or _holds_mac(dest_path, mac))
            and (crc is None or _holds_mac(dest_path, crc, CRC_XATTR))
        )

    # Skip the write if the block is already stored, but only if what is at
    # the path is a complete block (with a *mac* or *checksum*: holding it,
    # else a planted or damaged file, or one restored without its xattrs,
    # would be kept as this key's block): anything else is replaced below.
    if is_stored():
        return

    tmp_path = dest_path + get_tmp_suffix()
    # Ensure parent directories exist
    _ensure_dirs(dest_path, modes)
    # A directory in the way cannot be replaced by a file: remove it if empty,
    # fail the store of this block (OSError) if not.
    if os.path.isdir(dest_path) and not os.path.islink(dest_path):
        os.rmdir(dest_path)

    # Write block atomically (view_slice: a flat byte view, so the slice uses
    # byte indices; the raw memoryview may be multi-dimensional with itemsize
    # > 1).
    o_direct = O_DIRECT if use_o_direct else 0
    try:
        fd = os.open(
            tmp_path,
            os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC | o_direct,
            modes.file,
        )
        try:
            os.fchmod(fd, modes.file)  # exact, whatever the umask
            written = os.write(fd, view_slice)
            if written < len(view_slice):
                raise OSError(
                    f"Short write: expected {len(view_slice)} bytes, wrote {written}"
                )
            if mac is not None:
                os.setxattr(fd, MAC_XATTR, mac)
            if crc is not None:
                os.setxattr(fd, CRC_XATTR, crc)
        finally:
            os.close(fd)
        try:
            os.replace(tmp_path, dest_path)
        except FileExistsError:
            # Another writer published this block after the check above; some
            # shared filesystems fail the rename with EEXIST instead of
            # replacing. A file name stands for one block, so a complete file
            # already in place (holding this *mac*, if keyed, and this *crc*)
            # holds this block and the store is done.
            if not is_stored():
                raise  # the temp file is removed below
            with contextlib.suppress(OSError):
                os.remove(tmp_path)
    except Exception:
        try:
            os.remove(tmp_path)
        except OSError as cleanup_exc:
            logger.warning("Failed to remove temp file %s: %s", tmp_path, cleanup_exc)
        raise


def _remove_corrupt_file(path: str) -> None:
    # A failure to remove must not mask the load error the caller raises.
    try:
        os.remove(path)
    except OSError as cleanup_exc:
        logger.warning("Failed to remove corrupt block file %s: %s", path, cleanup_exc)


def _remove_if_same_file(path: str, read: FileMac | os.stat_result) -> None:
    """Remove *path* if it still names the file *read* describes: another
    engine sharing the root may have stored the block anew since. This
    narrows the window, it does not close it: a rename between the lstat and
    the removal still loses that block (a miss)."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if (st.st_dev, st.st_ino) == (read.st_dev, read.st_ino):
        _remove_corrupt_file(path)


def _load_block(
    source_path: str,
    view: memoryview,
    offset: int,
    block_size: int,
    use_o_direct: bool = True,
    read_mac: bool = False,
    checksum: bool = False,
) -> FileMac | None:
    """Read one KV block from disk; remove the file only if it provably holds
    no block (a regular file whose size is not block_size, or a short read:
    stores are atomic and write exactly one block, so that is genuine
    corruption), and only if its path still names the file read; leave it
    untouched on any other error. A file of the wrong size, or one that is
    not a regular file, is rejected before anything is read into the view.
    With *read_mac*, return the file's MAC attribute, read from the same open
    file; with *checksum*, check the bytes read against the file's CRC32C
    (_check_crc)."""
    fd: int | None = None
    view_slice = view.cast("B")[offset : offset + block_size]
    o_direct = O_DIRECT if use_o_direct else 0

    try:
        # O_NONBLOCK: a FIFO at the path does not block until a writer comes.
        # Once the file is known to be a regular one, O_NONBLOCK goes (Lustre
        # fails a read another node's lock holds with EAGAIN under it) and
        # O_DIRECT is set where asked: open(O_DIRECT) refuses a FIFO (EINVAL)
        fd = os.open(source_path, os.O_RDONLY | O_NOFOLLOW | os.O_NONBLOCK)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EBADMSG, "Not a regular file", source_path)
        if st.st_size != block_size:
            _remove_if_same_file(source_path, st)
            raise OSError(
                errno.EBADMSG,
                f"Block file has {st.st_size} bytes, expected {block_size}",
                source_path,
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, o_direct)  # its only status flags
        bytes_read = os.readv(fd, [view_slice])
        if bytes_read < block_size:
            _remove_if_same_file(source_path, st)
            raise OSError(
                errno.EBADMSG,
                f"Short read: expected {block_size} bytes, read {bytes_read}",
                source_path,
            )
        if checksum:
            _check_crc(source_path, fd, view_slice, st)
        if read_mac:
            return FileMac(_read_mac(fd), st.st_dev, st.st_ino)
        return None
    finally:
        if fd is not None:
            os.close(fd)


def batch_store_block(
    paths: list[str],
    view: memoryview,
    offsets: list[int],
    block_size: int,
    use_o_direct: bool = True,
    modes: FileModes = PRIVATE_MODES,
    mac: BlockMac | None = None,
    keys: Sequence[bytes] = (),
    checksum: bool = False,
) -> None:
    """Store a batch of KV blocks from a shared buffer to disk in one call.

    Each block buffer[offsets[i] : offsets[i]+block_size] is written atomically
    to dest_paths[i] via a temp-file rename, created with *modes*; with a
    *mac*, the MAC of keys[i] and the block is set on the temp file before
    the rename, with *checksum* the block's CRC32C. A block's own failure
    (BLOCK_ERRNOS) does not stop the batch, any other error does; if any
    failed, the error that stopped it, else the first, is raised once the
    batch is done.
    """
    _validate_offsets(view, offsets, block_size)
    view_B = view.cast("B")
    macs: list[bytes] | None = None
    if mac is not None:
        macs = [
            mac.compute(k, view_B[x : x + block_size]) for k, x in zip(keys, offsets)
        ]

    if _HAS_FSIO_C:
        view_slices = [view_B[x : x + block_size] for x in offsets]
        tmp_paths = [p + get_tmp_suffix() for p in paths]
        if macs is None and not checksum:
            return batch_store_block_C(
                tmp_paths, paths, view_slices, use_o_direct, modes.file, modes.dir
            )
        return batch_store_block_C(
            tmp_paths,
            paths,
            view_slices,
            use_o_direct,
            modes.file,
            modes.dir,
            None if macs is None else MAC_XATTR,
            [] if macs is None else macs,
            checksum,
        )
    else:
        first_exc: OSError | None = None
        for i, (path, offset) in enumerate(zip(paths, offsets)):
            try:
                _store_block(
                    path,
                    view,
                    offset,
                    block_size,
                    use_o_direct,
                    modes,
                    None if macs is None else macs[i],
                    checksum,
                )
            except OSError as exc:
                stops = exc.errno not in BLOCK_ERRNOS
                if first_exc is None or stops:
                    first_exc = exc
                if stops:
                    break  # the blocks after it would meet it too
        if first_exc is not None:
            raise first_exc


def batch_load_block(
    paths: list[str],
    view: memoryview,
    offsets: list[int],
    block_size: int,
    use_o_direct: bool = True,
    mac: BlockMac | None = None,
    keys: Sequence[bytes] = (),
    checksum: bool = False,
) -> None:
    """Load a batch of KV blocks from disk into a shared buffer in one call.

    Block i is read from source_paths[i] into view[offsets[i] : offsets[i]+block_size].
    A block's own failure (BLOCK_ERRNOS; see _load_block for the
    delete-on-short-read policy) does not stop the batch: the other blocks are
    still loaded. Any other error stops it, and the blocks after it count as
    failed, untried. With a *mac*, each block read is then checked against the MAC
    attribute read from the same open file, for keys[i] (BlockMac.check): a
    mismatch fails the block; with *checksum*, each block read is checked
    against its file's CRC32C (a mismatch, or none recorded, fails the block
    and removes the file). If any block failed, the error that stopped the
    batch, else the first, is raised once the batch is done, carrying
    ``failed_indices``, the indices of all failed blocks in ascending order,
    so the tier can keep every block that loaded, ``untried``, those of the
    blocks after a stop, and ``integrity_failed``, those of the blocks that
    failed their MAC or CRC32C.
    """
    if mac is None:
        _batch_load_block(
            paths, view, offsets, block_size, use_o_direct, checksum=checksum
        )
        return
    integrity_failed: list[int] = []
    try:
        reads = _batch_load_block(
            paths, view, offsets, block_size, use_o_direct, MAC_XATTR, checksum
        )
        failed: list[int] = []
        first_exc: OSError | None = None
    except OSError as exc:
        failed = getattr(exc, "failed_indices", None)  # type: ignore[assignment]
        reads = getattr(exc, "xattr_reads", None)
        if failed is None or reads is None:
            raise
        integrity_failed.extend(getattr(exc, "integrity_failed", ()))
        first_exc = exc
    assert reads is not None  # with an xattr name, a list
    view_B = view.cast("B")
    skip = set(failed)
    for i, (path, offset) in enumerate(zip(paths, offsets)):
        if i in skip:
            continue
        try:
            read = reads[i]
            assert read is not None  # block i loaded
            mac.check(path, keys[i], view_B[offset : offset + block_size], read)
        except OSError as exc:
            failed.append(i)
            if isinstance(exc, BlockIntegrityError):
                integrity_failed.append(i)
            if first_exc is None:
                first_exc = exc
    if first_exc is not None:
        first_exc.failed_indices = sorted(failed)  # type: ignore[attr-defined]
        first_exc.untried = getattr(first_exc, "untried", [])  # type: ignore[attr-defined]
        first_exc.integrity_failed = sorted(integrity_failed)  # type: ignore[attr-defined]
        raise first_exc


def _batch_load_block(
    paths: list[str],
    view: memoryview,
    offsets: list[int],
    block_size: int,
    use_o_direct: bool,
    xattr_name: str | None = None,
    checksum: bool = False,
) -> list[FileMac | None] | None:
    """batch_load_block's reads, on the compiled path where there is one.
    With *xattr_name* (MAC_XATTR), return each block's FileMac (None where
    the block failed; on failure, as the error's ``xattr_reads``). With
    *checksum*, the blocks that failed their CRC32C are the error's
    ``integrity_failed``."""
    _validate_offsets(view, offsets, block_size)

    if _HAS_FSIO_C:
        view_B = view.cast("B")
        view_slices = [view_B[x : x + block_size] for x in offsets]
        if xattr_name is None and not checksum:
            return batch_load_block_C(paths, view_slices, use_o_direct)
        try:
            found = batch_load_block_C(
                paths, view_slices, use_o_direct, xattr_name, checksum
            )
        except OSError as exc:
            found = getattr(exc, "xattr_reads", None)
            if found is not None:
                exc.xattr_reads = [  # type: ignore[attr-defined]
                    None if r is None else FileMac(*r) for r in found
                ]
            integrity_failed = getattr(exc, "integrity_failed", ())
            if exc.errno == errno.EBADMSG and exc.filename in (
                paths[i] for i in integrity_failed
            ):
                # the first failure is a CRC32C's: say so, as the Python path
                raise _crc_error(exc) from None
            raise
        if xattr_name is None:
            return None
        return [FileMac(*r) for r in found]
    return _load_each_block(
        paths, view, offsets, block_size, use_o_direct, xattr_name, checksum
    )


def _load_each_block(
    paths: list[str],
    view: memoryview,
    offsets: list[int],
    block_size: int,
    use_o_direct: bool,
    xattr_name: str | None,
    checksum: bool,
) -> list[FileMac | None] | None:
    """_batch_load_block's Python path, block by block (_load_block)."""
    first_exc: OSError | None = None
    failed_indices: list[int] = []
    integrity_failed: list[int] = []
    reads: list[FileMac | None] = []
    untried = range(0)
    for i, (path, offset) in enumerate(zip(paths, offsets)):
        try:
            reads.append(
                _load_block(
                    path,
                    view,
                    offset,
                    block_size,
                    use_o_direct,
                    read_mac=xattr_name is not None,
                    checksum=checksum,
                )
            )
        except OSError as exc:
            if exc.filename is None:  # from readv or fstat: named, as in C
                exc.filename = path
            reads.append(None)
            failed_indices.append(i)
            if isinstance(exc, BlockIntegrityError):
                integrity_failed.append(i)
            stops = exc.errno not in BLOCK_ERRNOS
            if first_exc is None or stops:
                first_exc = exc
            if stops:
                untried = range(i + 1, len(paths))
                failed_indices.extend(untried)
                reads.extend(None for _ in untried)
                break
    if first_exc is not None:
        # The C path sets the same attributes via PyObject_SetAttrString.
        first_exc.failed_indices = failed_indices  # type: ignore[attr-defined]
        first_exc.untried = list(untried)  # type: ignore[attr-defined]
        if checksum:
            first_exc.integrity_failed = integrity_failed  # type: ignore[attr-defined]
        if xattr_name is not None:
            first_exc.xattr_reads = reads  # type: ignore[attr-defined]
        raise first_exc
    return reads if xattr_name is not None else None


def _crc_error(exc: OSError) -> BlockIntegrityError:
    """The compiled path's EBADMSG of a block that failed its CRC32C, as the
    Python path raises it, with *exc*'s attributes."""
    error = BlockIntegrityError(
        errno.EBADMSG,
        "does not hold the block stored (CRC32C mismatch, or none recorded)",
        exc.filename,
    )
    for name in ("failed_indices", "untried", "xattr_reads", "integrity_failed"):
        if hasattr(exc, name):
            setattr(error, name, getattr(exc, name))
    return error
