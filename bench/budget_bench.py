#!/usr/bin/env python3
"""The fs_python tier's byte budget (max_bytes, issue 19): its cost beside the unbounded tier.

Runs on the vLLM this interpreter imports (the patched side: .venv or BENCH_PATCHED_SITE), both
tiers in this one process, rounds interleaved (the order alternates):
- scheduler: the per-key cost of the scheduler-side calls through the real connector scheduler
  (OffloadingConnectorScheduler over a TieringOffloadingManager, its CPU tier and the fs_python
  tier): requests of REQ_BLOCKS new blocks stored one after another, over a budget of a quarter
  of the workload (once full, every store evicts) vs no budget. Timed: every connector call the
  engine makes, and the take_events() that collects the tier's finished jobs once the tier's
  I/O (untimed, between the calls) is done. Wall time (what the engine waits, with the I/O
  threads' competition for the GIL) and the scheduler thread's CPU time (time.thread_time);
- store: steady-state store throughput of the tier alone (store jobs of 64 KiB rows, 8 read
  and 8 write threads, all taking store tasks) at a full budget (every round evicts as many
  files as it writes; the budgeted side's time includes removing the files it evicted, see
  settle()) vs unbounded. "full" says the timed rounds were at a full budget: after each, the
  budget's bytes at or above its low-water mark (the budget evicts ahead from HIGH_WATER down
  to LOW_WATER percent of max_bytes, so at rest it is between the two, never at max_bytes),
  and the rounds evicted at least 90% of the files they wrote;
- floor: raw writes of the same files with vs without removing as many older ones: what a
  removal costs this disk by itself, the bound of the store ratio.
Writes JSON for report.py; {"skipped": why} when the tree's fs tier has no max_bytes.
"""

import argparse
import hashlib
import inspect
import json
import mmap
import os
import shutil
import statistics
import time
from types import SimpleNamespace

from common import QUICK, TMP, run_main, run_tasks, say, vllm_fingerprint

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: E402
    OffloadingConnectorScheduler,
)
from vllm.v1.kv_offload.base import ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.tiering.base import JobMetadata  # noqa: E402
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import (  # noqa: E402
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from fakes import BLOCK_SIZE, fake_spec  # noqa: E402

SIDES = ("unbounded", "max_bytes")
REQ_BLOCKS = 256  # blocks (keys) per request
ROW_BYTES = 4096  # CPU tier rows = fs tier files of the scheduler case
STORE_ROW = 65536  # files of the store-throughput case


def settle(tier) -> None:
    """Wait until the tier's budget has no background work left (files evicted ahead still to
    remove), so that it does not run into the other side's timing."""
    budget = getattr(tier, "_budget", None)
    deadline = time.monotonic() + 60
    while budget is not None and (
        getattr(budget, "unlinking", 0) or getattr(budget, "_to_unlink", None)
    ):
        if time.monotonic() > deadline:
            raise RuntimeError("the budget's removals did not finish in 60 s")
        time.sleep(0.0005)


class Request:
    """The attributes of vllm.v1.request.Request that the connector scheduler reads."""

    def __init__(self, req_id: str, block_hashes: list[bytes]):
        self.request_id = req_id
        self.kv_transfer_params = None
        self.block_hashes = block_hashes
        self.num_tokens = len(block_hashes) * BLOCK_SIZE
        self.num_computed_tokens = 0
        self.finished = False

    def is_finished(self) -> bool:
        return self.finished


class SchedSide:
    """A connector scheduler over a CPU tier and an fs_python tier (with or without a budget),
    timing the connector calls (seconds, keys) of the requests it serves."""

    def __init__(self, name: str, root: str, max_bytes: int | None, cpu_blocks: int):
        region = SharedOffloadRegion(
            instance_id=f"bench-budget-{os.getpid()}-{name}",
            total_size_bytes=ROW_BYTES * cpu_blocks,
            num_blocks=cpu_blocks,
            rank=None,
            num_workers=1,
            cpu_page_size=ROW_BYTES,
        )
        primary = CPUPrimaryTierOffloadingManager(num_blocks=cpu_blocks, mmap_region=region)
        self.tier = FileSystemTierManager(
            fake_spec(1),
            primary.get_kv_memoryview(),
            "fs_python",
            root_dir=root,
            n_read_threads=2,
            n_write_threads=2,
            max_bytes=max_bytes,
        )
        manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[self.tier])
        self.sched = OffloadingConnectorScheduler(fake_spec(1, manager))
        self.seconds, self.cpu_seconds, self.keys = 0.0, 0.0, 0

    def timed(self, fn, *args):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args)
        if fn == self.sched.take_events:
            out = list(out)
        self.cpu_seconds += time.thread_time() - c0
        self.seconds += time.perf_counter() - t0
        return out

    def serve(self, req_id: str, block_hashes: list[bytes]) -> None:
        sched = self.sched
        req = Request(req_id, block_hashes)
        hit, _ = self.timed(sched.get_num_new_matched_tokens, req, 0)
        if hit:
            raise RuntimeError(f"{req_id}: unexpected hit of {hit} tokens")
        block_ids = (list(range(1, len(block_hashes) + 1)),)
        out = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=block_ids)],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], new_block_ids=[], resumed_req_ids=set()
            ),
            num_scheduled_tokens={req_id: req.num_tokens},
            preempted_req_ids=None,
        )
        meta = self.timed(sched.build_connector_meta, out)
        done = OffloadingWorkerMetadata()
        for job_id in meta.store_jobs:
            done.mark_completed(job_id)
        self.timed(sched.update_connector_output, KVConnectorOutput(kv_connector_worker_meta=done))
        self.timed(sched.take_events)
        req.finished = True
        self.timed(sched.request_finished, req)
        # the cascade to disk runs untimed (the I/O threads' time is not the scheduler's);
        # then one engine step (timed) collects the finished jobs
        self.tier._pool.wait_idle()
        self.timed(sched.take_events)
        if self.tier._pool._finished_q:
            raise RuntimeError("the fs tier's finished jobs were not collected")
        self.keys += len(block_hashes)

    def shutdown(self) -> None:
        self.sched.shutdown()


def hashes(n: int, salt: str) -> list[bytes]:
    return [hashlib.sha256(f"{salt}-{i}".encode()).digest() for i in range(n)]


def sched_case(root: str, rounds: int, reqs_per_round: int) -> dict:
    total_keys = (rounds + 1) * reqs_per_round * REQ_BLOCKS
    max_bytes = total_keys // 4 * ROW_BYTES
    sides = {
        name: SchedSide(name, f"{root}/sched-{name}", mb, 2 * REQ_BLOCKS)
        for name, mb in (("unbounded", None), ("max_bytes", max_bytes))
    }
    out: dict = {name: [] for name in SIDES}
    out.update({f"{name}_cpu": [] for name in SIDES})
    try:
        for r in range(rounds + 1):  # round 0 warms up (and fills a third of the budget)
            for name in SIDES if r % 2 == 0 else SIDES[::-1]:
                side = sides[name]
                side.seconds, side.cpu_seconds, side.keys = 0.0, 0.0, 0
                for i in range(reqs_per_round):
                    side.serve(f"r{r}-{i}", hashes(REQ_BLOCKS, f"{name}-{r}-{i}"))
                settle(side.tier)  # untimed: the budget's work does not run into the other side
                if r:
                    out[name].append(side.seconds / side.keys * 1e6)
                    out[f"{name}_cpu"].append(side.cpu_seconds / side.keys * 1e6)
        budget = sides["max_bytes"].tier._budget
        out["evicted_files"] = budget.evicted_files
        out["budget_bytes"] = max_bytes
        out["used_bytes"] = budget.used
    finally:
        for side in sides.values():
            side.shutdown()
    return out


def store_case(root: str, rounds: int, jobs: int, keys_per_job: int) -> dict:
    region = mmap.mmap(-1, keys_per_job * STORE_ROW)
    rows = np.frombuffer(region, dtype=np.uint8).reshape(keys_per_job, STORE_ROW)
    rows[:] = 7
    max_files = 4 * jobs * keys_per_job
    tiers = {
        name: FileSystemTierManager(
            fake_spec(1),
            memoryview(rows),
            "fs_python",
            root_dir=f"{root}/store-{name}",
            n_read_threads=8,
            n_write_threads=8,
            max_bytes=mb,
        )
        for name, mb in (("unbounded", None), ("max_bytes", max_files * STORE_ROW))
    }
    counter = [0]
    cpu_us: list[float] = []
    ctx = ReqContext(req_id="bench")

    def run(tier, n_jobs: int) -> float:
        """n_jobs store jobs of keys_per_job new keys (a chain, touched in prompt order);
        keys/s from the first submit to the last result; the process's CPU time per key
        (all threads, user and system: the other side is idle meanwhile) into cpu_us."""
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n_jobs):
            keys = []
            for _ in range(keys_per_job):
                counter[0] += 1
                keys.append(make_offload_key(counter[0].to_bytes(32, "big"), 0))
            tier.touch(keys, ctx)
            tier.submit_store(
                JobMetadata(
                    job_id=counter[0],
                    keys=keys,
                    block_ids=np.arange(keys_per_job, dtype=np.int64),
                    is_promotion=False,
                    req_context=ctx,
                )
            )
        pending = n_jobs
        while pending:
            for result in tier.get_finished():
                if not result.success:
                    raise OSError("the fs tier reported a failed store")
                pending -= 1
            time.sleep(0.0005)
        settle(tier)  # timed: the files the budget evicted ahead are removed too
        cpu_us.append((time.process_time() - c0) / (n_jobs * keys_per_job) * 1e6)
        return n_jobs * keys_per_job / (time.perf_counter() - t0)

    out: dict = {name: [] for name in SIDES}
    budget = tiers["max_bytes"]._budget
    # at rest a full budget is between its low- and high-water marks (see the docstring)
    from vllm.v1.kv_offload.tiering.fs import budget as budget_module

    low = budget.max_bytes * getattr(budget_module, "LOW_WATER", 100) // 100
    rest: list[int] = []  # the budget's bytes after each timed round
    try:
        for tier in tiers.values():  # fill the budget (and as much unbounded)
            for _ in range(5):
                run(tier, jobs)
        evicted0 = budget.evicted_files
        for r in range(rounds):
            for name in SIDES if r % 2 == 0 else SIDES[::-1]:
                out[name].append(run(tiers[name], jobs))
                out.setdefault(f"{name}_cpu", []).append(cpu_us[-1])
                if name == "max_bytes":
                    rest.append(budget.used + budget.unlinking)
        written = rounds * jobs * keys_per_job
        out["evicted_files"] = budget.evicted_files
        out["evicted_share"] = (budget.evicted_files - evicted0) / written
        out["min_used_share"] = min(rest) / budget.max_bytes
        out["full"] = min(rest) >= low - keys_per_job * STORE_ROW and out["evicted_share"] >= 0.9
    finally:
        for tier in tiers.values():
            tier.shutdown()
    return out


def removal_floor(root: str, rounds: int, files: int) -> dict:
    """What removing files costs this disk by itself: raw writes of STORE_ROW files (temp file
    + rename, O_DIRECT, 8 threads, the tier's pattern) vs the same writes plus the removal of as
    many older files (as tasks of the same threads, as the budget's removals run), keeping
    4 * files; rounds interleaved. A budget at its limit removes a file for every file it
    writes: its store throughput over the unbounded tier's cannot beat this ratio."""
    row = mmap.mmap(-1, STORE_ROW)
    row.write(b"\7" * STORE_ROW)
    view = memoryview(row)
    direct = getattr(os, "O_DIRECT", 0)
    keep = 4 * files
    nxt = {"plain": 0, "removing": 0}

    def path(side: str, i: int) -> str:
        h = hashlib.sha256(str(i).encode()).hexdigest()
        return f"{root}/floor-{side}/{h[:2]}/{h}.bin"

    def write(p: str) -> None:
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | direct
        try:
            fd = os.open(p + ".tmp", flags, 0o600)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(p), mode=0o700, exist_ok=True)
            fd = os.open(p + ".tmp", flags, 0o600)
        try:
            os.writev(fd, [view])
        finally:
            os.close(fd)
        os.rename(p + ".tmp", p)

    def task(side: str, i: int) -> None:
        if i < 0:  # a removal
            os.unlink(path(side, -i - 1))
        else:
            write(path(side, i))

    def run(side: str) -> float:
        first = nxt[side]
        nxt[side] += files
        tasks = []
        for i in range(first, first + files):
            tasks.append(i)
            if side == "removing" and i >= keep:
                tasks.append(-(i - keep) - 1)
        return files / run_tasks(len(tasks), lambda j: task(side, tasks[j]), 8)

    out: dict = {"plain": [], "removing": []}
    for side in out:  # fill to keep
        while nxt[side] < keep:
            run(side)
    for r in range(rounds):
        for side in ("plain", "removing") if r % 2 == 0 else ("removing", "plain"):
            out[side].append(run(side))
    return out


def sched_repeats(n: int) -> int:
    """The scheduler case of `make bench` (8 rounds of 6 requests), n times: the goal's
    ratio of bests, and the ratio of medians, of each run."""
    root = str(TMP / "budget-sched")
    for i in range(n):
        shutil.rmtree(root, ignore_errors=True)
        out = sched_case(root, 8, 6)
        with_b, without = out["max_bytes"], out["unbounded"]
        best = min(with_b) / min(without)
        median = statistics.median(with_b) / statistics.median(without)
        say(f"run {i + 1}/{n}: with / without a budget, best {best:.3f}, median {median:.3f}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(TMP / "budget.json"))
    ap.add_argument("--sched-repeats", type=int, default=0, metavar="N",
                    help="only the scheduler case, N times: how its ratios spread")
    args = ap.parse_args()
    if args.sched_repeats:
        return sched_repeats(args.sched_repeats)
    import vllm

    result: dict = {"fingerprint": vllm_fingerprint(os.path.dirname(vllm.__file__))}
    if "max_bytes" not in inspect.signature(FileSystemTierManager).parameters:
        result["skipped"] = "this tree's fs_python tier has no max_bytes setting"
        say(f"budget: skipped ({result['skipped']})")
    else:
        root = str(TMP / "budget")
        shutil.rmtree(root, ignore_errors=True)
        t0 = time.monotonic()
        rounds = 2 if QUICK else 8
        say(f"budget: scheduler side, max_bytes vs unbounded, {rounds} interleaved rounds")
        result["sched"] = sched_case(root, rounds, 2 if QUICK else 6)
        say(f"budget: store throughput at a full budget vs unbounded, {rounds} rounds")
        result["store"] = store_case(root, rounds, 10 if QUICK else 30, 8)
        say(f"budget: raw writes with vs without removals (this disk's floor), {rounds} rounds")
        result["floor"] = removal_floor(root, rounds, (10 if QUICK else 30) * 8)
        result["seconds"] = time.monotonic() - t0
        shutil.rmtree(root, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
