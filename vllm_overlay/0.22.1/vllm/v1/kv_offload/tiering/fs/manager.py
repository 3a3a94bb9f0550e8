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

I/O mode:
    O_DIRECT (bypassing the page cache) when the primary tier's rows are
    page-aligned and the filesystem supports it, else buffered I/O. Decided
    at start by probe_direct_io(), and logged with the reason. A probe that
    failed for a reason that may pass (a full disk, an I/O error) is run
    again, by the first store at least REPROBE_INTERVAL_S later, until it
    succeeds or fails for good.

Useful bytes only:
    A key's file holds the bytes of the CPU row its KV cache group's
    transfers use (cpu/row_extents.py: not the tensors of other groups' layers,
    not the padding of a mamba state), zero-padded to the page size: a group
    whose bytes are one page-aligned run of the row is written and read in
    place, else through a page-aligned per-thread buffer, so that O_DIRECT
    works for every group. A load writes only the group's runs of the row.
    Each group's file size is part of the layout (config.json), so files of
    whole rows written before are never read.

Integrity (the tier config's "checksum", on by default):
    With "auto" (the default: crc32c where the fs_io_C extension is built,
    computed in C with the block's I/O; else xxh3_64 where the xxhash
    package imports, else crc32), "crc32c", "xxh3_64" or "crc32", each
    block file carries a checksum of the block's key and bytes, set as its
    extended attribute user.vllm.kv_checksum before the file is published:
    the file holds exactly the block. A load
    whose checksum does not match or is missing fails: the key is a miss,
    so a block file overwritten by another writer (same size, another key's
    block, a flipped bit) is never served. Where the root's filesystem has
    no user xattrs (probed once at start), the checksum is written in a
    trailer after the block instead (a page where the blocks are
    page-aligned, for O_DIRECT; else 8 bytes), which costs more I/O and
    keeps every block on the Python path: there "auto" checks nothing (a
    warning at start says so and how to choose a trailer). Where it is
    kept, and the algorithm, are part of the file layout
    (config.json): files of one format are never read as another.

Keyed namespace (the tier config's "key_file", off by default):
    For a store shared by several engines (NFS, a PVC): with a key read from
    a private file (fs/security.py), block files are named by a keyed hash
    of the block hash and carry an HMAC-SHA256 of the block's identity
    (layout and key) and bytes where the checksum would be (the extended
    attribute user.vllm.kv_mac, else the trailer), checked on load.
    Without the key nobody can compute where a prefix's block lives, test
    whether it is cached, or plant a file that loads: a planted or altered
    file is a miss, counted in the rate-limited failure report. Engines
    sharing a root share the key; another key is another namespace.

File modes (the tier config's "group_access", off by default):
    KV blocks are users' data. Block files, temp files and config.json are
    created 0600 and the tier's directories 0700, set exactly whatever the
    process umask; with "group_access": true, 0640 and 2770 (setgid, group
    writable: the group's engines store into each other's directories), for
    a root shared by service accounts of one group. Files and directories of the
    tier's tree with wider modes (from before, or made by hand) are counted
    by the start-up walk and reported once, with an example and the fix.
    A root (or a parent) that others can write or that another user owns is
    refused at start (fs/security.py). Block files are opened with
    O_NOFOLLOW and, where /proc is mounted, checked to be where their path
    says (not behind a symlinked directory): a symbolic link in the tree is
    a miss, never read, written or removed through.

Budget (the tier config's "max_bytes", unbounded by default):
    The layout's files on the root never exceed max_bytes by more than one
    store job per engine: engines sharing the root share the budget (each
    counts the others' stores through their ledgers). A store evicts first,
    whole chunks (every group's file) of the least recently used prefix
    tails, never a chunk with a transfer in flight; a store that cannot fit
    fails for the keys that do not. Existing files are indexed at start,
    in the background. See budget.py. The root's other layouts (an earlier
    version's, another model's) are not counted: they are named at start,
    for their owner to remove, least recently used first, with how long ago
    (a running tier sets its layout directory's mtime hourly), so that a
    layout nobody runs is told from a live one.

File naming:  <base_path>_r<rank>/<hhh>/<hh>_g<group_idx>/<hash_hex>.bin
              (hash-based subdirectories to limit directory fan-out)
"""

import errno
import functools
import json
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, get_offload_group_idx
from vllm.v1.kv_offload.cpu.row_extents import group_row_runs
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
from vllm.v1.kv_offload.tiering.fs.io import (
    CHECKSUM_XATTR,
    CHECKSUMS,
    MAC_XATTR,
    BlockChecksum,
    BlockMac,
    io_calls_in_use,
    load_block,
    probe_direct_io,
    probe_user_xattrs,
    resolve_checksum,
    store_block,
    umask_narrows,
)
from vllm.v1.kv_offload.tiering.fs.layouts import LayoutMark, report_other_layouts
from vllm.v1.kv_offload.tiering.fs.report import Throttle
from vllm.v1.kv_offload.tiering.fs.security import (
    TierKey,
    check_root_dir,
    load_key_file,
)
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = init_logger(__name__)


# After an O_DIRECT probe failed for a reason that may pass (a full disk, an
# I/O error), probe again with the first store at least this much later.
REPROBE_INTERVAL_S = 60.0
# lookup() without a request: its hits order like a request's unpositioned
# keys (recency)
_NO_REQUEST = ReqContext(req_id="")


@dataclass(frozen=True)
class GroupFile:
    """How a KV cache group's block file maps to a row of the primary tier:
    *size* bytes (the group's, page-aligned), at *offset* of the row when
    runs is None, else gathered from (and scattered to) the row's *runs*."""

    offset: int
    size: int
    runs: tuple[tuple[int, int], ...] | None = None


def group_files(
    offloading_spec: "OffloadingSpec", row_bytes: int
) -> list[GroupFile] | None:
    """Each KV cache group's file, from the CPU tier's row layout; None where
    the rows (*row_bytes* each) are not the CPU offloading rows that
    group_row_runs() describes (files of whole rows then)."""
    per_worker = getattr(offloading_spec, "cpu_page_size_per_worker", None)
    num_workers = offloading_spec.vllm_config.parallel_config.world_size
    if (
        not isinstance(per_worker, int)
        or not isinstance(num_workers, int)
        or per_worker * num_workers != row_bytes
    ):
        return None
    # O_DIRECT needs page-aligned lengths, where the rows allow it at all
    align = mmap.PAGESIZE if row_bytes % mmap.PAGESIZE == 0 else 1
    files = []
    for runs in group_row_runs(
        offloading_spec.kv_cache_config,
        offloading_spec.block_size_factor,
        per_worker,
        num_workers,
    ):
        size = -(-sum(n for _, n in runs) // align) * align
        if len(runs) == 1 and runs[0][1] == size and runs[0][0] % align == 0:
            files.append(GroupFile(runs[0][0], size))  # in place
        else:
            files.append(GroupFile(0, size, tuple(runs)))
    return files


def _keyed_chunk_id(file_stem: Callable[[bytes], str], block_hash: bytes) -> bytes:
    return bytes.fromhex(file_stem(block_hash))


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
            f"cleanup_stale_tmp_after_seconds of the '{tier_type}' tier must "
            f"be a number of seconds >= 0 or null (no cleanup), got {stale_s!r}"
        )
    if not isinstance(group_access, bool):
        raise ValueError(
            f"group_access of the '{tier_type}' tier must be true or false, "
            f"got {group_access!r}"
        )


@dataclass
class _Job:
    """A job in flight, as the tier keeps it: enqueued with the job's tasks
    (one a key), it comes back with the finished job (FinishedJob.record),
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
        cleanup_stale_tmp_after_seconds: At start-up, remove the tier's
            temp files not modified for this long (left by writers
            killed between writing a block and renaming it); None: never.
        checksum: "auto" (the default: crc32c where the fs_io_C
            extension is built, else xxh3_64 where the xxhash package
            imports, else crc32), "crc32c" (Castagnoli, in C), "xxh3_64",
            "crc32" (zlib) or "none": store a checksum of each block's
            key and bytes with the block (in an extended attribute of
            its file, else a trailer) and check it on every load; a
            mismatch (a file overwritten by another writer, another key's
            block, a flipped bit) makes the key a miss. Part of the file
            layout: each algorithm has its own directory. "auto" checks
            nothing where the root has no user xattrs (a warning at
            start says so).
        group_access: create files 0640 and directories 2770 (the
            group's engines read blocks and store into each other's
            directories) instead of 0600 and 0700.
        key_file: path of a private file holding a secret of at least
            32 bytes (never the secret itself): a keyed namespace for a
            shared root. File names become a keyed hash of the block
            hash, and each block file carries an HMAC-SHA256 of the
            block's identity and bytes, checked on load (a mismatch is
            a miss). Engines sharing a root share the key file; another
            key is another namespace. Replaces 'checksum'.
        max_bytes: the most bytes this tier's files may take on disk
            (at least one chunk of every KV cache group); None: no limit.
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
        # block files need an fchmod only where the umask at start-up narrows
        # their mode (a later umask can only make new files more private)
        self._chmod_files = umask_narrows(self._modes.file)
        # From here on the resolved root, the one checked: a symlink in the
        # given path could be repointed after the check.
        root_dir = check_root_dir(root_dir, tier_type, group_access)
        self._label = f"'{tier_type}' KV offload tier at {root_dir}"
        tier_key = (
            load_key_file(key_file, tier_type, group_access)
            if key_file is not None
            else None
        )
        super().__init__(offloading_spec, primary_kv_view, tier_type)

        assert primary_kv_view.strides is not None, "a view of rows"
        self._block_size: int = primary_kv_view.strides[0]  # a row of the view

        self._checksum, file_format, in_xattr = self._resolve_checksum(
            checksum, tier_key, root_dir
        )

        self._map_files(offloading_spec, root_dir, tier_key, file_format, in_xattr)

        # bytes of each group's block files; a chunk has one per group
        trailer = self._checksum.trailer_size if self._checksum else 0
        self._file_sizes = [f.size + trailer for f in self._group_files]
        self._max_bytes = validate_max_bytes(
            max_bytes, sum(self._file_sizes), tier_type
        )

        self._root_dir = root_dir
        self._config_lock = threading.Lock()
        self._config_failures = 0  # since the last warning (under _config_lock)
        self._config_throttle = Throttle()
        self._write_config()

        self._probe_root(root_dir)

        # Keys whose load failed and whose file could not be removed (a
        # directory, a file on a read-only or immutable mount): answered as
        # misses, so that the scheduler does not promote them again and
        # again, until a store of the key (which replaces the file) succeeds.
        self._unloadable: set[OffloadKey] = set()

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
        file_format: dict | None,
        in_xattr: bool,
    ) -> None:
        """Where the tier's files are and what each holds of a row: the
        FileMapper of the layout (with key_file: keyed names and a MAC)."""
        # what each group's files hold of a row (whole rows where unknown)
        files = group_files(offloading_spec, self._block_size)
        num_groups = len(offloading_spec.kv_cache_config.kv_cache_groups)
        self._whole_row = GroupFile(0, self._block_size)
        self._group_files: list[GroupFile] = files or [self._whole_row] * max(
            1, num_groups
        )
        if tier_key is not None:
            # keyed files live apart from unkeyed ones; the key is not named
            file_format = {
                **BlockMac.describe_format(
                    self._block_size, MAC_XATTR if in_xattr else None
                ),
                "file_names": "keyed-blake2b-128",
            }

        # Create file mapper
        self.file_mapper = FileMapper.from_offloading_spec(
            # resolved, so that I/O can tell a symlink in the tree
            root_dir=root_dir,
            offloading_spec=offloading_spec,
            gpu_blocks_per_file=offloading_spec.block_size_factor,
            checksum=file_format,
            file_stem=tier_key.file_stem if tier_key is not None else None,
            group_file_bytes=[f.size for f in files] if files else None,
        )
        if tier_key is not None:
            self._checksum = BlockMac(
                tier_key.mac_key,
                self._block_size,
                self.file_mapper.layout_id(),
                MAC_XATTR if in_xattr else None,
            )

    def _resolve_checksum(
        self, checksum: str, tier_key: TierKey | None, root_dir: str
    ) -> tuple["BlockChecksum | None", dict | None, bool]:
        """The block checksum of the 'checksum' setting (None: none; a
        key_file's MAC replaces it), its file format, and whether it is kept
        in an extended attribute (else a trailer)."""
        if tier_key is not None and checksum not in ("auto", "none"):
            raise ValueError(
                f"the '{self.tier_type}' tier's key_file replaces its checksum (a "
                "keyed MAC checks every block): remove 'checksum' or set it "
                "to 'auto' or 'none'"
            )
        if checksum not in CHECKSUMS:
            raise ValueError(
                f"Unknown checksum {checksum!r} in the fs_python tier's config: "
                f"set 'checksum' to one of {list(CHECKSUMS)}"
            )
        # the checksum or MAC in an extended attribute of each block file,
        # else (a filesystem without user xattrs) in a trailer after it
        xattr_reason = None
        if tier_key is not None or checksum != "none":
            make_dirs(root_dir, self._modes)
            xattr_reason = probe_user_xattrs(root_dir, self._modes)
        auto_off = checksum == "auto" and tier_key is None
        if xattr_reason is not None and not auto_off:
            logger.info(
                "%s: keeping each block's checksum in a "
                "trailer after the block because %s",
                self._label,
                xattr_reason,
            )
        in_xattr = xattr_reason is None
        if auto_off and not in_xattr:
            # a trailer page per file (+25% for 16 KiB group files) and every
            # block on the Python path: not a default's price
            logger.warning(
                "%s: blocks are not checked for damage: "
                "checksum 'auto' keeps its checksum in a user extended "
                "attribute, and %s. Set the tier's 'checksum' to 'crc32c' "
                "(or 'xxh3_64', 'crc32') to keep it in a trailer page after "
                "each block instead",
                self._label,
                xattr_reason,
            )
            checksum = "none"
        self._checksum: BlockChecksum | None = None
        if tier_key is None and checksum != "none":
            self._checksum = BlockChecksum(
                resolve_checksum(checksum),
                self._block_size,
                CHECKSUM_XATTR if in_xattr else None,
            )
        file_format = self._checksum.describe() if self._checksum else None
        return self._checksum, file_format, in_xattr

    def _probe_root(self, root_dir: str) -> None:
        """Probe the layout directory for O_DIRECT (see probe_direct_io())."""
        # O_DIRECT bypasses the page cache, but only works for aligned rows
        # on filesystems that support it; otherwise use buffered I/O.
        self._probe_dir = os.path.dirname(self.file_mapper.get_config_file_path())
        reason, transient = probe_direct_io(
            self._probe_dir, self._primary_kv_view, self._block_size, self._modes
        )
        self._direct_io: bool = reason is None
        # when to probe again after a transient failure (None: never)
        self._reprobe_at: float | None = (
            time.monotonic() + REPROBE_INTERVAL_S if transient else None
        )
        if transient:
            reason = f"{reason}; probing again in {REPROBE_INTERVAL_S:.0f} s"
        logger.info("%s: %s", self._label, io_calls_in_use())
        if self._direct_io:
            logger.info(
                "%s: using O_DIRECT I/O for %d-byte blocks",
                self._label,
                self._block_size,
            )
        else:
            logger.info(
                "%s: using buffered I/O for %d-byte blocks because %s",
                self._label,
                self._block_size,
                reason,
            )

    def _start_tmp_cleanup(self, root_dir: str, max_age_s: float | None) -> None:
        """Walk the tier's files in the background (the walk can be long):
        remove the temp files of writers that died between writing a block
        and renaming it into place, and count files with wider modes than
        the tier's. This rank's block directory, and the config's (the
        O_DIRECT probe's and config.json's)."""
        self._stop_tmp_cleanup = threading.Event()
        block_dir = f"{self.file_mapper.base_path}_r{self.file_mapper.rank}"
        self._tmp_cleanup = _start_thread(
            scan_and_report,
            self._label,
            (os.path.dirname(self.file_mapper.get_config_file_path()), block_dir),
            max_age_s,
            self._modes,
            root_dir,
            self._stop_tmp_cleanup,
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
            # keyed files: the budget indexes chunks by their file names
            chunk_id = functools.partial(_keyed_chunk_id, tier_key.file_stem)
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
        """Write config.json (the layout of this directory's files) unless it
        exists; atomically, as several engines may share the directory.
        Returns whether it was written."""
        config_path = self.file_mapper.get_config_file_path()
        if os.path.exists(config_path):
            return False
        make_dirs(os.path.dirname(config_path), self._modes)
        config = json.dumps(self.file_mapper.get_run_config(), indent=2, sort_keys=True)
        write_file_atomically(config_path, config.encode(), self._modes)
        return True

    def _on_new_dir(self) -> None:
        """A store created a block directory (an I/O thread): if the tier's
        root was removed while running, re-create its config.json too, or
        the blocks stored from now on would lie in a directory that does not
        say what they are."""
        try:
            with self._config_lock:
                rewritten = self._write_config()
            if rewritten:
                logger.warning(
                    "%s: %s was missing (was the directory removed?); re-created it",
                    self._label,
                    self.file_mapper.get_config_file_path(),
                )
        except OSError as e:
            with self._config_lock:
                self._config_failures += 1
                if not self._config_throttle.due():
                    return
                failures, self._config_failures = self._config_failures, 0
            logger.warning(
                "%s: could not re-create %s (%d failed "
                "attempt(s) since the last warning; its blocks are stored "
                "without it): %s",
                self._label,
                self.file_mapper.get_config_file_path(),
                failures,
                e,
            )

    def lookup(
        self, key: OffloadKey, req_context: ReqContext | None = None
    ) -> bool | None:
        if key in self._unloadable:
            return False
        try:
            st = os.lstat(self.file_mapper.get_file_name(key))
        except OSError:
            return False
        # a symbolic link is never read through (load_block: O_NOFOLLOW)
        if stat.S_ISLNK(st.st_mode):
            return False
        budget = self._budget
        if budget is not None:
            # pinned until the promotion the tiering manager submits for it,
            # or evicted already: its file is about to be removed (a miss)
            ctx = req_context or _NO_REQUEST
            return budget.on_hit(key, ctx.req_id, ctx.offload_key_positions())
        return True

    def _reprobe_direct_io(self) -> None:
        """Probe O_DIRECT again after a transient failure (on an I/O thread,
        before a store): switch to it if it works now, else keep buffered
        I/O and, if the failure may still pass, probe again later."""
        try:
            reason, transient = probe_direct_io(
                self._probe_dir, self._primary_kv_view, self._block_size, self._modes
            )
        except OSError as e:  # the probe file could not even be created
            reason, transient = str(e), True
        if reason is None:
            self._direct_io = True
            logger.info(
                "%s: the O_DIRECT probe succeeded this time; "
                "using O_DIRECT I/O for %d-byte blocks",
                self._label,
                self._block_size,
            )
        elif transient:
            self._reprobe_at = time.monotonic() + REPROBE_INTERVAL_S
        else:
            logger.info(
                "%s: keeping buffered I/O because %s",
                self._label,
                reason,
            )

    def _with_reprobe(self, task: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            self._reprobe_direct_io()
            task()

        return run

    def _store_admitted(
        self, job: Admission, key: OffloadKey, block_id: int, rewrite: bool
    ) -> None:
        """A store task of a budgeted tier: its job's admission first (on
        this I/O thread, not the scheduler's), then, for the job's first
        task, the evicted chunks' files removed, then its write."""
        assert self._budget is not None
        rejected, unreachable, evicted = self._budget.admitted(job)
        if evicted:
            self._budget.remove_evicted(evicted)
        if rejected and key in rejected:
            self._reject(key)
        if unreachable and key in unreachable:
            return  # its prefix is not on disk: it could never hit
        gf = self._group_file(key)
        store_block(
            self.file_mapper.get_file_name(key),
            self._primary_kv_view,
            block_id * self._block_size + gf.offset,
            gf.size,
            self._direct_io,
            rewrite,
            key,
            self._checksum,
            self._on_new_dir,
            self._modes,
            self._chmod_files,
            gf.runs,
        )
        self._budget.written(job, (key,))

    def _reject(self, key: OffloadKey) -> None:
        # reported by the budget's rejection warning, not as a failed write
        raise BudgetRejection(
            errno.ENOSPC,
            f"no room in max_bytes={self._max_bytes}: every indexed block file "
            "is in use by a transfer",
        )

    def _group_file(self, key: OffloadKey) -> GroupFile:
        g = get_offload_group_idx(key)
        files = self._group_files
        return files[g] if g < len(files) else self._whole_row

    def submit_store(self, job_metadata: JobMetadata) -> None:
        unloadable = self._unloadable
        record = _Job(list(job_metadata.keys), is_load=False)
        if unloadable:
            record.rewrites = [k for k in record.keys if k in unloadable]
        tasks: Iterable[Callable[[], None]]
        if self._budget is not None:
            # the job's admission (reserving its bytes, evicting first,
            # pinning its chunks) is decided by its first task to run
            ctx = job_metadata.req_context
            job = self._budget.admit_store(
                job_metadata.keys, ctx.req_id, ctx.offload_key_positions()
            )
            record.admission = job
            store = self._store_admitted
            tasks = (
                functools.partial(
                    store, job, key, int(bid), bool(unloadable) and key in unloadable
                )
                for key, bid in zip(job_metadata.keys, job_metadata.block_ids)
            )
        else:
            tasks = (
                functools.partial(
                    store_block,
                    self.file_mapper.get_file_name(key),
                    self._primary_kv_view,
                    int(bid) * self._block_size + gf.offset,
                    gf.size,
                    self._direct_io,
                    key in unloadable,
                    key,
                    self._checksum,
                    self._on_new_dir,
                    self._modes,
                    self._chmod_files,
                    gf.runs,
                )
                for key, bid in zip(job_metadata.keys, job_metadata.block_ids)
                for gf in (self._group_file(key),)
            )
        reprobe_at = self._reprobe_at
        if (
            reprobe_at is not None
            and job_metadata.keys
            and time.monotonic() >= reprobe_at
        ):
            # the job's first task probes first (off the scheduler's thread)
            self._reprobe_at = None
            tasks = (
                self._with_reprobe(t) if i == 0 else t for i, t in enumerate(tasks)
            )
        self._pool.enqueue_store(
            job_metadata.job_id, len(record.keys), list(tasks), record
        )

    def submit_load(self, job_metadata: JobMetadata) -> None:
        tasks = (
            functools.partial(
                load_block,
                self.file_mapper.get_file_name(key),
                self._primary_kv_view,
                int(bid) * self._block_size + gf.offset,
                gf.size,
                self._direct_io,
                key,
                self._checksum,
                gf.runs,
            )
            for key, bid in zip(job_metadata.keys, job_metadata.block_ids)
            for gf in (self._group_file(key),)
        )
        record = _Job(list(job_metadata.keys), is_load=True)
        if self._budget is not None:
            record.admission = self._budget.pin_load(job_metadata.keys)
        self._pool.enqueue_load(
            job_metadata.job_id, len(record.keys), list(tasks), record
        )

    def get_finished(self) -> Iterable[JobResult]:
        """
        Collect completed jobs from the finished-jobs queue.
        """
        results = []
        budget = self._budget
        if budget is not None:
            budget.end_step()
            # evicted chunks: lookup() stats their files (no cached verdict
            # to turn into a miss), so they only leave the removing set
            budget.take_evicted_keys()
        for finished in self._pool.get_finished():
            job: _Job = finished.record
            keys, failed = job.keys, finished.failed
            if budget is not None:
                assert job.admission is not None
                budget.finish_job(job.admission, [keys[i] for i in failed])
            if job.rewrites:
                # a store that replaced an unloadable file: loadable again
                failed_keys = {keys[i] for i in failed}
                self._unloadable.difference_update(
                    k for k in job.rewrites if k not in failed_keys
                )
            if not failed:
                results.append(JobResult(job_id=finished.job_id, success=True))
                continue
            failed_idx = set(failed)
            successful = [k for i, k in enumerate(keys) if i not in failed_idx]
            if job.is_load:
                # A failed load removes the file; one still there cannot be
                # loaded or removed, and would be promoted forever.
                for i in failed_idx:
                    if os.path.lexists(self.file_mapper.get_file_name(keys[i])):
                        self._unloadable.add(keys[i])
            results.append(
                JobResult(
                    job_id=finished.job_id, success=False, successful_keys=successful
                )
            )
        return results

    def shutdown(self) -> None:
        """
        Release resources held by this tier.

        Shuts down the thread pool, clearing pending tasks and waiting for
        active threads to complete.
        """
        self._stop_tmp_cleanup.set()
        self._tmp_cleanup.join()
        self._marker.stop()
        self._pool.shutdown(wait=True)
        if self._budget is not None:
            self._budget.shutdown()
