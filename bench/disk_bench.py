#!/usr/bin/env python3
"""Disk tier: the fs_python tier's store/load throughput vs raw file-per-block I/O, and HMA cost.

Runs on the vLLM this interpreter imports (.venv: the patched tree). Both sides use the same
directory tree (the tier's own FileMapper paths, under tier/ and raw/), the same number of
threads and the same page-aligned buffer. Directories are created beforehand (steady state of
a long-lived cache); files are deleted between rounds. Before every load, the files' pages are
dropped from the page cache (fsync + POSIX_FADV_DONTNEED), so buffered reads hit the disk too.
The raw reference uses O_DIRECT when the row allows it (page-aligned rows), else buffered I/O,
as the tier does. Throughput counts the payload bytes (the KV data), not the padding.

Sections: rows of 4 KiB - 4 MiB (one KV cache group: the file sizes blocks_per_chunk
reaches), then equal bytes per token stored as 1, 2 or 4 KV cache groups (G files per chunk
through the tier and raw, and raw one file per chunk: the G rows at page-aligned offsets,
written with one writev, loaded whole or one row per key by offset), then the cost of the
tier's integrity check (the tier as configured by default where its default checks blocks, else
with checksum "xxh3_64", vs the same tier with checksum "none" twice: the second "none" is an
A/A control that shows the noise floor). Every section rotates its sides' order per round
(common.round_order()): every side runs in every position.
"""

import argparse
import hashlib
import itertools
import json
import logging
import mmap
import os
import shutil
import time

from common import (
    QUICK,
    TMP,
    BenchError,
    fmt_bytes,
    round_order,
    run_main,
    run_tasks,
    say,
    vllm_fingerprint,
)

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering import base as tiering_base  # noqa: E402
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager  # noqa: E402

from fakes import fake_spec, fake_spec_upstream  # noqa: E402

# The 0.34.0 track's tier ("fs": its C batch path where built) takes TransferJob and answers
# get_finished_jobs(); 0.22.1's ("fs_python") JobMetadata and get_finished().
TRACK_UPSTREAM = hasattr(tiering_base, "TransferJob")
TIER_TYPE = "fs" if TRACK_UPSTREAM else "fs_python"

# A tier that fails every block logs an error per block; the job result says it failed.
# (Set after importing vLLM: its logging config resets the levels of existing loggers.)
logging.getLogger("vllm.v1.kv_offload.tiering.fs").setLevel(logging.CRITICAL)

O_DIRECT = getattr(os, "O_DIRECT", 0)
PAGE = mmap.PAGESIZE
GOAL_ROWS = (64 << 10, 256 << 10)  # the row sizes issue 20's goal 2 names
JOB_CHUNKS = 16  # chunks per job: a 4,096-token prompt in 256-token chunks
# raw stores that publish atomically: side -> raw_io()'s publish
PUBLISH = {"raw_atomic": "rename", "raw_linkat": "linkat"}


def no_check(check):
    """The value of a tier's _checksum that checks nothing: 0.34.0's bool, or 0.22.1's
    check object (None)."""
    return False if isinstance(check, bool) else None


class Point:
    """One measured configuration: a primary buffer of `rows` rows, a tier and raw files."""

    def __init__(
        self,
        root: str,
        row_bytes: int,
        payload: int,
        chunks: int,
        groups: int,
        threads: int,
        tier_config: dict | None = None,
    ):
        self.row_bytes, self.payload, self.groups = row_bytes, payload, groups
        self.rows = chunks * groups
        self.buf = mmap.mmap(-1, self.rows * row_bytes)  # page-aligned
        arr = np.frombuffer(self.buf, dtype=np.uint8).reshape(self.rows, row_bytes)
        pattern = np.frombuffer(np.random.default_rng(row_bytes).bytes(1 << 20), np.uint8)
        flat_arr = arr.reshape(-1)
        for start in range(0, flat_arr.size, pattern.size):
            chunk = flat_arr[start : start + pattern.size]
            chunk[:] = pattern[: chunk.size]
            pattern = np.roll(pattern, 4099)  # no two rows alike
        self.arr = arr
        self.reference = arr.copy()
        self.view = memoryview(arr)
        self.flat = memoryview(self.buf)
        tier_root = os.path.join(root, "tier")
        if TRACK_UPSTREAM and groups != 1:
            raise BenchError("the 0.34.0 track's tier is measured with one group only")
        self.tier = FileSystemTierManager(
            fake_spec_upstream() if TRACK_UPSTREAM else fake_spec(groups),
            self.view,
            TIER_TYPE,
            root_dir=tier_root,
            n_read_threads=threads // 2,
            n_write_threads=threads - threads // 2,
            **(tier_config or {}),
        )
        # the patched tier decides (0.34.0: _use_o_direct)
        self.direct = getattr(self.tier, "_direct_io", getattr(self.tier, "_use_o_direct", True))
        # chunk c, group g -> row c * groups + g (a chunk's G keys are adjacent)
        hashes = [
            hashlib.sha256(f"{row_bytes}-{groups}-{c}".encode()).digest() for c in range(chunks)
        ]
        self.keys = [make_offload_key(h, g) for h in hashes for g in range(groups)]
        self.tier_paths = [self.tier.file_mapper.get_file_name(k) for k in self.keys]
        raw_root = os.path.join(root, "raw")
        self.raw_paths = [p.replace(tier_root, raw_root, 1) for p in self.tier_paths]
        for p in {os.path.dirname(p) for p in self.tier_paths + self.raw_paths}:
            os.makedirs(p, exist_ok=True)
        # one file per chunk (the HMA layout alternative), in group 0's key's place
        chunk_root = os.path.join(root, "chunk")
        self.chunk_paths = [
            p.replace(raw_root, chunk_root, 1) for p in self.raw_paths[:: self.groups]
        ]
        self.chunk_dirs_made = False  # made by the first chunk round (only the HMA section)
        # the raw reference writes only the payload: O_DIRECT when it is page-sized
        self.raw_direct = payload % PAGE == 0 and O_DIRECT != 0
        self.threads = threads
        self._job = itertools.count()
        self.proc_fds: int | None = None  # /proc/self/fd, opened by the first linkat side

    # -- the fs tier, driven as TieringOffloadingManager drives it
    def tier_io(self, is_load: bool) -> float:
        """Every row in jobs of JOB_CHUNKS chunks (a request's share of a step), submitted at
        once, as concurrent requests do: the 0.34.0 tier runs a job as one task (its C
        batch), 0.22.1's a task per key; either spreads over the I/O threads."""
        per_job = JOB_CHUNKS * self.groups
        jobs = []
        for start in range(0, self.rows, per_job):
            job_id = next(self._job)
            keys = self.keys[start : start + per_job]
            rows = np.arange(start, start + len(keys), dtype=np.int64)
            ctx = ReqContext(req_id=f"bench-{job_id}")
            if TRACK_UPSTREAM:
                job = tiering_base.TransferJob(job_id, keys, rows, is_load, ctx)
            else:
                job = tiering_base.JobMetadata(job_id, keys, rows, is_load, ctx)
            jobs.append(job)
        finished = self.tier.get_finished_jobs if TRACK_UPSTREAM else self.tier.get_finished
        submit = self.tier.submit_load if is_load else self.tier.submit_store
        waiting = {job.job_id for job in jobs}
        t0 = time.perf_counter()
        for job in jobs:
            submit(job)
        failed = False
        while waiting:
            for r in finished():
                if r.job_id in waiting:
                    waiting.discard(r.job_id)
                    failed |= not r.success
            if waiting:
                time.sleep(0.001)
        took = time.perf_counter() - t0
        if failed:
            raise OSError("the fs tier reported a failed job")
        return took

    def unchecked_tier_io(self, is_load: bool) -> float:
        """tier_io() with the tier's integrity check off (as raw I/O checks nothing): the
        tier's own cost, which goal 2 judges; goal 4 prices the check itself."""
        check = self.tier._checksum
        self.tier._checksum = no_check(check)
        try:
            return self.tier_io(is_load)
        finally:
            self.tier._checksum = check

    # -- raw file-per-block I/O, same threads
    def raw_io(self, is_load: bool, serial_chunks: bool = False, publish: str = "") -> float:
        """publish: how each store makes its file appear whole, as any atomic publish must
        (a reader never sees a partial file, a killed writer leaves none; neither side
        fsyncs, as the tier does not): "rename" writes a temporary name and renames it into
        place; "linkat" writes an unnamed O_TMPFILE and links it into place (no name to
        clean up after a crash; linkat fails if the name exists). The disk's own cost of
        either, measured beside plain raw writes."""
        flags = O_DIRECT if self.raw_direct else 0
        rb, n, flat, paths = self.row_bytes, self.payload, self.flat, self.raw_paths
        if publish == "linkat" and self.proc_fds is None:
            # an O_TMPFILE is linked into place by its fd's name there
            self.proc_fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)

        def store(i: int) -> None:
            if publish == "linkat":
                fd = os.open(os.path.dirname(paths[i]), os.O_TMPFILE | os.O_WRONLY | flags, 0o644)
            else:
                path = paths[i] + ".tmp" if publish == "rename" else paths[i]
                fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | flags, 0o644)
            try:
                if os.write(fd, flat[i * rb : i * rb + n]) != n:
                    raise OSError("short write")
                if publish == "linkat":  # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/<fd>
                    os.link(str(fd), paths[i], src_dir_fd=self.proc_fds)
            finally:
                os.close(fd)
            if publish == "rename":
                os.rename(path, paths[i])

        def load(i: int) -> None:
            fd = os.open(paths[i], os.O_RDONLY | flags)
            try:
                if os.readv(fd, [flat[i * rb : i * rb + n]]) != n:
                    raise OSError("short read")
            finally:
                os.close(fd)

        fn = load if is_load else store
        g = self.groups
        if serial_chunks:  # one task per chunk: its G files one after the other
            n_tasks = self.rows // g

            def task(c: int) -> None:
                for i in range(c * g, (c + 1) * g):
                    fn(i)
        else:
            n_tasks, task = self.rows, fn
        return run_tasks(n_tasks, task, self.threads)

    # -- raw one-file-per-chunk layout: a chunk's G rows in one file at page-aligned offsets
    def chunk_io(self, is_load: bool, by_group: bool = False) -> float:
        """Store: one writev per chunk. Load: one preadv of the whole chunk, or (by_group)
        one task per key that opens the chunk file and preads its group's row at its offset,
        as a per-key tier would serve a key of such a file."""
        flags = O_DIRECT if self.raw_direct else 0
        rb, n, g, flat, paths = (
            self.row_bytes,
            self.payload,
            self.groups,
            self.flat,
            self.chunk_paths,
        )
        slot = -(-n // PAGE) * PAGE  # group j's row starts at j * slot

        def rows(c: int) -> list:
            return [flat[i * rb : i * rb + n] for i in range(c * g, (c + 1) * g)]

        def store(c: int) -> None:
            fd = os.open(paths[c], os.O_CREAT | os.O_WRONLY | os.O_TRUNC | flags, 0o644)
            try:
                if slot == n:
                    if os.writev(fd, rows(c)) != g * n:
                        raise OSError("short write")
                else:
                    for j, row in enumerate(rows(c)):
                        if os.pwrite(fd, row, j * slot) != n:
                            raise OSError("short write")
            finally:
                os.close(fd)

        def load_chunk(c: int) -> None:
            fd = os.open(paths[c], os.O_RDONLY | flags)
            try:
                if slot == n:
                    if os.preadv(fd, rows(c), 0) != g * n:
                        raise OSError("short read")
                else:
                    for j, row in enumerate(rows(c)):
                        if os.preadv(fd, [row], j * slot) != n:
                            raise OSError("short read")
            finally:
                os.close(fd)

        def load_key(i: int) -> None:
            fd = os.open(paths[i // g], os.O_RDONLY | flags)
            try:
                if os.preadv(fd, [flat[i * rb : i * rb + n]], (i % g) * slot) != n:
                    raise OSError("short read")
            finally:
                os.close(fd)

        if not is_load:
            return run_tasks(self.rows // g, store, self.threads)
        if by_group:
            return run_tasks(self.rows, load_key, self.threads)
        return run_tasks(self.rows // g, load_chunk, self.threads)

    def evict(self, paths: list[str]) -> None:
        os.sync()  # write back buffered files, so that their pages can be dropped
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def drop(self, paths: list[str]) -> None:
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def round_trip(self, side: str) -> tuple[float, float]:
        """Store every row, drop it from memory, load it back and check it; (store s, load s)."""
        paths = {
            "tier": self.tier_paths,
            "tier_nocheck": self.tier_paths,
            "chunk": self.chunk_paths,
            "chunk_by_group": self.chunk_paths,
        }.get(side, self.raw_paths)
        self.drop(paths)
        if side.startswith("chunk") and not self.chunk_dirs_made:
            for p in {os.path.dirname(p) for p in self.chunk_paths}:
                os.makedirs(p, exist_ok=True)
            self.chunk_dirs_made = True
        # Commit the deletes (this side's and the previous side's) before the timed store:
        # else the store pays for them (the journal commit, and on a `discard` mount the
        # discards of the freed blocks), a cost of the bench's order, not of either side.
        os.sync()
        if side == "tier":
            io = self.tier_io
        elif side == "tier_nocheck":
            io = self.unchecked_tier_io
        elif side.startswith("chunk"):
            io = lambda is_load: self.chunk_io(is_load, by_group=side == "chunk_by_group")  # noqa: E731
        else:
            io = lambda is_load: self.raw_io(  # noqa: E731
                is_load, serial_chunks=side == "raw_serial", publish=PUBLISH.get(side, "")
            )
        c0 = time.process_time()
        t_store = io(False)
        c1 = time.process_time()
        self.evict(paths)
        self.arr[:] = 0
        c2 = time.process_time()
        t_load = io(True)
        # CPU seconds of the whole process (every thread): steadier than wall time on a
        # shared machine, and what a check on the I/O threads costs where the CPUs are busy
        self.cpu = (c1 - c0, time.process_time() - c2)
        if not np.array_equal(self.arr[:, : self.payload], self.reference[:, : self.payload]):
            raise BenchError(f"{side}: the loaded rows differ from the stored rows")
        self.drop(paths)
        return t_store, t_load

    def close(self) -> None:
        if self.proc_fds is not None:
            os.close(self.proc_fds)
        self.tier.shutdown()
        self.view.release()
        self.flat.release()


def measure(point: Point, sides: list[str], rounds: int) -> dict:
    out = {s: {"store_s": [], "load_s": [], "store_cpu_s": [], "load_cpu_s": []} for s in sides}
    for r in range(rounds):
        for side in round_order(sides, r):
            try:
                t_store, t_load = point.round_trip(side)
            except OSError as e:
                out[side]["error"] = str(e)
                continue
            record(out[side], point, t_store, t_load)
    return out


def record(res: dict, point: Point, t_store: float, t_load: float) -> None:
    res["store_s"].append(t_store)
    res["load_s"].append(t_load)
    res["store_cpu_s"].append(point.cpu[0])
    res["load_cpu_s"].append(point.cpu[1])


def fingerprint() -> str:
    import vllm

    path = os.path.dirname(vllm.__file__)
    fp = vllm_fingerprint(path)
    return f"{vllm.__version__} from {path} (files {fp['digest']}, newest {fp['newest']})"


def integrity_setting() -> str | None:
    """The fs tier's integrity setting: "checksum" (0.22.1), "checksum_blocks" (0.34.0: a
    CRC32C, #57912's shape), or None (the tier checks nothing)."""
    import inspect

    params = inspect.signature(FileSystemTierManager).parameters
    return next((name for name in ("checksum", "checksum_blocks") if name in params), None)


def has_integrity_check() -> bool:
    """Whether the fs tier can check what it loads (an integrity setting)."""
    return integrity_setting() is not None


def checksum_default() -> str | None:
    """The integrity setting's value when a config leaves it out (None: no setting)."""
    import inspect

    name = integrity_setting()
    if name is None:
        return None
    return str(inspect.signature(FileSystemTierManager).parameters[name].default)


def integrity_config() -> dict:
    """The tier config that checks blocks: its default where that checks, else a checksum."""
    if integrity_setting() == "checksum_blocks":
        return {"checksum_blocks": True}
    if checksum_default() not in (None, "none"):
        return {}
    try:
        import xxhash  # noqa: F401

        return {"checksum": "xxh3_64"}
    except ImportError:
        return {"checksum": "crc32"}


def integrity_cost(root, rounds: int, threads: int, max_bytes: int, max_files: int) -> list:
    """The tier checking blocks ("on": its default where that checks) vs not ("off", and
    "off_aa", the same again: the A/A control), same rows.

    All three sides are one tier, its check switched per side (the tier's _checksum: the
    check object, or 0.34.0's bool), so they share the directory tree, the buffer and the
    threads: three tiers of their own read up to 1.37x apart as an A/A pair on this VM,
    their directories and buffers, not the check."""
    sides = ("on", "off", "off_aa")
    out = []
    # the goal's row gets every round (a 5% cost is judged on the per-round ratios, see
    # report.paired()); 2 MiB, shown beside it, half of them
    for label, row_bytes, row_rounds in (
        ("64 KiB", 64 << 10, rounds),
        ("2 MiB", 2 << 20, max(len(sides), rounds // 2)),
    ):
        n = max(1, min(max_files, max_bytes // row_bytes))
        point = Point(
            str(root / f"integrity-{row_bytes}"),
            row_bytes,
            row_bytes,
            n,
            1,
            threads,
            tier_config=integrity_config(),
        )
        check = point.tier._checksum
        off = no_check(check)
        res = {
            side: {"store_s": [], "load_s": [], "store_cpu_s": [], "load_cpu_s": []}
            for side in sides
        }
        try:
            for r in range(row_rounds):
                for side in round_order(sides, r):
                    point.tier._checksum = check if side == "on" else off
                    t_store, t_load = point.round_trip("tier")
                    record(res[side], point, t_store, t_load)
            point.tier._checksum = check
            hash_floor = hash_once(point, min(row_rounds, 6))
            read_floor = read_once(point, min(row_rounds, 6))
        finally:
            point.close()
        if isinstance(check, bool):  # 0.34.0: checksum_blocks
            described = {"algorithm": "crc32c", "xattr": "user.vllm.kv_crc32c"} if check else None
        else:
            described = check.describe() if check else None
        out.append(
            {
                "label": label,
                "row_bytes": row_bytes,
                "blocks": n,
                "checksum": described,
                "tier_direct": point.direct,
                "hash_once_s": hash_floor,
                "read_once_s": read_floor,
                "cpus": os.cpu_count(),
                **res,
            }
        )
    return out


def read_once(point: Point, rounds: int) -> list[float]:
    """Seconds to read every byte of *point*'s rows once right after a load (numpy, one
    pass): the floor of any check that reads the whole block, whatever its hash."""
    times = []
    for _ in range(rounds):
        point.round_trip("tier")  # the rows come fresh from the disk; not timed here
        t0 = time.process_time()
        np.bitwise_xor.reduce(point.arr.view(np.uint64), axis=None)
        times.append(time.process_time() - t0)
    return times


def hash_once(point: Point, rounds: int) -> list[float]:
    """Seconds to checksum every block of *point* once, as its tier's check does, right
    after a load (cold: the bytes came from the disk by DMA): the least any check of the
    loaded bytes costs, whatever holds its value."""
    check = point.tier._checksum
    if not hasattr(check, "compute"):
        return []  # none, or 0.34.0's CRC32C (computed in C, inside the batch calls)
    times = []
    for _ in range(rounds):
        point.round_trip("tier")  # the rows come fresh from the disk; not timed here
        t0 = time.process_time()
        rb = point.row_bytes
        for i, key in enumerate(point.keys):
            check.compute(key, point.flat[i * rb : (i + 1) * rb])
        times.append(time.process_time() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(TMP / "disk.json"))
    ap.add_argument("--rounds", type=int, default=1 if QUICK else 3)
    ap.add_argument(
        "--integrity-rounds",
        type=int,
        default=3 if QUICK else 18,
        help="rounds of the integrity on/off comparison at 64 KiB (2 MiB: half); a multiple "
        "of 3 puts every side in every position equally often",
    )
    ap.add_argument(
        "--sections",
        default="rows,hma,integrity",
        help="comma-separated subset of rows,hma,integrity",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=16,
        help="I/O threads: the tier gets half read-, half write-priority",
    )
    args = ap.parse_args()
    root = TMP / "disk"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    max_bytes = (32 if QUICK else 128) << 20
    max_files = 512 if QUICK else 2048
    # (label, row bytes in the primary tier, payload bytes per block). The sweep is the file
    # sizes blocks_per_chunk reaches (file = blocks_per_chunk x a group's row): every row
    # moves at most max_bytes in at most max_files files, so the small rows stay short.
    rows = [(fmt_bytes(size), size, size) for size in (4 << 10 << 2 * k for k in range(6))] + [
        ("1280 B, unpadded row", 1280, 1280),
        ("1280 B, row padded to 4 KiB", 4 << 10, 1280),
    ]
    t_start = time.monotonic()
    results: dict = {
        "rows": [],
        "hma": [],
        "threads": args.threads,
        "rounds": args.rounds,
        "dir": str(root),
        "integrity_check": has_integrity_check(),
        "checksum_default": checksum_default(),
        "integrity": [],
        "fingerprint": fingerprint(),
        "tier_type": TIER_TYPE,
    }
    say(
        f"disk tier: {TIER_TYPE} vs raw file-per-block I/O in {root}, {args.threads} threads, "
        f"{args.rounds} rounds"
    )
    sections = set(args.sections.split(","))
    for label, row_bytes, payload in rows if "rows" in sections else []:
        # at least two files per thread, so that the large rows keep every thread busy
        n = max(2 * args.threads, min(max_files, max_bytes // row_bytes))
        point = Point(
            str(root / f"rows-{row_bytes}-{payload}"), row_bytes, payload, n, 1, args.threads
        )
        # the goal rows also against raw writes that publish atomically (either way), and
        # the tier without its default check, if it checks (goal 2: the tier's own cost)
        goal_row = row_bytes == payload in GOAL_ROWS
        unchecked = ["tier_nocheck"] if goal_row and point.tier._checksum else []
        sides = ["tier", "raw"] + (unchecked + list(PUBLISH) if goal_row else [])
        # every side in every position at least once (round_order()); the goal rows twice
        rounds = max(args.rounds, len(sides) * (2 if goal_row else 1))
        try:
            res = measure(point, sides, rounds)
        finally:
            point.close()
        results["rows"].append(
            {
                "label": label,
                "row_bytes": row_bytes,
                "payload": payload,
                "blocks": n,
                "tier_direct": point.direct,
                "raw_direct": point.raw_direct,
                **res,
            }
        )
        say(f"  rows {label}: {n} blocks done ({time.monotonic() - t_start:.0f} s)")

    chunk = 256 << 10  # bytes per chunk (all groups together), equal for every G
    chunks = (32 if QUICK else 128) << 20 >> 18
    for groups in (1, 2, 4) if "hma" in sections else ():
        point = Point(
            str(root / f"hma-g{groups}"),
            chunk // groups,
            chunk // groups,
            chunks,
            groups,
            args.threads,
        )
        sides = ["tier", "raw", "chunk"] + (["raw_serial", "chunk_by_group"] if groups > 1 else [])
        try:
            res = measure(point, sides, max(args.rounds, len(sides)))
        finally:
            point.close()
        results["hma"].append(
            {
                "groups": groups,
                "row_bytes": chunk // groups,
                "chunks": chunks,
                "chunk_bytes": chunk,
                "tier_direct": point.direct,
                **res,
            }
        )
        say(
            f"  HMA {groups} group(s): {chunks} chunks of {chunk >> 10} KiB done "
            f"({time.monotonic() - t_start:.0f} s)"
        )
    if "integrity" in sections and results["integrity_check"]:
        results["integrity"] = integrity_cost(
            root, args.integrity_rounds, args.threads, max_bytes, max_files
        )
        say(f"  integrity on/off done ({time.monotonic() - t_start:.0f} s)")
    shutil.rmtree(root, ignore_errors=True)
    results["seconds"] = time.monotonic() - t_start
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    say(f"disk tier done in {results['seconds']:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    run_main(main)
