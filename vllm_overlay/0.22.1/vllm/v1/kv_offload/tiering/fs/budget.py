# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FsTierBudget: a byte budget (``max_bytes``) for the fs tier that keeps whole
prefixes, in the order its files' own times record.

Design principles:
    - One order, no links. A hit needs every earlier chunk of its prompt, so
      a prefix must lose its tail before its head. A request first seen at
      time T gives its key ending at token p the order time T - 2p (a
      sliding-window or mamba key: that of the full-attention chunk covering
      it, minus one); a chunk keeps the newest order time any request gave
      it, and a store raises its request's earlier chunks to the request's
      times. Evicting the oldest chunk first, every group's file of it at
      once, loses tails before heads, as vLLM's free-block queue does.
    - The order lives with the files. A chunk's order time is its files'
      mtime (set once they are written), so a restart reads it back with
      the directory listing: no journal, no state shared between engines
      but the files.
    - One budget per root. max_bytes bounds the root's files of the layout,
      whoever stored them. Each engine publishes the bytes it added and
      removed in a ledger file of its own (_Ledgers) and, once it saw
      another's, reads theirs every tick: their stores count at once. When
      one changed, it lists the root again (at most every ROOT_RESCAN_S),
      indexing the files the others stored and forgetting those they
      removed. Engines read one order in the files' mtimes (only ever
      raised), so they evict the same oldest chunks, and a victim another
      engine raised is kept. An engine that stops or crashes leaves files,
      which the others count and evict, and a ledger, which stops changing.
      An engine alone on its root lists it again only if it finds files it
      did not index.
    - The scheduler thread only posts. Its calls append events and read the
      chunks being removed: no filesystem call, no wait on eviction.

Threads and what they own:
    - _events (a deque: append and popleft are thread-safe) is written by the
      scheduler thread and applied in order, under _lock, by the I/O threads
      (a store's admission needs every event posted before it) and by the
      budget thread.
    - _lock guards the index and the counters; it is never held across a
      filesystem call but _has_file()'s look for a predecessor's file
      before the start-up scan is done.
    - _removing_lock guards _removing, _gone_in_step and _hit_pins
      (lookup()'s pins),
      which the scheduler thread reads and writes on every hit: held for a
      few dict operations, or one eviction's pick of its victims.
    - _recalled and _step_hits are the scheduler thread's own; _ledgers
      (the engines' ledger files) is the budget thread's. others,
      added_bytes and removed_bytes are guarded by _lock.

Invariants:
    - Prefix order: for every prompt, a chunk's order time is at least that
      of any later chunk of it. No store writes a key whose predecessor (or
      covering full-attention chunk) is on no disk, so no kept file is past
      a gap.
    - used + unlinking = the bytes of the indexed files, of the stores in
      flight and of the files evicted ahead not removed yet. A store
      reserves its bytes (evicting first) before its files are written, and
      its task removes what it evicted before it writes: the files never
      exceed max_bytes by more than one store job's writes. A key is refused
      when only chunks newer than it (or pinned) could make room.
    - Pins as eviction protection: a chunk with a transfer in flight, or that
      lookup() reported present in an engine step not ended yet, is never
      evicted. Each pin is dropped by the job or step that took it.
    - An evicted chunk stays in _removing until its files are gone and the
      scheduler thread took its keys (lookup()'s cached verdicts become
      misses); meanwhile lookup() answers a miss and no store writes it. A
      tier that takes no keys: until its files are gone, then a miss to
      on_hit() until the step ends (lookup() may have seen the file).
    - Bounded: the index by max_bytes (one entry per chunk on disk), the
      requests' positions by MAX_TRACKED_KEYS, the events by MAX_EVENTS (the
      budget thread is woken to apply them), the reports by
      report.REPORT_INTERVAL_S.

Shared roots: the root's files may exceed max_bytes by one store job per
engine and what the others' ledgers did not show yet: their stores of a
tick, or, on NFS, until a new ledger's name is seen (the client's
directory cache, up to a minute). An engine evicts what it indexed:
another engine's files from its last listing, or its lookup() hit, on. A
file another engine removed is a miss (lookup() checks the file) until
the next listing forgets it. Order times are wall-clock times: engines on
several hosts need synchronized clocks; raising another account's file's
mtime needs its ownership (one account for all engines keeps one order).
"""

import contextlib
import heapq
import math
import os
import socket
import stat
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import islice

import regex as re

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.fs.report import Throttle

logger = init_logger(__name__)

# Evicting ahead: once the files and the stores in flight pass HIGH_WATER
# percent of max_bytes, the budget thread evicts down to LOW_WATER percent,
# so that a store rarely evicts and its task rarely removes files first.
HIGH_WATER = 95
LOW_WATER = 90
# Positions of the most recently seen requests' keys kept for the order
# (about 100 MiB; the least recently seen requests go first).
MAX_TRACKED_KEYS = 1 << 20
# Requests whose last copy of positions the scheduler thread remembers.
MAX_RECALLED_REQUESTS = 1 << 16
# Events posted before the scheduler thread wakes the budget thread.
MAX_EVENTS = 65536
# The budget thread's period: events applied, eviction ahead, file times.
BUDGET_INTERVAL_S = 0.05
# Chunks of earlier runs indexed per lock hold at start (a few ms), and the
# pause after each, so the scheduler thread's posts are applied meanwhile.
SCAN_BATCH = 1024
SCAN_PAUSE_S = 0.001
# The root is listed again (other engines' stores and removals) after at
# least ROOT_RESCAN_S, and after RESCAN_COST_FACTOR times the last listing's
# duration: the listing takes at most 1/RESCAN_COST_FACTOR of the thread.
ROOT_RESCAN_S = 2.0
RESCAN_COST_FACTOR = 20
# The engines' ledgers, in the rank directory; one of an engine that has
# not listed the root for LEDGER_STALE_S (it crashed) is removed.
LEDGER_DIR = "budget-ledgers"
LEDGER_STALE_S = 3600.0
# While no other engine's ledger was seen, the ledgers are read this often.
LEDGER_POLL_S = 1.0
# An evicted chunk leaves _removing once both happened.
_KEYS_TAKEN, _FILES_GONE = 1, 2
_HIT, _RECALL, _FORGET, _ADMIT, _STEP, _FINISH, _LOAD = range(7)

# Evicted chunks: (chunk id, group bitmask of their files, order time).
Evicted = list[tuple[bytes, int, int]]
# An engine's ledger: the bytes of the files it added and removed.
Ledger = tuple[int, int]


class BudgetRejection(OSError):
    """A store job the budget refused keys of (no room: every indexed file
    older in the eviction order is in use by a transfer): the job fails, but
    the disk did not (reported by the budget's rejection warning, not as a
    failed write), and the keys it wrote are stored."""


class Admission:
    """A store or load job's share of the budget: posted by the scheduler
    thread, decided when its event is applied (see FsTierBudget._apply())."""

    __slots__ = ("keys", "positions", "req_id", "pinned", "added", "result")

    def __init__(
        self,
        keys: Collection[OffloadKey],
        req_id: str | None = None,
        positions: list[int | None] | None = None,
    ) -> None:
        self.keys = keys
        self.req_id = req_id
        self.positions = positions  # a store's: each key's end-token position
        self.pinned: list[bytes] = []
        # a store's files not on disk before it: chunk id -> group bitmask
        self.added: dict[bytes, int] = {}
        # a store's: the keys that do not fit, the keys past a gap or of a
        # chunk being removed (not written), the evicted chunks whose files
        # its task removes first
        self.result: tuple[set[OffloadKey], set[OffloadKey], Evicted] | None = None


class _Request:
    """What the budget knows of a request: when it was first seen and its
    keys by (end-token position, group suffix)."""

    __slots__ = ("time", "keys")

    def __init__(self) -> None:
        self.time = time.time_ns()
        self.keys: dict[tuple[int, bytes], OffloadKey] = {}


def warn_beyond_free_space(label: str, root_dir: str, max_bytes: int) -> None:
    """Say at start where max_bytes is more than the root's free space:
    stores will fail once the disk is full."""
    with contextlib.suppress(OSError):
        st = os.statvfs(root_dir)
        free = st.f_bavail * st.f_frsize
        if max_bytes > free:
            logger.warning(
                "%s: max_bytes=%d is more than the free space of its filesystem "
                "(%d bytes): stores will fail once the disk is full",
                label,
                max_bytes,
                free,
            )


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


def _bit(key: OffloadKey) -> int:
    """The key's group's bit in a group bitmask."""
    return 1 << int.from_bytes(key[-4:], "big")


# a block file's name: its chunk id in lower-case hex (block_hash.hex())
_BLOCK_NAME = re.compile(r"(?:[0-9a-f]{2})+\.bin")


def _groups_of(bits: int) -> list[int]:
    return [g for g in range(bits.bit_length()) if bits >> g & 1]


class FsTierBudget:
    """The index, the eviction order and the start-up scan of a budgeted fs
    tier (see the module docstring)."""

    def __init__(
        self,
        max_bytes: int,
        file_sizes: Sequence[int],
        rank_dir: str,
        key_path: Callable[[OffloadKey], str],
        chunk_path: Callable[[bytes, int], str],
        label: str,
        chunk_tokens: dict[int, int],
        prefix_groups: Collection[int] | None = None,
        chunk_id: Callable[[bytes], bytes] | None = None,
        on_removal_errors: Callable[[int, str], None] | None = None,
        takes_evicted_keys: bool = True,
    ) -> None:
        """file_sizes: the bytes of a block file of each KV cache group.
        chunk_tokens: the tokens of one chunk of each KV cache group.
        prefix_groups: the groups a hit needs every earlier chunk of (full
        attention; None: every group). Chunks are indexed by the stem of
        their file names: chunk_id maps a block hash to it (a keyed
        namespace's; None: the hash itself), chunk_path maps it and a group
        index to the file, key_path a key to its file.
        on_removal_errors(count, last error): evicted files that could not
        be removed (the tier's rate-limited failure report).
        takes_evicted_keys: the tier calls take_evicted_keys() (it caches
        lookup() verdicts); if not, no keys are kept for it."""
        self.max_bytes = max_bytes
        self._sizes = list(file_sizes)  # a file's bytes, by group index
        self._rank_dir = rank_dir
        self._key_path = key_path
        self._chunk_path = chunk_path
        self._chunk_id = chunk_id
        self._label = label
        self._on_removal_errors = on_removal_errors
        self._takes_keys = takes_evicted_keys
        # a keyed chunk's block hash, kept only to give its keys back
        self._keep_hashes = chunk_id is not None and takes_evicted_keys
        self._chunk_tokens = {g.to_bytes(4, "big"): t for g, t in chunk_tokens.items()}
        prefix = set(chunk_tokens) if prefix_groups is None else set(prefix_groups)
        self._prefix = {g.to_bytes(4, "big") for g in prefix}
        # the full-attention group whose chunks cover the other groups' files
        cover = min(prefix, key=lambda g: chunk_tokens.get(g, 1 << 30), default=0)
        self._cover_group = cover.to_bytes(4, "big")
        self._cover_tokens = chunk_tokens.get(cover, 1)

        self._lock = threading.Lock()
        # the index: chunk id -> (order time, group bitmask of its files on
        # disk or being written); a heap of (order time, chunk id), with
        # stale entries skipped; the pins; the block hash of keyed chunks
        self._chunks: dict[bytes, tuple[int, int]] = {}
        self._heap: list[tuple[int, bytes]] = []
        self._pins: dict[bytes, int] = {}
        self._hash_of: dict[bytes, bytes] = {}
        # lookup()'s pins of the steps not ended (scheduler thread and
        # eviction, under _removing_lock); the current step's hits
        self._hit_pins: dict[bytes, int] = {}
        self._step_hits: list[bytes] = []
        self._requests: OrderedDict[str, _Request] = OrderedDict()
        self._tracked = 0  # keys in _requests
        self._events: deque[tuple] = deque()
        # chunks whose order time is not on their files yet
        self._dirty: set[bytes] = set()
        self._init_shared_root(rank_dir, label)
        # the scheduler thread's: req_id -> recorded positions last copied
        self._recalled: dict[str, int] = {}
        self._removing_lock = threading.Lock()
        self._removing: dict[bytes, int] = {}  # chunk id -> _KEYS_TAKEN | ...
        self._evicted_keys: deque[tuple[bytes, list[OffloadKey]]] = deque()
        self._gone_in_step: set[bytes] = set()  # takes_evicted_keys=False
        self._init_counters()

        self._wake = threading.Event()
        self._stop = False
        self.scan_done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="vllm_kv_py_fs_budget", daemon=True
        )
        self._thread.start()

    def _init_counters(self) -> None:
        """The bytes counted and what the reports say."""
        self.used = 0
        self.unlinking = 0  # evicted ahead, files not removed yet
        self.evicted_files = self.rejected_files = self.rejected_jobs = 0
        self.unreachable_files = 0  # not written: past a gap, or being removed
        self.removal_errors = 0
        self._reported = (0, 0, 0)
        self._warned = (0, 0)
        self._report_throttle, self._warning_throttle = Throttle(), Throttle()
        self._errors = 0  # the budget thread's failures
        self._error_throttle = Throttle()

    def _init_shared_root(self, rank_dir: str, label: str) -> None:
        """What the budget keeps of the other engines on its root."""
        # while the root is listed: the chunks stored, evicted or found
        # since the listing began, which it may have missed (see _rescan())
        self._changed: set[bytes] | None = None
        self.rescans = 0
        self.adopted_files = self.vanished_files = 0  # other engines'
        # this engine's block files since start: the bytes of those it
        # stores (from their admission) and of those it removed (from their
        # eviction)
        self.added_bytes = self.removed_bytes = 0
        # the root's bytes this index does not hold: the other engines' net
        # stores since the last listing (less the files they removed of this
        # index), and this index's victims kept on disk
        self.others = 0
        self._ledgers = _Ledgers(rank_dir, self.max_bytes, label)
        self._next_rescan = self._listed_at = 0.0
        # another engine's files found unindexed, or victims kept: list again
        self._relist = False

    # ---- scheduler thread: O(1) per key, no filesystem call ---------------

    def on_hit(
        self, key: OffloadKey, req_id: str, positions: dict[OffloadKey, int]
    ) -> bool:
        """lookup() found the key's file. Returns whether it stays: pinned
        here at once, until the end of the step (by then its promotion is
        pinned), unless an eviction marked it removing (a miss: its load
        would fail). Eviction picks and marks its victims under the same
        lock, so a chunk is either pinned first or a miss."""
        h = self._cid(key[:-4])
        with self._removing_lock:
            if h in self._removing or h in self._gone_in_step:
                return False
            self._hit_pins[h] = self._hit_pins.get(h, 0) + 1
        self._step_hits.append(h)
        self._recall(req_id, positions)
        self._events.append((_HIT, key, req_id, positions.get(key)))
        return True

    def forget_request(self, req_id: str) -> None:
        """The request finished: no store of it follows."""
        self._recalled.pop(req_id, None)
        self._events.append((_FORGET, req_id))

    def admit_store(
        self,
        keys: Collection[OffloadKey],
        req_id: str,
        positions: dict[OffloadKey, int],
    ) -> Admission:
        """A store job's admission, decided by its task (see admitted()).
        positions: every key of the request the scheduler recorded an
        end-token position of, read here only (see _recall())."""
        job = Admission(keys, req_id, [positions.get(k) for k in keys])
        self._recall(req_id, positions)
        self._events.append((_ADMIT, job))
        return job

    def _recall(self, req_id: str, positions: dict[OffloadKey, int]) -> None:
        """Post the request's positions recorded since the last call (a
        prefix another tier served is in no event of this tier). The
        scheduler only adds to them, in order: O(new keys)."""
        last = self._recalled.get(req_id, 0)
        if len(positions) > last:
            if len(self._recalled) >= MAX_RECALLED_REQUESTS:
                self._recalled.clear()  # bounded; a request copied again is correct
                last = 0
            new = dict(islice(reversed(positions.items()), len(positions) - last))
            self._recalled[req_id] = len(positions)
            self._events.append((_RECALL, req_id, new))

    def pin_load(self, keys: Collection[OffloadKey]) -> Admission:
        """A load job's chunks, pinned until finish_job()."""
        job = Admission(keys)
        self._events.append((_LOAD, job))
        return job

    def finish_job(self, job: Admission, failed: Iterable[OffloadKey]) -> None:
        """A job finished: forget the files its failed keys left missing
        (files it added, or that a failed load removed); unpin its chunks."""
        self._events.append((_FINISH, job, list(failed)))

    def end_step(self) -> None:
        """on_schedule_end(): lookup()'s pins of the step are dropped once
        the events before this one (its promotions' pins) are applied."""
        self._events.append((_STEP, self._step_hits))
        self._step_hits = []
        with self._removing_lock:
            self._gone_in_step.clear()
        if len(self._events) > MAX_EVENTS:
            self._wake.set()

    def take_evicted_keys(self) -> list[list[OffloadKey]]:
        """The keys of the chunks evicted since the last call, one list per
        chunk (for a keyed namespace, those of keys stored or found since
        start): lookup()'s cached verdicts of them become misses."""
        taken: list[bytes] = []
        out: list[list[OffloadKey]] = []
        while self._evicted_keys:
            h, keys = self._evicted_keys.popleft()
            taken.append(h)
            if keys:
                out.append(keys)
        if taken:
            with self._removing_lock:
                for h in taken:
                    self._settle(h, _KEYS_TAKEN)
        return out

    def written(self, job: Admission, keys: Iterable[OffloadKey]) -> None:
        """A store task wrote these keys' files (on its I/O thread): they get
        their chunks' order times now, so that a restart after a crash reads
        the order back."""
        with self._lock:
            times = []
            for k in keys:
                h = self._cid(k[:-4])
                chunk = self._chunks.get(h)
                if chunk is not None:
                    times.append((h, int.from_bytes(k[-4:], "big"), chunk[0]))
        for h, g, t in times:
            with contextlib.suppress(OSError):  # removed since
                os.utime(self._chunk_path(h, g), ns=(t, t), follow_symlinks=False)

    def is_removing(self, key: OffloadKey) -> bool:
        """lookup(): the key's chunk was evicted and is not gone yet (a miss:
        its load would fail)."""
        with self._removing_lock:
            return bool(self._removing) and self._cid(key[:-4]) in self._removing

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join()
        with self._lock:
            self._apply()
        self._persist_times()
        self._ledgers.close()
        self._report(force=True)
        self._warn_rejections(force=True)

    # ---- I/O threads ------------------------------------------------------

    def admitted(
        self, job: Admission
    ) -> tuple[set[OffloadKey], set[OffloadKey], Evicted]:
        """A store task's first step: its job's admission (see _admit()):
        the keys refused, the keys past a gap, and the evicted chunks whose
        files the caller removes before it writes (handed to the job's first
        task only). The thread that gets the lock applies the events posted
        before the job: a store never waits on the budget thread."""
        with self._lock:
            if job.result is None:
                self._apply(job)
            assert job.result is not None  # _apply(job) admits it
            rejected, unreachable, evicted = job.result
            job.result = (rejected, unreachable, [])
        if self.used + self.others > self.max_bytes * HIGH_WATER // 100:
            self._wake.set()  # evict ahead, off the write path
        if rejected:
            self._warn_rejections()
        return rejected, unreachable, evicted

    def remove_evicted(self, evicted: Evicted) -> None:
        """Remove evicted chunks' files (a store's task, before it writes)."""
        self._remove(evicted)

    def _remove(self, evicted: Evicted) -> None:
        errors, error, not_removed, stuck = 0, "", 0, 0
        shared = self._ledgers.shared  # set once, by the budget thread
        for h, groups, t in evicted:
            if shared and self._raised_elsewhere(h, groups, t):
                not_removed += self._bytes(groups)
                continue  # another engine's hit raised it: kept, whole
            for g in _groups_of(groups):
                try:
                    os.remove(self._chunk_path(h, g))
                except FileNotFoundError:
                    # another engine removed (and counted) it, or it was
                    # never written
                    not_removed += self._bytes(1 << g)
                except OSError as e:
                    errors, error = errors + 1, str(e)
                    not_removed += self._bytes(1 << g)
                    stuck += self._bytes(1 << g)
        with self._lock:
            self.removal_errors += errors
            self.removed_bytes -= not_removed  # counted when evicted
            # on disk but not indexed (a removal failed), or counted removed
            # in others already: the next listing counts them
            recount = not_removed if shared else stuck
            if recount:
                self.others += recount
                self._relist = True
        with self._removing_lock:
            for h, _, _ in evicted:
                self._settle(h, _FILES_GONE)
        if errors and self._on_removal_errors is not None:
            self._on_removal_errors(errors, error)

    def _newer_on_disk(self, h: bytes, g: int, t: int) -> bool:
        try:
            return (
                os.stat(self._chunk_path(h, g), follow_symlinks=False).st_mtime_ns >= t
            )
        except OSError:
            return False

    def _raised_elsewhere(self, h: bytes, groups: int, t: int) -> bool:
        """Whether a file of the chunk has a newer mtime than its order time
        here (another engine's hit raised it)."""
        for g in _groups_of(groups):
            with contextlib.suppress(OSError):
                st = os.stat(self._chunk_path(h, g), follow_symlinks=False)
                return stat.S_ISREG(st.st_mode) and st.st_mtime_ns > t
        return False

    # ---- the events, in order (under _lock) -------------------------------

    def _apply(self, until: Admission | None = None) -> None:
        """Apply the events posted so far, or up to until's admission."""
        events = self._events
        while events and (until is None or until.result is None):
            event = events.popleft()
            kind = event[0]
            if kind == _HIT:
                self._hit(*event[1:])
            elif kind == _RECALL:
                req = self._request(event[1])
                for key, position in event[2].items():
                    self._note(req, key, position)
            elif kind == _ADMIT:
                self._admit(event[1])
            elif kind == _STEP:
                with self._removing_lock:
                    for h in event[1]:
                        n = self._hit_pins.pop(h)
                        if n > 1:
                            self._hit_pins[h] = n - 1
            elif kind == _FINISH:
                self._finish(event[1], event[2])
            elif kind == _FORGET:
                gone = self._requests.pop(event[1], None)
                if gone is not None:
                    self._tracked -= len(gone.keys)
            else:
                job = event[1]
                for h in {self._cid(k[:-4]) for k in job.keys}:
                    self._pin_chunk(job, h)

    def _bytes(self, groups: int) -> int:
        """The bytes of a chunk's files of a group bitmask (a group past
        file_sizes, which no config names: the largest file)."""
        sizes = self._sizes
        return sum(
            sizes[g] if g < len(sizes) else max(sizes) for g in _groups_of(groups)
        )

    def _cid(self, block_hash: bytes) -> bytes:
        """A block hash's chunk id: the stem of its files' names."""
        return block_hash if self._chunk_id is None else self._chunk_id(block_hash)

    def _request(self, req_id: str) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = _Request()
        else:
            self._requests.move_to_end(req_id)
        return req

    def _note(self, req: _Request, key: OffloadKey, position: int | None) -> None:
        if position is None or (position, key[-4:]) in req.keys:
            return
        req.keys[(position, key[-4:])] = key
        self._tracked += 1
        self._bound_requests()

    def _bound_requests(self) -> None:
        while self._tracked > MAX_TRACKED_KEYS and len(self._requests) > 1:
            dropped = self._requests.popitem(last=False)[1]
            self._tracked -= len(dropped.keys)

    def _order(self, req: _Request, key: OffloadKey, position: int | None) -> int:
        """The order time the request gives its key."""
        if position is None:  # no prefix order to keep: recency
            return time.time_ns()
        if key[-4:] in self._prefix:
            return req.time - 2 * position
        cover = -(-position // self._cover_tokens) * self._cover_tokens
        return req.time - 2 * cover - 1

    def _raise(self, h: bytes, t: int) -> bool:
        """Raise a chunk's order time to t; whether it was older."""
        chunk = self._chunks.get(h)
        if chunk is None or chunk[0] >= t:
            return False
        self._chunks[h] = (t, chunk[1])
        heapq.heappush(self._heap, (t, h))
        self._dirty.add(h)
        return True

    def _hit(self, key: OffloadKey, req_id: str, position: int | None) -> None:
        req = self._request(req_id)
        self._note(req, key, position)
        h = self._cid(key[:-4])
        chunk = self._chunks.get(h)
        if chunk is None or not chunk[1] & _bit(key):
            # another engine's file, or one the start-up scan has not reached:
            # indexed at the request's order, which its mtime then says
            if not self._adopt(h, key, self._order(req, key, position)):
                return
        elif self._keep_hashes:
            self._hash_of.setdefault(h, key[:-4])
        self._raise(h, self._order(req, key, position))
        if position is not None:
            self._raise_prefix(req, key, position)

    def _raise_prefix(self, req: _Request, key: OffloadKey, position: int) -> None:
        """Keep the request's chunks before the key at least as new as it:
        its group's, and for a sliding-window or mamba key its covering
        full-attention chunk and those before that (another tier may have
        served them: this tier saw no hit or store of theirs)."""
        self._raise_earlier(req, key, position)
        if key[-4:] not in self._prefix:
            before = self._needs(req, key, position)
            if before is not None:
                self._raise(self._cid(before[0][:-4]), self._order(req, *before))
                self._raise_earlier(req, *before)

    def _raise_earlier(self, req: _Request, key: OffloadKey, position: int) -> None:
        """The request's earlier chunks of the key's group, back while they
        are older than the request's times (amortized O(1) per key)."""
        group = key[-4:]
        step = self._chunk_tokens.get(group, 0)
        p = position - step
        while step and p > 0:
            earlier = req.keys.get((p, group))
            if earlier is None or not self._raise(
                self._cid(earlier[:-4]), self._order(req, earlier, p)
            ):
                return
            p -= step

    def _admit(self, job: Admission) -> None:
        """Reserve room for a store's new files, evicting older chunks first;
        set its result (see Admission). Keys nearest the prompt's start go
        first; a key is refused when only chunks newer than it (its own
        prefix's among them) could make room for it."""
        assert job.req_id is not None and job.positions is not None
        req = self._request(job.req_id)
        pairs = list(zip(job.keys, job.positions))
        for key, position in pairs:
            self._note(req, key, position)
        # full-attention keys first, each in prompt order: a key is written
        # only if what it needs is on disk or written before it
        pairs.sort(key=lambda kp: (kp[0][-4:] not in self._prefix, kp[1] or 0))
        coming: set[OffloadKey] = set()
        rejected: set[OffloadKey] = set()
        unreachable: set[OffloadKey] = set()
        evicted: Evicted = []
        for key, position in pairs:
            h = self._cid(key[:-4])
            before = self._needs(req, key, position)
            with self._removing_lock:  # evicted, also by this job's keys before
                removing = h in self._removing
            if removing or (
                before is not None
                and before[0] not in coming
                and not self._has_file(req, *before)
            ):
                unreachable.add(key)
                continue
            if before is not None:  # kept while this key is written
                self._pin_chunk(job, self._cid(before[0][:-4]))
            t = self._order(req, key, position)
            self._index(h, t, key)
            self._pin_chunk(job, h)
            if position is not None:  # before evicting: they are newer
                self._raise_prefix(req, key, position)
            bit = _bit(key)
            if not self._chunks[h][1] & bit:
                size = self._bytes(bit)
                need = self.used + self.others + self.unlinking + size - self.max_bytes
                if need > 0:
                    evicted += self._evict(need, older_than=t)
                if self.used + self.others + self.unlinking + size > self.max_bytes:
                    rejected.add(key)
                    continue
                order, groups = self._chunks[h]
                self._chunks[h] = (order, groups | bit)
                job.added[h] = job.added.get(h, 0) | bit
                self.used += size
                self.added_bytes += size  # in the ledger from now: reserved
                self._mark_changed(h)
            coming.add(key)
        self.unreachable_files += len(unreachable)
        if rejected:
            self.rejected_files += len(rejected)
            self.rejected_jobs += 1
        job.result = (rejected, unreachable, evicted)

    def _index(self, h: bytes, t: int, key: OffloadKey) -> None:
        """Index a chunk at order time t, or raise it to t."""
        if h not in self._chunks:
            self._chunks[h] = (t, 0)
            heapq.heappush(self._heap, (t, h))
            if self._keep_hashes:
                self._hash_of[h] = key[:-4]
        else:
            self._raise(h, t)

    def _needs(
        self, req: _Request, key: OffloadKey, position: int | None
    ) -> tuple[OffloadKey, int] | None:
        """The key (and its position) that a hit on this key needs on disk
        before it; None: a root, as far as the request's keys tell."""
        if position is None:
            return None
        group = key[-4:]
        if group in self._prefix:
            step = self._chunk_tokens.get(group, 0)
            before = position - step
            if not step or before <= 0:
                return None
        else:
            before = -(-position // self._cover_tokens) * self._cover_tokens
            group = self._cover_group
        key_before = req.keys.get((before, group))
        return None if key_before is None else (key_before, before)

    def _has_file(self, req: _Request, key: OffloadKey, position: int) -> bool:
        """Whether the key has a file: indexed (lookup() indexes the files it
        finds), or, until the start-up scan is done, there (a filesystem
        call, on an I/O thread or the budget thread, under _lock, only until
        then). A file not indexed yet is indexed now, at the request's order
        for it, so that its successors never outlive it."""
        h, bit = self._cid(key[:-4]), _bit(key)
        chunk = self._chunks.get(h)
        if chunk is not None and chunk[1] & bit:
            return True
        if self.scan_done.is_set() or not os.path.exists(self._key_path(key)):
            return False
        return self._adopt(h, key, self._order(req, key, position))

    def _adopt(self, h: bytes, key: OffloadKey, t: int) -> bool:
        """Index a key's file found on disk at order time t (its mtime is set
        to it); False if its chunk is being removed."""
        with self._removing_lock:
            if h in self._removing:
                return False
        bit = _bit(key)
        self._index(h, t, key)
        order, groups = self._chunks[h]
        self._chunks[h] = (order, groups | bit)
        self.used += self._bytes(bit)
        if self.scan_done.is_set():
            # another engine's: in others if its ledger was read since it was
            # stored (a first reading counts nothing); never below nothing
            self.others = max(0, self.others - self._bytes(bit))
            self._relist = True
        self._dirty.add(h)
        self._mark_changed(h)
        return True

    def _mark_changed(self, h: bytes) -> None:
        if self._changed is not None:
            self._changed.add(h)

    def _pin_chunk(self, job: Admission, h: bytes) -> None:
        """Indexed or not (a file the start-up scan has not reached)."""
        self._pins[h] = self._pins.get(h, 0) + 1
        job.pinned.append(h)

    def _unpin(self, h: bytes) -> None:
        n = self._pins.pop(h, 0)
        if n < 1:
            raise RuntimeError(
                f"{self._label}: chunk {h.hex()} unpinned more often than pinned"
            )
        if n > 1:
            self._pins[h] = n - 1
        elif h in self._chunks and not self._chunks[h][1]:
            self._drop(h)  # nothing of it on disk

    def _drop(self, h: bytes) -> None:
        del self._chunks[h]
        self._dirty.discard(h)
        self._hash_of.pop(h, None)

    def _finish(self, job: Admission, failed: list[OffloadKey]) -> None:
        for h in job.added:  # written after the listing passed, maybe
            self._mark_changed(h)
        for key in failed:
            h, bit = self._cid(key[:-4]), _bit(key)
            chunk = self._chunks.get(h)
            if job.positions is not None and not job.added.get(h, 0) & bit:
                continue  # a store over a file that is still there
            if chunk is not None and chunk[1] & bit:
                self._chunks[h] = (chunk[0], chunk[1] & ~bit)
                self.used -= self._bytes(bit)
                if job.positions is not None:  # a store's reservation
                    self.added_bytes -= self._bytes(bit)
        for h in job.pinned:
            self._unpin(h)

    def _evict(
        self, need: int, floor: int = 0, older_than: int | None = None
    ) -> Evicted:
        """The oldest unpinned chunks (older than older_than), until need
        bytes are freed or one more would take used below floor."""
        evicted: Evicted = []
        skipped: list[tuple[int, bytes]] = []
        heap = self._heap
        # victims are picked and marked removing under the lock lookup()'s
        # pins take: a chunk is pinned first or a miss
        with self._removing_lock:
            while need > 0 and heap:
                if older_than is not None and heap[0][0] >= older_than:
                    break
                t, h = heapq.heappop(heap)
                chunk = self._chunks.get(h)
                if chunk is None or chunk[0] != t:
                    continue  # stale: raised since, or gone
                if h in self._pins or h in self._hit_pins or not chunk[1]:
                    skipped.append((t, h))
                    continue
                size = self._bytes(chunk[1])
                if self.used - size < floor:
                    skipped.append((t, h))
                    break
                del self._chunks[h]
                self._dirty.discard(h)
                self._mark_changed(h)
                self._removing[h] = 0 if self._takes_keys else _KEYS_TAKEN
                self.used -= size
                self.removed_bytes += size  # in the ledger from now
                self.evicted_files += chunk[1].bit_count()
                need -= size
                evicted.append((h, chunk[1], t))
        for entry in skipped:
            heapq.heappush(heap, entry)
        if evicted and self._takes_keys:
            for h, groups, _ in evicted:
                self._evicted_keys.append((h, self._keys_of(h, groups)))
        return evicted

    def _keys_of(self, h: bytes, groups: int) -> list[OffloadKey]:
        block_hash = h if self._chunk_id is None else self._hash_of.pop(h, None)
        if block_hash is None:
            return []  # never stored nor found since start: no cached verdict
        return [
            OffloadKey(block_hash + g.to_bytes(4, "big")) for g in _groups_of(groups)
        ]

    def _settle(self, h: bytes, done: int) -> None:
        """Under _removing_lock: one of an evicted chunk's two ends."""
        state = self._removing.get(h)
        if state is not None:
            if state | done == _KEYS_TAKEN | _FILES_GONE:
                del self._removing[h]
                if not self._takes_keys:
                    self._gone_in_step.add(h)
            else:
                self._removing[h] = state | done

    # ---- the budget thread ------------------------------------------------

    def _run(self) -> None:
        try:
            self._rescan(start_up=True)
        except Exception as e:  # the tier still works, unindexed files stay
            logger.warning("%s: could not index existing files: %s", self._label, e)
        finally:
            self.scan_done.set()
        while not self._stop:
            self._wake.wait(BUDGET_INTERVAL_S)
            self._wake.clear()
            try:
                self._tick()
                if time.monotonic() >= self._next_rescan and (
                    # a ledger moves as a job is admitted, its files change
                    # later: list until one listing began ROOT_RESCAN_S after
                    # the last change seen
                    self._ledgers.changed_at + ROOT_RESCAN_S > self._listed_at
                    or self._relist
                ):
                    self._rescan()
            except Exception as e:  # reported, rate-limited; the next tick retries
                self._errors += 1
                if self._error_throttle.due():
                    logger.exception(
                        "%s: the budget thread failed %d time(s) since start: %s",
                        self._label,
                        self._errors,
                        e,
                    )

    def _tick(self) -> None:
        """Apply the events, count the other engines' bytes, evict ahead,
        persist order times, report."""
        with self._lock:
            self._apply()
            if len(self._heap) > 2 * len(self._chunks) + SCAN_BATCH:
                self._heap = [(c[0], h) for h, c in self._chunks.items()]
                heapq.heapify(self._heap)  # drop the stale entries
        self._count_others()
        with self._lock:
            evicted: Evicted = []
            total = self.used + self.others
            if total > self.max_bytes * HIGH_WATER // 100:
                low = self.max_bytes * LOW_WATER // 100
                evicted = self._evict(total - low, floor=low - self.others)
                ahead = sum(self._bytes(g) for _, g, _ in evicted)
                self.unlinking += ahead  # stores count them until gone
        if evicted:
            self._remove(evicted)
            with self._lock:
                self.unlinking -= ahead
                own = (self.added_bytes, self.removed_bytes)
            self._ledgers.publish(own)  # before the others evict the same
        self._persist_times()
        if self._report_throttle.due():
            self._report()
        self._warn_rejections()

    def _count_others(self) -> None:
        """Publish this engine's ledger and count the others' changes."""
        with self._lock:
            own = (self.added_bytes, self.removed_bytes)
        delta = self._ledgers.others_since(own)
        if delta:
            with self._lock:
                self.others += delta

    def _persist_times(self) -> None:
        """Set the files of chunks whose order time changed to it (their
        mtime), for a restart to read back."""
        with self._lock:
            dirty = [(h, self._chunks.get(h)) for h in self._dirty]
            self._dirty.clear()
        shared = self._ledgers.shared
        for h, chunk in dirty:
            if chunk is None:
                continue
            for g in _groups_of(chunk[1]):
                if shared and self._newer_on_disk(h, g, chunk[0]):
                    continue  # another engine raised it further: never lower
                # removed since, or not written yet (its store sets it)
                with contextlib.suppress(OSError):
                    os.utime(
                        self._chunk_path(h, g),
                        ns=(chunk[0], chunk[0]),
                        follow_symlinks=False,
                    )

    def _rescan(self, start_up: bool = False) -> None:
        """List the root and bring the index to it, in batches: index the
        files it lacks (other engines' stores, earlier runs'), take the newer
        order times of other engines' hits, forget the files gone (other
        engines' evictions); then evict down to max_bytes. A chunk stored,
        evicted or found since the listing began is left as it is: the
        listing may have missed that."""
        start = time.monotonic()
        with self._lock:
            self._relist = False
            self._changed = set()
            indexed = list(self._chunks)
            own = (self.added_bytes, self.removed_bytes)
        self._ledgers.others_since(own, force=True)
        at_start = self._ledgers.read_others()
        try:
            found = self._walk()
            if found is None:
                return
            at_end = self._ledgers.read_others()
            listed = list(found.items())
            adopted = vanished = removed = 0
            for i in range(0, max(len(listed), len(indexed)), SCAN_BATCH):
                if self._stop:
                    return
                with self._lock:
                    self._apply()
                    changed = self._changed
                    for h, (t, groups) in listed[i : i + SCAN_BATCH]:
                        if h not in changed:
                            n = self._insert_found(h, t, groups)
                            adopted += n.bit_count()
                            if not start_up:  # in others until now
                                self.others -= self._bytes(n)
                    for h in indexed[i : i + SCAN_BATCH]:
                        if h not in changed:
                            n = self._forget_gone(h, found.get(h, (0, 0))[1])
                            vanished += n.bit_count()
                            if not start_up:  # counted removed in others
                                self.others += self._bytes(n)
                    evicted = self._evict(self.used - self.max_bytes)
                removed += sum(groups.bit_count() for _, groups, _ in evicted)
                self._remove(evicted)
                time.sleep(SCAN_PAUSE_S)
        finally:
            with self._lock:
                self._changed = None
            took = time.monotonic() - start  # a failed listing waits as long
            self._next_rescan = time.monotonic() + max(
                ROOT_RESCAN_S, RESCAN_COST_FACTOR * took
            )
        others = self._ledgers.listed(at_start, at_end)
        with self._lock:  # the index is the listing now
            self.others = others
        self._listed_at = start
        self._ledgers.remove_stale(max(LEDGER_STALE_S, 100 * took))
        self.rescans += 1
        if start_up:
            logger.info(
                "%s: indexed %d chunk(s) of earlier runs in %.1f s; removed %d "
                "file(s) to fit max_bytes=%d; %d bytes used",
                self._label,
                len(listed),
                took,
                removed,
                self.max_bytes,
                self.used,
            )
        else:
            self.adopted_files += adopted
            self.vanished_files += vanished

    def _walk(self) -> dict[bytes, tuple[int, int]] | None:
        """The root's block files: chunk id -> (newest mtime, group bitmask);
        None if the budget stopped meanwhile. The events posted meanwhile
        are applied every SCAN_BATCH files."""
        found: dict[bytes, tuple[int, int]] = {}
        files = 0
        for d1 in _listdir(self._rank_dir):
            for d2 in _listdir(d1.path) if d1.is_dir(follow_symlinks=False) else ():
                # a KV cache group of this layout, in ASCII digits: not one
                # whose mask someone writing into the root could make huge
                group = d2.name[d2.name.find("_g") + 2 :]
                if not (
                    "_g" in d2.name
                    and group.isascii()
                    and group.isdigit()
                    and int(group) < len(self._sizes)
                    and d2.is_dir(follow_symlinks=False)
                ):
                    continue
                bit = 1 << int(group)
                for f in _listdir(d2.path):
                    if self._stop:
                        return None
                    if not _BLOCK_NAME.fullmatch(f.name):
                        continue
                    try:
                        st = f.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed since
                    h, t = bytes.fromhex(f.name[:-4]), st.st_mtime_ns
                    if (
                        not stat.S_ISREG(st.st_mode)
                        or self._chunk_path(h, int(group)) != f.path
                    ):
                        continue  # not a block file: neither counted nor removed
                    old = found.get(h, (t, 0))
                    found[h] = (max(t, old[0]), old[1] | bit)
                    files += 1
                    if files % SCAN_BATCH == 0:
                        with self._lock:
                            self._apply()
                        self._count_others()
        return found

    def _insert_found(self, h: bytes, t: int, groups: int) -> int:
        """Index a chunk's files the listing found; the group bitmask of the
        files it adds."""
        with self._removing_lock:
            if h in self._removing:
                return 0  # evicted: its files are going
        chunk = self._chunks.get(h)
        if chunk is None:
            chunk = self._chunks[h] = (t, groups)
            heapq.heappush(self._heap, (t, h))
            added = groups
        else:
            added = groups & ~chunk[1]
            if added or t > chunk[0]:
                self._chunks[h] = (max(t, chunk[0]), chunk[1] | groups)
                heapq.heappush(self._heap, (self._chunks[h][0], h))
        self.used += self._bytes(added)
        return added

    def _forget_gone(self, h: bytes, on_disk: int) -> int:
        """Forget the chunk's files the listing did not find (another engine
        removed them) unless a transfer holds it; the group bitmask of those
        forgotten. lookup()'s cached verdicts of them become misses."""
        chunk = self._chunks.get(h)
        if chunk is None or h in self._pins or not chunk[1] & ~on_disk:
            return 0
        gone = chunk[1] & ~on_disk
        self.used -= self._bytes(gone)
        block_hash = h if self._chunk_id is None else self._hash_of.get(h)
        if block_hash is not None and self._takes_keys:
            keys = [
                OffloadKey(block_hash + g.to_bytes(4, "big")) for g in _groups_of(gone)
            ]
            self._evicted_keys.append((h, keys))
        if chunk[1] & on_disk:
            self._chunks[h] = (chunk[0], chunk[1] & on_disk)
        else:
            self._drop(h)
        return gone

    # ---- reports ----------------------------------------------------------

    def _report(self, force: bool = False) -> None:
        now = (self.used + self.unlinking, self.evicted_files, self.rejected_files)
        if now == self._reported and not force:
            return
        logger.info(
            "%s: %d of max_bytes=%d bytes used, %d files evicted and %d "
            "rejected since the previous report (%d and %d since start); "
            "other engines' files on the root since start: %d indexed, %d gone",
            self._label,
            now[0],
            self.max_bytes,
            self.evicted_files - self._reported[1],
            self.rejected_files - self._reported[2],
            self.evicted_files,
            self.rejected_files,
            self.adopted_files,
            self.vanished_files,
        )
        self._reported = now

    def _warn_rejections(self, force: bool = False) -> None:
        """Stores refused since the previous warning, if any: at most one
        line per REPORT_INTERVAL_S (report.Throttle: said by one thread)."""
        files, jobs = self.rejected_files, self.rejected_jobs
        last_files, last_jobs = self._warned
        if files == last_files or not self._warning_throttle.due(force):
            return
        self._warned = (files, jobs)
        logger.warning(
            "%s: %d block file(s) of %d store job(s) not written since the "
            "previous report (%d and %d since start): no room in "
            "max_bytes=%d (%d bytes indexed here, %d by other engines on the "
            "root not listed yet, %d being removed) once every file older in "
            "the eviction order and not in use by a transfer was evicted. The "
            "disk did not fail; the keys are not offloaded. A larger "
            "max_bytes keeps them.",
            self._label,
            files - last_files,
            jobs - last_jobs,
            files,
            jobs,
            self.max_bytes,
            self.used,
            self.others,
            self.unlinking,
        )


class _Ledgers:
    """The ledgers of the engines on one rank directory: a file per engine
    with the bytes of block files it added (stored new) and removed since
    its start (two 8-byte integers). Owned by the budget thread.

    Another engine's stores and removals since a listing are its ledger now
    less its ledger then: counted at once, without a listing. An engine that
    stopped (its ledger gone) counts as last read. A ledger not read before,
    or that moves back or by more than max_bytes in one read, counts nothing
    and asks for a listing (changed_at), which counts the files themselves.
    """

    def __init__(self, rank_dir: str, max_bytes: int, label: str) -> None:
        self._rank_dir = rank_dir
        self._dir = os.path.join(rank_dir, LEDGER_DIR)
        self._max_bytes = max_bytes
        self._label = label
        self._name = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        self._published: Ledger | None = None
        self._last: dict[str, Ledger] = {}  # the other engines', last read
        self._next_read = 0.0
        # another engine's ledger was seen since start: the root is shared
        self.shared = False
        # when another engine's ledger was last seen to change (monotonic)
        self.changed_at = -math.inf
        self._dir_mtime = 0
        self.errors = 0
        self._warning = Throttle()

    def others_since(self, own: Ledger, force: bool = False) -> int:
        """Publish this engine's ledger; the other engines' net bytes since
        the previous call (read every BUDGET_INTERVAL_S while the root is
        shared, else every LEDGER_POLL_S, or when forced)."""
        self._publish(own, force)
        now = time.monotonic()
        if not force and now < self._next_read:
            return 0
        self._next_read = now + (BUDGET_INTERVAL_S if self.shared else LEDGER_POLL_S)
        last = self._last
        read = self.read_others()
        self._last = {**last, **read}  # a stopped engine: as last read
        return sum(self._delta(last.get(n), x) for n, x in read.items())

    def _delta(self, last: Ledger | None, now: Ledger) -> int:
        """An engine's net bytes since its last read. One not read before
        (it started, or this engine did, since the listing), or one that
        moved back or by more than max_bytes, counts nothing: the next
        listing, which it asks for, counts its files."""
        if last is None or not (
            last[0] <= now[0] <= last[0] + self._max_bytes
            and last[1] <= now[1] <= last[1] + self._max_bytes
        ):
            self.changed_at = time.monotonic()
            return 0
        if now != last:
            self.changed_at = time.monotonic()
        return _net(now) - _net(last)

    def read_others(self) -> dict[str, Ledger]:
        """The other engines' ledgers (16-byte regular files). A change of
        the ledgers' directory (an engine came or went, even between two
        reads) asks for a listing."""
        out: dict[str, Ledger] = {}
        dir_fd = _open_dir(self._dir)
        if dir_fd is None:
            return out
        try:
            mtime = os.stat(dir_fd).st_mtime_ns
            entries = _scandir(dir_fd)
            if mtime != self._dir_mtime:
                self._dir_mtime = mtime
                if self.shared or any(e.name != self._name for e in entries):
                    self.changed_at = time.monotonic()
            for entry in entries:
                if entry.name == self._name:
                    continue
                ledger = self._read(entry.name, dir_fd)
                if ledger is not None and min(ledger) >= 0:
                    out[entry.name] = ledger
                    self.shared = True
        except OSError:
            pass  # read again at the next tick
        finally:
            os.close(dir_fd)
        return out

    @staticmethod
    def _read(name: str, dir_fd: int) -> Ledger | None:
        try:  # O_NONBLOCK: a FIFO never blocks the budget thread
            fd = os.open(
                name,
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                dir_fd=dir_fd,
            )
        except OSError:
            return None  # removed: its engine stopped
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = os.read(fd, 17)
        except OSError:
            return None
        finally:
            os.close(fd)
        return struct.unpack("<qq", data) if len(data) == 16 else None

    def listed(self, at_start: dict[str, Ledger], at_end: dict[str, Ledger]) -> int:
        """A listing between two reads of the other engines' ledgers ended:
        their net bytes since, counting the files they added since it began
        (it may have missed them) and removed since it ended."""
        self._last = dict(at_end)
        added = 0
        for name, ledger in at_end.items():
            start = at_start.get(name)
            if start is None or start != ledger:
                self.changed_at = time.monotonic()  # list again
            if start is not None and 0 <= ledger[0] - start[0] <= self._max_bytes:
                added += ledger[0] - start[0]
        return added

    def publish(self, own: Ledger) -> None:
        self._publish(own, False)

    def _publish(self, own: Ledger, force: bool) -> None:
        """Write this engine's ledger where it changed (force: also where it
        did not, so that its mtime says the engine lives): opened, written
        and closed, which NFS clients flush to the server."""
        if (own == self._published and not force) or not os.path.isdir(self._rank_dir):
            return  # unchanged, or no file stored yet (the tier makes the dir)
        try:
            st = os.stat(self._rank_dir)
            # the rank directory's modes (group access, setgid), umask aside
            with contextlib.suppress(FileExistsError):
                os.mkdir(self._dir)
                # through an fd opened without following a link: with
                # group_access a member could put one there meanwhile
                dir_fd = os.open(
                    self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                )
                try:
                    os.fchmod(dir_fd, st.st_mode & 0o7777)
                finally:
                    os.close(dir_fd)
            if not stat.S_ISDIR(os.lstat(self._dir).st_mode):
                raise NotADirectoryError(f"{self._dir} is not a directory")
            fd = os.open(
                os.path.join(self._dir, self._name),
                os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
            try:
                os.fchmod(fd, st.st_mode & 0o666)
                os.pwrite(fd, struct.pack("<qq", *own), 0)
            finally:
                os.close(fd)
            self._published = own
        except OSError as e:  # the others miss this engine's bytes meanwhile
            self.errors += 1
            if self._warning.due():
                logger.warning(
                    "%s: could not write this engine's budget ledger in %s "
                    "(%d time(s) since start): %s. The other engines on the "
                    "root do not count its stores until they list the root.",
                    self._label,
                    self._dir,
                    self.errors,
                    e,
                )

    def remove_stale(self, stale_s: float) -> None:
        """Remove the ledgers not rewritten for stale_s (their engine died)."""
        deadline = time.time() - stale_s
        dir_fd = _open_dir(self._dir)
        if dir_fd is None:
            return
        try:
            for entry in _scandir(dir_fd):
                with contextlib.suppress(OSError):
                    if entry.name != self._name and (
                        entry.stat(follow_symlinks=False).st_mtime < deadline
                    ):
                        os.remove(entry.name, dir_fd=dir_fd)
                        self._last.pop(entry.name, None)
        finally:
            os.close(dir_fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(self._dir, self._name))


def _net(ledger: Ledger | None) -> int:
    return 0 if ledger is None else ledger[0] - ledger[1]


def _listdir(path: str) -> list[os.DirEntry]:
    """A directory's entries for a listing of the root: a directory removed
    since has none; another error (EACCES, ESTALE, EMFILE) fails the listing,
    whose files would else read as gone."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _open_dir(path: str) -> int | None:
    """The ledgers' directory, never through a link (with group_access a
    member of the group could put one there): None where it is not one."""
    try:
        return os.open(
            path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        )
    except OSError:
        return None


def _scandir(dir_fd: int) -> list[os.DirEntry]:
    try:
        with os.scandir(dir_fd) as it:
            return list(it)
    except OSError:
        return []
