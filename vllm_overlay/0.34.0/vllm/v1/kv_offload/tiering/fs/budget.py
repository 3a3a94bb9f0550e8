# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FsTierBudget: a byte budget (``max_bytes``) for the fs tier, with an
eviction order that keeps whole prefixes.

What can still hit:
    A hit needs every full-attention group's chunks from the start of the
    prompt, so a file is only useful while every earlier chunk of its prefix
    is kept. Block hashes chain (a chunk's hash covers its whole prefix), so
    the chunks on disk form a forest: a chunk's parent is the chunk before it
    in its prompt. Only leaves (chunks with no kept child) are evicted, in
    least-recently-used order, with every group's file of the chunk at once;
    a parent whose last child was evicted becomes the next victim, at once
    when it is left with sliding-window or mamba files alone (they hit only
    with the full-attention child evicted before them). So a
    prefix loses its tail before its head, a prefix shared by several
    prompts stays while any of them is kept, and no kept file is unreachable
    because an earlier chunk of its prefix was evicted.

Where the order comes from:
    Store jobs carry their keys without their place in the prompt; the
    connector scheduler records each key's end-token position in the
    request's ReqContext (as for the CPU tier's LRU policy). The tier keeps
    a request's keys by group and position (those it stores or reports
    present by lookup(), O(1) per key; MAX_TRACKED_KEYS keys at most,
    dropped when the request finishes), and a store finds a key's parent as
    the key of its group one chunk's tokens earlier: O(1) per stored key.
    When that key is not kept (a prefix the CPU tier served, never asked of
    this tier) the request's recorded positions are read in full, at most
    each time they have doubled: amortized O(1) per key. A key without a
    position or without a recorded predecessor is a root. No file is written
    past a gap: a full-attention key whose predecessor's file of its group
    is on no disk (evicted, being removed, or its store failed or was
    refused) could never hit from there: it is not written, nor are its
    chunk's files of the other groups. A sliding-window or mamba file hits
    only with the full-attention chunks up to its end: it is written only
    if its covering chunk (the request's full-attention key at the first
    chunk end at or after its own, found by position like a parent) has
    its file on disk or being written, or is not known yet (the prompt may
    still grow). So no store job, even one of sliding-window keys alone,
    writes a file past a gap. A key that is not indexed is on disk only if
    lookup() found it for the request (another engine's file) or, until the
    start-up scan is done, if its file exists.

Where the work runs:
    The scheduler thread only posts events (a lookup() hit, a store or load
    job, its end, a finished request, the end of an engine step) to a
    queue: O(1) per call, no lock, no filesystem call. The events are
    applied in order, under one lock, by the store job's I/O task (its
    admission needs every event posted before it; a store never waits on
    the budget thread), and by the budget thread (at least once per
    JOURNAL_INTERVAL_S). Once the files and the stores in flight pass
    HIGH_WATER percent of max_bytes, the budget thread evicts ahead down
    to LOW_WATER percent (never below) and removes those files itself, so
    a store rarely evicts and its task rarely removes files before writing.
    The keys of evicted chunks go back to the scheduler thread (see
    take_evicted_keys()): its cached lookup() verdicts become misses.

Invariants:
    - used + unlinking = the bytes of the indexed files, of the stores in
      flight and of the files evicted ahead not removed yet; a store
      reserves its bytes (evicting first, taking over the budget thread's
      removals not started yet) before its files are written, and its task
      removes the files it evicted before it writes, so the tier's files
      never exceed max_bytes by more than the writes of one store job. A
      store that does not fit once everything evictable is gone fails for
      the keys that do not (the chunks farthest from the prompt's start
      first).
    - A chunk with a store or load in flight, or reported present by
      lookup() in an engine step whose end is not applied yet (the tiering
      manager submits the promotions of a step's hits at its end, before
      the tier's on_schedule_end()), is pinned: never evicted under the
      transfer. Events apply in the scheduler's order, so a store submitted
      in the step of a hit sees its pin; a lookup() racing with an eviction
      either keeps its chunk (the hit is read after the victims are marked)
      or answers a miss (the chunk stays removing until its files are gone
      and the scheduler thread took its keys).
    - Every scheduler-thread call is O(1) per key (most O(1) per call),
      with no lock and no filesystem call; start-up indexing, admission,
      eviction (ahead), the journal and removals (and their paths) run on
      other threads; a hit costs the scheduler thread two appends.
    - One scheduler-thread write skips the lock: take_evicted_keys() drops
      the chunks whose files are gone from _removing, which the other
      threads add to and read under the lock. It relies on the GIL: one
      set.difference_update() of bytes per eviction runs no Python code,
      so those threads see it whole, before or after (the deques it pops,
      _unlinked and _evicted_keys, are safe for one popper). Either is
      right: a chunk in _removing is not indexed nor written again until
      dropped, so seen removing its store is skipped (a miss, stored again
      later), and seen dropped it is a new chunk (its files are gone).
    - used counts every indexed file still on disk: a failed load forgets
      only files it removed or that hold no block (a file it could not read,
      EMFILE or EIO, stays counted and evictable); an evicted file that
      cannot be removed (other than already gone) is counted in
      removal_errors and in the tier's rate-limited failure report. A
      store refused for want of room is the budget working, not the disk
      failing: rejections have their own rate-limited warning (naming
      max_bytes, with counts), and the keys the job did write are stored.
    - An evicted chunk's keys become misses in lookup()'s cached verdicts:
      all of them, or with keyed file names (which do not give the block
      hash back) those lookup() found for requests not finished yet (those
      with a cached verdict; the most recent MAX_TRACKED_KEYS of them).
    - The index is flat: a chunk is one int in a dict (flags, pins, kept
      children, group bitmask) and, when linked, one entry in a dict of
      parents; no Python object per chunk for the garbage collector, so a
      million indexed chunks add no collection pauses.

Restart:
    The parent of each stored chunk is appended to a small per-rank journal
    (``budget.journal`` in the tier's rank directory; compacted when it holds
    twice as many records as the index has chunks). At start a background
    thread lists the rank directory, links the chunks with the journal's
    parents, orders the leaves by file time, inserts them (older than
    anything stored since start) in batches of a few ms under the lock,
    pausing between them, and trims to the budget after each; the engine
    serves meanwhile (files not indexed yet are not counted until their
    batch). Files written without a budget have no journal:
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
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.fs.io import (
    O_NOFOLLOW,
    PRIVATE_MODES,
    FileModes,
    make_dirs,
    write_file_atomically,
)

logger = init_logger(__name__)

JOURNAL_NAME = "budget.journal"
# Keys of the most recently seen requests kept for finding parents (about
# 100 MiB of keys; the least recently seen requests go first).
MAX_TRACKED_KEYS = 1 << 20
# The journal is appended at most once per interval, or when this many links
# are waiting (a wake-up costs the scheduler thread a GIL hand-off).
JOURNAL_INTERVAL_S = 1.0
JOURNAL_BATCH = 16384
# Recovered chunks inserted per lock hold by the start-up scan (a few ms),
# and the pause after each: a lock released and taken again at once starves
# the scheduler thread waiting for it.
SCAN_BATCH = 1024
SCAN_PAUSE_S = 0.001
# The budget's report (used bytes, evictions, rejections): at most one line
# per interval, and only when something changed. Stores refused for want of
# room: a warning at once, then at most one per interval, with the counts.
REPORT_INTERVAL_S = 30.0
# Evicting ahead: once the files and the stores in flight pass HIGH_WATER
# percent of max_bytes, the budget thread evicts down to LOW_WATER percent
# (never below) and removes the files, so that a store rarely evicts and its
# task rarely removes files before it writes.
HIGH_WATER = 95
LOW_WATER = 90
# Events the scheduler thread posts before it wakes the budget thread to
# apply them (the I/O threads apply them with each store job, the budget
# thread at least once per JOURNAL_INTERVAL_S).
MAX_EVENTS = 65536
# The events
_HIT, _FORGET, _ADMIT, _STEP, _FINISH, _LOAD = range(6)


# A chunk's state in the index is one int, so that the index holds no Python
# object per chunk for the garbage collector to track (a million chunks are
# one dict of bytes -> int): flags, pins, kept children, and from bit GROUPS
# the bitmask of the KV cache groups it has files of.
RECOVERED = 1  # found by the start-up scan
PIN = 1 << 1  # a transfer (or a lookup() hit) needs its files
PINS = ((1 << 24) - 1) << 1
CHILD = 1 << 25  # an indexed chunk whose parent it is
CHILDREN = ((1 << 31) - 1) << 25
GROUPS = 56

# Evicted chunks: (chunk id, group bitmask of their files), for the I/O
# threads to turn into paths and remove.
Evicted = list[tuple[bytes, int]]
# What finish_job() needs of a job: the chunks it pinned, and for a store the
# group bitmask of the files it adds, per chunk (None for a load).
JobTicket = tuple[list[bytes], dict[bytes, int] | None]


class BudgetRejection(OSError):
    """A store job the budget refused keys of (no room: every indexed file
    is in use by a transfer): the job fails, but the disk did not (reported
    by the budget's rejection warning, not as a failed write), and the keys
    it wrote are stored."""


class Admission:
    """A store or load job's share of the budget: posted by the scheduler
    thread, decided when its event is applied (see FsTierBudget._drain())."""

    __slots__ = ("keys", "req_context", "result", "ticket")

    def __init__(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None
    ) -> None:
        self.keys = keys
        self.req_context = req_context
        # a store's: the keys that do not fit, the keys not worth writing,
        # the evicted chunks whose files its task removes before it writes
        self.result: tuple[set[OffloadKey], set[OffloadKey], Evicted] | None = None
        self.ticket: JobTicket | None = None


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


def _group_indices(groups: int) -> list[int]:
    """The group indices of a group bitmask."""
    return [g for g in range(groups.bit_length()) if groups >> g & 1]


def _by_position(positions: dict[bytes, int]) -> Callable[[bytes], int]:
    return lambda h: positions.get(h, -1)


def _drop_bits(new: dict[bytes, int], drop: dict[bytes, int]) -> None:
    """Take a store's files not to write (chunk -> group bitmask) out of its
    new files."""
    for h, bits in drop.items():
        rest = new.get(h, 0) & ~bits
        if rest:
            new[h] = rest
        else:
            new.pop(h, None)


def _slot(position: int, group_idx: int) -> int:
    """A request's key's place: its end-token position and group, one int."""
    return position << 32 | group_idx


class FsTierBudget:
    """The index, the eviction order and the start-up scan of a budgeted
    fs tier (see the module docstring). The scheduler thread only
    posts events; the I/O threads and the budget thread apply them in order
    under one lock."""

    def __init__(
        self,
        max_bytes: int,
        file_size: int,
        rank_dir: str,
        key_path: Callable[[OffloadKey], str],
        chunk_path: Callable[[bytes, int], str],
        label: str,
        chunk_tokens: dict[int, int],
        prefix_groups: Collection[int] | None = None,
        chunk_id: Callable[[bytes], bytes] | None = None,
        modes: FileModes = PRIVATE_MODES,
        on_removal_errors: Callable[[int, str], None] | None = None,
    ) -> None:
        """chunk_tokens: the tokens of one chunk of each KV cache group (a
        key's predecessor ends that many tokens earlier). prefix_groups: the
        KV cache groups a hit needs every earlier
        chunk of (full attention); None: every group. A key of such a group
        whose predecessor is on no disk is not written.

        Chunks are indexed by the stem of their file names, what the
        start-up scan reads back: chunk_id maps a block hash to it (a keyed
        namespace's keyed hash; None: the block hash itself), and
        chunk_path maps it and a group index to the file's path. modes: the
        tier's file modes, which the journal gets too (it names the chunks
        on disk). on_removal_errors(count, last error): evicted files that
        could not be removed (the tier's rate-limited failure report)."""
        self.max_bytes = max_bytes
        self.file_size = file_size
        self.used = 0
        # evicted ahead, files not removed yet (counted against max_bytes)
        self.unlinking = 0
        self._high_water = max_bytes * HIGH_WATER // 100
        self._low_water = max_bytes * LOW_WATER // 100
        self._rank_dir = rank_dir
        self._key_path = key_path
        self._chunk_path = chunk_path
        self._chunk_id = chunk_id
        self._modes = modes
        self._label = label
        self._on_removal_errors = on_removal_errors
        self._chunk_tokens = {
            g.to_bytes(4, "big"): tokens for g, tokens in chunk_tokens.items()
        }
        self._prefix_groups: frozenset[bytes] | None = (
            None
            if prefix_groups is None
            else frozenset(g.to_bytes(4, "big") for g in prefix_groups)
        )
        # the group bits of prefix_groups (-1: every group)
        self._prefix_bits = (
            -1 if prefix_groups is None else sum(1 << g for g in prefix_groups)
        )
        # the full-attention group whose chunks cover the other groups'
        # files (group index, its tokens a chunk), where there are both
        self._cover_group: tuple[int, int] | None = None
        if prefix_groups is not None and set(chunk_tokens) - set(prefix_groups):
            g = min((g for g in prefix_groups if g in chunk_tokens), default=None)
            if g is not None:
                self._cover_group = (g, chunk_tokens[g])
        self._lock = threading.Lock()
        # chunk id -> state (RECOVERED, PINS, CHILDREN, GROUPS above)
        self._chunks: dict[bytes, int] = {}
        # chunk id -> the indexed chunk before it in its prompt
        self._parent: dict[bytes, bytes] = {}
        # evictable chunks, least recent first: files on disk, no kept
        # child. Pinning only counts (a pinned chunk may stay listed:
        # eviction drops it from the list, and its last unpin lists it again).
        self._leaves: OrderedDict[bytes, None] = OrderedDict()
        # a key's 4-byte group suffix -> its bit in a group bitmask
        self._group_bits: dict[bytes, int] = {}
        # what the scheduler thread posts (hits, jobs, finished requests,
        # steps), applied in order by _drain(); the keys of its hits not
        # drained yet
        self._events: deque[tuple] = deque()
        self._pending_hits: deque[OffloadKey] = deque()
        # the chunks that lookup() hits pinned in the current engine step
        self._step_pins: list[bytes] = []
        # req_id -> {_slot(position, group): the request's key there}, the
        # keys the tier saw
        self._orders: OrderedDict[str, dict[int, OffloadKey]] = OrderedDict()
        self._order_keys = 0  # their keys
        # req_id -> the number of recorded positions its last recall read
        self._recalled: dict[str, int] = {}
        # req_id -> {key lookup() reported present: its chunk id}, bounded
        # and dropped like _orders: such a key is on disk for a successor's
        # store, and with keyed file names (which do not give the block hash
        # back) an evicted chunk's keys whose cached lookup verdicts become
        # misses
        self._present: OrderedDict[str, dict[OffloadKey, bytes]] = OrderedDict()
        self._present_keys = 0  # their keys
        # keyed file names: chunk id -> {a present key of it: its requests}
        self._present_by_chunk: dict[bytes, dict[OffloadKey, int]] = {}
        # evicted chunks whose files are being removed, or were removed
        # before the scheduler thread took their keys (see
        # take_evicted_keys()); chunks evicted ahead whose files the budget
        # thread has not started removing
        self._removing: set[bytes] = set()
        self._unlinked: deque[list[bytes]] = deque()
        self._to_unlink: deque[tuple[bytes, int]] = deque()
        # the keys of evicted chunks, one list per eviction, for the
        # scheduler thread's cached lookup() verdicts (take_evicted_keys())
        self._evicted_keys: deque[list[OffloadKey]] = deque()
        # the start-up scan's chunks not inserted yet (chunk id -> state);
        # None once the scan is done
        self._recovering: dict[bytes, int] | None = None
        # counters: since start, and since the last report
        self.evicted_files = 0
        self.rejected_files = 0
        self.unreachable_files = 0  # not written: their prefix is not on disk
        self.removal_errors = 0  # evicted files that could not be removed
        self._reported = (0, 0, 0)
        self._next_report = time.monotonic() + REPORT_INTERVAL_S
        # rejections: (files, jobs) at the last warning, and when the next
        # one is due (the first is at once)
        self.rejected_jobs = 0
        self._warned_rejections = (0, 0)
        self._next_rejection_warning = 0.0
        # the warning is called from the scheduler thread and I/O threads
        self._rejection_warning = threading.Lock()

        # the start-up scan, eviction ahead and its removals, and the
        # journal's records run on this thread
        self._journal_path = os.path.join(rank_dir, JOURNAL_NAME)
        # (chunk, parent) links not written yet; the thread writes them at
        # most once per JOURNAL_INTERVAL_S (or at once past JOURNAL_BATCH)
        self._journal_q: deque[tuple[bytes, bytes]] = deque()
        self._journal_records = 0
        self._wake = threading.Condition(threading.Lock())
        self._kicked = False
        self._stop = False
        self.scan_done = threading.Event()
        self.scan_stats: tuple[int, int, int, float] | None = None
        self._thread = threading.Thread(
            target=self._run, name="vllm_kv_py_fs_budget", daemon=True
        )
        self._thread.start()

    # ---- scheduler thread: O(1) per call, never the lock ------------------

    def on_hit(self, key: OffloadKey, req_context: ReqContext) -> None:
        """lookup() found the key's file: pinned until the end of the step
        (by then its promotion, if any, is pinned), and its request's next
        chunk links to it. Posted before lookup() checks is_removing(): an
        eviction marks its victims removing before it reads the hits not
        drained yet, so a lookup() racing with it either keeps the chunk or
        answers a miss."""
        self._pending_hits.append(key)
        self._events.append((_HIT, key, req_context))

    def forget_request(self, req_id: str) -> None:
        """The request finished: no store of it follows."""
        self._events.append((_FORGET, req_id))

    def admit_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> Admission:
        """A store job's admission: decided, in order with the other events,
        by its task (see admitted())."""
        job = Admission(keys, req_context)
        self._events.append((_ADMIT, job))
        return job

    def pin_load(self, keys: Collection[OffloadKey]) -> Admission:
        """A load job's chunks, pinned until finish_job()."""
        job = Admission(keys, None)
        self._events.append((_LOAD, job))
        return job

    def finish_job(self, job: Admission, failed: Iterable[OffloadKey]) -> None:
        """A store or load job finished: forget the files of its failed keys
        (a failed store did not write its new files, a failed load removed
        its file) and unpin its chunks."""
        self._events.append((_FINISH, job, failed))

    def end_step(self) -> None:
        """on_schedule_end(): release lookup()'s pins of the step (its
        promotions are pinned by now); wake the budget thread when events or
        journal records pile up."""
        events = self._events
        events.append((_STEP,))
        if len(events) > MAX_EVENTS or len(self._journal_q) > JOURNAL_BATCH:
            self._kick()
        now = time.monotonic()
        if now >= self._next_report:
            self._report()
        if now >= self._next_rejection_warning:
            self._warn_rejections()

    def take_evicted_keys(self) -> list[list[OffloadKey]]:
        """The keys of the chunks evicted since the last call, one list per
        eviction: all of them, or for keyed file names (which do not give
        their block hash back) those lookup() reported present to a request
        not finished yet (whose cached verdicts are hits). An evicted chunk
        is removing (a miss) until its files are gone and its keys were
        taken here: its cached verdicts are misses before lookup() answers
        from them. O(1) per eviction here; the caller's per key."""
        unlinked = self._unlinked
        queue = self._evicted_keys
        if not (unlinked or queue):
            return []
        # removed before now: evicted, their keys queued, before now
        gone = len(unlinked)
        keys = [queue.popleft() for _ in range(len(queue))]
        removing = self._removing
        for _ in range(gone):
            removing.difference_update(unlinked.popleft())
        return keys

    def is_removing(self, key: OffloadKey) -> bool:
        """lookup(): the key's chunk was evicted and its files are being
        removed, or its keys were not taken yet (a miss: its load would
        fail)."""
        return bool(self._removing) and self._cid(key[:-4]) in self._removing

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join()
        with self._lock:
            self._drain()
        self._report(force=True)
        self._warn_rejections()

    # ---- I/O threads --------------------------------------------------------

    def admitted(
        self, job: Admission
    ) -> tuple[set[OffloadKey], set[OffloadKey], Evicted]:
        """A store task's first step: its job's admission (the keys that do
        not fit, the keys not worth writing, the evicted chunks whose files
        the task removes before its writes, see _admit()). The thread that
        gets the lock first applies the events posted before it (not those
        after: their jobs' tasks do): a store never waits on the budget
        thread, only on a bounded drain."""
        result = job.result
        if result is None:
            with self._lock:
                self._drain(job)
            if self.used > self._high_water:
                self._kick()  # evict ahead, off the write path
            result = job.result
            assert result is not None  # _drain(job) admits the job
            if result[0] and time.monotonic() >= self._next_rejection_warning:
                self._warn_rejections()
        return result

    def remove_evicted(self, evicted: Evicted) -> None:
        """Remove evicted chunks' files (a task for the tier's I/O threads)."""
        self._remove_files(self._paths(evicted))
        self._removed(evicted)

    def _removed(self, evicted: Evicted) -> None:
        # no longer removing once the scheduler thread took their keys
        self._unlinked.append([h for h, _ in evicted])

    # ---- the events, in order (under self._lock) ---------------------------

    def _drain(self, until: Admission | None = None) -> None:
        """Apply the events posted so far, or up to until's admission."""
        events = self._events
        while events and (until is None or until.result is None):
            event = events.popleft()
            kind = event[0]
            if kind == _HIT:
                self._pending_hits.popleft()
                self._hit(event[1], event[2])
            elif kind == _ADMIT:
                self._admit(event[1])
            elif kind == _STEP:
                for h in self._step_pins:
                    self._unpin(h)
                self._step_pins.clear()
            elif kind == _FINISH:
                self._finish(event[1], event[2])
            elif kind == _FORGET:
                self._forget(event[1])
            else:
                job = event[1]
                job.ticket = (self._pin(job.keys), None)

    def _hit(self, key: OffloadKey, req_context: ReqContext) -> None:
        h = self._cid(key[:-4])
        state = self._chunks.get(h)
        if state is not None:
            self._chunks[h] = state + PIN
            self._step_pins.append(h)
        elif h in self._removing:
            return  # evicted since: lookup() answered a miss
        self.note_keys((key,), req_context)
        req_id = req_context.req_id
        present = self._present.get(req_id)
        if present is None:
            present = self._present[req_id] = {}
        else:
            self._present.move_to_end(req_id)
        if key in present:
            return  # a cached verdict asked again
        present[key] = h
        self._present_keys += 1
        if self._chunk_id is not None:
            requests = self._present_by_chunk.setdefault(h, {})
            requests[key] = requests.get(key, 0) + 1
        while self._present_keys > MAX_TRACKED_KEYS and len(self._present) > 1:
            self._drop_present(self._present.popitem(last=False)[1])

    def note_keys(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Keep the request's keys by group and end-token position, for
        finding their successors' parents."""
        orders = self._orders.get(req_context.req_id)
        if orders is None:
            orders = self._orders[req_context.req_id] = {}
        else:
            self._orders.move_to_end(req_context.req_id)
        n = len(orders)
        for k in keys:
            position = req_context.get_offload_key_position(k)
            if position is not None:
                orders[_slot(position, int.from_bytes(k[-4:], "big"))] = k
        self._order_keys += len(orders) - n
        self._bound_orders()

    def _bound_orders(self) -> None:
        while self._order_keys > MAX_TRACKED_KEYS and len(self._orders) > 1:
            req_id, dropped = self._orders.popitem(last=False)
            self._order_keys -= len(dropped)
            self._recalled.pop(req_id, None)

    def _recall(self, req_context: ReqContext) -> dict[int, OffloadKey]:
        """Keep every key the scheduler recorded a position of for the
        request, unless they have not doubled since the last recall."""
        recorded = req_context.offload_key_positions()
        req_id = req_context.req_id
        if not recorded or len(recorded) < 2 * self._recalled.get(req_id, 0):
            return self._orders.get(req_id, {})
        # a copy (one C call): the scheduler thread records more meanwhile
        recorded = dict(recorded)
        self._recalled[req_id] = len(recorded)
        orders = self._orders.setdefault(req_id, {})
        n = len(orders)
        for k, position in recorded.items():
            orders[_slot(position, int.from_bytes(k[-4:], "big"))] = k
        self._order_keys += len(orders) - n
        self._bound_orders()
        return self._orders.get(req_id, {})

    def _forget(self, req_id: str) -> None:
        dropped = self._orders.pop(req_id, None)
        if dropped is not None:
            self._order_keys -= len(dropped)
        self._recalled.pop(req_id, None)
        present = self._present.pop(req_id, None)
        if present is not None:
            self._drop_present(present)

    def _drop_present(self, present: dict[OffloadKey, bytes]) -> None:
        self._present_keys -= len(present)
        if self._chunk_id is None:
            return
        by_chunk = self._present_by_chunk
        for key, h in present.items():
            requests = by_chunk.get(h)
            if requests is None:
                continue
            n = requests.get(key, 0) - 1
            if n > 0:
                requests[key] = n
            else:
                requests.pop(key, None)
                if not requests:
                    del by_chunk[h]

    def _on_disk(self, key: OffloadKey, req_id: str) -> bool:
        """Whether a key that is not indexed has a file: one lookup() found
        for the request (another engine's), or, until the start-up scan is
        done, one of an earlier run not indexed yet (a filesystem call, on
        an I/O thread, only until the scan is done)."""
        present = self._present.get(req_id)
        if present is not None and key in present:
            return True
        if self.scan_done.is_set():
            return False  # neither stored nor found at start by this engine
        return os.path.exists(self._key_path(key))

    def _admit(self, admission: Admission) -> None:
        """Reserve room for a store job's new files, evicting first: sets
        the job's result (the keys that do not fit, not to be written: the
        chunks nearest the prompt's start are admitted first; the keys not
        worth writing: the chunk before them in their prompt is not on
        disk, so they could never hit from it; the evicted chunks, whose
        files its task removes before its writes) and its ticket for
        finish_job() (its pinned chunks and new files)."""
        keys = admission.keys
        req_context = admission.req_context
        assert req_context is not None  # a store's
        gbits = self._group_bits
        # the job's chunks: chunk id -> group bitmask of its keys
        job: dict[bytes, int] = {}
        ids: dict[bytes, bytes] | None = None  # block hash -> chunk id
        if self._chunk_id is None:
            for k in keys:
                g = k[-4:]
                bit = gbits.get(g) or self._group_bit(g)
                h = k[:-4]
                job[h] = job.get(h, 0) | bit
        else:
            ids = {}
            for k in keys:
                g = k[-4:]
                bit = gbits.get(g) or self._group_bit(g)
                raw = k[:-4]
                cid = ids.get(raw)
                if cid is None:
                    cid = ids[raw] = self._chunk_id(raw)
                job[cid] = job.get(cid, 0) | bit
        chunks = self._chunks
        pinned: list[bytes] = []
        # chunk id -> group bitmask of the job's new files
        new: dict[bytes, int] = {}
        # evicted chunks whose files are not removed yet: not written
        # now (the removal would delete the new files); a miss until
        # stored again
        removing: dict[bytes, int] = {}
        for h, bits in job.items():
            if h in self._removing:
                removing[h] = bits
                continue
            state = chunks.get(h)
            if state is None:
                new[h] = bits
                continue
            chunks[h] = state + PIN
            pinned.append(h)
            missing = bits & ~(state >> GROUPS)
            if missing:
                new[h] = missing
        parents, positions, orphans, covers = self._find_parents(
            new, ids, keys, req_context
        )
        req_id = req_context.req_id
        going = self._removing
        unreachable: dict[bytes, int] = {}
        for h, _, prev in orphans:
            # not indexed with that file here: on disk only if another
            # engine stored it, and not if it is being removed; if not, no
            # file of the chunk is worth writing (its other groups' files
            # could only hit past the same gap)
            if self._cid(prev[:-4]) in going or not self._on_disk(prev, req_id):
                unreachable[h] = new[h]
        if unreachable:
            # and so are the chunks after them in the job (unless their
            # parent's full-attention files are on disk already)
            gone = set(unreachable)
            kept = self._prefix_bits
            for h in sorted(new, key=_by_position(positions)):
                parent = parents.get(h)
                if parent in gone and not chunks.get(parent, 0) >> GROUPS & kept:
                    unreachable[h] = new[h]
                    gone.add(h)
            _drop_bits(new, unreachable)
        if covers:
            # sliding-window and mamba files: their covering full-attention
            # file (in this job after the drops above, indexed: on disk or
            # being written, or another engine's) or nothing
            dropped: dict[bytes, int] = {}
            recovering = self._recovering
            for h, bit, cover_key in covers:
                if not new.get(h, 0) & bit:
                    continue
                cover = self._cid(cover_key[:-4])
                cover_bit = self._group_bit(cover_key[-4:])
                state = chunks.get(cover)
                if state is None and recovering is not None:
                    state = recovering.get(cover)
                if cover not in going and (
                    (new.get(cover, 0) | (state or 0) >> GROUPS) & cover_bit
                    or self._on_disk(cover_key, req_id)
                ):
                    continue
                dropped[h] = dropped.get(h, 0) | bit
            if dropped:
                _drop_bits(new, dropped)
                for h, bits in dropped.items():
                    unreachable[h] = unreachable.get(h, 0) | bits
        if unreachable:
            self.unreachable_files += sum(b.bit_count() for b in unreachable.values())
        # indexed parents stay while their new children are written
        for h in new:
            parent = parents.get(h)
            if parent is not None and parent not in new:
                state = chunks.get(parent)
                if state is not None:
                    chunks[parent] = state + PIN
                    pinned.append(parent)
        file_size = self.file_size
        nfiles = sum(b.bit_count() for b in new.values())
        evicted = self._evict(nfiles * file_size)
        room = max(0, (self.max_bytes - self.used - self.unlinking) // file_size)
        rejected: dict[bytes, int] = {}
        if nfiles > room:
            # keep the chunks nearest the start of their prompt
            for h in sorted(new, key=_by_position(positions)):
                n = new[h].bit_count()
                if n <= room:
                    room -= n
                else:
                    room = -1
                    rejected[h] = new.pop(h)
                    nfiles -= n
            self.rejected_files += sum(b.bit_count() for b in rejected.values())
            self.rejected_jobs += 1
        created: list[bytes] = []
        for h, bits in new.items():
            state = chunks.get(h)
            if state is None:
                state = PIN
                pinned.append(h)
                created.append(h)
            chunks[h] = state | bits << GROUPS
        self.used += nfiles * file_size
        # link the new chunks to their parents (indexed, or new here); a
        # chunk first stored as a root by a group of larger chunks gets
        # its parent with its finer group's file
        if parents:
            parent_of = self._parent
            leaves = self._leaves
            journal = self._journal_q
            for h in new:
                parent = parents.get(h)
                if parent is not None and parent != h and h not in parent_of:
                    state = chunks.get(parent)
                    if state is not None:
                        parent_of[h] = parent
                        chunks[parent] = state + CHILD
                        if not state & CHILDREN:
                            leaves.pop(parent, None)
                        journal.append((h, parent))
        rejected_keys: set[OffloadKey] = set()
        unreachable_keys: set[OffloadKey] = set()
        unreachable.update(removing)
        if rejected or unreachable:
            for k in keys:
                h = k[:-4] if ids is None else ids[k[:-4]]
                bit = gbits[k[-4:]]
                if rejected.get(h, 0) & bit:
                    rejected_keys.add(k)
                elif unreachable.get(h, 0) & bit:
                    unreachable_keys.add(k)
        admission.ticket = (pinned, new)
        admission.result = (rejected_keys, unreachable_keys, evicted)

    def _pin(self, keys: Collection[OffloadKey]) -> list[bytes]:
        pinned: list[bytes] = []
        chunks = self._chunks
        for h in {self._cid(k[:-4]) for k in keys}:
            state = chunks.get(h)
            if state is not None:
                chunks[h] = state + PIN
                pinned.append(h)
        return pinned

    def _finish(self, job: Admission, failed: Iterable[OffloadKey]) -> None:
        if job.ticket is None:
            return  # never admitted (its task was dropped at shutdown)
        pinned, new = job.ticket
        chunks = self._chunks
        for k in failed:
            h = self._cid(k[:-4])
            bit = self._group_bit(k[-4:])
            if new is not None and not new.get(h, 0) & bit:
                continue  # the file it failed to store over is still there
            state = chunks.get(h)
            if state is not None and state >> GROUPS & bit:
                chunks[h] = state - (bit << GROUPS)
                self.used -= self.file_size
        for h in pinned:
            self._unpin(h)

    def _keys_of(self, evicted: Evicted) -> list[OffloadKey]:
        """The keys of evicted chunks (see take_evicted_keys())."""
        if self._chunk_id is not None:
            by_chunk = self._present_by_chunk
            return [
                k
                for h, groups in evicted
                for k in by_chunk.get(h, ())
                if groups >> int.from_bytes(k[-4:], "big") & 1
            ]
        return [
            OffloadKey(h + g.to_bytes(4, "big"))
            for h, groups in evicted
            for g in _group_indices(groups)
        ]

    # ---- internals (under self._lock) --------------------------------------

    def _cid(self, block_hash: bytes) -> bytes:
        """A block hash's chunk id: the stem of its files' names."""
        chunk_id = self._chunk_id
        return block_hash if chunk_id is None else chunk_id(block_hash)

    def _group_bit(self, suffix: bytes) -> int:
        bit = self._group_bits.get(suffix)
        if bit is None:
            bit = self._group_bits[suffix] = 1 << int.from_bytes(suffix, "big")
        return bit

    def _find_parents(
        self,
        new: dict[bytes, int],
        ids: dict[bytes, bytes] | None,
        keys: Collection[OffloadKey],
        req_context: ReqContext,
    ) -> tuple[
        dict[bytes, bytes],
        dict[bytes, int],
        list[tuple[bytes, int, OffloadKey]],
        list[tuple[bytes, int, OffloadKey]],
    ]:
        """Parents (indexed chunks, or new chunks of this job) and prompt
        positions of the new chunks, from the keys' positions and the keys
        the tier saw of their request; the new full-attention files whose
        predecessor's file of their group is neither indexed nor new here
        (chunk, group bit, the predecessor's key); and the new files of the
        other groups with their covering chunk's key (chunk, group bit, the
        key of the cover group at the first chunk end at or after theirs).
        O(1) per key (amortized); a chunk whose predecessor is unknown has
        no parent (a root), a file whose covering key is unknown no cover.
        Notes the job's keys for the request's next store."""
        parents: dict[bytes, bytes] = {}
        positions: dict[bytes, int] = {}
        orphans: list[tuple[bytes, int, OffloadKey]] = []
        covers: list[tuple[bytes, int, OffloadKey]] = []
        if not new:
            self.note_keys(keys, req_context)
            return parents, positions, orphans, covers
        req_id = req_context.req_id
        orders = self._orders.get(req_id)
        if orders is None:
            orders = self._orders[req_id] = {}
        else:
            self._orders.move_to_end(req_id)
        n = len(orders)
        chunks = self._chunks
        prefix_groups = self._prefix_groups
        chunk_tokens = self._chunk_tokens
        group_bits = self._group_bits
        get_position = req_context.get_offload_key_position
        if len(set(chunk_tokens.values())) > 1:
            # the finest group first: its predecessor is the closest (groups
            # of larger chunks skip the chunks between theirs)
            keys = sorted(keys, key=lambda k: chunk_tokens.get(k[-4:], 0))
        # the job's keys first: predecessors of each other, and of the
        # request's next store
        placed: list[tuple[OffloadKey, int, int]] = []
        for k in keys:
            position = get_position(k)
            if position is not None:
                group_idx = int.from_bytes(k[-4:], "big")
                orders[_slot(position, group_idx)] = k
                placed.append((k, position, group_idx))
        cover_group = self._cover_group
        recalled = False
        for k, position, group_idx in placed:
            g = k[-4:]
            h = k[:-4] if ids is None else ids[k[:-4]]
            bit = group_bits[g]
            tokens = chunk_tokens.get(g)
            if not new.get(h, 0) & bit or tokens is None:
                continue
            positions.setdefault(h, position)
            needs_prefix = prefix_groups is None or g in prefix_groups
            if not needs_prefix and cover_group is not None:
                # the first full-attention chunk end at or after this one's
                cover_idx, cover_tokens = cover_group
                end = -(-position // cover_tokens) * cover_tokens
                cover_slot = _slot(end, cover_idx)
                cover_key = orders.get(cover_slot)
                if cover_key is None and not recalled:
                    self._order_keys += len(orders) - n
                    orders = self._recall(req_context)
                    n = len(orders)
                    recalled = True
                    cover_key = orders.get(cover_slot)
                if cover_key is not None:
                    covers.append((h, bit, cover_key))
            if position <= tokens:
                continue  # the first chunk: a root
            slot = _slot(position - tokens, group_idx)
            prev_key = orders.get(slot)
            if prev_key is None:
                self._order_keys += len(orders) - n
                orders = self._recall(req_context)
                n = len(orders)
                prev_key = orders.get(slot)
                if prev_key is None:
                    continue  # no recorded predecessor: a root
            prev = self._cid(prev_key[:-4])
            state = chunks.get(prev)
            if state is None and prev not in new:
                if needs_prefix:
                    # sliding-window and mamba groups skip chunks: no orphans
                    orphans.append((h, bit, prev_key))
                continue
            parents.setdefault(h, prev)
            # its file of this group failed, was refused or is not written
            if needs_prefix and not (new.get(prev, 0) | (state or 0) >> GROUPS) & bit:
                orphans.append((h, bit, prev_key))
        self._order_keys += len(orders) - n
        self._bound_orders()
        return parents, positions, orphans, covers

    def _unpin(self, h: bytes) -> None:
        state = self._chunks.get(h)
        if state is None:
            return
        state -= PIN
        self._chunks[h] = state
        if not state & (PINS | CHILDREN):
            if state >> GROUPS:  # evictable, and just used
                self._leaves[h] = None
                self._leaves.move_to_end(h)
            else:  # its files failed: nothing left to keep
                self._remove_chunk(h, state)

    def _remove_chunk(self, h: bytes, state: int) -> None:
        chunks = self._chunks
        del chunks[h]
        self._leaves.pop(h, None)
        self.used -= (state >> GROUPS).bit_count() * self.file_size
        parent = self._parent.pop(h, None)
        if parent is None:
            return
        recovering = self._recovering
        if state & RECOVERED and recovering is not None and parent in recovering:
            recovering[parent] -= CHILD  # the parent is not inserted yet
            return
        self._drop_child(parent)

    def _drop_child(self, parent: bytes) -> None:
        state = self._chunks.get(parent)
        if state is None:
            return
        state -= CHILD
        self._chunks[parent] = state
        if not state & (CHILDREN | PINS):
            # the prefix's head follows its tail
            self._leaves[parent] = None
            self._leaves.move_to_end(parent, last=False)

    def _bytes(self, groups: int) -> int:
        """The bytes of a chunk's files of the groups in a group bitmask."""
        return groups.bit_count() * self.file_size

    def _evict(self, need: int, low: int | None = None) -> Evicted:
        """Evict until need more bytes fit in max_bytes, taking over first
        the budget thread's removals not started yet; or, with low (the
        budget thread evicting ahead), down to low bytes and never below.
        Leaves go least recent first, each marked removing before the hits
        not drained yet are read: a victim lookup() just found is kept (see
        on_hit()). Returns the evicted chunks; the caller removes their
        files. Their keys go to take_evicted_keys()."""
        evicted: Evicted = []
        size_of = self._bytes
        if low is None:
            queue = self._to_unlink
            while self.used + self.unlinking + need > self.max_bytes:
                try:  # the budget thread takes from the other end
                    h, groups = queue.pop()
                except IndexError:
                    break
                self.unlinking -= size_of(groups)
                evicted.append((h, groups))
            low = self.max_bytes - need
            floor = False
            extra = self.unlinking
        else:
            # ahead: the files being removed are as good as gone
            floor = True
            extra = 0
        taken_over = len(evicted)
        leaves = self._leaves
        chunks = self._chunks
        removing = self._removing
        hit: set[bytes] = set()
        checked = 0  # pending hits already in `hit`
        files = 0
        while leaves and self.used + extra > low:
            excess = self.used + extra - low
            victims: list[bytes] = []
            while excess > 0 and leaves:
                h, _ = leaves.popitem(last=False)
                state = chunks.get(h)
                if state is None or state & (PINS | CHILDREN):
                    continue  # pinned: listed again when unpinned
                size = size_of(state >> GROUPS)
                if floor and size > excess:
                    leaves[h] = None
                    leaves.move_to_end(h, last=False)
                    break
                removing.add(h)
                victims.append(h)
                excess -= size
            if not victims:
                break
            pending = list(self._pending_hits)
            for k in pending[checked:]:
                hit.add(self._cid(k[:-4]))
            checked = len(pending)
            before = len(evicted)
            while victims:
                # a parent left with sliding-window or mamba files alone
                # could only hit with the full-attention child just evicted:
                # it follows it now (marked removing before the hits are
                # read again)
                heads: list[bytes] = []
                for h in victims:
                    state = chunks[h]
                    if h in hit:  # found by a lookup() meanwhile: kept
                        removing.discard(h)
                        leaves[h] = None
                        continue
                    groups = state >> GROUPS
                    evicted.append((h, groups))
                    files += groups.bit_count()
                    parent = self._parent.get(h)
                    self._remove_chunk(h, state)
                    if parent is None:
                        continue
                    state = chunks.get(parent, PINS)
                    if not state & (PINS | CHILDREN | self._prefix_bits << GROUPS):
                        removing.add(parent)
                        heads.append(parent)
                victims = heads
                if heads:
                    pending = list(self._pending_hits)
                    for k in pending[checked:]:
                        hit.add(self._cid(k[:-4]))
                    checked = len(pending)
            if len(evicted) == before:
                break  # every victim was found by a lookup() meanwhile
        if files:
            self.evicted_files += files
            keys = self._keys_of(evicted[taken_over:])
            if keys:
                self._evicted_keys.append(keys)
        return evicted

    def _paths(self, evicted: Evicted) -> list[str]:
        chunk_path = self._chunk_path
        return [
            chunk_path(h, g) for h, groups in evicted for g in _group_indices(groups)
        ]

    # ---- reports ------------------------------------------------------------

    def _report(self, force: bool = False) -> None:
        self._next_report = time.monotonic() + REPORT_INTERVAL_S
        now = (self.used + self.unlinking, self.evicted_files, self.rejected_files)
        if now == self._reported and not force:
            return
        logger.info(
            "%s: %d of max_bytes=%d bytes used (%d files), %d files evicted "
            "and %d rejected since the previous report (%d and %d since start)",
            self._label,
            now[0],
            self.max_bytes,
            now[0] // self.file_size,
            self.evicted_files - self._reported[1],
            self.rejected_files - self._reported[2],
            self.evicted_files,
            self.rejected_files,
        )
        self._reported = now

    def _warn_rejections(self) -> None:
        """Stores refused since the previous warning, if any (at most one
        line per REPORT_INTERVAL_S; read without the budget's lock: counters;
        one thread at a time, so that two threads never say the same)."""
        if not self._rejection_warning.acquire(blocking=False):
            return  # another thread is saying it
        try:
            files, jobs = self.rejected_files, self.rejected_jobs
            last_files, last_jobs = self._warned_rejections
            if files == last_files:
                return
            self._warned_rejections = (files, jobs)
            self._next_rejection_warning = time.monotonic() + REPORT_INTERVAL_S
        finally:
            self._rejection_warning.release()
        logger.warning(
            "%s: %d block file(s) of %d store job(s) not written since the "
            "previous report (%d and %d since start): no room in "
            "max_bytes=%d (%d bytes used, %d being removed) once every file "
            "not in use by a transfer was evicted. The disk did not fail; "
            "the keys are not offloaded. A larger max_bytes keeps them.",
            self._label,
            files - last_files,
            jobs - last_jobs,
            files,
            jobs,
            self.max_bytes,
            self.used,
            self.unlinking,
        )

    # ---- budget thread: the start-up scan, eviction ahead, the journal ---

    def _kick(self) -> None:
        with self._wake:
            self._kicked = True
            self._wake.notify()

    def _run(self) -> None:
        try:
            self._scan()
        except Exception as e:  # the tier still works, unindexed files stay
            logger.warning("%s: could not index existing files: %s", self._label, e)
        finally:
            self.scan_done.set()
        while True:
            with self._wake:
                if not (self._kicked or self._stop):
                    self._wake.wait(JOURNAL_INTERVAL_S)
                self._kicked = False
                stop = self._stop
            with self._lock:
                self._drain()
                if self.used > self._high_water:
                    for h, groups in self._evict(0, self._low_water):
                        self._to_unlink.append((h, groups))
                        self.unlinking += self._bytes(groups)
            self._unlink_ahead()
            self._write_journal()
            if stop:
                return

    def _unlink_ahead(self) -> None:
        """Remove the files of the chunks evicted ahead, one chunk at a time
        (a store that needs the room first takes over the rest)."""
        queue = self._to_unlink
        removed: Evicted = []
        while not self._stop:
            try:
                evicted = [queue.popleft()]
            except IndexError:
                break
            self._remove_files(self._paths(evicted))
            with self._lock:
                self.unlinking -= self._bytes(evicted[0][1])
            removed += evicted
        if removed:  # one hand-off to the scheduler thread
            self._removed(removed)

    def _write_journal(self) -> None:
        q = self._journal_q
        records = [_record(*q.popleft()) for _ in range(len(q))]
        if not records:
            return
        try:
            # the tier's modes: the journal names the chunks on disk
            make_dirs(self._rank_dir, self._modes)
            fd = os.open(
                self._journal_path,
                os.O_WRONLY | os.O_APPEND | os.O_CREAT | O_NOFOLLOW,
                self._modes.file,
            )
            try:
                os.fchmod(fd, self._modes.file)
                os.write(fd, b"".join(records))
            finally:
                os.close(fd)
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
        write_file_atomically(
            self._journal_path,
            b"".join(_record(h, p) for h, p in kept.items()),
            self._modes,
        )
        self._journal_records = len(kept)

    def _scan(self) -> None:
        """Index the rank directory's block files and trim to the budget.

        Flat: one state int and one mtime per chunk in two dicts (nothing
        the garbage collector tracks per file), the order sorted by numpy,
        and inserted SCAN_BATCH chunks per lock hold."""
        start = time.monotonic()
        parents = _read_journal(self._journal_path)
        self._journal_records = len(parents)
        found: dict[bytes, int] = {}  # chunk id -> state
        mtimes: dict[bytes, float] = {}  # chunk id -> its newest file's mtime
        for d1 in _scandir(self._rank_dir):
            if not d1.is_dir(follow_symlinks=False):
                continue
            for d2 in _scandir(d1.path):
                name = d2.name
                sep = name.find("_g")
                if sep < 0 or not d2.is_dir(follow_symlinks=False):
                    continue
                try:
                    bit = 1 << (GROUPS + int(name[sep + 2 :]))
                except ValueError:
                    continue
                if self._stop:
                    return
                for f in _scandir(d2.path):
                    fname = f.name
                    if not fname.endswith(".bin"):
                        continue
                    try:
                        h = bytes.fromhex(fname[:-4])
                        mtime = f.stat(follow_symlinks=False).st_mtime
                    except (ValueError, OSError):
                        continue
                    state = found.get(h)
                    if state is None:
                        found[h] = RECOVERED | bit
                        mtimes[h] = mtime
                    else:
                        found[h] = state | bit
                        if mtime > mtimes[h]:
                            mtimes[h] = mtime
        links: dict[bytes, bytes] = {}
        for h, p in parents.items():
            if h in found and p in found and h != p:
                links[h] = p
                found[p] += CHILD
        del parents
        # the most recent first, each inserted at the least recent end
        # (numpy sorts without holding the GIL: the engine keeps serving)
        hashes = list(found)
        mt = np.fromiter(mtimes.values(), np.float64, len(hashes))
        del mtimes
        order = [hashes[i] for i in np.argsort(-mt, kind="stable").tolist()]
        del hashes, mt
        total = len(order)
        removed = 0
        with self._lock:
            self._recovering = found
        try:
            for i in range(0, total, SCAN_BATCH):
                if self._stop:
                    return
                with self._lock:
                    self._drain()
                    for h in order[i : i + SCAN_BATCH]:
                        self._insert_recovered(h, found.pop(h), links.get(h))
                    evicted = self._evict(0)
                removed += self._remove_files(self._paths(evicted))
                self._removed(evicted)
                time.sleep(SCAN_PAUSE_S)
        finally:
            with self._lock:
                self._recovering = None
        self.scan_stats = (total, removed, self.used, time.monotonic() - start)
        logger.info(
            "%s: indexed %d chunk(s) of earlier runs in %.1f s; removed %d "
            "file(s) to fit max_bytes=%d; %d bytes used",
            self._label,
            total,
            self.scan_stats[3],
            removed,
            self.max_bytes,
            self.used,
        )

    def _insert_recovered(self, h: bytes, found: int, parent: bytes | None) -> None:
        """Insert a chunk found on disk (under the lock). Its children count
        is the recovered one, kept up to date while it waited: a recovered
        child removed before its parent was inserted decremented it there."""
        chunks = self._chunks
        state = chunks.get(h)
        children = found & CHILDREN
        if state is not None:  # stored again since start: merge
            add = found >> GROUPS & ~(state >> GROUPS)
            self.used += add.bit_count() * self.file_size
            chunks[h] = (state | add << GROUPS) + children
            if children:
                self._leaves.pop(h, None)
            if parent is not None:  # keep the link it has: drop the old one
                recovering = self._recovering
                if recovering is not None and parent in recovering:
                    recovering[parent] -= CHILD
                else:
                    self._drop_child(parent)
            return
        chunks[h] = found
        if parent is not None:
            self._parent[h] = parent
        self.used += (found >> GROUPS).bit_count() * self.file_size
        if not children:
            self._leaves[h] = None
            self._leaves.move_to_end(h, last=False)

    def _remove_files(self, paths: Iterable[str]) -> int:
        """Remove files; returns how many were. A file already gone was
        removed by another engine or never written; other failures (a
        directory, a read-only mount) are counted and reported."""
        n = errors = 0
        error = ""
        for path in paths:
            try:
                os.remove(path)
                n += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                errors += 1
                error = str(e)
        if errors:
            with self._lock:
                self.removal_errors += errors
            if self._on_removal_errors is not None:
                self._on_removal_errors(errors, error)
        return n


def _record(h: bytes, parent: bytes) -> bytes:
    return bytes((len(h), len(parent))) + h + parent


def _read_journal(path: str) -> dict[bytes, bytes]:
    try:
        fd = os.open(path, os.O_RDONLY | O_NOFOLLOW)
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read()
        finally:
            os.close(fd)
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
