#!/usr/bin/env python3
"""Say which earlier patches each patch of the series builds on, line by line.

For every hunk of a patch, `git blame` of the track's checkout names the earlier patches
that last changed the lines the hunk changes, or the line beside it (a three-way merge
conflicts on adjacent changes too). A PR unit stands on the tag, or on one base unit, only
if its own patches build on nothing outside them: for each unit (all, or those named) this
prints what its own patches build on, grouped by the smallest unit that carries it, with
the files and hunks: more than one unit there, or a unit that stands on another, is what
keeps it from standing on one base. Test-file hunks are counted apart: make pr's merge
driver applies a patch's appended tests without the earlier ones. Blame sees lines, not
imports or behaviour: make pr's before/after runs check those. A unit over the review limits needs each of
those lines moved, or the patch split, before it can stand on one base (issue 33).
Each unit's last line follows its code hunks (docs-table rows and tests left out) down to
the tag: how deep a stack of units that code needs, and how many lines it rests on.
Glue (pr-units.toml's `glue`) is in no unit: a hunk beside lines a glue patch set aside or
brought back is reported "on the glue" and not followed (a unit beside the lines glue
brings back stands on the units it combines, which its base must carry with the glue:
make pr's limits flag that).

Usage: patch_deps.py [UNIT ...]   (VLLM_VERSION selects the track)
"""

import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lib import (
    UserError,
    checkout_dir,
    git,
    load_pin,
    rel,
    run_main,
    say,
    series_dir,
    vllm_version,
)
from make_pr import builds_on, load_glue, load_units, make_command, review_limits, select

HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", re.M)


def series_commits(checkout: Path, tag: str, patches: list[Path]) -> list[str]:
    """The checkout's commits of the series, oldest first, checked against the patches."""
    commits = git("rev-list", "--reverse", f"{tag}..HEAD", cwd=checkout).split()
    subjects = git("log", "--reverse", "--format=%s", f"{tag}..HEAD", cwd=checkout).splitlines()
    if len(commits) != len(patches):
        raise UserError(f"{rel(checkout)} has {len(commits)} commits on {tag}, the series "
                        f"{len(patches)}: run `{make_command('checkout', vllm_version())}` "
                        "to rebuild it from the series")
    for patch, subject in zip(patches, subjects):
        head = patch.read_text(errors="replace").partition("\n\n")[0]
        if re.sub(r"\s+", " ", subject) not in re.sub(r"\s+", " ", head):
            raise UserError(f"{rel(checkout)}'s commit '{subject}' is not {patch.name}: run "
                            f"`{make_command('checkout', vllm_version())}` to rebuild it")
    return commits


def touched_lines(diff: str) -> dict[str, list[tuple[int, int, tuple[int, ...]]]]:
    """Per pre-image file, the line ranges (1-based, inclusive) each hunk changes or sits
    beside, each with the lines it sits beside. New files have none."""
    ranges: dict[str, list[tuple[int, int, tuple[int, ...]]]] = defaultdict(list)
    for part in re.split(r"^diff --git ", diff, flags=re.M)[1:]:
        m = re.search(r"^--- (?:a/(.*)|/dev/null)$", part, re.M)
        if m is None or m.group(1) is None:
            continue
        for h in HUNK.finditer(part):
            start, count = int(h.group(1)), int(h.group(2) or 1)
            # an insertion after line `start` (count 0) touches it and the next one
            first, last = (start, start + 1) if count == 0 else (start - 1, start + count)
            beside = (first, last) if count == 0 else (start - 1, start + count)
            ranges[m.group(1)].append((max(first, 1), last, beside))
    return ranges


# A line of brackets alone (or a blank one) beside a hunk is anyone's: blame's diff picks one
# of several equal lines, and a patch that sits beside it applies wherever the brackets are
# the same. A hunk that changes such a line still depends on whoever wrote it.
GENERIC_LINE = re.compile(r"^[\s(){}\[\];,]*$")


def blame(checkout: Path, tag: str, rev: str, path: str) -> list[tuple[str, bool]]:
    """Per line of `path` at `rev`: the commit that last changed it ('' for the tag's lines)
    and whether it is generic (GENERIC_LINE)."""
    if git("rev-parse", f"{rev}^{{commit}}", cwd=checkout) == git(
            "rev-parse", f"{tag}^{{commit}}", cwd=checkout):
        return []  # blame of an empty range would blame HEAD
    out = git("blame", "-l", "-s", f"{tag}..{rev}", "--", path, cwd=checkout, strip=False)
    owners = []
    for ln in out.splitlines():
        commit, _, rest = ln.partition(" ")
        text = rest.split(") ", 1)[1] if ") " in rest else ""
        owners.append(("" if ln.startswith("^") else commit,
                       GENERIC_LINE.match(text) is not None))
    return owners


def dependencies(checkout: Path, tag: str, commits: list[str]) -> list[Counter]:
    """For each commit, Counter((earlier commit index, file)) of the hunks that build on it."""
    index = {c: i for i, c in enumerate(commits)}
    deps = []
    for c in commits:
        found: Counter = Counter()
        diff = git("diff", "-U0", "--no-renames", f"{c}^", c, cwd=checkout)
        for path, ranges in touched_lines(diff).items():
            owners = blame(checkout, tag, f"{c}^", path)
            for first, last, beside in ranges:
                hit = {index[o] for n, (o, generic) in enumerate(owners[first - 1:last], first)
                       if o in index and not (generic and n in beside)}
                found.update((i, path) for i in hit)
        deps.append(found)
    return deps


def is_test(where: str) -> bool:
    """Whether a dependency ("<patch> <path>") is in a test file: make pr's merge driver
    (merge_test_appends.py) applies a test file's appends without the earlier tests."""
    return "/test_" in where.split(" ", 1)[1]


def is_docs(where: str) -> bool:
    """Whether a dependency ("<patch> <path>") is a docs-table row: one can move."""
    return where.split(" ", 1)[1].startswith("docs/")


def code_stacks(needs: dict[str, set[str]]) -> dict[str, tuple[int, set[str]]]:
    """Per unit, from the units its own code hunks build on: how deep the stack under it
    goes (1: the tag alone) and every unit that stack holds."""
    out: dict[str, tuple[int, set[str]]] = {}

    def walk(name: str) -> tuple[int, set[str]]:
        if name not in out:
            out[name] = (1, set())  # a cycle (none in an ordered series) stops here
            depth, under = 1, set()
            for dep in needs.get(name, ()):
                d, below = walk(dep)
                depth, under = max(depth, d + 1), under | below | {dep}
            out[name] = (depth, under)
        return out[name]

    for name in needs:
        walk(name)
    return out


def main() -> None:
    version = vllm_version()
    tag = load_pin(version)["tag"]
    checkout = checkout_dir(version)
    if not (checkout / ".git").exists():
        raise UserError(f"no checkout at {rel(checkout)}: run "
                        f"`{make_command('checkout', version)}` first")
    all_units = load_units(version)
    glue = load_glue(version)
    units = select(all_units, sys.argv[1:])
    patches = sorted(series_dir(version).glob("[0-9]*.patch"))
    commits = series_commits(checkout, tag, patches)
    deps = dependencies(checkout, tag, commits)
    number = {i: p.name[:4] for i, p in enumerate(patches)}
    position = {p: i for i, p in enumerate(patches)}
    # the smallest unit carrying each patch names where a dependency lives (the glue is
    # in no unit: the units it combines are those it builds on)
    home = {}
    for u in sorted(all_units, key=lambda u: len(u.patches), reverse=True):
        for p in u.patches:
            if p not in glue:
                home[p] = u.name
    say(f"vLLM {version}: {len(patches)} patches, {len(units)} unit(s); a dependency is a "
        "hunk of a unit's own patch beside lines an earlier patch outside its base changed")
    report, code_needs, sizes = {}, {}, {}
    for u in all_units:
        sizes[u.name], why = review_limits(u, all_units, glue)
        bases = builds_on(u, all_units)[0]
        base_patches = {p for b in all_units if b.name in bases for p in b.patches}
        own = [p for p in u.patches if p not in base_patches]
        needs: dict[str, Counter] = defaultdict(Counter)
        for p in own:
            for (j, path), n in deps[position[p]].items():
                if patches[j] not in own:
                    where = "the glue" if patches[j] in glue else "no unit"
                    needs[home.get(patches[j], where)][f"{number[j]} {path}"] += n
        code_needs[u.name] = {name for name, counts in needs.items()
                              if name not in ("no unit", "the glue")
                              and any(not is_test(k) and not is_docs(k) for k in counts)}
        report[u.name] = (own, bases, why, needs)
    stacks = code_stacks(code_needs)
    for u in units:
        own, bases, why, needs = report[u.name]
        lines = sizes[u.name]
        print(f"\n{u.name}: {lines} own lines in {', '.join(p.name[:4] for p in own)}"
              f"{' on ' + ', '.join(bases) if bases else ''}; "
              f"{'OVER the limits' if why else 'fits'}")
        if not needs:
            print("  builds on the tag alone")
        for name, counts in sorted(needs.items(), key=lambda kv: -sum(kv[1].values())):
            code = {k: n for k, n in counts.items() if not is_test(k)}
            tests = sum(n for k, n in counts.items() if is_test(k))
            detail = ", ".join(f"{k} ({n})" for k, n in sorted(code.items()))
            print(f"  on {name}: {sum(code.values())} code hunk(s)"
                  f"{': ' + detail if detail else ''}; {tests} test hunk(s)")
        depth, under = stacks[u.name]
        print(f"  its code: a stack of {depth} unit(s) down to the tag, on "
              f"{sum(sizes[n] for n in under)} lines of {len(under)} unit(s)"
              f"{' (the limits: a stack of 2, on at most 600 lines)' if depth > 2 else ''}")

if __name__ == "__main__":
    run_main(main)
