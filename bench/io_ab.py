#!/usr/bin/env python3
"""The fs tier's store and load with two versions of its I/O code, side by side: the installed
one ("after") and one from a file ("before"), e.g. the code of the commit before a change.

--before is a csrc/fs_io.cpp, compiled here with g++ and its batch store/load swapped in for
the installed fs_io_C's (the figures patches/0.34.0/measured/tier-store-lookups.md cites);
both tracks carry the same one since the fork's patch 0064. Before that patch, --before could
be the fork's io.py, its per-block store_block/load_block swapped in (the figures patches 0036
and 0038 of patches/0.22.1 cite): that needs a checkout of that time.

One tier (bench/disk_bench.py's Point: 16 I/O threads, O_DIRECT, the journal committed before
each timed store, the pages dropped before each load), the version swapped in per round;
rounds interleaved with raw file-per-block I/O, the order rotating. Per block: median wall and
process CPU; tier / raw and after / before per round, median and best. The load average is
printed.

    git -C build/vllm show HEAD~2:vllm/v1/kv_offload/tiering/fs/io.py > /tmp/io_before.py
    .venv/bin/python bench/io_ab.py --before /tmp/io_before.py [--row-kib 64] [--rounds 10]
    git -C build/vllm-0.34.0 show HEAD~1:csrc/fs_io.cpp > /tmp/fs_io_before.cpp
    .venv-0.34.0/bin/python bench/io_ab.py --before /tmp/fs_io_before.cpp
"""

import argparse
import importlib.util
import os
import shutil
import statistics
import sys

from common import ROOT, TMP, BenchError, round_order, run_main, say

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm.v1.kv_offload.tiering.fs import io as fs_io  # noqa: E402
from vllm.v1.kv_offload.tiering.fs import manager as fs_manager  # noqa: E402

import disk_bench  # noqa: E402


def swapped(target, names: tuple[str, str], before) -> tuple[dict, object]:
    """The store/load pair *names* of *target* as installed ("after") and as *before* has
    them (the same names, or fs_io_C's where *before* is that module), and a function that
    puts a pair in place."""
    own = names if hasattr(before, names[0]) else ("batch_store_block", "batch_load_block")
    versions = {
        "before": tuple(getattr(before, n) for n in own),
        "after": tuple(getattr(target, n) for n in names),
    }

    def use(pair) -> None:
        for name, function in zip(names, pair, strict=True):
            setattr(target, name, function)

    return versions, use


def python_versions(path: str) -> tuple[dict, object]:
    """0.22.1 before its patch 0064: the manager's store_block/load_block, installed and from
    *path*."""
    if not hasattr(fs_manager, "store_block"):
        raise BenchError(
            "this fork's fs tier has no per-block store_block/load_block (since its patch "
            "0064): compare a csrc/fs_io.cpp instead"
        )
    spec = importlib.util.spec_from_file_location("io_before", path)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    return swapped(fs_manager, ("store_block", "load_block"), before)


def compiled_versions(path: str) -> tuple[dict, object]:
    """0.34.0: fs_io_C's batch store/load, installed and compiled from *path* (as make
    wheel compiles it, scripts/make_wheel.py)."""
    if not fs_io.has_compiled_io():
        raise BenchError("this tier does its I/O without fs_io_C: nothing to compare a .cpp with")
    sys.path.insert(0, str(ROOT / "scripts"))
    from _lib import UserError
    from make_wheel import compile_native_cached

    so = TMP / "io_ab_before" / "fs_io_C.so"
    so.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "rb") as f:
        try:
            so.write_bytes(compile_native_cached("csrc/fs_io.cpp", f.read()))
        except UserError as e:
            raise BenchError(f"{path}: {e}") from None
    # the init function is named after the last part of the module's name: fs_io_C
    spec = importlib.util.spec_from_file_location("vllm.fs_io_C", so)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    return swapped(fs_io, ("batch_store_block_C", "batch_load_block_C"), before)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--before", required=True, help="the io.py (0.22.1) or fs_io.cpp (0.34.0) to compare"
    )
    ap.add_argument("--row-kib", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=0, help="default: 128 MiB of rows, <= 2048")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    compiled = args.before.endswith(".cpp")
    versions, use = (compiled_versions if compiled else python_versions)(args.before)
    size = args.row_kib << 10
    n = args.blocks or min(2048, (128 << 20) // size)
    root = TMP / "io_ab"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    say(
        f"io_ab: {n} blocks of {args.row_kib} KiB, {args.rounds} rounds, "
        f"{'fs_io_C' if compiled else 'io.py'} before vs installed, load {os.getloadavg()}"
    )
    point = disk_bench.Point(str(root), size, size, n, 1, 16)
    sides = ["before", "after", "raw"]
    res: dict[str, list] = {s: [] for s in sides}
    try:
        for r in range(args.rounds):
            for side in round_order(sides, r):
                if side in versions:
                    use(versions[side])
                t_store, t_load = point.round_trip("tier" if side in versions else "raw")
                res[side].append((t_store, t_load, *point.cpu))
    finally:
        use(versions["after"])
        point.close()
    us = 1e6 / n
    for side in sides:
        m = [statistics.median(x[i] for x in res[side]) * us for i in range(4)]
        say(
            f"  {side:6s} store {m[0]:6.1f} us (CPU {m[2]:6.1f}) | "
            f"load {m[1]:6.1f} us (CPU {m[3]:6.1f})"
        )
    for phase, i in (("store", 0), ("load", 1)):
        for side in ("before", "after"):
            ratios = [res["raw"][k][i] / res[side][k][i] for k in range(args.rounds)]
            say(
                f"  {side:6s} {phase:5s} tier / raw: median {statistics.median(ratios):.2f}, "
                f"best {max(ratios):.2f}"
            )
        ratios = [res["before"][k][i] / res["after"][k][i] for k in range(args.rounds)]
        say(
            f"  after / before {phase:5s} throughput: median {statistics.median(ratios):.2f}, "
            f"best {max(ratios):.2f}"
        )
    say(f"io_ab: load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    run_main(main)
