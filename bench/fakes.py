"""A duck-typed OffloadingSpec: the attributes the connector scheduler, the tiering managers
and FileMapper read, in pristine 0.22.1 and in the patched tree (which adds per-group
offloaded_block_size and hash_blocks_per_offloaded_block). Building a real spec needs a model
config, and pristine TieringOffloadingSpec.get_manager refuses more than one KV cache group."""

from types import SimpleNamespace

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec

BLOCK_SIZE = 16  # tokens per GPU block = per offloaded block (no chunking)


def fake_spec(num_groups: int, manager=None, model: str = "bench/model") -> SimpleNamespace:
    groups = [
        SimpleNamespace(
            kv_cache_spec=FullAttentionSpec(
                block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float16
            ),
            layer_names=[f"model.layers.{g}.attn"],
        )
        for g in range(num_groups)
    ]
    parallel = SimpleNamespace(
        world_size=1,
        rank=0,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        prefill_context_parallel_size=1,
        decode_context_parallel_size=1,
    )
    vllm_config = SimpleNamespace(
        parallel_config=parallel,
        cache_config=SimpleNamespace(
            enable_prefix_caching=True, block_size=BLOCK_SIZE, cache_dtype="auto"
        ),
        # what the fs tier's kv_values record reads (patch 0048)
        model_config=SimpleNamespace(
            model=model, revision=None, hf_config={}, dtype="float16", quantization=None
        ),
    )
    return SimpleNamespace(
        vllm_config=vllm_config,
        kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
        gpu_block_size=(BLOCK_SIZE,) * num_groups,
        hash_block_size=BLOCK_SIZE,
        block_size_factor=1,
        offloaded_block_size=(BLOCK_SIZE,) * num_groups,
        hash_blocks_per_offloaded_block=(1,) * num_groups,
        get_manager=lambda: manager,
    )


def fake_spec_upstream(model: str = "bench/model", num_groups: int = 0):
    """The spec the 0.34.0 track's fs tier reads (spec.config, blocks_per_chunk,
    kv_events_config), one worker, no KV events: as its own tests build it, with
    num_groups full-attention KV cache groups of BLOCK_SIZE-token chunks."""
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    config = OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(tokens_per_block=BLOCK_SIZE, layer_names=(f"l{g}",), group_id=g)
            for g in range(num_groups)
        ),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="bench-engine",
        model=OffloadingModelConfig(name=model, dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_SIZE, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        replicated_layout=False,
    )
    return SimpleNamespace(
        config=config,
        blocks_per_chunk=1,
        kv_events_config=OffloadingKVEventsConfig(
            enable_kv_cache_events=False, self_describing_kv_events=False
        ),
    )
