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

import json
import logging
import mmap
import os
import time
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
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
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
    factor = int(kv_connector_extra_config.get("blocks_per_chunk", 1))
    if "block_size" in kv_connector_extra_config:
        factor = int(kv_connector_extra_config["block_size"]) // 16
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
        np.testing.assert_array_equal(rows[block_id], block_bytes(key, rows.shape[1]))
    manager.complete_load(keys, ctx)
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
        ("llama", {"blocks_per_chunk": 0}, "blocks_per_chunk"),
        ("llama", {"blocks_per_chunk": 2, "block_size": 32}, "only one"),
        ("mamba_no_align", {}, r"\(1024, 16\).*enable-prefix-caching"),
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
    and every group's real KV cache spec."""
    vllm_config, kv_cache_config = make_configs(
        model_config, layout, str(tmp_path), cpu_blocks=4
    )
    spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    run_config = FileMapper.from_offloading_spec(str(tmp_path), spec).get_run_config()
    assert run_config["hash_block_size"] == spec.hash_block_size
    assert [g["kv_cache_spec"] for g in run_config["kv_cache_groups"]] == [
        repr(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups
    ]


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


@pytest.mark.parametrize("layout", ["odd_rows", "gemma3"])
def test_fs_tier_io_mode_logged_once(model_config, tmp_path, caplog, layout):
    """Any KV layout gets page-aligned primary rows, so the fs tier uses
    O_DIRECT where the filesystem supports it, and says once at start which
    I/O mode it uses and why."""
    root_dir = str(tmp_path / "fs")
    vllm_config, kv_cache_config = make_configs(model_config, layout, root_dir, 8)
    spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    assert spec.cpu_page_size_per_worker % mmap.PAGESIZE == 0
    with caplog.at_level(logging.INFO, logger="vllm.v1.kv_offload.tiering.fs"):
        manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    try:
        store(manager, request_keys(0, 4, 2), ReqContext(req_id="req0"))
    finally:
        manager.shutdown()
    messages = [r.getMessage() for r in caplog.records if "I/O for" in r.getMessage()]
    assert len(messages) == 1, messages
    assert "using O_DIRECT I/O" in messages[0] or "because" in messages[0]


def test_fs_tier_buffered_fallback_for_unaligned_rows(model_config, tmp_path, caplog):
    """A primary tier whose rows are not aligned (1280-byte rows, as an
    unpadded mamba or odd-head-size layout gives) still round-trips: the fs
    tier falls back to buffered I/O instead of failing every job."""
    from vllm.v1.kv_offload.tiering.base import JobMetadata
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    vllm_config, kv_cache_config = make_configs(
        model_config, "odd_rows", str(tmp_path), 8
    )
    spec = TieringOffloadingSpec(vllm_config, kv_cache_config)
    rows = np.zeros((8, 1280), dtype=np.uint8)
    keys = request_keys(0, 4, 2)

    def run(job: JobMetadata, tier: FileSystemTierManager) -> bool:
        (tier.submit_load if job.is_promotion else tier.submit_store)(job)
        deadline = time.monotonic() + _TIMEOUT_S
        while time.monotonic() < deadline:
            results = list(tier.get_finished())
            if results:
                return results[0].success
            time.sleep(0.005)
        raise AssertionError("timed out")

    def job(job_id: int, is_promotion: bool) -> JobMetadata:
        return JobMetadata(
            job_id=job_id,
            keys=keys,
            block_ids=np.arange(len(keys), dtype=np.int64),
            is_promotion=is_promotion,
            req_context=ReqContext(req_id="req0"),
        )

    for i, key in enumerate(keys):
        rows[i] = block_bytes(key, 1280)
    with caplog.at_level(logging.INFO, logger="vllm.v1.kv_offload.tiering.fs"):
        tier = FileSystemTierManager(
            spec, memoryview(rows), "fs_python", str(tmp_path / "fs"), 1, 1
        )
    try:
        assert run(job(0, is_promotion=False), tier)
        rows[:] = 0
        assert run(job(1, is_promotion=True), tier)
    finally:
        tier.shutdown()
    for i, key in enumerate(keys):
        np.testing.assert_array_equal(rows[i], block_bytes(key, 1280))
    assert "using buffered I/O" in caplog.text
