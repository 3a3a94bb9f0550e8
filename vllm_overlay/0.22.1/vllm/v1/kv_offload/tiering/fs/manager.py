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

Integrity (the tier config's "checksum", off by default):
    With "xxh3_64" or "crc32", each block file holds the block followed by
    a checksum of the block's key and bytes, in a trailer (a page where the
    blocks are page-aligned, for O_DIRECT; else 8 bytes). A load whose
    checksum does not match fails: the key is a miss. It costs throughput
    (on 64 KiB blocks, 20-35% measured with bench/disk_bench.py on a small
    VM): turn it on where silent corruption is a concern.

File naming:  <base_path>_r<rank>/<hhh>/<hh>_g<group_idx>/<hash_hex>.bin
              (hash-based subdirectories to limit directory fan-out)
"""

import contextlib
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobMetadata,
    JobResult,
    SecondaryTierManager,
)
from vllm.v1.kv_offload.tiering.fs.io import (
    CHECKSUMS,
    BlockChecksum,
    _get_tmp_suffix,
    load_block,
    probe_direct_io,
    remove_stale_tmp_files,
    store_block,
)
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = init_logger(__name__)

# After an O_DIRECT probe failed for a reason that may pass (a full disk, an
# I/O error), probe again with the first store at least this much later.
REPROBE_INTERVAL_S = 60.0


class FileSystemTierManager(SecondaryTierManager):
    """
    Pure-Python disk-backed secondary tier.

    Read-priority threads service load jobs preferentially; write-priority
    threads service store jobs preferentially.  Both groups can drain either
    queue, so neither starves.

    submit_store / submit_load are non-blocking: they enqueue tasks and return.
    get_finished() polls job completion and returns completed JobResults.

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
        checksum: str = "none",
    ):
        """
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
            checksum: "none" (the default), "xxh3_64" (needs the xxhash
                package) or "crc32" (zlib): store a checksum of each block's
                key and bytes with the block and check it on every load; a
                mismatch (a file overwritten in place, another key's block,
                a flipped bit) makes the key a miss. Part of the file
                layout: each setting has its own directory.
        """
        if cleanup_stale_tmp_after_seconds is not None and (
            cleanup_stale_tmp_after_seconds < 0
        ):
            raise ValueError(
                f"cleanup_stale_tmp_after_seconds of the '{tier_type}' tier must "
                f"be >= 0 or null (no cleanup), got {cleanup_stale_tmp_after_seconds}"
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type)

        # Extract block size from primary view
        assert primary_kv_view.strides is not None, (
            "primary_kv_view.strides cannot be None"
        )
        self._block_size: int = primary_kv_view.strides[0]

        if checksum not in CHECKSUMS:
            raise ValueError(
                f"Unknown checksum {checksum!r} in the fs_python tier's config: "
                f"set 'checksum' to one of {list(CHECKSUMS)}"
            )
        self._checksum: BlockChecksum | None = (
            BlockChecksum(checksum, self._block_size) if checksum != "none" else None
        )

        # Create file mapper
        self.file_mapper = FileMapper.from_offloading_spec(
            root_dir=root_dir,
            offloading_spec=offloading_spec,
            gpu_blocks_per_file=offloading_spec.block_size_factor,
            checksum=self._checksum.describe() if self._checksum else None,
        )

        # Write config file
        self._root_dir = root_dir
        self._config_lock = threading.Lock()
        config_path = self.file_mapper.get_config_file_path()
        self._write_config()

        # O_DIRECT bypasses the page cache, but only works for aligned rows
        # on filesystems that support it; otherwise use buffered I/O.
        self._probe_dir = os.path.dirname(config_path)
        reason, transient = probe_direct_io(
            self._probe_dir, primary_kv_view, self._block_size
        )
        self._direct_io: bool = reason is None
        # when to probe again after a transient failure (None: never)
        self._reprobe_at: float | None = (
            time.monotonic() + REPROBE_INTERVAL_S if transient else None
        )
        if transient:
            reason = f"{reason}; probing again in {REPROBE_INTERVAL_S:.0f} s"
        if self._direct_io:
            logger.info(
                "fs_python tier at %s: using O_DIRECT I/O for %d-byte blocks",
                root_dir,
                self._block_size,
            )
        else:
            logger.info(
                "fs_python tier at %s: using buffered I/O for %d-byte blocks "
                "because %s",
                root_dir,
                self._block_size,
                reason,
            )

        # keys of the in-flight jobs, to report which ones failed
        self._job_keys: dict[JobId, list[OffloadKey]] = {}
        # Keys whose load failed and whose file could not be removed (a
        # directory, a file on a read-only or immutable mount): answered as
        # misses, so that the scheduler does not promote them again and
        # again, until a store of the key (which replaces the file) succeeds.
        self._unloadable: set[OffloadKey] = set()
        # store jobs: the keys they store over such a file
        self._rewrites: dict[JobId, list[OffloadKey]] = {}
        self._load_jobs: set[JobId] = set()

        self._pool = DualQueueThreadPool(
            n_read_threads,
            n_write_threads,
            thread_name_prefix="vllm_kv_py_fs",
            label=f"{tier_type} tier at {root_dir}",
        )

        # Remove the temp files of writers that died between writing a block
        # and renaming it into place, in the background (the walk can be long):
        # this rank's block directory, and the config's (the O_DIRECT probe's
        # and config.json's).
        self._stop_tmp_cleanup = threading.Event()
        self._tmp_cleanup: threading.Thread | None = None
        if cleanup_stale_tmp_after_seconds is not None:
            block_dir = f"{self.file_mapper.base_path}_r{self.file_mapper.rank}"
            self._tmp_cleanup = threading.Thread(
                target=self._remove_stale_tmp_files,
                args=(
                    (os.path.dirname(config_path), block_dir),
                    cleanup_stale_tmp_after_seconds,
                    root_dir,
                ),
                name="vllm_kv_py_fs_tmp_cleanup",
                daemon=True,
            )
            self._tmp_cleanup.start()

    def _write_config(self) -> bool:
        """Write config.json (the layout of this directory's files) unless it
        exists; atomically, as several engines may share the directory.
        Returns whether it was written."""
        config_path = self.file_mapper.get_config_file_path()
        if os.path.exists(config_path):
            return False
        os.makedirs(os.path.dirname(config_path), exist_ok=True)
        tmp_path = config_path + _get_tmp_suffix()
        try:
            with open(tmp_path, "w") as f:
                json.dump(
                    self.file_mapper.get_run_config(), f, indent=2, sort_keys=True
                )
            os.replace(tmp_path, config_path)
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp_path)
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
                    "fs_python tier at %s: %s was missing (was the directory "
                    "removed?); re-created it",
                    self._root_dir,
                    self.file_mapper.get_config_file_path(),
                )
        except OSError as e:
            logger.warning(
                "fs_python tier at %s: could not re-create %s: %s",
                self._root_dir,
                self.file_mapper.get_config_file_path(),
                e,
            )

    def _remove_stale_tmp_files(
        self, directories: tuple[str, ...], max_age_s: float, root_dir: str
    ) -> None:
        try:
            removed, removed_bytes = remove_stale_tmp_files(
                directories, max_age_s, self._stop_tmp_cleanup
            )
        except Exception as e:
            logger.warning(
                "fs_python tier at %s: could not remove stale temporary files: %s",
                root_dir,
                e,
            )
            return
        if removed:
            logger.info(
                "fs_python tier at %s: removed %d stale temporary file(s) "
                "(%d bytes, not modified for %.0f s)",
                root_dir,
                removed,
                removed_bytes,
                max_age_s,
            )

    def lookup(
        self, key: OffloadKey, req_context: ReqContext | None = None
    ) -> bool | None:
        if key in self._unloadable:
            return False
        return os.path.exists(self.file_mapper.get_file_name(key))

    def _reprobe_direct_io(self) -> None:
        """Probe O_DIRECT again after a transient failure (on an I/O thread,
        before a store): switch to it if it works now, else keep buffered
        I/O and, if the failure may still pass, probe again later."""
        try:
            reason, transient = probe_direct_io(
                self._probe_dir, self._primary_kv_view, self._block_size
            )
        except OSError as e:  # the probe file could not even be created
            reason, transient = str(e), True
        if reason is None:
            self._direct_io = True
            logger.info(
                "fs_python tier at %s: the O_DIRECT probe succeeded this time; "
                "using O_DIRECT I/O for %d-byte blocks",
                self._root_dir,
                self._block_size,
            )
        elif transient:
            self._reprobe_at = time.monotonic() + REPROBE_INTERVAL_S
        else:
            logger.info(
                "fs_python tier at %s: keeping buffered I/O because %s",
                self._root_dir,
                reason,
            )

    def _with_reprobe(self, task: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            self._reprobe_direct_io()
            task()

        return run

    def submit_store(self, job_metadata: JobMetadata) -> None:
        unloadable = self._unloadable
        tasks: Iterable[Callable[[], None]] = (
            functools.partial(
                store_block,
                self.file_mapper.get_file_name(key),
                self._primary_kv_view,
                int(bid) * self._block_size,
                self._block_size,
                self._direct_io,
                key in unloadable,
                key,
                self._checksum,
                self._on_new_dir,
            )
            for key, bid in zip(job_metadata.keys, job_metadata.block_ids)
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
        self._job_keys[job_metadata.job_id] = list(job_metadata.keys)
        if unloadable:
            rewrites = [k for k in job_metadata.keys if k in unloadable]
            if rewrites:
                self._rewrites[job_metadata.job_id] = rewrites
        self._pool.enqueue_store(job_metadata.job_id, len(job_metadata.keys), tasks)

    def submit_load(self, job_metadata: JobMetadata) -> None:
        tasks = (
            functools.partial(
                load_block,
                self.file_mapper.get_file_name(key),
                self._primary_kv_view,
                int(bid) * self._block_size,
                self._block_size,
                self._direct_io,
                key,
                self._checksum,
            )
            for key, bid in zip(job_metadata.keys, job_metadata.block_ids)
        )
        self._job_keys[job_metadata.job_id] = list(job_metadata.keys)
        self._load_jobs.add(job_metadata.job_id)
        self._pool.enqueue_load(job_metadata.job_id, len(job_metadata.keys), tasks)

    def get_finished(self) -> Iterable[JobResult]:
        """
        Collect completed jobs from the finished-jobs queue.
        """
        results = []
        for job_id, failed in self._pool.get_finished():
            keys = self._job_keys.pop(job_id)
            is_load = job_id in self._load_jobs
            self._load_jobs.discard(job_id)
            rewrites = self._rewrites.pop(job_id, None)
            if rewrites:
                # a store that replaced an unloadable file: loadable again
                failed_keys = {keys[i] for i in failed}
                self._unloadable.difference_update(
                    k for k in rewrites if k not in failed_keys
                )
            if not failed:
                results.append(JobResult(job_id=job_id, success=True))
                continue
            failed_idx = set(failed)
            successful = [k for i, k in enumerate(keys) if i not in failed_idx]
            if is_load:
                # A failed load removes the file; one still there cannot be
                # loaded or removed, and would be promoted forever.
                for i in failed_idx:
                    if os.path.lexists(self.file_mapper.get_file_name(keys[i])):
                        self._unloadable.add(keys[i])
            results.append(
                JobResult(job_id=job_id, success=False, successful_keys=successful)
            )
        return results

    def shutdown(self) -> None:
        """
        Release resources held by this tier.

        Shuts down the thread pool, clearing pending tasks and waiting for
        active threads to complete.
        """
        self._stop_tmp_cleanup.set()
        if self._tmp_cleanup is not None:
            self._tmp_cleanup.join()
        self._pool.shutdown(wait=True)
