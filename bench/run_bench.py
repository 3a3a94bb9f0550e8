#!/usr/bin/env python3
"""make bench: the scheduler side (patched vs pristine), the disk tier, the HMA cost, the
fs tier's max_bytes budget (with vs without, patched side; the unreachable share of its kept
bytes vs a per-key LRU), the useful bytes per layout,
each against its reference in the same run; writes bench/results/<date>-<host>.md + .png.

BENCH_QUICK=1: a smoke run of about a minute (fewer rounds, smaller sizes).
BENCH_TAG=T: the results' file names end in -T (a run that must not replace the day's results).
"""

import os
import subprocess
import sys
import time
from pathlib import Path

from common import QUICK, TMP, VENV_PY, BenchError, check_venv, run_main, say, vllm_env

HERE = Path(__file__).resolve().parent
VENV_UPSTREAM_PY = HERE.parent / ".venv-0.34.0" / "bin" / "python"
E2E_SKIPPED = (
    "skipped: a cold-restart time-to-first-token comparison needs at least three engine starts "
    "(store, cold restart loading from disk, recompute without the connector) at 1-3 minutes "
    "each on this 2-core CPU, beyond the few minutes `make bench` has; and with the tiny "
    "random-weight models the CPU prefill is so cheap that loading from disk cannot show a "
    "meaningful gain here. That comparison belongs to GPU runners with real models "
    "(`make bench-gpu`)."
)


def step(script: str, *args: str, python: Path = VENV_PY) -> None:
    t0 = time.monotonic()
    # the disk sections import the patched side (BENCH_PATCHED_SITE, else .venv as is)
    env = vllm_env(pristine=False)
    if python != VENV_PY:
        env.pop("PYTHONPATH", None)  # BENCH_PATCHED_SITE is the default track's
    rc = subprocess.call([str(python), str(HERE / script), *args], cwd=HERE.parent, env=env)
    if rc != 0:
        raise BenchError(f"bench/{script} failed (exit status {rc}); see its message above")
    say(f"{script}: {time.monotonic() - t0:.0f} s")


def main() -> int:
    check_venv()
    t0 = time.monotonic()
    TMP.mkdir(parents=True, exist_ok=True)
    for old in (
        "sched.json",
        "disk.json",
        "disk-upstream.json",
        "budget.json",
        "reach.json",
        "layout.json",
        "shared-root.json",
    ):
        (TMP / old).unlink(missing_ok=True)
    say(
        f"make bench{' (BENCH_QUICK=1: smoke run)' if QUICK else ''}: scheduler side, "
        "disk tier, HMA cost; figures are ratios against references measured in this run"
    )
    step("sched_bench.py")
    step("disk_bench.py")
    if VENV_UPSTREAM_PY.exists():  # the 0.34.0 track's tier, where that track is built
        step(
            "disk_bench.py",
            "--sections",
            "rows,integrity",
            "--out",
            str(TMP / "disk-upstream.json"),
            python=VENV_UPSTREAM_PY,
        )
    else:
        say(
            f"disk tier of the 0.34.0 track: skipped, {VENV_UPSTREAM_PY} is not built "
            "(VLLM_VERSION=0.34.0 make apply builds it)"
        )
    step("budget_bench.py")
    step("budget_reach.py")
    step("layout_bytes.py")
    step("shared_root.py")
    say("end to end on the CPU engine: " + E2E_SKIPPED)
    tag = ["--tag", os.environ["BENCH_TAG"]] if os.environ.get("BENCH_TAG") else []
    step("report.py", "--e2e", E2E_SKIPPED, "--total-s", f"{time.monotonic() - t0:.0f}", *tag)
    say(f"make bench done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    run_main(main)
