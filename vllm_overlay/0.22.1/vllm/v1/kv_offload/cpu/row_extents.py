# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where each KV cache group's bytes lie in a row of the CPU primary tier.

A row (one offloaded block) holds, per worker, cpu_page_size_per_worker
bytes: the canonical tensors of kv_cache_config.kv_cache_tensors back to
back, in that order, each page_size_bytes x block_size_factor (as
OffloadingConnectorWorker.register_kv_caches builds them and
CpuGpuOffloadingHandlers lays them out; a tensor with no layer is skipped),
then padding to the row alignment. Workers' cells follow each other.

vLLM gives every group the same number of shared tensors, so a row is only
partly a group's: a group with fewer layers leaves tensors unused, and a
mamba state padded to the attention page uses only its unpadded bytes of
each page. The GPU<->CPU transfer of a group copies, per layer and GPU block
of the chunk, the layer's unpadded page and nothing else.
group_row_runs() computes those bytes from the KVCacheConfig alone (the
scheduler side has no worker), so that a secondary tier stores only them.

Attention tensors count whole: the worker may split one into K and V halves
(FlashAttention's layout, known to the worker's attention backend only), so
the unused bytes of a padded attention page are not located here. An
unpadded attention page (every layout but padded attention) is the whole
tensor anyway.
"""

from dataclasses import replace

from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)

# (offset in the row, length) in bytes
Run = tuple[int, int]


def group_row_runs(
    kv_cache_config: KVCacheConfig,
    block_size_factor: int,
    row_bytes_per_worker: int,
    num_workers: int = 1,
) -> list[list[Run]]:
    """Per KV cache group, the coalesced, sorted byte runs of a row that its
    transfers read and write (see the module docstring).

    Raises ValueError if the tensors do not fit in row_bytes_per_worker."""
    groups = kv_cache_config.kv_cache_groups
    layer_specs: dict[str, KVCacheSpec] = {}
    group_of: dict[str, int] = {}
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        per_layer = (
            spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else {}
        )
        for name in group.layer_names:
            layer_specs[name] = per_layer.get(name, spec)
            group_of[name] = g

    runs: list[list[Run]] = [[] for _ in groups]
    offset = 0
    for tensor in kv_cache_config.kv_cache_tensors:
        names = [n for n in tensor.shared_by if n in layer_specs]
        if not names:
            continue  # reserved memory of no layer: not in the row
        # the worker's page of the tensor (K and V halves of a split tensor
        # together), from its size: the scheduler's KVCacheConfig keeps one
        # arbitrary spec of a group of layers with UniformTypeKVCacheSpecs
        page = tensor.size // kv_cache_config.num_blocks
        for name in names:
            spec = layer_specs[name]
            if isinstance(spec, MambaSpec):
                used = replace(spec, page_size_padded=None).page_size_bytes
                runs[group_of[name]].extend(
                    (offset + j * page, used) for j in range(block_size_factor)
                )
            else:
                runs[group_of[name]].append((offset, page * block_size_factor))
        offset += page * block_size_factor
    if offset > row_bytes_per_worker:
        raise ValueError(
            f"the KV cache tensors take {offset} bytes per offloaded block, more "
            f"than the CPU row of {row_bytes_per_worker} bytes per worker"
        )
    return [
        _coalesce(
            (w * row_bytes_per_worker + o, n)
            for w in range(num_workers)
            for o, n in group_runs
        )
        for group_runs in runs
    ]


def _coalesce(runs) -> list[Run]:
    """Sorted runs, overlapping or adjacent ones merged."""
    merged: list[Run] = []
    for o, n in sorted(runs):
        if merged and o <= merged[-1][0] + merged[-1][1]:
            last_o, last_n = merged[-1]
            merged[-1] = (last_o, max(last_n, o + n - last_o))
        else:
            merged.append((o, n))
    return merged
