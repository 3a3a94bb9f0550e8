# SPDX-License-Identifier: Apache-2.0
"""Test-only offloading spec: the real TieringOffloadingSpec with a CPU memory copy in place of
the CUDA device<->host copy.

Loaded by the OffloadingConnector through kv_connector_extra_config
    {"spec_name": "CpuCopyTieringSpec", "spec_module_path": "<this file's module>", ...}

Only the two worker-side handlers differ from upstream: `CpuGpuOffloadingHandlers` needs CUDA
streams and `swap_blocks_batch`. Here each copy is a memmove between the engine's KV cache
tensors (which live in CPU memory on the CPU platform) and the SharedOffloadRegion views, with
the pointers computed by upstream's own `compute_sub_block_ptrs` and the same per-group walk as
`SingleDirectionOffloadingHandler.transfer_async`. Scheduler, connector, managers, tiers and
files are unchanged vLLM code.

For the e2e harness it also logs two lines the runner reads from the engine log:
  "e2e-spec: kv cache groups ..."  the groups vLLM built (count, block size, page bytes)
  "e2e-spec: promoted N keys ..."   keys a secondary tier loaded back into the CPU tier
"""

import os
import time
from collections.abc import Iterator

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.kv_offload.worker.worker import (
    OffloadingHandler,
    TransferResult,
    TransferSpec,
)

from cpu_copy_common import copy_groups, count_promotions

# under the "vllm" logger so the engine's log configuration prints these lines
logger = init_logger("vllm.e2e.cpu_copy_spec")


class CpuCopyHandler(OffloadingHandler):
    """One direction (GPU->CPU or CPU->GPU), copies done synchronously with memmove."""

    def __init__(self, gpu_tensors, cpu_tensors, factors, group_data_refs, gpu_to_cpu,
                 mmap_region=None):
        self.src_tensors = gpu_tensors if gpu_to_cpu else cpu_tensors
        self.dst_tensors = cpu_tensors if gpu_to_cpu else gpu_tensors
        self.gpu_to_cpu = gpu_to_cpu
        self.group_data_refs = group_data_refs
        self.factors = factors
        self.transfer_type = ("GPU", "CPU") if gpu_to_cpu else ("CPU", "GPU")
        self._mmap_region = mmap_region
        self._done: list[TransferResult] = []
        # negative control for the harness: E2E_CORRUPT_LOADS=1 garbles every CPU->GPU load
        self._corrupt = not gpu_to_cpu and os.environ.get("E2E_CORRUPT_LOADS") == "1"

    def transfer_async(self, job_id: int, transfer_spec: TransferSpec) -> bool:
        t0 = time.perf_counter()
        src_spec, dst_spec = transfer_spec
        nbytes = copy_groups(src_spec, dst_spec, self.gpu_to_cpu, self.factors,
                             self.group_data_refs, self.src_tensors, self.dst_tensors, np.int64,
                             self._corrupt)
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                         transfer_time=time.perf_counter() - t0,
                                         transfer_type=self.transfer_type))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # copies are synchronous

    def shutdown(self) -> None:
        self.src_tensors = self.dst_tensors = []
        if self._mmap_region is not None:
            self._mmap_region.cleanup()
            self._mmap_region = None


class CpuCopyHandlers:
    """Same constructor arguments and CPU tensor layout as CpuGpuOffloadingHandlers."""

    def __init__(self, kv_caches: CanonicalKVCaches, block_size_factor: int, num_cpu_blocks: int,
                 mmap_region: SharedOffloadRegion | None = None, **_ignored):
        # GPU blocks per offloaded block: one int for every group, as upstream's handlers take
        factors = [int(block_size_factor)] * len(kv_caches.group_data_refs)
        row_factor = int(block_size_factor)
        gpu_tensors, cpu_tensors = [], []
        for t in kv_caches.tensors:
            assert t.tensor.device.type == "cpu", "this spec is for the CPU platform only"
            gpu_tensors.append(t.tensor.view(torch.int8).view((-1, t.page_size_bytes)))
            cpu_page = t.page_size_bytes * row_factor
            if mmap_region is not None:
                cpu_tensors.append(mmap_region.create_next_view(cpu_page))
            else:
                cpu_tensors.append(torch.zeros((num_cpu_blocks, cpu_page), dtype=torch.int8))
        refs = kv_caches.group_data_refs
        self.gpu_to_cpu_handler = CpuCopyHandler(gpu_tensors, cpu_tensors, factors, refs, True,
                                                 mmap_region)
        self.cpu_to_gpu_handler = CpuCopyHandler(gpu_tensors, cpu_tensors, factors, refs, False)


class CpuCopyTieringSpec(TieringOffloadingSpec):
    def __init__(self, vllm_config, kv_cache_config):
        super().__init__(vllm_config, kv_cache_config)
        groups = [
            f"g{i}:{type(g.kv_cache_spec).__name__}(block_size={g.kv_cache_spec.block_size},"
            f" page_bytes={g.kv_cache_spec.page_size_bytes}, layers={len(g.layer_names)})"
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
        ]
        logger.info(
            "e2e-spec: kv cache groups count=%d block_sizes=%s hash_block_size=%s "
            "tensors=%d cpu_row_bytes=%d cpu_blocks=%d groups=[%s]",
            len(groups), list(self.gpu_block_size), self.hash_block_size,
            len(kv_cache_config.kv_cache_tensors), self.cpu_page_size_per_worker,
            self.num_blocks, "; ".join(groups))

    def get_manager(self) -> OffloadingManager:
        fresh = self._manager is None
        manager = super().get_manager()
        if fresh:
            for tier in getattr(manager, "secondary_tiers", []):
                count_promotions(tier, logger)
        return manager

    def create_handlers(self, kv_caches: CanonicalKVCaches) -> CpuCopyHandlers:
        world_size = self.vllm_config.parallel_config.world_size
        try:
            rank = torch.accelerator.current_device_index()
        except Exception:  # CPU platform: no accelerator device
            from vllm.distributed.parallel_state import get_world_group
            rank = get_world_group().rank_in_group
        worker_mmap = SharedOffloadRegion(
            instance_id=self.vllm_config.instance_id,
            total_size_bytes=self.cpu_page_size_per_worker * world_size * self.num_blocks,
            num_blocks=self.num_blocks,
            rank=rank,
            num_workers=world_size,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        return CpuCopyHandlers(kv_caches=kv_caches, block_size_factor=self.block_size_factor,
                               num_cpu_blocks=self.num_blocks, mmap_region=worker_mmap)

    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        # CPUOffloadingSpec.get_handlers refuses non-CUDA platforms; this is the only change.
        if not self._handlers:
            self._handlers = self.create_handlers(kv_caches)
        yield GPULoadStoreSpec, CPULoadStoreSpec, self._handlers.gpu_to_cpu_handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, self._handlers.cpu_to_gpu_handler
