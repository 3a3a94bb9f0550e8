#!/usr/bin/env python3
"""Start-up cost of the fs tier's model fingerprint (vllm/v1/kv_offload/kv_values.py).

Fingerprints the e2e tiny models; checkpoints of real size made of sparse safetensors files
(a real header, holes for data): 50 GB in 20 shards with a dense model's tensor count
(Llama-3-70B: 723 tensors) and a MoE's (DeepSeek-V3: ~91,000); and a real 4 GB checkpoint of
random bytes with 20,000 tensors, read cold (its pages evicted with POSIX_FADV_DONTNEED before
the first run). Prints one row per model: files, bytes, the first run and the median of 5.

    .venv/bin/python bench/kv_values_cost.py [--dir DIR] [--real-gb 4]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 10**9


def sparse_checkpoint(
    model_dir: Path, total_bytes: int, num_shards: int, num_tensors: int, real: bool = False
):
    """num_shards safetensors files of total_bytes, num_tensors tensors spread over them:
    holes, or random bytes where real."""
    model_dir.mkdir(parents=True, exist_ok=True)
    per_shard = num_tensors // num_shards
    shard_bytes = total_bytes // num_shards
    tensor_bytes = shard_bytes // per_shard // 2 * 2
    for shard in range(num_shards):
        header = {"__metadata__": {"format": "pt"}}
        for i in range(per_shard):
            n = tensor_bytes // 2
            offsets = [i * tensor_bytes, (i + 1) * tensor_bytes]
            header[f"model.layers.{shard}.t{i}.weight"] = {
                "dtype": "BF16",
                "shape": [n],
                "data_offsets": offsets,
            }
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        path = model_dir / f"model-{shard:05d}-of-{num_shards:05d}.safetensors"
        with open(path, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            if real:
                for _ in range(per_shard * tensor_bytes // (64 << 20)):
                    f.write(os.urandom(64 << 20))
            f.truncate(8 + len(raw) + per_shard * tensor_bytes)
    (model_dir / "config.json").write_text('{"model_type": "llama"}')


def evict(model_dir: Path) -> None:
    """Drop the files' pages from the page cache, so that the next read is cold."""
    for path in model_dir.iterdir():
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(model_dir: Path, runs: int = 5) -> tuple[float, float, str]:
    from vllm.v1.kv_offload.kv_values import weights_fingerprint

    evict(model_dir)
    times, digest = [], ""
    for _ in range(runs):
        t0 = time.perf_counter()
        digest = weights_fingerprint(str(model_dir))["digest"]
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times), digest


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--dir", type=Path, default=None, help="where the files go (default: a temp dir)"
    )
    ap.add_argument("--real-gb", type=int, default=4, help="size of the real checkpoint (0: none)")
    args = ap.parse_args()
    rows = []
    for tiny in sorted((ROOT / "build" / "tiny-models").glob("*/config.json")):
        if tiny.parent.name != "tokenizer":
            rows.append((f"tiny {tiny.parent.name}", tiny.parent))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name, tensors in (("dense", 723), ("moe", 91000)):
            model_dir = Path(tmp) / name
            sparse_checkpoint(model_dir, 50 * GB, 20, tensors)
            rows.append((f"50 GB {name}, {tensors} tensors, sparse", model_dir))
        if args.real_gb:
            model_dir = Path(tmp) / "real"
            sparse_checkpoint(model_dir, args.real_gb * GB, 8, 20000, real=True)
            rows.append((f"{args.real_gb} GB, 20000 tensors, random bytes", model_dir))
        print("| model | files | bytes | first run, cold (ms) | median of 5 (ms) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, model_dir in rows:
            files = [p for p in model_dir.rglob("*") if p.is_file()]
            size = sum(p.stat().st_size for p in files)
            first, median, _ = timed(model_dir)
            ms = f"{first * 1000:.1f} | {median * 1000:.1f}"
            print(f"| {name} | {len(files)} | {size:,} | {ms} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
