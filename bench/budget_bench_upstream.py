#!/usr/bin/env python3
"""The 0.34.0 fs tier's byte budget (max_bytes): its scheduler-thread cost beside the
unbounded tier (the figure patches/0.34.0/pr-units.toml cites for tier-disk-budget).

Runs on the vLLM this interpreter imports (.venv-0.34.0, or PYTHONPATH of a work tree's site
from scripts/worktree_site.py), both tiers in this one process, rounds interleaved (the order
alternates). Each round serves one request of KEYS keys (one KV cache group of 16-token
chunks, each key's position recorded in its ReqContext as the connector records it) in store
jobs of JOB keys: submit_store, the I/O (untimed on the scheduler's clock), then one engine
step (get_finished_jobs, on_schedule_end), then on_request_finished. Files of 4 KiB (one row
of the CPU tier's region). The budget holds BUDGET_ROUNDS requests' files: from then on every
job evicts as many files as it writes (checked: "evicted share" of the timed rounds).

Measured, per key stored, with vs without the budget:
- sched_cpu: the scheduler thread's CPU time (time.thread_time) in submit_store,
  get_finished_jobs and on_schedule_end: what the budget adds to the engine's step;
- store_wall: wall time from a job's submit_store to its I/O done (pool idle), which includes
  the budget's admission, eviction and removals on the I/O threads.
Ratios are per round (max_bytes / unbounded, same round), then their median and best; the
first WARMUP_ROUNDS rounds are not timed (the budget fills). The load average is printed at
the start and end. Several processes (--procs) each run all rounds; the summary pools their
per-round ratios and shows each process's median.

    PYTHONPATH=$(VLLM_VERSION=0.34.0 scripts/worktree_site.py TREE) \\
        .venv-0.34.0/bin/python bench/budget_bench_upstream.py [--procs 5] [--rounds 16]
"""

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

KEYS = 256  # keys (chunks) per request
JOB = 16  # keys per store job
ROW = 4096  # bytes per file (one row of the region)
ROWS = 64
BUDGET_ROUNDS = 4  # requests' files the budget holds
WARMUP_ROUNDS = 6  # not timed: the budget fills during the first BUDGET_ROUNDS
SIDES = ("unbounded", "max_bytes")


def one_process(rounds: int) -> dict:
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    from fakes import fake_spec_upstream

    region = mmap.mmap(-1, ROWS * ROW)  # page-aligned rows, as the CPU tier's region
    rows = memoryview(region).cast("B", (ROWS, ROW))
    root = tempfile.mkdtemp(prefix="budget-bench-033-")
    tiers = {
        side: FileSystemTierManager(
            offloading_spec=fake_spec_upstream("bench-model", num_groups=1),
            primary_kv_view=rows,
            tier_type="fs",
            root_dir=f"{root}/{side}",
            n_read_threads=4,
            n_write_threads=4,
            max_bytes=max_bytes,
        )
        for side, max_bytes in (("unbounded", None), ("max_bytes", BUDGET_ROUNDS * KEYS * ROW))
    }
    for side in SIDES:
        os.makedirs(f"{root}/{side}", mode=0o700, exist_ok=True)
    job_id = 0
    end = ScheduleEndContext((), ())

    def serve(tier, r: int) -> tuple[float, float]:
        nonlocal job_id
        keys = [make_offload_key(f"{r}-{i}".encode().ljust(32, b"\0"), 0) for i in range(KEYS)]
        ctx = ReqContext(f"req{r}")
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, 16 * (i + 1))
        cpu = wall = 0.0
        for s in range(0, KEYS, JOB):
            job_id += 1
            job = TransferJob(job_id, keys[s : s + JOB], np.arange(JOB) % ROWS, False, ctx)
            w0, c0 = time.perf_counter(), time.thread_time()
            tier.submit_store(job)
            cpu += time.thread_time() - c0
            tier._pool.wait_idle()  # the I/O: not the scheduler thread's CPU
            wall += time.perf_counter() - w0
            c0 = time.thread_time()
            results = list(tier.get_finished_jobs())
            tier.on_schedule_end(end)
            cpu += time.thread_time() - c0
            if not all(x.success for x in results):
                raise RuntimeError(f"a store job failed: {results}")
        tier.on_request_finished(ctx)
        return cpu / KEYS * 1e6, wall / KEYS * 1e6

    out: dict = {f"{side}_{m}": [] for side in SIDES for m in ("sched_cpu", "store_wall")}
    budget = tiers["max_bytes"]._budget
    try:
        if not budget.scan_done.wait(60):
            raise RuntimeError("the budget's start-up scan did not finish")
        for r in range(rounds):
            if r == WARMUP_ROUNDS:
                evicted0 = budget.evicted_files
            for side in SIDES if r % 2 else SIDES[::-1]:
                cpu, wall = serve(tiers[side], r)
                if r >= WARMUP_ROUNDS:
                    out[f"{side}_sched_cpu"].append(cpu)
                    out[f"{side}_store_wall"].append(wall)
        written = (rounds - WARMUP_ROUNDS) * KEYS
        out["evicted_share"] = (budget.evicted_files - evicted0) / written
        out["rejected_files"] = budget.rejected_files
        out["used_share"] = (budget.used + budget.unlinking) / budget.max_bytes
    finally:
        for tier in tiers.values():
            tier.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return out


def ratios(result: dict, metric: str) -> list[float]:
    return [
        b / u
        for b, u in zip(result[f"max_bytes_{metric}"], result[f"unbounded_{metric}"], strict=True)
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=5, help="processes, one after another")
    ap.add_argument("--rounds", type=int, default=16, help="rounds per process")
    ap.add_argument("--json", help="write the per-process results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds <= WARMUP_ROUNDS:
        raise SystemExit(f"--rounds must be more than {WARMUP_ROUNDS} (the warm-up)")
    if args.worker:
        json.dump(one_process(args.rounds), sys.stdout)
        return 0
    import vllm

    print(f"vllm: {os.path.dirname(vllm.__file__)}")
    print(f"load average at start: {os.getloadavg()}")
    results = []
    for p in range(args.procs):
        out = subprocess.run(
            [sys.executable, __file__, "--worker", "--rounds", str(args.rounds)],
            check=True,
            capture_output=True,
            text=True,
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(
            f"process {p}: sched_cpu ratio median "
            f"{statistics.median(ratios(r, 'sched_cpu')):.2f}, store_wall ratio median "
            f"{statistics.median(ratios(r, 'store_wall')):.2f}, evicted share "
            f"{r['evicted_share']:.2f}, rejected {r['rejected_files']}, "
            f"load {os.getloadavg()[0]:.1f}"
        )
    print(f"load average at end: {os.getloadavg()}")
    for metric in ("sched_cpu", "store_wall"):
        pooled = [x for r in results for x in ratios(r, metric)]
        per_proc = [statistics.median(ratios(r, metric)) for r in results]
        med = {
            side: statistics.median(x for r in results for x in r[f"{side}_{metric}"])
            for side in SIDES
        }
        print(
            f"{metric} us/key: unbounded median {med['unbounded']:.1f}, max_bytes median "
            f"{med['max_bytes']:.1f}; ratio median {statistics.median(pooled):.2f}, best "
            f"{min(pooled):.2f} (n={len(pooled)}; per process medians "
            f"{min(per_proc):.2f}-{max(per_proc):.2f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
