#!/usr/bin/env python3
"""Export the commits on top of the pristine tag in the selected track's checkout
(build/vllm, or build/vllm-<version> for VLLM_VERSION) to patches/<version>/, then regenerate
vllm_overlay/<version>/ and bring that track's venv up to date. The series is the source of
truth; the overlay is its generated view. Another release's folders are never written.

Usage: export_patches.py [--out DIR]
  --out DIR  write the series to DIR only (the series, overlay and venv stay untouched)

Refuses, without touching anything, to write an empty series (no commit past the tag).
"""

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from _lib import (
    OVERLAY, PATCHES, ROOT, VENV, UserError, borrowed_series, checkout_dir, git, load_pin, rel,
    run_main, say,
)
from apply import STATE, series, series_digest

# --zero-commit and --no-signature keep the files byte-stable across exports; the round trip
# (apply.AM_ARGS, then these) gives back the same bytes (tests/test_series.py).
FORMAT_PATCH_ARGS = ("format-patch", "-q", "--zero-commit", "--no-signature", "--full-index")


def format_patch(repo: Path, tag: str, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    git(*FORMAT_PATCH_ARGS, "-o", str(out), f"{tag}..HEAD", cwd=repo)
    return sorted(out.glob("*.patch"))


def check_exportable(repo: Path, tag: str) -> int:
    if git("status", "--porcelain", cwd=repo):
        say(f"warning: {repo} has uncommitted edits; only commits are exported "
            "(commit them, one commit per concern, and run `make patches` again)")
    n = int(git("rev-list", "--count", f"{tag}..HEAD", cwd=repo))
    if n == 0:
        raise UserError(
            f"{repo} has no commit past {tag}: exporting would delete the whole series. "
            f"Nothing was written; `make apply` rebuilds the checkout from {rel(PATCHES)}/")
    return n


def export_series(repo: Path, tag: str) -> None:
    # Into a scratch folder first: patches/ is replaced only by a complete export.
    with tempfile.TemporaryDirectory(dir=ROOT / "build") as tmp:
        new = format_patch(repo, tag, Path(tmp))
        old = {p.name: p.read_bytes() for p in PATCHES.glob("*.patch")}
        for p in PATCHES.glob("*.patch"):
            p.unlink()
        if not PATCHES.is_dir():
            say(f"starting the series of this release: {rel(PATCHES)}/")
        PATCHES.mkdir(parents=True, exist_ok=True)
        for p in new:
            shutil.move(p, PATCHES / p.name)
    changed = [p.name for p in series() if old.get(p.name) != p.read_bytes()]
    gone = sorted(old.keys() - {p.name for p in series()})
    say(f"exported {len(series())} patch(es) to {rel(PATCHES)}/: "
        + (", ".join(changed) + " changed" if changed else "none changed")
        + (f"; removed {', '.join(gone)}" if gone else ""))
    head = git("rev-parse", "HEAD", cwd=repo)
    (repo / ".git" / STATE).write_text(f"{series_digest(series())} {head}\n")


def export_overlay(repo: Path, tag: str) -> None:
    changed = git("diff", "--name-only", "--no-renames", "--diff-filter=AM", tag, "HEAD", cwd=repo).split()
    deleted = git("diff", "--name-only", "--diff-filter=D", tag, "HEAD", cwd=repo).split()
    if deleted:
        raise UserError(f"the series deletes {', '.join(deleted)}; the overlay cannot express deletions")
    shutil.rmtree(OVERLAY, ignore_errors=True)
    for path in changed:
        dest = OVERLAY / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(git_blob(repo, f"HEAD:{path}"))
    say(f"regenerated {rel(OVERLAY)}/ ({len(changed)} file(s))")


def git_blob(repo: Path, rev: str) -> bytes:
    return subprocess.run(["git", "show", rev], cwd=repo, check=True, stdout=subprocess.PIPE).stdout


def update_venv() -> None:
    """`make test` checks that .venv holds the patched files: bring it up to date now."""
    if not (VENV / "bin" / "python").exists():
        say(f"no {rel(VENV)} yet: `make apply` builds it with this series")
        return
    from make_env import install_series

    install_series()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the series here only")
    opts = ap.parse_args()
    pin = load_pin()
    other = borrowed_series()
    if other and opts.out is None:
        raise UserError(
            f"vLLM {pin['version']} applies the {other} series ({pin['pin_file'].name}: "
            f"series = \"{other}\"), so `make patches` here would overwrite {rel(PATCHES)}/ "
            f"with commits made on {pin['tag']}. Nothing was written. Change the series on "
            f"its own track (build/vllm-{other}, `VLLM_VERSION={other} make patches`), or "
            f"export these commits elsewhere: `scripts/export_patches.py --out DIR`")
    repo = checkout_dir(pin["version"])
    if not (repo / ".git").exists():
        raise UserError(f"no checkout at {repo}; run `make apply` first")
    n = check_exportable(repo, pin["tag"])
    if opts.out is not None:
        for p in opts.out.glob("*.patch"):
            p.unlink()
        written = format_patch(repo, pin["tag"], opts.out)
        say(f"exported {len(written)} patch(es) of {repo.name} to {opts.out}")
        return
    say(f"exporting {n} commit(s) of {repo.name} past {pin['tag']}")
    export_series(repo, pin["tag"])
    export_overlay(repo, pin["tag"])
    update_venv()
    say("next: `make test` (or `make test GROUP=regression`)")


if __name__ == "__main__":
    run_main(main)
