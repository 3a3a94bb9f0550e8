"""Helpers shared by the benchmark scripts: paths, sizes, statistics, the run's context."""

import gc
import itertools
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_PY = ROOT / ".venv" / "bin" / "python"
TMP = ROOT / "build" / "bench-tmp"
RESULTS = ROOT / "bench" / "results"

QUICK = os.environ.get("BENCH_QUICK", "") not in ("", "0")
# PYTHONPATH of the patched side instead of .venv as installed (e.g. a checkout's work tree
# through scripts/worktree_site.py): the scheduler worker and the disk sections import it.
PATCHED_SITE = os.environ.get("BENCH_PATCHED_SITE", "")


class BenchError(Exception):
    """An error the user can act on; printed as one line, exit status 1."""


def say(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def freeze_heap() -> None:
    """Take everything allocated so far (vLLM's imports, the setup) out of the garbage
    collector's passes, as the engine does once started (vllm/v1/engine/core.py:
    freeze_gc_heap()): a measured call then pays for collecting what it allocates, not for
    passes over a start-up heap the engine never makes (11% of the fs tier's store CPU here,
    perf, 2026-12-02)."""
    gc.collect()
    gc.freeze()


def run_main(main) -> None:
    freeze_heap()
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"[bench] error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


def stats(samples: list[float]) -> dict:
    return {"min": min(samples), "median": statistics.median(samples), "n": len(samples)}


def round_order(sides, r: int) -> list:
    """The sides in round r's order, rotated by r: every side runs in every position once in
    len(sides) rounds. With three sides or more, alternating the order only would keep one
    side in the middle for ever (an A/A control showed 1.33x between two identical sides)."""
    k = r % len(sides)
    return list(sides[k:]) + list(sides[:k])


def fmt_bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def fmt_ratio(x: float | None, prefix: str = "") -> str:
    return "n/a" if x is None else f"{prefix}{x:.2f}"


def vllm_env(pristine: bool) -> dict:
    """Environment for a .venv python that imports the patched vLLM, or pristine 0.22.1."""
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    if not pristine and PATCHED_SITE:
        env["PYTHONPATH"] = PATCHED_SITE
    if pristine:
        out = subprocess.run(
            ["python3", str(ROOT / "scripts" / "unpatched_site.py")],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if out.returncode != 0 or not out.stdout.strip():
            raise BenchError(
                "scripts/unpatched_site.py could not build the pristine site "
                f"({(out.stderr or out.stdout).strip()[-300:]}); run `make apply` first"
            )
        env["PYTHONPATH"] = out.stdout.strip().splitlines()[-1]
    return env


def vllm_fingerprint(package_dir: str) -> dict:
    """A digest of the vLLM files this benchmark exercises, and the newest file's time: the
    patched tree may be rebuilt while the benchmark runs, so every result says what it ran."""
    import hashlib
    import time

    digest = hashlib.sha256()
    newest = 0.0
    roots = [
        Path(package_dir) / "v1" / "kv_offload",
        Path(package_dir) / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "offloading",
    ]
    for path in sorted(p for root in roots for p in root.rglob("*.py")):
        digest.update(str(path.relative_to(package_dir)).encode())
        digest.update(path.read_bytes())
        newest = max(newest, path.stat().st_mtime)
    return {
        "digest": digest.hexdigest()[:12],
        "newest": time.strftime("%H:%M:%S", time.localtime(newest)),
    }


def check_venv() -> None:
    if not VENV_PY.exists():
        raise BenchError(f"{VENV_PY} is missing; run `make apply` first")


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kb = 0
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "patches", "vllm_overlay"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    series = subprocess.run(
        ["git", "log", "-1", "--format=%h %s"],
        cwd=ROOT / "build" / "vllm",
        capture_output=True,
        text=True,
    ).stdout.strip()
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = -1.0
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem_kb / (1 << 20), 1),
        "commit": commit + (" (patches/ modified)" if dirty else ""),
        "series_head": series,
        "python": platform.python_version(),
        "load_at_start": round(load, 2),
    }


def run_tasks(n_tasks: int, task, n_threads: int) -> float:
    """Run task(0 .. n_tasks - 1) on n_threads threads; the wall time in seconds."""
    counter = itertools.count()
    errors: list[Exception] = []

    def worker() -> None:
        try:
            while (i := next(counter)) < n_tasks:
                task(i)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return took


def model_config(tmp: str):
    """A real ModelConfig of a tiny local Llama config (no hub, no weights): the layouts' KV
    specs are given, the model is not loaded."""
    import json

    from vllm.config import ModelConfig

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "torch_dtype": "float16",
    }
    Path(tmp, "config.json").write_text(json.dumps(cfg))
    return ModelConfig(
        model=tmp, tokenizer=tmp, skip_tokenizer_init=True, max_model_len=1024, dtype="float16"
    )
