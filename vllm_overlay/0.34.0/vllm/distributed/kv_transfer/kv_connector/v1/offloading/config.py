# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Translate vLLM KV cache metadata for native offloading backends."""

from typing import TYPE_CHECKING

from vllm.utils.math_utils import cdiv, round_up
from vllm.v1.core.kv_cache_utils import (
    resolve_dcp_kv_block_size,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupRole,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
)
from vllm.v1.kv_offload.config import (
    OffloadingBlockLayout,
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.kv_values import KVValuesSource

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec


def get_offloading_group_ids(kv_cache_config: "KVCacheConfig") -> tuple[int, ...]:
    if kv_cache_config.hisparse_host_num_blocks is None:
        return kv_cache_config.prefix_cacheable_group_ids
    return tuple(
        group_id
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        if group.role is KVCacheGroupRole.HISPARSE_INDEXER
    )


def _group_kv_bytes_per_block(group: "KVCacheGroupSpec") -> int:
    """Return the physical bytes occupied by one block of a cache group.

    Worker configs may retain ``UniformTypeKVCacheSpecs`` while scheduler
    configs flatten that wrapper to one representative per-layer spec.  Keep
    the result invariant across those two representations.
    """
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.page_size_bytes
    return spec.page_size_bytes * len(group.layer_names)


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def describe_block_layout(spec: KVCacheSpec) -> OffloadingBlockLayout:
    """The fields that determine how one layer's block of ``spec`` is laid out
    in bytes (see OffloadingBlockLayout)."""
    if isinstance(spec, MambaSpec):
        return OffloadingBlockLayout(
            kind="mamba",
            dtypes=tuple(_dtype_name(d) for d in spec.dtypes),
            shapes=tuple(tuple(shape) for shape in spec.shapes),
            page_size_bytes=spec.page_size_bytes,
            # Where each state starts within the page.
            variant=(f"state_alignment={spec.state_alignment}",),
        )
    if isinstance(spec, AttentionSpec):
        # Full, sliding window and chunked local attention store the same
        # bytes per block.
        kind = "attention"
        variant: tuple[str, ...] = (spec.kv_quant_mode.name,)
        if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
            kind = "mla_attention"
            variant += (str(spec.cache_dtype_str), str(spec.model_version))
        return OffloadingBlockLayout(
            kind=kind,
            dtypes=(_dtype_name(spec.dtype),),
            shapes=((spec.head_size, spec.head_size_v),),
            page_size_bytes=spec.page_size_bytes,
            num_kv_heads=spec.num_kv_heads,
            variant=variant,
        )
    raise ValueError(
        f"KV offloading supports attention and mamba KV cache groups, not "
        f"{type(spec).__name__}."
    )


def get_sliding_window_size_in_chunks(
    kv_cache_spec: KVCacheSpec, tokens_per_chunk: int
) -> int | None:
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        assert kv_cache_spec.sliding_window > 0
        return max(
            cdiv(kv_cache_spec.sliding_window, tokens_per_chunk),
            cdiv(
                kv_cache_spec.sliding_window - 1 + kv_cache_spec.extra_retained_tokens,
                tokens_per_chunk,
            ),
        )

    if isinstance(kv_cache_spec, ChunkedLocalAttentionSpec):
        # Attention never reaches back past one chunk
        assert kv_cache_spec.attention_chunk_size > 0
        return cdiv(kv_cache_spec.attention_chunk_size, tokens_per_chunk)

    if isinstance(kv_cache_spec, MambaSpec):
        # Mamba depends on a single state
        return 1

    assert isinstance(kv_cache_spec, FullAttentionSpec)
    return None


def build_offloading_config(
    vllm_config: "VllmConfig",
    kv_cache_config: "KVCacheConfig",
) -> OffloadingConfig:
    """Translate vLLM configuration into the native offloading boundary."""
    kv_transfer_config = vllm_config.kv_transfer_config
    assert kv_transfer_config is not None
    extra_config = kv_transfer_config.kv_connector_extra_config
    assert kv_transfer_config.engine_id is not None
    engine_id = kv_transfer_config.engine_id

    parallel_config = vllm_config.parallel_config
    selected_groups = tuple(
        (group_id, kv_cache_config.kv_cache_groups[group_id])
        for group_id in get_offloading_group_ids(kv_cache_config)
    )
    if not selected_groups:
        raise ValueError("KV offloading found no eligible cache groups.")

    group_tokens_per_block = tuple(
        resolve_dcp_kv_block_size(
            group.kv_cache_spec, parallel_config.decode_context_parallel_size
        )
        for _, group in selected_groups
    )
    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    for tokens_per_block in group_tokens_per_block:
        assert tokens_per_block % tokens_per_hash == 0, (
            f"tokens_per_block={tokens_per_block} not divisible by "
            f"tokens_per_hash={tokens_per_hash}. "
            f"Hybrid models (e.g. Mamba+Attention) need "
            f"--enable-prefix-caching to align block sizes."
        )

    blocks_per_chunk = 1
    blocks_per_chunk_config = extra_config.get("blocks_per_chunk")
    tokens_per_chunk = extra_config.get("block_size")

    if blocks_per_chunk_config is not None and tokens_per_chunk is not None:
        raise ValueError(
            "Specify only one of 'block_size' or 'blocks_per_chunk' "
            "in kv_connector_extra_config."
        )

    if blocks_per_chunk_config is not None:
        blocks_per_chunk = int(blocks_per_chunk_config)

        if blocks_per_chunk <= 0:
            raise ValueError("'blocks_per_chunk' must be greater than 0.")

    elif tokens_per_chunk is not None:
        tokens_per_chunk_int = int(tokens_per_chunk)

        unique_tokens_per_block = set(group_tokens_per_block)

        assert len(unique_tokens_per_block) == 1, (
            "If 'block_size' is specified in kv_connector_extra_config, "
            "there must be at least one KV cache group, "
            "and all groups must have the same block size."
        )

        tokens_per_block = unique_tokens_per_block.pop()
        if tokens_per_chunk_int % tokens_per_block == 0:
            blocks_per_chunk = tokens_per_chunk_int // tokens_per_block
        else:
            raise ValueError(
                f"'block_size'={tokens_per_chunk_int} in kv_connector_extra_config "
                f"must be a multiple of the GPU KV cache block size "
                f"({tokens_per_block} tokens). Use "
                f"{round_up(tokens_per_chunk_int, tokens_per_block)} instead, or set "
                f"'blocks_per_chunk' to express the chunk size in blocks."
            )

    groups = tuple(
        OffloadingGroupConfig(
            group_id=group_id,
            tokens_per_block=tokens_per_block,
            layer_names=tuple(group.layer_names),
            sliding_window_size_in_chunks=get_sliding_window_size_in_chunks(
                next(iter(iter_layer_specs(group.kv_cache_spec))),
                tokens_per_block * blocks_per_chunk,
            ),
            kv_bytes_per_block=_group_kv_bytes_per_block(group),
            # The first layer's spec: the one scheduler configs keep of a
            # UniformTypeKVCacheSpecs group, so workers and scheduler agree;
            # kv_bytes_per_block covers the group's other layers.
            block_layout=describe_block_layout(
                next(iter(iter_layer_specs(group.kv_cache_spec)))
            ),
        )
        for (group_id, group), tokens_per_block in zip(
            selected_groups, group_tokens_per_block
        )
    )

    worker_kv_bytes_per_block = 0
    if (
        kv_cache_config.hisparse_host_num_blocks is None
        and kv_cache_config.num_blocks > 0
        and kv_cache_config.kv_cache_tensors
    ):
        # Scratch filtering must preserve the scheduler/worker allocation stride.
        # Every KVCacheTensor describes placement within the same backing allocation,
        # so its size is the total, not a per-tensor share.
        total_gpu_kv_bytes = kv_cache_config.kv_cache_tensors[0].size
        worker_kv_bytes_per_block = total_gpu_kv_bytes // kv_cache_config.num_blocks
    elif kv_cache_config.num_blocks > 0:
        worker_kv_bytes_per_block = sum(
            _group_kv_bytes_per_block(group) for _, group in selected_groups
        )

    replicated_layout = (
        vllm_config.model_config.use_mla
        and parallel_config.tensor_parallel_size > 1
        and kv_cache_config.kv_tp_replicas == parallel_config.tensor_parallel_size
        and worker_kv_bytes_per_block > 0
        # Safe MVP boundary: TP-only, no other parallel axes.
        and parallel_config.pipeline_parallel_size == 1
        and parallel_config.prefill_context_parallel_size == 1
        and parallel_config.decode_context_parallel_size == 1
        and parallel_config.world_size == parallel_config.tensor_parallel_size
        # Shared /dev/shm mmap layout is single-node mp only.
        and parallel_config.distributed_executor_backend == "mp"
        and parallel_config.nnodes_within_dp == 1
    )

    canonical_layout = bool(extra_config.get("canonical_layout", False))

    # Only canonical pages can be parallelism-invariant: they are
    # topology-free, so every config whose mappings derive portable, group by
    # group, qualifies; certification happens per layer at registration and
    # create_worker fails closed on this flag.
    is_parallelism_agnostic = False
    if canonical_layout:
        tp_size = parallel_config.tensor_parallel_size
        total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()

        def spec_certifiable(spec: KVCacheSpec) -> bool:
            """Conservative static mirror of _layer_mapping's per-layer checks."""
            if not isinstance(spec, AttentionSpec):
                return False
            if spec.kv_quant_mode.is_per_token_head:
                return False
            if type(spec) is MLAAttentionSpec:
                return (
                    spec.tokens_per_state == 1
                    and spec.real_page_size_bytes % spec.block_size == 0
                )
            if isinstance(spec, (SlidingWindowMLASpec, MLAAttentionSpec)):
                return False
            if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
                return False
            return (
                total_kv_heads % tp_size == 0 or tp_size % total_kv_heads == 0
            ) and spec.num_kv_heads == max(1, total_kv_heads // tp_size)

        # UniformTypeKVCacheSpecs groups (e.g. MLA plus its DSA indexer) hold
        # one spec per layer; certify per layer, as the mapping derivation does.
        layer_specs = [
            spec
            for group in kv_cache_config.kv_cache_groups
            for spec in iter_layer_specs(group.kv_cache_spec)
        ]
        is_parallelism_agnostic = (
            len(layer_specs) > 0
            and all(spec_certifiable(spec) for spec in layer_specs)
            and parallel_config.decode_context_parallel_size == 1
            and parallel_config.prefill_context_parallel_size == 1
            and parallel_config.world_size == tp_size
        )

    if canonical_layout:
        replicated_layout = (
            is_parallelism_agnostic
            and all(
                type(spec) is MLAAttentionSpec
                for _, group in selected_groups
                for spec in iter_layer_specs(group.kv_cache_spec)
            )
            and parallel_config.nnodes_within_dp == 1
            and (
                parallel_config.world_size == 1
                or parallel_config.distributed_executor_backend == "mp"
            )
        )

    kv_events_config = vllm_config.kv_events_config
    cache_dtype = (
        vllm_config.model_config.dtype
        if vllm_config.cache_config.cache_dtype == "auto"
        else vllm_config.cache_config.cache_dtype
    )

    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=(
            kv_events_config is not None and kv_events_config.enable_kv_cache_events
        ),
        extra_config=extra_config,
        engine_id=engine_id,
        model=OffloadingModelConfig(
            name=vllm_config.model_config.model,
            dtype=str(cache_dtype).removeprefix("torch."),
            max_model_len=vllm_config.model_config.max_model_len,
            kv_values_source=KVValuesSource.from_vllm_config(vllm_config),
        ),
        cache=OffloadingCacheConfig(
            tokens_per_hash=tokens_per_hash,
            blocks_per_chunk=blocks_per_chunk,
        ),
        parallel=OffloadingParallelConfig(
            rank=parallel_config.rank,
            world_size=parallel_config.world_size,
            tp_size=parallel_config.tensor_parallel_size,
            pp_size=parallel_config.pipeline_parallel_size,
            pcp_size=parallel_config.prefill_context_parallel_size,
            dcp_size=parallel_config.decode_context_parallel_size,
            data_parallel_index=parallel_config.data_parallel_index,
            data_parallel_size=parallel_config.data_parallel_size,
            data_parallel_rank_local=parallel_config.data_parallel_rank_local,
            is_parallelism_agnostic=is_parallelism_agnostic,
        ),
        replicated_layout=replicated_layout,
        canonical_layout=canonical_layout,
        kv_cache_layout=vllm_config.cache_config.kv_cache_layout,
    )
