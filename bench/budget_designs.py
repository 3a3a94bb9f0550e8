#!/usr/bin/env python3
"""The 0.34.0 fs tier's max_bytes budget (the series' FsTierBudget, fs/budget.py: ordered
times kept in the files' mtimes) on issue 19's workload: what it keeps reachable and hits.

Workload (test_fs_tier_budget.py's test_no_kept_file_is_unreachable_with_sliding_window_groups,
through the real connector scheduler, the CPU tier of 64 blocks and the fs tier writing real
files): 32 prompts of 4 shared heads of 4 chunks and 4 chunks of their own, then 64 revisits
(recent prompts more likely), each looked up (its disk hit promoted) and then offloaded, over
a budget of 16 chunks. After each request (its jobs done, the removals waited for): the
unreachable share of the kept files (files of a prompt past the first full-attention chunk it
lost: they can never hit), sampled from the first time the files reach 90% of the budget.
Reported per layout: mean and worst share, tokens hit from the fs tier's promotions, evicted
and rejected files, files never written past a gap.

    PYTHONPATH=<dir with a `tests` link to build/vllm-0.34.0/tests> \\
        .venv-0.34.0/bin/python bench/budget_designs.py [--layouts llama,gemma3]
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import model_config  # noqa: E402


def run_case(t, mc, layout: str, root: str) -> dict:
    probe = t.Engine(mc, layout, root, 64)
    max_bytes = 16 * t.chunk_bytes_on_disk(probe)
    engine = t.budget_engine(mc, layout, root, max_bytes=max_bytes)
    sched = engine.connector_scheduler()
    hits: dict[str, int] = {}  # the tokens each lookup request hit, as settle_step saw them
    matched = sched.get_num_new_matched_tokens

    def recorded(request, num_computed_tokens):
        out = matched(request, num_computed_tokens)
        if out[0] is not None:
            hits[request.request_id] = out[0]
        return out

    sched.get_num_new_matched_tokens = recorded
    (tier,) = t.tiering_manager(sched).secondary_tiers
    budget = tier._budget
    heads = [[(11 * i + 101 * h + 3) % 500 for i in range(64)] for h in range(4)]
    prompts = [heads[p % 4] + [(7 * i + 13 * p + 1) % 500 for i in range(65)] for p in range(32)]
    rng = random.Random(19)
    order = list(range(32)) + [max(rng.randrange(32), rng.randrange(32)) for _ in range(64)]
    all_keys, shares, hit, full = [], [], 0, False
    t0 = time.monotonic()
    try:
        for i, p in enumerate(order):
            lookup = t.request_of(engine, f"lookup{i}", prompts[p])
            sched.on_new_request(lookup)
            settled: set[str] = set()
            for _ in range(3):
                t.settle_step(sched, [lookup], settled)
            hit += hits.pop(lookup.request_id, 0)
            keys = t.store_prompt(sched, t.request_of(engine, f"req{i}", prompts[p]))
            if i < 32:
                all_keys.append(keys)
            t.wait_until(lambda: budget.unlinking == 0)
            files = t.block_files(root)
            lost = t.unreachable_files(all_keys, files, sched)
            full = full or t.disk_bytes(root) >= 0.9 * max_bytes
            if full:  # sampled from the first time the files reached 90% of the budget
                shares.append(len(lost) / max(len(files), 1))
    finally:
        sched.shutdown()
    return {
        "mean": sum(shares) / len(shares) if shares else None,
        "worst": max(shares, default=None),
        "samples": len(shares),
        "hit_tokens": hit,
        "evicted_files": budget.evicted_files,
        "rejected_files": budget.rejected_files,
        "not_written_past_a_gap": budget.unreachable_files,
        "seconds": round(time.monotonic() - t0, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="llama,gemma3,gemma4,qwen3_5")
    ap.add_argument("--json")
    args = ap.parse_args()
    import tests.v1.kv_offload.test_fs_tier_budget as t
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "model").mkdir()
        mc = model_config(str(Path(tmp, "model")))
        for layout in args.layouts.split(","):
            r = out[layout] = run_case(t, mc, layout, str(Path(tmp, f"fs-{layout}")))
            print(
                f"{layout:7} unreachable mean {r['mean']:.2%} worst {r['worst']:.2%} "
                f"({r['samples']} samples), hit tokens {r['hit_tokens']}, evicted "
                f"{r['evicted_files']}, rejected {r['rejected_files']}, not written past a "
                f"gap {r['not_written_past_a_gap']} ({r['seconds']} s)",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
