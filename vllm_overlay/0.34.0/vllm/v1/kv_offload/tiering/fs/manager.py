# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FileSystemTierManager: pure-Python filesystem tier for KV cache offloading.

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
    a store replaces it with the block. Directories below the root are the
    tier's own: a link planted in them needs write access to them.

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

Checksums (the tier config's "checksum_blocks", off by default; upstream
#57912's shape):
    Each block file carries the CRC32C of its bytes in an extended attribute
    (fs/io.py CRC_XATTR), set before the rename and checked after each load
    (in C, with the GIL released, where fs_io_C is built): a block whose
    bytes changed at the same size (bit rot, a torn copy) or that has no
    CRC32C is a miss, its file removed, counted in the rate-limited failure
    report and in vllm:kv_offload_tiering_checksum_failures. Off, no CRC or xattr
    call is made. With key_file, the MAC already checks every block's bytes:
    no CRC32C is stored. The root must support user extended attributes
    (checked at start).

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
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

try:
    from vllm.fs_io_C import batch_lookup as batch_lookup_C

    _HAS_BATCH_LOOKUP_C = True
except ImportError:
    _HAS_BATCH_LOOKUP_C = False

from typing_extensions import override

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    RequestOffloadingContext,
    ScheduleEndContext,
    SecondaryTierManager,
    TransferJob,
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
from vllm.v1.kv_offload.tiering.fs.io import (
    BLOCK_ERRNOS,
    BlockMac,
    batch_load_block,
    batch_store_block,
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
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool, FinishedJob

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = init_logger(__name__)

# After an O_DIRECT probe failed for a reason that may pass (a full disk, an
# I/O error), probe again after the first store at least this much later.
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

# The budget's metrics (see get_stats()), labeled by tier type.
BUDGET_USED_BYTES = "vllm:kv_offload_fs_budget_used_bytes"
BUDGET_MAX_BYTES = "vllm:kv_offload_fs_budget_max_bytes"
BUDGET_EVICTED_FILES = "vllm:kv_offload_fs_budget_evicted_files"
BUDGET_REJECTED_FILES = "vllm:kv_offload_fs_budget_rejected_files"
# checksum_blocks: blocks that failed their integrity check on load (#57912's
# name, so that dashboards outlive this patch)
CHECKSUM_FAILURES = "vllm:kv_offload_tiering_checksum_failures"


class FsAsyncLookupManager(AsyncLookupManager):
    """Async lookup manager for FileSystemTierManager."""

    def __init__(
        self,
        tier: "FileSystemTierManager",
        tier_type: str,
    ) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(
        self, keys: list[OffloadKey], req_context: ReqContext
    ) -> Iterable[bool]:
        paths = [self._tier.file_mapper.get_file_name(k) for k in keys]
        if _HAS_BATCH_LOOKUP_C:
            # C extension: GIL released for the entire lstat() batch.
            return batch_lookup_C(paths)
        return (is_block_path(p) for p in paths)


def _file_mapper(
    root_dir: str, offloading_spec: "OffloadingSpec", tier_key: TierKey | None
) -> FileMapper:
    """Where the tier's files are, by layout and (with key_file) key."""
    # Opt in; FileMapper enables it only for a parallelism-invariant block.
    return FileMapper.from_offloading_spec(
        root_dir=root_dir,
        offloading_spec=offloading_spec,
        blocks_per_file=offloading_spec.blocks_per_chunk,
        parallel_agnostic=True,
        # keyed files live apart from unkeyed ones; the key is not named
        keyed_namespace=(
            {"file_names": "keyed-blake2b-128", "mac": "hmac-sha256-xattr"}
            if tier_key is not None
            else None
        ),
        file_stem=tier_key.file_stem if tier_key is not None else None,
    )


def view_address(view: memoryview) -> int:
    """Where a (writable) byte view's memory starts."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0


def _start_thread(target: Callable, *args: Any, name: str) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread


def _check_settings(
    tier_type: str, stale_s: object, group_access: object, checksum_blocks: object
) -> None:
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
    if not isinstance(checksum_blocks, bool):
        raise ValueError(
            f"checksum_blocks of the '{tier_type}' tier must be true or "
            f"false, got {checksum_blocks!r}"
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
    """A job in flight, as the tier keeps it: enqueued with the job's tasks,
    it comes back with the finished job (FinishedJob.record), so that the
    tier keeps no per-job table that I/O threads and the scheduler share."""

    keys: list[OffloadKey]
    is_load: bool
    # a store's request (its KV events say it)
    req_context: ReqContext | None = None
    # what the job holds of the budget (FsTierBudget.finish_job())
    admission: Admission | None = None
    # a store's keys in _unloadable: loadable again once stored
    rewrites: list[OffloadKey] = field(default_factory=list)


class FileSystemTierManager(SecondaryTierManager):
    """Pure-Python disk-backed secondary tier.

    Read-priority threads service load jobs preferentially; write-priority
    threads service store jobs preferentially.  Both groups can drain either
    queue, so neither starves.

    submit_store / submit_load are non-blocking: they enqueue tasks and return.
    get_finished_jobs() polls job completion and returns completed JobResults.

    Cross-process sharing:
        KV cache sharing between multiple vLLM instances using the same
        ``root_dir`` (e.g., via a shared PVC) works by default: ``NONE_HASH``
        (the chain-hash seed for block content hashes) is derived from a fixed
        default seed, so identical token content produces identical block
        filenames across instances. Setting the ``PYTHONHASHSEED`` environment
        variable to the same value on all instances overrides the default seed,
        and is required to share a cache when using a non-cryptographic
        prefix-caching hash algorithm, which seeds ``NONE_HASH`` randomly.

    Args:
        offloading_spec: Contains normalized offloading configuration and
            blocks_per_chunk.
        primary_kv_view: Memoryview of the primary tier's CPU KV cache.
        tier_type: Tier type identifier, set by SecondaryTierFactory.
        root_dir: Root directory for block files.
        n_read_threads: Number of read-priority I/O threads.
        n_write_threads: Number of write-priority I/O threads.
        enable_kv_events: Emit BlockStored KV events for blocks
            successfully stored to this tier. Effective only when KV
            cache events are enabled globally (kv_events_config).
        locality: Whether this tier's storage is LOCAL or REMOTE relative
            to the publishing vLLM instance.
        backpressure_detector: Optional backpressure detector.
        cleanup_stale_tmp_after_seconds: At start-up, remove the temp files
            under root_dir not modified for this long (left by writers
            killed between writing a block and renaming it); None: never.
        group_access: create files 0640 and directories 2770 (the group's
            engines read blocks and store into each other's directories)
            instead of 0600 and 0700.
        key_file: path of a private file holding a secret of at least 32
            bytes (never the secret itself): a keyed namespace for a shared
            root. File names become a keyed hash of the block hash, and each
            block file carries an HMAC-SHA256 of the block's identity and
            bytes, checked on load (a mismatch is a miss). Engines sharing a
            root share the key file; another key is another namespace.
        checksum_blocks: keep each block's CRC32C in an extended attribute
            of its file and check it on load: a block whose bytes changed,
            or that has none, is a miss (its file removed, counted). With
            key_file, the MAC checks the bytes already: no CRC32C.
        max_bytes: the most bytes this tier's files may take on disk (at
            least one chunk of every KV cache group); None: no limit.
            Engines sharing root_dir share it: set the same on each.

    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: "OffloadingSpec",
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        n_read_threads: int = 16,
        n_write_threads: int = 16,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
        cleanup_stale_tmp_after_seconds: float | None = 3600.0,
        group_access: bool = False,
        key_file: str | None = None,
        max_bytes: int | None = None,
        checksum_blocks: bool = False,
    ):
        _check_settings(
            tier_type, cleanup_stale_tmp_after_seconds, group_access, checksum_blocks
        )
        self._modes = GROUP_MODES if group_access else PRIVATE_MODES
        tier_key = (
            load_key_file(key_file, tier_type, group_access)
            if key_file is not None
            else None
        )
        # From here on the resolved root, the one checked: a symlink in the
        # given path could be repointed after the check.
        root_dir = check_root_dir(root_dir, tier_type, group_access)
        self._label = f"'{tier_type}' KV offload tier at {root_dir}"
        super().__init__(
            offloading_spec, primary_kv_view, tier_type, backpressure_detector
        )
        self.locality = Locality(locality) if locality is not None else None

        self.events = self._kv_events(enable_kv_events, offloading_spec)
        # Keys whose load failed and whose path still holds something that
        # is not a loadable block (a directory, a file that failed its check
        # on a read-only mount, a file whose read fails for good): answered
        # as misses, so that no request promotes them again, until a store
        # of the key (which writes its file anew) succeeds. Scheduler thread;
        # at most MAX_UNLOADABLE_KEYS, oldest first out.
        self._unloadable: dict[OffloadKey, None] = {}

        self._block_size: int = self.block_size_bytes  # a row of the view
        num_groups = len(offloading_spec.config.groups)
        self._max_bytes = validate_max_bytes(
            max_bytes, max(1, num_groups) * self._block_size, tier_type
        )

        self.file_mapper = _file_mapper(root_dir, offloading_spec, tier_key)
        self._init_integrity(tier_key, checksum_blocks, root_dir)

        self._config_lock = threading.Lock()
        self._config_failures = 0  # since the last warning (under _config_lock)
        self._config_throttle = Throttle()
        self._write_config()

        self._probe_root(root_dir)

        self._pool = DualQueueThreadPool(
            n_read_threads,
            n_write_threads,
            thread_name_prefix="vllm_kv_py_fs",
            label=self._label,
        )

        self._lookup_manager = FsAsyncLookupManager(tier=self, tier_type=self.tier_type)

        self._start_tmp_cleanup(root_dir, cleanup_stale_tmp_after_seconds)

        self._budget_reported = (0, 0)  # evicted, rejected files in get_stats()
        self._budget: FsTierBudget | None = None
        if self._max_bytes is not None:
            self._budget = self._start_budget(offloading_spec, root_dir, tier_key)
        mapper, budgeted = self.file_mapper, self._max_bytes is not None
        report_other_layouts(
            self._label, root_dir, mapper.base_path, mapper.fields, budgeted
        )
        self._marker = LayoutMark(self._o_direct_dir, self._label)

    def _kv_events(
        self, enable_kv_events: bool, offloading_spec: "OffloadingSpec"
    ) -> list[OffloadingEvent] | None:
        """The list KV events are collected in; None: none are emitted."""
        if not enable_kv_events:
            return None
        if offloading_spec.kv_events_config.enable_kv_cache_events:
            return []
        logger.warning(
            "enable_kv_events is set on secondary tier '%s' but KV "
            "cache events are disabled globally; the tier will not "
            "emit events.",
            self.tier_type,
        )
        return None

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

    def _init_integrity(
        self, tier_key: TierKey | None, checksum_blocks: bool, root_dir: str
    ) -> None:
        """What each block file carries: its MAC (key_file) or CRC32C
        (checksum_blocks), or nothing."""
        self._mac: BlockMac | None = None
        if tier_key is not None:
            self._mac = BlockMac(tier_key.mac_key, self.file_mapper.layout_id())
        # the MAC checks every block's bytes already (and more: it cannot be
        # forged), so with key_file no CRC32C is stored or checked
        self._checksum = checksum_blocks and self._mac is None
        # registered by build_metric_definitions() for checksum_blocks
        self._checksum_metric = checksum_blocks
        if checksum_blocks and not self._checksum:
            logger.info(
                "'%s' KV offload tier: checksum_blocks is covered by key_file "
                "(each block's HMAC-SHA256 is checked on load); no CRC32C is "
                "stored.",
                self.tier_type,
            )
        elif self._checksum and not has_compiled_io():
            logger.warning(
                "'%s' KV offload tier: checksum_blocks without vLLM's compiled "
                "fs_io_C extension computes each block's CRC32C in Python, "
                "holding the GIL (under 10 MB/s for the whole process). Fix: "
                "build vLLM with it, or set checksum_blocks to false.",
                self.tier_type,
            )
        # blocks that failed their integrity check (checksum_blocks), reported
        # by get_stats()
        self._checksum_failures = 0
        self._checksum_reported = 0
        # before anything is written: a root refused for xattrs keeps nothing
        self._probe_xattr(root_dir)

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

    def _probe_xattr(self, root_dir: str) -> None:
        """Where a MAC or CRC32C is kept: refuse a root without user extended
        attributes, naming the fix."""
        if self._mac is not None or self._checksum:
            setting, kept, off = (
                ("key_file", "MAC", "remove key_file")
                if self._mac is not None
                else ("checksum_blocks", "CRC32C", "set checksum_blocks to false")
            )
            make_dirs(root_dir, self._modes)
            try:
                probe_xattr(root_dir)
            except OSError as e:
                if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
                    raise  # not about xattrs (EROFS, EACCES): as it is
                raise ValueError(
                    f"{setting} of the '{self.tier_type}' tier needs user extended "
                    f"attributes at root_dir {root_dir!r} (each block's {kept} "
                    "is kept in one), but the filesystem refused one "
                    f"({e.strerror}). Fix: use a root_dir on a filesystem with "
                    "user xattrs (ext4, xfs, btrfs, tmpfs on Linux >= 6.6, NFS "
                    f"4.2), or {off}"
                ) from None

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

        groups = offloading_spec.config.groups
        budget = FsTierBudget(
            self._max_bytes,
            # every group's block file is one whole row
            [self._block_size] * (max((g.group_id for g in groups), default=0) + 1),
            f"{self.file_mapper.base_path}_r{self.file_mapper.rank}",
            self.file_mapper.get_file_name,
            lambda stem, g: self.file_mapper.get_stem_file_name(stem.hex(), g),
            self._label,
            chunk_tokens={
                group.group_id: group.tokens_per_block
                * offloading_spec.blocks_per_chunk
                for group in offloading_spec.config.groups
            },
            prefix_groups=[
                group.group_id
                for group in offloading_spec.config.groups
                # what the connector looks up as a prefix (full attention)
                if group.sliding_window_size_in_chunks is None
                and not (group.block_layout and group.block_layout.kind == "mamba")
            ]
            or None,
            chunk_id=chunk_id,
            on_removal_errors=self._pool.record_removal_errors,
        )
        logger.info(
            "'%s' KV offload tier at %s: max_bytes=%d (%d block files of %d "
            "bytes); indexing the files of earlier runs in the background",
            self.tier_type,
            root_dir,
            self._max_bytes,
            self._max_bytes // self._block_size,
            self._block_size,
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

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._unloadable:
            return LookupResult.MISS
        budget = self._budget
        if budget is not None and budget.is_removing(key):
            return LookupResult.MISS  # evicted: its file is about to be removed
        result = self._lookup_manager.lookup(key, req_context)
        if result is None:
            return LookupResult.RETRY
        if result and budget is not None:
            # pinned until the promotion the tiering manager submits for it,
            # or evicted already (a miss)
            positions = req_context.offload_key_positions()
            if not budget.on_hit(key, req_context.req_id, positions):
                return LookupResult.MISS
        return LookupResult.HIT if result else LookupResult.MISS

    def _file_size(self, key: OffloadKey) -> int:
        """The size of *key*'s block file: a row of the primary tier's view."""
        return self._block_size

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
        """Write each key's row at *offsets* of the primary tier's view to
        its path; an error not of its block stops it (batch_store_block)."""
        if paths:
            batch_store_block(
                paths,
                self._primary_kv_view,
                offsets,
                self._block_size,
                self._use_o_direct,
                self._modes,
                self._mac,
                keys,
                self._checksum,
            )

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

    def _publish_evicted(self) -> None:
        """Evicted chunks' keys (scheduler thread): their cached lookup
        verdicts are misses now, and KV events report them removed."""
        assert self._budget is not None
        for evicted_keys in self._budget.take_evicted_keys():
            self._lookup_manager.mark_miss(evicted_keys)
            if self.events is not None:
                self.events.append(
                    OffloadingEvent(
                        keys=evicted_keys,
                        medium=self.medium,
                        removed=True,
                        locality=self.locality,
                    )
                )

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        job = _Job(keys, is_load=False, req_context=job_metadata.req_context)
        if self._unloadable:
            job.rewrites = [key for key in keys if key in self._unloadable]
        rows = job_metadata.chunk_ids.tolist()
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

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        job = _Job(keys, is_load=True)
        if self._budget is not None:
            job.admission = self._budget.pin_load(keys)
        task = functools.partial(
            self._load_blocks, keys, job_metadata.chunk_ids.tolist()
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
        """Read each key's file into its row at *offsets* of the primary
        tier's view; an error not of its block stops it (batch_load_block)."""
        batch_load_block(
            paths,
            self._primary_kv_view,
            offsets,
            self._block_size,
            self._use_o_direct,
            self._mac,
            keys,
            self._checksum,
        )

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

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Collect finished jobs; a failed promotion marks only its failed keys
        as a miss here (scheduler thread)."""
        if self._budget is not None:
            # before the stores that evicted them are reported
            self._publish_evicted()
        return [
            self._finish_load(finished)
            if finished.record.is_load
            else self._finish_store(finished)
            for finished in self._pool.get_finished()
        ]

    def _finish_store(self, finished: FinishedJob) -> JobResult:
        """A finished store: the keys it wrote are present (all of them, or
        those written before the budget refused the others)."""
        job: _Job = finished.record
        outcome = finished.outcomes[0]
        failed = isinstance(outcome, Exception)
        written: list[OffloadKey] = (
            getattr(outcome, "written", []) if failed else outcome
        )
        if self._budget is not None:
            assert job.admission is not None
            self._budget.finish_job(job.admission, getattr(outcome, "missing", []))
        if written:
            self._lookup_manager.mark_present(written)
            if self.events is not None:
                self.events.append(
                    OffloadingEvent(
                        keys=list(written),
                        medium=self.medium,
                        removed=False,
                        locality=self.locality,
                        req_context=job.req_context,
                    )
                )
            if job.rewrites:
                # a store replaced what could not be loaded: loadable again
                for key in set(job.rewrites).intersection(written):
                    self._unloadable.pop(key, None)
        count = len(written) if written else len(job.keys)
        return JobResult(
            job_id=finished.job_id,
            success=not failed,
            transfer_time=finished.transfer_time,
            transfer_bytes=count * self._block_size if count else None,
        )

    def _mark_unloadable(self, keys: Iterable[OffloadKey]) -> None:
        """Answer *keys* as misses until stored again (most recent last)."""
        for key in keys:
            self._unloadable.pop(key, None)
            self._unloadable[key] = None
        while len(self._unloadable) > MAX_UNLOADABLE_KEYS:
            del self._unloadable[next(iter(self._unloadable))]

    def _finish_load(self, finished: FinishedJob) -> JobResult:
        """A finished load. A batched load goes on past a bad block and
        reports which blocks failed: the others are kept in the primary tier
        (reported via successful_keys); only the failed ones are marked a
        miss and recomputed."""
        job: _Job = finished.record
        outcome = finished.outcomes[0]
        keys = job.keys
        transfer_bytes = len(keys) * self._block_size if keys else None
        if self._budget is not None:
            assert job.admission is not None
            gone = getattr(outcome, "gone", ())
            self._budget.finish_job(job.admission, [keys[i] for i in gone])
        if not isinstance(outcome, Exception):
            return JobResult(
                job_id=finished.job_id,
                success=True,
                transfer_time=finished.transfer_time,
                transfer_bytes=transfer_bytes,
            )
        self._checksum_failures += len(getattr(outcome, "integrity_failed", ()))
        self._mark_unloadable(keys[i] for i in getattr(outcome, "unloadable", ()))
        failed_indices = getattr(outcome, "failed_indices", None)
        failed_set = set(range(len(keys)) if failed_indices is None else failed_indices)
        successful = [k for i, k in enumerate(keys) if i not in failed_set]
        self._lookup_manager.mark_miss([keys[i] for i in sorted(failed_set)])
        return JobResult(
            job_id=finished.job_id,
            success=False,
            successful_keys=tuple(successful) if successful else None,
            transfer_time=finished.transfer_time,
            transfer_bytes=transfer_bytes,
        )

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is not None:
            yield from self.events
            self.events.clear()

    @override
    def drain_jobs(self) -> None:
        """Block until all in-flight transfers in the threadpool finish."""
        self._pool.wait_idle()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup_manager.cleanup(req_context.req_id)
        if self._budget is not None:
            self._budget.forget_request(req_context.req_id)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup_manager.flush()
        if self._budget is not None:
            # after the step's promotions were submitted (and pinned)
            self._budget.end_step()
            self._publish_evicted()

    @classmethod
    @override
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        metrics: dict[str, OffloadingMetricMetadata] = {}
        if extra_config.get("checksum_blocks"):
            metrics[CHECKSUM_FAILURES] = OffloadingCounterMetadata(
                documentation="Blocks the fs tier did not load because they "
                "failed their integrity check (checksum_blocks: a CRC32C "
                "mismatch or none recorded; with key_file, a MAC mismatch); "
                "their files are removed.",
                labelnames=("tier_type",),
            )
        if extra_config.get("max_bytes") is None:
            return metrics
        return metrics | {
            BUDGET_USED_BYTES: OffloadingGaugeMetadata(
                documentation="Bytes of the fs tier's files counted against "
                "its max_bytes budget (including stores in flight).",
                labelnames=("tier_type",),
            ),
            BUDGET_MAX_BYTES: OffloadingGaugeMetadata(
                documentation="The fs tier's max_bytes budget.",
                labelnames=("tier_type",),
            ),
            BUDGET_EVICTED_FILES: OffloadingCounterMetadata(
                documentation="Block files the fs tier evicted to stay within "
                "max_bytes.",
                labelnames=("tier_type",),
            ),
            BUDGET_REJECTED_FILES: OffloadingCounterMetadata(
                documentation="Block files the fs tier did not store: no room "
                "in max_bytes (every indexed file older in the eviction order "
                "in use by a transfer).",
                labelnames=("tier_type",),
            ),
        }

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        budget = self._budget
        if budget is None and not self._checksum_metric:
            return None
        stats = OffloadingConnectorStats()
        label = (self.tier_type,)
        if self._checksum_metric:
            stats.increase_counter(
                CHECKSUM_FAILURES,
                self._checksum_failures - self._checksum_reported,
                label,
            )
            self._checksum_reported = self._checksum_failures
        if budget is None:
            return stats
        stats.set_gauge(BUDGET_USED_BYTES, budget.used + budget.unlinking, label)
        stats.set_gauge(BUDGET_MAX_BYTES, budget.max_bytes, label)
        evicted, rejected = budget.evicted_files, budget.rejected_files
        stats.increase_counter(
            BUDGET_EVICTED_FILES, evicted - self._budget_reported[0], label
        )
        stats.increase_counter(
            BUDGET_REJECTED_FILES, rejected - self._budget_reported[1], label
        )
        self._budget_reported = (evicted, rejected)
        return stats

    @override
    def shutdown(self) -> None:
        """Release resources held by this tier.

        Shuts down the lookup manager and the thread pool,
        clearing pending tasks and waiting for active threads to complete.
        """
        self._tmp_cleanup_stop.set()
        self._tmp_cleanup.join()
        self._marker.stop()
        self._lookup_manager.shutdown()
        self._pool.shutdown(wait=True)
        if self._budget is not None:
            self._budget.shutdown()
