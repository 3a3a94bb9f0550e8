# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
FsTierBudget: a byte budget (``max_bytes``) for the fs_python tier, with an
eviction order that keeps whole prefixes.

What can still hit:
    A hit needs every full-attention group's chunks from the start of the
    prompt, so a file is only useful while every earlier chunk of its prefix
    is kept. Block hashes chain (a chunk's hash covers its whole prefix), so
    the chunks on disk form a forest: a chunk's parent is the chunk before it
    in its prompt. Only leaves (chunks with no kept child) are evicted, in
    least-recently-used order, with every group's file of the chunk at once;
    a parent whose last child was evicted becomes the next victim. So a
    prefix loses its tail before its head, a prefix shared by several
    prompts stays while any of them is kept, and no kept file is unreachable
    because an earlier chunk of its prefix was evicted.

Where the order comes from:
    Store jobs carry their keys as a set (no position). The connector touches
    each request's keys in prompt order (one list per KV cache group, the
    live list for full-attention groups) before it stores them, and the
    tiering manager passes those lists to the tier's touch(): the tier keeps
    a reference per request and group (O(1) per touch; MAX_TRACKED_KEYS
    keys at most), and a store finds a key's parent as the key before it in
    that list, scanning back from its end a bounded distance (a store's keys
    are its request's newest): O(1) per stored key. A key without such a
    list (a caller that never touches) is a root. A key whose predecessor is
    on no disk (evicted, or its store failed) could never hit from there:
    it is not written.

Invariants:
    - used = the bytes of the indexed files plus those of stores in flight;
      a store reserves its bytes (evicting first) before its files are
      written, and each of its tasks removes its share of the evicted files
      before it writes, so the tier's files never exceed max_bytes by more
      than the writes of one store job. A store that does not fit once
      everything evictable is gone fails for the keys that do not (the
      chunks farthest from the prompt's start first).
    - A chunk with a store or load in flight, or reported present by
      lookup() since the tier's last get_finished() (a promotion the
      tiering manager submits at the end of that step), is pinned: never
      evicted under the transfer.
    - Every scheduler-thread call is O(1) per key; start-up indexing, the
      journal and removals run on other threads.

Restart:
    The parent of each stored chunk is appended to a small per-rank journal
    (``budget.journal`` in the tier's rank directory; compacted when it holds
    twice as many records as the index has chunks). At start a background
    thread lists the rank directory, links the chunks with the journal's
    parents, orders the leaves by file time, inserts them (older than
    anything stored since start) in batches and trims to the budget after
    each; the engine serves meanwhile (files not indexed yet are not counted
    until their batch). Files written without a budget have no journal:
    their order is file time only, so the first trim may cut a prefix.

Shared roots:
    Each engine indexes the files it stored or found at its start and evicts
    only those, within its own budget: engines sharing a root hold at most the
    sum of their budgets (a file indexed by two engines counts in both). A
    file another engine removed is a miss (lookup() checks the file).
"""

import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable

import numpy as np

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import OffloadKey

logger = init_logger(__name__)

JOURNAL_NAME = "budget.journal"
# Keys of the most recently touched requests' lists kept for finding parents
# (about 70 MiB of keys; the least recently touched requests go first).
MAX_TRACKED_KEYS = 1 << 20
# How far back from the end of a request's key list a store looks for its
# keys, beyond their number (keys appended since the store was built, or
# skipped: sliding-window blocks outside the window).
MAX_ORDER_SLACK = 32
# The journal is appended at most once per interval, or when this many links
# are waiting (a wake-up costs the scheduler thread a GIL hand-off).
JOURNAL_INTERVAL_S = 1.0
JOURNAL_BATCH = 16384
# Recovered chunks inserted per lock hold by the start-up scan.
SCAN_BATCH = 4096
# The budget's report (used bytes, evictions, rejections): at most one line
# per interval, and only when something changed.
REPORT_INTERVAL_S = 30.0


# What finish_job() needs of a job: the chunks it pinned, and for a store the
# keys whose files it adds (None for a load).
JobTicket = tuple[list[bytes], set[OffloadKey] | None]


def validate_max_bytes(max_bytes: object, min_bytes: int, tier_type: str) -> int | None:
    """The tier's max_bytes setting: None (unbounded) or an int of at least
    min_bytes (one chunk of every KV cache group). Raises ValueError
    naming the setting and the smallest valid value."""
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
        raise ValueError(
            f"max_bytes of the '{tier_type}' tier must be an integer number of "
            f"bytes >= {min_bytes} (one chunk of every KV cache group) or null "
            f"(unbounded), got {max_bytes!r}"
        )
    if max_bytes < min_bytes:
        raise ValueError(
            f"max_bytes of the '{tier_type}' tier must be >= {min_bytes} (one "
            f"chunk of every KV cache group) or null (unbounded), got {max_bytes}"
        )
    return max_bytes


class _Chunk:
    """One block hash on disk: its files (one per KV cache group)."""

    __slots__ = ("groups", "nbytes", "parent", "children", "pins", "recovered")

    def __init__(self, parent: bytes | None, recovered: bool = False) -> None:
        self.groups: set[bytes] = set()  # 4-byte group suffixes of its keys
        self.nbytes = 0  # bytes of its files
        self.parent = parent  # the chunk before it in its prompt, if indexed
        self.children = 0  # indexed chunks whose parent it is
        self.pins = 0  # transfers (and lookups) that need its files
        self.recovered = recovered  # found by the start-up scan


class FsTierBudget:
    """The index, the eviction order and the start-up scan of a budgeted
    fs_python tier (see the module docstring). Thread-safe: the scheduler
    thread and the start-up scan share it under one lock."""

    def __init__(
        self,
        max_bytes: int,
        file_size: int,
        rank_dir: str,
        key_path: Callable[[OffloadKey], str],
        chunk_path: Callable[[bytes, int], str],
        label: str,
        prefix_groups: Collection[int] | None = None,
        chunk_id: Callable[[bytes], bytes] | None = None,
    ) -> None:
        """prefix_groups: the KV cache groups a hit needs every earlier
        chunk of (full attention); None: every group. A key of such a group
        whose predecessor is on no disk is not written.

        Chunks are indexed by the stem of their file names, what the
        start-up scan reads back: chunk_id maps a block hash to it (a keyed
        namespace's keyed hash; None: the block hash itself), and
        chunk_path maps it and a group index to the file's path."""
        self.max_bytes = max_bytes
        self.file_size = file_size
        self.used = 0
        self._rank_dir = rank_dir
        self._key_path = key_path
        self._chunk_path = chunk_path
        self._chunk_id = chunk_id
        self._label = label
        self._prefix_groups: frozenset[bytes] | None = (
            None
            if prefix_groups is None
            else frozenset(g.to_bytes(4, "big") for g in prefix_groups)
        )
        self._lock = threading.Lock()
        self._chunks: dict[bytes, _Chunk] = {}
        # evictable chunks (no kept child, not pinned): least recent first
        self._leaves: OrderedDict[bytes, None] = OrderedDict()
        # chunks pinned by lookup() until the next get_finished()
        self._step_pins: list[bytes] = []
        # req_id -> {group suffix: the request's keys of it, in prompt order}
        self._orders: OrderedDict[str, dict[bytes, list]] = OrderedDict()
        self._order_keys = 0  # their keys, when last touched
        # the start-up scan's chunks: hash -> [groups, nbytes, mtime,
        # children, inserted]; None once the scan is done
        self._recovering: dict[bytes, list] | None = None
        # counters: since start, and since the last report
        self.evicted_files = 0
        self.rejected_files = 0
        self.unreachable_files = 0  # not written: their prefix is not on disk
        self._reported = (0, 0, 0)
        self._next_report = time.monotonic() + REPORT_INTERVAL_S

        # journal records and the start-up scan run on this thread
        self._journal_path = os.path.join(rank_dir, JOURNAL_NAME)
        # (chunk, parent) links not written yet; the thread writes them at
        # most once per JOURNAL_INTERVAL_S (or at once past JOURNAL_BATCH)
        self._journal_q: deque[tuple[bytes, bytes]] = deque()
        self._journal_records = 0
        self._wake = threading.Condition(threading.Lock())
        self._stop = False
        self.scan_done = threading.Event()
        self.scan_stats: tuple[int, int, int, float] | None = None
        self._thread = threading.Thread(
            target=self._run, name="vllm_kv_py_fs_budget", daemon=True
        )
        self._thread.start()

    # ---- scheduler thread -------------------------------------------------

    def note_order(self, req_id: str, keys: Collection[OffloadKey]) -> None:
        """touch(): keep the request's keys of one group, in prompt order."""
        if not keys or not isinstance(keys, list):
            return
        with self._lock:
            orders = self._orders.get(req_id)
            if orders is None:
                orders = self._orders[req_id] = {}
            else:
                self._orders.move_to_end(req_id)
            last = keys[-1]
            old = orders.get(last[-4:])
            orders[last[-4:]] = keys
            self._order_keys += len(keys) - (len(old) if old is not None else 0)
            while self._order_keys > MAX_TRACKED_KEYS and len(self._orders) > 1:
                _, dropped = self._orders.popitem(last=False)
                self._order_keys -= sum(len(o) for o in dropped.values())
            # the prompt is in use: its deepest chunk on disk is recent
            h = self._cid(last[:-4])
            if h in self._leaves:
                self._leaves.move_to_end(h)

    def on_hit(self, key: OffloadKey) -> None:
        """lookup() found the key's file: pin it until the next
        get_finished(), by which time its promotion (if any) is pinned."""
        h = self._cid(key[:-4])
        with self._lock:
            chunk = self._chunks.get(h)
            if chunk is None:
                return
            self._pin(h, chunk)
            self._step_pins.append(h)

    def admit_store(
        self, keys: Collection[OffloadKey], req_id: str
    ) -> tuple[set[OffloadKey], set[OffloadKey], list[str], "JobTicket"]:
        """Reserve room for a store job's new files, evicting first.

        Returns the keys that do not fit (not to be written: the chunks
        nearest the prompt's start are admitted first), the keys not worth
        writing (the chunk before them in their prompt is not on disk, so
        they could never hit from it), the paths of the evicted files (to
        be removed before the job's writes), and the job's ticket for
        finish_job(): its pinned chunks and new files."""
        with self._lock:
            chunks = self._chunks
            # the job's chunks (and their parents), pinned once each
            pinned: dict[bytes, _Chunk] = {}
            new: list[OffloadKey] = []
            cid = self._cid
            for k in keys:
                h = cid(k[:-4])
                chunk = chunks.get(h)
                if chunk is None:
                    new.append(k)
                    continue
                if k[-4:] not in chunk.groups:
                    new.append(k)
                if h not in pinned:
                    pinned[h] = chunk
                    self._pin(h, chunk)
            parents, positions, orphans = self._find_parents(new, req_id)
            unreachable: set[OffloadKey] = set()
            for k, prev in orphans:
                # not indexed here: on disk only if another engine stored it
                if not os.path.exists(self._key_path(prev)):
                    unreachable.add(k)
            if unreachable:
                # and so are the keys after them in the job
                new.sort(key=lambda k: positions.get(k, -1))
                gone = {cid(k[:-4]) for k in unreachable}
                for k in new:
                    parent = parents.get(cid(k[:-4]))
                    if parent in gone and parent not in chunks:
                        unreachable.add(k)
                        gone.add(cid(k[:-4]))
                new = [k for k in new if k not in unreachable]
                self.unreachable_files += len(unreachable)
            for parent in parents.values():
                if parent not in pinned:
                    pchunk = chunks.get(parent)
                    if pchunk is not None:
                        pinned[parent] = pchunk
                        self._pin(parent, pchunk)
            evicted = self._evict(len(new) * self.file_size)
            fits = max(0, (self.max_bytes - self.used) // self.file_size)
            rejected: set[OffloadKey] = set()
            if len(new) > fits:
                # keep the chunks nearest the start of their prompt
                new.sort(key=lambda k: positions.get(k, -1))
                rejected.update(new[fits:])
                del new[fits:]
                self.rejected_files += len(rejected)
            file_size = self.file_size
            created: list[bytes] = []
            for k in new:
                h = cid(k[:-4])
                chunk = chunks.get(h)
                if chunk is None:
                    chunk = chunks[h] = _Chunk(None)
                    created.append(h)
                if h not in pinned:
                    pinned[h] = chunk
                    self._pin(h, chunk)
                chunk.groups.add(k[-4:])
                chunk.nbytes += file_size
            self.used += file_size * len(new)
            # link the new chunks to their parents (indexed, or new here)
            for h in created:
                parent = parents.get(h)
                if parent is not None:
                    pchunk = chunks.get(parent)
                    if pchunk is not None:
                        chunks[h].parent = parent
                        pchunk.children += 1
                        self._leaves.pop(parent, None)
                        self._journal_q.append((h, parent))
            return rejected, unreachable, evicted, (list(pinned), set(new))

    def pin_load(self, keys: Collection[OffloadKey]) -> "JobTicket":
        """A load job's chunks, pinned until finish_job()."""
        pinned: list[bytes] = []
        with self._lock:
            for h in {self._cid(k[:-4]) for k in keys}:
                chunk = self._chunks.get(h)
                if chunk is not None:
                    self._pin(h, chunk)
                    pinned.append(h)
        return pinned, None

    def finish_job(self, ticket: "JobTicket", failed: Iterable[OffloadKey]) -> None:
        """A store or load job finished: forget the files of its failed keys
        (a failed store did not write its new files, a failed load removed
        its file) and unpin its chunks."""
        pinned, new = ticket
        with self._lock:
            for k in failed:
                if new is not None and k not in new:
                    continue  # the file it failed to store over is still there
                chunk = self._chunks.get(self._cid(k[:-4]))
                if chunk is not None and k[-4:] in chunk.groups:
                    chunk.groups.discard(k[-4:])
                    chunk.nbytes -= self.file_size
                    self.used -= self.file_size
            for h in pinned:
                chunk = self._chunks.get(h)
                if chunk is not None:
                    self._unpin(h, chunk)

    def end_step(self) -> None:
        """get_finished(): release lookup()'s pins; wake the journal."""
        if self._step_pins:
            with self._lock:
                for h in self._step_pins:
                    chunk = self._chunks.get(h)
                    if chunk is not None:
                        self._unpin(h, chunk)
                self._step_pins.clear()
        if len(self._journal_q) > JOURNAL_BATCH:
            with self._wake:
                self._wake.notify()
        if time.monotonic() >= self._next_report:
            self._report()

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join()
        self._report(force=True)

    # ---- internals (under self._lock) --------------------------------------

    def _cid(self, block_hash: bytes) -> bytes:
        """A block hash's chunk id: the stem of its files' names."""
        chunk_id = self._chunk_id
        return block_hash if chunk_id is None else chunk_id(block_hash)

    def _find_parents(
        self, keys: list[OffloadKey], req_id: str
    ) -> tuple[
        dict[bytes, bytes], dict[OffloadKey, int], list[tuple[OffloadKey, OffloadKey]]
    ]:
        """Parents (indexed chunks, or chunks of this job) and prompt
        positions of new keys, from the request's touched lists, and the
        keys whose predecessor is neither (with it). A store's keys are the
        newest of its request, so each list is scanned back from its end, at
        most a bounded distance past the job's keys: O(1) per key; a key not
        found there has no parent (a root)."""
        parents: dict[bytes, bytes] = {}
        positions: dict[OffloadKey, int] = {}
        orphans: list[tuple[OffloadKey, OffloadKey]] = []
        orders = self._orders.get(req_id)
        if orders is None or not keys:
            return parents, positions, orphans
        by_group: dict[bytes, set[OffloadKey]] = {}
        for k in keys:
            by_group.setdefault(k[-4:], set()).add(k)
        chunks = self._chunks
        cid = self._cid
        new_chunks = {cid(k[:-4]) for k in keys}
        prefix_groups = self._prefix_groups
        # the finest group first: its predecessor is the closest (groups of
        # larger blocks skip the chunks between theirs)
        for g, wanted in sorted(
            by_group.items(), key=lambda item: -len(orders.get(item[0], ()))
        ):
            order = orders.get(g)
            if order is None:
                continue
            # sliding-window and mamba groups skip chunks: no orphans there
            needs_prefix = prefix_groups is None or g in prefix_groups
            i = len(order) - 1
            stop = max(0, i - len(wanted) - MAX_ORDER_SLACK)
            while wanted and i >= stop:
                k = order[i]
                if k in wanted:
                    wanted.discard(k)
                    positions[k] = i
                    if i:
                        prev = cid(order[i - 1][:-4])
                        if prev in chunks or prev in new_chunks:
                            parents.setdefault(cid(k[:-4]), prev)
                        elif needs_prefix:
                            orphans.append((k, order[i - 1]))
                i -= 1
        return parents, positions, orphans

    def _pin(self, h: bytes, chunk: _Chunk) -> None:
        if chunk.pins == 0:
            self._leaves.pop(h, None)
        chunk.pins += 1

    def _unpin(self, h: bytes, chunk: _Chunk) -> None:
        chunk.pins -= 1
        if chunk.pins == 0 and chunk.children == 0:
            if chunk.groups:
                self._leaves[h] = None
            else:  # its files failed: nothing left to keep
                self._remove_chunk(h, chunk)

    def _remove_chunk(self, h: bytes, chunk: _Chunk) -> None:
        del self._chunks[h]
        self._leaves.pop(h, None)
        self.used -= chunk.nbytes
        parent = chunk.parent
        if parent is None:
            return
        recovering = self._recovering
        if chunk.recovered and recovering is not None:
            pending = recovering.get(parent)
            if pending is not None and not pending[4]:
                pending[3] -= 1  # the parent is not inserted yet
                return
        pchunk = self._chunks.get(parent)
        if pchunk is not None:
            pchunk.children -= 1
            if pchunk.children == 0 and pchunk.pins == 0:
                # the prefix's head follows its tail
                self._leaves[parent] = None
                self._leaves.move_to_end(parent, last=False)

    def _evict(self, need: int) -> list[str]:
        """Evict leaves, least recent first, until need more bytes fit.
        Returns the paths of their files, to be removed."""
        evicted: list[str] = []
        leaves = self._leaves
        chunk_path = self._chunk_path
        while self.used + need > self.max_bytes and leaves:
            h = next(iter(leaves))
            chunk = self._chunks[h]
            evicted.extend(
                chunk_path(h, int.from_bytes(g, "big")) for g in chunk.groups
            )
            self._remove_chunk(h, chunk)
        self.evicted_files += len(evicted)
        return evicted

    # ---- reports ------------------------------------------------------------

    def _report(self, force: bool = False) -> None:
        self._next_report = time.monotonic() + REPORT_INTERVAL_S
        now = (self.used, self.evicted_files, self.rejected_files)
        if now == self._reported and not force:
            return
        logger.info(
            "%s: %d of max_bytes=%d bytes used (%d files), %d files evicted "
            "and %d rejected since the previous report (%d and %d since start)",
            self._label,
            self.used,
            self.max_bytes,
            self.used // self.file_size,
            self.evicted_files - self._reported[1],
            self.rejected_files - self._reported[2],
            self.evicted_files,
            self.rejected_files,
        )
        self._reported = now

    # ---- budget thread: the start-up scan and the journal -----------------

    def _run(self) -> None:
        try:
            self._scan()
        except Exception as e:  # the tier still works, unindexed files stay
            logger.warning("%s: could not index existing files: %s", self._label, e)
        finally:
            self.scan_done.set()
        while True:
            with self._wake:
                self._wake.wait(JOURNAL_INTERVAL_S)
                stop = self._stop
            self._write_journal()
            if stop:
                return

    def _write_journal(self) -> None:
        q = self._journal_q
        records = [_record(*q.popleft()) for _ in range(len(q))]
        if not records:
            return
        try:
            os.makedirs(self._rank_dir, exist_ok=True)
            with open(self._journal_path, "ab") as f:
                f.write(b"".join(records))
            self._journal_records += len(records)
            if self._journal_records > 2 * len(self._chunks) + SCAN_BATCH:
                self._compact_journal()
        except OSError as e:
            logger.warning(
                "%s: could not write %s: %s", self._label, self._journal_path, e
            )

    def _compact_journal(self) -> None:
        """Keep the records of indexed chunks (read without the lock: dict
        membership is atomic; a record dropped by a race only makes that
        chunk a root after a restart)."""
        kept = {
            h: p
            for h, p in _read_journal(self._journal_path).items()
            if h in self._chunks
        }
        tmp = f"{self._journal_path}.{os.getpid()}.compact"
        with open(tmp, "wb") as f:
            f.write(b"".join(_record(h, p) for h, p in kept.items()))
        os.replace(tmp, self._journal_path)
        self._journal_records = len(kept)

    def _scan(self) -> None:
        """Index the rank directory's block files and trim to the budget."""
        start = time.monotonic()
        parents = _read_journal(self._journal_path)
        self._journal_records = len(parents)
        # hash -> [groups, nbytes, newest mtime, children, inserted]
        found: dict[bytes, list] = {}
        for d1 in _scandir(self._rank_dir):
            if not d1.is_dir(follow_symlinks=False):
                continue
            for d2 in _scandir(d1.path):
                name = d2.name
                sep = name.find("_g")
                if sep < 0 or not d2.is_dir(follow_symlinks=False):
                    continue
                try:
                    g = int(name[sep + 2 :]).to_bytes(4, "big")
                except (ValueError, OverflowError):
                    continue
                if self._stop:
                    return
                for f in _scandir(d2.path):
                    fname = f.name
                    if not fname.endswith(".bin"):
                        continue
                    try:
                        h = bytes.fromhex(fname[:-4])
                        st = f.stat(follow_symlinks=False)
                    except (ValueError, OSError):
                        continue
                    entry = found.get(h)
                    if entry is None:
                        found[h] = [{g}, st.st_size, st.st_mtime, 0, False]
                    else:
                        entry[0].add(g)
                        entry[1] += st.st_size
                        entry[2] = max(entry[2], st.st_mtime)
        links: dict[bytes, bytes] = {}
        for h in found:
            p = parents.get(h)
            if p is not None and p in found:
                links[h] = p
                found[p][3] += 1
        # the most recent first, each inserted at the least recent end
        # (numpy sorts without holding the GIL: the engine keeps serving)
        hashes = list(found)
        mtimes = np.fromiter((found[h][2] for h in hashes), np.float64, len(hashes))
        order = [hashes[i] for i in np.argsort(-mtimes, kind="stable")]
        del hashes, mtimes
        removed = 0
        with self._lock:
            self._recovering = found
        try:
            for i in range(0, len(order), SCAN_BATCH):
                if self._stop:
                    return
                with self._lock:
                    for h in order[i : i + SCAN_BATCH]:
                        self._insert_recovered(h, found[h], links.get(h))
                    evicted = self._evict(0)
                removed += self._remove_files(evicted)
        finally:
            with self._lock:
                self._recovering = None
        self.scan_stats = (len(found), removed, self.used, time.monotonic() - start)
        logger.info(
            "%s: indexed %d chunk(s) of earlier runs in %.1f s; removed %d "
            "file(s) to fit max_bytes=%d; %d bytes used",
            self._label,
            len(found),
            self.scan_stats[3],
            removed,
            self.max_bytes,
            self.used,
        )

    def _insert_recovered(self, h: bytes, entry: list, parent: bytes | None) -> None:
        """Insert a chunk found on disk (under the lock). Its children count
        is the recovered one (entry[3]), kept up to date while it waits:
        a recovered child removed before its parent is inserted decrements
        it there."""
        groups, nbytes, _, children, _ = entry
        entry[4] = True
        chunk = self._chunks.get(h)
        if chunk is not None:  # stored again since start: merge
            for g in groups - chunk.groups:
                chunk.groups.add(g)
                chunk.nbytes += self.file_size
                self.used += self.file_size
            chunk.children += children
            if children:
                self._leaves.pop(h, None)
            if parent is not None:  # keep the link it has: drop the old one
                pending = self._recovering[parent] if self._recovering else None
                if pending is not None and not pending[4]:
                    pending[3] -= 1
                else:
                    pchunk = self._chunks.get(parent)
                    if pchunk is not None:
                        pchunk.children -= 1
                        if pchunk.children == 0 and pchunk.pins == 0:
                            self._leaves[parent] = None
                            self._leaves.move_to_end(parent, last=False)
            return
        chunk = self._chunks[h] = _Chunk(parent, recovered=True)
        chunk.groups = groups
        chunk.nbytes = nbytes
        chunk.children = children
        self.used += nbytes
        if children == 0:
            self._leaves[h] = None
            self._leaves.move_to_end(h, last=False)

    def _remove_files(self, paths: Iterable[str]) -> int:
        n = 0
        for path in paths:
            try:
                os.remove(path)
                n += 1
            except OSError:  # removed by another engine, or never written
                pass
        return n

    def remove_evicted(self, paths: Iterable[str]) -> None:
        """A task for the tier's I/O threads."""
        self._remove_files(paths)


def _record(h: bytes, parent: bytes) -> bytes:
    return bytes((len(h), len(parent))) + h + parent


def _read_journal(path: str) -> dict[bytes, bytes]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return {}
    parents: dict[bytes, bytes] = {}
    i, n = 0, len(data)
    while i + 2 <= n:
        lh, lp = data[i], data[i + 1]
        j = i + 2 + lh + lp
        if j > n:
            break  # a torn last record
        parents[data[i + 2 : i + 2 + lh]] = data[i + 2 + lh : j]
        i = j
    return parents


def _scandir(path: str):
    try:
        with os.scandir(path) as it:
            yield from it
    except OSError:
        return
