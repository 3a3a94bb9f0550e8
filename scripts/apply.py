#!/usr/bin/env python3
"""Materialize build/vllm: pristine sdist as a tagged commit, then our series, one commit per patch.

Idempotent: when the checkout already holds exactly the series (patches/<version>/) on the
pristine tag, nothing changes. A release with no series of its own yet gets the default
track's series: the starting point of a port.
Never destroys local work: uncommitted edits or commits not exported to patches/ stop it
(FORCE=1 discards them).
"""

import hashlib
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

from _lib import (
    PATCHES, ROOT, SERIES_VERSION, UserError, Timer, borrowed_series, checkout_dir, git,
    git_env, load_pin, run_main, say, series_dir,
)
from fetch import fetch

STATE = "hma-series"  # .git/hma-series: sha256 of the applied series and the HEAD it produced


def series() -> list[Path]:
    """The selected track's series (none yet for a release being ported)."""
    return sorted(PATCHES.glob("*.patch"))


def series_to_apply() -> tuple[Path, list[Path]]:
    """The track's series; for a release with none yet, the default track's: the start of
    a port (it stops at the first patch upstream made unnecessary or incompatible)."""
    folder = PATCHES if PATCHES.is_dir() else series_dir(SERIES_VERSION)
    return folder, sorted(folder.glob("*.patch"))


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


# `git am` flags of the checkout. --keep-non-patch strips only "[PATCH n/m]" and keeps
# "[KV Offloading]" in subjects, so that `make patches` exports the series byte for byte
# (tests/test_series.py::test_round_trip checks it with these flags).
AM_ARGS = ("am", "-q", "--3way", "--keep-non-patch", "--committer-date-is-author-date")


def check_no_local_work(repo: Path, tag: str) -> None:
    if os.environ.get("FORCE") == "1":
        return
    # Not stripped: porcelain lines start with a status column that may be a space.
    dirty = [ln for ln in git("status", "--porcelain", cwd=repo, strip=False).splitlines() if ln]
    if dirty:
        files = ", ".join(line[3:] for line in dirty[:5]) + (", ..." if len(dirty) > 5 else "")
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
            f"{repo} has commits that are not in {PATCHES.relative_to(ROOT)}/ (HEAD {head[:12]}, {ahead} commit(s) "
            f"past the applied series). Keep them: `make patches`; or discard them: "
            "`make apply FORCE=1`"
        )


def head(repo: Path) -> str:
    return git("rev-parse", "HEAD", cwd=repo)


def conflicting_files(output: str) -> list[str]:
    """The files git names as not applying: hunks that fail, files missing or already
    there, 3-way merge conflicts. Files of the patch that applied are not among them."""
    pats = (r"error: patch failed: ([^:\n]+):\d+",
            r"error: ([^:\n]+): (?:does not exist in index|already exists in (?:index|working directory)|patch does not apply)",
            r"CONFLICT \([^)]*\): (?:Merge conflict in )?(\S+)")
    found: list[str] = []
    for pat in pats:
        found += re.findall(pat, output)
    return sorted(set(found))


def files_that_do_not_apply(repo: Path, patch: Path) -> list[str]:
    """Fallback when git's messages name no file: check the patch one file at a time."""
    touched = sorted(set(re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(errors="replace"), re.M)))
    return [f for f in touched
            if subprocess.run(["git", "apply", "--check", f"--include={f}", str(patch)],
                              cwd=repo, capture_output=True).returncode != 0]


def apply_series(repo: Path, tag: str, patches: list[Path]) -> None:
    """Apply the series one commit per patch. At the first patch that does not apply, stop,
    name the files that really conflict (one per line) and the later patches (not tried:
    they build on it), and leave the pristine tag rather than a half-applied series."""
    git("reset", "-q", "--hard", tag, cwd=repo)
    git("clean", "-q", "-fdx", "-e", "__pycache__", cwd=repo)
    for i, p in enumerate(patches):
        r = subprocess.run(["git", *AM_ARGS, str(p)], cwd=repo, env=git_env(),
                           capture_output=True, text=True)
        if r.returncode == 0 and not (repo / ".git" / "rebase-apply").exists():
            continue
        unmerged = git("diff", "--name-only", "--diff-filter=U", cwd=repo, check=False).split()
        files = unmerged or conflicting_files(r.stdout + r.stderr)
        git("am", "--abort", cwd=repo, check=False)
        git("reset", "-q", "--hard", tag, cwd=repo)
        git("clean", "-q", "-fdx", "-e", "__pycache__", cwd=repo)
        if not files:
            files = files_that_do_not_apply(repo, p) or ["(git named no file; see below)"]
        later = [q.name for q in patches[i + 1:]]
        msg = (f"{p.relative_to(ROOT)} (patch {i + 1} of {len(patches)}) does not apply on {tag}; "
               f"conflicting file(s):\n" + "".join(f"  {f}\n" for f in files))
        if later:
            msg += f"not tried (they build on it): {len(later)} patch(es), {later[0]} to {later[-1]}\n"
        if files[0].startswith("(git named"):
            msg += "git said:\n" + "".join(f"  {ln}\n" for ln in (r.stdout + r.stderr).splitlines()[:8])
        msg += f"The checkout {repo} was left at the pristine tag {tag}. "
        if borrowed_series():
            msg += (f"This release applies the {borrowed_series()} series as it is (its pin's "
                    "`series`); `make patches` does not write it from here. A port is a "
                    "series of its own: drop `series` from the pin, then port as below")
        msg += (f"To port the series: "
                f"`git -C {repo} am -3 --keep-non-patch {p}`, resolve, `git am --continue`, then "
                f"the next patches; export the port with "
                f"`make patches` (it writes {PATCHES.relative_to(ROOT)}/; no other series changes)")
        raise UserError(msg)


def main() -> None:
    pin = load_pin()
    repo = checkout_dir(pin["version"])
    tag = pin["tag"]
    folder, patches = series_to_apply()
    digest = series_digest(patches)
    with Timer() as t:
        if not (repo / ".git").exists():
            create_pristine(pin, repo)
        state = repo / ".git" / STATE
        if state.exists() and state.read_text().split() == [digest, head(repo)] and not git(
            "status", "--porcelain", cwd=repo
        ):
            say(f"{repo.relative_to(ROOT)}: {len(patches)} patch(es) on {tag}, already applied")
            return
        check_no_local_work(repo, tag)
        if folder != PATCHES:
            say(f"no series for vLLM {pin['version']} yet ({PATCHES.relative_to(ROOT)}/): "
                f"trying the {SERIES_VERSION} series on it")
        elif borrowed_series():
            say(f"vLLM {pin['version']} applies the {borrowed_series()} series "
                f"({pin['pin_file'].name}: series = \"{borrowed_series()}\")")
        say(f"applying {len(patches)} patch(es) from {folder.relative_to(ROOT)}/ on {tag}")
        apply_series(repo, tag, patches)
        state.write_text(f"{digest} {git('rev-parse', 'HEAD', cwd=repo)}\n")
    say(f"{repo.relative_to(ROOT)}: {len(patches)} patch(es) applied on {tag} in {t.elapsed:.1f} s")


if __name__ == "__main__":
    run_main(main)
