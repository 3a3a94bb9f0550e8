#!/usr/bin/env python3
"""git merge driver for test files on a PR branch (make_pr.py configures it in its clone).

A unit of the series is applied on the pristine tag without the series' earlier patches.
Those append their own tests to the same test files, so a later patch's test hunk carries
their tests as context, and a three-way merge conflicts: base (the patch's pre-image) has the
earlier tests, ours (the branch) does not, theirs adds the unit's tests after them. The right
result keeps ours and adds what the patch itself adds - not the earlier tests (union would
keep them, and they would fail on a branch without their fixes). Each conflict is resolved
that way; if a conflict remains unclear (the patch changes a line ours lacks), it exits 1
and git reports the conflict as usual.

Usage (git): merge_test_appends.py %O %A %B   (base, ours - rewritten in place - theirs)
"""

import difflib
import subprocess
import sys
from pathlib import Path


def added_by_patch(base: list[str], theirs: list[str]) -> list[str] | None:
    """Lines theirs adds to base; None if it also changes or removes lines of base."""
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, base, theirs, autojunk=False).get_opcodes():
        if op == "insert":
            out += theirs[j1:j2]
        elif op != "equal":
            return None
    return out


def resolve(text: str) -> str | None:
    """Resolve diff3 conflict blocks of `git merge-file --diff3 -p`; None if one is unclear."""
    lines, out, i = text.splitlines(keepends=True), [], 0
    while i < len(lines):
        if not lines[i].startswith("<<<<<<< "):
            out.append(lines[i])
            i += 1
            continue
        parts, cur, i = {"ours": [], "base": [], "theirs": []}, "ours", i + 1
        while not lines[i].startswith(">>>>>>> "):
            if lines[i].startswith("||||||| "):
                cur = "base"
            elif lines[i].startswith("=======") and cur == "base":
                cur = "theirs"
            else:
                parts[cur].append(lines[i])
            i += 1
        i += 1
        new = added_by_patch(parts["base"], parts["theirs"])
        if new is None:
            return None
        out += parts["ours"] + new
    return "".join(out)


def main() -> int:
    base, ours, theirs = sys.argv[1:4]
    r = subprocess.run(["git", "merge-file", "--diff3", "-p", ours, base, theirs],
                       capture_output=True, text=True)
    if r.returncode == 0:
        Path(ours).write_text(r.stdout)
        return 0
    merged = resolve(r.stdout)
    if merged is None:
        Path(ours).write_text(r.stdout)  # the conflict, as git would leave it
        return 1
    Path(ours).write_text(merged)
    return 0


if __name__ == "__main__":
    sys.exit(main())
