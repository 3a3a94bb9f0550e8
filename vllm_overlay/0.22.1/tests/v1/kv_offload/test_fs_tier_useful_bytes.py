# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
Regression tests for the fs_python tier's file sizes: a key's file holds
only the bytes of the CPU row its KV cache group uses (page-aligned), not
the whole row, which also holds the tensors of other groups' layers and the
padding of small mamba states.

The group's byte runs (cpu/row_extents.py, computed on the scheduler side)
are checked against what the real worker-side canonicalization
(OffloadingConnectorWorker.register_kv_caches) makes the GPU<->CPU copies
read and write, for every layout of test_tiering_hma.py. Then, through the
real connector scheduler and tiers writing real files: each file's size is
its group's useful bytes, page-aligned; a cold load gives back the group's
bytes and leaves the row's other bytes alone; the budget counts exactly the
bytes on disk, and its smallest valid max_bytes is one chunk of those files.
"""

import math
import mmap
import os
import time
from unittest.mock import MagicMock, patch

import numpy as np
import pytest
import torch
from test_tiering_hma import (  # noqa: F401 (fixtures)
    LAYOUTS,
    _load_hit,
    _make_request,
    _remove_shm_regions,
    _store_requests,
    block_bytes,
    cpu_rows,
    make_configs,
    model_config,
    sha256_block_hashes,
)

from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, MambaSpec
from vllm.v1.kv_offload.base import OffloadingSpec, get_offload_group_idx
from vllm.v1.kv_offload.cpu.row_extents import group_row_runs
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

PAGE = mmap.PAGESIZE
SENTINEL = 0xA5


class _BlocksFirstBackend:
    """An attention backend whose KV cache is (num_blocks, ...)."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


class _KVFirstBackend:
    """FlashAttention's (2, num_blocks, ...): the worker splits K and V."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)


def _worker_copy_runs(
    kv_cache_config: KVCacheConfig, backend: type, block_size_factor: int
) -> list[list[tuple[int, int]]]:
    """Per group, the byte runs of a CPU row that the real worker's
    canonical tensors and group data refs make the GPU<->CPU copies touch
    (CpuGpuOffloadingHandlers: one CPU view of page x factor bytes per
    canonical tensor, in order; a ref copies its page_size_bytes of each
    GPU block of the chunk)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )

    num_blocks = kv_cache_config.num_blocks
    specs = {
        name: group.kv_cache_spec
        for group in kv_cache_config.kv_cache_groups
        for name in group.layer_names
    }
    kv_caches: dict = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        raw = torch.zeros(tensor.size, dtype=torch.int8)
        for name in tensor.shared_by:
            spec = specs[name]
            if isinstance(spec, MambaSpec):
                kv_caches[name] = [raw.view(num_blocks, -1)]
            else:
                shape = backend.get_kv_cache_shape(1234, 16, 1, 256)
                if shape[0] == 2:
                    kv_caches[name] = raw.view(2, num_blocks, -1)
                else:
                    kv_caches[name] = raw.view(num_blocks, 2, -1)
    layers = {}
    for name, spec in specs.items():
        if isinstance(spec, AttentionSpec):
            layers[name] = MagicMock()
            layers[name].get_attn_backend.return_value = backend
    spec_mock = MagicMock(spec=OffloadingSpec)
    spec_mock.kv_cache_config = kv_cache_config
    spec_mock.vllm_config = MagicMock()
    spec_mock.get_handlers.return_value = iter([])
    worker = OffloadingConnectorWorker(spec=spec_mock)
    worker.worker = MagicMock()
    with patch(
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"
        ".get_layers_from_vllm_config",
        return_value=layers,
    ):
        worker.register_kv_caches(kv_caches)
    canonical = spec_mock.get_handlers.call_args[0][0]

    offsets, offset = [], 0
    for t in canonical.tensors:
        offsets.append(offset)
        offset += t.page_size_bytes * block_size_factor
    result = []
    for refs in canonical.group_data_refs:
        touched = set()
        for ref in refs:
            page = canonical.tensors[ref.tensor_idx].page_size_bytes
            for j in range(block_size_factor):
                start = offsets[ref.tensor_idx] + j * page
                touched.update(range(start, start + ref.page_size_bytes))
        result.append(_as_runs(touched))
    return result


def _as_runs(touched: set[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for b in sorted(touched):
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


@pytest.mark.parametrize("backend", [_BlocksFirstBackend, _KVFirstBackend])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("layout", [*LAYOUTS, "gemma3_fewer_sliding"])
def test_group_runs_are_what_the_worker_copies(
    model_config,  # noqa: F811 (a fixture of test_tiering_hma)
    tmp_path,
    layout,
    blocks_per_chunk,
    backend,
):
    """group_row_runs(), from the KVCacheConfig alone, gives each group
    exactly the bytes of a CPU row its worker-side copies touch."""
    if backend is _KVFirstBackend and layout == "qwen3_5":
        pytest.skip("vLLM lays attention out blocks-first beside mamba layers")
    vllm_config, kv_cache_config = make_configs(
        model_config, layout, str(tmp_path), 4, {"blocks_per_chunk": blocks_per_chunk}
    )
    spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    runs = group_row_runs(
        kv_cache_config, spec.block_size_factor, spec.cpu_page_size_per_worker
    )
    assert runs == _worker_copy_runs(kv_cache_config, backend, blocks_per_chunk)


def _expected_file_sizes(spec: TieringOffloadingSpec) -> list[int]:
    """Each group's useful bytes per offloaded block, page-aligned."""
    runs = group_row_runs(
        spec.kv_cache_config, spec.block_size_factor, spec.cpu_page_size_per_worker
    )
    return [-(-sum(n for _, n in r) // PAGE) * PAGE for r in runs]


def _row_mask(spec: TieringOffloadingSpec, group: int) -> np.ndarray:
    """True at the row's bytes of the group."""
    mask = np.zeros(spec.cpu_page_size_per_worker, dtype=bool)
    for o, n in group_row_runs(
        spec.kv_cache_config, spec.block_size_factor, spec.cpu_page_size_per_worker
    )[group]:
        mask[o : o + n] = True
    return mask


def _block_files(root_dir: str) -> dict[str, int]:
    """Path -> size of every block file under root_dir."""
    return {
        os.path.join(d, f): os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(root_dir)
        for f in files
        if f.endswith(".bin")
    }


_UNEQUAL = pytest.mark.parametrize(
    "layout,blocks_per_chunk,checksum",
    [
        ("qwen3_5", 1, "none"),
        ("qwen3_5", 4, "crc32c"),
        ("gemma3_fewer_sliding", 1, "none"),
        ("gemma3_fewer_sliding", 2, "crc32c"),
    ],
)


def _store_one_request(model, root_dir, layout, blocks_per_chunk, checksum):
    """Store a request's blocks of every group to disk through the real
    connector scheduler (the tier budgeted). Returns the configs, the
    request and the number of keys stored."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        SchedulerOffloadConfig,
    )

    tier = {
        "type": "fs_python",
        "root_dir": root_dir,
        "n_read_threads": 2,
        "n_write_threads": 2,
        "checksum": checksum,
        "max_bytes": 1 << 30,
    }
    extra = {"blocks_per_chunk": blocks_per_chunk, "secondary_tiers": [tier]}
    configs = make_configs(model, layout, root_dir, 64, extra)
    spec = TieringOffloadingSpec(*configs)
    lcm = math.lcm(
        *(
            g.offloaded_block_size
            for g in SchedulerOffloadConfig.from_spec(spec).kv_group_configs
        )
    )
    request = _make_request(spec, "req0", 4 * lcm + 5)
    return configs, request, _store_requests(spec, [request])


@_UNEQUAL
def test_files_hold_only_their_groups_bytes(
    model_config,  # noqa: F811 (a fixture of test_tiering_hma)
    tmp_path,
    sha256_block_hashes,  # noqa: F811 (a fixture of test_tiering_hma)
    layout,
    blocks_per_chunk,
    checksum,
):
    """Through the real connector scheduler: every block file is its
    group's useful bytes, page-aligned (the checksum in the file's extended
    attribute),
    the layout (config.json) names each group's file size, and the budget
    counts exactly the bytes on disk."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )
    from vllm.v1.kv_offload.tiering.fs.io import CRC_XATTR

    root_dir = str(tmp_path / "fs")
    configs, _, num_keys = _store_one_request(
        model_config, root_dir, layout, blocks_per_chunk, checksum
    )
    spec = TieringOffloadingSpec(*configs)
    sizes = _expected_file_sizes(spec)
    # the layout has a group that uses part of a row
    assert min(sizes) < spec.cpu_page_size_per_worker

    # a restart indexes the files: the bytes it counts are the bytes on disk
    sched = OffloadingConnectorScheduler(TieringOffloadingSpec(*configs))
    try:
        (fs_tier,) = sched.manager.secondary_tiers
        files = _block_files(root_dir)
        assert len(files) == num_keys
        for path, size in files.items():
            group = int(os.path.basename(os.path.dirname(path)).rsplit("_g", 1)[1])
            assert size == sizes[group], path
            if fs_tier._checksum:
                assert len(os.getxattr(path, CRC_XATTR)) == 4
        groups = fs_tier.file_mapper.get_run_config()["kv_cache_groups"]
        assert [g["file_bytes"] for g in groups] == sizes
        assert fs_tier._budget.scan_done.wait(20)
        assert fs_tier._budget.used == sum(files.values())
    finally:
        sched.shutdown()


@_UNEQUAL
def test_a_load_gives_back_the_groups_bytes_only(
    model_config,  # noqa: F811 (a fixture of test_tiering_hma)
    tmp_path,
    sha256_block_hashes,  # noqa: F811 (a fixture of test_tiering_hma)
    layout,
    blocks_per_chunk,
    checksum,
):
    """Stored through the real connector scheduler, then a cold start (the
    CPU tier empty): the scheduler's lookup promotes every group's blocks
    from disk; each CPU row gets back exactly its group's bytes, and the
    row's other bytes are left as they were; the load job completes."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )

    root_dir = str(tmp_path / "fs")
    configs, request, _ = _store_one_request(
        model_config, root_dir, layout, blocks_per_chunk, checksum
    )
    spec = TieringOffloadingSpec(*configs)
    row = spec.cpu_page_size_per_worker
    sched = OffloadingConnectorScheduler(TieringOffloadingSpec(*configs))
    manager = sched.manager
    try:
        rows = cpu_rows(manager)
        rows[:] = SENTINEL  # what a load must leave outside its group's bytes
        for _ in range(400):
            num_hit_tokens, _ = sched.get_num_new_matched_tokens(request, 0)
            if num_hit_tokens is not None:
                break
            list(sched.take_events())
            time.sleep(0.005)
        assert num_hit_tokens
        promoted = manager.primary_tier._policy.blocks.items()
        assert promoted
        for key, block in promoted:
            mask = _row_mask(spec, get_offload_group_idx(key))
            got = rows[block.block_id]
            np.testing.assert_array_equal(got[mask], block_bytes(key, row)[mask])
            assert (got[~mask] == SENTINEL).all(), "a load wrote outside its group"
        assert _load_hit(sched, request, num_hit_tokens, blocks_per_chunk) > 0
    finally:
        sched.shutdown()


def test_smallest_budget_is_one_chunk_of_group_files(
    model_config,  # noqa: F811 (a fixture of test_tiering_hma)
    tmp_path,
):
    """max_bytes of one chunk (the sum of the groups' file sizes) is valid,
    one byte less is refused."""
    root_dir = str(tmp_path / "fs")

    def spec_with(max_bytes: int) -> TieringOffloadingSpec:
        tier = {"type": "fs_python", "root_dir": root_dir, "max_bytes": max_bytes}
        configs = make_configs(
            model_config, "qwen3_5", root_dir, 4, {"secondary_tiers": [tier]}
        )
        return TieringOffloadingSpec(*configs)

    chunk = sum(_expected_file_sizes(spec_with(1 << 30)))
    spec_with(chunk).get_manager().shutdown()
    with pytest.raises(ValueError, match="max_bytes"):
        spec_with(chunk - 1).get_manager()
