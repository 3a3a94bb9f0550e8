# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
Regression tests for tiered KV offloading (TieringOffloadingSpec) with
HMA models, i.e. models whose KV cache has several KV cache groups.

Everything is real except the GPU: the VllmConfig (built from a tiny
config.json written to tmp_path, never the hub), the KVCacheConfig (built by
vLLM's own get_kv_cache_configs from real KVCacheSpecs), the spec, the
TieringOffloadingManager, the CPU primary tier (a SharedOffloadRegion in
/dev/shm) and the fs_python secondary tier (on tmp_path). The GPU->CPU copy
is replaced by writing known bytes into the primary tier's rows, and the
CPU->GPU copy by reading them back.
"""

import contextlib
import errno
import json
import logging
import math
import mmap
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch

from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
)
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import (
    OffloadKey,
    ReqContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

_TIMEOUT_S = 20.0
_DTYPE = torch.float16

# ---------------------------------------------------------------------------
# KV cache layouts standing for the models of the upstream HMA report
# ---------------------------------------------------------------------------


def _one_group() -> dict[str, KVCacheSpec]:
    """Llama-like: full attention only, one KV cache group."""
    return {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=32, dtype=_DTYPE
        )
        for i in range(2)
    }


def _sliding_and_full() -> dict[str, KVCacheSpec]:
    """Gemma-3 / GPT-OSS-like: sliding + full attention, equal block sizes."""
    specs: dict[str, KVCacheSpec] = {}
    for i in range(4):
        name = f"model.layers.{i}.self_attn.attn"
        if i % 2 == 0:
            specs[name] = SlidingWindowSpec(
                block_size=16,
                num_kv_heads=2,
                head_size=32,
                dtype=_DTYPE,
                sliding_window=64,
            )
        else:
            specs[name] = FullAttentionSpec(
                block_size=16, num_kv_heads=2, head_size=32, dtype=_DTYPE
            )
    return specs


def _mixed_head_sizes() -> dict[str, KVCacheSpec]:
    """Gemma-4-like: full attention layers have twice the head size of the
    sliding window layers, so vLLM gives the sliding groups twice the block
    size to unify page sizes: block sizes (32, 32, 16)."""
    specs: dict[str, KVCacheSpec] = {}
    for i in range(6):
        name = f"model.layers.{i}.self_attn.attn"
        if i % 3 == 2:
            specs[name] = FullAttentionSpec(
                block_size=16, num_kv_heads=2, head_size=64, dtype=_DTYPE
            )
        else:
            specs[name] = SlidingWindowSpec(
                block_size=16,
                num_kv_heads=2,
                head_size=32,
                dtype=_DTYPE,
                sliding_window=64,
            )
    return specs


def _three_block_sizes() -> dict[str, KVCacheSpec]:
    """Three head sizes, hence block sizes (16, 32, 64)."""
    return {
        "model.layers.0.self_attn.attn": FullAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=64, dtype=_DTYPE
        ),
        "model.layers.1.self_attn.attn": SlidingWindowSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=32,
            dtype=_DTYPE,
            sliding_window=64,
        ),
        "model.layers.2.self_attn.attn": SlidingWindowSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=16,
            dtype=_DTYPE,
            sliding_window=128,
        ),
    }


# Mamba 'align' mode: the cache block size is raised so that an attention
# page holds a mamba state; mamba groups use the same (large) block size.
_MAMBA_BLOCK_SIZE = 96


def _mamba_and_attention(conv_dim: int = 64) -> dict[str, KVCacheSpec]:
    """Qwen3.5/3.6-, Nemotron-H-like: linear attention / mamba layers plus
    full attention layers, with a large block size (mamba_cache_mode='align')."""
    attn = FullAttentionSpec(
        block_size=_MAMBA_BLOCK_SIZE, num_kv_heads=1, head_size=32, dtype=_DTYPE
    )
    specs: dict[str, KVCacheSpec] = {}
    for i in range(3):
        specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
            block_size=_MAMBA_BLOCK_SIZE,
            shapes=((3, conv_dim), (2, 16, 16)),
            dtypes=(_DTYPE, _DTYPE),
            page_size_padded=attn.page_size_bytes,
            mamba_cache_mode="align",
        )
    specs["model.layers.3.self_attn.attn"] = attn
    return specs


def _mla_and_sliding() -> dict[str, KVCacheSpec]:
    """DeepSeek-V4-like: MLA full attention plus sliding window attention,
    block sizes (64, 32)."""
    return {
        "model.layers.0.self_attn.mla_attn": MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=72, dtype=_DTYPE
        ),
        "model.layers.0.self_attn.swa_attn": SlidingWindowSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=72,
            dtype=_DTYPE,
            sliding_window=128,
        ),
    }


def _odd_rows() -> dict[str, KVCacheSpec]:
    """Sliding + full attention with a head size giving 1280-byte rows, not a
    multiple of the disk's logical block size (as mamba states and mixed
    head sizes produce)."""
    return {
        "model.layers.0.self_attn.attn": SlidingWindowSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=20,
            dtype=_DTYPE,
            sliding_window=64,
        ),
        "model.layers.1.self_attn.attn": FullAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=20, dtype=_DTYPE
        ),
    }


# layout name -> (KV cache specs, extra CacheConfig arguments)
LAYOUTS: dict[str, tuple[Callable[[], dict[str, KVCacheSpec]], dict]] = {
    "llama": (_one_group, {}),
    "gemma3": (_sliding_and_full, {}),
    "gemma4": (_mixed_head_sizes, {}),
    "three_sizes": (_three_block_sizes, {}),
    "qwen3_5": (
        _mamba_and_attention,
        {"block_size": _MAMBA_BLOCK_SIZE, "mamba_cache_mode": "align"},
    ),
    "deepseek_v4": (_mla_and_sliding, {}),
    "odd_rows": (_odd_rows, {}),
}
# Mamba without 'align' mode: one block holds max_model_len tokens, block
# hashes are computed per scheduler block (lcm), offloading is impossible.
_OTHER_LAYOUTS = {
    # same block sizes, layer names and page size as qwen3_5, but another
    # mamba state layout within the page
    "qwen3_5_other_state": (
        lambda: _mamba_and_attention(conv_dim=32),
        LAYOUTS["qwen3_5"][1],
    ),
    "mamba_no_align": (
        lambda: {
            "model.layers.0.linear_attn": MambaSpec(
                block_size=1024,
                shapes=((3, 64), (2, 16, 16)),
                dtypes=(_DTYPE, _DTYPE),
                page_size_padded=2048,
            ),
            "model.layers.1.self_attn.attn": FullAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=32, dtype=_DTYPE
            ),
        },
        {},
    ),
}


def _fewer_sliding_layers() -> dict[str, KVCacheSpec]:
    """Gemma-3-27B-like: the sliding window layers are not a multiple of the
    full attention ones, so a sliding group has fewer layers than the shared
    tensors of a row: part of its row is unused."""
    specs: dict[str, KVCacheSpec] = {}
    for i in range(8):  # 3 full attention layers, 5 sliding window ones
        name = f"model.layers.{i}.self_attn.attn"
        if i in (1, 4, 7):
            specs[name] = FullAttentionSpec(
                block_size=16, num_kv_heads=2, head_size=64, dtype=_DTYPE
            )
        else:
            specs[name] = SlidingWindowSpec(
                block_size=16,
                num_kv_heads=2,
                head_size=64,
                dtype=_DTYPE,
                sliding_window=64,
            )
    return specs


_OTHER_LAYOUTS["gemma3_fewer_sliding"] = (_fewer_sliding_layers, {})
# per-group GPU block sizes vLLM derives for each layout
GPU_BLOCK_SIZES = {
    "llama": (16,),
    "gemma3": (16, 16),
    "gemma4": (32, 32, 16),
    "three_sizes": (16, 32, 64),
    "qwen3_5": (96, 96, 96, 96),
    "deepseek_v4": (64, 32),
    "odd_rows": (16, 16),
}

# ---------------------------------------------------------------------------
# Real configs
# ---------------------------------------------------------------------------


# /dev/shm regions of the primary tiers created by the running test
_SHM_PATHS: list[str] = []


@pytest.fixture(autouse=True)
def _remove_shm_regions():
    """Remove the primary tiers' /dev/shm regions left by failed tests."""
    yield
    while _SHM_PATHS:
        path = _SHM_PATHS.pop()
        if os.path.exists(path):
            os.remove(path)


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> ModelConfig:
    """A real ModelConfig for a tiny local Llama config (no hub access)."""
    model_dir = tmp_path_factory.mktemp("tiny-model")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "torch_dtype": "float16",
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    return ModelConfig(
        model=str(model_dir),
        tokenizer=str(model_dir),
        skip_tokenizer_init=True,
        max_model_len=1024,
        dtype="float16",
    )


def cpu_row_bytes(row_bytes: int) -> int:
    """The primary tier's row size: rows are padded to the page size."""
    return -(-row_bytes // mmap.PAGESIZE) * mmap.PAGESIZE


def make_configs(
    model_config: ModelConfig,
    layout: str,
    root_dir: str,
    cpu_blocks: int,
    extra_config: dict | None = None,
) -> tuple[VllmConfig, KVCacheConfig]:
    """Build a real VllmConfig and KVCacheConfig for the given layout.

    The CPU tier is sized to hold cpu_blocks offloaded blocks.
    """
    kv_connector_extra_config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 1,  # replaced below, once the row size is known
        "secondary_tiers": [
            {
                "type": "fs_python",
                "root_dir": root_dir,
                "n_read_threads": 2,
                "n_write_threads": 2,
            }
        ],
        **(extra_config or {}),
    }
    specs_fn, cache_kwargs = {**LAYOUTS, **_OTHER_LAYOUTS}[layout]
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(
            **{"block_size": 16, "enable_prefix_caching": True, **cache_kwargs}
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=kv_connector_extra_config,
        ),
    )
    _SHM_PATHS.append(f"/dev/shm/vllm_offload_{vllm_config.instance_id}.mmap")
    kv_cache_spec = specs_fn()
    page_bytes = max(spec.page_size_bytes for spec in kv_cache_spec.values())
    (kv_cache_config,) = get_kv_cache_configs(
        vllm_config, [kv_cache_spec], [page_bytes * len(kv_cache_spec) * 256]
    )
    row_bytes = (
        sum(t.size for t in kv_cache_config.kv_cache_tensors)
        // kv_cache_config.num_blocks
    )
    try:
        factor = int(kv_connector_extra_config.get("blocks_per_chunk", 1))
        if "block_size" in kv_connector_extra_config:
            factor = int(kv_connector_extra_config["block_size"]) // 16
    except ValueError:
        factor = 1  # an invalid option: the spec refuses it
    assert vllm_config.kv_transfer_config is not None
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    extra["cpu_bytes_to_use"] = cpu_row_bytes(row_bytes * factor) * cpu_blocks
    return vllm_config, kv_cache_config


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def wait_for(predicate: Callable[[], bool], manager: TieringOffloadingManager):
    """Run engine steps (take_events) until predicate() holds."""
    deadline = time.monotonic() + _TIMEOUT_S
    while True:
        list(manager.take_events())
        if predicate():
            return
        assert time.monotonic() < deadline, "timed out waiting for tier I/O"
        time.sleep(0.005)


def cpu_rows(manager: TieringOffloadingManager) -> np.ndarray:
    """The primary tier's rows, as (num_blocks, row_bytes) uint8."""
    return np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)


def block_bytes(key: OffloadKey, row_bytes: int) -> np.ndarray:
    """Deterministic content for the offloaded block identified by key."""
    seed = int.from_bytes(key, "big") % (2**32)
    return np.random.default_rng(seed).integers(0, 256, row_bytes, dtype=np.uint8)


def group_bytes(
    manager: TieringOffloadingManager, key: OffloadKey, row: np.ndarray
) -> np.ndarray:
    """The bytes of a row that the key's KV cache group's transfers use:
    what the fs tier stores and loads back (the rest of a row loaded from
    disk is left as it was)."""
    for tier in manager.secondary_tiers:
        group_file = tier._group_file(key)
        runs = group_file.runs or ((group_file.offset, group_file.size),)
        return np.concatenate([row[o : o + n] for o, n in runs])
    return row


def assert_holds(
    manager: TieringOffloadingManager, key: OffloadKey, row: np.ndarray, **kwargs
) -> None:
    """A row holds the key's bytes (those its group uses, see group_bytes())."""
    np.testing.assert_array_equal(
        group_bytes(manager, key, row),
        group_bytes(manager, key, block_bytes(key, len(row))),
        **kwargs,
    )


def request_keys(req_idx: int, num_blocks: int, num_groups: int) -> list[OffloadKey]:
    """Keys of a request's blocks, for every group, group-major."""
    return [
        make_offload_key(f"req{req_idx}-blk{b}".encode().ljust(32, b"\0"), g)
        for g in range(num_groups)
        for b in range(num_blocks)
    ]


def ref_cnt(manager: TieringOffloadingManager, key: OffloadKey) -> int | None:
    block = manager.primary_tier._policy.get(key)
    return None if block is None else block.ref_cnt


def store(
    manager: TieringOffloadingManager, keys: list[OffloadKey], ctx: ReqContext
) -> None:
    """GPU->CPU store of keys (the GPU copy writes known bytes), then wait
    for the cascade to every secondary tier to finish."""
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    rows = cpu_rows(manager)
    for key, block_id in zip(out.keys_to_store, out.store_spec.block_ids):
        rows[block_id] = block_bytes(key, rows.shape[1])
    manager.complete_store(keys, ctx)
    wait_for(lambda: all(ref_cnt(manager, k) == 0 for k in keys), manager)


def load(
    manager: TieringOffloadingManager, keys: list[OffloadKey], ctx: ReqContext
) -> None:
    """Look keys up (promoting them from secondary tiers as needed), then
    CPU->GPU load them and check the bytes the GPU would receive."""

    def all_ready() -> bool:
        return all(manager.lookup(k, ctx) for k in keys)

    wait_for(all_ready, manager)
    spec = manager.prepare_load(keys, ctx)
    assert isinstance(spec, CPULoadStoreSpec)
    rows = cpu_rows(manager)
    for key, block_id in zip(keys, spec.block_ids):
        assert_holds(manager, key, rows[block_id])
    manager.complete_load(keys, ctx)
    list(manager.take_events())  # the step ends: lookup()'s pins are released
    assert all(ref_cnt(manager, k) == 0 for k in keys)


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hma_store_cascade_cold_promote_load(model_config, tmp_path, layout):
    """A TieringOffloadingSpec built from a real VllmConfig and a real
    multi-group KVCacheConfig yields a working manager: store, cascade to the
    fs_python tier, then a cold manager on the same directory looks the blocks
    of every group up, promotes and loads them."""
    root_dir = str(tmp_path / "fs")
    vllm_config, kv_cache_config = make_configs(
        model_config, layout, root_dir, cpu_blocks=16
    )
    num_groups = len(kv_cache_config.kv_cache_groups)
    keys = request_keys(0, num_blocks=4, num_groups=num_groups)
    ctx = ReqContext(req_id="req0")

    spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    assert spec.gpu_block_size == GPU_BLOCK_SIZES[layout]
    manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    try:
        store(manager, keys, ctx)
        load(manager, keys, ctx)  # warm: served by the CPU tier
    finally:
        manager.shutdown()

    # Cold start: an empty CPU tier over the same fs_python directory.
    cold_manager = TieringOffloadingSpec(vllm_config, kv_cache_config).get_manager()
    assert isinstance(cold_manager, TieringOffloadingManager)
    try:
        for key in keys:
            assert cold_manager.primary_tier.lookup(key, ctx) is False
            # hit in the fs tier: promotion starts, retry later
            assert cold_manager.lookup(key, ctx) is None
        load(cold_manager, keys, ctx)
    finally:
        cold_manager.shutdown()

    files = [os.path.join(d, f) for d, _, fs in os.walk(root_dir) for f in fs]
    assert sum(f.endswith(".bin") for f in files) == len(keys)
    assert not [f for f in files if f.endswith(".tmp")]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 4])
def test_per_group_offloaded_block_sizes(
    model_config, tmp_path, layout, blocks_per_chunk
):
    """Chunking works for any per-group block sizes: one blocks_per_chunk for
    all groups; per-group tokens and hash blocks per offloaded block are
    derived once on the spec, and the connector scheduler uses them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        SchedulerOffloadConfig,
    )

    vllm_config, kv_cache_config = make_configs(
        model_config,
        layout,
        str(tmp_path),
        cpu_blocks=4,
        extra_config={"blocks_per_chunk": blocks_per_chunk},
    )
    spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    gpu_block_sizes = GPU_BLOCK_SIZES[layout]
    assert spec.gpu_block_size == gpu_block_sizes
    assert spec.block_size_factor == blocks_per_chunk
    assert spec.offloaded_block_size == tuple(
        b * blocks_per_chunk for b in gpu_block_sizes
    )
    assert spec.hash_blocks_per_offloaded_block == tuple(
        b * blocks_per_chunk // spec.hash_block_size for b in gpu_block_sizes
    )
    # a CPU row holds blocks_per_chunk GPU blocks of any group
    row_bytes = (
        sum(t.size for t in kv_cache_config.kv_cache_tensors)
        // kv_cache_config.num_blocks
    )
    assert spec.cpu_page_size_per_worker == cpu_row_bytes(row_bytes * blocks_per_chunk)
    assert spec.num_blocks == 4

    sched_config = SchedulerOffloadConfig.from_spec(spec)
    assert sched_config.block_size_factor == blocks_per_chunk
    for group_config in sched_config.kv_group_configs:
        idx = group_config.group_idx
        assert group_config.gpu_block_size == gpu_block_sizes[idx]
        assert group_config.offloaded_block_size == spec.offloaded_block_size[idx]
        assert (
            group_config.hash_block_size_factor
            == spec.hash_blocks_per_offloaded_block[idx]
        )

    # 'block_size' (tokens) stays supported when all groups agree
    if len(set(gpu_block_sizes)) == 1:
        extra_config = {"block_size": gpu_block_sizes[0] * blocks_per_chunk}
        vllm_config, kv_cache_config = make_configs(
            model_config, layout, str(tmp_path), 4, extra_config
        )
        spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
        assert spec.block_size_factor == blocks_per_chunk


@pytest.mark.parametrize("layout", ["gemma4", "deepseek_v4"])
def test_chunked_store_cold_load_mixed_block_sizes(model_config, tmp_path, layout):
    """blocks_per_chunk=2 with groups of different block sizes: chunks of
    every group cascade to disk and come back on a cold start."""
    root_dir = str(tmp_path / "fs")
    vllm_config, kv_cache_config = make_configs(
        model_config, layout, root_dir, 8, {"blocks_per_chunk": 2}
    )
    keys = request_keys(0, num_blocks=2, num_groups=len(GPU_BLOCK_SIZES[layout]))
    ctx = ReqContext(req_id="req0")
    manager = TieringOffloadingSpec(vllm_config, kv_cache_config).get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    try:
        store(manager, keys, ctx)
    finally:
        manager.shutdown()
    cold = TieringOffloadingSpec(vllm_config, kv_cache_config).get_manager()
    assert isinstance(cold, TieringOffloadingManager)
    try:
        load(cold, keys, ctx)
    finally:
        cold.shutdown()


@pytest.mark.parametrize(
    "layout,extra_config,match",
    [
        # tokens per chunk are ambiguous when groups differ in block size
        ("gemma4", {"block_size": 64}, r"\(32, 32, 16\).*blocks_per_chunk"),
        ("llama", {"block_size": 24}, r"'block_size'=24.*multiple.*16"),
        ("llama", {"block_size": "16x"}, "'block_size'.*positive integer"),
        ("llama", {"blocks_per_chunk": 0}, "'blocks_per_chunk'.*positive integer"),
        ("llama", {"blocks_per_chunk": "two"}, "'blocks_per_chunk'.*positive"),
        ("llama", {"blocks_per_chunk": True}, "'blocks_per_chunk'.*positive"),
        ("llama", {"blocks_per_chunk": 2, "block_size": 32}, "only one"),
        ("mamba_no_align", {}, r"\(1024, 16\).*enable-prefix-caching"),
    ],
    ids=[
        "block_size_for_mixed_sizes",
        "block_size_not_multiple",
        "block_size_not_int",
        "blocks_per_chunk_zero",
        "blocks_per_chunk_not_int",
        "blocks_per_chunk_bool",
        "both_options",
        "mamba_without_align_mode",
    ],
)
def test_invalid_chunking_raises_value_error(
    model_config, tmp_path, layout, extra_config, match
):
    vllm_config, kv_cache_config = make_configs(
        model_config, layout, str(tmp_path), 4, extra_config
    )
    with pytest.raises(ValueError, match=match):
        TieringOffloadingSpec(vllm_config, kv_cache_config)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_file_mapper_describes_hma_layout(model_config, tmp_path, layout):
    """The fs tier's FileMapper records the hash block size vLLM hashes with
    (not cache_config.block_size), and per group the kind, bytes per block,
    dtype and shape of its blocks."""
    vllm_config, kv_cache_config = make_configs(
        model_config, layout, str(tmp_path), cpu_blocks=4
    )
    spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    run_config = FileMapper.from_offloading_spec(str(tmp_path), spec).get_run_config()
    assert run_config["hash_block_size"] == spec.hash_block_size
    groups = kv_cache_config.kv_cache_groups
    layouts = [g["layout"] for g in run_config["kv_cache_groups"]]
    assert [x["page_size_bytes"] for x in layouts] == [
        g.kv_cache_spec.page_size_bytes for g in groups
    ]
    assert [x["block_size"] for x in layouts] == list(GPU_BLOCK_SIZES[layout])
    for x, group in zip(layouts, groups):
        assert x["version"] == 1
        if isinstance(group.kv_cache_spec, MambaSpec):
            assert x["kind"] == "mamba"
            assert x["shapes"] == [[3, 64], [2, 16, 16]]
            assert x["dtypes"] == ["float16", "float16"]
        else:
            assert x["kind"] in ("attention", "mla_attention")
            assert x["dtype"] == "float16"
            assert x["head_size"] == group.kv_cache_spec.head_size


def test_layout_fields_ignore_what_does_not_change_the_bytes():
    """Only what changes a block's bytes moves a cache to another directory:
    not the spec's repr (e.g. a sliding window size, speculative blocks)."""
    from vllm.v1.kv_offload.file_mapper import describe_block_layout

    def mamba(conv_dim: int = 64, **kwargs) -> MambaSpec:
        return MambaSpec(
            block_size=96,
            shapes=((3, conv_dim), (2, 16, 16)),
            dtypes=(_DTYPE, _DTYPE),
            page_size_padded=6144,
            mamba_cache_mode="align",
            **kwargs,
        )

    def sliding(window: int) -> SlidingWindowSpec:
        return SlidingWindowSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=32,
            dtype=_DTYPE,
            sliding_window=window,
        )

    assert describe_block_layout(mamba()) == describe_block_layout(
        mamba(num_speculative_blocks=2)
    )
    assert describe_block_layout(mamba()) != describe_block_layout(mamba(32))
    assert describe_block_layout(sliding(64)) == describe_block_layout(sliding(128))


def test_files_of_another_layout_are_never_read(model_config, tmp_path):
    """Blocks stored under one KV cache layout are not served to a model with
    the same block sizes, layer names and page size but another layout within
    the page (here: another mamba state shape)."""
    root_dir = str(tmp_path / "fs")
    vllm_config, kv_cache_config = make_configs(model_config, "qwen3_5", root_dir, 8)
    other_vllm_config, other_kv_cache_config = make_configs(
        model_config, "qwen3_5_other_state", root_dir, 8
    )
    spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    other_spec = TieringOffloadingSpec(other_vllm_config, other_kv_cache_config)
    assert (
        FileMapper.from_offloading_spec(root_dir, spec).base_path
        != FileMapper.from_offloading_spec(root_dir, other_spec).base_path
    )

    keys = request_keys(0, num_blocks=2, num_groups=4)
    ctx = ReqContext(req_id="req0")
    manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    try:
        store(manager, keys, ctx)
    finally:
        manager.shutdown()

    other = other_spec.get_manager()
    assert isinstance(other, TieringOffloadingManager)
    try:
        assert not any(other.lookup(key, ctx) for key in keys)
    finally:
        other.shutdown()


@pytest.mark.parametrize("layout", ["odd_rows", "qwen3_5", "gemma3"])
def test_rows_are_page_aligned_for_secondary_tiers(
    model_config, tmp_path, caplog, layout
):
    """Any KV layout gets page-aligned CPU rows (1280-byte rows of odd head
    sizes, mamba states), so the fs tier's O_DIRECT I/O works for them; the
    capacity the padding costs is logged."""
    root_dir = str(tmp_path / "fs")
    vllm_config, kv_cache_config = make_configs(model_config, layout, root_dir, 8)
    with caplog.at_level(logging.INFO, logger="vllm.v1.kv_offload.cpu.spec"):
        spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    assert spec.cpu_page_size_per_worker % mmap.PAGESIZE == 0
    padded = [r.getMessage() for r in caplog.records if "pads each" in r.getMessage()]
    if layout == "odd_rows":
        assert padded == [
            "CPU offloading pads each 1280-byte block to 4096 bytes (alignment "
            f"{mmap.PAGESIZE}): 8 CPU blocks fit in cpu_bytes_to_use instead of 25."
        ]
    keys = request_keys(0, 2, len(GPU_BLOCK_SIZES[layout]))
    ctx = ReqContext(req_id="req0")
    manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    try:
        store(manager, keys, ctx)
    finally:
        manager.shutdown()
    files = [f for _, _, fs in os.walk(root_dir) for f in fs]
    assert sum(f.endswith(".bin") for f in files) == len(keys)
    cold = TieringOffloadingSpec(vllm_config, kv_cache_config).get_manager()
    assert isinstance(cold, TieringOffloadingManager)
    try:
        load(cold, keys, ctx)
    finally:
        cold.shutdown()


@pytest.mark.parametrize("layout", ["odd_rows", "deepseek_v4", "qwen3_5"])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_worker_views_match_rows_secondary_tiers_copy(
    model_config, tmp_path, layout, blocks_per_chunk
):
    """The worker's per-tensor CPU views (as CpuGpuOffloadingHandlers lays
    them out, block_size_factor GPU pages per tensor) fit in the padded row
    and are exactly the bytes the scheduler-side view hands to secondary
    tiers for that block."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    vllm_config, kv_cache_config = make_configs(
        model_config,
        layout,
        str(tmp_path / "fs"),
        4,
        {"blocks_per_chunk": blocks_per_chunk},
    )
    spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    worker_region = SharedOffloadRegion(
        instance_id=vllm_config.instance_id,
        total_size_bytes=spec.cpu_page_size_per_worker * spec.num_blocks,
        num_blocks=spec.num_blocks,
        rank=0,
        num_workers=1,
        cpu_page_size=spec.cpu_page_size_per_worker,
    )
    views: list[torch.Tensor] = []
    try:
        page_sizes = [
            t.size // kv_cache_config.num_blocks * blocks_per_chunk
            for t in kv_cache_config.kv_cache_tensors
        ]
        views = [worker_region.create_next_view(p) for p in page_sizes]
        rows = cpu_rows(manager)
        block_id = spec.num_blocks - 1
        for i, view in enumerate(views):
            view[block_id] = torch.full((page_sizes[i],), i + 1, dtype=torch.int8)
        expected = np.concatenate(
            [np.full(p, i + 1, dtype=np.uint8) for i, p in enumerate(page_sizes)]
        )
        np.testing.assert_array_equal(rows[block_id][: len(expected)], expected)
        assert rows.shape[1] % mmap.PAGESIZE == 0
    finally:
        views.clear()
        worker_region.cleanup()
        manager.shutdown()


def _fail_io_on(monkeypatch, func_name: str, bad_suffixes: list[str]):
    """Make os.<func_name> fail with EIO for files whose name ends with one
    of bad_suffixes (the fs tier's threads call it, in Python: its C path,
    where built, is not used)."""
    from vllm.v1.kv_offload.tiering.fs import io as fs_io

    monkeypatch.setattr(fs_io, "_HAS_FSIO_C", False)
    real = getattr(os, func_name)

    def failing(fd, *args, **kwargs):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if any(path.split(".bin")[0].endswith(s) for s in bad_suffixes):
            raise OSError(errno.EIO, "injected I/O error")
        return real(fd, *args, **kwargs)

    monkeypatch.setattr(os, func_name, failing)


def _file_stem(key: OffloadKey) -> str:
    """The end of the fs tier's file name for key, without .bin."""
    return f"_g{get_offload_group_idx(key)}/{get_offload_block_hash(key).hex()}"


@pytest.mark.parametrize("layout", ["llama", "gemma4"])
def test_failed_writes_and_reads_stay_contained(
    model_config, tmp_path, monkeypatch, layout
):
    """Injected write and read errors: a key whose data did not arrive is
    never served, ref counts return to zero, no .tmp file is left, and the
    keys that succeeded in the same job are served without a second
    promotion. (EIO stops a batch: the failing blocks are the jobs' last.)"""
    root_dir = str(tmp_path / "fs")
    vllm_config, kv_cache_config = make_configs(model_config, layout, root_dir, 16)
    keys = request_keys(0, num_blocks=3, num_groups=len(GPU_BLOCK_SIZES[layout]))
    bad_write, bad_read = keys[-1], keys[1]
    good = [k for k in keys if k not in (bad_write, bad_read)]
    ctx = ReqContext(req_id="req0")

    manager = TieringOffloadingSpec(vllm_config, kv_cache_config).get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    try:
        with monkeypatch.context() as m:
            _fail_io_on(m, "write", [_file_stem(bad_write)])
            store(manager, keys, ctx)  # waits for ref counts back to 0
        # the CPU copy is intact
        load(manager, keys, ctx)
    finally:
        manager.shutdown()
    files = [os.path.join(d, f) for d, _, fs in os.walk(root_dir) for f in fs]
    assert not [f for f in files if f.endswith(".tmp")]
    assert sum(f.endswith(".bin") for f in files) == len(keys) - 1

    cold = TieringOffloadingSpec(vllm_config, kv_cache_config).get_manager()
    assert isinstance(cold, TieringOffloadingManager)
    try:
        assert cold.lookup(bad_write, ctx) is False
        with monkeypatch.context() as m:
            _fail_io_on(m, "readv", [_file_stem(bad_read)])
            for key in good + [bad_read]:
                assert cold.lookup(key, ctx) is None  # promotion started
            list(cold.take_events())  # submit the promotion job
            # wait until the job finished: no block is in flight anymore
            wait_for(
                lambda: all(
                    cold.primary_tier.lookup(k, ctx) is not None
                    for k in good + [bad_read]
                ),
                cold,
            )
        # the failed key is not served, and its slot is free again
        assert cold.primary_tier.lookup(bad_read, ctx) is False
        assert ref_cnt(cold, bad_read) is None
        # the keys that arrived are ready at once, no second promotion
        assert all(cold.primary_tier.lookup(k, ctx) is True for k in good)
        load(cold, good, ctx)
    finally:
        cold.shutdown()


@pytest.fixture
def sha256_block_hashes():
    """Block hashes as the engine computes them by default (sha256); the
    module global NONE_HASH is restored afterwards."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    saved = getattr(kv_cache_utils, "NONE_HASH", None)
    kv_cache_utils.init_none_hash(sha256)
    yield
    if saved is not None:
        kv_cache_utils.NONE_HASH = saved


def _sched_config_keys(sched, request) -> list[list[OffloadKey]]:
    """The offload keys the connector scheduler derives for a request's
    block hashes, per KV cache group."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        RequestOffloadState,
    )

    state = RequestOffloadState(config=sched.config, req=request)
    state.update_offload_keys()
    return [list(g.offload_keys) for g in state.group_states]


def _make_request(spec: TieringOffloadingSpec, req_id: str, num_tokens: int, seed=0):
    """A real Request whose block hashes the scheduler reads (sha256, the
    default prefix caching hash)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(
        request_id=req_id,
        prompt_token_ids=[(7 * i + 13 * seed) % 500 for i in range(num_tokens)],
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(spec.hash_block_size, sha256),
    )


def _load_hit(sched, request, num_hit_tokens: int, blocks_per_chunk: int) -> int:
    """Do what the engine does with a connector hit: allocate GPU blocks
    (null blocks before the window of sliding-window and mamba groups, as
    vLLM's KV cache managers do), update_state_after_alloc(),
    build_connector_meta(), check the bytes the load job reads for every
    group, and report the load done. Returns the number of keys loaded."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    manager = sched.manager
    blocks, expected_keys = [], []
    for group_idx, (group, keys) in enumerate(
        zip(sched.config.kv_group_configs, _sched_config_keys(sched, request))
    ):
        # in offloaded blocks (chunks of blocks_per_chunk GPU blocks)
        num_chunks = num_hit_tokens // group.offloaded_block_size
        needed = group.sliding_window_size_in_blocks or num_chunks
        num_null_chunks = max(num_chunks - needed, 0)
        num_null = num_null_chunks * blocks_per_chunk
        num_blocks = num_chunks * blocks_per_chunk
        blocks.append(
            [KVCacheBlock(0, is_null=True) for _ in range(num_null)]
            + [
                KVCacheBlock(1000 * (group_idx + 1) + i)
                for i in range(num_null, num_blocks)
            ]
        )
        expected_keys.append(keys[num_null_chunks:num_chunks])
    sched.update_state_after_alloc(
        request, KVCacheBlocks(tuple(blocks)), num_hit_tokens
    )
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    ((job_id, job),) = meta.load_jobs.items()
    src_spec, dst_spec = job.transfer_spec
    assert isinstance(src_spec, CPULoadStoreSpec)
    # hits per group: the blocks each group loads
    assert list(dst_spec.group_sizes) == [
        len(k) * blocks_per_chunk for k in expected_keys
    ]
    rows = cpu_rows(manager)
    flat_keys = [k for keys in expected_keys for k in keys]
    assert len(src_spec.block_ids) == len(flat_keys)
    for key, block_id in zip(flat_keys, src_spec.block_ids):
        assert_holds(manager, key, rows[block_id])
    assert all(ref_cnt(manager, k) >= 1 for k in flat_keys)

    # the worker reports the load done
    worker_meta = OffloadingWorkerMetadata()
    worker_meta.mark_completed(job_id)
    sched.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=worker_meta)
    )
    return len(flat_keys)


def _store_requests(spec: TieringOffloadingSpec, requests) -> int:
    """A previous engine stored every block of the requests, for every
    group, and cascaded them to disk. Returns the number of keys."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )

    sched = OffloadingConnectorScheduler(spec)
    keys = [
        k
        for request in requests
        for group_keys in _sched_config_keys(sched, request)
        for k in group_keys
    ]
    try:
        store(sched.manager, keys, ReqContext("x"))
    finally:
        sched.shutdown()
    return len(keys)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_connector_scheduler_cold_restart_hits_every_group(
    model_config, tmp_path, sha256_block_hashes, layout, blocks_per_chunk
):
    """The real offloading connector scheduler over the real tiers: a
    request's blocks of every group, keyed by its real block hashes, are on
    disk; after a cold start the scheduler's lookup promotes them, reports
    the expected hit, and its load job reads the right bytes for every
    group; ref counts return to zero once the load completes."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
        SchedulerOffloadConfig,
    )

    root_dir = str(tmp_path / "fs")
    vllm_config, kv_cache_config = make_configs(
        model_config, layout, root_dir, 64, {"blocks_per_chunk": blocks_per_chunk}
    )
    spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    block_sizes = [
        g.offloaded_block_size
        for g in SchedulerOffloadConfig.from_spec(spec).kv_group_configs
    ]
    lcm = math.lcm(*block_sizes)
    num_tokens = 4 * lcm + 5
    request = _make_request(spec, "req0", num_tokens)
    num_keys = _store_requests(spec, [request])
    assert num_keys == sum(num_tokens // b for b in block_sizes)

    # Cold start: the real scheduler looks the request up until promoted.
    sched = OffloadingConnectorScheduler(
        TieringOffloadingSpec(vllm_config, kv_cache_config)
    )
    manager = sched.manager
    assert isinstance(manager, TieringOffloadingManager)
    try:
        for _ in range(200):
            num_hit_tokens, is_async = sched.get_num_new_matched_tokens(request, 0)
            if num_hit_tokens is not None:
                break
            list(sched.take_events())  # end of engine step
            time.sleep(0.005)
        # every group hits up to the last full chunk of the largest block
        assert num_hit_tokens == 4 * lcm and is_async
        assert _load_hit(sched, request, num_hit_tokens, blocks_per_chunk) > 0
        list(sched.take_events())
        assert all(b.ref_cnt == 0 for b in manager.primary_tier._policy.blocks.values())
    finally:
        sched.shutdown()
    files = [f for _, _, fs in os.walk(root_dir) for f in fs]
    assert not [f for f in files if f.endswith(".tmp")]


def _write_weights(model_dir, seed: int) -> None:
    """A checkpoint file of the tiny model: what a fine-tune rewrites."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {
        f"model.layers.{i}.self_attn.{name}.weight": torch.randn(
            64, 64, generator=g
        ).half()
        for i in range(4)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    save_file(tensors, str(model_dir / "model.safetensors"), {"format": "pt"})


@pytest.mark.parametrize(
    "change, hits",
    [
        ("none", True),
        ("touch", True),
        ("weights", False),
        ("rope_theta", False),
    ],
)
@pytest.mark.parametrize("layout", ["llama", "gemma3"])
def test_cold_restart_after_a_model_change_at_its_path(
    model_config, tmp_path, sha256_block_hashes, layout, change, hits
):
    """An engine stored a request's blocks to disk; the model at the same
    path then changes and an engine starts on the same root. New weights of
    the same shapes (a fine-tune written over the directory) or a new
    rope_theta (--hf-overrides; an edit of config.json does the same)
    compute other K/V for the same tokens: the real connector scheduler
    finds no hit. The unchanged model, also after a touch of its files,
    keeps its hits."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
        SchedulerOffloadConfig,
    )

    model_dir = tmp_path / "model"
    shutil.copytree(model_config.model, model_dir)
    _write_weights(model_dir, seed=0)

    def engine_configs(**model_kwargs):
        config = ModelConfig(
            model=str(model_dir),
            tokenizer=str(model_dir),
            skip_tokenizer_init=True,
            max_model_len=1024,
            dtype="float16",
            **model_kwargs,
        )
        return make_configs(config, layout, str(tmp_path / "fs"), 64)

    spec = TieringOffloadingSpec(*engine_configs())
    block_sizes = [
        g.offloaded_block_size
        for g in SchedulerOffloadConfig.from_spec(spec).kv_group_configs
    ]
    num_tokens = 4 * math.lcm(*block_sizes) + 5
    request = _make_request(spec, "req0", num_tokens)
    assert _store_requests(spec, [request]) > 0

    model_kwargs = {}
    if change == "touch":
        for name in os.listdir(model_dir):
            os.utime(model_dir / name, (1, 1))
    elif change == "weights":
        _write_weights(model_dir, seed=1)
    elif change == "rope_theta":
        model_kwargs["hf_overrides"] = {"rope_theta": 40000.0}
    sched = OffloadingConnectorScheduler(
        TieringOffloadingSpec(*engine_configs(**model_kwargs))
    )
    try:
        for _ in range(200):
            num_hit_tokens, _ = sched.get_num_new_matched_tokens(request, 0)
            if num_hit_tokens is not None:
                break
            list(sched.take_events())  # end of engine step
            time.sleep(0.005)
        expected = 4 * math.lcm(*block_sizes) if hits else 0
        assert num_hit_tokens == expected, (
            f"after a change of {change}: {num_hit_tokens} tokens hit on disk, "
            f"{expected} expected"
        )
    finally:
        sched.shutdown()


@pytest.mark.parametrize("layout", ["llama", "gemma3"])
@pytest.mark.parametrize("keyed", [False, True], ids=["no_key", "key_file"])
def test_requests_with_another_cache_salt_never_load_disk_blocks(
    model_config, tmp_path, sha256_block_hashes, layout, keyed
):
    """Tenants of one server share its disk tier; their requests carry a
    cache_salt, which is part of the first block's hash (and so of every
    later block's). A tenant's blocks on disk are found by its own requests
    after a cold start, through the real connector scheduler, and never by
    a request with the same prompt and another salt or none: the salt is
    what separates tenants of one server (the tier's key file separates
    engines sharing a store; both at once here when keyed)."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
        SchedulerOffloadConfig,
    )
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    vllm_config, kv_cache_config = make_configs(
        model_config, layout, str(tmp_path / "fs"), 64
    )
    if keyed:
        key_file = tmp_path / "key"
        key_file.write_bytes(os.urandom(32))
        os.chmod(key_file, 0o600)
        assert vllm_config.kv_transfer_config is not None
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        extra["secondary_tiers"][0]["key_file"] = str(key_file)
    spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    lcm = math.lcm(
        *(
            g.offloaded_block_size
            for g in SchedulerOffloadConfig.from_spec(spec).kv_group_configs
        )
    )
    num_tokens = 4 * lcm + 5

    def request(req_id: str, cache_salt: str | None) -> Request:
        return Request(
            request_id=req_id,
            prompt_token_ids=[(7 * i) % 500 for i in range(num_tokens)],
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            cache_salt=cache_salt,
            block_hasher=get_request_block_hasher(spec.hash_block_size, sha256),
        )

    assert _store_requests(spec, [request("a0", "tenant-a")]) > 0

    sched = OffloadingConnectorScheduler(
        TieringOffloadingSpec(vllm_config, kv_cache_config)
    )
    fs_tier = sched.manager.secondary_tiers[0]
    loads: list = []
    submit_load = fs_tier.submit_load

    def recorded_load(job):
        loads.append(list(job.keys))
        submit_load(job)

    fs_tier.submit_load = recorded_load
    try:

        def matched(req: Request) -> int | None:
            for _ in range(200):
                num_hit_tokens, _ = sched.get_num_new_matched_tokens(req, 0)
                if num_hit_tokens is not None:
                    return num_hit_tokens
                list(sched.take_events())  # end of engine step
                time.sleep(0.005)
            return None

        # other tenants first: nothing of tenant a's is found or loaded
        assert matched(request("b0", "tenant-b")) == 0
        assert matched(request("n0", None)) == 0
        assert loads == [], "another tenant's request loaded disk blocks"
        # the same tenant after the restart: hits every group's blocks
        own = request("a1", "tenant-a")
        assert matched(own) == 4 * lcm
        assert loads and {k for job in loads for k in job} <= {
            k for g in _sched_config_keys(sched, own) for k in g
        }
    finally:
        sched.shutdown()


@pytest.mark.parametrize(
    "layout", ["llama", "gemma3", "gemma4", "qwen3_5", "deepseek_v4"]
)
@pytest.mark.parametrize("num_requests", [1, 3])
def test_promotion_never_evicts_blocks_reported_ready(
    model_config, tmp_path, sha256_block_hashes, layout, num_requests
):
    """Requests whose blocks are on disk, looked up together by the real
    connector scheduler through a cold CPU tier smaller than one request's
    blocks: promoting one group's block must not evict a block that lookup
    already reported ready in the same step (typically the request's block of
    another group). Otherwise the next lookup misses it, promotes it again
    and evicts the other one: the request is deferred forever. Every request
    settles within a few steps, and what it was told is ready loads with the
    right bytes."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
        SchedulerOffloadConfig,
    )

    root_dir = str(tmp_path / "fs")
    vllm_config, kv_cache_config = make_configs(model_config, layout, root_dir, 64)
    spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    block_sizes = [
        g.offloaded_block_size
        for g in SchedulerOffloadConfig.from_spec(spec).kv_group_configs
    ]
    num_tokens = 3 * math.lcm(*block_sizes) + 1
    requests = [
        _make_request(spec, f"req{r}", num_tokens, seed=r) for r in range(num_requests)
    ]
    per_request = _store_requests(spec, requests) // num_requests

    # a cold CPU tier that holds fewer blocks than one request has
    vllm_config, kv_cache_config = make_configs(
        model_config, layout, root_dir, per_request - 1
    )
    sched = OffloadingConnectorScheduler(
        TieringOffloadingSpec(vllm_config, kv_cache_config)
    )
    try:
        pending = list(requests)
        for _ in range(20):  # engine steps
            for request in list(pending):
                num_hit_tokens, _ = sched.get_num_new_matched_tokens(request, 0)
                if num_hit_tokens is None:
                    continue  # deferred: a promotion is in flight
                pending.remove(request)
                if num_hit_tokens:
                    _load_hit(sched, request, num_hit_tokens, 1)
            list(sched.take_events())  # end of engine step
            if not pending:
                break
            for tier in sched.manager.secondary_tiers:  # promotions landed
                with tier._pool._condition:
                    assert tier._pool._condition.wait_for(
                        lambda pool=tier._pool: pool._inflight_jobs == 0, 60
                    )
        assert not pending, "requests deferred forever"
        list(sched.take_events())
        blocks = sched.manager.primary_tier._policy.blocks.values()
        assert all(b.ref_cnt in (-1, 0) for b in blocks)
    finally:
        sched.shutdown()


@pytest.mark.parametrize("cache_policy", ["lru", "arc"])
def test_blocks_reported_ready_after_an_eviction_stay_too(
    model_config, tmp_path, cache_policy
):
    """One engine step looks up hits and blocks only on disk, interleaved,
    with a full CPU tier: each promotion evicts. Every block lookup()
    reported ready in the step, before and after the promotions' evictions,
    must still be in the CPU tier when the scheduler loads it in the same
    step, with its bytes."""
    root_dir = str(tmp_path / "fs")
    vllm_config, kv_cache_config = make_configs(
        model_config, "llama", root_dir, 4, {"eviction_policy": cache_policy}
    )
    manager = TieringOffloadingSpec(vllm_config, kv_cache_config).get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    ctx = ReqContext(req_id="req0")
    a, b, c, d, e, f = request_keys(0, num_blocks=6, num_groups=1)
    try:
        store(manager, [a, b, c, d], ctx)
        store(manager, [e, f], ctx)  # evicts a and b: on disk only
        assert ref_cnt(manager, a) is None and ref_cnt(manager, b) is None

        # one step: c ready, a promoted (evicts), e ready, b promoted (evicts)
        results = {key: manager.lookup(key, ctx) for key in (c, a, e, b)}
        assert results == {c: True, a: None, e: True, b: None}
        spec = manager.prepare_load([c, e], ctx)
        assert isinstance(spec, CPULoadStoreSpec)
        rows = cpu_rows(manager)
        for key, block_id in zip((c, e), spec.block_ids):
            assert_holds(manager, key, rows[block_id])
        list(manager.take_events())  # the step ends
        manager.complete_load([c, e], ctx)
        load(manager, [a, b], ctx)  # the promoted blocks arrive
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    "hash_algo,seed,warns",
    [("sha256", None, False), ("xxhash", None, True), ("xxhash", "0", False)],
    ids=["sha256", "xxhash_unseeded", "xxhash_seeded"],
)
def test_persistent_tier_warns_when_block_hashes_are_not_reproducible(
    model_config, tmp_path, monkeypatch, caplog, hash_algo, seed, warns
):
    """sha256 block hashes are reproducible across restarts without any
    setting; with xxhash and no PYTHONHASHSEED they are random per process,
    so a disk tier never hits after a restart: say so once, with the fix."""
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    vllm_config, kv_cache_config = make_configs(model_config, "llama", str(tmp_path), 4)
    vllm_config.cache_config.prefix_caching_hash_algo = hash_algo
    with caplog.at_level(logging.WARNING, logger="vllm.v1.kv_offload"):
        manager = TieringOffloadingSpec(vllm_config, kv_cache_config).get_manager()
        manager.shutdown()
    warnings = [
        r.getMessage() for r in caplog.records if "PYTHONHASHSEED" in r.getMessage()
    ]
    assert len(warnings) == (1 if warns else 0)
    if warns:
        assert "prefix_caching_hash_algo=xxhash" in warnings[0]
        assert "or use sha256" in warnings[0]


@pytest.mark.parametrize(
    "extra_config,match",
    [
        ({"store_threshold": 2}, "store_threshold"),
        ({"eviction_policy": "lfu"}, "'eviction_policy'.*'lru' or 'arc'"),
        (
            {
                "secondary_tiers": [
                    {"type": "fs_python", "root_dir": "ROOT"},
                    {"type": "no_such_tier"},
                ]
            },
            "no_such_tier",
        ),
    ],
    ids=["unsupported_store_threshold", "unknown_eviction_policy", "unknown_tier_type"],
)
def test_failed_get_manager_leaks_nothing(model_config, tmp_path, extra_config, match):
    """A configuration error is raised without leaving the CPU region in
    /dev/shm or the already created tiers' threads behind."""
    import threading

    for tier in extra_config.get("secondary_tiers", []):
        if tier.get("root_dir") == "ROOT":
            tier["root_dir"] = str(tmp_path / "fs")
    threads_before = set(threading.enumerate())
    with pytest.raises((ValueError, KeyError), match=match):
        vllm_config, kv_cache_config = make_configs(
            model_config, "llama", str(tmp_path), 4, extra_config
        )
        shm_path = f"/dev/shm/vllm_offload_{vllm_config.instance_id}.mmap"
        TieringOffloadingSpec(vllm_config, kv_cache_config).get_manager()
    assert not os.path.exists(shm_path)
    time.sleep(0.1)
    assert set(threading.enumerate()) <= threads_before


# ---------------------------------------------------------------------------
# Randomized sequences (hypothesis): every operation of the scheduler and of
# the disk, interleaved, with the invariants checked after each engine step
# ---------------------------------------------------------------------------

# HMA_SOAK_EXAMPLES=5000 runs a long randomized soak instead of the short,
# derandomized run that CI gets.
_SOAK_EXAMPLES = int(os.environ.get("HMA_SOAK_EXAMPLES", "0"))
# layouts of 1, 2, 3 and 4 KV cache groups
_RANDOM_LAYOUTS = ["llama", "gemma3", "gemma4", "qwen3_5"]
_RANDOM_HASHES = 4  # block hashes per layout: requests are prefixes of them
_RANDOM_CPU_BLOCKS = 8  # fewer than the keys of 4 groups: evictions happen
# A request left alone settles within this many engine steps (a promotion
# takes one step), and no CPU block stays in flight for longer.
_SETTLE_STEPS = 3


@pytest.mark.parametrize("budget_chunks", [None, 1], ids=["unbounded", "max_bytes"])
def test_random_sequences_keep_the_invariants(
    model_config, tmp_path, monkeypatch, budget_chunks
):
    """Random interleavings of lookup, load (prepare/complete), store
    (prepare/complete, failed GPU copies included), engine step ends,
    reset_cache, disk files removed or overwritten behind the tier's back and
    injected I/O errors of the fs tier's threads, over layouts of 1-4 KV cache
    groups, through the real TieringOffloadingManager, CPU primary tier and
    fs_python tier. After every engine step: every ref count is the number of
    transfers holding the block (never negative, never leaked), no slot is
    both used and free, every block in the CPU tier that is ready holds the
    bytes stored for its key (checked on every load too), no block stays in
    flight, no .tmp file is left once the tier's jobs finished; a request
    left alone settles within a few steps. With a max_bytes of one chunk
    (of every group): the tier's files never take more than max_bytes once
    its jobs finished, and at most one store job more while they run."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import (
        RuleBasedStateMachine,
        initialize,
        precondition,
        rule,
        run_state_machine_as_test,
    )

    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

    # injected I/O errors: the next n group batches read or written fail
    faults = {"budget": 0}

    def failing(io_fn):
        def wrapper(*args, **kwargs):
            if faults["budget"] > 0:
                faults["budget"] -= 1
                raise OSError(errno.EIO, "injected I/O error")
            return io_fn(*args, **kwargs)

        return wrapper

    store, load = fs_manager.store_group_files, fs_manager.load_group_files
    monkeypatch.setattr(fs_manager, "store_group_files", failing(store))
    monkeypatch.setattr(fs_manager, "load_group_files", failing(load))

    root_dir = str(tmp_path / "fs")
    tier_config = {
        "type": "fs_python",
        "root_dir": root_dir,
        "n_read_threads": 2,
        "n_write_threads": 2,
        # overwritten files must be caught: a ready block holds its bytes
        "checksum": "crc32c",
    }
    configs = {
        layout: make_configs(
            model_config,
            layout,
            root_dir,
            _RANDOM_CPU_BLOCKS,
            {"secondary_tiers": [tier_config]},
        )
        for layout in _RANDOM_LAYOUTS
    }
    max_bytes: dict[str, int] = {}
    if budget_chunks is not None:
        for layout in _RANDOM_LAYOUTS:
            # a file: at most a CPU row, and a page to spare
            row = TieringOffloadingSpec(*configs[layout]).cpu_page_size_per_worker
            max_bytes[layout] = (
                budget_chunks * len(GPU_BLOCK_SIZES[layout]) * (row + mmap.PAGESIZE)
            )
            configs[layout] = make_configs(
                model_config,
                layout,
                root_dir,
                _RANDOM_CPU_BLOCKS,
                {"secondary_tiers": [{**tier_config, "max_bytes": max_bytes[layout]}]},
            )
    counts = Counter()

    class TieringMachine(RuleBasedStateMachine):
        manager: TieringOffloadingManager | None = None

        @initialize(layout=st.sampled_from(_RANDOM_LAYOUTS))
        def start(self, layout: str) -> None:
            counts["sequences"] += 1
            faults["budget"] = 0
            shutil.rmtree(root_dir, ignore_errors=True)
            manager = TieringOffloadingSpec(*configs[layout]).get_manager()
            assert isinstance(manager, TieringOffloadingManager)
            self.manager = manager
            (self.tier,) = manager.secondary_tiers
            self.outstanding = 0  # fs tier jobs submitted, results not taken
            submit_load, submit_store = self.tier.submit_load, self.tier.submit_store
            get_finished = self.tier.get_finished

            def counted(submit):
                def wrapper(job):
                    self.outstanding += 1
                    submit(job)

                return wrapper

            def counted_finished():
                results = list(get_finished())
                self.outstanding -= len(results)
                return results

            self.tier.submit_load = counted(submit_load)
            self.tier.submit_store = counted(submit_store)
            self.tier.get_finished = counted_finished
            self.groups = len(GPU_BLOCK_SIZES[layout])
            self.max_bytes = max_bytes.get(layout)
            self.rows = cpu_rows(manager)
            self.hashes = [
                f"{layout}-blk{b}".encode().ljust(32, b"\0")
                for b in range(_RANDOM_HASHES)
            ]
            self.ready: dict[int, list[OffloadKey]] = {}  # lookups of the step
            self.loads: list[tuple[list[OffloadKey], ReqContext]] = []
            self.stores: list[tuple[list[OffloadKey], ReqContext, bool]] = []
            self.in_flight: dict[OffloadKey, int] = {}  # key -> steps in flight

        def keys(self, n: int) -> list[OffloadKey]:
            """The keys of request n: its first n blocks, every group."""
            return [
                make_offload_key(h, g)
                for h in self.hashes[:n]
                for g in range(self.groups)
            ]

        def ctx(self, n: int) -> ReqContext:
            return ReqContext(req_id=f"req{n}")

        def lookup_request(self, n: int) -> bool:
            """The connector's maximal prefix lookup; whether it deferred."""
            assert self.manager is not None
            hits, deferred = [], False
            for key in self.keys(n):
                result = self.manager.lookup(key, self.ctx(n))
                if result is None:
                    deferred = True
                elif not result:
                    break
                else:
                    hits.append(key)
            if not deferred:
                self.ready[n] = hits
            counts["lookups deferred" if deferred else "lookups settled"] += 1
            return deferred

        @precondition(lambda self: self.manager is not None)
        @rule(
            lookups=st.lists(
                st.tuples(st.integers(1, _RANDOM_HASHES), st.booleans()), max_size=3
            ),
            stores=st.lists(
                st.tuples(
                    st.integers(1, _RANDOM_HASHES),
                    st.sampled_from([True] * 7 + [False]),
                ),
                max_size=2,
            ),
        )
        def engine_step(
            self, lookups: list[tuple[int, bool]], stores: list[tuple[int, bool]]
        ) -> None:
            """One engine step as the connector drives it: requests looked up
            (each loading what was reported ready, or not), then the step's
            stores, then the step ends."""
            counts["rules"] += 1
            for n, load in lookups:
                if not self.lookup_request(n) and load and self.ready.get(n):
                    self.load(n)
            for n, success in stores:
                self.store(n, success)
            self.finish_step()

        def load(self, n: int) -> None:
            """CPU->GPU load of what the lookup of request n reported ready."""
            assert self.manager is not None
            keys = self.ready.pop(n)
            spec = self.manager.prepare_load(keys, self.ctx(n))
            assert isinstance(spec, CPULoadStoreSpec)
            for key, block_id in zip(keys, spec.block_ids):
                assert_holds(self.manager, key, self.rows[block_id])
            self.loads.append((keys, self.ctx(n)))
            counts["blocks loaded"] += len(keys)

        def store(self, n: int, success: bool) -> None:
            """GPU->CPU store of request n's blocks; the copy finishes (or
            fails) when the step ends."""
            assert self.manager is not None
            out = self.manager.prepare_store(self.keys(n), self.ctx(n))
            if out is None or not out.keys_to_store:
                return
            assert isinstance(out.store_spec, CPULoadStoreSpec)
            for key, block_id in zip(out.keys_to_store, out.store_spec.block_ids):
                self.rows[block_id] = (
                    block_bytes(key, self.rows.shape[1]) if success else 0xEE
                )
            self.stores.append((list(out.keys_to_store), self.ctx(n), success))

        @precondition(lambda self: self.manager is not None)
        @rule(n=st.integers(1, 4))
        def inject_io_errors(self, n: int) -> None:
            counts["rules"] += 1
            faults["budget"] = n

        @precondition(lambda self: self.manager is not None)
        @rule(data=st.data(), how=st.sampled_from(["remove", "overwrite", "root"]))
        def damage_file(self, data, how: str) -> None:
            """Remove a block file, overwrite it with another key's file, or
            remove the tier's whole root, behind the tier's back (another
            engine, an operator, a bad disk)."""
            counts["rules"] += 1
            if how == "root":
                shutil.rmtree(root_dir, ignore_errors=True)
                return
            files = sorted(
                os.path.join(d, f)
                for d, _, fs in os.walk(root_dir)
                for f in fs
                if f.endswith(".bin")
            )
            if not files:
                return
            path = data.draw(st.sampled_from(files))
            if how == "remove":
                os.remove(path)
                return
            other = data.draw(st.sampled_from(files))
            if other != path and os.path.getsize(other) == os.path.getsize(path):
                with open(other, "rb") as f:
                    content = f.read()
                with open(path, "r+b") as f:
                    f.write(content)

        @precondition(lambda self: self.manager is not None)
        @rule()
        def reset(self) -> None:
            """reset_cache(): the scheduler drops its in-flight GPU<->CPU
            jobs (never completes them) and starts over."""
            counts["rules"] += 1
            assert self.manager is not None
            self.manager.reset_cache()
            self.loads.clear()
            self.stores.clear()
            self.ready.clear()
            self.in_flight.clear()

        @precondition(lambda self: self.manager is not None)
        @rule(n=st.integers(1, _RANDOM_HASHES))
        def settle(self, n: int) -> None:
            """Request n alone, step after step: it is not deferred for more
            than _SETTLE_STEPS steps (e.g. by a block promoted, failed and
            promoted again forever)."""
            counts["rules"] += 1
            self.finish_step()
            for _ in range(_SETTLE_STEPS + 1):
                if not self.lookup_request(n):
                    break
                self.finish_step()
            else:
                raise AssertionError(
                    f"request {n} deferred for more than {_SETTLE_STEPS} steps"
                )
            self.finish_step()

        def finish_step(self) -> None:
            """The engine step ends: the GPU copies of the step finish, the
            step's events are taken, the fs tier's jobs run to completion;
            then the invariants are checked."""
            counts["steps"] += 1
            manager = self.manager
            assert manager is not None
            for keys, ctx in self.loads:
                manager.complete_load(keys, ctx)
            for keys, ctx, success in self.stores:
                manager.complete_store(keys, ctx, success)
            self.loads.clear()
            self.stores.clear()
            self.ready.clear()
            list(manager.take_events())
            deadline = time.monotonic() + _TIMEOUT_S
            while len(self.tier._pool._finished_q) < self.outstanding:
                assert time.monotonic() < deadline, "the fs tier's jobs did not finish"
                if self.max_bytes is not None:
                    # a store job writes at most every key of a request
                    job = (
                        _RANDOM_HASHES
                        * self.groups
                        * (self.max_bytes // (budget_chunks * self.groups))
                    )
                    assert self.disk_bytes() <= self.max_bytes + job
                time.sleep(0.001)
            self.check()

        def disk_bytes(self) -> int:
            """Bytes of the tier's block and temporary files (a file
            removed while walking counts as gone)."""
            total = 0
            for d, _, fs in os.walk(root_dir):
                for f in fs:
                    if f.endswith((".bin", ".tmp")):
                        with contextlib.suppress(FileNotFoundError):
                            total += os.path.getsize(os.path.join(d, f))
            return total

        def check(self) -> None:
            manager = self.manager
            assert manager is not None
            primary = manager.primary_tier
            blocks = dict(primary._policy.blocks)
            # transfers holding each block: the cascades (stores) in flight
            holders: Counter = Counter()
            promoting = set()
            for job in manager._transfer_jobs.values():
                if job.is_promotion:
                    promoting.update(job.keys)
                else:
                    holders.update(job.keys)
            for key, block in blocks.items():
                if key in promoting:
                    assert block.ref_cnt == -1, (key, block.ref_cnt)
                else:
                    assert block.ref_cnt == holders[key], (
                        f"ref_cnt {block.ref_cnt} of a block held by "
                        f"{holders[key]} transfers"
                    )
                if block.ref_cnt == -1:
                    self.in_flight[key] = self.in_flight.get(key, 0) + 1
                    assert self.in_flight[key] <= _SETTLE_STEPS, "stuck in flight"
                else:
                    self.in_flight.pop(key, None)
                    assert_holds(
                        self.manager,
                        key,
                        self.rows[block.block_id],
                        err_msg="a ready block does not hold its key's bytes",
                    )
            used = [b.block_id for b in blocks.values()]
            assert len(set(used)) == len(used), "a slot holds two blocks"
            free = set(primary._free_list)
            assert not free & set(used), "a used slot is also free"
            assert not free & set(manager._orphaned_slots), "an orphaned slot is free"
            files = [f for _, _, fs in os.walk(root_dir) for f in fs]
            tmp = [f for f in files if f.endswith(".tmp")]
            assert not tmp, f"temporary files left: {tmp}"
            if any(f.endswith(".bin") for f in files):
                config = self.tier.file_mapper.get_config_file_path()
                assert os.path.isfile(config), "blocks stored without config.json"
            if self.max_bytes is not None:
                used = self.disk_bytes()
                assert used <= self.max_bytes, f"{used} bytes > max_bytes"

        def teardown(self) -> None:
            manager = self.manager
            if manager is None:
                return
            try:
                # quiescence: every slot is back, nothing is held
                faults["budget"] = 0
                for _ in range(3):
                    self.finish_step()
                primary = manager.primary_tier
                assert not manager._transfer_jobs and not manager._orphaned_slots
                assert all(b.ref_cnt == 0 for b in primary._policy.blocks.values())
                assert (
                    len(primary._policy.blocks) + primary._get_num_free_blocks()
                    == _RANDOM_CPU_BLOCKS
                ), "slots leaked"
            finally:
                del self.rows  # the primary tier's buffer is unmapped
                manager.shutdown()
                if self.max_bytes is not None:
                    # once shut down: the budget thread's evictions too
                    counts["files evicted"] += self.tier._budget.evicted_files

    examples = _SOAK_EXAMPLES or 30
    run_state_machine_as_test(
        TieringMachine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=30,
            derandomize=not _SOAK_EXAMPLES,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    print(f"hypothesis {hypothesis.__version__}: {dict(counts)}")
    if budget_chunks is not None:
        assert counts["files evicted"], "the budget never evicted"
