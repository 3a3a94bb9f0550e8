#!/usr/bin/env python3
"""N engines on one fs-tier root (issue 35): one max_bytes for the root vs a budget per engine.

Each engine is a process with its own FsTierBudget (the series' fs/budget.py, the code both
tracks carry) over one root of real files, driven as the tier drives it: per request a lookup
of its chunks in prompt order (the file is there and on_hit() keeps it) until the first miss,
then one store job of the rest (admit_store, admitted, the evicted files removed, the files
written, written(), finish_job), then end_step(). A request is one of HEADS shared heads
(HEAD_CHUNKS chunks, the same keys on every engine) and TAIL_CHUNKS chunks of its own, at
RATE requests per second per engine.

Arms, the same requests per engine:
  - one budget for the root: every engine max_bytes = S (the budget this tree imports: engines
    count each other's stores through their ledgers, and list the root every ROOT_RESCAN_S);
  - a budget per engine, the budget as it was before (BEFORE_REV's fs/budget.py, read from
    git): each engine counts only its own files; max_bytes = S / N each (what an operator
    had to set, and change with N) and S each (the settings unchanged as N grows).
N = 1 is the reference: one engine with the whole budget.

Reported per arm and N: root utilization (bytes of the root's files over S, sampled every
0.1 s once the root first reached 80% of S: mean, min and max), the hit rate of the shared
heads' chunks, the unreachable share of the root's bytes (files past a chunk of their prompt
that is not on disk; every 0.5 s, mean, and at the end), and each engine's store throughput
(MB/s of its store jobs' wall time). Writes JSON for report.py.
"""

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import sys
import time
from pathlib import Path

from common import QUICK, TMP, run_main, say, vllm_fingerprint

FILE_BYTES = 16 << 10
BUDGET_FILES = 512  # S, in files
HEADS, HEAD_CHUNKS, TAIL_CHUNKS = 32, 4, 4
REQUESTS = 200 if QUICK else 600
# requests per second per engine: the budget turns over in about a second at
# N = 4 (an engine's budget thread reads the others' ledgers every 50 ms)
RATE = 40
TOKENS = 16  # per chunk
RESCAN_S = 0.5
# the budget before one budget per root (the 0.34.0 overlay's, as both tracks carried it)
BEFORE_REV = "11ae58d"
BUDGET_PATH = "vllm_overlay/0.34.0/vllm/v1/kv_offload/tiering/fs/budget.py"


def budget_before():
    """BEFORE_REV's fs/budget.py as a module of its own."""
    import importlib.util
    import subprocess

    path = TMP / f"budget_{BEFORE_REV}.py"
    if not path.exists():
        src = subprocess.run(
            ["git", "show", f"{BEFORE_REV}:{BUDGET_PATH}"],
            cwd=Path(__file__).resolve().parent.parent,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        path.write_text(src)
    spec = importlib.util.spec_from_file_location("budget_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def key_of(head: int | None, owner: str, i: int) -> bytes:
    """A chunk's block hash + group 0: shared heads' the same on every engine."""
    import hashlib

    name = f"head{head}-{i}" if head is not None else f"{owner}-{i}"
    return hashlib.sha256(name.encode()).digest() + (0).to_bytes(4, "big")


def prompt_keys(rng: random.Random, engine: int, r: int) -> tuple[list[bytes], int]:
    head = rng.randrange(HEADS)
    keys = [key_of(head, "", i) for i in range(HEAD_CHUNKS)]
    keys += [key_of(None, f"e{engine}r{r}", i) for i in range(TAIL_CHUNKS)]
    return keys, head


def paths(root: str):
    def chunk_path(h: bytes, g: int) -> str:
        x = h.hex()
        return os.path.join(root, x[:3], f"{x[3:5]}_g{g}", f"{x}.bin")

    return chunk_path, lambda key: chunk_path(key[:-4], 0)


def engine(root: str, idx: int, max_bytes: int, before: bool, seed: int, out) -> None:
    from vllm.v1.kv_offload.base import OffloadKey

    if before:
        budget_module = budget_before()
    else:
        from vllm.v1.kv_offload.tiering.fs import budget as budget_module

        budget_module.ROOT_RESCAN_S = RESCAN_S
    chunk_path, key_path = paths(root)
    budget = budget_module.FsTierBudget(
        max_bytes, [FILE_BYTES], root, key_path, chunk_path, f"engine {idx}", {0: TOKENS}
    )
    budget.scan_done.wait(60)
    rng = random.Random(seed * 1000 + idx)
    data = os.urandom(FILE_BYTES)
    head_lookups = head_hits = stored = 0
    store_s = 0.0
    start = time.monotonic()
    for r in range(REQUESTS):
        time.sleep(max(0.0, start + r / RATE - time.monotonic()))
        raw, _ = prompt_keys(rng, idx, r)
        keys = [OffloadKey(k) for k in raw]
        req = f"e{idx}-r{r}"
        positions = {k: TOKENS * (i + 1) for i, k in enumerate(keys)}
        hit = 0
        for k in keys:
            if not (os.path.exists(key_path(k)) and budget.on_hit(k, req, positions)):
                break
            hit += 1
        head_lookups += HEAD_CHUNKS
        head_hits += min(hit, HEAD_CHUNKS)
        budget.end_step()
        todo = keys[hit:]
        if todo:
            t0 = time.perf_counter()
            job = budget.admit_store(todo, req, positions)
            rejected, unreachable, evicted = budget.admitted(job)
            budget.remove_evicted(evicted)
            written = [k for k in todo if k not in rejected and k not in unreachable]
            for k in written:
                path = key_path(k)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    f.write(data)
                os.rename(tmp, path)
            budget.written(job, written)
            budget.finish_job(job, [])
            store_s += time.perf_counter() - t0
            stored += len(written)
        budget.forget_request(req)
    budget.shutdown()
    out.send(
        {
            "engine": idx,
            "head_lookups": head_lookups,
            "head_hits": head_hits,
            "stored_bytes": stored * FILE_BYTES,
            "store_s": store_s,
            "rejected_files": budget.rejected_files,
        }
    )


def root_bytes(root: str) -> int:
    n = 0
    for _, _, files in os.walk(root):
        n += sum(f.endswith(".bin") for f in files)
    return n * FILE_BYTES


def prompt_chains(n: int, seed: int) -> list[list[bytes]]:
    """Every request's chunk hashes in prompt order, as the engines make them."""
    chains = []
    for idx in range(n):
        rng = random.Random(seed * 1000 + idx)
        for r in range(REQUESTS):
            keys, _ = prompt_keys(rng, idx, r)
            chains.append([k[:-4] for k in keys])
    return chains


def unreachable_share(root: str, chains: list[list[bytes]]) -> float | None:
    """Files on the root past a chunk of their prompt that is not on disk, over all its files."""
    on_disk = set()
    for _, _, files in os.walk(root):
        for f in files:
            if f.endswith(".bin"):
                with contextlib.suppress(ValueError):
                    on_disk.add(bytes.fromhex(f[:-4]))
    if not on_disk:
        return None
    bad: set[bytes] = set()
    for chain in chains:
        gap = False
        for h in chain:
            if h not in on_disk:
                gap = True
            elif gap:
                bad.add(h)
    return len(bad) / len(on_disk)


def run_arm(n: int, shared: bool, max_bytes: int, seed: int) -> dict:
    root = str(TMP / f"shared-root-{n}-{int(shared)}-{max_bytes}")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    budget = BUDGET_FILES * FILE_BYTES
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    for idx in range(n):
        received, sent = ctx.Pipe(duplex=False)
        p = ctx.Process(target=engine, args=(root, idx, max_bytes, not shared, seed, sent))
        p.start()
        pipes.append(received)
        procs.append(p)
    chains = prompt_chains(n, seed)
    samples: list[float] = []
    unreachable: list[float] = []
    filled = False
    while any(p.is_alive() for p in procs):
        used = root_bytes(root) / budget
        filled = filled or used >= 0.8
        if filled:
            samples.append(used)
            if len(samples) % 5 == 0:
                share = unreachable_share(root, chains)
                if share is not None:
                    unreachable.append(share)
        time.sleep(0.1)
    engines = [received.recv() for received in pipes]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"an engine of the N={n} run failed (exit status {p.exitcode})")
    lookups = sum(e["head_lookups"] for e in engines)
    result = {
        "n": n,
        "one_budget": shared,
        "max_bytes_each": max_bytes,
        "util_mean": sum(samples) / len(samples) if samples else None,
        "util_min": min(samples, default=None),
        "util_max": max(samples, default=None),
        "util_end": root_bytes(root) / budget,
        "head_hit_rate": sum(e["head_hits"] for e in engines) / lookups,
        "unreachable_mean": sum(unreachable) / len(unreachable) if unreachable else None,
        "unreachable": unreachable_share(root, chains),
        "mb_s_per_engine": [
            e["stored_bytes"] / e["store_s"] / 1e6 for e in engines if e["store_s"]
        ],
        "rejected_files": sum(e["rejected_files"] for e in engines),
    }
    shutil.rmtree(root, ignore_errors=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(TMP / "shared-root.json"))
    ap.add_argument("--engines", default="1,2,4")
    args = ap.parse_args()
    try:
        from vllm.v1.kv_offload.tiering.fs import budget as budget_module
    except ImportError as e:
        Path(args.out).write_text(json.dumps({"skipped": f"no fs-tier budget here ({e})"}))
        return 0
    if not hasattr(budget_module, "ROOT_RESCAN_S"):
        Path(args.out).write_text(json.dumps({"skipped": "this budget does not list the root"}))
        return 0
    TMP.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    runs = []
    budget = BUDGET_FILES * FILE_BYTES
    for n in [int(x) for x in args.engines.split(",")]:
        arms = [(True, budget)]
        if n > 1:
            arms += [(False, budget // n), (False, budget)]
        for shared, max_bytes in arms:
            runs.append(run_arm(n, shared, max_bytes, seed=1))
            r = runs[-1]
            say(
                f"N={n} {'one budget' if shared else 'budget per engine'}, max_bytes "
                f"S/{budget // max_bytes}: utilization "
                f"{r['util_mean'] or 0:.0%} mean "
                f"({r['util_min'] or 0:.0%}-{r['util_max'] or 0:.0%}), "
                f"head hits {r['head_hit_rate']:.0%}, unreachable {r['unreachable'] or 0:.1%}"
            )
    import vllm

    fp = vllm_fingerprint(os.path.dirname(vllm.__file__))
    Path(args.out).write_text(
        json.dumps(
            {
                "fingerprint": fp,
                "workload": {
                    "file_bytes": FILE_BYTES,
                    "budget_files": BUDGET_FILES,
                    "heads": HEADS,
                    "head_chunks": HEAD_CHUNKS,
                    "tail_chunks": TAIL_CHUNKS,
                    "requests_per_engine": REQUESTS,
                    "rescan_s": RESCAN_S,
                },
                "runs": runs,
                "seconds": time.monotonic() - t0,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    run_main(main)
