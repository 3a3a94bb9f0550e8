#!/usr/bin/env python3
"""Export the commits on top of the pristine tag in build/vllm to patches/, then regenerate
vllm_overlay/ from them. patches/ is the source of truth; the overlay is its generated view."""

import shutil

from _lib import OVERLAY, PATCHES, UserError, checkout_dir, git, load_pin, run_main, say
from apply import STATE, series, series_digest


def export_series(repo, tag: str) -> None:
    if git("status", "--porcelain", cwd=repo):
        say(f"warning: {repo} has uncommitted edits; only commits are exported "
            "(commit them, one commit per concern, and run `make patches` again)")
    for p in series():
        p.unlink()
    PATCHES.mkdir(exist_ok=True)
    # --zero-commit and --no-signature keep the files byte-stable across exports.
    git("format-patch", "-q", "--zero-commit", "--no-signature", "--full-index",
        "-o", str(PATCHES), f"{tag}..HEAD", cwd=repo)
    for p in series():
        say(f"exported {p.name}")
    head = git("rev-parse", "HEAD", cwd=repo)
    (repo / ".git" / STATE).write_text(f"{series_digest(series())} {head}\n")


def export_overlay(repo, tag: str) -> None:
    changed = git("diff", "--name-only", "--no-renames", "--diff-filter=AM", tag, "HEAD", cwd=repo).split()
    deleted = git("diff", "--name-only", "--diff-filter=D", tag, "HEAD", cwd=repo).split()
    if deleted:
        raise UserError(f"the series deletes {', '.join(deleted)}; the overlay cannot express deletions")
    shutil.rmtree(OVERLAY, ignore_errors=True)
    for path in changed:
        dest = OVERLAY / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(git_blob(repo, f"HEAD:{path}"))
    say(f"regenerated vllm_overlay/ ({len(changed)} file(s))")


def git_blob(repo, rev: str) -> bytes:
    import subprocess

    return subprocess.run(["git", "show", rev], cwd=repo, check=True, stdout=subprocess.PIPE).stdout


def main() -> None:
    pin = load_pin()
    repo = checkout_dir(pin["version"])
    if not (repo / ".git").exists():
        raise UserError(f"no checkout at {repo}; run `make apply` first")
    export_series(repo, pin["tag"])
    export_overlay(repo, pin["tag"])


if __name__ == "__main__":
    run_main(main)
