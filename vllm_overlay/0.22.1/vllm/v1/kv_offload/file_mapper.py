# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

import hashlib
import json
from collections.abc import Callable

from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)
from vllm.v1.kv_offload.base import (
    OffloadingSpec,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.kv_values import KVValuesSource, describe_kv_values

_BASE_PATH_HASH_LEN = 12
_CONFIG_FILENAME = "config.json"

# Version of describe_block_layout()'s fields. Bump it when a field is added
# or changes meaning: the fields are hashed into the directory name, so that
# files written under one block layout are never read under another.
BLOCK_LAYOUT_VERSION = 1


def describe_block_layout(spec: KVCacheSpec) -> dict:
    """The fields that determine how a KV cache group's block is laid out in
    bytes: its kind, bytes per block (padding included), dtype(s), shape and
    quantization (kv_quant_mode; MLA: cache_dtype_str, model version,
    compression).

    Explicit fields rather than the spec's repr(), so that a field a later
    release adds to the spec dataclasses (or one that does not change the
    bytes, e.g. num_speculative_blocks) does not move existing caches.
    """
    layout: dict = {
        "version": BLOCK_LAYOUT_VERSION,
        "kind": _block_kind(spec),
        "block_size": spec.block_size,
        "page_size_bytes": spec.page_size_bytes,
    }
    if isinstance(spec, MambaSpec):
        layout["dtypes"] = [str(d).removeprefix("torch.") for d in spec.dtypes]
        layout["shapes"] = [list(shape) for shape in spec.shapes]
    elif isinstance(spec, AttentionSpec):
        layout["dtype"] = str(spec.dtype).removeprefix("torch.")
        layout["num_kv_heads"] = spec.num_kv_heads
        layout["head_size"] = spec.head_size
        layout["head_size_v"] = getattr(spec, "head_size_v", spec.head_size)
        layout["kv_quant_mode"] = spec.kv_quant_mode.name
        if getattr(spec, "tq_slot_size", 0):
            layout["tq_slot_size"] = spec.tq_slot_size
        if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
            layout["cache_dtype_str"] = spec.cache_dtype_str
            layout["model_version"] = spec.model_version
            layout["compress_ratio"] = spec.compress_ratio
    return layout


def _block_kind(spec: KVCacheSpec) -> str:
    if isinstance(spec, MambaSpec):
        return "mamba"
    if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
        return "mla_attention"
    if isinstance(spec, AttentionSpec):
        return "attention"  # full, sliding window, chunked local: same bytes
    return type(spec).__name__


class FileMapper:
    """
    FileMapper maps KV blocks (given by their hash) to file names.
    """

    def __init__(
        self,
        root_dir: str,
        model_name: str,
        hash_block_size: int,
        gpu_blocks_per_file: int,
        tp_size: int,
        pp_size: int,
        pcp_size: int,
        dcp_size: int,
        rank: int,
        dtype: str,
        kv_cache_groups: list[dict] | None = None,
        inference_engine: str = "vllm",
        parallel_agnostic: bool = False,
        checksum: dict | None = None,
        file_stem: Callable[[bytes], str] | None = None,
        kv_values: dict | None = None,
    ):
        """
        Initialize the file mapper. Each worker constructs its own, but
        `config.json` is shared across workers since rank lives outside the hash.
        When `parallel_agnostic=True`, tp/pp/pcp/dcp are forced to 1 and rank
        to 0 so multiple parallelism layouts collapse into the same folder.
        A `checksum` (the fields of the checksum stored with each block)
        gives the files their own folder, so that files without it (or with
        another) are never read as if they had it. `file_stem` maps a block
        hash to its files' name (default: its hex), e.g. a keyed hash, so
        that names cannot be computed from the prefix. `kv_values` (what the
        model's K/V values depend on, kv_values.describe_kv_values()) gives
        another model at the same path, new weights or another config their
        own folder.
        """
        if parallel_agnostic:
            tp_size = pp_size = pcp_size = dcp_size = 1
            rank = 0
        self.rank: int = rank
        self.fields: dict = {
            "model_name": model_name,
            "hash_block_size": hash_block_size,
            "gpu_blocks_per_file": gpu_blocks_per_file,
            "tp_size": tp_size,
            "pp_size": pp_size,
            "pcp_size": pcp_size,
            "dcp_size": dcp_size,
            "dtype": str(dtype),
            "kv_cache_groups": kv_cache_groups or [],
            "inference_engine": inference_engine,
        }
        if checksum is not None:
            self.fields["checksum"] = checksum
        if kv_values is not None:
            self.fields["kv_values"] = kv_values
        self.base_path: str = self._compute_base_path(root_dir, self.fields)
        self._file_stem = file_stem

    @classmethod
    def from_offloading_spec(
        cls,
        root_dir: str,
        offloading_spec: OffloadingSpec,
        gpu_blocks_per_file: int = 1,
        parallel_agnostic: bool = False,
        checksum: dict | None = None,
        file_stem: Callable[[bytes], str] | None = None,
        group_file_bytes: list[int] | None = None,
    ) -> "FileMapper":
        """Build a FileMapper from an OffloadingSpec. group_file_bytes: the
        bytes of each group's block files where they hold only the group's
        part of a block (a file format of its own: another directory)."""
        vllm_config = offloading_spec.vllm_config
        kv_cache_config = offloading_spec.kv_cache_config

        parallel_config = vllm_config.parallel_config
        dtype = str(vllm_config.cache_config.cache_dtype).replace("torch.", "")
        kv_cache_groups = [
            {
                "block_size": group.kv_cache_spec.block_size,
                "layer_names": list(group.layer_names),
                "layout": describe_block_layout(group.kv_cache_spec),
            }
            for group in kv_cache_config.kv_cache_groups
        ]
        if group_file_bytes is not None:
            for group_fields, file_bytes in zip(kv_cache_groups, group_file_bytes):
                group_fields["file_bytes"] = file_bytes
        return cls(
            root_dir=root_dir,
            model_name=vllm_config.model_config.model,
            # The granularity vLLM hashes blocks with; for HMA models it can
            # differ from cache_config.block_size.
            hash_block_size=offloading_spec.hash_block_size,
            gpu_blocks_per_file=gpu_blocks_per_file,
            tp_size=parallel_config.tensor_parallel_size,
            pp_size=parallel_config.pipeline_parallel_size,
            pcp_size=parallel_config.prefill_context_parallel_size,
            dcp_size=parallel_config.decode_context_parallel_size,
            rank=parallel_config.rank,
            dtype=dtype,
            kv_cache_groups=kv_cache_groups,
            parallel_agnostic=parallel_agnostic,
            checksum=checksum,
            file_stem=file_stem,
            kv_values=describe_kv_values(KVValuesSource.from_vllm_config(vllm_config)),
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
        """The sha256 of the fields (what base_path's digest abbreviates):
        identifies the layout of this rank's files."""
        canonical = json.dumps(self.fields, sort_keys=True, separators=(",", ":"))
        return f"{hashlib.sha256(canonical.encode()).hexdigest()}_r{self.rank}"

    def get_config_file_path(self) -> str:
        return f"{self.base_path}/{_CONFIG_FILENAME}"

    @staticmethod
    def _compute_base_path(root_dir: str, fields: dict) -> str:
        """
        Layout: <root_dir>/<safe_model_name>_<sha256-prefix>/.
        safe_model_name replaces '/' with '_' so HuggingFace IDs don't nest.
        """
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()[
            :_BASE_PATH_HASH_LEN
        ]
        safe_model_name = fields["model_name"].replace("/", "_")
        return f"{root_dir}/{safe_model_name}_{digest}"
