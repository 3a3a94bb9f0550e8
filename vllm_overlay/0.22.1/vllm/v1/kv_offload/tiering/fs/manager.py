# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
FileSystemTierManager: Pure-Python file system secondary tier for KV cache offloading.

Store path:
    Data is written to a temp file (<dest_path.tmp>) via os.write,
    then os.replace'd to the final path (without .tmp).

Load path:
    Data is read from the block file directly via os.readv into the
    provided memoryview slice.

File naming:  <base_path>_r<rank>/<hhh>/<hh>_g<group_idx>/<hash_hex>.bin
              (hash-based subdirectories to limit directory fan-out)

I/O mode:
    O_DIRECT (bypassing the page cache) when the primary tier's rows are
    page-aligned and the filesystem supports it, else buffered I/O. Decided
    at start by probe_o_direct(), and logged with the reason. A probe that
    failed for a reason that may pass (a full disk, an I/O error) is run
    again, by the first store at least REPROBE_INTERVAL_S later, until it
    succeeds or fails for good.

Useful bytes only (fs/group_files.py):
    A key's file holds the bytes of the CPU row its KV cache group's
    transfers use (cpu/row_extents.py), zero-padded to the page size. Each
    group's file size is part of the layout (config.json), so files of
    whole rows written before are never read.

Integrity (the tier config's "checksum", on by default):
    With "auto" (the default) or "crc32c", each block file carries the
    CRC32C of its bytes in the extended attribute user.vllm.kv_crc32c, set
    before the file is published and checked on every load (computed in C
    with the block's I/O where the fs_io_C extension is built): a damaged
    or truncated block is a miss, its file removed. Where the root's
    filesystem has no user xattrs (probed once at start), "auto" checks
    nothing (a warning at start says so) and "crc32c" is refused; "none"
    checks nothing. The same files as the upstream track's checksum_blocks.

File modes (the tier config's "group_access", off by default):
    KV blocks are users' data. Block files, temp files and config.json are
    created 0600 and the tier's directories 0700, set exactly whatever the
    process umask (the Python and the C I/O paths alike); with
    "group_access": true, 0640 and 2770 (setgid, group writable: the group's
    engines store into each other's directories), for a root shared by
    service accounts of one group. Files and directories of the tier's tree
    with wider modes (from before, or made by hand) are counted by the
    start-up walk and reported once, with an example and the fix.

Trust (see fs/security.py):
    A root (or a parent) that others can write or that another user owns is
    refused at start with a ValueError naming the path, its mode and owner,
    and the fix. Block files are opened with O_NOFOLLOW and looked up with
    lstat: a symbolic link at a block's path is a miss, never read through;
    a store replaces it with the block.

Keyed namespace (the tier config's "key_file", off by default):
    For a store shared by several engines (NFS, a PVC): with a key read from
    a private file (fs/security.py), block files are named by a keyed hash
    of the block hash and carry an HMAC-SHA256 of the block's identity
    (layout and key) and bytes in an extended attribute (fs/io.py BlockMac),
    checked on load. Without the key nobody can compute where a prefix's
    block lives, test whether it is cached, or plant a file that loads: a
    planted or altered file is a miss, removed, and counted in the
    rate-limited failure report. Engines sharing a root share the key file;
    another key is another namespace. The root must support user extended
    attributes (checked at start).

Budget (the tier config's "max_bytes", unbounded by default):
    The layout's files on the root never exceed max_bytes by more than one
    store job per engine: engines sharing the root share the budget (each
    counts the others' stores through their ledgers). A store evicts first,
    whole chunks (every group's file) of the least recently used prefix
    tails, never a chunk with a transfer in flight; a store that cannot fit
    fails for the keys that do not. Existing files are indexed at start, in
    the background, in the order of their times. See budget.py. The root's
    other layouts (an earlier version's, another model's) are not counted:
    they are named at start, for their owner to remove, least recently used
    first, with how long ago (a running tier sets its layout directory's
    mtime hourly), so that a layout nobody runs is told from a live one.
"""

import contextlib
import ctypes
import errno
import functools
import json
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, get_offload_group_idx
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import (
    JobMetadata,
    JobResult,
    SecondaryTierManager,
)
from vllm.v1.kv_offload.tiering.fs.budget import (
    Admission,
    BudgetRejection,
    FsTierBudget,
    validate_max_bytes,
    warn_beyond_free_space,
)
from vllm.v1.kv_offload.tiering.fs.files import (
    GROUP_MODES,
    PRIVATE_MODES,
    make_dirs,
    scan_and_report,
    write_file_atomically,
)
from vllm.v1.kv_offload.tiering.fs.group_files import (
    GroupFile,
    group_files,
    load_group_files,
    stops_batch,
    store_group_files,
)
from vllm.v1.kv_offload.tiering.fs.io import (
    BLOCK_ERRNOS,
    CRC_XATTR,
    BlockMac,
    has_compiled_io,
    holds_no_block,
    is_block_path,
    probe_o_direct,
    probe_xattr,
)
from vllm.v1.kv_offload.tiering.fs.layouts import LayoutMark, report_other_layouts
from vllm.v1.kv_offload.tiering.fs.report import Throttle
from vllm.v1.kv_offload.tiering.fs.security import (
    TierKey,
    check_root_dir,
    load_key_file,
)
from vllm.v1.kv_offload.tiering.fs.thread_pool import (
    DualQueueThreadPool,
    FinishedJob,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = init_logger(__name__)


# After an O_DIRECT probe failed for a reason that may pass (a full disk, an
# I/O error), probe again with the first store at least this much later.
REPROBE_INTERVAL_S = 60.0
# Load errors that may pass (too many open files, memory, a signal): the
# file is loaded again later, not rewritten.
TRANSIENT_LOAD_ERRNOS = frozenset(
    {
        errno.EMFILE,
        errno.ENFILE,
        errno.ENOMEM,
        errno.EINTR,
        errno.EAGAIN,
        errno.ESTALE,  # NFS: a file handle that a new open renews
        errno.ETIMEDOUT,
    }
)
# The most keys kept as misses because their file cannot be loaded: beyond
# it the oldest go (such a key fails one more load, then is kept again).
MAX_UNLOADABLE_KEYS = 1 << 16
# lookup() without a request: its hits order like a request's unpositioned
# keys (recency)
_NO_REQUEST = ReqContext(req_id="")


def view_address(view: memoryview) -> int:
    """Where a (writable) byte view's memory starts."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0


def _start_thread(target: Callable, *args: Any, name: str) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread


def _check_settings(tier_type: str, stale_s: object, group_access: object) -> None:
    """Refuse settings of the wrong type, naming the setting and the fix."""
    if stale_s is not None and (
        isinstance(stale_s, bool)
        or not isinstance(stale_s, (int, float))
        or stale_s < 0
    ):
        raise ValueError(
            "cleanup_stale_tmp_after_seconds of the "
            f"'{tier_type}' tier must be a number of seconds >= 0 or null "
            f"(no cleanup), got {stale_s!r}"
        )
    if not isinstance(group_access, bool):
        raise ValueError(
            f"group_access of the '{tier_type}' tier must be true or false, "
            f"got {group_access!r}"
        )


# the tier's 'checksum' settings (see FileSystemTierManager)
CHECKSUMS = ("auto", "crc32c", "none")


def _check_checksum(tier_type: str, checksum: object, tier_key: object) -> None:
    """Refuse a 'checksum' setting that is not one, naming the fix."""
    if tier_key is not None and checksum not in ("auto", "none"):
        raise ValueError(
            f"the '{tier_type}' tier's key_file replaces its checksum (a "
            "keyed MAC checks every block): remove 'checksum' or set it "
            "to 'auto' or 'none'"
        )
    if checksum in ("xxh3_64", "crc32"):
        raise ValueError(
            f"checksum {checksum!r} of the '{tier_type}' tier is no longer "
            "offered: blocks are checked with CRC32C, computed in C with their "
            "I/O. Fix: set 'checksum' to 'auto' or 'crc32c'"
        )
    if checksum not in CHECKSUMS:
        raise ValueError(
            f"Unknown checksum {checksum!r} in the '{tier_type}' tier's "
            f"config: set 'checksum' to one of {list(CHECKSUMS)}"
        )


def _remove_old_files(
    keys: list[OffloadKey], paths: list[str], rewrites: Collection[OffloadKey]
) -> dict[str, os.stat_result]:
    """Remove the files of *rewrites* (keys whose load failed), so that a
    store writes them anew; returns those it could not remove (a directory,
    a read-only mount), by path, as they were."""
    kept: dict[str, os.stat_result] = {}
    for key, path in zip(keys, paths):
        if key in rewrites:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            except OSError:
                with contextlib.suppress(OSError):
                    kept[path] = os.lstat(path)
    return kept


def _kept_old(
    keys: list[OffloadKey], paths: list[str], old_files: dict[str, os.stat_result]
) -> set[OffloadKey]:
    """The keys whose old file (see _remove_old_files()) is still there."""
    kept: set[OffloadKey] = set()
    for key, path in zip(keys, paths):
        if path in old_files:
            old = old_files[path]
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino, st.st_mtime_ns) == (
                old.st_dev,
                old.st_ino,
                old.st_mtime_ns,
            ):
                kept.add(key)
    return kept


@dataclass
class _Job:
    """A job in flight, as the tier keeps it: enqueued with the job's task,
    it comes back with the finished job (FinishedJob.record),
    so that the tier keeps no per-job table."""

    keys: list[OffloadKey]
    is_load: bool
    # what the job holds of the budget (FsTierBudget.finish_job())
    admission: Admission | None = None
    # a store's keys in _unloadable: loadable again once stored
    rewrites: list[OffloadKey] = field(default_factory=list)


class FileSystemTierManager(SecondaryTierManager):
    """
    Pure-Python disk-backed secondary tier.

    Read-priority threads service load jobs preferentially; write-priority
    threads service store jobs preferentially.  Both groups can drain either
    queue, so neither starves.

    submit_store / submit_load are non-blocking: they enqueue tasks and return.
    get_finished() polls job completion and returns completed JobResults.

    Args:
        offloading_spec: contains the vllm_config, kv_cache_config
            and block_size_factor.
        primary_kv_view: Memoryview of the primary tier's CPU KV cache.
        tier_type: Tier type identifier, set by SecondaryTierFactory.
        root_dir: Root directory for block files.
        n_read_threads: Number of read-priority I/O threads.
        n_write_threads: Number of write-priority I/O threads.
        cleanup_stale_tmp_after_seconds: At start-up, remove the temp files
            under root_dir not modified for this long (left by writers
            killed between writing a block and renaming it); None: never.
        checksum: "auto" (the default), "crc32c" or "none": keep each
            block's CRC32C in an extended attribute of its file and check
            it on every load; a mismatch (a damaged or truncated block)
            makes the key a miss. "auto" checks nothing where the root has
            no user xattrs (a warning at start says so); "crc32c" is
            refused there.
        group_access: create files 0640 and directories 2770 (the group's
            engines read blocks and store into each other's directories)
            instead of 0600 and 0700.
        key_file: path of a private file holding a secret of at least 32
            bytes (never the secret itself): a keyed namespace for a shared
            root. File names become a keyed hash of the block hash, and each
            block file carries an HMAC-SHA256 of the block's identity and
            bytes, checked on load (a mismatch is a miss). Engines sharing a
            root share the key file; another key is another namespace.
            Replaces 'checksum'.
        max_bytes: the most bytes this tier's files may take on disk (at
            least one chunk of every KV cache group); None: no limit.
            Engines sharing root_dir share it: set the same on each.
    """

    persistent = True

    def __init__(
        self,
        offloading_spec: "OffloadingSpec",
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        n_read_threads: int = 16,
        n_write_threads: int = 16,
        cleanup_stale_tmp_after_seconds: float | None = 3600.0,
        checksum: str = "auto",
        group_access: bool = False,
        key_file: str | None = None,
        max_bytes: int | None = None,
    ):
        _check_settings(tier_type, cleanup_stale_tmp_after_seconds, group_access)
        self._modes = GROUP_MODES if group_access else PRIVATE_MODES
        tier_key = (
            load_key_file(key_file, tier_type, group_access)
            if key_file is not None
            else None
        )
        _check_checksum(tier_type, checksum, tier_key)
        # From here on the resolved root, the one checked: a symlink in the
        # given path could be repointed after the check.
        root_dir = check_root_dir(root_dir, tier_type, group_access)
        self._label = f"'{tier_type}' KV offload tier at {root_dir}"
        super().__init__(offloading_spec, primary_kv_view, tier_type)

        assert primary_kv_view.strides is not None, "a view of rows"
        self._block_size: int = primary_kv_view.strides[0]  # a row of the view

        # before anything is written: a root refused for xattrs keeps nothing
        self._init_integrity(tier_key, checksum, root_dir)
        self._map_files(offloading_spec, root_dir, tier_key)

        # bytes of each group's block files; a chunk has one per group
        self._file_sizes = [f.size for f in self._group_files]
        self._max_bytes = validate_max_bytes(
            max_bytes, sum(self._file_sizes), tier_type
        )

        self._root_dir = root_dir
        self._config_lock = threading.Lock()
        self._config_failures = 0  # since the last warning (under _config_lock)
        self._config_throttle = Throttle()
        self._write_config()

        self._probe_root(root_dir)

        # Keys whose load failed and whose path still holds something that
        # is not a loadable block (a directory, a file that failed its check
        # on a read-only mount, a file whose read fails for good): answered
        # as misses, so that no request promotes them again, until a store
        # of the key (which writes its file anew) succeeds. Scheduler thread;
        # at most MAX_UNLOADABLE_KEYS, oldest first out.
        self._unloadable: dict[OffloadKey, None] = {}

        self._pool = DualQueueThreadPool(
            n_read_threads,
            n_write_threads,
            thread_name_prefix="vllm_kv_py_fs",
            label=self._label,
        )

        self._start_tmp_cleanup(root_dir, cleanup_stale_tmp_after_seconds)

        self._budget: FsTierBudget | None = None
        if self._max_bytes is not None:
            self._budget = self._start_budget(offloading_spec, root_dir, tier_key)
        mapper, budgeted = self.file_mapper, self._max_bytes is not None
        report_other_layouts(
            self._label, root_dir, mapper.base_path, mapper.fields, budgeted
        )
        layout_dir = os.path.dirname(mapper.get_config_file_path())
        self._marker = LayoutMark(layout_dir, self._label)

    def _map_files(
        self,
        offloading_spec: "OffloadingSpec",
        root_dir: str,
        tier_key: TierKey | None,
    ) -> None:
        """Where the tier's files are and what each holds of a row: the
        FileMapper of the layout (with key_file: keyed names and a MAC).
        Checked files live apart from unchecked ones: an engine that checks
        never removes, as unchecked, the files of one that does not."""
        # what each group's files hold of a row (whole rows where unknown)
        files = group_files(offloading_spec, self._block_size)
        num_groups = len(offloading_spec.kv_cache_config.kv_cache_groups)
        self._whole_row = GroupFile(0, self._block_size)
        self._group_files: list[GroupFile] = files or [self._whole_row] * max(
            1, num_groups
        )
        self.file_mapper = FileMapper.from_offloading_spec(
            # resolved, so that I/O can tell a symlink in the tree
            root_dir=root_dir,
            offloading_spec=offloading_spec,
            gpu_blocks_per_file=offloading_spec.block_size_factor,
            # keyed files live apart from unkeyed ones; the key is not named
            checksum=(
                {"file_names": "keyed-blake2b-128", "mac": "hmac-sha256-xattr"}
                if tier_key is not None
                else {"algorithm": "crc32c", "xattr": CRC_XATTR}
                if self._checksum
                else None
            ),
            file_stem=tier_key.file_stem if tier_key is not None else None,
            group_file_bytes=[f.size for f in files] if files else None,
        )
        if tier_key is not None:
            self._mac = BlockMac(tier_key.mac_key, self.file_mapper.layout_id())

    def _init_integrity(
        self, tier_key: TierKey | None, checksum: str, root_dir: str
    ) -> None:
        """What each block file carries: its MAC (key_file, set by
        _map_files()) or CRC32C (checksum), or nothing; both need user
        extended attributes, probed at the root."""
        self._mac: BlockMac | None = None
        self._checksum = checksum != "none" and tier_key is None
        if self._checksum and checksum == "auto" and not has_compiled_io():
            self._checksum = False
            logger.warning(
                "%s: blocks are not checked for damage: checksum 'auto' "
                "computes each block's CRC32C in C, and this vLLM build lacks "
                "its fs_io_C extension (built from csrc/fs_io.cpp). Set "
                "'checksum' to 'crc32c' to check them in Python (under 10 MB/s "
                "per I/O thread), or to 'none'",
                self._label,
            )
        if tier_key is None and not self._checksum:
            return
        setting, kept, off = (
            ("key_file", "MAC", "remove key_file")
            if tier_key is not None
            else ("checksum", "CRC32C", "set checksum to 'none'")
        )
        make_dirs(root_dir, self._modes)
        try:
            probe_xattr(root_dir)
        except OSError as e:
            if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
                raise  # not about xattrs (EROFS, EACCES): as it is
            if tier_key is None and checksum == "auto":
                self._checksum = False
                logger.warning(
                    "%s: blocks are not checked for damage: checksum 'auto' "
                    "keeps each block's CRC32C in a user extended attribute, "
                    "and the filesystem refused one (%s). Use a root_dir with "
                    "user xattrs to check them, or set 'checksum' to 'none'",
                    self._label,
                    e.strerror,
                )
                return
            raise ValueError(
                f"{setting} of the '{self.tier_type}' tier needs user extended "
                f"attributes at root_dir {root_dir!r} (each block's {kept} "
                f"is kept in one), but the filesystem refused one ({e.strerror})."
                " Fix: use a root_dir on a filesystem with user xattrs (ext4, "
                f"xfs, btrfs, tmpfs on Linux >= 6.6, NFS 4.2), or {off}"
            ) from None
        if self._checksum and not has_compiled_io():
            logger.warning(
                "%s: checksum without vLLM's compiled fs_io_C extension "
                "computes each block's CRC32C in Python (under 10 MB/s per I/O "
                "thread). Fix: build vLLM with it, or set 'checksum' to 'none'",
                self._label,
            )

    def _probe_root(self, root_dir: str) -> None:
        """Probe the layout directory for O_DIRECT; blocks are read and
        written with it only where the primary tier's rows are page-aligned
        (O_DIRECT fails every other transfer with EINVAL)."""
        # Prefer O_DIRECT to bypass the page cache, but fall back to buffered
        # I/O on filesystems that reject it (e.g. overlayfs, some NFS mounts)
        # rather than failing every block.
        self._o_direct_dir = os.path.dirname(self.file_mapper.get_config_file_path())
        address = view_address(self._primary_kv_view.cast("B"))
        self._reprobe_at: float | None = None  # None: never
        reason = None
        if self._block_size % mmap.PAGESIZE or address % mmap.PAGESIZE:
            self._use_o_direct = False
            reason = (
                f"the primary tier's rows ({self._block_size} bytes at address "
                f"{address:#x}) are not aligned to the page size ({mmap.PAGESIZE})"
            )
        else:
            try:
                self._use_o_direct = probe_o_direct(self._o_direct_dir)
            except OSError as e:  # says nothing about O_DIRECT: probe again
                self._use_o_direct = False
                self._reprobe_at = time.monotonic() + REPROBE_INTERVAL_S
                reason = (
                    f"the O_DIRECT probe failed ({e}); probing again in "
                    f"{REPROBE_INTERVAL_S:.0f} s"
                )
            else:
                if not self._use_o_direct:
                    reason = "O_DIRECT I/O is not supported here"
        if self._use_o_direct:
            logger.info(
                "%s: using O_DIRECT I/O for %d-byte blocks",
                self._label,
                self._block_size,
            )
        else:
            # a warning where O_DIRECT may work once the failure passes
            log = logger.warning if self._reprobe_at is not None else logger.info
            log(
                "%s: using buffered I/O for %d-byte blocks because %s",
                self._label,
                self._block_size,
                reason,
            )

    def _start_tmp_cleanup(self, root_dir: str, max_age_s: float | None) -> None:
        """Walk the tier's files in the background (the walk can be long):
        remove the temp files of writers that died between writing a block
        and renaming it into place, and count files with wider modes than
        the tier's."""
        self._tmp_cleanup_stop = threading.Event()
        rank_dir = f"{self.file_mapper.base_path}_r{self.file_mapper.rank}"
        self._tmp_cleanup = _start_thread(
            scan_and_report,
            self._label,
            [rank_dir, self._o_direct_dir],
            max_age_s,
            self._modes,
            root_dir,
            self._tmp_cleanup_stop,
            name="vllm_kv_py_fs_tmp_cleanup",
        )

    def _start_budget(
        self,
        offloading_spec: "OffloadingSpec",
        root_dir: str,
        tier_key: TierKey | None,
    ) -> FsTierBudget:
        assert self._max_bytes is not None
        chunk_id: Callable[[bytes], bytes] | None = None
        if tier_key is not None:
            file_stem = tier_key.file_stem

            def chunk_id(block_hash: bytes) -> bytes:
                # keyed files: the budget indexes chunks by their file names
                return bytes.fromhex(file_stem(block_hash))

        budget = FsTierBudget(
            self._max_bytes,
            self._file_sizes,
            f"{self.file_mapper.base_path}_r{self.file_mapper.rank}",
            self.file_mapper.get_file_name,
            lambda stem, g: self.file_mapper.get_stem_file_name(stem.hex(), g),
            self._label,
            chunk_tokens=dict(enumerate(offloading_spec.offloaded_block_size)),
            prefix_groups=[
                i
                for i, group in enumerate(
                    offloading_spec.kv_cache_config.kv_cache_groups
                )
                # what the connector looks up as a prefix (full attention)
                if not isinstance(group.kv_cache_spec, (SlidingWindowSpec, MambaSpec))
            ]
            or None,
            chunk_id=chunk_id,
            on_removal_errors=self._pool.record_removal_errors,
            # lookup() stats files: no cached verdict to turn into a miss
            takes_evicted_keys=False,
        )
        logger.info(
            "%s: max_bytes=%d (%d chunks of one file "
            "per group, of %s bytes); indexing the files of earlier runs "
            "in the background",
            self._label,
            self._max_bytes,
            self._max_bytes // sum(self._file_sizes),
            self._file_sizes,
        )
        warn_beyond_free_space(self._label, root_dir, self._max_bytes)
        return budget

    def _write_config(self) -> bool:
        """Write config.json (the layout of the directory's block files)
        unless it exists; atomically, as several engines may share the
        directory. Returns whether it was written."""
        config_path = self.file_mapper.get_config_file_path()
        if os.path.exists(config_path):
            return False
        make_dirs(os.path.dirname(config_path), self._modes)
        config = json.dumps(self.file_mapper.get_run_config(), indent=2, sort_keys=True)
        write_file_atomically(config_path, config.encode(), self._modes)
        return True

    def _store_and_keep_config(
        self, store: Callable[[], list[OffloadKey]]
    ) -> list[OffloadKey]:
        """Run a store task (on an I/O thread), then re-create config.json if
        the tier's root was removed while running (an operator cleaning a
        cache directory): the store re-created the block directories, which
        must not be left without the file that says what they hold, also
        where the store failed after writing some. Costs a stat per store
        job. Returns what the store task returned."""
        try:
            return store()
        finally:
            self._keep_config()

    def _keep_config(self) -> None:
        config_path = self.file_mapper.get_config_file_path()
        if os.path.exists(config_path):
            return
        with self._config_lock:
            try:
                written = self._write_config()
            except OSError as e:
                self._report_config_failure(config_path, e)
                return
        if written:
            logger.warning(
                "%s was missing (was the '%s' KV offload tier's directory "
                "removed?); re-created it.",
                config_path,
                self.tier_type,
            )

    def _report_config_failure(self, config_path: str, error: OSError) -> None:
        """Rate-limited, with counts (under _config_lock): the first failure
        at once, then at most one warning per REPORT_INTERVAL_S, so a root
        that stays unwritable is neither silent nor flooding the log."""
        self._config_failures += 1
        if not self._config_throttle.due():
            return
        logger.warning(
            "Could not re-create %s for the '%s' KV offload tier (%d failed "
            "attempt(s) since the last warning; its blocks are stored "
            "without it): %s",
            config_path,
            self.tier_type,
            self._config_failures,
            error,
        )
        self._config_failures = 0

    def lookup(
        self, key: OffloadKey, req_context: ReqContext | None = None
    ) -> bool | None:
        if key in self._unloadable:
            return False
        try:
            st = os.lstat(self.file_mapper.get_file_name(key))
        except OSError:
            return False
        # a symbolic link is never read through (io.py: O_NOFOLLOW)
        if stat.S_ISLNK(st.st_mode):
            return False
        budget = self._budget
        if budget is not None:
            # pinned until the promotion the tiering manager submits for it,
            # or evicted already: its file is about to be removed (a miss)
            ctx = req_context or _NO_REQUEST
            return budget.on_hit(key, ctx.req_id, ctx.offload_key_positions())
        return True

    def _store_and_reprobe_o_direct(
        self, store: Callable[[], list[OffloadKey]]
    ) -> list[OffloadKey]:
        """Run a store task, then probe O_DIRECT again after a transient
        failure (on an I/O thread): switch to it if it works now (blocks are
        the same bytes in both modes), else probe again later while the
        failure may pass. Returns what the store task returned."""
        try:
            return store()
        finally:
            try:
                self._use_o_direct = probe_o_direct(self._o_direct_dir)
            except OSError:
                self._reprobe_at = time.monotonic() + REPROBE_INTERVAL_S
            else:
                logger.info(
                    "The O_DIRECT probe at '%s' %s; using %s I/O for the '%s' "
                    "KV offload tier.",
                    self._o_direct_dir,
                    "succeeded" if self._use_o_direct else "failed",
                    "O_DIRECT" if self._use_o_direct else "buffered",
                    self.tier_type,
                )

    def _group_file(self, key: OffloadKey) -> GroupFile:
        """What *key*'s file holds of a row (whole rows for an unknown group)."""
        g = get_offload_group_idx(key)
        files = self._group_files
        return files[g] if g < len(files) else self._whole_row

    def _by_group(self, keys: list[OffloadKey]) -> dict[GroupFile, list[int]]:
        """The indices of *keys*, by what their files hold of a row."""
        indices: dict[GroupFile, list[int]] = {}
        for i, key in enumerate(keys):
            indices.setdefault(self._group_file(key), []).append(i)
        return indices

    def _file_size(self, key: OffloadKey) -> int:
        """The size of *key*'s block file: its group's useful bytes of a row."""
        return self._group_file(key).size

    def _paths_and_offsets(
        self, keys: list[OffloadKey], rows: list[int]
    ) -> tuple[list[str], list[int]]:
        """Each key's file and its row's offset in the primary tier's view,
        worked out on the I/O thread: the scheduler's thread only posts."""
        paths = [self.file_mapper.get_file_name(key) for key in keys]
        return paths, [row * self._block_size for row in rows]

    def _store_blocks(
        self,
        keys: list[OffloadKey],
        rows: list[int],
        rewrites: Collection[OffloadKey] = (),
    ) -> list[OffloadKey]:
        """A store task (on an I/O thread): writes the blocks of *rows* and
        returns the keys it wrote. The files of *rewrites* (keys whose load
        failed) are removed first, so that they are written anew; one whose
        old file is still there after the store is not returned. A failure raises with
        ``missing``, the keys left without a complete file, ``written``, those
        stored, and ``failed_indices``, the others' (for the failure report)."""
        paths, offsets = self._paths_and_offsets(keys, rows)
        old_files = _remove_old_files(keys, paths, rewrites)
        try:
            self._write_rows(keys, paths, offsets)
        except Exception as exc:  # whatever the store raised
            missing = [
                k
                for k, p in zip(keys, paths)
                if not is_block_path(p) or holds_no_block(p, self._file_size(k))
            ]
            not_written = _kept_old(keys, paths, old_files).union(missing)
            exc.missing = missing  # type: ignore[attr-defined]
            exc.written = [k for k in keys if k not in not_written]  # type: ignore[attr-defined]
            exc.failed_indices = [  # type: ignore[attr-defined]
                i for i, k in enumerate(keys) if k in not_written
            ]
            raise
        kept_old = _kept_old(keys, paths, old_files)
        return [k for k in keys if k not in kept_old]

    def _write_rows(
        self, keys: list[OffloadKey], paths: list[str], offsets: list[int]
    ) -> None:
        """Write each group's files of the rows at *offsets* of the primary
        tier's view; an error that stops a group's batch stops the store
        (store_group_files), and is raised once it is done."""
        first_exc: Exception | None = None
        for group_file, idx in self._by_group(keys).items():
            if first_exc is not None and stops_batch(first_exc):
                break  # the groups after it would meet it too
            try:
                store_group_files(
                    group_file,
                    [paths[i] for i in idx],
                    self._primary_kv_view,
                    [offsets[i] for i in idx],
                    self._use_o_direct,
                    self._modes,
                    self._mac,
                    [keys[i] for i in idx],
                    self._checksum,
                )
            except Exception as exc:  # whatever the store raised
                if first_exc is None or stops_batch(exc):
                    first_exc = exc
        if first_exc is not None:
            raise first_exc

    def _store_within_budget(
        self,
        admission: Admission,
        keys: list[OffloadKey],
        rows: list[int],
        rewrites: Collection[OffloadKey] = (),
    ) -> list[OffloadKey]:
        """A budgeted store task (on an I/O thread): its job's admission
        (reserving its bytes, evicting first; see FsTierBudget.admitted()),
        the evicted chunks' files removed, the admitted blocks written.
        Returns the keys written; raises a BudgetRejection (reported by the
        budget's rejection warning) carrying them as ``written`` if some did
        not fit, and any failure as _store_blocks() does."""
        assert self._budget is not None
        rejected, unreachable, evicted = self._budget.admitted(admission)
        if rejected or unreachable:
            kept = [
                i
                for i, key in enumerate(keys)
                if key not in rejected and key not in unreachable
            ]
            keys = [keys[i] for i in kept]
            rows = [rows[i] for i in kept]
        if evicted:
            self._budget.remove_evicted(evicted)
        stored = self._store_blocks(keys, rows, rewrites)
        self._budget.written(admission, keys)
        if rejected:
            refusal = BudgetRejection(
                errno.ENOSPC,
                f"{len(rejected)} block(s) not stored: no room in "
                f"max_bytes={self._max_bytes}, every indexed block file older "
                "in the eviction order is in use by a transfer",
            )
            refusal.written = stored  # type: ignore[attr-defined]
            raise refusal
        return stored

    def submit_store(self, job_metadata: JobMetadata) -> None:
        keys = list(job_metadata.keys)
        if len(job_metadata.block_ids) != len(keys):
            raise ValueError(
                f"store job {job_metadata.job_id} has {len(keys)} keys and "
                f"{len(job_metadata.block_ids)} block ids"
            )
        job = _Job(keys, is_load=False)
        if self._unloadable:
            job.rewrites = [key for key in keys if key in self._unloadable]
        rows = job_metadata.block_ids.tolist()
        task: Callable[[], list[OffloadKey]]
        if self._budget is not None:
            # the job's admission (reserving its bytes, evicting first,
            # pinning its chunks) is decided by its task, off this thread
            ctx = job_metadata.req_context
            job.admission = self._budget.admit_store(
                keys, ctx.req_id, ctx.offload_key_positions()
            )
            task = functools.partial(
                self._store_within_budget,
                job.admission,
                keys,
                rows,
                frozenset(job.rewrites),
            )
        else:
            task = functools.partial(
                self._store_blocks, keys, rows, frozenset(job.rewrites)
            )
        store = functools.partial(self._store_and_keep_config, task)
        if self._reprobe_at is not None and time.monotonic() >= self._reprobe_at:
            # This job's I/O thread probes O_DIRECT again after its store.
            self._reprobe_at = None
            store = functools.partial(self._store_and_reprobe_o_direct, store)
        self._pool.enqueue_store(job_metadata.job_id, 1, [store], job, len(keys))

    def submit_load(self, job_metadata: JobMetadata) -> None:
        keys = list(job_metadata.keys)
        job = _Job(keys, is_load=True)
        if self._budget is not None:
            job.admission = self._budget.pin_load(keys)
        task = functools.partial(
            self._load_blocks, keys, job_metadata.block_ids.tolist()
        )
        self._pool.enqueue_load(job_metadata.job_id, 1, [task], job, len(keys))

    def _load_blocks(self, keys: list[OffloadKey], rows: list[int]) -> None:
        """A load task (on an I/O thread): the blocks into *rows*. A block's
        own failure does not stop the others; the error is raised once the
        batch is done, with ``failed_indices``, ``untried`` and
        ``integrity_failed`` (indices of *keys*; batch_load_block) and what
        the failed blocks left at their paths (_describe_failed_load())."""
        paths, offsets = self._paths_and_offsets(keys, rows)
        try:
            self._read_rows(keys, paths, offsets)
        except Exception as exc:  # whatever the load raised
            if getattr(exc, "failed_indices", None) is None:
                # no block is known to be read: none is looked at
                exc.failed_indices = exc.untried = list(range(len(keys)))  # type: ignore[attr-defined]
            self._describe_failed_load(exc, keys, paths)
            raise

    def _read_rows(
        self, keys: list[OffloadKey], paths: list[str], offsets: list[int]
    ) -> None:
        """Read each group's files into the rows at *offsets* of the primary
        tier's view; an error that stops a group's batch stops the load (the
        other groups untried). The error that stopped it, else the first, is
        raised once it is done, with ``failed_indices``, ``untried`` and
        ``integrity_failed`` of all groups."""
        first_exc: Exception | None = None
        failed: list[int] = []
        untried: list[int] = []
        integrity_failed: list[int] = []
        for group_file, idx in self._by_group(keys).items():
            if first_exc is not None and stops_batch(first_exc):
                failed.extend(idx)  # the groups after it would meet it too
                untried.extend(idx)
                continue
            try:
                load_group_files(
                    group_file,
                    [paths[i] for i in idx],
                    self._primary_kv_view,
                    [offsets[i] for i in idx],
                    self._use_o_direct,
                    self._mac,
                    [keys[i] for i in idx],
                    self._checksum,
                )
            except Exception as exc:  # whatever the load raised: its group failed
                if first_exc is None or stops_batch(exc):
                    first_exc = exc
                everything = range(len(idx))
                group_failed = getattr(exc, "failed_indices", everything)
                failed.extend(idx[j] for j in group_failed)
                # where nothing says which blocks were read, none is looked at
                known = hasattr(exc, "failed_indices")
                group_untried = getattr(exc, "untried", () if known else everything)
                untried.extend(idx[j] for j in group_untried)
                integrity = getattr(exc, "integrity_failed", ())
                integrity_failed.extend(idx[j] for j in integrity)
        if first_exc is not None:
            first_exc.failed_indices = sorted(set(failed))  # type: ignore[attr-defined]
            first_exc.untried = sorted(untried)  # type: ignore[attr-defined]
            first_exc.integrity_failed = sorted(integrity_failed)  # type: ignore[attr-defined]
            raise first_exc

    def _describe_failed_load(
        self, exc: Exception, keys: list[OffloadKey], paths: list[str]
    ) -> None:
        """On the I/O thread, what a failed load left at the paths it read,
        as attributes of its error (read in _finish_load()): ``unloadable``,
        the indices of failed blocks whose path still holds something: not a
        block, or a file that failed its check and could not be removed, or
        the one whose error stopped the batch, if it will not pass (EIO, EACCES),
        which a store of the key writes anew; and ``gone``, those whose file
        the budget forgets (gone, or not a block kept; a file whose read
        failed is still there and still counted)."""
        failed = exc.failed_indices  # type: ignore[attr-defined]
        # the blocks after an error that stopped the batch were not read: on a
        # failing disk, looking at their paths would wait as long again
        untried = set(getattr(exc, "untried", ()))
        tried = [i for i in failed if i not in untried]
        integrity_failed = set(getattr(exc, "integrity_failed", ()))
        kept_broken = {
            i
            for i in tried
            if holds_no_block(paths[i], self._file_size(keys[i]))
            or (i in integrity_failed and os.path.lexists(paths[i]))
        }
        # the block whose error stopped the batch (named by it), if that error
        # will not pass
        code = getattr(exc, "errno", None)
        lasting = code not in BLOCK_ERRNOS and code not in TRANSIENT_LOAD_ERRNOS
        stopped_at = getattr(exc, "filename", None) if lasting else None
        exc.unloadable = [  # type: ignore[attr-defined]
            i
            for i in tried
            if i in kept_broken
            or (paths[i] == stopped_at and os.path.lexists(paths[i]))
        ]
        exc.gone = [  # type: ignore[attr-defined]
            i for i in tried if i in kept_broken or not is_block_path(paths[i])
        ]
        # Surfaces errno (e.g. EMFILE "Too many open files") for both the C
        # and Python load paths.
        logger.debug(
            "Load of %d blocks failed for %d blocks: %s", len(paths), len(failed), exc
        )

    def get_finished(self) -> Iterable[JobResult]:
        """Collect finished jobs; a failed load marks only its failed keys
        as misses (scheduler thread)."""
        budget = self._budget
        if budget is not None:
            budget.end_step()
        return [
            self._finish_load(finished)
            if finished.record.is_load
            else self._finish_store(finished)
            for finished in self._pool.get_finished()
        ]

    def _finish_store(self, finished: FinishedJob) -> JobResult:
        """A finished store: the keys it wrote are stored (all of them, or
        those the budget admitted, or those a failure left a file for)."""
        job: _Job = finished.record
        outcome = finished.outcomes[0]
        failed = isinstance(outcome, Exception)
        written: list[OffloadKey] = (
            getattr(outcome, "written", []) if failed else outcome
        )
        if self._budget is not None:
            assert job.admission is not None
            self._budget.finish_job(job.admission, getattr(outcome, "missing", []))
        if job.rewrites:
            # a store that replaced an unloadable file: loadable again
            for key in set(job.rewrites).intersection(written):
                self._unloadable.pop(key, None)
        if not failed:
            return JobResult(job_id=finished.job_id, success=True)
        return JobResult(
            job_id=finished.job_id, success=False, successful_keys=list(written)
        )

    def _mark_unloadable(self, keys: Iterable[OffloadKey]) -> None:
        """Answer *keys* as misses until stored again (most recent last)."""
        for key in keys:
            self._unloadable.pop(key, None)
            self._unloadable[key] = None
        while len(self._unloadable) > MAX_UNLOADABLE_KEYS:
            del self._unloadable[next(iter(self._unloadable))]

    def _finish_load(self, finished: FinishedJob) -> JobResult:
        """A finished load: a failed block does not fail the others, which
        are kept in the primary tier (successful_keys)."""
        job: _Job = finished.record
        outcome = finished.outcomes[0]
        keys = job.keys
        if self._budget is not None:
            assert job.admission is not None
            gone = getattr(outcome, "gone", ())
            self._budget.finish_job(job.admission, [keys[i] for i in gone])
        if not isinstance(outcome, Exception):
            return JobResult(job_id=finished.job_id, success=True)
        self._mark_unloadable(keys[i] for i in getattr(outcome, "unloadable", ()))
        failed = set(getattr(outcome, "failed_indices", range(len(keys))))
        successful = [k for i, k in enumerate(keys) if i not in failed]
        return JobResult(
            job_id=finished.job_id, success=False, successful_keys=successful
        )

    def shutdown(self) -> None:
        """
        Release resources held by this tier.

        Shuts down the thread pool, clearing pending tasks and waiting for
        active threads to complete.
        """
        self._tmp_cleanup_stop.set()
        self._tmp_cleanup.join()
        self._marker.stop()
        self._pool.shutdown(wait=True)
        if self._budget is not None:
            self._budget.shutdown()
