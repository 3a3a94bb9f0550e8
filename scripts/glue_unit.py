#!/usr/bin/env python3
"""Put a PR unit written on its base into the series, with glue around it.

A unit that changes lines other units of the series also change cannot stand on the tag as
the series has it. Written anew on its base (the tag, or its one base unit), it goes into the
series in place of the old patch, as three commits:

1. glue that sets aside what the unit's hunks change or sit beside: those lines go back to
   the base's text (a three-way merge of the series' file, the base's, and the base's with
   every line the unit's hunks cover marked: where the series changed a marked line or one
   beside it, the base's text wins); a file the unit creates that the series already has is
   set aside whole, and so is a file where the unit does not apply that way, or where its
   patch as the series exports it would not turn the base's file into the unit's (git diff
   aligns hunks on the series' lines);
2. the unit's commit as it is (`git am`): its PR branch has the same patch;
3. glue back to the old patch's tree, plus the unit's own files (those the series before it
   has as the base has them, and the old patch does not change): its test file.

The later commits then rebase unchanged onto the third. The final tree is the old one plus the
unit's own files. List the two glue patches in pr-units.toml's `glue` (`make patches` first).

Usage: glue_unit.py BASE UNIT OLD SET_ASIDE_MSG COMBINE_MSG
  BASE, UNIT: commits of the track's checkout (the unit's base and the unit on it); OLD: the
  series commit the unit replaces; *_MSG: files with the two glue commits' messages.
  VLLM_VERSION selects the track; the checkout's branch must be checked out and clean.
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _lib import UserError, checkout_dir, git, git_env, rel, run_main, say
from make_pr import git_show

MARK = b"@@glue-unit-covered@@"
MARKER_SIZE = 40  # merge-file's conflict markers: longer than any line of the series


def covered_lines(diff: str) -> set[int]:
    """Lines (1-based, of the pre-image) a unified diff's hunks cover, context included; an
    insertion covers the lines on both sides of it."""
    lines: set[int] = set()
    for m in re.finditer(r"^@@ -(\d+)(?:,(\d+))? ", diff, re.M):
        start, count = int(m.group(1)), int(m.group(2) or 1)
        lines |= {start, start + 1} if count == 0 else set(range(start, start + count))
    return lines


def set_aside(series: bytes, base: bytes, covered: set[int]) -> bytes:
    """*series* with the lines *covered* (of *base*) and what the series changed beside them
    back to *base*'s text."""
    base_lines = base.splitlines(keepends=True)
    marked = b"".join(ln.rstrip(b"\n") + MARK + b"\n" if i in covered else ln
                      for i, ln in enumerate(base_lines, 1))
    with tempfile.TemporaryDirectory() as d:
        paths = [os.path.join(d, n) for n in ("series", "base", "marked")]
        for path, data in zip(paths, (series, base, marked)):
            Path(path).write_bytes(data)
        r = subprocess.run(["git", "merge-file", "-p", "--diff3",
                            f"--marker-size={MARKER_SIZE}", *paths], capture_output=True)
    if r.returncode < 0 or r.returncode > 127:
        raise UserError(f"git merge-file failed: {r.stderr.decode(errors='replace').strip()}")
    out, side = [], None
    opens, bases, mids, closes = (c * MARKER_SIZE for c in (b"<", b"|", b"=", b">"))
    for ln in r.stdout.splitlines(keepends=True):
        if side is None and ln.startswith(opens + b" "):
            side = "series"
        elif side == "series" and ln.startswith(bases + b" "):
            side = "base"
        elif side == "base" and ln.rstrip(b"\n") == mids:
            side = "marked"
        elif side == "marked" and ln.startswith(closes + b" "):
            side = None
        elif side in (None, "base"):
            out.append(ln.replace(MARK, b""))
    return b"".join(out)


def tree_with(repo: Path, rev: str, files: dict[str, bytes | None]) -> str:
    """The tree of *rev* with *files* replaced (None: removed)."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, GIT_INDEX_FILE=os.path.join(d, "index"))
        subprocess.run(["git", "read-tree", rev], cwd=repo, env=env, check=True)
        for path, data in files.items():
            if data is None:
                subprocess.run(["git", "update-index", "--force-remove", "--", path],
                               cwd=repo, env=env, check=True)
                continue
            sha = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=repo, input=data,
                                 capture_output=True, check=True).stdout.decode().strip()
            mode = (git("ls-tree", rev, "--", path, cwd=repo).split() or ["100644"])[0]
            subprocess.run(["git", "update-index", "--add", "--cacheinfo",
                            f"{mode},{sha},{path}"], cwd=repo, env=env, check=True)
        return subprocess.run(["git", "write-tree"], cwd=repo, env=env, check=True,
                              capture_output=True, text=True).stdout.strip()


def commit(repo: Path, tree: str, parent: str, message: str, date: str) -> str:
    env = dict(git_env(), GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date)
    return subprocess.run(["git", "commit-tree", tree, "-p", parent], cwd=repo, env=env,
                          input=message, text=True, capture_output=True,
                          check=True).stdout.strip()


def drift(repo: Path, base: str, unit: str, old: str, own: set[str]) -> dict[str, list[str]]:
    """Per file the unit changes (but its own files, kept whole), the lines it adds that the
    old patch's tree lacks: what the combined glue drops (a fix the PR branch has and the
    series not)."""
    out = {}
    for path in git("diff", "--name-only", "--diff-filter=M", base, unit, cwd=repo).split():
        if path in own:
            continue
        have = {ln.strip() for ln in (git_show(repo, old, path) or b"").decode().splitlines()}
        added = [ln[1:].strip() for ln in git("diff", "-U0", base, unit, "--", path,
                                             cwd=repo).splitlines()
                 if ln.startswith("+") and not ln.startswith("+++")]
        lacking = [ln for ln in added if ln.strip("()[]{}:,;") and ln not in have]
        if lacking:
            out[path] = lacking
    return out


def place(repo: Path, base: str, unit: str, parent: str, aside: dict[str, bytes | None],
          aside_msg: str, date: str, branch: str) -> tuple[str, str]:
    """The set-aside glue on *parent*, and the unit applied on it (`git am`): both commits."""
    tree = tree_with(repo, parent, aside)
    first = parent if tree == git("rev-parse", f"{parent}^{{tree}}", cwd=repo) else commit(
        repo, tree, parent, Path(aside_msg).read_text(), date)  # nothing to set aside: none
    patch = git("format-patch", "-1", "--stdout", unit, cwd=repo, strip=False)
    git("checkout", "-q", "--detach", first, cwd=repo)
    r = subprocess.run(["git", "am", "-q", "--keep-non-patch", "--committer-date-is-author-date"],
                       cwd=repo, input=patch, text=True, capture_output=True, env=git_env())
    placed = git("rev-parse", "HEAD", cwd=repo)
    if r.returncode != 0:
        git("am", "--abort", cwd=repo, check=False)
    git("checkout", "-q", branch, cwd=repo)
    if r.returncode != 0:
        raise UserError(f"the unit does not apply after the set-aside glue ({r.stderr.strip()}): "
                        "is BASE the commit it was written on?")
    return first, placed


def misplaced(repo: Path, base: str, unit: str, first: str, placed: str) -> list[str]:
    """The unit's files that its patch as the series exports it (first..placed, whose context
    is the series' text) does not turn from BASE's into UNIT's: `git diff` may align the
    hunks on other lines than the unit's own diff does."""
    paths = git("diff", "--name-only", base, unit, cwd=repo).split()
    diff = git("diff", "--binary", first, placed, cwd=repo, strip=False)
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, GIT_INDEX_FILE=os.path.join(d, "index"))
        subprocess.run(["git", "read-tree", base], cwd=repo, env=env, check=True)
        r = subprocess.run(["git", "apply", "--cached"], cwd=repo, env=env, input=diff,
                           text=True, capture_output=True)
        if r.returncode != 0:
            return paths
        tree = subprocess.run(["git", "write-tree"], cwd=repo, env=env, check=True,
                              capture_output=True, text=True).stdout.strip()
    return [p for p in paths if git_show(repo, tree, p) != git_show(repo, unit, p)]


def main() -> None:
    if len(sys.argv) != 6:
        raise UserError("usage: glue_unit.py BASE UNIT OLD SET_ASIDE_MSG COMBINE_MSG "
                        "(see the script's docstring)")
    base, unit, old, aside_msg, combine_msg = sys.argv[1:]
    repo = checkout_dir()
    if git("status", "--porcelain", cwd=repo):
        raise UserError(f"{rel(repo)} has uncommitted changes: commit or stash them first")
    branch = git("symbolic-ref", "--short", "HEAD", cwd=repo)
    if git("rev-parse", f"{unit}^", cwd=repo) != git("rev-parse", base, cwd=repo):
        raise UserError(f"UNIT {unit} is not one commit on BASE {base}: squash the unit into "
                        "one commit on the commit it was written on")
    tip = git("rev-parse", branch, cwd=repo)
    parent = git("rev-parse", f"{old}^", cwd=repo)
    date = git("log", "-1", "--format=%ad", "--date=raw", old, cwd=repo)

    aside: dict[str, bytes | None] = {}
    for path in git("diff", "--name-only", "--diff-filter=M", base, unit, cwd=repo).split():
        series = git_show(repo, parent, path)
        if series is not None:
            diff = git("diff", "-U3", base, unit, "--", path, cwd=repo)
            aside[path] = set_aside(series, git_show(repo, base, path) or b"", covered_lines(diff))
    for path in git("diff", "--name-only", "--diff-filter=A", base, unit, cwd=repo).split():
        if git_show(repo, parent, path) is not None:
            aside[path] = None  # the unit creates it: set aside whole
    try:
        first, placed = place(repo, base, unit, parent, aside, aside_msg, date, branch)
        whole = misplaced(repo, base, unit, first, placed)
    except UserError:  # beside lines the series rewrote: only the base's whole files take it
        whole = git("diff", "--name-only", "--diff-filter=M", base, unit, cwd=repo).split()
    if whole:  # its diff there would not apply on BASE as the unit's: set those files aside whole
        say(f"set aside whole (the unit's hunks land elsewhere beside the series' lines): "
            f"{', '.join(whole)}")
        aside.update({path: git_show(repo, base, path) for path in whole})
        first, placed = place(repo, base, unit, parent, aside, aside_msg, date, branch)
        if misplaced(repo, base, unit, first, placed):
            raise UserError("the unit's patch in the series does not give the unit on BASE: "
                            "report this with the commits named")

    own = {}
    for path in git("diff", "--name-only", base, unit, cwd=repo).split():
        untouched = not git("diff", "--name-only", parent, old, "--", path, cwd=repo)
        if untouched and git_show(repo, parent, path) == git_show(repo, base, path):
            own[path] = git_show(repo, unit, path)
    back = commit(repo, tree_with(repo, old, own), placed, Path(combine_msg).read_text(), date)
    for path, lines in drift(repo, base, unit, old, set(own)).items():
        say(f"drift: {path} lacks {len(lines)} line(s) the unit adds, e.g. {lines[0]!r}: the "
            "combined glue keeps the series' text; carry what it lacks into the series")
    r = subprocess.run(["git", "rebase", "-q", "--committer-date-is-author-date", "--onto",
                        back, old, branch], cwd=repo, env=git_env(), capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise UserError(f"the commits after {old[:12]} do not rebase onto the glue "
                        f"({r.stderr.strip()[-300:]}): resolve and `git rebase --continue` in "
                        f"{rel(repo)}, or `git rebase --abort` (then {branch} is {tip[:12]})")
    changed = set(git("diff", "--name-only", tip, branch, cwd=repo).split())
    if not changed <= set(own):  # the old tree, plus the unit's files (if it lacked them)
        raise UserError(f"{branch}'s final tree differs from before in {sorted(changed)}, not "
                        f"only in the unit's own files {sorted(own)}: `git -C {rel(repo)} "
                        f"reset --hard {tip[:12]}` restores it")
    say(f"{branch}: {old[:12]} is now {first[:12]} (set aside, or its parent where nothing "
        f"was), {placed[:12]} (the unit), "
        f"{back[:12]} (combined); the unit's own files: {', '.join(sorted(own)) or 'none'}. "
        "Next: `make patches`, then list the two glue patches in pr-units.toml")


if __name__ == "__main__":
    run_main(main)
