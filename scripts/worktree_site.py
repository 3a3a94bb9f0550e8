#!/usr/bin/env python3
"""Build a site folder that imports vLLM as a checkout's work tree has it, uncommitted
edits included, without reinstalling the venv: the fast loop while writing a patch.

    PYTHONPATH=$(scripts/worktree_site.py build/vllm-0.34.0) .venv-0.34.0/bin/python -m pytest ...

The folder (build/worktree-site-<checkout name>) holds hard links to the track venv's
installed vllm package (its compiled parts included), except the vllm/ files the work tree
changes or adds against the pristine tag, or the venv's series patches (vllm_overlay/): those
are the work tree's, so a checkout of an earlier patch runs its own code, and the native modules
whose source the tree has (csrc/fs_io.cpp), compiled from it (cached in build/native/). `make patches` is still
what makes a change part of the series (and `make test` tests only that).

Usage: worktree_site.py [CHECKOUT]   (default: the selected track's checkout)
"""

import os
import shutil
import sys
from pathlib import Path

from _lib import BUILD, OVERLAY, ROOT, VENV, UserError, checkout_dir, load_pin, run_main
from _series import changed_vllm_files, site_packages
from make_wheel import place_native


def build(repo: Path) -> Path:
    pin = load_pin()
    if not (repo / ".git").exists():
        raise UserError(f"{repo} is not a git checkout; `make checkout` makes one")
    out = BUILD / f"worktree-site-{repo.name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copytree(site_packages() / "vllm", out / "vllm", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__"))
    # the venv holds the whole series: a file it patches that this tree has as the tag has it
    # (or not at all) is the tree's too
    patched = [str(f.relative_to(OVERLAY)) for f in (OVERLAY / "vllm").rglob("*") if f.is_file()]
    changed = sorted(set(changed_vllm_files(repo, pin["tag"])) | set(patched))
    for path in changed:
        dest = out / path
        dest.unlink(missing_ok=True)  # a hard link into the venv: never write through it
        if (repo / path).exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(repo / path, dest)
    # the tree's C sources, compiled (the venv's may differ)
    place_native(out, lambda src: (repo / src).read_bytes() if (repo / src).exists() else None)
    # stderr: stdout is the path alone, for PYTHONPATH=$(...)
    print(f"==> {out.relative_to(ROOT)}: {VENV.name}'s vllm with {len(changed)} file(s) of "
          f"{repo}", file=sys.stderr)
    return out


def main() -> None:
    repo = Path(sys.argv[1]).resolve() if sys.argv[1:] else checkout_dir()
    print(build(repo))


if __name__ == "__main__":
    run_main(main)
