#!/usr/bin/env python3
"""Useful bytes vs allocated bytes per KV cache group: the CPU tier's rows and the fs tier's files.

For each layout (the regression suite's, tests/v1/kv_offload/test_tiering_hma.py LAYOUTS in
build/vllm, and real model sizes built from their public configs), vLLM's own grouping
(get_kv_cache_configs) and the real TieringOffloadingSpec give:

- useful bytes of one offloaded block of group g: its layers x the spec's real page bytes
  (no page_size_padded) x the GPU blocks per offloaded block (blocks_per_chunk);
- the slot: spec.cpu_page_size_per_worker, one row size for every group (patch 0002's
  block_size_factor, 0004's layout, 0005's page alignment): what the CPU tier allocates per
  block and, today, what the fs tier writes per key (a file of exactly the row, plus the
  checksum's trailer where the root has no user xattrs; the default keeps it in an xattr);
- used / allocated: CPU tier (one key = one row), fs tier today (file = row), and the
  alternatives: a file of the group's bytes rounded up to the page ("useful bytes", goal 5)
  and one file per chunk holding its groups' rows at page-aligned offsets (goal 3's layout,
  the same bytes as "useful bytes", or packed at unaligned offsets); and a CPU tier with
  per-group row sizes (the same bytes as "useful bytes").

A chunk stores one block of every group (sliding-window groups included: the offloading
connector stores every group's block), so a layout's ratio is sum(useful) / sum(allocated).
Writes the table to stdout and to --out (JSON) for report.py.
"""

import argparse
import importlib.util
import json
import mmap
import os
import sys
import tempfile
from pathlib import Path

from common import ROOT, TMP, model_config, run_main, say

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
)
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

PAGE = mmap.PAGESIZE
BF16 = torch.bfloat16
SUITE = ROOT / "build" / "vllm" / "tests" / "v1" / "kv_offload" / "test_tiering_hma.py"


def up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


# -- real model sizes, from their public configs (the assumptions are printed with them)
def gemma3_27b():
    specs = {}
    for i in range(62):  # sliding_window_pattern 6: every 6th layer is global
        kw = dict(block_size=16, num_kv_heads=16, head_size=128, dtype=BF16)
        specs[f"model.layers.{i}.self_attn.attn"] = (
            FullAttentionSpec(**kw) if i % 6 == 5 else SlidingWindowSpec(**kw, sliding_window=1024)
        )
    return specs, {}


def gpt_oss_20b():
    specs = {}
    for i in range(24):  # layer_types: sliding (128) and full, alternating
        kw = dict(block_size=16, num_kv_heads=8, head_size=64, dtype=BF16)
        specs[f"model.layers.{i}.attn"] = (
            FullAttentionSpec(**kw) if i % 2 else SlidingWindowSpec(**kw, sliding_window=128)
        )
    return specs, {}


def qwen3_next_80b():
    """48 layers, full_attention_interval 4; gated delta net states in bf16; mamba 'align'
    mode raises the attention block size so that its page holds a state (vLLM: a multiple of
    16 tokens), and pads the state to that page."""
    conv = (3, 2 * 16 * 128 + 32 * 128)  # conv_kernel - 1, 2 x key dim + value dim
    ssm = (32, 128, 128)  # value heads, key head dim, value head dim
    state = (conv[0] * conv[1] + ssm[0] * ssm[1] * ssm[2]) * 2
    per_token = 2 * 2 * 256 * 2  # K and V, 2 KV heads, head_dim 256, bf16
    block = up(state, 16 * per_token) // per_token
    attn = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=256, dtype=BF16)
    specs = {}
    for i in range(48):
        if i % 4 == 3:
            specs[f"model.layers.{i}.self_attn.attn"] = attn
        else:
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                block_size=block,
                shapes=(conv, ssm),
                dtypes=(BF16, BF16),
                page_size_padded=attn.page_size_bytes,
                mamba_cache_mode="align",
            )
    return specs, {"block_size": block, "mamba_cache_mode": "align"}


def deepseek_v4_sized():
    """No public config in this tree's vLLM: sized as DeepSeek-V3's MLA (61 layers, latent
    512 + rope 64 = 576 bf16 values per token, block 64) plus, per layer, a sliding-window
    (128) cache of one 576-wide head (block 16), the shape of the suite's deepseek_v4."""
    specs = {}
    for i in range(61):
        specs[f"model.layers.{i}.self_attn.mla_attn"] = MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=576, dtype=BF16
        )
        specs[f"model.layers.{i}.self_attn.swa_attn"] = SlidingWindowSpec(
            block_size=16, num_kv_heads=1, head_size=576, dtype=BF16, sliding_window=128
        )
    return specs, {}


MODELS = {
    "Gemma-3-27B (62 layers, 52 sliding 1024 + 10 full, 16 KV heads x 128, bf16)": gemma3_27b,
    "gpt-oss-20B (24 layers, 12 sliding 128 + 12 full, 8 KV heads x 64, bf16)": gpt_oss_20b,
    "Qwen3-Next-80B-sized (48 layers, 36 gated delta net + 12 full, 2 KV heads x 256, bf16)": (
        qwen3_next_80b
    ),
    "DeepSeek-V4-sized (assumed: 61 x (MLA 576 + sliding 128 x 576), bf16)": deepseek_v4_sized,
}


def suite_layouts() -> dict:
    """The regression suite's LAYOUTS, from the track's checkout (None when absent)."""
    if not SUITE.exists():
        return {}
    spec = importlib.util.spec_from_file_location("_suite_layouts", SUITE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {f"suite: {k}": v for k, v in mod.LAYOUTS.items()}


def real_bytes(spec) -> int:
    """A GPU block's bytes of one layer without padding."""
    if isinstance(spec, MambaSpec):
        return sum(
            int(torch.Size(s).numel()) * torch.tensor([], dtype=d).element_size()
            for s, d in zip(spec.shapes, spec.dtypes, strict=True)
        )
    return getattr(spec, "real_page_size_bytes", spec.page_size_bytes)


def measure(mc: ModelConfig, root: str, specs: dict, cache_kwargs: dict, bpc: int) -> dict:
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 1 << 30,
        "blocks_per_chunk": bpc,
        "secondary_tiers": [{"type": "fs_python", "root_dir": root}],
    }
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(
            **{"block_size": 16, "enable_prefix_caching": True, **cache_kwargs}
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    page = max(s.page_size_bytes for s in specs.values())
    (kcc,) = get_kv_cache_configs(vc, [specs], [page * len(specs) * 256])
    spec = TieringOffloadingSpec(vc, kcc)
    row = spec.cpu_page_size_per_worker
    groups = []
    for g, grp in enumerate(kcc.kv_cache_groups):
        per_chunk = spec.offloaded_block_size[g] // spec.gpu_block_size[g]
        useful = len(grp.layer_names) * real_bytes(grp.kv_cache_spec) * per_chunk
        groups.append(
            {
                "kind": type(grp.kv_cache_spec).__name__,
                "layers": len(grp.layer_names),
                "tokens": spec.offloaded_block_size[g],
                "useful": useful,
                "file_useful": up(useful),
            }
        )
    n = len(groups)
    used = sum(x["useful"] for x in groups)
    # what the tier under test writes per key: the group's file where it sizes files by
    # group (group_files), else a file of the whole row
    try:
        from vllm.v1.kv_offload.tiering.fs.manager import group_files
    except ImportError:
        files = None
    else:
        files = group_files(spec, row)
    for g, f in enumerate(files or ()):
        # the byte runs of the row a group file gathers (the shared io.py's plan,
        # bench/io_gather.py: a Python gather costs loads at small runs)
        runs = [n for _, n in f.runs] if f.runs else [f.size]
        groups[g]["runs"], groups[g]["min_run"] = len(runs), min(runs)
    disk_allocated = sum(f.size for f in files) if files else n * row
    return {
        "blocks_per_chunk": bpc,
        "row": row,
        "tensors": len(kcc.kv_cache_tensors),
        "groups": groups,
        "cpu_today": used / (n * row),
        "disk_today": used / disk_allocated,
        "disk_group_files": bool(files),
        "disk_useful": used / sum(x["file_useful"] for x in groups),
        "cpu_per_group_rows": used / sum(x["file_useful"] for x in groups),
        # one file per chunk with the groups' bytes packed (offsets not page-aligned)
        "disk_chunk_packed": used / up(used),
    }


def fmt(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} B"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(TMP / "layout.json"))
    ap.add_argument("--blocks-per-chunk", default="1,16", help="comma-separated values")
    args = ap.parse_args()
    layouts = {**suite_layouts(), **{k: f for k, f in MODELS.items()}}
    out = {"page": PAGE, "suite": str(SUITE), "layouts": []}
    with tempfile.TemporaryDirectory(prefix="layout-bytes-") as tmp:
        mc = model_config(tmp)
        for name, fn in layouts.items():
            specs, cache_kwargs = fn() if not isinstance(fn, tuple) else (fn[0](), fn[1])
            for bpc in (int(x) for x in args.blocks_per_chunk.split(",")):
                try:
                    r = measure(mc, os.path.join(tmp, "fs"), specs, cache_kwargs, bpc)
                except ValueError as e:  # e.g. a block size blocks_per_chunk cannot reach
                    r = {"blocks_per_chunk": bpc, "error": str(e).splitlines()[0]}
                out["layouts"].append({"name": name, **r})
    for r in out["layouts"]:
        if "error" in r:
            say(f"{r['name']}, blocks_per_chunk {r['blocks_per_chunk']}: {r['error']}")
            continue
        per = ", ".join(
            f"{x['kind']} x{x['layers']}: {fmt(x['useful'])}"
            + (f" in {x['runs']} run(s) of >= {fmt(x['min_run'])}" if "runs" in x else "")
            for x in r["groups"]
        )
        say(
            f"{r['name']}, blocks_per_chunk {r['blocks_per_chunk']}: row {fmt(r['row'])}; "
            f"{per}; used/allocated CPU {r['cpu_today']:.2f}, disk today "
            f"{r['disk_today']:.2f}, disk useful bytes {r['disk_useful']:.2f}, chunk file packed "
            f"{r['disk_chunk_packed']:.2f}"
        )
    Path(args.out).write_text(json.dumps(out, indent=1))
    say(f"layout bytes -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    run_main(main)
