"""A simpler max_bytes budget for the fs tier, measured against today's (issue 34, item 3).

One invariant instead of a parent forest and a journal: a chunk's order time is never older
than the order time of a chunk after it in any prompt, so evicting the oldest chunk first
loses a prefix's tail before its head. A request at time T gives its key at end-token
position p the order time T - 2p (a sliding-window or mamba key: that of the full-attention
chunk covering it, minus one, so it goes just before that chunk); a chunk keeps the newest
order time any request gave it. A store also raises the request's earlier chunks on disk to
the request's times, walking back only while they are older (amortized O(1) per key), so a
prefix another tier served keeps the order too. As vLLM's free-block queue: tails first.

What it drops against budget.py's FsTierBudget: the parent links, the journal shared by
the engines of a rank, the start-up scan (not in this prototype: on the design's path, a
chunk's order time would be its files' mtime, set by the I/O thread at store and raise,
and a restart would read it back), bit-packed state. What it keeps: the same interface to
the tier's manager (a drop-in for the benchmarks), no filesystem call and no lock wait on
the scheduler thread beyond one short lock hold per call, pins for transfers in flight and
for a step's lookup() hits, no file written past a gap, eviction ahead on its own thread.

Threads: the scheduler thread posts events (a deque, thread-safe for one popper by its
documentation) and reads `_removing` under `_lock`; the I/O threads and the budget thread
apply events and evict under `_lock`, which guards every other field.
"""

import heapq
import itertools
import os
import threading
import time
from collections import OrderedDict, deque

from vllm.v1.kv_offload.tiering.fs.budget import Admission

HIGH_WATER, LOW_WATER = 95, 90
MAX_TRACKED_KEYS = 1 << 20


class OrderedTimesBudget:
    def __init__(
        self,
        max_bytes,
        file_size,
        rank_dir,
        key_path,
        chunk_path,
        label,
        chunk_tokens,
        prefix_groups=None,
        chunk_id=None,
        modes=None,
        on_removal_errors=None,
    ):
        self.max_bytes, self.file_size = max_bytes, file_size
        self._chunk_path, self._chunk_id, self._label = chunk_path, chunk_id, label
        self._on_removal_errors = on_removal_errors
        self._tokens = {g.to_bytes(4, "big"): t for g, t in chunk_tokens.items()}
        prefix = set(chunk_tokens) if prefix_groups is None else set(prefix_groups)
        self._prefix = {g.to_bytes(4, "big") for g in prefix}
        cover = min(prefix, key=lambda g: chunk_tokens.get(g, 1 << 30), default=0)
        self._cover_group = cover.to_bytes(4, "big")  # covers the other groups' files
        self._cover = chunk_tokens.get(cover, 1)
        self.used = self.unlinking = 0
        self.evicted_files = self.rejected_files = self.unreachable_files = 0
        self.removal_errors = 0
        self._to_unlink: deque = deque()  # read by bench/budget_reach.py's settle()
        self._events: deque = deque()
        self._lock = threading.Lock()
        # chunk id -> [order time, group bitmask of its files, pins, its keys]
        self._chunks: dict[bytes, list] = {}
        self._heap: list[tuple[int, bytes]] = []  # (order time, chunk id), lazy
        self._removing: set[bytes] = set()
        self._evicted_keys: deque[list] = deque()
        self._step_pins: list[bytes] = []
        # req_id -> [request time, {(position, group): key}, keys at the last recall]
        self._requests: OrderedDict[str, list] = OrderedDict()
        self._tracked = 0
        self._clock = itertools.count(1)
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ordered_budget", daemon=True)
        self._thread.start()

    # ---- scheduler thread ---------------------------------------------------------------

    def on_hit(self, key, req_context):
        self._events.append(
            ("hit", key, req_context.req_id, req_context.get_offload_key_position(key))
        )

    def forget_request(self, req_id):
        self._events.append(("forget", req_id))

    def admit_store(self, keys, req_context):
        # positions are read when the job is admitted (an I/O thread): the scheduler
        # recorded them before it submitted the job, and only adds others since
        job = Admission(keys, req_context)
        self._events.append(("store", job))
        return job

    def pin_load(self, keys):
        job = Admission(keys, None)
        self._events.append(("load", job))
        return job

    def finish_job(self, job, failed):
        self._events.append(("finish", job, list(failed)))

    def end_step(self):
        self._events.append(("step",))
        if self.used > self.max_bytes * HIGH_WATER // 100 or len(self._events) > 4096:
            self._wake.set()

    def take_evicted_keys(self):
        out = []
        while self._evicted_keys:
            out.append(self._evicted_keys.popleft())
        return out

    def is_removing(self, key):
        with self._lock:
            return self._cid(key[:-4]) in self._removing

    def shutdown(self):
        self._stop = True
        self._wake.set()
        self._thread.join()

    # ---- I/O threads ------------------------------------------------------------------

    def admitted(self, job):
        if job.result is None:
            with self._lock:
                self._drain(job)
        return job.result

    def remove_evicted(self, evicted):
        self._remove(evicted)

    # ---- under _lock --------------------------------------------------------------------

    def _drain(self, until=None):
        events = self._events
        while events and (until is None or until.result is None):
            event = events.popleft()
            kind = event[0]
            if kind == "hit":
                self._hit(*event[1:])
            elif kind == "store":
                self._admit(event[1])
            elif kind == "load":
                event[1].result = self._pin(event[1].keys)
            elif kind == "finish":
                self._finish(event[1], event[2])
            elif kind == "step":
                for h in self._step_pins:
                    self._unpin(h)
                self._step_pins.clear()
            else:
                self._forget(event[1])

    def _cid(self, block_hash):
        return block_hash if self._chunk_id is None else self._chunk_id(block_hash)

    def _request(self, req_id):
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = [time.time_ns(), {}, 0]
        else:
            self._requests.move_to_end(req_id)
        return req

    def _order(self, req, key, position):
        """The order time the request gives its key (None: no position, oldest)."""
        if position is None:
            return req[0] - (1 << 40)
        if key[-4:] in self._prefix:
            return req[0] - 2 * position
        cover = -(-position // self._cover) * self._cover
        return req[0] - 2 * cover - 1

    def _raise(self, h, t):
        chunk = self._chunks.get(h)
        if chunk is not None and chunk[0] < t:
            chunk[0] = t
            heapq.heappush(self._heap, (t, h))
            return True
        return False

    def _note(self, req, key, position):
        if position is not None and (position, key[-4:]) not in req[1]:
            req[1][(position, key[-4:])] = key
            self._tracked += 1
            while self._tracked > MAX_TRACKED_KEYS and len(self._requests) > 1:
                self._tracked -= len(self._requests.popitem(last=False)[1][1])

    def _hit(self, key, req_id, position):
        req = self._request(req_id)
        self._note(req, key, position)
        h = self._cid(key[:-4])
        chunk = self._chunks.get(h)
        if chunk is not None:
            self._raise(h, self._order(req, key, position))
            chunk[2] += 1
            chunk[3].add(key)
            self._step_pins.append(h)

    def _raise_earlier(self, req, key, position):
        """The request's earlier chunks of the key's group, back while older than its times."""
        group = key[-4:]
        step = self._tokens.get(group, 0)
        p = position - step
        while step and p > 0:
            earlier = req[1].get((p, group))
            if earlier is None or not self._raise(
                self._cid(earlier[:-4]), self._order(req, earlier, p)
            ):
                return
            p -= step

    def _recall(self, req, req_context):
        """Every key the scheduler recorded a position of for the request (a prefix another
        tier served is on no event of this tier), unless they have not doubled since the
        last recall: amortized O(1) per key."""
        recorded = req_context.offload_key_positions()
        if recorded and len(recorded) >= 2 * req[2]:
            req[2] = len(recorded)
            for k, position in dict(recorded).items():
                self._note(req, k, position)

    def _admit(self, job):
        position_of = job.req_context.get_offload_key_position
        job.ticket = [position_of(k) for k in job.keys]
        req = self._request(job.req_context.req_id)
        self._recall(req, job.req_context)
        for key, position in zip(job.keys, job.ticket, strict=False):
            self._note(req, key, position)
        # full-attention keys first, each in prompt order: a key is written only if what it
        # needs (its predecessor, or its covering chunk) is on disk or written before it
        order = sorted(
            zip(job.keys, job.ticket, strict=False),
            key=lambda kp: (kp[0][-4:] not in self._prefix, kp[1] is None, kp[1] or 0),
        )
        coming: dict[bytes, int] = {}  # chunk id -> group bits this job writes
        unreachable, new = set(), []
        for key, position in order:
            h = self._cid(key[:-4])
            if h in self._removing or not self._reachable(req, key, position, coming):
                unreachable.add(key)
                continue
            bit = 1 << int.from_bytes(key[-4:], "big")
            coming[h] = coming.get(h, 0) | bit
            new.append((key, position, h, bit))
        self.unreachable_files += len(unreachable)
        pinned, added, evicted, rejected = [], [], [], set()
        for key, position, h, bit in new:
            chunk = self._chunks.get(h)
            if chunk is None:
                chunk = self._chunks[h] = [self._order(req, key, position), 0, 0, set()]
                heapq.heappush(self._heap, (chunk[0], h))
            else:
                self._raise(h, self._order(req, key, position))
            chunk[2] += 1
            pinned.append(h)
            chunk[3].add(key)
            if not chunk[1] & bit:
                chunk[1] |= bit
                added.append((key, h, bit))
            if position is not None:
                self._raise_earlier(req, key, position)
        self.used += len(added) * self.file_size
        # files being removed are gone soon: not waited for (the disk holds at most
        # max_bytes plus the budget thread's removals in flight, LOW_WATER..HIGH_WATER)
        over = self.used - self.max_bytes
        if over > 0:
            evicted = self._evict(over)
            over = self.used - self.max_bytes
            for key, h, bit in reversed(added):  # the farthest first
                if over <= 0:
                    break
                rejected.add(key)  # not written: its bytes go back at once
                self._chunks[h][1] &= ~bit
                self.used -= self.file_size
                over -= self.file_size
            self.rejected_files += len(rejected)
        job.ticket = (pinned, rejected)
        job.result = (rejected, unreachable, evicted)

    def _has(self, key, coming):
        h, bit = self._cid(key[:-4]), 1 << int.from_bytes(key[-4:], "big")
        chunk = self._chunks.get(h)
        return bool((chunk is not None and chunk[1] & bit) or coming.get(h, 0) & bit)

    def _reachable(self, req, key, position, coming):
        """Not past a gap: a full-attention key's predecessor, a sliding-window or mamba
        key's covering full-attention chunk, is on disk or written first (or not known:
        a key without a recorded predecessor is a root, the prompt may still grow)."""
        if position is None:
            return True
        group = key[-4:]
        if group in self._prefix:
            step = self._tokens[group]
            before = req[1].get((position - step, group)) if position > step else None
        else:
            cover = -(-position // self._cover) * self._cover
            before = req[1].get((cover, self._cover_group))
        return before is None or self._has(before, coming)

    def _pin(self, keys):
        pinned = []
        for k in keys:
            h = self._cid(k[:-4])
            if h in self._chunks:
                self._chunks[h][2] += 1
                pinned.append(h)
        return (pinned, set())

    def _unpin(self, h):
        chunk = self._chunks.get(h)
        if chunk is not None:
            chunk[2] -= 1

    def _finish(self, job, failed):
        pinned, rejected = job.ticket if job.req_context is not None else job.result
        for h in pinned:
            self._unpin(h)
        for key in set(failed) | rejected:  # files not on disk: forget them
            h = self._cid(key[:-4])
            chunk = self._chunks.get(h)
            bit = 1 << int.from_bytes(key[-4:], "big")
            if chunk is not None and chunk[1] & bit:
                chunk[1] &= ~bit
                self.used -= self.file_size
                if not chunk[1] and not chunk[2]:
                    del self._chunks[h]

    def _forget(self, req_id):
        req = self._requests.pop(req_id, None)
        if req is not None:
            self._tracked -= len(req[1])

    def _evict(self, need):
        """Oldest unpinned chunks first, until *need* bytes are freed (or nothing is left)."""
        evicted, skipped, heap = [], [], self._heap
        while need > 0 and heap:
            t, h = heapq.heappop(heap)
            chunk = self._chunks.get(h)
            if chunk is None or chunk[0] != t:
                continue  # a stale entry: raised since, or gone
            if chunk[2] or not chunk[1]:
                skipped.append((t, h))  # pinned, or its files are not written yet
                continue
            del self._chunks[h]
            files = bin(chunk[1]).count("1")
            self.used -= files * self.file_size
            self.unlinking += files * self.file_size
            need -= files * self.file_size
            self.evicted_files += files
            self._removing.add(h)
            self._evicted_keys.append(list(chunk[3]))
            evicted.append((h, chunk[1]))
        for entry in skipped:
            heapq.heappush(heap, entry)
        if len(heap) > 2 * len(self._chunks) + 1024:  # drop stale entries
            self._heap = [(c[0], h) for h, c in self._chunks.items()]
            heapq.heapify(self._heap)
        return evicted

    # ---- removals and the budget thread -------------------------------------------------

    def _remove(self, evicted):
        errors = 0
        for h, groups in evicted:
            for g in range(groups.bit_length()):
                if groups >> g & 1:
                    try:
                        os.remove(self._chunk_path(h, g))
                    except FileNotFoundError:
                        pass
                    except OSError as e:
                        errors += 1
                        if self._on_removal_errors is not None:
                            self._on_removal_errors(1, str(e))
        with self._lock:
            for h, groups in evicted:
                self.unlinking -= bin(groups).count("1") * self.file_size
                self._removing.discard(h)
        self.removal_errors += errors

    def _run(self):
        while not self._stop:
            self._wake.wait(0.05)
            self._wake.clear()
            with self._lock:
                self._drain()
                # used: the files kept or being written (those being removed are evicted)
                over = self.used - self.max_bytes * LOW_WATER // 100
                high = self.used > self.max_bytes * HIGH_WATER // 100
                evicted = self._evict(over) if high and over > 0 else []
            if evicted:
                self._remove(evicted)
        with self._lock:
            self._drain()
