#!/usr/bin/env python3
"""Per-group block files through either track's compiled I/O: the evidence for issue 34's plan
to share one io.py/fs_io.cpp (docs/series.md, "One fs tier").

A KV cache group's file holds its byte runs of a CPU row (the fork's 0034: only the group's
bytes). The fork gathers and scatters the runs in C, one call per block (fs_io_C.store_new_block
and load_block); the 0.34.0 track's fs_io_C takes one call per job of contiguous buffers. The
plan keeps per-group files on the shared code by gathering a job's runs into a page-aligned
per-thread buffer in Python, then one batch call (and the reverse on load). This measures the
three ways side by side, each in the venv that has its fs_io_C:

- fork-c:       .venv (0.22.1): per block, runs gathered/scattered in C;
- batch-gather: .venv-0.34.0: per job, runs gathered/scattered in Python around one C call;
- batch-rows:   .venv-0.34.0: per job, whole rows (what 0.34.0 stores today: no gather, but
                every group's file is the whole row).

Rows of ROW_KIB with GROUPS groups, each group's bytes RUNS runs spread over the row (as
HMA layouts interleave groups in the tensors they share); a round stores then loads
ROWS x GROUPS files with THREADS threads, jobs of JOB_BLOCKS blocks, buffered I/O (the page
cache: what differs between the arms is CPU and GIL time, not the disk). Rounds alternate
between the arms (each a subprocess); per arm the median store and load MB/s of group bytes.

    .venv/bin/python bench/io_gather.py [--rounds 5] [--runs 8]

Since the fork's patch 0064 carried this plan out, the fork-c arm runs only at a commit before
it (results: bench/results/2026-12-05-vm-io-gather.md).
"""

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

ROW_KIB, GROUPS, RUNS = 256, 4, 8
ROWS, THREADS, JOB_BLOCKS = 256, 8, 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENVS = {"fork-c": ".venv", "batch-gather": ".venv-0.34.0", "batch-rows": ".venv-0.34.0"}


def layout() -> list[list[tuple[int, int]]]:
    """Per group, its (offset, length) runs in a row: RUNS runs, groups interleaved."""
    run = ROW_KIB * 1024 // (GROUPS * RUNS)
    return [[((r * GROUPS + g) * run, run) for r in range(RUNS)] for g in range(GROUPS)]


def jobs(root: str) -> list[list[tuple[str, int, int]]]:
    """(path, row, group) of every file, in jobs of JOB_BLOCKS."""
    files = [
        (os.path.join(root, f"{row % 64:02x}", f"{row:05d}_g{g}.bin"), row, g)
        for row in range(ROWS)
        for g in range(GROUPS)
    ]
    return [files[i : i + JOB_BLOCKS] for i in range(0, len(files), JOB_BLOCKS)]


def run_threads(work, job_list) -> float:
    queue = list(job_list)
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                job = queue.pop()
            work(job)

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def arm_fork_c(rows: memoryview, runs):
    from vllm import fs_io_C

    if not hasattr(fs_io_C, "store_new_block"):
        raise SystemExit(
            "the fork's per-block fs_io_C is gone since its patch 0064 (the fork now runs the "
            "batch-gather arm's code): run this arm at a commit before it"
        )

    size = sum(n for _, n in runs[0])
    row_bytes = ROW_KIB * 1024

    def store(job):
        for path, row, g in job:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            rc = fs_io_C.store_new_block(
                path + ".tmp",
                path,
                rows,
                row * row_bytes,
                size,
                runs[g],
                False,
                0o600,
                False,
                None,
                b"",
            )
            if rc != 0:
                raise OSError(-rc if rc < 0 else 0, f"store_new_block: {rc}")

    def load(job):
        for path, row, g in job:
            rc = fs_io_C.load_block(path, rows, row * row_bytes, size, runs[g], False, None, b"")
            if rc != 0:
                raise OSError(-rc, f"load_block: {rc}")

    return store, load


def arm_batch(rows: memoryview, runs, gather: bool):
    from vllm.fs_io_C import batch_load_block, batch_store_block

    row_bytes = ROW_KIB * 1024
    size = sum(n for _, n in runs[0]) if gather else row_bytes
    local = threading.local()

    def bounce() -> memoryview:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(mmap.mmap(-1, JOB_BLOCKS * size))
        return buf

    def views(job) -> list[memoryview]:
        if not gather:
            return [rows[row * row_bytes : row * row_bytes + size] for _, row, _ in job]
        buf, out = bounce(), []
        for i, (_, row, g) in enumerate(job):
            pos = i * size
            for offset, n in runs[g]:
                start = row * row_bytes + offset
                buf[pos : pos + n] = rows[start : start + n]
                pos += n
            out.append(buf[i * size : (i + 1) * size])
        return out

    def store(job):
        for path, _, _ in job:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        paths = [p for p, _, _ in job]
        batch_store_block([p + ".tmp" for p in paths], paths, views(job), False, 0o600, 0o700)

    def load(job):
        if not gather:
            batch_load_block([p for p, _, _ in job], views(job), False)
            return
        buf = bounce()
        slices = [buf[i * size : (i + 1) * size] for i in range(len(job))]
        batch_load_block([p for p, _, _ in job], slices, False)
        for i, (_, row, g) in enumerate(job):
            pos = i * size
            for offset, n in runs[g]:
                start = row * row_bytes + offset
                rows[start : start + n] = buf[pos : pos + n]
                pos += n

    return store, load


def one_round(arm: str, root: str) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    rows = memoryview(mmap.mmap(-1, ROWS * ROW_KIB * 1024))
    rows[:] = os.urandom(len(rows))
    runs = layout()
    if arm == "fork-c":
        store, load = arm_fork_c(rows, runs)
    else:
        store, load = arm_batch(rows, runs, gather=arm == "batch-gather")
    expected = bytes(rows)
    store_s = run_threads(store, jobs(root))
    rows[:] = bytes(len(rows))  # the loads must write every byte back
    load_s = run_threads(load, jobs(root))
    if bytes(rows) != expected:
        raise SystemExit(f"{arm}: the rows loaded back differ from those stored")
    group_bytes = ROWS * ROW_KIB * 1024  # every group's bytes of every row, once
    shutil.rmtree(root, ignore_errors=True)
    return {"store_mbs": group_bytes / store_s / 1e6, "load_mbs": group_bytes / load_s / 1e6}


def main() -> None:
    global RUNS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=8, help="runs per group and row")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=os.path.join(ROOT, "build", "bench-tmp", "io_gather"))
    args = ap.parse_args()
    RUNS = args.runs
    if args.arm:  # one round of one arm, in its venv
        print(json.dumps(one_round(args.arm, args.root)))
        return
    results: dict[str, list[dict]] = {arm: [] for arm in VENVS}
    for r in range(args.rounds):
        order = list(VENVS)[r % 3 :] + list(VENVS)[: r % 3]
        for arm in order:
            python = os.path.join(ROOT, VENVS[arm], "bin", "python")
            out = (
                subprocess.run(
                    [python, __file__, "--arm", arm, "--root", args.root, "--runs", str(RUNS)],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            results[arm].append(json.loads(out))
    print(
        f"load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds; rows of "
        f"{ROW_KIB} KiB, {GROUPS} groups of {RUNS} runs; {THREADS} threads, jobs of "
        f"{JOB_BLOCKS} blocks; MB/s of group bytes (median, min-max)"
    )
    for arm, rounds in results.items():
        cols = []
        for key in ("store_mbs", "load_mbs"):
            vals = [x[key] for x in rounds]
            cols.append(f"{statistics.median(vals):7.0f} ({min(vals):.0f}-{max(vals):.0f})")
        print(f"  {arm:13s} store {cols[0]}   load {cols[1]}")


if __name__ == "__main__":
    sys.exit(main())
