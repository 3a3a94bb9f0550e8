#!/usr/bin/env python3
"""Make .venv import the patched vLLM: copy the checkout's changed vllm/ files over the
installed wheel, and put back pristine files that the series no longer changes.

Source: the working tree of build/vllm (committed or not), compared with the pristine tag.
The installed file must equal the pristine sdist file before it is replaced: our patches are
written against the sdist, so a wheel that differs there would silently get the wrong code.
"""

import json
import os
from pathlib import Path

from _lib import VENV, UserError, checkout_dir, git, load_pin, run_main, say

MANIFEST = "hma-overlay.json"  # in .venv: the files this script replaced or added


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
    import subprocess

    r = subprocess.run(["git", "show", f"{tag}:{path}"], cwd=repo, capture_output=True)
    return r.stdout if r.returncode == 0 else None


def _replace(dest: Path, data: bytes) -> None:
    """Write a new file and rename it over dest: never write through dest, which may be
    a hard link shared with another tree (build/unpatched-site links to .venv's files)."""
    tmp = dest.with_name(dest.name + ".hma-tmp")
    tmp.write_bytes(data)
    os.replace(tmp, dest)


def sync(venv: Path = VENV) -> list[str]:
    pin = load_pin()
    repo = checkout_dir(pin["version"])
    tag = pin["tag"]
    sp = site_packages(venv)
    manifest_path = venv / MANIFEST
    previous = set(json.loads(manifest_path.read_text())) if manifest_path.exists() else set()
    current = changed_vllm_files(repo, tag)
    restored, installed = [], []
    for path in sorted(previous - set(current)):  # no longer patched: back to pristine
        blob = pristine_blob(repo, tag, path)
        dest = sp / path
        if blob is None:
            dest.unlink(missing_ok=True)
        else:
            _replace(dest, blob)
        restored.append(path)
    for path in current:
        dest = sp / path
        src = repo / path
        if path not in previous:
            blob = pristine_blob(repo, tag, path)
            current_bytes = dest.read_bytes() if dest.exists() else None
            if current_bytes != blob:
                raise UserError(
                    f"the installed {dest} differs from {path} in the pristine sdist "
                    f"({tag}); the patch was written against the sdist. Reinstall the "
                    "environment with `rm -rf .venv && make apply`"
                )
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not src.exists():
            dest.unlink(missing_ok=True)
            continue
        if not dest.exists() or dest.read_bytes() != src.read_bytes():
            _replace(dest, src.read_bytes())
            installed.append(path)
    if restored:
        say(f"restored {len(restored)} pristine file(s) the series no longer changes: "
            + ", ".join(Path(p).name for p in restored))
    if installed:
        say(f"installed {len(installed)} patched file(s) from {repo.name}: "
            + ", ".join(Path(p).name for p in installed))
    manifest_path.write_text(json.dumps(current, indent=1) + "\n")
    return current


def main() -> None:
    files = sync()
    say(f".venv imports the patched vLLM ({len(files)} file(s) from {checkout_dir().name})")


if __name__ == "__main__":
    run_main(main)
