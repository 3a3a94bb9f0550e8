"""One side of the scheduler benchmark: times cases on the vLLM this interpreter imports.

Started by sched_bench.py twice, once on the patched .venv and once with PYTHONPATH set to
pristine 0.22.1. Reads one JSON command per line on stdin, answers one JSON line per command.
Usage: sched_worker.py FS_ROOT (a scratch directory for the fs tier's cold lookups).
Written against the pristine 0.22.1 API, so the same code path runs on both trees:
- the managers are built directly (pristine TieringOffloadingSpec.get_manager asserts one
  KV cache group): a real CPUPrimaryTierOffloadingManager over a real SharedOffloadRegion and a
  real TieringOffloadingManager;
- the real OffloadingConnectorScheduler runs over a duck-typed spec (fakes.py).
"""

import gc
import hashlib
import itertools
import json
import os
import sys
import time
import traceback
from types import SimpleNamespace

# Keep the protocol on our own copy of stdout: vLLM's logger writes to stdout.
_proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: E402
    OffloadingConnectorScheduler,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager  # noqa: E402
from vllm.v1.kv_offload.tiering.example.manager import (  # noqa: E402
    ExampleSecondaryTierManager,
)
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import (  # noqa: E402
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from common import freeze_heap, vllm_fingerprint  # noqa: E402
from fakes import BLOCK_SIZE, fake_spec  # noqa: E402

ROW_BYTES = 64  # the scheduler side never touches the rows' bytes
_regions = 0


class AlwaysHitTier(SecondaryTierManager):
    """A secondary tier that holds every key (or only `held`, when given) and finishes
    every job at once."""

    def __init__(self, primary_kv_view: memoryview, held: set | None = None):
        super().__init__(None, primary_kv_view, "always_hit")
        self._done: list[JobResult] = []
        self._held = held

    def lookup(self, key, req_context):
        return self._held is None or key in self._held

    def submit_store(self, job_metadata):
        self._done.append(JobResult(job_id=job_metadata.job_id, success=True))

    def submit_load(self, job_metadata):
        self._done.append(JobResult(job_id=job_metadata.job_id, success=True))

    def get_finished(self):
        done, self._done = self._done, []
        return done


def make_manager(
    num_blocks: int, tier: str, fs_root: str = "", held: set | None = None
) -> TieringOffloadingManager:
    global _regions
    _regions += 1
    region = SharedOffloadRegion(
        instance_id=f"bench-{os.getpid()}-{_regions}",
        total_size_bytes=ROW_BYTES * num_blocks,
        num_blocks=num_blocks,
        rank=None,
        num_workers=1,
        cpu_page_size=ROW_BYTES,
    )
    primary = CPUPrimaryTierOffloadingManager(num_blocks=num_blocks, mmap_region=region)
    view = primary.get_kv_memoryview()
    if tier == "example":
        secondary = ExampleSecondaryTierManager(None, view, "example")
    elif tier == "always_hit":
        secondary = AlwaysHitTier(view, held)
    else:
        secondary = FileSystemTierManager(
            fake_spec(1, None),
            view,
            "fs_python",
            root_dir=fs_root,
            n_read_threads=1,
            n_write_threads=1,
        )
    return TieringOffloadingManager(primary_tier=primary, secondary_tiers=[secondary])


class FakeRequest:
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


def hashes(n: int, salt: str) -> list[bytes]:
    return [hashlib.sha256(f"{salt}-{i}".encode()).digest() for i in range(n)]


def sched_output(req_id: str | None, block_ids: tuple, num_tokens: int) -> SimpleNamespace:
    new = [] if req_id is None else [SimpleNamespace(req_id=req_id, block_ids=block_ids)]
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={} if req_id is None else {req_id: num_tokens},
        preempted_req_ids=None,
    )


def complete(sched: OffloadingConnectorScheduler, job_ids) -> None:
    meta = OffloadingWorkerMetadata()
    for job_id in job_ids:
        meta.mark_completed(job_id)
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))


def case_perkey(groups: int, blocks: int, repeats: int) -> dict:
    """Store a request's blocks for every group through the real connector scheduler, then
    hit and load them for a second request with the same prompt. Times both, per key."""
    out = {"store_us_per_key": [], "hit_load_us_per_key": [], "total_us_per_key": []}
    num_keys = groups * blocks
    for rep in range(repeats):
        block_hashes = hashes(blocks, f"perkey-{rep}")
        manager = make_manager(num_keys, "example")
        sched = OffloadingConnectorScheduler(fake_spec(groups, manager))
        try:
            gpu_ids = tuple([g * blocks + i + 1 for i in range(blocks)] for g in range(groups))
            alloc = KVCacheBlocks(tuple([KVCacheBlock(b) for b in ids] for ids in gpu_ids))
            req_a = FakeRequest("a", block_hashes)
            req_b = FakeRequest("b", block_hashes)
            num_tokens = req_a.num_tokens
            out_a = sched_output("a", gpu_ids, num_tokens)
            out_b = sched_output("b", gpu_ids, num_tokens)
            gc.collect()

            t0 = time.perf_counter()
            hit, _ = sched.get_num_new_matched_tokens(req_a, 0)
            meta = sched.build_connector_meta(out_a)
            complete(sched, meta.store_jobs)
            list(sched.take_events())
            req_a.finished = True
            sched.request_finished(req_a)
            t1 = time.perf_counter()
            stored = sum(len(j.transfer_spec[1].block_ids) for j in meta.store_jobs.values())
            if hit != 0 or stored != num_keys:
                raise RuntimeError(f"store phase: hit={hit}, stored {stored} of {num_keys}")

            t2 = time.perf_counter()
            hit, _ = sched.get_num_new_matched_tokens(req_b, 0)
            sched.update_state_after_alloc(req_b, alloc, hit)
            meta = sched.build_connector_meta(out_b)
            complete(sched, meta.load_jobs)
            list(sched.take_events())
            req_b.finished = True
            sched.request_finished(req_b)
            t3 = time.perf_counter()
            loaded = sum(len(j.transfer_spec[0].block_ids) for j in meta.load_jobs.values())
            if hit != num_tokens or loaded != num_keys:
                raise RuntimeError(
                    f"hit phase: hit {hit} of {num_tokens} tokens, "
                    f"loaded {loaded} of {num_keys} keys"
                )
        finally:
            sched.shutdown()
        out["store_us_per_key"].append((t1 - t0) * 1e6 / num_keys)
        out["hit_load_us_per_key"].append((t3 - t2) * 1e6 / num_keys)
        out["total_us_per_key"].append((t1 - t0 + t3 - t2) * 1e6 / num_keys)
    return out


def store(manager: TieringOffloadingManager, keys, ctx: ReqContext) -> None:
    out = manager.prepare_store(keys, ctx)
    if out is None or len(out.keys_to_store) != len(keys):
        raise RuntimeError("setup: the CPU tier did not take the blocks")
    manager.complete_store(keys, ctx)
    list(manager.take_events())  # end of step: cascades finish, ref counts drop


PHASES = ("store", "cold", "step1", "step2", "load")


def case_phases(n: int, full: bool, repeats: int = 1, budget_s: float = 3.0) -> dict:
    """The scheduler-side phases of one request on the tiering manager, each timed on its
    own (ms), with n keys per phase:
    - store: prepare_store + complete_store of n keys and the step's end (take_events);
    - cold: lookup of n keys that no tier holds, and the step's end;
    - step1: lookup of the n stored keys (hits) and n keys only the secondary tier holds
      (promotions started), and the step's end (take_events submits the promotion job);
    - step2: lookup of all 2n again (all ready: the promotions finished), without the
      step's end;
    - load: prepare_load of the 2n keys, the step's end, complete_load of the 2n keys.
    The CPU tier holds 2n blocks. With `full` they are taken beforehand by another
    request's blocks: the store evicts n of them, the promotions the other n.
    Repeated up to `repeats` times while the samples so far took less than `budget_s`."""
    out: dict = {f"{p}_ms": [] for p in PHASES}
    t_start = time.perf_counter()
    while len(out["step1_ms"]) < repeats and (
        not out["step1_ms"] or time.perf_counter() - t_start < budget_s
    ):
        for phase, ms in zip(PHASES, phases_once(n, full, len(out["step1_ms"])), strict=True):
            out[f"{phase}_ms"].append(ms)
    return out


def phases_once(n: int, full: bool, rep: int) -> list[float]:
    keys = [make_offload_key(h, 0) for h in hashes(3 * n, f"phases-{rep}")]
    ready, promote, cold = keys[:n], keys[n : 2 * n], keys[2 * n :]
    manager = make_manager(2 * n, "always_hit", held=set(promote))
    try:
        ctx = ReqContext(req_id="req")
        if full:
            filler = [make_offload_key(h, 0) for h in hashes(2 * n, f"filler-{rep}")]
            store(manager, filler, ReqContext(req_id="other"))
        both = ready + promote
        gc.collect()

        t0 = time.perf_counter()
        out = manager.prepare_store(ready, ctx)
        manager.complete_store(ready, ctx)
        list(manager.take_events())
        t1 = time.perf_counter()
        misses = [manager.lookup(k, ctx) for k in cold]
        list(manager.take_events())
        t2 = time.perf_counter()
        step1 = [manager.lookup(k, ctx) for k in both]
        list(manager.take_events())
        t3 = time.perf_counter()
        step2 = [manager.lookup(k, ctx) for k in both]
        t4 = time.perf_counter()
        manager.prepare_load(both, ctx)
        list(manager.take_events())
        manager.complete_load(both, ctx)
        t5 = time.perf_counter()
    finally:
        manager.shutdown()
    stored = 0 if out is None else len(out.keys_to_store)
    n_true, n_none = step1.count(True), step1.count(None)
    if stored != n or any(misses) or n_true != n or n_none != n or step2.count(True) != 2 * n:
        raise RuntimeError(
            f"stored {stored} of {n}; cold: {sum(map(bool, misses))} hits; step 1: "
            f"{n_true} ready, {n_none} promoting (expected {n}, {n}); step 2: "
            f"{step2.count(True)} of {2 * n} ready"
        )
    return [(b - a) * 1e3 for a, b in itertools.pairwise((t0, t1, t2, t3, t4, t5))]


def case_cold(blocks: int, repeats: int) -> dict:
    """Lookup of a long cold prompt: every key misses the CPU tier and the secondary tier."""
    out = {"example_us_per_key": [], "fs_us_per_key": []}
    for rep in range(repeats):
        keys = [make_offload_key(h, 0) for h in hashes(blocks, f"cold-{rep}")]
        ctx = ReqContext(req_id="cold")
        for tier, metric in (("example", "example_us_per_key"), ("fs", "fs_us_per_key")):
            manager = make_manager(16, tier, sys.argv[1])
            try:
                gc.collect()
                t0 = time.perf_counter()
                hits = [manager.lookup(k, ctx) for k in keys]
                t1 = time.perf_counter()
                list(manager.take_events())
            finally:
                manager.shutdown()
            if any(hits):
                raise RuntimeError(f"cold lookup: {sum(map(bool, hits))} unexpected hits")
            out[metric].append((t1 - t0) * 1e6 / blocks)
    return out


CASES = {"perkey": case_perkey, "phases": case_phases, "cold": case_cold}


def main() -> None:
    # warm up every code path once, so that no case pays for first calls
    case_perkey(2, 64, 1)
    case_phases(64, True)
    case_phases(64, False)
    case_cold(64, 1)
    freeze_heap()  # as the engine does once started
    import vllm

    path = os.path.dirname(vllm.__file__)
    ready = {"ready": True, "version": vllm.__version__, "path": path, **vllm_fingerprint(path)}
    _proto.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            result = CASES[cmd.pop("case")](**cmd)
            _proto.write(json.dumps({"ok": result}) + "\n")
        except Exception as e:
            traceback.print_exc()
            _proto.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")


if __name__ == "__main__":
    main()
