# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fs tier's max_bytes budget reported as vLLM's KV offload metrics:
declared by the tiering spec, reported through the tiering manager's stats."""

import pytest

from tests.v1.kv_offload.tiering.test_fs_tier import (
    _page_aligned_zero_tensor,
    lookup_and_wait,
)
from tests.v1.kv_offload.tiering.test_fs_tier_max_bytes import (
    block_key,
    make_tier,
    page,
    store,
)
from tests.v1.kv_offload.tiering.test_tiering_offloading import _mock_mmap_region
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

USED_BYTES = "vllm:kv_offload_fs_budget_used_bytes"
MAX_BYTES = "vllm:kv_offload_fs_budget_max_bytes"
EVICTED_FILES = "vllm:kv_offload_fs_budget_evicted_files"
REJECTED_FILES = "vllm:kv_offload_fs_budget_rejected_files"


@pytest.fixture
def rows():
    return _page_aligned_zero_tensor(4, 1024)


def test_budget_metrics_are_declared_only_with_max_bytes(tmp_path):
    """The tiering spec declares the budget's gauges and counters, labeled
    by tier type, for an fs tier with max_bytes, and none without it."""
    tier = {"type": "fs", "root_dir": str(tmp_path)}
    metrics = TieringOffloadingSpec.build_metric_definitions(
        {"secondary_tiers": [{**tier, "max_bytes": 1 << 30}]}
    )
    for name, kind in (
        (USED_BYTES, OffloadingGaugeMetadata),
        (MAX_BYTES, OffloadingGaugeMetadata),
        (EVICTED_FILES, OffloadingCounterMetadata),
        (REJECTED_FILES, OffloadingCounterMetadata),
    ):
        assert isinstance(metrics[name], kind), name
        assert metrics[name].labelnames == ("tier_type",)
    unbounded = TieringOffloadingSpec.build_metric_definitions(
        {"secondary_tiers": [tier]}
    )
    assert not {USED_BYTES, MAX_BYTES, EVICTED_FILES, REJECTED_FILES} & set(unbounded)


def test_budget_is_reported_through_the_tiering_managers_stats(tmp_path, rows):
    """Bytes used and the budget (gauges), files evicted and rejected
    (counters: the increase since the previous report), labeled "fs"."""
    tier = make_tier(tmp_path, rows, max_bytes=2 * page)
    primary = CPUPrimaryTierOffloadingManager(4, _mock_mmap_region(4))
    manager = TieringOffloadingManager(primary, [tier], tier_poll_interval_s=0)
    a, b, c, d = (block_key(i) for i in range(4))

    def report() -> dict:
        stats = manager.get_stats()
        assert stats is not None
        data = stats.data["data"]
        names = (USED_BYTES, MAX_BYTES, EVICTED_FILES, REJECTED_FILES)
        return {name: data[name][("fs",)] for name in names}

    try:
        assert store(tier, [a], 0, rows)[0].success
        assert store(tier, [b], 10, rows)[0].success
        assert store(tier, [c], 20, rows)[0].success  # evicts a
        assert report() == {
            USED_BYTES: 2 * page,
            MAX_BYTES: 2 * page,
            EVICTED_FILES: 1,
            REJECTED_FILES: 0,
        }
        # b and c hit in this step: d finds no room
        assert lookup_and_wait(tier, [b, c]) == [LookupResult.HIT] * 2
        assert [r.success for r in store(tier, [d], 30, rows)] == [False]
        tier.on_schedule_end(ScheduleEndContext((), ()))
        assert report() == {
            USED_BYTES: 2 * page,
            MAX_BYTES: 2 * page,
            EVICTED_FILES: 0,
            REJECTED_FILES: 1,
        }
    finally:
        tier.shutdown()
