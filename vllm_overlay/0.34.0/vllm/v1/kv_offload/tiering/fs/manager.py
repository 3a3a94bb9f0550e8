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
import errno
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

try:
    from vllm.fs_io_C import batch_lookup as batch_lookup_C

    _HAS_BATCH_LOOKUP_C = True
except ImportError:
    _HAS_BATCH_LOOKUP_C = False

import regex as re
from typing_extensions import override

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.logger import init_logger
from vllm.v1.kv_offload import kv_values
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
    JobId,
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
)
from vllm.v1.kv_offload.tiering.fs.io import (
    GROUP_MODES,
    PRIVATE_MODES,
    BlockMac,
    batch_load_block,
    batch_store_block,
    has_compiled_io,
    holds_no_block,
    is_block_path,
    make_dirs,
    probe_o_direct,
    probe_xattr,
    scan_tier_files,
    write_file_atomically,
)
from vllm.v1.kv_offload.tiering.fs.security import (
    TierKey,
    check_root_dir,
    load_key_file,
)
from vllm.v1.kv_offload.tiering.fs.thread_pool import (
    FAILURE_REPORT_INTERVAL_S,
    DualQueueThreadPool,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = init_logger(__name__)

# After an O_DIRECT probe failed for a reason that may pass (a full disk, an
# I/O error), probe again after the first store at least this much later.
REPROBE_INTERVAL_S = 60.0

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
            # C extension: GIL released for the entire faccessat() batch.
            return batch_lookup_C(paths)
        return (is_block_path(p) for p in paths)


# The most layout names a start-up line gives (then "and N more").
_LAYOUTS_NAMED = 5
# A running tier sets its layout directory's mtime (<model>_<layout digest>,
# its config.json's) to now every so often, and an engine's start changes it
# too (the O_DIRECT probe): a layout whose mtime is older has no engine
# running on it, which another engine's start-up line says (_names()).
LAYOUT_MARK_INTERVAL_S = 3600.0
# A mark that keeps failing is reported at the first failure and then once
# every so many intervals, with the count.
_MARK_FAILURES_REPORTED_EVERY = 24
# FileMapper's directories: <model>_<layout digest> (its config.json) and
# <model>_<layout digest>_r<rank> (a rank's blocks).
_LAYOUT_DIR = re.compile(r"(.+)_[0-9a-f]{12}(_r[0-9]+)?")


def other_layouts(root_dir: str, base_path: str) -> tuple[list[str], list[str]]:
    """Return the `<model>_<layout digest>` names of the layouts with
    directories in `root_dir` other than `base_path`'s, sorted: this model's,
    then other models'. One listing, no walk; a listing that fails part way
    returns what it saw."""
    own = os.path.basename(base_path)
    own_model = _LAYOUT_DIR.fullmatch(own)
    same: set[str] = set()
    other: set[str] = set()
    with contextlib.suppress(OSError), os.scandir(root_dir) as entries:
        for entry in entries:
            match = _LAYOUT_DIR.fullmatch(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False):
                continue
            name = entry.name.removesuffix(match.group(2) or "")
            if name == own:
                continue
            model = match.group(1)
            (same if own_model and model == own_model.group(1) else other).add(name)
    return sorted(same), sorted(other)


def _age(seconds: float) -> str:
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"


def _names(root_dir: str, layouts: list[str], fields: dict | None = None) -> str:
    """The layouts, least recently used first (their directory's mtime,
    see LAYOUT_MARK_INTERVAL_S), each with how long ago and, given this
    layout's `fields`, what differs in theirs (kv_values.layout_change)."""
    mtimes = {}
    for name in layouts:
        with contextlib.suppress(OSError):
            path = os.path.join(root_dir, name)
            mtimes[name] = os.stat(path, follow_symlinks=False).st_mtime
    now = time.time()
    aged = sorted(layouts, key=lambda n: (n in mtimes, mtimes.get(n, 0.0), n))
    described = []
    for name in aged[:_LAYOUTS_NAMED]:
        notes = []
        if name in mtimes:
            notes.append(f"last used {_age(max(0.0, now - mtimes[name]))} ago")
        if fields is not None:
            notes.append(kv_values.layout_change(fields, _read_fields(root_dir, name)))
        described.append(f"{name!r} ({'; '.join(notes)})" if notes else repr(name))
    named = ", ".join(described)
    if len(layouts) > _LAYOUTS_NAMED:
        named += f" and {len(layouts) - _LAYOUTS_NAMED} more"
    return named


def _read_fields(root_dir: str, name: str) -> dict | None:
    """Another layout's recorded fields (its config.json), or None."""
    try:
        with open(os.path.join(root_dir, name, "config.json"), "rb") as f:
            fields = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    return fields if isinstance(fields, dict) else None


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
        """Args:
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
        max_bytes: the most bytes this tier's files may take on disk (at
            least one chunk of every KV cache group); None: no limit.
            Engines sharing root_dir share it: set the same on each.
        checksum_blocks: keep each block's CRC32C in an extended attribute
            of its file and check it on load: a block whose bytes changed,
            or that has none, is a miss (its file removed, counted). With
            key_file, the MAC checks the bytes already: no CRC32C.

        """
        stale_s = cleanup_stale_tmp_after_seconds
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
        self._modes = GROUP_MODES if group_access else PRIVATE_MODES
        # From here on the resolved root, the one checked: a symlink in the
        # given path could be repointed after the check.
        root_dir = check_root_dir(root_dir, tier_type, group_access)
        tier_key = (
            load_key_file(key_file, tier_type, group_access)
            if key_file is not None
            else None
        )
        super().__init__(
            offloading_spec, primary_kv_view, tier_type, backpressure_detector
        )
        self.locality = Locality(locality) if locality is not None else None

        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                logger.warning(
                    "enable_kv_events is set on secondary tier '%s' but KV "
                    "cache events are disabled globally; the tier will not "
                    "emit events.",
                    tier_type,
                )
        # Track in-flight store jobs for lookup invalidation and KV events.
        self._store_jobs: dict[JobId, TransferJob] = {}
        # Keys of in-flight load (promotion) jobs, so a failed load can mark
        # its own cached lookup verdicts False (see get_finished_jobs).
        self._load_job_keys: dict[JobId, list[OffloadKey]] = {}
        # Block count per in-flight job, used to report transfer_bytes.
        self._job_block_counts: dict[JobId, int] = {}
        # Per failed load job: the indices of its keys that failed to load
        # (partial keep). Written by the pool worker inside the load task
        # before it raises (so before task_done publishes the job); read on the
        # scheduler thread in get_finished_jobs only for job ids the finished
        # queue returned. Under the GIL that read cannot observe the finished
        # job without the prior write, so no extra lock is needed (get_finished
        # is itself lock-free).
        self._load_failures: dict[JobId, list[int]] = {}
        # Per failed load job: the indices of its failed keys whose path still
        # holds something that is not a block (it could not be removed).
        # Same hand-off as _load_failures.
        self._load_unloadable: dict[JobId, list[int]] = {}
        # Keys whose path holds something that is not a block and could not be
        # removed (a directory, a bad file on a read-only mount): answered as
        # misses, so that no request promotes them again, until a store of the
        # key succeeds (a store replaces anything that is not a complete
        # block, or fails). Bounded by the broken paths on disk.
        self._unloadable: set[OffloadKey] = set()
        # Per in-flight store job: its keys in _unloadable.
        self._store_job_unloadable: dict[JobId, list[OffloadKey]] = {}

        # Extract block size from primary view
        assert primary_kv_view.strides is not None, (
            "primary_kv_view.strides cannot be None"
        )
        self._block_size: int = primary_kv_view.strides[0]
        num_groups = len(offloading_spec.config.groups)
        self._max_bytes = validate_max_bytes(
            max_bytes, max(1, num_groups) * self._block_size, tier_type
        )

        # Opt in; FileMapper enables it only for a parallelism-invariant block.
        self.file_mapper = FileMapper.from_offloading_spec(
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
                tier_type,
            )
        elif self._checksum and not has_compiled_io():
            logger.warning(
                "'%s' KV offload tier: checksum_blocks without vLLM's compiled "
                "fs_io_C extension computes each block's CRC32C in Python "
                "(under 10 MB/s per I/O thread). Fix: build vLLM with it, or "
                "set checksum_blocks to false.",
                tier_type,
            )
        # blocks that failed their integrity check (checksum_blocks), reported
        # by get_stats(); per failed load job, its count (same hand-off as
        # _load_failures)
        self._checksum_failures = 0
        self._checksum_reported = 0
        self._load_integrity: dict[JobId, int] = {}

        # Write config file
        config_path = self.file_mapper.get_config_file_path()
        self._config_lock = threading.Lock()
        self._config_failures = 0  # since the last warning (under _config_lock)
        self._next_config_warning = float("-inf")
        self._write_config()

        # Prefer O_DIRECT to bypass the page cache, but fall back to buffered
        # I/O on filesystems that reject it (e.g. overlayfs, some NFS mounts)
        # rather than failing every block.
        self._o_direct_dir = os.path.dirname(config_path)
        self._reprobe_at: float | None = None  # None: never
        try:
            self._use_o_direct = probe_o_direct(self._o_direct_dir)
        except OSError as e:
            # Says nothing about O_DIRECT support: buffered I/O for now.
            self._use_o_direct = False
            self._reprobe_at = time.monotonic() + REPROBE_INTERVAL_S
            logger.warning(
                "The O_DIRECT probe at '%s' failed (%s); using buffered I/O "
                "for the '%s' KV offload tier and probing again in %.0f s.",
                root_dir,
                e,
                tier_type,
                REPROBE_INTERVAL_S,
            )
        if self._mac is not None or self._checksum:
            setting, kept, off = (
                ("key_file", "MAC", "remove key_file")
                if self._mac is not None
                else ("checksum_blocks", "CRC32C", "set checksum_blocks to false")
            )
            try:
                probe_xattr(self._o_direct_dir)
            except OSError as e:
                raise ValueError(
                    f"{setting} of the '{tier_type}' tier needs user extended "
                    f"attributes at root_dir {root_dir!r} (each block's {kept} "
                    "is kept in one), but the filesystem refused one "
                    f"({e.strerror}). Fix: use a root_dir on a filesystem with "
                    "user xattrs (ext4, xfs, btrfs, tmpfs on Linux >= 6.6, NFS "
                    f"4.2), or {off}"
                ) from None
        if not self._use_o_direct and self._reprobe_at is None:
            logger.warning(
                "O_DIRECT is not supported at '%s'; falling back to buffered "
                "I/O for the '%s' KV offload tier.",
                root_dir,
                tier_type,
            )

        self._pool = DualQueueThreadPool(
            n_read_threads,
            n_write_threads,
            thread_name_prefix="vllm_kv_py_fs",
            label=f"'{tier_type}' KV offload tier at {root_dir}",
        )

        self._lookup_manager = FsAsyncLookupManager(tier=self, tier_type=self.tier_type)

        # Walk the tier's files in the background (the walk can be long):
        # remove the temp files of writers that died between writing a block
        # and renaming it into place, and count files with wider modes than
        # the tier's.
        self._tmp_cleanup_stop = threading.Event()
        self._tmp_cleanup = threading.Thread(
            target=self._scan_tier_files,
            args=(
                [
                    f"{self.file_mapper.base_path}_r{self.file_mapper.rank}",
                    os.path.dirname(config_path),
                ],
                cleanup_stale_tmp_after_seconds,
                root_dir,
            ),
            name="vllm_kv_py_fs_tmp_cleanup",
            daemon=True,
        )
        self._tmp_cleanup.start()

        # what each job holds of the budget (see FsTierBudget.finish_job()),
        # the keys a store job's task wrote (those its admission kept), and
        # the keys a failed store job left without a file
        self._budget_tickets: dict[JobId, Admission] = {}
        self._budget_written: dict[JobId, list[OffloadKey]] = {}
        self._budget_failed: dict[JobId, list[OffloadKey]] = {}
        # store jobs failed only by the budget's refusal: their written keys
        # are stored
        self._budget_refused: set[JobId] = set()
        # per failed load job: the indices of its failed keys whose file is
        # gone or unloadable (a file a load failed to read, e.g. EMFILE or
        # EIO, is still there and still counted). Same hand-off as
        # _load_failures.
        self._budget_load_gone: dict[JobId, list[int]] = {}
        self._budget_reported = (0, 0)  # evicted, rejected files in get_stats()
        self._budget: FsTierBudget | None = None
        if self._max_bytes is not None:
            self._budget = self._start_budget(offloading_spec, root_dir, tier_key)
        same, other = other_layouts(root_dir, self.file_mapper.base_path)
        # Never read, removed or counted in max_bytes here: an upgrade's old
        # layout stays until someone removes it. Other models' are likely live.
        counted = "" if self._max_bytes is None else ", nor counts them in max_bytes"
        if same:
            (logger.info if self._max_bytes is None else logger.warning)(
                "'%s' KV offload tier at %s: directories of %d other "
                "layout(s) of this model are in the root (other weights', "
                "model config's, vLLM version's, tier setting's or "
                "parallelism's): %s (<name> and <name>_r<rank>; its "
                "config.json records the settings). This "
                "tier never reads or removes them%s: if no engine uses one, "
                "remove it (running engines of this version mark theirs every "
                "%.0f min).",
                self.tier_type,
                root_dir,
                len(same),
                _names(root_dir, same, self.file_mapper.fields),
                counted,
                LAYOUT_MARK_INTERVAL_S / 60,
            )
        if other:
            logger.info(
                "'%s' KV offload tier at %s: directories of %d other "
                "model(s)' layouts are in the root: %s. This tier never reads "
                "or removes them%s.",
                self.tier_type,
                root_dir,
                len(other),
                _names(root_dir, other),
                counted,
            )
        # Mark this layout in use while the tier runs (a thread of its own).
        self._stop_marking = threading.Event()
        self._marker = threading.Thread(
            target=self._mark_layout_in_use,
            args=(root_dir,),
            name="vllm_kv_py_fs_layout_mark",
            daemon=True,
        )
        self._marker.start()

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
            f"'{self.tier_type}' KV offload tier at {root_dir}",
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
        with contextlib.suppress(OSError):
            st = os.statvfs(root_dir)
            free = st.f_bavail * st.f_frsize
            if self._max_bytes > free:
                logger.warning(
                    "'%s' KV offload tier at %s: max_bytes=%d is more than the "
                    "free space of its filesystem (%d bytes): stores will fail "
                    "once the disk is full",
                    self.tier_type,
                    root_dir,
                    self._max_bytes,
                    free,
                )
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

    def _mark_layout_in_use(self, root_dir: str) -> None:
        """Set the layout directory's mtime to now, at start and every
        LAYOUT_MARK_INTERVAL_S until shutdown: what tells another engine
        sharing the root that this layout is in use (the directory, not
        config.json: on a group_access root the group may write it). A
        failing mark is reported at once, then with its count every
        _MARK_FAILURES_REPORTED_EVERY intervals: the layout looks unused."""
        layout_dir = os.path.dirname(self.file_mapper.get_config_file_path())
        failures = 0
        while True:
            try:
                os.utime(layout_dir, follow_symlinks=False)
                if failures:
                    logger.info(
                        "'%s' KV offload tier at %s: marks its layout in use "
                        "again after %d failure(s)",
                        self.tier_type,
                        root_dir,
                        failures,
                    )
                failures = 0
            except OSError as e:
                if failures % _MARK_FAILURES_REPORTED_EVERY == 0:
                    logger.warning(
                        "'%s' KV offload tier at %s: could not mark its layout "
                        "in use (%d time(s) in a row; %s): other engines "
                        "sharing the root see it as unused",
                        self.tier_type,
                        root_dir,
                        failures + 1,
                        e,
                    )
                failures += 1
            if self._stop_marking.wait(LAYOUT_MARK_INTERVAL_S):
                return

    def _store_and_keep_config(self, store: Callable[[], None]) -> None:
        """Run a store task (on an I/O thread), then re-create config.json if
        the tier's root was removed while running (an operator cleaning a
        cache directory): the store re-created the block directories, which
        must not be left without the file that says what they hold. Costs a
        stat per store job."""
        store()
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
        at once, then at most one warning per FAILURE_REPORT_INTERVAL_S, so a
        root that stays unwritable is neither silent nor flooding the log."""
        self._config_failures += 1
        now = time.monotonic()
        if now < self._next_config_warning:
            return
        self._next_config_warning = now + FAILURE_REPORT_INTERVAL_S
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

    def _store_and_reprobe_o_direct(self, store: Callable[[], None]) -> None:
        """Run a store task, then probe O_DIRECT again after a transient
        failure (on an I/O thread): switch to it if it works now (blocks are
        the same bytes in both modes), else probe again later while the
        failure may pass."""
        try:
            store()
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

    def _scan_tier_files(
        self, directories: list[str], max_age_s: float | None, root_dir: str
    ) -> None:
        scan = scan_tier_files(
            directories, max_age_s, self._modes, self._tmp_cleanup_stop
        )
        if scan.removed:
            logger.info(
                "Removed %d stale temp files (%d bytes, older than %.0f s) under "
                "%s for the '%s' KV offload tier.",
                scan.removed,
                scan.removed_bytes,
                max_age_s,
                directories,
                self.tier_type,
            )
        if scan.too_open_example is not None:
            path, mode = scan.too_open_example
            group = self._modes is GROUP_MODES
            logger.warning(
                "%d file(s) and directories of the '%s' KV offload tier at %s "
                "have wider modes than %o (files) / %o (directories), e.g. %s "
                "(mode %o): users other than the tier's %s read or change "
                "cached KV blocks there. Restrict them, e.g. chmod -R %s %s",
                scan.too_open,
                self.tier_type,
                root_dir,
                self._modes.file,
                self._modes.dir,
                path,
                mode,
                "and its group may" if group else "may",
                "o-rwx" if group else "go-rwx",
                root_dir,
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

    def _store_within_budget(
        self,
        job_id: JobId,
        admission: Admission,
        keys: list[OffloadKey],
        paths: list[str],
        offsets: list[int],
    ) -> None:
        """A budgeted store task (on an I/O thread): its job's admission
        (reserving its bytes, evicting first; see FsTierBudget.admitted()),
        the evicted chunks' files removed, the admitted blocks written, then
        the job failed if some did not fit (a BudgetRejection: reported by
        the budget's rejection warning, and the written keys are stored)."""
        assert self._budget is not None
        rejected, unreachable, evicted = self._budget.admitted(admission)
        if rejected or unreachable:
            kept = [
                i
                for i, key in enumerate(keys)
                if key not in rejected and key not in unreachable
            ]
            keys = [keys[i] for i in kept]
            paths = [paths[i] for i in kept]
            offsets = [offsets[i] for i in kept]
        # what the job writes, read by get_finished_jobs() after the
        # finished queue hands this job back (same hand-off as
        # _load_failures)
        self._budget_written[job_id] = keys
        if evicted:
            self._budget.remove_evicted(evicted)
        try:
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
        except Exception:
            # the budget forgets the files that are not there, whatever
            # the store raised (not only OSError)
            self._budget_failed[job_id] = [
                k for k, p in zip(keys, paths) if not is_block_path(p)
            ]
            raise
        self._budget.written(admission, keys)
        if rejected:
            # what it wrote is stored (same hand-off as _budget_written)
            self._budget_refused.add(job_id)
            raise BudgetRejection(
                errno.ENOSPC,
                f"{len(rejected)} block(s) not stored: no room in "
                f"max_bytes={self._max_bytes}, every indexed block file is in "
                "use by a transfer",
            )

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
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        self._store_jobs[job_id] = job_metadata
        if self._unloadable:
            unloadable = [key for key in keys if key in self._unloadable]
            if unloadable:
                self._store_job_unloadable[job_id] = unloadable
        paths = [self.file_mapper.get_file_name(key) for key in keys]
        offsets = [int(cid) * self._block_size for cid in job_metadata.chunk_ids]
        task: Callable[[], None]
        if self._budget is not None:
            # the job's admission is decided by its task, in order with the
            # scheduler's other budget events (off this thread)
            ctx = job_metadata.req_context
            admission = self._budget.admit_store(
                keys, ctx.req_id, ctx.offload_key_positions()
            )
            self._budget_tickets[job_id] = admission
            task = functools.partial(
                self._store_within_budget, job_id, admission, keys, paths, offsets
            )
        else:
            task = functools.partial(
                batch_store_block,
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
        self._job_block_counts[job_id] = len(keys)
        store = functools.partial(self._store_and_keep_config, task)
        if self._reprobe_at is not None and time.monotonic() >= self._reprobe_at:
            # This job's I/O thread probes O_DIRECT again after its store.
            self._reprobe_at = None
            store = functools.partial(self._store_and_reprobe_o_direct, store)
        self._pool.enqueue_store(job_id, 1, [store])

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        # Track this load's keys so a failed promotion can mark only its failed
        # keys as a miss (see get_finished_jobs).
        keys = list(job_metadata.keys)
        self._load_job_keys[job_id] = keys
        self._job_block_counts[job_id] = len(keys)
        if self._budget is not None:
            self._budget_tickets[job_id] = self._budget.pin_load(keys)
        paths = [self.file_mapper.get_file_name(key) for key in keys]
        offsets = [int(cid) * self._block_size for cid in job_metadata.chunk_ids]

        def load_task() -> None:
            try:
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
            except OSError as exc:
                # Runs on the pool worker thread. Record which blocks failed so
                # get_finished_jobs can keep all the others; this write
                # precedes task_done, so the scheduler reads it safely under
                # the GIL once the finished queue hands back this job. Without
                # failed_indices, every block counts as failed.
                failed_indices = getattr(exc, "failed_indices", None)
                if failed_indices is not None:
                    self._load_failures[job_id] = list(failed_indices)
                # A planted file that failed its MAC and could not be removed
                # (a read-only mount) is unloadable too.
                integrity_failed = getattr(exc, "integrity_failed", ())
                if integrity_failed:
                    self._load_integrity[job_id] = len(integrity_failed)
                failed = range(len(paths)) if failed_indices is None else failed_indices
                unloadable = [
                    i
                    for i in failed
                    if holds_no_block(paths[i], self._block_size)
                    or (i in integrity_failed and os.path.lexists(paths[i]))
                ]
                self._load_unloadable[job_id] = unloadable
                if self._budget is not None:
                    # the budget forgets these files; the others still count
                    kept_broken = set(unloadable)
                    self._budget_load_gone[job_id] = [
                        i
                        for i in failed
                        if i in kept_broken or not is_block_path(paths[i])
                    ]
                # Surfaces errno (e.g. EMFILE "Too many open files") for both
                # the C and Python load paths.
                logger.debug(
                    "Load of %d blocks for job %s failed for %s blocks: %s",
                    len(paths),
                    job_id,
                    "all" if failed_indices is None else len(failed_indices),
                    exc,
                )
                raise

        self._pool.enqueue_load(job_id, 1, [load_task])

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Collect finished jobs; a failed promotion marks only its failed keys
        as a miss here (scheduler thread)."""
        results = []
        if self._budget is not None:
            # before the stores that evicted them are reported
            self._publish_evicted()
        for job_id, success, transfer_time in self._pool.get_finished():
            # whether the keys the job wrote are stored, and which (None: all)
            stored, written = success, None
            if self._budget is not None:
                stored, written = self._finish_budget_job(job_id, success)
            block_count = self._job_block_counts.pop(job_id, 0)
            transfer_bytes = block_count * self._block_size if block_count else None
            job = self._store_jobs.pop(job_id, None)
            if job is not None and stored:
                # Successful store makes previously absent keys known-present:
                # only those it wrote (the budget may have refused others).
                keys = job.keys if written is None else written
                self._lookup_manager.mark_present(keys)
                if self.events is not None and keys:
                    self.events.append(
                        OffloadingEvent(
                            keys=list(keys),
                            medium=self.medium,
                            removed=False,
                            locality=self.locality,
                            req_context=job.req_context,
                        )
                    )
            unloadable = self._store_job_unloadable.pop(job_id, None)
            if stored and unloadable:
                self._unloadable.difference_update(unloadable)
            load_keys = self._load_job_keys.pop(job_id, None)
            failed_indices = self._load_failures.pop(job_id, None)
            self._checksum_failures += self._load_integrity.pop(job_id, 0)
            for i in self._load_unloadable.pop(job_id, ()):
                assert load_keys is not None
                self._unloadable.add(load_keys[i])
            if load_keys is not None and not success:
                # A batched load goes on past a bad block and reports which
                # blocks failed. The others are kept in the primary tier
                # (reported via successful_keys); only the failed ones are
                # marked a miss and recomputed.
                successful: list[OffloadKey] = []
                if failed_indices is None:
                    failed = load_keys
                else:
                    failed_set = set(failed_indices)
                    failed = []
                    for i, k in enumerate(load_keys):
                        (failed if i in failed_set else successful).append(k)
                self._lookup_manager.mark_miss(failed)
                results.append(
                    JobResult(
                        job_id=job_id,
                        success=False,
                        successful_keys=tuple(successful) if successful else None,
                        transfer_time=transfer_time,
                        transfer_bytes=transfer_bytes,
                    )
                )
                continue
            results.append(
                JobResult(
                    job_id=job_id,
                    success=success,
                    transfer_time=transfer_time,
                    transfer_bytes=transfer_bytes,
                )
            )
        return results

    def _finish_budget_job(
        self, job_id: JobId, success: bool
    ) -> tuple[bool, list[OffloadKey] | None]:
        """Unpin the job's chunks; forget the files a failed job left
        missing or unloadable (a failed load removed a bad file; a file it
        failed to read is still there and still counted). Returns whether
        the keys the job wrote are stored (it succeeded, or failed only
        because the budget refused its other keys), and which keys a store
        wrote (None: not a store)."""
        assert self._budget is not None
        stored = success
        if job_id in self._budget_refused:
            self._budget_refused.discard(job_id)
            stored = True
        written = self._budget_written.pop(job_id, None)
        if written is not None and len(written) < self._job_block_counts[job_id]:
            # its admission dropped keys: report and count only those written
            self._job_block_counts[job_id] = len(written)
            unloadable = self._store_job_unloadable.get(job_id)
            if unloadable:
                kept = set(written)
                self._store_job_unloadable[job_id] = [
                    k for k in unloadable if k in kept
                ]
        failed: list[OffloadKey] = self._budget_failed.pop(job_id, [])
        gone = self._budget_load_gone.pop(job_id, ())
        load_keys = self._load_job_keys.get(job_id)
        if load_keys is not None and gone:
            failed = [load_keys[i] for i in gone]
        self._budget.finish_job(self._budget_tickets.pop(job_id), failed)
        return stored, written

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
                "in max_bytes (every indexed file in use by a transfer).",
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
        self._stop_marking.set()
        self._tmp_cleanup.join()
        self._marker.join()
        self._lookup_manager.shutdown()
        self._pool.shutdown(wait=True)
        if self._budget is not None:
            self._budget.shutdown()
