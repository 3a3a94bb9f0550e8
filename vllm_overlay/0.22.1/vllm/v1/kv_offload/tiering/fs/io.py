# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

import contextlib
import ctypes
import errno
import hmac
import logging
import mmap
import os
import platform
import stat
import sys
import threading
import zlib
from collections.abc import Callable, Sequence

try:
    import xxhash
except ImportError:  # optional: the crc32 checksum needs no package
    xxhash = None  # type: ignore[assignment]

try:
    # csrc/fs_io.cpp: a new block stored, or a block loaded, with the GIL
    # released once instead of at each of its syscalls; where it is not
    # built, every block takes the Python path.
    from vllm import fs_io_C  # pyright: ignore[reportAttributeAccessIssue]
except ImportError:
    fs_io_C = None

from vllm.v1.kv_offload.tiering.fs.files import (
    PRIVATE_MODES,
    FileModes,
    get_tmp_suffix,
    make_dirs,
)

logger = logging.getLogger(__name__)

# Per-thread page-aligned buffers (_bounce(), BlockChecksum.trailer())
_thread_local = threading.local()

# O_DIRECT is Linux-specific and not available on macOS
O_DIRECT = getattr(os, "O_DIRECT", 0)
# A symbolic link at a block's path (planted by whoever could write into the
# tree) is never read through: its target's bytes would be served as the
# key's KV.
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class LinkInTreeError(OSError):
    """A block path that leads through a symbolic link (an intermediate
    directory of the tree): the file is elsewhere, so it is neither read,
    written nor removed."""


def _check_opened_at(fd: int, path: str) -> None:
    """Raise LinkInTreeError unless *fd* is the file at *path* (absolute
    and free of symbolic links, as FileMapper builds them from the resolved
    root) reached through no symbolic link: O_NOFOLLOW only covers the last
    component. Where /proc is missing, only O_NOFOLLOW protects."""
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return
    # " (deleted)": another writer replaced the file after it was opened
    if opened != path and opened != path + " (deleted)":
        raise LinkInTreeError(
            f"{path} leads through a symbolic link (to {opened}): not used"
        )


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


_AT_FDCWD = -100
# openat2's number in the syscall table that these architectures share
# (alpha, ia64 and mips number it otherwise: they keep the /proc check)
_SYS_OPENAT2 = 437
_OPENAT2_MACHINES = ("x86_64", "aarch64", "ppc64le", "s390x", "riscv64")
_RESOLVE_NO_SYMLINKS = 0x04
_RENAME_NOREPLACE = 1
# a name that does not exist: the probes expect ENOENT where a call works
_PROBE_PATH = b"/.vllm-kv-offload-probe-that-does-not-exist"


def _libc_function(name: str, restype, argtypes: list) -> Callable | None:
    if sys.platform != "linux":
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.restype = restype
    function.argtypes = argtypes
    return function


def _load_openat2() -> Callable[[str, int, int], int] | None:
    """openat2 (Linux 5.6+) refusing symbolic links, or None where the
    architecture, kernel or a seccomp filter lacks it (probed once)."""
    if platform.machine() not in _OPENAT2_MACHINES:
        return None
    syscall = _libc_function(
        "syscall",
        ctypes.c_long,
        [
            ctypes.c_long,
            ctypes.c_long,
            ctypes.c_char_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
        ],
    )
    if syscall is None:
        return None

    def openat2(path: str, flags: int, mode: int) -> int:
        how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE_NO_SYMLINKS)
        fd = syscall(
            _SYS_OPENAT2,
            _AT_FDCWD,
            os.fsencode(path),
            ctypes.addressof(how),
            ctypes.sizeof(how),
        )
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), path)
        return fd

    try:
        os.close(openat2("/", os.O_RDONLY | os.O_DIRECTORY, 0))
    except OSError:
        return None
    return openat2


def _load_renameat2() -> Callable | None:
    """renameat2 (glibc 2.28+), or None where the libc, kernel or a seccomp
    filter lacks it (probed once: renaming a name that does not exist)."""
    renameat2 = _libc_function(
        "renameat2",
        ctypes.c_int,
        [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint],
    )
    if renameat2 is None:
        return None
    failed = renameat2(
        _AT_FDCWD, _PROBE_PATH, _AT_FDCWD, _PROBE_PATH + b"-2", _RENAME_NOREPLACE
    )
    if not failed or ctypes.get_errno() != errno.ENOENT:
        return None
    return renameat2


# Each saves the I/O threads a syscall per block, and the GIL hand-over
# that comes with it; None: the way they replace (see below) is used.
_openat2 = _load_openat2()
_renameat2 = _load_renameat2()


def io_calls_in_use() -> str:
    """How block files are opened and published in this process, for the
    tier's start-up log line."""
    opened = (
        "openat2(RESOLVE_NO_SYMLINKS)"
        if _openat2 is not None
        else "open(O_NOFOLLOW) and a /proc/self/fd check"
    )
    published = (
        "renameat2(RENAME_NOREPLACE)"
        if _renameat2 is not None
        else "a look at the path, then rename"
    )
    in_c = ", in C where nothing is unusual" if _c_path_in_use() else ""
    return f"opens block files with {opened}, publishes them with {published}{in_c}"


# fs_io_C.store_new_block()'s results; a negative errno: nothing was left
# behind, the Python path stores the block
_C_PUBLISHED = 0
# the temp file is complete, but the name is taken (or RENAME_NOREPLACE is
# unsupported): _publish_if_absent() and _replace() decide, as in Python
_C_UNPUBLISHED = 1


def _c_path_in_use() -> bool:
    """Whether fs_io_C stores and loads blocks: built, and opening files as
    _open_without_links() does (openat2, while it is in use)."""
    return fs_io_C is not None and fs_io_C.HAVE_OPENAT2 and _openat2 is not None


def _link_error(path: str) -> OSError:
    """The error for a symbolic link met opening *path*: LinkInTreeError
    where a directory of the path is one (the file is elsewhere: neither
    read, written nor removed), else an OSError (a link at the block's own
    path, removed as an unloadable block)."""
    directory = os.path.dirname(path)
    if os.path.realpath(directory) != directory:
        return LinkInTreeError(f"{path} leads through a symbolic link: not used")
    return OSError(f"{path} is a symbolic link, not a block file: not read through")


def _open_without_links(path: str, flags: int, mode: int = 0) -> int:
    """Open *path* (absolute and free of symbolic links, as FileMapper
    builds them from the resolved root) refusing a symbolic link at any of
    its components (_link_error()). One openat2 with RESOLVE_NO_SYMLINKS;
    without openat2, an open with O_NOFOLLOW and _check_opened_at()."""
    global _openat2
    openat2 = _openat2
    if openat2 is not None:
        try:
            return openat2(path, flags, mode)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _link_error(path) from None
            if e.errno != errno.ENOSYS:
                raise
            # refused since the probe (a seccomp filter installed later)
            _openat2 = None
            logger.warning("openat2 is refused: %s", io_calls_in_use())
    try:
        fd = os.open(path, flags | O_NOFOLLOW, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_error(path) from None
        raise
    try:
        _check_opened_at(fd, path)
    except LinkInTreeError:
        os.close(fd)
        if flags & os.O_EXCL:  # created elsewhere by this open: removed
            with contextlib.suppress(OSError):
                os.remove(path)
        raise
    return fd


def _publish_if_absent(tmp_path: str, dest_path: str) -> bool:
    """Rename *tmp_path* to *dest_path* unless something is there already
    (renameat2's RENAME_NOREPLACE): whether it was renamed. False also
    where the flag is unsupported: then the caller looks, for good."""
    global _renameat2
    renameat2 = _renameat2
    if renameat2 is None:
        return False
    if renameat2(
        _AT_FDCWD,
        os.fsencode(tmp_path),
        _AT_FDCWD,
        os.fsencode(dest_path),
        _RENAME_NOREPLACE,
    ):
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            return False
        if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            # a file system without the flag (NFS, FUSE without rename2)
            _renameat2 = None
            logger.info("RENAME_NOREPLACE is unsupported: %s", io_calls_in_use())
            return False
        raise OSError(code, os.strerror(code), dest_path)
    return True


def umask_narrows(mode: int) -> bool:
    """Whether the process umask clears bits of *mode*: only then does a file
    created with *mode* need an fchmod to get it exactly (the umask only ever
    clears bits, so it never makes a file more open). Read from /proc, as
    os.umask() can only be read by setting it, racing other threads; True
    where /proc cannot tell."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return bool(int(line.split()[1], 8) & mode)
    except (OSError, ValueError):
        pass
    return True


# "auto" is crc32c where fs_io_C is built (computed in C with the block's
# I/O, the GIL released: SSE4.2 where the CPU has it), else xxh3_64 where
# the xxhash package imports, else crc32: xxh3_64 takes about 1 us per
# 64 KiB block on one core, zlib's crc32 about 15 times as long, and both
# keep the block on the Python path. Resolved at start
# (resolve_checksum()); the file layout records the algorithm used.
CHECKSUMS = ("auto", "none", "crc32c", "xxh3_64", "crc32")


def resolve_checksum(name: str) -> str:
    """The algorithm the checksum setting *name* stands for."""
    if name == "auto":
        if fs_io_C is not None:
            return "crc32c"
        return "xxh3_64" if xxhash is not None else "crc32"
    return name


# The extended attributes that hold a block's checksum or MAC, set on the
# block file before it is published (upstream #57912 keeps its CRC32C in
# user.vllm.kv_crc32c the same way; the 0.33.0 track's MAC is in
# user.vllm.kv_mac): the file holds exactly the block.
CHECKSUM_XATTR = "user.vllm.kv_checksum"
MAC_XATTR = "user.vllm.kv_mac"


def probe_user_xattrs(directory: str, modes: FileModes = PRIVATE_MODES) -> str | None:
    """Why a block's checksum cannot be kept in a user extended attribute
    of a file in *directory* (a filesystem without user xattrs: an old
    tmpfs, some NFS mounts), or None where it can. Any other error (the
    directory cannot be written) is raised: it says nothing about xattrs,
    and the answer decides the file format."""
    if not hasattr(os, "setxattr"):
        return "extended attributes are not available on this platform"
    probe_path = os.path.join(directory, f".xattr_probe{get_tmp_suffix()}")
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | O_NOFOLLOW
    fd = os.open(probe_path, flags, modes.file)
    try:
        os.setxattr(fd, CHECKSUM_XATTR, bytes(8))
        if os.getxattr(fd, CHECKSUM_XATTR) != bytes(8):
            return "a user extended attribute does not read back as written"
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return f"user extended attributes are not supported here ({e})"
        raise
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(probe_path)
    return None


class BlockChecksum:
    """A checksum of each block's key and bytes, stored with the block and
    verified by every load: a file overwritten with bytes of the same size
    (another key's block, a flipped bit, zeroed pages) fails its load
    instead of being served as the key's block.

    Stored in the extended attribute *xattr* of the block's file, so that
    the file holds exactly the block; where the filesystem has no user
    xattrs (xattr None, see probe_user_xattrs()), in a trailer after the
    block: a page for page-aligned blocks, so that O_DIRECT can write and
    read it with the block, else the 8 bytes of the checksum. Where it is
    stored is part of the file format (describe()): files of one are never
    read as the other.
    """

    # bytes of the checksum's value (in the xattr or the trailer)
    digest_size = 8

    def __init__(
        self, algorithm: str, block_size: int, xattr: str | None = None
    ) -> None:
        if algorithm == "xxh3_64" and xxhash is None:
            raise ValueError(
                "the fs_python tier's checksum 'xxh3_64' needs the xxhash "
                "package: install it (pip install xxhash) or set the tier's "
                "'checksum' to 'auto', 'crc32' or 'none'"
            )
        # bound now: the tier's algorithm is fixed at start
        self._crc32c = fs_io_C.crc32c if fs_io_C is not None else None
        if algorithm == "crc32c" and self._crc32c is None:
            raise ValueError(
                "the fs_python tier's checksum 'crc32c' is computed by the "
                "fs_io_C extension, which this vLLM build lacks (built from "
                "csrc/fs_io.cpp): set the tier's 'checksum' to 'auto', "
                "'xxh3_64' or 'crc32'"
            )
        self.algorithm = algorithm
        self.xattr = xattr
        self.trailer_size = _trailer_size(block_size, self.digest_size, xattr)

    def describe(self) -> dict:
        """The fields that determine the file format, for FileMapper."""
        return _describe(self.algorithm, self.trailer_size, self.xattr)

    @property
    def in_c(self) -> bool:
        """Whether fs_io_C checks it along with the block's I/O (crc32c in
        an extended attribute)."""
        return self.algorithm == "crc32c" and self.xattr is not None

    def compute(self, key: bytes, data: memoryview) -> bytes:
        if self.algorithm == "crc32c":
            return self._crc32c(key, data)
        if self.algorithm == "xxh3_64":
            value = xxhash.xxh3_64_intdigest(data, seed=xxhash.xxh3_64_intdigest(key))
        else:
            value = zlib.crc32(data, zlib.crc32(key))
        return value.to_bytes(8, "little")

    def stored(self, fd: int, chunks: list[memoryview]) -> bytes:
        """The value stored with the block read from *fd* into *chunks*
        (b"" where its extended attribute is missing)."""
        if self.xattr is None:
            return bytes(chunks[1][: self.digest_size])
        try:
            return os.getxattr(fd, self.xattr)
        except OSError as e:
            if e.errno == errno.ENODATA:
                return b""
            raise

    def trailer(self) -> memoryview:
        """This thread's page-aligned trailer buffer (O_DIRECT needs it)."""
        buf = getattr(_thread_local, "trailer", None)
        if buf is None:
            buf = _thread_local.trailer = mmap.mmap(-1, mmap.PAGESIZE)
        return memoryview(buf)[: self.trailer_size]

    def mismatch(self) -> str:
        return f"{self.algorithm} checksum mismatch"


def _trailer_size(block_size: int, digest_size: int, xattr: str | None) -> int:
    if xattr is not None:
        return 0
    return mmap.PAGESIZE if block_size % mmap.PAGESIZE == 0 else digest_size


def _describe(algorithm: str, trailer_size: int, xattr: str | None) -> dict:
    if xattr is not None:
        return {"algorithm": algorithm, "xattr": xattr}
    return {"algorithm": algorithm, "trailer_bytes": trailer_size}


class BlockIntegrityError(OSError):
    """A block file whose checksum or MAC does not match: damaged, planted
    or another key's. Counted apart in the tier's failure report."""


class BlockMac(BlockChecksum):
    """A keyed MAC (HMAC-SHA256) of each block's identity and bytes, stored
    where BlockChecksum keeps its checksum (the extended attribute *xattr*,
    else a trailer): the identity is the
    tier's layout (FileMapper.layout_id(), which names the model, layout
    and rank's files) and the block's key (block hash and group). Unlike a
    checksum, nobody without the tier's key can compute it, so a planted or
    altered file - right size, right unkeyed checksum, or another engine's
    block of another key or layout - fails its load.

    HMAC-SHA256 because it was the fastest keyed MAC of the standard
    library here (OpenSSL's SHA-256, with the CPU's SHA extensions): on 2 MiB
    blocks 1.8 GB/s against keyed BLAKE2b's 0.75 and BLAKE2s's 0.41.
    """

    digest_size = 32

    def __init__(
        self,
        mac_key: bytes,
        block_size: int,
        layout_id: str,
        xattr: str | None = None,
    ) -> None:
        self.algorithm = "hmac-sha256"
        self.xattr = xattr
        self.trailer_size = _trailer_size(block_size, self.digest_size, xattr)
        self._keyed = hmac.new(mac_key, digestmod="sha256")
        layout = layout_id.encode()
        self._keyed.update(len(layout).to_bytes(2, "little") + layout)

    @classmethod
    def describe_format(cls, block_size: int, xattr: str | None = None) -> dict:
        """describe() before the layout is known, for FileMapper."""
        trailer = _trailer_size(block_size, cls.digest_size, xattr)
        return _describe("hmac-sha256", trailer, xattr)

    def compute(self, key: bytes, data: memoryview) -> bytes:
        mac = self._keyed.copy()
        mac.update(len(key).to_bytes(2, "little") + key)
        mac.update(data)
        return mac.digest()

    def mismatch(self) -> str:
        return f"{self.algorithm} MAC mismatch: not written with the tier's key"

    def __repr__(self) -> str:
        return "BlockMac(hmac-sha256, key redacted)"


def _ensure_dirs(
    path: str,
    on_new_dir: Callable[[], None] | None = None,
    modes: FileModes = PRIVATE_MODES,
) -> None:
    """Create parent directories of *path* if they don't exist, then call
    *on_new_dir* (e.g. to re-create what a removed root held)."""
    parent = os.path.dirname(path)
    if (
        not os.path.isdir(parent)
        and make_dirs(parent, modes)
        and on_new_dir is not None
    ):
        on_new_dir()


# Errors of the O_DIRECT probe that say nothing about O_DIRECT support (a
# full disk or quota, a failing device, a signal): worth probing again later.
TRANSIENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EAGAIN, errno.EINTR, errno.ENOMEM}
)


def probe_direct_io(
    directory: str,
    buffer: memoryview,
    block_size: int,
    modes: FileModes = PRIVATE_MODES,
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
    probe_path = os.path.join(directory, f".direct_io_probe{get_tmp_suffix()}")
    probe_buf = mmap.mmap(-1, block_size)
    try:
        # Created without O_DIRECT first: a directory that cannot be written
        # is a configuration error, not a reason for buffered I/O.
        # Exclusive, and never through a link: the root may be group-writable.
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | O_NOFOLLOW
        try:
            os.close(os.open(probe_path, flags, modes.file))
        except FileExistsError as e:  # something planted at a temp name
            return f"the O_DIRECT probe could not create its file ({e})", False
        try:
            fd = os.open(probe_path, os.O_RDWR | O_NOFOLLOW | O_DIRECT)
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


def _holds_value(
    path: str, checksum: BlockChecksum | None, value: bytes | None
) -> bool:
    """Whether the file at *path* holds *value*, this block's checksum or
    MAC, in the extended attribute it lives in (always, where it lives in a
    trailer: checked by the load): a file copied or restored without its
    xattrs, or another block's, is written again, not kept to fail its
    load."""
    if checksum is None or checksum.xattr is None:
        return True
    try:
        stored = os.getxattr(path, checksum.xattr, follow_symlinks=False)
    except OSError:
        return False
    return hmac.compare_digest(stored, value or b"")


def _bounce(size: int) -> memoryview:
    """This thread's page-aligned buffer of *size* bytes (O_DIRECT needs
    one): a group file's data gathered from, or scattered to, the group's
    runs of the row. Grown to the largest group file, never shrunk."""
    buf = getattr(_thread_local, "bounce", None)
    if buf is None or len(buf) < size:
        buf = _thread_local.bounce = mmap.mmap(-1, max(size, mmap.PAGESIZE))
    return memoryview(buf)[:size]


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
    modes: FileModes = PRIVATE_MODES,
    chmod: bool = True,
    runs: Sequence[tuple[int, int]] | None = None,
) -> None:
    """
    Store callback: Writes to a temp file then atomically replaces the destination.
    Uses O_DIRECT if direct_io (see probe_direct_io()), else buffered I/O.

    What is at dest_path already is kept or replaced by _replace(). With
    overwrite (the file's load failed), even a complete-looking file is
    replaced. With a checksum, its value (of *key* and the block) is set as
    the file's extended attribute before the file is published, or written
    as a trailer after the block (BlockChecksum). *on_new_dir* is called
    after the block's directory had to be created. Files and directories
    are created with *modes*; chmod=False skips the fchmod that sets the
    file's mode exactly where the umask cannot narrow it (umask_narrows()).

    With *runs* ((offset from *offset*, length) pairs: the byte runs of the
    row the key's KV cache group uses, see row_extents.py), the file holds
    only those bytes, back to back and zero-padded to block_size, gathered
    in a page-aligned buffer; without, the block_size bytes at *offset*.

    A store costs its syscalls (each also a GIL hand-over between the I/O
    threads), so it takes no look before it writes (see _create_temp_file()
    and _publish_if_absent()), and is first tried in C where it can be
    (_store_new_block_in_c()).
    """
    file_size = block_size + (checksum.trailer_size if checksum else 0)
    # Write the block atomically: a temp file, renamed into place.
    tmp_path = dest_path + get_tmp_suffix()
    created = False
    if (checksum is None or checksum.in_c) and not overwrite:
        rc = _store_new_block_in_c(
            tmp_path,
            dest_path,
            buffer,
            offset,
            block_size,
            runs,
            direct_io,
            modes,
            chmod,
            key,
            checksum,
        )
        if rc == _C_PUBLISHED:
            return
        created = rc == _C_UNPUBLISHED  # else the Python path from the start
    chunks, value = _block_chunks(buffer, offset, block_size, key, checksum, runs)
    try:
        if not created:
            fd = _create_temp_file(tmp_path, dest_path, direct_io, modes, on_new_dir)
            created = True
            try:
                _write_temp_file(fd, chunks, file_size, modes, chmod, checksum, value)
            finally:
                os.close(fd)
        if overwrite or not _publish_if_absent(tmp_path, dest_path):
            _replace(tmp_path, dest_path, file_size, overwrite, checksum, value)
    except Exception as e:
        if created:
            _remove_temp_file(tmp_path)
        if (
            isinstance(e, OSError)
            and e.errno in (errno.ENOSPC, errno.EDQUOT)
            and not overwrite
            and _stored_already(dest_path, file_size, checksum, value)
        ):
            return  # the disk is full, but this block is on it already
        raise


def _remove_temp_file(tmp_path: str) -> None:
    try:
        os.remove(tmp_path)
    except FileNotFoundError:
        pass  # published, or removed for the file already there
    except OSError as cleanup_exc:
        logger.warning("Failed to remove temp file %s: %s", tmp_path, cleanup_exc)


def _store_new_block_in_c(
    tmp_path: str,
    dest_path: str,
    buffer: memoryview,
    offset: int,
    block_size: int,
    runs: Sequence[tuple[int, int]] | None,
    direct_io: bool,
    modes: FileModes,
    chmod: bool,
    key: bytes,
    checksum: BlockChecksum | None,
) -> int:
    """Where fs_io_C is in use (_c_path_in_use()), a store without a checksum
    or with crc32c in an xattr, and not an overwrite, is first tried in one
    C call (fs_io_C.store_new_block: the GIL released once). Published
    (_C_PUBLISHED): done. Written but not published (_C_UNPUBLISHED): the
    temp file is complete, and the publish in store_block() decides. Any
    other result (-errno, the call left nothing behind; -ENOSYS without
    fs_io_C): the block is stored in Python from the start. C gathers runs
    into its own per-thread buffer, not _bounce(): an I/O thread may hold
    both, each of the largest group file."""
    if _renameat2 is None or not _c_path_in_use():
        return -errno.ENOSYS
    return fs_io_C.store_new_block(
        tmp_path,
        dest_path,
        buffer,
        offset,
        block_size,
        runs,
        direct_io and O_DIRECT != 0,
        modes.file,
        chmod,
        checksum.xattr if checksum is not None else None,
        key,
    )


def _create_temp_file(
    tmp_path: str,
    dest_path: str,
    direct_io: bool,
    modes: FileModes,
    on_new_dir: Callable[[], None] | None,
) -> int:
    """Create a block's temp file; its directory is looked at (and created)
    only when the temp file cannot be created in it."""
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | (O_DIRECT if direct_io else 0)
    try:
        return _open_without_links(tmp_path, flags, modes.file)
    except FileNotFoundError:  # the block's directory is missing
        _ensure_dirs(dest_path, on_new_dir, modes)
        return _open_without_links(tmp_path, flags, modes.file)


def _write_temp_file(
    fd: int,
    chunks: list,
    file_size: int,
    modes: FileModes,
    chmod: bool,
    checksum: BlockChecksum | None,
    value: bytes | None,
) -> None:
    """Write a block's bytes (and trailer) and set its checksum's xattr."""
    if chmod:
        os.fchmod(fd, modes.file)  # exact, whatever the umask
    written = os.writev(fd, chunks)
    if written < file_size:
        raise OSError(f"Short write: expected {file_size} bytes, wrote {written}")
    if checksum is not None and checksum.xattr is not None:
        assert value is not None
        os.setxattr(fd, checksum.xattr, value)


def _block_chunks(
    buffer: memoryview,
    offset: int,
    block_size: int,
    key: bytes,
    checksum: BlockChecksum | None,
    runs: Sequence[tuple[int, int]] | None,
) -> tuple[list[memoryview], bytes | None]:
    """What store_block() writes in Python (the block's bytes, then the
    checksum's trailer, if any), and its checksum or MAC value, if any:
    also where C wrote the temp file, the value that a file already at the
    block's path must hold to be kept."""
    # Cast to a flat byte view so the slice uses byte indices; the raw
    # memoryview may be multi-dimensional with itemsize > 1.
    flat = buffer.cast("B")
    if runs is None:
        view_slice = flat[offset : offset + block_size]
    else:
        view_slice = _bounce(block_size)
        pos = 0
        for run_offset, length in runs:
            start = offset + run_offset
            view_slice[pos : pos + length] = flat[start : start + length]
            pos += length
        view_slice[pos:] = bytes(block_size - pos)
    value = checksum.compute(key, view_slice) if checksum is not None else None
    chunks = [view_slice]
    if checksum is not None and checksum.xattr is None:
        trailer = checksum.trailer()
        trailer[:] = bytes(len(trailer))
        trailer[: checksum.digest_size] = value
        chunks.append(trailer)
    return chunks, value


def _stored_already(
    path: str, file_size: int, checksum: BlockChecksum | None, value: bytes | None
) -> bool:
    """Whether *path* is a complete block file that holds this block's
    checksum or MAC, if any (_holds_value())."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_size == file_size
        and _holds_value(path, checksum, value)
    )


def _replace(
    tmp_path: str,
    dest_path: str,
    file_size: int,
    overwrite: bool,
    checksum: BlockChecksum | None,
    value: bytes | None,
) -> None:
    """Publish *tmp_path* at *dest_path*, where something may be already.
    An existing block file is kept (the temp file removed) only if it is a
    regular file of exactly block_size bytes (plus the checksum's trailer,
    if any) that has the extended attribute its checksum lives in, if any;
    anything else (a short or long file, an empty directory) is replaced,
    and a store that cannot replace it (a non-empty directory) fails: a
    store never reports success for bytes it did not write."""
    if not overwrite and _stored_already(dest_path, file_size, checksum, value):
        os.remove(tmp_path)
        return
    if os.path.isdir(dest_path) and not os.path.islink(dest_path):
        try:
            os.rmdir(dest_path)
        except OSError as e:
            raise OSError(
                f"cannot store block at {dest_path}: a directory is in the "
                f"way and cannot be removed ({e})"
            ) from None
    os.replace(tmp_path, dest_path)


def _remove_if_same_file(path: str, read: os.stat_result) -> None:
    """Remove *path* if it still names the file *read* describes: another
    engine sharing the root may have stored the block anew since."""
    st = os.lstat(path)
    if (st.st_dev, st.st_ino) == (read.st_dev, read.st_ino):
        os.remove(path)


def load_block(
    source_path: str,
    view: memoryview,
    offset: int,
    block_size: int,
    direct_io: bool = True,
    key: bytes = b"",
    checksum: BlockChecksum | None = None,
    runs: Sequence[tuple[int, int]] | None = None,
) -> None:
    """
    Load callback: read one KV block from disk. On failure, remove the file
    read if its path still names it (another engine may have stored the
    block anew), or a symbolic link at the path; leave what was not opened.
    Uses O_DIRECT if direct_io (see probe_direct_io()), else buffered I/O.
    Only a regular file of exactly block_size bytes (plus the checksum's
    trailer, if any) holds a block: anything else (a shorter or longer file,
    a directory, a symbolic link) fails the load, and so does a block whose
    checksum does not match its bytes and *key*, or lacks one (its extended
    attribute read from the fd the block was read from). With *runs* (see
    store_block()), the file's bytes go to those runs of the row, once
    checked; the row's other bytes are left as they are.
    The block is first loaded in C where it can be (_loaded_in_c()).
    """
    if _loaded_in_c(
        source_path, view, offset, block_size, direct_io, key, checksum, runs
    ):
        return
    # in Python: the common case where fs_io_C is not in use, else a block
    # it did not load (the load below says why, and removes the file)
    fd: int | None = None
    st: os.stat_result | None = None
    flat = view.cast("B")
    if runs is None:
        view_slice = flat[offset : offset + block_size]
    else:
        view_slice = _bounce(block_size)
    chunks = [view_slice]
    file_size = block_size
    if checksum is not None and checksum.xattr is None:
        chunks.append(checksum.trailer())
        file_size += checksum.trailer_size
    try:
        fd = _open_without_links(
            source_path, os.O_RDONLY | (O_DIRECT if direct_io else 0)
        )
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
        if checksum is not None and not hmac.compare_digest(
            checksum.stored(fd, chunks), checksum.compute(key, view_slice)
        ):
            raise BlockIntegrityError(
                f"{source_path} does not hold the block stored for its key "
                f"({checksum.mismatch()})"
            )
        if runs is not None:
            pos = 0
            for run_offset, length in runs:
                start = offset + run_offset
                flat[start : start + length] = view_slice[pos : pos + length]
                pos += length
    except LinkInTreeError:
        raise  # the file is not the tier's: not removed
    except Exception as exc:
        _remove_what_failed_to_load(source_path, st, exc)
        raise
    finally:
        if fd is not None:
            os.close(fd)


def _loaded_in_c(
    source_path: str,
    view: memoryview,
    offset: int,
    block_size: int,
    direct_io: bool,
    key: bytes,
    checksum: BlockChecksum | None,
    runs: Sequence[tuple[int, int]] | None,
) -> bool:
    """Where fs_io_C is in use, a block without a checksum or with crc32c in
    an xattr is first loaded in one C call (fs_io_C.load_block); any result
    but 0 (the file is not one block, a link, a checksum that differs or is
    missing: EBADMSG, an error) loads it again in Python, which fails it
    with its reason and removes the file as without C."""
    return (
        (checksum is None or checksum.in_c)
        and _c_path_in_use()
        and fs_io_C.load_block(
            source_path,
            view,
            offset,
            block_size,
            runs,
            direct_io and O_DIRECT != 0,
            checksum.xattr if checksum is not None else None,
            key,
        )
        == 0
    )


def _remove_what_failed_to_load(
    source_path: str, st: os.stat_result | None, exc: Exception
) -> None:
    """After a failed load: remove the file read (*st*) if its path still
    names it, or a symbolic link at the path; leave what was not opened.
    Raises an OSError saying so where the file cannot be removed."""
    if st is None:  # not opened: only a link at the block's path goes
        with contextlib.suppress(OSError):
            link = os.lstat(source_path)
            st = link if stat.S_ISLNK(link.st_mode) else None
        if st is None:
            return  # gone, or a transient error: left alone
    try:
        _remove_if_same_file(source_path, st)
    except FileNotFoundError:
        pass
    except OSError as cleanup_exc:
        # Reported with the load's error (rate-limited by the thread pool),
        # not logged here: the tier answers the key as a miss from now on,
        # so this happens once per key, not per retry.
        raise OSError(
            f"{exc}; {source_path} could not be removed either "
            f"({cleanup_exc}): a miss until stored again"
        ) from exc
