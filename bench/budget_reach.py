#!/usr/bin/env python3
"""The fs_python tier's byte budget (max_bytes, issue 19): the unreachable share of kept bytes.

A kept block file is unreachable when it can never hit: a hit needs every full-attention
group's chunks from the start of the prompt, so a file (of any group) is unreachable when a
full-attention chunk of its prompt up to its end is not on disk (gemma4: a sliding-window file
of 16 tokens needs the full-attention chunk of 32 tokens that ends at or after it). The
budget evicts whole prefixes, tail first, and writes no file past a gap; a per-key LRU (what a
budget that knows no prefixes does) keeps files whose prefix it evicted.

Workload, the same for both sides and every layout (issue 19's measurement): through the real
connector scheduler, its CPU tier (64 blocks) and the fs_python tier writing real files (the
regression suite's helpers, tests/v1/kv_offload/test_fs_tier_budget.py of the checkout), 32
prompts of 4 chunks of one of 4 shared heads and 4 chunks of their own, then 64 revisits
(recent prompts more likely), over a budget of 16 chunks (one file of every group each).
Sides: max_bytes (the budget) vs "per-key LRU": the same tier unbounded, trimmed after every
engine step by removing files least recently used first (a key's use: its store, or a lookup()
that found it) down to the same bytes.

Sampled after each request once the tier's files reached 90% of the budget: at rest (the
request's store jobs to disk are done, so no file is in flight; the budget's removals of what it
evicted are waited for, so an evicted chunk never counts half removed). Reported per layout and
side: the mean share over those samples and the share at the end, the tokens hit, the files the
budget refused to write as unreachable. Judged by report.py: budget <= 5% at every layout.
Runs on the vLLM this interpreter imports (the patched side: .venv or BENCH_PATCHED_SITE), the
suite of BENCH_SUITE (a checkout's tests/v1/kv_offload; default build/vllm's). Writes JSON for
report.py; {"skipped": why} when the tree has no budget or the suite lacks its helpers.
"""

import argparse
import importlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

from common import QUICK, ROOT, TMP, run_main, say, vllm_fingerprint

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

SUITE = Path(os.environ.get("BENCH_SUITE", ROOT / "build" / "vllm" / "tests" / "v1" / "kv_offload"))
LAYOUTS = ("llama", "gemma3", "gemma4", "qwen3_5")
SIDES = ("max_bytes", "lru")
N_PROMPTS, N_HEADS, HEAD_CHUNKS, TAIL_CHUNKS, BUDGET_CHUNKS = 32, 4, 4, 4, 16
CPU_BLOCKS = 64
GOAL = 0.05  # issue 19: the budget's unreachable share of kept bytes


def prompts(chunk_tokens: int) -> list[list[int]]:
    """N_PROMPTS prompts: HEAD_CHUNKS chunks of one of N_HEADS heads, TAIL_CHUNKS of their
    own, plus one token."""
    out = []
    for p in range(N_PROMPTS):
        h = p % N_HEADS
        head = [(11 * i + 101 * h + 3) % 500 for i in range(HEAD_CHUNKS * chunk_tokens)]
        tail = [(7 * i + 13 * p + 1) % 500 for i in range(TAIL_CHUNKS * chunk_tokens + 1)]
        out.append(head + tail)
    return out


def visits() -> list[int]:
    """Each prompt once, then 2 * N_PROMPTS revisits (recent prompts more likely)."""
    rng = random.Random(19)
    seq = list(range(N_PROMPTS))
    seq += [max(rng.randrange(N_PROMPTS), rng.randrange(N_PROMPTS)) for _ in range(2 * N_PROMPTS)]
    return seq


class PerKeyLRU:
    """Per-key LRU over an unbounded fs_python tier's files (the reference)."""

    def __init__(self, tier, max_bytes: int, root: str, disk_bytes):
        self.max_bytes, self.root, self.disk_bytes = max_bytes, root, disk_bytes
        self.recent: dict[str, None] = {}  # path -> None, least recent first
        lookup, submit_store = tier.lookup, tier.submit_store

        def use(key):
            path = tier.file_mapper.get_file_name(key)
            self.recent.pop(path, None)
            self.recent[path] = None

        def counted_lookup(key, *args, **kwargs):
            hit = lookup(key, *args, **kwargs)
            if hit:
                use(key)
            return hit

        def counted_store(job):
            for key in job.keys:
                use(key)
            return submit_store(job)

        tier.lookup, tier.submit_store = counted_lookup, counted_store

    def trim(self) -> None:
        used = self.disk_bytes(self.root)
        for path in list(self.recent):
            if used <= self.max_bytes:
                break
            try:
                size = os.path.getsize(path)
                os.remove(path)
                used -= size
            except FileNotFoundError:
                pass  # not written yet (a store in flight) or gone: forget it
            del self.recent[path]


def settle(tier) -> None:
    """Wait until the files the budget evicted are removed (nothing for the LRU side)."""
    budget = getattr(tier, "_budget", None)
    deadline = time.monotonic() + 60
    while budget is not None and budget.unlinking:
        if time.monotonic() > deadline:
            raise RuntimeError("the budget's removals did not finish in 60 s")
        time.sleep(0.001)


def run_case(suite, hma, mc, layout: str, side: str, root: str) -> dict:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    shutil.rmtree(root, ignore_errors=True)
    probe = TieringOffloadingSpec(*hma.make_configs(mc, layout, root, CPU_BLOCKS))
    groups = len(probe.kv_cache_config.kv_cache_groups)
    chunk = groups * suite.file_bytes(probe)
    chunk_tokens = min(probe.offloaded_block_size)  # a chunk: the finest group's block
    max_bytes = BUDGET_CHUNKS * chunk
    budget = {"max_bytes": max_bytes} if side == "max_bytes" else {}
    spec = TieringOffloadingSpec(
        *hma.make_configs(
            mc, layout, root, CPU_BLOCKS, {"secondary_tiers": [suite.tier_config(root, **budget)]}
        )
    )
    sched = suite.sched_for(spec)
    configs = sched.config.kv_group_configs
    tier = sched.manager.secondary_tiers[0]
    lru = PerKeyLRU(tier, max_bytes, root, suite.disk_bytes) if side == "lru" else None
    full = [False]

    def on_step():
        if lru is not None:
            lru.trim()
        if suite.disk_bytes(root) >= max_bytes * 0.9:
            full[0] = True

    all_keys: list = []
    shares: list[float] = []
    hit = 0
    t0 = time.monotonic()
    ps = prompts(chunk_tokens)
    try:
        for i, p in enumerate(visits()):
            request = suite.make_request(spec, f"req{i}", ps[p])
            if i < N_PROMPTS:
                all_keys.append(suite.prompt_keys_of(sched, request))
            hit += suite.serve(sched, request, on_step)
            if full[0]:  # at rest: the request's jobs are done
                settle(tier)  # and the budget's removals
                files = suite.block_files(root)
                shares.append(suite.unreachable_share(all_keys, files, configs))
    finally:
        sched.shutdown()
        while hma._SHM_PATHS:  # the CPU tier's /dev/shm region
            path = hma._SHM_PATHS.pop()
            if os.path.exists(path):
                os.remove(path)
    if lru is not None:
        lru.trim()
    files = suite.block_files(root)
    out = {
        "mean": sum(shares) / len(shares) if shares else None,
        "end": suite.unreachable_share(all_keys, files, configs),
        "samples": len(shares),
        "tokens_hit": hit,
        "kept_chunks": suite.disk_bytes(root) / chunk,
        "budget_chunks": BUDGET_CHUNKS,
        "groups": groups,
        "seconds": time.monotonic() - t0,
    }
    b = getattr(tier, "_budget", None)
    if b is not None:
        out["not_written_unreachable"] = b.unreachable_files
        out["evicted_files"] = b.evicted_files
    shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(TMP / "reach.json"))
    args = ap.parse_args()
    import inspect

    import vllm
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    result: dict = {"fingerprint": vllm_fingerprint(os.path.dirname(vllm.__file__))}
    if "max_bytes" not in inspect.signature(FileSystemTierManager).parameters:
        result["skipped"] = "this tree's fs_python tier has no max_bytes setting"
    elif not (SUITE / "test_fs_tier_budget.py").exists():
        result["skipped"] = f"{SUITE} has no test_fs_tier_budget.py (the workload's helpers)"
    if "skipped" in result:
        say(f"reach: skipped ({result['skipped']})")
        Path(args.out).write_text(json.dumps(result, indent=1))
        return 0
    sys.path.insert(0, str(SUITE))
    suite = importlib.import_module("test_fs_tier_budget")
    hma = importlib.import_module("test_tiering_hma")
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    from layout_bytes import model_config

    kv_cache_utils.init_none_hash(sha256)  # the engine's default block hashes
    work = TMP / "reach"
    shutil.rmtree(work, ignore_errors=True)
    (work / "model").mkdir(parents=True)
    mc = model_config(str(work / "model"))
    layouts = [name for name in LAYOUTS if name in hma.LAYOUTS]
    if QUICK:
        layouts = layouts[:2]
    t0 = time.monotonic()
    cases: dict = {}
    for layout in layouts:
        cases[layout] = {}
        for side in SIDES:
            r = run_case(suite, hma, mc, layout, side, str(work / "fs"))
            cases[layout][side] = r
            say(
                f"reach: {layout} {side}: unreachable share of kept bytes mean "
                f"{r['mean'] if r['mean'] is None else format(r['mean'], '.1%')}, end "
                f"{r['end']:.1%} ({r['seconds']:.0f} s)"
            )
    result.update(
        cases=cases,
        suite=str(SUITE),
        workload={
            "prompts": N_PROMPTS,
            "heads": N_HEADS,
            "head_chunks": HEAD_CHUNKS,
            "tail_chunks": TAIL_CHUNKS,
            "revisits": 2 * N_PROMPTS,
            "budget_chunks": BUDGET_CHUNKS,
            "cpu_blocks": CPU_BLOCKS,
        },
        goal=GOAL,
        seconds=time.monotonic() - t0,
    )
    shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    run_main(main)
