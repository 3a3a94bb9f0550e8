#!/usr/bin/env python3
"""Scheduler side, patched vs pristine vLLM: the phases of a request, per-key cost, cold lookup.

Starts sched_worker.py twice (patched .venv; pristine 0.22.1 via scripts/unpatched_site.py)
and sends both the same cases in interleaved rounds (the order alternates per round).
A case that runs past its time limit stops its worker (restarted for the next case), is
recorded as "> limit", and larger sizes of the same case are not run on that tree.
Writes the samples as JSON (--out) for report.py.
"""

import argparse
import glob
import json
import os
import queue
import subprocess
import threading
import time

from common import (
    PATCHED_SITE,
    QUICK,
    TMP,
    VENV_PY,
    BenchError,
    check_venv,
    run_main,
    say,
    vllm_env,
    vllm_fingerprint,
)

TREES = ("patched", "pristine")
PERKEY_KEYS, PERKEY_KEYS_QUICK = 4096, 1024
COLD_KEYS, COLD_KEYS_QUICK = 16384, 4096
PHASE_SIZES = (1000, 4000, 16000)  # keys per phase, quick runs too (a sample is < 1 s)


class Worker:
    def __init__(self, tree: str, env: dict):
        self.tree, self.env, self.proc = tree, env, None
        self.log = TMP / f"sched-worker-{tree}.log"

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        fs_root = TMP / f"cold-fs-{self.tree}"
        fs_root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                str(VENV_PY),
                os.path.join(os.path.dirname(__file__), "sched_worker.py"),
                str(fs_root),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log, "a"),
            text=True,
            env=self.env,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()

    def wait_ready(self) -> None:
        ready = self._answer(300, "start")
        if ready is None:
            raise BenchError(
                f"the {self.tree} scheduler worker did not start in 300 s (log: {self.log})"
            )
        version = f"{ready['version']} from {ready['path']}"
        fingerprint = f"files {ready['digest']}, newest {ready['newest']}"
        if getattr(self, "fingerprint", fingerprint).split(",")[0] != fingerprint.split(",")[0]:
            self.changed = f"restarted on other files ({self.fingerprint} -> {fingerprint})"
        self.version, self.fingerprint, self.path = version, fingerprint, ready["path"]

    @staticmethod
    def _read(proc, lines) -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def _answer(self, timeout: float, what: str):
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        if line is None:
            tail = self.log.read_text().strip().splitlines()[-15:]
            raise BenchError(
                f"the {self.tree} scheduler worker exited during {what}:\n  "
                + "\n  ".join(tail)
                + f"\n(full log: {self.log})"
            )
        return json.loads(line)

    def run(self, case: dict, timeout: float):
        """The case's samples, or None when it ran past timeout (the worker is stopped)."""
        if self.proc is None:
            self.start()
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(timeout, f"case {case}")
        if answer is None:
            self.stop()
            return None
        if "error" in answer:
            raise BenchError(
                f"{self.tree} vLLM failed case {case}: {answer['error']} (log: {self.log})"
            )
        return answer["ok"]

    def stop(self) -> None:
        if self.proc is None:
            return
        pid = self.proc.pid
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        for path in glob.glob(f"/dev/shm/vllm_offload_bench-{pid}-*.mmap"):
            os.unlink(path)


def cases(quick: bool) -> list[tuple[str, dict, float]]:
    """(name, command, time limit in seconds)."""
    keys = PERKEY_KEYS_QUICK if quick else PERKEY_KEYS  # per request, for every G
    out = [
        (
            f"perkey g={g}",
            {"case": "perkey", "groups": g, "blocks": keys // g, "repeats": 3 if quick else 5},
            120,
        )
        for g in (1, 2, 4, 8)
    ]
    out.append(
        (
            "cold",
            {
                "case": "cold",
                "blocks": COLD_KEYS_QUICK if quick else COLD_KEYS,
                "repeats": 1 if quick else 2,
            },
            120,
        )
    )
    limit = 10 if quick else 30
    for full in (False, True):
        for n in PHASE_SIZES:
            name = f"phases n={n}{' full' if full else ''}"
            out.append(
                (
                    name,
                    {"case": "phases", "n": n, "full": full, "repeats": 3},
                    limit,
                )
            )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(TMP / "sched.json"))
    ap.add_argument("--rounds", type=int, default=1 if QUICK else 4)
    ap.add_argument(
        "--patched-site",
        default="",
        help="PYTHONPATH for the 'patched' side instead of .venv as is "
        "(e.g. another build of the series; default: $BENCH_PATCHED_SITE)",
    )
    ap.add_argument("--cases", default="", help="run only the cases whose name starts so")
    args = ap.parse_args()
    check_venv()
    TMP.mkdir(parents=True, exist_ok=True)
    envs = {"patched": vllm_env(False), "pristine": vllm_env(True)}
    if args.patched_site:
        envs["patched"]["PYTHONPATH"] = args.patched_site
    for tree in TREES:
        (TMP / f"sched-worker-{tree}.log").write_text("")
    workers = {tree: Worker(tree, envs[tree]) for tree in TREES}
    plan = [c for c in cases(QUICK) if c[0].startswith(args.cases)]
    if not plan:
        raise BenchError(f"no case starts with {args.cases!r}")
    say(
        f"scheduler side: {len(plan)} cases x {args.rounds} interleaved rounds, "
        f"patched vs pristine (each in its own process)"
    )
    results: dict = {name: {tree: {} for tree in TREES} for name, _, _ in plan}
    t_start = time.monotonic()
    try:
        for w in workers.values():  # import both trees at once
            w.launch()
        for w in workers.values():
            w.wait_ready()
        for r in range(args.rounds):
            order = TREES if r % 2 == 0 else TREES[::-1]
            for name, cmd, limit in plan:
                for tree in order:
                    res = results[name][tree]
                    if res.get("stopped"):
                        continue
                    # a case that took a quarter of its limit is not repeated: one sample
                    # tells (a quadratic cost); a shorter one slowed down by other jobs
                    # on a shared machine is repeated like the others
                    if res.get("slow") and len(res.get("samples", {}).get("_n", [])) >= 1:
                        continue
                    if skipped_for_size(results, name, tree):
                        res["stopped"] = res.get("stopped") or "a smaller size ran past its limit"
                        continue
                    if workers[tree].proc is None:
                        workers[tree].start()
                    t0 = time.monotonic()
                    out = workers[tree].run(dict(cmd), limit)
                    took = time.monotonic() - t0
                    if out is None:
                        res["stopped"] = f"> {limit} s"
                        res["limit_s"] = limit
                        say(f"  {tree:8s} {name}: ran past {limit} s, stopped")
                        continue
                    samples = res.setdefault("samples", {"_n": []})
                    samples["_n"].append(took)
                    for metric, values in out.items():
                        samples.setdefault(metric, []).extend(values)
                    if took > limit / 4:
                        res["slow"] = True
            say(f"  round {r + 1}/{args.rounds} done ({time.monotonic() - t_start:.0f} s)")
    finally:
        for w in workers.values():
            w.stop()
    with open(args.out, "w") as f:
        json.dump(
            {
                "cases": results,
                "seconds": time.monotonic() - t_start,
                "commands": {name: cmd for name, cmd, _ in plan},
                "rounds": args.rounds,
                "versions": {t: f"{w.version} ({w.fingerprint})" for t, w in workers.items()},
                "changed": changed(workers),
                "patched_site": args.patched_site or PATCHED_SITE or "(.venv)",
            },
            f,
            indent=1,
        )
    say(f"scheduler side done in {time.monotonic() - t_start:.0f} s -> {args.out}")
    return 0


def changed(workers: dict) -> list[str]:
    """The trees whose files changed while the benchmark ran (it measured the import's)."""
    out = []
    for tree, w in workers.items():
        now = vllm_fingerprint(w.path)
        if getattr(w, "changed", None):
            out.append(f"{tree}: {w.changed}")
        elif f"files {now['digest']}," not in w.fingerprint:
            out.append(
                f"{tree}: files changed during the run ({w.fingerprint} -> files "
                f"{now['digest']}, newest {now['newest']}); the figures are those of the "
                "files imported at start"
            )
    return out


def skipped_for_size(results: dict, name: str, tree: str) -> bool:
    """Whether a smaller size of the same phases case ran past its limit on this tree."""
    if not name.startswith("phases"):
        return False
    n = int(name.split("n=")[1].split()[0])
    variant = name.endswith(" full")
    for other, by_tree in results.items():
        if not other.startswith("phases") or other.endswith(" full") != variant:
            continue
        m = int(other.split("n=")[1].split()[0])
        if m < n and by_tree[tree].get("stopped"):
            return True
    return False


if __name__ == "__main__":
    run_main(main)
