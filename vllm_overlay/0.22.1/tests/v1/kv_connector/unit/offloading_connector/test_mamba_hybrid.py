# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""
KV offloading for mamba / linear-attention hybrids (MambaSpec groups next to
attention groups) through vLLM's real Scheduler, KVCacheManager and
OffloadingConnector, with TieringOffloadingSpec's CPU tier.

A recurrent group keeps one state per block: the state after the block's last
token. Loading it is only correct when the request resumes exactly there. The
tests run a request to completion (its blocks are stored), drop the GPU prefix
cache, send the same prompt again, and check the load the connector schedules:
the hit, which keys, into which GPU blocks, and that every recurrent state
lands where the request resumes. GPU contents are modelled per block (token
ranges for attention, the position of the state for mamba), because the CPU
platform has no kernels to run.
"""

import json
import os

import pytest
import torch

from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_configs,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
)
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

pytestmark = pytest.mark.skip_global_cleanup

BLOCK_SIZE = 96
_DTYPE = torch.float16
EOS_TOKEN_ID = 50256


def _hybrid(num_mamba: int, num_attn: int, mode: str) -> dict[str, KVCacheSpec]:
    attn = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=32, dtype=_DTYPE
    )
    specs: dict[str, KVCacheSpec] = {}
    for i in range(num_mamba):
        specs[f"model.layers.{i}.mixer"] = MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=((3, 64), (2, 16, 16)),
            dtypes=(_DTYPE, _DTYPE),
            page_size_padded=attn.page_size_bytes,
            mamba_cache_mode=mode,
        )
    for i in range(num_mamba, num_mamba + num_attn):
        specs[f"model.layers.{i}.self_attn.attn"] = attn
    return specs


# layout -> (mamba layers, attention layers)
LAYOUTS = {
    # Qwen3.5/3.6: three gated DeltaNet layers per full attention layer
    "qwen3_5": (3, 1),
    # Nemotron-H: mostly mamba2 layers, a few attention layers
    "nemotron_h": (4, 2),
    # Jamba: one attention layer per seven mamba layers
    "jamba": (7, 1),
}

# name -> (prompt length given the offloaded block size c in tokens,
#          max_num_batched_tokens in GPU blocks: 2 prefills in several chunks)
PROMPTS = {
    "boundary": (lambda c: 4 * c, 64),
    "boundary_minus_1": (lambda c: 4 * c - 1, 64),
    "boundary_plus_1": (lambda c: 4 * c + 1, 64),
    "shorter_than_a_block": (lambda c: BLOCK_SIZE - 10, 64),
    "one_block": (lambda c: c, 64),
    "boundary_several_chunks": (lambda c: 4 * c, 2),
    "mid_several_chunks": (lambda c: 3 * c + 50, 2),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny local Llama config (no hub access); the KV cache layout comes
    from the specs above, not from the model."""
    path = tmp_path_factory.mktemp("tiny-model")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "vocab_size": 60000,
        "max_position_embeddings": 4096,
        "torch_dtype": "float16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


class HybridRunner:
    """The real Scheduler + OffloadingConnector (TieringOffloadingSpec, CPU
    tier) over a real KVCacheConfig, with a modelled worker: transfers
    complete at the end of the step that issues them, and each GPU block's
    content is tracked."""

    def __init__(
        self,
        model_dir: str,
        layout: str,
        mode: str,
        blocks_per_chunk: int,
        max_num_batched_tokens: int,
    ):
        num_mamba, num_attn = LAYOUTS[layout]
        model_config = ModelConfig(
            model=model_dir,
            tokenizer=model_dir,
            skip_tokenizer_init=True,
            max_model_len=4096,
            dtype="float16",
        )
        extra_config = {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 64 << 20,
            "secondary_tiers": [],
        }
        if blocks_per_chunk > 1:
            extra_config["blocks_per_chunk"] = blocks_per_chunk
        self.vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=BLOCK_SIZE,
                enable_prefix_caching=True,
                mamba_cache_mode=mode,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=4,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=4096,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config=extra_config,
            ),
        )
        specs = _hybrid(num_mamba, num_attn, mode)
        page_bytes = max(s.page_size_bytes for s in specs.values())
        (self.kv_cache_config,) = get_kv_cache_configs(
            self.vllm_config, [specs], [page_bytes * len(specs) * 256]
        )
        self.vllm_config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.groups = self.kv_cache_config.kv_cache_groups
        self.mamba_groups = [
            i
            for i, g in enumerate(self.groups)
            if isinstance(g.kv_cache_spec, MambaSpec)
        ]
        assert self.mamba_groups and len(self.mamba_groups) < len(self.groups)
        for g in self.groups:
            assert g.kv_cache_spec.block_size == BLOCK_SIZE
        self.bpc = blocks_per_chunk
        self.chunk = BLOCK_SIZE * blocks_per_chunk
        self.mode = mode

        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self._shm = f"/dev/shm/vllm_offload_{self.vllm_config.instance_id}.mmap"
        try:
            self.scheduler = Scheduler(
                vllm_config=self.vllm_config,
                kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=BLOCK_SIZE,
                log_stats=False,
            )
        except BaseException:
            # e.g. a vLLM that refuses HMA models after creating the CPU
            # region: do not leave it in /dev/shm
            if os.path.exists(self._shm):
                os.remove(self._shm)
            raise
        self.connector_scheduler = self.scheduler.connector.connector_scheduler
        self.manager = self.connector_scheduler.manager

        # record the keys of every prepare_load, in order
        self.prepared_loads: list[list] = []
        prepare_load = self.manager.prepare_load

        def _prepare_load(keys, req_context):
            self.prepared_loads.append(list(keys))
            return prepare_load(keys, req_context)

        self.manager.prepare_load = _prepare_load

        # modelled GPU contents: block_id -> content, where content is
        # ("kv", start, end) for attention and ("state", pos) for mamba
        self.gpu: dict[int, tuple] = {}
        # modelled CPU tier contents: (offload key, sub-block) -> content
        self.cpu: dict[tuple, tuple] = {}

    def close(self):
        self.connector_scheduler.shutdown()
        if os.path.exists(self._shm):
            os.remove(self._shm)

    def new_request(self, req_id: str, token_ids: list[int]) -> Request:
        params = SamplingParams(max_tokens=1)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        req = Request(
            request_id=req_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.block_hasher,
        )
        self.scheduler.add_request(req)
        return req

    def keys(self, req: Request, group_idx: int) -> list:
        """The offload keys of a request's chunks in a group: the hash of the
        chunk's last hash block."""
        return [
            make_offload_key(h, group_idx)
            for h in req.block_hashes[self.bpc - 1 :: self.bpc]
        ]

    def block_table(self, req_id: str, group_idx: int) -> list:
        coordinator = self.scheduler.kv_cache_manager.coordinator
        return coordinator.single_type_managers[group_idx].req_to_blocks[req_id]

    def _compute(self, req_id: str, start: int, end: int):
        """The model's forward pass over tokens [start, end) writes KV of
        those tokens (attention) and the recurrent state (mamba)."""
        for group_idx in range(len(self.groups)):
            table = self.block_table(req_id, group_idx)
            if group_idx not in self.mamba_groups:
                for idx in range(start // BLOCK_SIZE, (end - 1) // BLOCK_SIZE + 1):
                    lo = idx * BLOCK_SIZE
                    hi = min(end, lo + BLOCK_SIZE)
                    prev = self.gpu.get(table[idx].block_id)
                    if lo < start:
                        # continues the block: valid if it held [lo, start)
                        lo = prev[1] if prev and prev[2] == start else start
                    self.gpu[table[idx].block_id] = ("kv", lo, hi)
                continue
            if self.mode == "all":
                # a state at every block boundary passed, and at the end
                for pos in range(
                    (start // BLOCK_SIZE + 1) * BLOCK_SIZE, end, BLOCK_SIZE
                ):
                    block = table[pos // BLOCK_SIZE - 1]
                    assert not block.is_null
                    self.gpu[block.block_id] = ("state", pos)
            # the state after the last token goes into the last block
            block = table[(end - 1) // BLOCK_SIZE]
            assert not block.is_null
            self.gpu[block.block_id] = ("state", end)

    def step(self, finished_recving: set[str] | None = None):
        """One engine step: schedule, run the modelled worker (loads before
        the forward pass, stores after it), report back."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        worker_meta = OffloadingWorkerMetadata()
        recving = set(finished_recving or ())
        for job_id, job in meta.load_jobs.items():
            keys = self.prepared_loads.pop(0)
            self.last_load = (job, self._load(job, keys))
            worker_meta.mark_completed(job_id)
            recving.add(job.req_id)
        # schedule() already advanced num_computed_tokens past this step
        for req in self.scheduler.running:
            n = out.num_scheduled_tokens.get(req.request_id)
            if n:
                end = req.num_computed_tokens
                self._compute(req.request_id, end - n, end)
        for job_id, job in meta.store_jobs.items():
            self._store(job)
            worker_meta.mark_completed(job_id)
        running = [
            r
            for r in self.scheduler.running
            if r.request_id in out.num_scheduled_tokens
        ]
        req_ids = [r.request_id for r in running]
        sampled = [
            [0] if r.num_computed_tokens >= r.num_tokens else [] for r in running
        ]
        self.scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=sampled,
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=None,
                kv_connector_output=KVConnectorOutput(
                    finished_recving=recving or None,
                    kv_connector_worker_meta=worker_meta,
                ),
            ),
        )
        return out, meta

    def _load(self, job, keys: list) -> list[tuple]:
        """Copy offloaded blocks into GPU blocks as the worker would: the
        load job's keys, group by group, fill its GPU blocks from the first
        one's offset within its chunk. Returns (group, block index in the
        request, key, sub-block) for each GPU block written."""
        _, dst = job.transfer_spec
        key_iter = iter(keys)
        offset = 0
        written = []
        for group_idx, (size, start) in enumerate(
            zip(dst.group_sizes, dst.block_indices)
        ):
            num_keys = -(-(start % self.bpc + size) // self.bpc) if size else 0
            group_keys = [next(key_iter) for _ in range(num_keys)]
            addresses = [(key, sub) for key in group_keys for sub in range(self.bpc)]
            addresses = addresses[start % self.bpc :][:size]
            block_ids = dst.block_ids[offset : offset + size].tolist()
            offset += size
            table = self.block_table(job.req_id, group_idx)
            for i, ((key, sub), block_id) in enumerate(zip(addresses, block_ids)):
                assert table[start + i].block_id == block_id
                self.gpu[block_id] = self.cpu.get((key, sub))
                written.append((group_idx, start + i, key, sub))
        assert next(key_iter, None) is None
        assert offset == len(dst.block_ids)
        return written

    def _store(self, job):
        """Copy GPU blocks to the CPU tier as the worker would: the store
        job's GPU blocks, group by group, are the chunks of its keys."""
        src, _ = job.transfer_spec
        req = self.scheduler.requests[job.req_id]
        offset = 0
        for group_idx, (size, start) in enumerate(
            zip(src.group_sizes, src.block_indices)
        ):
            block_ids = src.block_ids[offset : offset + size].tolist()
            offset += size
            table = self.block_table(job.req_id, group_idx)
            keys = self.keys(req, group_idx)
            for i, block_id in enumerate(block_ids):
                idx = start + i
                assert table[idx].block_id == block_id
                self.cpu[(keys[idx // self.bpc], idx % self.bpc)] = self.gpu.get(
                    block_id
                )

    def run_to_completion(self, req: Request, max_steps: int = 100):
        for _ in range(max_steps):
            if req.is_finished() and not self.connector_scheduler._jobs:
                return
            self.step()
        raise AssertionError(f"request {req.request_id} did not finish")

    def drop_gpu_prefix_cache(self):
        assert self.scheduler.kv_cache_manager.reset_prefix_cache()
        self.gpu.clear()


def _prompt(num_tokens: int) -> list[int]:
    return [(7 * i + 3) % 50000 + 1 for i in range(num_tokens)]


@pytest.fixture
def runner_factory(model_dir):
    runners: list[HybridRunner] = []

    def make(*args, **kwargs) -> HybridRunner:
        runner = HybridRunner(model_dir, *args, **kwargs)
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.close()


def _expected_hit(runner: HybridRunner, tokens: list[int], start: int) -> int:
    """What a correct load can resume from: the largest chunk boundary P <=
    N - 1 (the last prompt token is always recomputed), at least one chunk
    past `start` (the GPU prefix hit), such that every recurrent group's chunk
    ending at P was offloaded holding the state after exactly P tokens."""
    req = Request(
        request_id="keys",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=runner.block_hasher,
    )
    expected = 0
    for pos in range(start + runner.chunk, len(tokens), runner.chunk):
        if all(
            runner.cpu.get(
                (runner.keys(req, g)[pos // runner.chunk - 1], runner.bpc - 1)
            )
            == ("state", pos)
            for g in runner.mamba_groups
        ):
            expected = pos - start
    return expected


def _send_again_and_check_load(
    runner: HybridRunner, req_id: str, tokens: list[int], local_hit: int = 0
):
    """Send `tokens` and check the load the connector schedules for it: the
    hit, the keys, the GPU blocks they go to, and that every recurrent group
    resumes from the state saved exactly where the request resumes."""
    expected_hit = _expected_hit(runner, tokens, local_hit)
    req = runner.new_request(req_id, tokens)
    runner.last_load = None
    runner.step()
    if expected_hit == 0:
        assert runner.last_load is None, (
            f"loads up to token {req.num_computed_tokens}, but no offloaded "
            f"recurrent state fits a resume before token {len(tokens)}"
        )
        runner.run_to_completion(req)
        return

    assert runner.last_load is not None, (
        f"no load, but states up to {local_hit + expected_hit} tokens were offloaded"
    )
    _, written = runner.last_load
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    hit = req.num_computed_tokens
    assert hit - local_hit == expected_hit
    assert hit % runner.chunk == 0
    # the right chunk of the right group goes to the right GPU block
    for group_idx, idx, key, sub in written:
        assert key == runner.keys(req, group_idx)[idx // runner.bpc]
        assert sub == idx % runner.bpc

    for group_idx in range(len(runner.groups)):
        table = runner.block_table(req_id, group_idx)
        if group_idx in runner.mamba_groups:
            # the request resumes after `hit` tokens from this block
            content = runner.gpu.get(table[hit // BLOCK_SIZE - 1].block_id)
            assert content == ("state", hit), (
                f"group {group_idx} resumes after {hit} tokens from a block "
                f"holding {content}"
            )
        else:
            for idx in range(hit // BLOCK_SIZE):
                content = runner.gpu.get(table[idx].block_id)
                assert content == ("kv", idx * BLOCK_SIZE, (idx + 1) * BLOCK_SIZE)

    # the load completes and the request runs to the end
    runner.run_to_completion(req)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize(
    "prompt", ["boundary_minus_1", "boundary_plus_1", "mid_several_chunks"]
)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_align_mode_offload_hit_through_real_scheduler(
    runner_factory, layout, prompt, blocks_per_chunk
):
    """mamba_cache_mode='align' (Qwen3.5/3.6): an offload hit goes through
    the real Scheduler, whose block-aligned split runs for every waiting
    request, and loads what the request resumes from."""
    num_tokens_fn, budget_blocks = PROMPTS[prompt]
    runner = runner_factory(
        layout, "align", blocks_per_chunk, budget_blocks * BLOCK_SIZE
    )
    tokens = _prompt(num_tokens_fn(runner.chunk))
    runner.run_to_completion(runner.new_request("A", tokens))
    runner.drop_gpu_prefix_cache()
    _send_again_and_check_load(runner, "B", tokens)


@pytest.mark.parametrize("mode", ["align", "all"])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpu_prefix_hit_extended_by_offload_hit(
    runner_factory, layout, blocks_per_chunk, mode
):
    """A request whose first chunks are in the GPU prefix cache and whose next
    chunks are offloaded loads only the offloaded ones, and resumes every
    recurrent group from the offloaded state at the end of the hit."""
    runner = runner_factory(layout, mode, blocks_per_chunk, 64 * BLOCK_SIZE)
    chunk = runner.chunk
    tokens = _prompt(4 * chunk + 10)
    runner.run_to_completion(runner.new_request("A", tokens))
    runner.drop_gpu_prefix_cache()
    # a shorter prompt puts the first two chunks into the GPU prefix cache
    runner.run_to_completion(runner.new_request("B", tokens[: 2 * chunk + 5]))
    probe = Request(
        request_id="probe",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=runner.block_hasher,
    )
    _, local_hit = runner.scheduler.kv_cache_manager.get_computed_blocks(probe)
    assert local_hit == 2 * chunk
    _send_again_and_check_load(runner, "C", tokens, local_hit=local_hit)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("mode", ["align", "all"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_offload_hit_resumes_recurrent_state_where_it_was_saved(
    runner_factory, layout, mode, prompt, blocks_per_chunk
):
    """Prompts ending exactly on an offloaded block boundary, one token
    before or after, shorter than a block, in one or several prefill chunks:
    request A runs and is offloaded, the GPU prefix cache is dropped, the same
    prompt comes again. A recurrent state holds the state after its block's
    last token, so at a boundary N the hit must stop one chunk earlier (the
    last token is recomputed) and load the state saved there, never the state
    after N tokens: that would apply token N-1 twice (vLLM #44599 for
    'align', #51094 for 'all')."""
    num_tokens_fn, budget_blocks = PROMPTS[prompt]
    runner = runner_factory(layout, mode, blocks_per_chunk, budget_blocks * BLOCK_SIZE)
    tokens = _prompt(num_tokens_fn(runner.chunk))
    runner.run_to_completion(runner.new_request("A", tokens))
    runner.drop_gpu_prefix_cache()
    _send_again_and_check_load(runner, "B", tokens)
