#!/usr/bin/env python3
"""Materialize build/vllm: pristine sdist as a tagged commit, then our series, one commit per patch.

Idempotent: when the checkout already holds exactly patches/ on the pristine tag, nothing changes.
Never destroys local work: uncommitted edits or commits not exported to patches/ stop it
(FORCE=1 discards them).
"""

import hashlib
import os
import re
import shutil
import tarfile
from pathlib import Path

from _lib import (
    PATCHES, UserError, Timer, checkout_dir, git, load_pin, run_main, say,
)
from fetch import fetch

STATE = "hma-series"  # .git/hma-series: sha256 of the applied series and the HEAD it produced


def series() -> list[Path]:
    return sorted(PATCHES.glob("*.patch"))


def series_digest(patches: list[Path]) -> str:
    h = hashlib.sha256()
    for p in patches:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def create_pristine(pin: dict, repo: Path) -> None:
    sdist = fetch(pin, "sdist")
    say(f"unpacking {sdist.name} into {repo}")
    tmp = repo.with_name(repo.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tf:
        top = f"vllm-{pin['version']}/"
        members = []
        for m in tf.getmembers():
            if not m.name.startswith(top):
                continue
            m.name = m.name[len(top):]
            if m.name:
                members.append(m)
        tf.extractall(tmp, members=members, filter="data")
    git("init", "-q", "-b", "main", cwd=tmp)
    # Commits made in the checkout (yours, or `git am`'s) carry the project identity
    # unless you set your own there: the DCO Signed-off-by is what names the author.
    git("config", "user.name", "vllm-hma-tiering", cwd=tmp)
    git("config", "user.email", "vllm-hma-tiering@localhost", cwd=tmp)
    (tmp / ".git" / "info" / "exclude").write_text("__pycache__/\n*.pyc\n.pytest_cache/\n")
    git("add", "-A", "-f", cwd=tmp)
    git("commit", "-q", "-m", f"vLLM {pin['version']} (pristine sdist {sdist.name})",
        "--date", "2026-01-01T00:00:00+00:00", cwd=tmp)
    git("tag", pin["tag"], cwd=tmp)
    os.replace(tmp, repo)


def check_no_local_work(repo: Path, tag: str) -> None:
    if os.environ.get("FORCE") == "1":
        return
    dirty = git("status", "--porcelain", cwd=repo)
    if dirty:
        files = ", ".join(line[3:] for line in dirty.splitlines()[:5])
        raise UserError(
            f"{repo} has uncommitted edits ({files}). Keep them: commit them there "
            f"(git -C {repo} commit -a) and run `make patches`; or discard them: "
            "`make apply FORCE=1`"
        )
    state = repo / ".git" / STATE
    applied_head = state.read_text().split()[1] if state.exists() else git("rev-parse", tag, cwd=repo)
    head = git("rev-parse", "HEAD", cwd=repo)
    if head != applied_head:
        ahead = git("rev-list", "--count", f"{applied_head}..HEAD", cwd=repo, check=False) or "?"
        raise UserError(
            f"{repo} has commits that are not in patches/ (HEAD {head[:12]}, {ahead} commit(s) "
            f"past the applied series). Keep them: `make patches`; or discard them: "
            "`make apply FORCE=1`"
        )


def head(repo: Path) -> str:
    return git("rev-parse", "HEAD", cwd=repo)


def conflicting_files(output: str) -> list[str]:
    files = re.findall(r"(?:patch failed|does not exist in index|already exists in index): ([^:\n]+)", output)
    return sorted(set(files))


def apply_series(repo: Path, tag: str, patches: list[Path]) -> None:
    git("reset", "-q", "--hard", tag, cwd=repo)
    git("clean", "-q", "-fdx", "-e", "__pycache__", cwd=repo)
    failed: list[str] = []
    for p in patches:
        say(f"applying {p.name}")
        # --keep-non-patch: strip only "[PATCH n/m]", keep "[KV Offloading]" in subjects,
        # so that `make patches` exports the series byte for byte.
        out = git("am", "-q", "--3way", "--keep-non-patch", "--committer-date-is-author-date", str(p),
                  cwd=repo, check=False)
        if (repo / ".git" / "rebase-apply").exists():  # git am stopped on this patch
            unmerged = git("diff", "--name-only", "--diff-filter=U", cwd=repo, check=False)
            am_out = git("am", "--show-current-patch=diff", cwd=repo, check=False)
            files = unmerged.split() or conflicting_files(out + am_out)
            if not files:
                files = sorted(set(re.findall(r"^\+\+\+ b/(\S+)", am_out, re.M)))
            git("am", "--abort", cwd=repo, check=False)
            say(f"  does not apply: {', '.join(files)}")
            failed.append(f"{p.name} (conflicting files: {', '.join(files)})")
    if failed:
        # Report every patch, then leave the pristine tag rather than a half-applied series.
        git("reset", "-q", "--hard", tag, cwd=repo)
        raise UserError(
            f"{len(failed)} of {len(patches)} patch(es) do not apply on {tag}: "
            + "; ".join(failed)
            + f". The checkout was left at the pristine tag {tag}; port each patch there, "
            "commit, and run `make patches`"
        )


def main() -> None:
    pin = load_pin()
    repo = checkout_dir(pin["version"])
    tag = pin["tag"]
    patches = series()
    digest = series_digest(patches)
    with Timer() as t:
        if not (repo / ".git").exists():
            create_pristine(pin, repo)
        state = repo / ".git" / STATE
        if state.exists() and state.read_text().split() == [digest, head(repo)] and not git(
            "status", "--porcelain", cwd=repo
        ):
            say(f"{repo.name}: {len(patches)} patch(es) on {tag}, already applied")
            return
        check_no_local_work(repo, tag)
        apply_series(repo, tag, patches)
        state.write_text(f"{digest} {git('rev-parse', 'HEAD', cwd=repo)}\n")
    say(f"{repo.name}: {len(patches)} patch(es) applied on {tag} in {t.elapsed:.1f} s")


if __name__ == "__main__":
    run_main(main)
