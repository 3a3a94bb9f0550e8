# SPDX-License-Identifier: Apache-2.0
"""What the two CPU-copy doubles share: cpu_copy_spec.py (the 0.22.1 handlers API) and
cpu_copy_worker_spec.py (0.34.0's OffloadingWorker API). Only vLLM names both releases have
are imported here."""

import ctypes

import numpy as np

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec, GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs


def copy_groups(src_spec, dst_spec, gpu_to_cpu: bool, factors, group_refs, src_tensors,
                dst_tensors, ptr_dtype, corrupt: bool) -> int:
    """One transfer, synchronously with memmove: the per-group walk of upstream's
    SingleDirectionOffloadingHandler.transfer_async, with its compute_sub_block_ptrs.
    factors[g]: GPU blocks per offloaded block of group g. Returns the bytes copied.
    corrupt (the harness's negative control) garbles every destination page."""
    assert isinstance(src_spec, BlockIDsLoadStoreSpec)
    assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
    gpu_spec = src_spec if gpu_to_cpu else dst_spec
    assert isinstance(gpu_spec, GPULoadStoreSpec)
    assert len(gpu_spec.group_sizes) == len(group_refs)
    src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
    src_off = dst_off = nbytes = 0
    for g, (group_size, block_idx, refs) in enumerate(
        zip(gpu_spec.group_sizes, gpu_spec.block_indices, group_refs)
    ):
        if group_size == 0:
            continue
        src_f, dst_f = (1, factors[g]) if gpu_to_cpu else (factors[g], 1)
        src_skip, dst_skip = block_idx % src_f, block_idx % dst_f
        src_n = cdiv(group_size + src_skip, src_f)
        dst_n = cdiv(group_size + dst_skip, dst_f)
        group_src = src_blocks[src_off:src_off + src_n]
        group_dst = dst_blocks[dst_off:dst_off + dst_n]
        assert len(group_src) == src_n and len(group_dst) == dst_n
        src_ptrs = np.empty(group_size, dtype=ptr_dtype)
        dst_ptrs = np.empty(group_size, dtype=ptr_dtype)
        for ref in refs:
            compute_sub_block_ptrs(group_src, src_f, src_ptrs, src_tensors[ref.tensor_idx],
                                   skip_count=src_skip)
            compute_sub_block_ptrs(group_dst, dst_f, dst_ptrs, dst_tensors[ref.tensor_idx],
                                   skip_count=dst_skip)
            for s, d in zip(src_ptrs.tolist(), dst_ptrs.tolist()):
                ctypes.memmove(d, s, ref.page_size_bytes)
                if corrupt:
                    ctypes.memset(d, 0x3C, ref.page_size_bytes)
            nbytes += group_size * ref.page_size_bytes
        src_off += src_n
        dst_off += dst_n
    assert src_off == len(src_blocks) and dst_off == len(dst_blocks)
    return nbytes


def count_promotions(tier, logger) -> None:
    """Log every load a secondary tier is asked for (observation only, behaviour unchanged):
    the "e2e-spec: promoted N keys" line the e2e runner reads."""
    submit_load = tier.submit_load
    totals = {"keys": 0, "jobs": 0}

    def counting_submit_load(job_metadata):
        totals["keys"] += len(job_metadata.keys)
        totals["jobs"] += 1
        logger.info("e2e-spec: promoted %d keys from %s (total keys=%d jobs=%d)",
                    len(job_metadata.keys), tier.tier_type, totals["keys"], totals["jobs"])
        return submit_load(job_metadata)

    tier.submit_load = counting_submit_load
