#!/usr/bin/env python3
"""The tiering test plan on a GPU runner, with the real CUDA handlers (plain TieringOffloadingSpec).

  - no CUDA GPU visible to the venv's torch: says so and exits 0
  - hub reachable: the models of e2e/gpu_models.toml on lm_eval's gsm8k (accuracy within the
    model's tolerance of the no-connector arm; cold arm CPU->GPU loads > 0)
  - hub not reachable (or --tiny): the tiny local models and task (exact per-sample parity)

    python e2e/run_gpu.py [--models gpt-oss gemma-4] [--tiny] [--config e2e/gpu_models.toml]

Use E2E_VENV_BIN=/path/to/venv/bin for a venv with the CUDA build of vllm 0.22.1 + the series.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, E2EError, PY, Server, log_tail, run_lm_eval, say  # noqa: E402

OUT = ROOT / "build" / "e2e-gpu"
METRIC = "exact_match,strict-match"


def gpu_count() -> int:
    try:
        out = subprocess.run([str(PY), "-c", "import torch;print(torch.cuda.device_count() "
                              "if torch.cuda.is_available() else 0)"],
                             capture_output=True, text=True, timeout=180).stdout.strip()
        return int(out.splitlines()[-1]) if out else 0
    except Exception:
        return 0


def hub_reachable() -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        urllib.request.urlopen("https://huggingface.co/api/models/gpt2", timeout=5)
        return True
    except Exception:
        return False


def fs_tier_type() -> str:
    """The disk tier's type name in the installed vLLM: `fs_python` (0.22.1), `fs` after
    upstream #43600."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    return "fs" if "fs" in SecondaryTierFactory._registry else "fs_python"


def kv(fs_root: Path, cpu_bytes: int) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
                "eviction_policy": "lru",
                "secondary_tiers": [{"type": fs_tier_type(), "root_dir": str(fs_root)}]}}


def run_hub_model(name: str, m: dict, out: Path) -> list[dict]:
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    rows = []
    serve = list(m["args"]) + ["--tensor-parallel-size", str(m["tp"])]
    for arm in ("noconn", "warm", "cold"):
        cfg = None if arm == "noconn" else kv(run_dir / "fs", int(m["cpu_bytes_to_use"]))
        log = run_dir / f"{arm}.server.log"
        row = {"model": name, "arm": arm, "acc": None, "parity": "-", "cpu_to_gpu_B": "-",
               "start_s": None, "dur_s": None, "status": "?"}
        t0 = time.monotonic()
        server = Server(m["hf_id"], log, kv_transfer_config=cfg, extra_args=serve,
                        served_name=name, online=True, start_timeout=3600)
        try:
            with server:
                row["start_s"] = round(server.start_s, 1)
                res: dict = {}
                row["samples_map"] = run_lm_eval(server, m["hf_id"], None, run_dir / f"{arm}.lm",
                                                 int(m["num_concurrent"]), run_dir / f"{arm}.lm.log",
                                                 int(m["limit"]), task="gsm8k", results=res)
                row["acc"] = res.get(METRIC)
                if cfg is not None:
                    row["cpu_to_gpu_B"] = int(server.metrics().get(
                        "vllm:kv_offload_total_bytes_total[CPU_to_GPU]", 0))
                row["status"] = "ran"
        except E2EError as e:
            row["status"] = "FAILED: " + str(e).splitlines()[0]
            say(f"{name}/{arm}: {e}\n  server log tail:\n{log_tail(log)}")
        row["dur_s"] = round(time.monotonic() - t0, 1)
        rows.append(row)
    base = rows[0]
    for r in rows[1:]:
        if r["acc"] is not None and base["acc"] is not None:
            same = sum(r["samples_map"].get(d) == v for d, v in base["samples_map"].items())
            r["parity"] = f"{same}/{len(base['samples_map'])} identical"
    ok = all(r["status"] == "ran" for r in rows) and all(
        abs(r["acc"] - base["acc"]) <= float(m["tolerance"]) for r in rows[1:]) and \
        rows[2]["cpu_to_gpu_B"] not in ("-", 0)
    for r in rows:
        r["verdict"] = "PASS" if ok else "FAIL"
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path(__file__).with_name("gpu_models.toml"))
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--tiny", action="store_true", help="use the tiny local models even online")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    n = gpu_count()
    if n == 0:
        say(f"no CUDA GPU visible to {PY}: e2e-gpu skipped (run it on a GPU runner, with "
            "E2E_VENV_BIN pointing at a CUDA vllm 0.22.1 venv)")
        return 0
    if a.tiny or not hub_reachable():
        say(f"{n} GPU(s); hub not used: tiny local models with the real CUDA handlers")
        import run_plan
        return run_plan.main(["--gpu", "--scenarios", "base", "conc8", "small",
                              "--out", str(a.out / "tiny")])
    cfg = tomllib.loads(a.config.read_text())
    defaults = cfg.get("defaults", {})
    rows: list[dict] = []
    for name, m in cfg["models"].items():
        if a.models and name not in a.models:
            continue
        m = {**defaults, **m, "args": list(defaults.get("args", [])) + list(m.get("args", []))}
        if m["tp"] > n:
            say(f"{name}: needs tp={m['tp']} GPUs, this runner has {n}: skipped")
            rows.append({"model": name, "arm": "-", "acc": None, "parity": "-",
                         "cpu_to_gpu_B": "-", "start_s": None, "dur_s": None,
                         "status": f"skipped (tp {m['tp']} > {n} GPUs)", "verdict": "SKIP"})
            continue
        say(f"{name}: {m['hf_id']} tp={m['tp']} gsm8k limit={m['limit']} "
            f"tolerance={m['tolerance']}")
        rows += run_hub_model(name, m, a.out)
    hdr = ["model", "arm", "acc", "parity", "cpu_to_gpu_B", "start_s", "dur_s", "status", "verdict"]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    lines += ["| " + " | ".join(str(r.get(k)) for k in hdr) + " |" for r in rows]
    text = "\n".join(lines)
    print("\n" + text + "\n")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.md").write_text(text + "\n")
    return 0 if all(r.get("verdict") in ("PASS", "SKIP") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
