#!/usr/bin/env python3
"""The 0.22.1 fs_python tier's store and load with two versions of its io.py, side by side:
the installed one ("after") and one from a file ("before"), e.g. the io.py of the commit before
a change (the figures patch 0036 of patches/0.22.1 cites).

One tier (bench/disk_bench.py's Point: 16 I/O threads, O_DIRECT, the journal committed before
each timed store, the pages dropped before each load), store_block/load_block swapped in per
round; rounds interleaved with raw file-per-block I/O, the order alternating. Per block: median
wall and process CPU; tier / raw per round, median and best. The load average is printed.

    git -C build/vllm show HEAD~2:vllm/v1/kv_offload/tiering/fs/io.py > /tmp/io_before.py
    .venv/bin/python bench/io_ab.py --before /tmp/io_before.py [--row-kib 64] [--rounds 10]
"""

import argparse
import importlib.util
import os
import shutil
import statistics

from common import TMP, round_order, run_main, say

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import disk_bench  # noqa: E402
from vllm.v1.kv_offload.tiering.fs import manager as fs_manager  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the io.py to compare with the installed one")
    ap.add_argument("--row-kib", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=0, help="default: 128 MiB of rows, <= 2048")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("io_before", args.before)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    size = args.row_kib << 10
    n = args.blocks or min(2048, (128 << 20) // size)
    root = TMP / "io_ab"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    say(f"io_ab: {n} blocks of {args.row_kib} KiB, {args.rounds} rounds, load {os.getloadavg()}")
    versions = {
        "before": (before.store_block, before.load_block),
        "after": (fs_manager.store_block, fs_manager.load_block),
    }
    point = disk_bench.Point(str(root), size, size, n, 1, 16)
    sides = ["before", "after", "raw"]
    res: dict[str, list] = {s: [] for s in sides}
    try:
        for r in range(args.rounds):
            for side in round_order(sides, r):
                if side in versions:
                    fs_manager.store_block, fs_manager.load_block = versions[side]
                t_store, t_load = point.round_trip("tier" if side in versions else "raw")
                res[side].append((t_store, t_load, *point.cpu))
    finally:
        fs_manager.store_block, fs_manager.load_block = versions["after"]
        point.close()
    us = 1e6 / n
    for side in sides:
        m = [statistics.median(x[i] for x in res[side]) * us for i in range(4)]
        say(
            f"  {side:6s} store {m[0]:6.1f} us (CPU {m[2]:6.1f}) | "
            f"load {m[1]:6.1f} us (CPU {m[3]:6.1f})"
        )
    for side in ("before", "after"):
        for phase, i in (("store", 0), ("load", 1)):
            ratios = [res["raw"][k][i] / res[side][k][i] for k in range(args.rounds)]
            say(
                f"  {side:6s} {phase:5s} tier / raw: median {statistics.median(ratios):.2f}, "
                f"best {max(ratios):.2f}"
            )
    say(f"io_ab: load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    run_main(main)
