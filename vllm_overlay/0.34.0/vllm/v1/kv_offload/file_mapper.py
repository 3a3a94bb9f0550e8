# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

import hashlib
import json
from collections.abc import Callable

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
    canonical_format_id,
)
from vllm.v1.kv_offload import kv_values
from vllm.v1.kv_offload.base import (
    OffloadingSpec,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.config import OffloadingGroupConfig

_BASE_PATH_HASH_LEN = 12
_CONFIG_FILENAME = "config.json"


def _describe_group(group: OffloadingGroupConfig, parallel_agnostic: bool) -> dict:
    """A group's hashed fields: its block size and layers and, when known, how
    its blocks are laid out in bytes, so that blocks written under one layout
    are never read under another. Unknown layout fields (hand-built configs)
    are left out, so such configs keep their storage paths.

    A parallel-agnostic namespace is shared across TP sizes, so it leaves out
    the sizes of one worker's shard (KV heads, bytes per block): there the
    model fixes the total head count.
    """
    fields: dict = {
        "tokens_per_block": group.tokens_per_block,
        "layer_names": list(group.layer_names),
    }
    if group.kv_bytes_per_block and not parallel_agnostic:
        fields["kv_bytes_per_block"] = group.kv_bytes_per_block
    layout = group.block_layout
    if layout is not None:
        fields["block_layout"] = {
            "kind": layout.kind,
            "dtypes": list(layout.dtypes),
            "shapes": [list(shape) for shape in layout.shapes],
            "variant": list(layout.variant),
        }
        if not parallel_agnostic:
            fields["block_layout"]["page_size_bytes"] = layout.page_size_bytes
            fields["block_layout"]["num_kv_heads"] = layout.num_kv_heads
    return fields


class FileMapper:
    """FileMapper maps KV blocks (given by their hash) to file names."""

    def __init__(
        self,
        root_dir: str,
        model_name: str,
        tokens_per_hash: int,
        blocks_per_file: int,
        tp_size: int,
        pp_size: int,
        pcp_size: int,
        dcp_size: int,
        rank: int,
        dtype: str,
        kv_cache_groups: list[dict] | None = None,
        model_values: dict | None = None,
        inference_engine: str = "vllm",
        parallel_agnostic: bool = False,
        replicated_layout: bool = False,
        canonical_format: str | None = None,
        keyed_namespace: dict | None = None,
        file_stem: Callable[[bytes], str] | None = None,
    ):
        """Initialize the file mapper. Each worker constructs its own, but
        `config.json` is shared across workers since rank lives outside the hash.
        When `parallel_agnostic=True`, tp/pp/pcp/dcp are forced to 1 and rank
        to 0 so multiple parallelism layouts collapse into the same folder.
        A `keyed_namespace` (how its files are named and checked, never the
        key) gives keyed files their own folder, apart from unkeyed ones;
        `file_stem` maps a block hash to its files' name (default: its hex),
        e.g. a keyed hash, so that names cannot be computed from the prefix.
        """
        if parallel_agnostic:
            tp_size = pp_size = pcp_size = dcp_size = 1
            rank = 0
        self.rank: int = rank
        self.fields: dict = {
            "model_name": model_name,
            "tokens_per_hash": tokens_per_hash,
            "blocks_per_file": blocks_per_file,
            "tp_size": tp_size,
            "pp_size": pp_size,
            "pcp_size": pcp_size,
            "dcp_size": dcp_size,
            "dtype": str(dtype),
            "kv_cache_groups": kv_cache_groups or [],
            "inference_engine": inference_engine,
        }
        # What the model's K/V values depend on (kv_values.py): a model
        # changed at the same path gets its own folder.
        if model_values is not None:
            self.fields["kv_values"] = model_values
        if not parallel_agnostic:
            self.fields["parallel_agnostic"] = False
        # Only written when True so existing deployments' hashed fields are
        # unchanged (False is the historical default and must not appear).
        if replicated_layout:
            self.fields["replicated_layout"] = True
        # The canonical byte format is not interchangeable with the direct
        # layout (or with other canonical format versions/families), so its
        # identity participates in the storage namespace.
        if canonical_format is not None:
            self.fields["canonical_format"] = canonical_format
        if keyed_namespace is not None:
            self.fields["keyed_namespace"] = keyed_namespace
        self.base_path: str = self._compute_base_path(root_dir, self.fields)
        self._file_stem = file_stem

    @classmethod
    def from_offloading_spec(
        cls,
        root_dir: str,
        offloading_spec: OffloadingSpec,
        blocks_per_file: int = 1,
        parallel_agnostic: bool = False,
        keyed_namespace: dict | None = None,
        file_stem: Callable[[bytes], str] | None = None,
    ) -> "FileMapper":
        """Build a FileMapper from an OffloadingSpec."""
        config = offloading_spec.config
        parallel = config.parallel
        parallel_agnostic = parallel_agnostic and (
            parallel.is_parallelism_agnostic or config.replicated_layout
        )
        kv_cache_groups = [
            _describe_group(group, parallel_agnostic) for group in config.groups
        ]
        canonical_format = None
        if config.canonical_layout:
            assert config.kv_cache_layout is not None
            canonical_format = canonical_format_id(config.kv_cache_layout)
        # What the model's K/V values depend on: read here, where a persistent
        # tier starts, not where every connector builds its config.
        source = config.model.kv_values_source
        model_values = None if source is None else kv_values.describe_kv_values(source)
        return cls(
            root_dir=root_dir,
            model_name=config.model.name,
            tokens_per_hash=config.cache.tokens_per_hash,
            blocks_per_file=blocks_per_file,
            tp_size=parallel.tp_size,
            pp_size=parallel.pp_size,
            pcp_size=parallel.pcp_size,
            dcp_size=parallel.dcp_size,
            rank=parallel.rank,
            dtype=config.model.dtype,
            model_values=model_values,
            kv_cache_groups=kv_cache_groups,
            parallel_agnostic=parallel_agnostic,
            replicated_layout=(parallel_agnostic and config.replicated_layout),
            canonical_format=canonical_format,
            keyed_namespace=keyed_namespace,
            file_stem=file_stem,
        )

    def get_file_name(self, key: OffloadKey) -> str:
        """Map an OffloadKey to <base>_r<rank>/<hhh>/<hh>_g<group_idx>/<hash>.bin."""
        block_hash = get_offload_block_hash(key)
        if self._file_stem is None:
            hash_hex = block_hash.hex()
        else:
            hash_hex = self._file_stem(block_hash)
        return self.get_stem_file_name(hash_hex, get_offload_group_idx(key))

    def get_stem_file_name(self, hash_hex: str, group_idx: int) -> str:
        """The file of a file-name stem (what get_file_name() names a block
        hash's files by) and a group, e.g. for a file found on disk."""
        subfolder1, subfolder2 = hash_hex[:3], hash_hex[3:5]
        return (
            f"{self.base_path}_r{self.rank}"
            f"/{subfolder1}/{subfolder2}_g{group_idx}/{hash_hex}.bin"
        )

    def get_run_config(self) -> dict:
        return dict(self.fields)

    def layout_id(self) -> str:
        """The sha256 of the fields (what base_path's digest abbreviates) and
        the rank: identifies the layout of this rank's files."""
        canonical = json.dumps(self.fields, sort_keys=True, separators=(",", ":"))
        return f"{hashlib.sha256(canonical.encode()).hexdigest()}_r{self.rank}"

    def get_config_file_path(self) -> str:
        return f"{self.base_path}/{_CONFIG_FILENAME}"

    @staticmethod
    def _compute_base_path(root_dir: str, fields: dict) -> str:
        """Layout: <root_dir>/<safe_model_name>_<sha256-prefix>/.
        safe_model_name replaces '/' with '_' so HuggingFace IDs don't nest.
        """
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()[
            :_BASE_PATH_HASH_LEN
        ]
        safe_model_name = fields["model_name"].replace("/", "_")
        return f"{root_dir}/{safe_model_name}_{digest}"
