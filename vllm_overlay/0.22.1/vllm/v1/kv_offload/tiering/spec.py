# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
TieringOffloadingSpec: Spec for multi-tier KV cache offloading.

This spec creates a TieringOffloadingManager with a CPU primary tier
and configurable secondary tiers (e.g., Storage, Network).

Configuration via kv_connector_extra_config:
  - cpu_bytes_to_use: (required) Bytes to allocate for CPU primary tier
  - blocks_per_chunk: (optional) GPU blocks per offloaded block, the same
    for every KV cache group, whatever their block sizes (default: 1)
  - block_size: (optional) Tokens per offloaded block (default: GPU block
    size); only for models whose KV cache groups share one block size. Set
    at most one of blocks_per_chunk and block_size.
  - eviction_policy: (optional) Primary tier eviction policy: "lru" or
    "arc" (default: "lru")
  - secondary_tiers: (optional) List of secondary tier configurations
    Each secondary tier config is a dict with:
      - type: (required) Type of secondary tier (e.g., "example", "storage", "network")
      - Additional tier-specific parameters are passed directly to the tier
        constructor. See each tier's documentation for supported parameters.

Example configuration:
{
    "cpu_bytes_to_use": 10737418240,  # 10 GB
    "block_size": 16,
    "eviction_policy": "lru",
    "secondary_tiers": [
        {
            "type": "example",
            "custom_param": 67
        }
    ]
}
"""

import mmap
import os

import torch
from typing_extensions import override

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager
from vllm.v1.kv_offload.cpu.gpu_worker import CpuGpuOffloadingHandlers
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

logger = init_logger(__name__)


class TieringOffloadingSpec(CPUOffloadingSpec):
    """
    Spec for multi-tier KV cache offloading.

    Creates a TieringOffloadingManager with:
    - Primary tier: CPU (LRU or ARC eviction policy)
    - Secondary tiers: Configurable via extra_config

    The CPU primary tier has direct GPU access and serves as the gateway for
    all GPU↔offload operations. Secondary tiers cannot directly access GPU
    memory and must transfer data through the primary tier.
    """

    # Secondary tiers copy whole rows of the primary tier, e.g. with O_DIRECT,
    # which needs page-aligned buffers and lengths.
    BLOCK_SIZE_ALIGNMENT = mmap.PAGESIZE

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        super().__init__(
            vllm_config,
            kv_cache_config,
            block_size_alignment=self.BLOCK_SIZE_ALIGNMENT,
        )
        # Redeclare for mypy: parent sets this but `--follow-imports skip` hides it
        self._manager: OffloadingManager | None = None

        # Parse secondary tier configurations
        self.secondary_tier_configs = self.extra_config.get("secondary_tiers", [])
        if not isinstance(self.secondary_tier_configs, list):
            raise ValueError("secondary_tiers must be a list of tier configurations")

        # Checked here, before get_manager() allocates the CPU region and tiers.
        store_threshold = self.extra_config.get("store_threshold", 0)
        if str(store_threshold) not in ("0", "1"):
            raise ValueError(
                "store_threshold is not supported for TieringOffloadingSpec, "
                f"got store_threshold={store_threshold!r}; remove it from "
                "kv_connector_extra_config, or set it to 0 or 1."
            )
        if self.eviction_policy not in ("lru", "arc"):
            raise ValueError(
                "'eviction_policy' in kv_connector_extra_config must be 'lru' "
                f"or 'arc', got {self.eviction_policy!r}."
            )

        # Scheduler-side mmap (rank=None); kept for cleanup
        self._scheduler_mmap: SharedOffloadRegion | None = None

    @override
    def get_manager(self) -> OffloadingManager:
        """
        Get the TieringOffloadingManager.

        Creates a TieringOffloadingManager with:
        - Primary tier: CPU (LRU or ARC)
        - Secondary tiers: As configured in extra_config

        Returns:
            TieringOffloadingManager instance
        """
        if not self._manager:
            kv_events_config = self.vllm_config.kv_events_config
            enable_events = (
                kv_events_config is not None and kv_events_config.enable_kv_cache_events
            )

            # Create scheduler-side SharedOffloadRegion (rank=None) so the
            # primary tier can eagerly create a memoryview over _base.
            world_size = self.vllm_config.parallel_config.world_size
            scheduler_mmap = SharedOffloadRegion(
                instance_id=self.vllm_config.instance_id,
                total_size_bytes=self.cpu_page_size_per_worker
                * world_size
                * self.num_blocks,
                num_blocks=self.num_blocks,
                rank=None,
                num_workers=world_size,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._scheduler_mmap = scheduler_mmap

            primary_tier: CPUPrimaryTierOffloadingManager | None = None
            secondary_tiers: list[SecondaryTierManager] = []
            try:
                # Create primary tier (CPU-based)
                primary_tier = CPUPrimaryTierOffloadingManager(
                    num_blocks=self.num_blocks,
                    cache_policy=self.eviction_policy,  # type: ignore[arg-type]
                    enable_events=enable_events,
                    mmap_region=scheduler_mmap,
                )

                # Create secondary tiers
                primary_kv_view = primary_tier.get_kv_memoryview()
                for i, tier_config in enumerate(self.secondary_tier_configs):
                    try:
                        tier = SecondaryTierFactory.create_secondary_tier(
                            tier_config, primary_kv_view, self
                        )
                    except Exception as e:
                        logger.error(
                            "Failed to create secondary tier from config %s: %s",
                            tier_config,
                            e,
                        )
                        raise
                    secondary_tiers.append(tier)
                    logger.info(
                        "Created secondary tier #%d (%s)",
                        i,
                        tier.tier_type,
                    )
            except BaseException:
                # Release what was created: the tiers' threads, the primary
                # tier's view and the /dev/shm region.
                for created in secondary_tiers:
                    created.shutdown()
                if primary_tier is not None:
                    primary_tier.shutdown()
                else:
                    scheduler_mmap.cleanup()
                self._scheduler_mmap = None
                raise

            persistent = [t.tier_type for t in secondary_tiers if t.persistent]
            hash_algo = self.vllm_config.cache_config.prefix_caching_hash_algo
            if (
                persistent
                and hash_algo.startswith("xxhash")
                and os.getenv("PYTHONHASHSEED") is None
            ):
                # init_none_hash() then seeds block hashes randomly per process
                logger.warning(
                    "Secondary tier(s) %s keep KV cache blocks across "
                    "restarts, but with prefix_caching_hash_algo=%s and no "
                    "PYTHONHASHSEED, block hashes are seeded randomly per "
                    "process: after a restart no stored block is ever hit. Set "
                    "PYTHONHASHSEED to the same value for every vLLM process "
                    "that shares these tiers, or use sha256.",
                    persistent,
                    hash_algo,
                )

            # Create TieringOffloadingManager. GPU↔CPU transfers use the inherited
            # get_handlers(); secondary tier transfers are handled by the
            # secondary tier managers and need no additional handlers here.
            tiering_manager = TieringOffloadingManager(
                primary_tier=primary_tier,
                secondary_tiers=secondary_tiers,
                enable_events=enable_events,
            )
            self._manager = tiering_manager

            logger.info(
                "Created TieringOffloadingManager with primary tier "
                "(%s, %s blocks) and %s secondary tier(s)",
                self.eviction_policy,
                self.num_blocks,
                len(secondary_tiers),
            )

        return self._manager

    @override
    def create_handlers(self, kv_caches: CanonicalKVCaches) -> CpuGpuOffloadingHandlers:
        world_size = self.vllm_config.parallel_config.world_size
        if self.secondary_tier_configs and world_size > 1:
            _reject_workers_across_nodes()
        rank = torch.accelerator.current_device_index()
        worker_mmap = SharedOffloadRegion(
            instance_id=self.vllm_config.instance_id,
            total_size_bytes=self.cpu_page_size_per_worker
            * world_size
            * self.num_blocks,
            num_blocks=self.num_blocks,
            rank=rank,
            num_workers=world_size,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        return CpuGpuOffloadingHandlers(
            kv_caches=kv_caches,
            block_size_factor=self.block_size_factor,
            num_cpu_blocks=self.num_blocks,
            mmap_region=worker_mmap,
        )


def _reject_workers_across_nodes() -> None:
    """Reject secondary tiers on an engine whose workers span nodes (as
    upstream #54415 does). Secondary tiers run in the engine core and read
    only its node's CPU region, which lacks the slots of workers on other
    nodes: they would store and serve those slots as zeros. An engine's
    workers form a grid of TP, PP and PCP groups, so they share one node if
    every such group does. Collective over each group."""
    from vllm.distributed.parallel_state import (
        get_pcp_group,
        get_pp_group,
        get_tp_group,
        in_the_same_node_as,
    )

    # Every rank must join every collective before any of them raises.
    spans = [
        group.world_size > 1
        and not all(in_the_same_node_as(group.cpu_group, source_rank=0))
        for group in (get_tp_group(), get_pp_group(), get_pcp_group())
    ]
    if any(spans):
        raise NotImplementedError(
            "TieringOffloadingSpec secondary tiers are not supported on "
            "engines whose workers span several nodes: remove secondary_tiers "
            "from kv_connector_extra_config, or run one engine per node "
            "(replicas) sharing the tier's root_dir."
        )
