"""make pr (scripts/make_pr.py): PR branches signed off by the person running it.

The tests run the real script with real git on a tiny fake track (a checkout with the tag
the pin names and two patches exported from it), so they take seconds, not a vLLM clone.
vLLM's hooks are replaced by one local hook of the fake checkout; it needs pre-commit (the
kit's build/pr/tools-venv when there, else installed from PyPI into the project copy).
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT

import make_pr as kit

V = "0.22.1"
DATE = "2026-01-01T00:00:00+00:00"
ME = ("Test Person", "test.person@example.com")
FAKE_HOOKS = """\
repos:
- repo: local
  hooks:
  - id: no-forbidden-word
    name: no FORBIDDEN word
    entry: bash -c '! grep -Hn FORBIDDEN "$@"' --
    language: system
    types: [python]
"""


# vLLM 0.34.0's .github/PULL_REQUEST_TEMPLATE.md (its sections, its checklist, its last line)
TEMPLATE_UPSTREAM = """\
<!-- markdownlint-disable -->

## Overview

<!-- Summarize the change in 1-2 lines. Link relevant issues and PRs. -->

## Claims

<!-- State the accomplishments in a few concrete bullets. -->

## Validation

<!-- Show evidence that the claims are met by this change, and steps to reproduce validations. -->

## Details

<!-- Explain motivation, design decisions, root cause, tradeoffs, and limitations concisely. -->

---

<details>
<summary> Pull Request Checklist </summary>

- [ ] I used vLLM's `/pr-checklist` skill. (Mandatory for agents, optional for humans).
- [ ] AI assistance was used during the creation of this PR.

- [ ] **Design Fit:** Minimizes impact on core components.
- [ ] **Testing and Validation:** Validates the change and ensures any added tests are meaningful.
- [ ] **Code Quality and Style:** Keeps code and comments clear and concise.
- [ ] **Pull Request Contents:** Includes a brief summary and relevant links.
</details>

**BEFORE SUBMITTING, PLEASE READ <https://docs.vllm.ai/en/latest/contributing>** (anything below)
"""
# vLLM 0.22.1's: other sections, another checklist
TEMPLATE_0_22 = """\
<!-- markdownlint-disable -->
PLEASE FILL IN THE PR DESCRIPTION HERE.

## Purpose

## Test Plan

## Test Result

---
<details>
<summary> Essential Elements of an Effective PR Description Checklist </summary>

- [ ] The purpose of the PR, such as "Fix some issue".
- [ ] The test plan, such as providing test command.
- [ ] The test results, such as pasting the results comparison before and after, or e2e results
- [ ] (Optional) The necessary documentation update.
</details>

**BEFORE SUBMITTING, PLEASE READ <https://docs.vllm.ai/en/latest/contributing>**
"""


def git(repo, *args, **kw):
    env = kw.pop("env", None)
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True,
                          env=env, **kw).stdout.strip()


def commit(repo, message):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(repo), "GIT_AUTHOR_DATE": DATE,
           "GIT_COMMITTER_DATE": DATE, "GIT_CONFIG_NOSYSTEM": "1"}
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=vllm-hma-tiering", "-c", "user.email=vllm-hma-tiering@localhost",
        "commit", "-q", "-m", message, env=env)


@pytest.fixture
def track(project_copy, tmp_path):
    """A project copy whose 0.22.1 track is tiny: build/vllm = tag + 3 commits, exported to
    patches/0.22.1/, and a pr-units.toml naming them."""
    repo = project_copy / "build" / "vllm"
    (repo / "vllm").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    (repo / "vllm" / "__init__.py").write_text("")
    (repo / "vllm" / "a.py").write_text("X = 1\n")
    (repo / "pyproject.toml").write_text("[project]\nname = 'vllm'\n")
    (repo / ".pre-commit-config.yaml").write_text(FAKE_HOOKS)
    (repo / ".github").mkdir()
    (repo / ".github" / "PULL_REQUEST_TEMPLATE.md").write_text(TEMPLATE_UPSTREAM)
    commit(repo, "vLLM (pristine)")
    git(repo, "tag", "v0.22.1")
    (repo / "vllm" / "a.py").write_text("X = 2\n")
    commit(repo, textwrap.dedent("""\
        [KV Offloading] Make X two

        X was one, so every HMA model was refused (measured: 5 of 5).

        Set X to two.

        Upstream status: fixed upstream in #12345 (released in 0.23.0). This
        patch can be dropped when rebasing onto vLLM >= 0.23.0; keep its test.
        """))
    (repo / "vllm" / "b.py").write_text("Y = 3\n")
    commit(repo, "[KV Offloading] Add Y\n\nY was missing.\n\nTests only. Upstream status: "
                 "not upstream. Drop this patch when upstream adds Y.\n")
    (repo / "vllm" / "c.py").write_text("Z = 'FORBIDDEN'\n")
    commit(repo, "[Core] Add Z\n\nZ was missing.\n\nUpstream status: none. Keep it.\n")
    series = project_copy / "patches" / V
    for p in series.glob("*.patch"):
        p.unlink()
    git(repo, "format-patch", "-q", "--zero-commit", "--no-signature", "--full-index",
        "-o", str(series), "v0.22.1..HEAD")
    (series / "pr-units.toml").write_text(textwrap.dedent("""\
        [[unit]]
        name = "x-and-y"
        title = "[KV Offloading] Make X two and add Y"
        patches = ["0001", "0002-KV-Offloading-Add-Y.patch"]
        threads = ["vllm-project/vllm#12345"]
        layouts = ["one group"]

        [[unit]]
        name = "z"
        title = "[Core] Add Z"
        patches = ["3"]
        """))
    gitconfig = tmp_path / "gitconfig"
    gitconfig.write_text(f"[user]\n\tname = {ME[0]}\n\temail = {ME[1]}\n")
    return project_copy


def make_pr(project: Path, *args, gitconfig: Path | None = None, **env):
    tools = ROOT / "build" / "pr" / "tools-venv"
    # the caller's git identity and settings stay out: only the test's global config counts
    full = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "VLLM_"))}
    full.update(VLLM_VERSION=V, GIT_CONFIG_GLOBAL=str(gitconfig or project.parent / "gitconfig"),
                **env)
    if (tools / "bin" / "pre-commit").exists():
        full.setdefault("HMA_PR_TOOLS_VENV", str(tools))
    return subprocess.run([sys.executable, str(project / "scripts" / "make_pr.py"), *args],
                          cwd=project, env=full, capture_output=True, text=True)


def test_unset_or_placeholder_identity_is_refused(track, tmp_path):
    empty = tmp_path / "empty-gitconfig"
    empty.write_text("")
    r = make_pr(track, "--no-hooks", gitconfig=empty)
    assert r.returncode == 2
    assert "git has no user.name and user.email" in r.stderr
    assert "git config --global user.name" in r.stderr

    r = make_pr(track, "--no-hooks", GIT_AUTHOR_NAME="vllm-hma-tiering",
                GIT_AUTHOR_EMAIL="vllm-hma-tiering@localhost")
    assert r.returncode == 2 and "the project's placeholder" in r.stderr
    r = make_pr(track, "--no-hooks", GIT_AUTHOR_EMAIL="me@localhost")
    assert r.returncode == 2 and "the project's placeholder" in r.stderr
    assert not (track / "build" / "pr").exists()  # refused before anything was made


def test_unknown_patch_is_refused(track):
    units = track / "patches" / V / "pr-units.toml"
    units.write_text(units.read_text().replace('patches = ["3"]', 'patches = ["3", "0099"]'))
    r = make_pr(track, "--no-hooks")
    assert r.returncode == 2
    assert (f"unit 'z' of patches/{V}/pr-units.toml names patch '0099', which is not in "
            f"patches/{V}/") in r.stderr
    units.write_text('[[unit]]\nname = "z"\ntitle = "Add Z"\npatches = ["3"]\n')
    r = make_pr(track, "--no-hooks")
    assert r.returncode == 2 and "vLLM's convention" in r.stderr


def test_unit_branch_is_signed_off_by_the_user_and_rebuilds_identically(track):
    checkout = track / "build" / "vllm"
    checkout_head = git(checkout, "rev-parse", "HEAD")
    r = make_pr(track, "--no-hooks", "x-and-y")
    assert r.returncode == 0, r.stderr
    repo = track / "build" / "pr" / V / "repo"
    branch = "pr/x-and-y"
    commits = git(repo, "rev-list", "--reverse", f"v0.22.1..{branch}").split()
    assert len(commits) == 2
    for c in commits:
        who = git(repo, "log", "-1", "--format=%an <%ae>|%cn <%ce>", c)
        assert who == f"{ME[0]} <{ME[1]}>|{ME[0]} <{ME[1]}>"
        msg = git(repo, "log", "-1", "--format=%B", c)
        assert msg.splitlines()[-1] == f"Signed-off-by: {ME[0]} <{ME[1]}>"
        assert len(re.findall("^Signed-off-by:", msg, re.M)) == 1
        assert "Upstream status:" not in msg
        assert not re.search(r"can be dropped|Drop this patch|keep its test", msg)
    first = git(repo, "log", "-1", "--format=%B", commits[0])
    assert first.startswith("[KV Offloading] Make X two\n\nX was one, so every HMA model was "
                            "refused (measured: 5 of 5).\n\nSet X to two.\n\nSigned-off-by:")
    assert "Y was missing.\n\nTests only.\n\nSigned-off-by" in git(
        repo, "log", "-1", "--format=%B", commits[1])
    # the tree is the series' tree; the checkout was only read
    assert git(repo, "rev-parse", f"{branch}^{{tree}}") == git(checkout, "rev-parse", "HEAD~1^{tree}")
    assert git(checkout, "rev-parse", "HEAD") == checkout_head
    assert git(checkout, "status", "--porcelain") == ""
    assert "pr/" not in git(checkout, "branch", "--list")
    out = track / "build" / "pr" / V / "x-and-y"
    pr_md = (out / "PR.md").read_text()
    assert pr_md.startswith("# [KV Offloading] Make X two and add Y\n")
    assert "vllm-project/vllm#12345" in pr_md
    assert "git rebase upstream/main pr/x-and-y" in (out / "PUSH.md").read_text()
    patches = sorted(p.name for p in (out / "patches").glob("*.patch"))
    assert patches == ["0001-KV-Offloading-Make-X-two.patch", "0002-KV-Offloading-Add-Y.patch"]
    assert f"From: {ME[0]} <{ME[1]}>" in (out / "patches" / patches[0]).read_text()
    head = git(repo, "rev-parse", branch)

    again = make_pr(track, "--no-hooks", "x-and-y")
    assert again.returncode == 0, again.stderr
    assert f"HEAD {head[:12]}, unchanged" in again.stdout
    assert git(repo, "rev-parse", branch) == head

    # Work of the user's in the clone is never destroyed: uncommitted, then committed.
    (repo / "vllm" / "a.py").write_text("X = 'mine'\n")
    r = make_pr(track, "--no-hooks", "x-and-y")
    assert r.returncode == 2 and "uncommitted edits on pr/x-and-y (vllm/a.py)" in r.stderr
    assert "reset -q --hard" in r.stderr and "commit -s -a" in r.stderr
    git(repo, "commit", "-q", "-s", "-a", "-m", "[KV Offloading] Mine")
    r = make_pr(track, "--no-hooks", "x-and-y")
    assert r.returncode == 2 and "has commits make pr did not make" in r.stderr
    assert f"branch -m {branch} {branch}-mine" in r.stderr and f"branch -D {branch}" in r.stderr
    assert (repo / "vllm" / "a.py").read_text() == "X = 'mine'\n"


def sections(md: str) -> list[str]:
    return re.findall(r"^## (.+)$", md, re.M)


def test_pr_md_has_the_tags_template_structure(track):
    """PR.md follows the tag's own .github/PULL_REQUEST_TEMPLATE.md: its sections in its
    order, the long material folded, at most 400 words shown, the checklist ticked only
    where make pr saw it done, the template's last line kept."""
    r = make_pr(track, "--no-hooks", "--no-tests", "x-and-y")
    assert r.returncode == 0, r.stderr
    md = (track / "build" / "pr" / V / "x-and-y" / "PR.md").read_text()
    assert sections(md) == ["Overview", "Claims", "Validation", "Details"]
    assert "<summary>1. [KV Offloading] Make X two</summary>" in md
    assert "X was one, so every HMA model was refused" in md.split("## Details")[1]
    assert "Upstream status" not in md
    assert kit.visible_words(md) <= kit.VISIBLE_WORDS
    assert "- [x] AI assistance was used" in md
    assert "- [ ] **Testing and Validation:**" in md  # --no-tests: not claimed
    assert "- [ ] I used vLLM's `/pr-checklist` skill." in md
    assert md.rstrip().endswith("(anything below)")
    assert "words shown" in r.stdout


def test_pr_md_follows_another_releases_template():
    """0.22.1's template has Purpose / Test Plan / Test Result and another checklist."""
    tpl = kit.parse_template(TEMPLATE_0_22, "0.22.1's")
    assert tpl.sections == ["Purpose", "Test Plan", "Test Result"]
    assert len(tpl.checklist) == 4
    unit = kit.Unit("u", "[Core] Fix it", [], tests=["tests/test_a.py"], threads=["#12"],
                    overview="It was broken.", claims=["Fixed."])
    before = {"cases": {"tests/test_a.py::test_a": ("failed", "assert 1 == 2")},
              "seconds": 1, "rc": 1, "command": "pytest before"}
    after = {"cases": {"tests/test_a.py::test_a": ("passed", "")},
             "seconds": 1, "rc": 0, "command": "pytest after"}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "u" / "PR.md"
        path.parent.mkdir()
        words = kit.write_pr_md(path, unit, "0.22.1", "v0.22.1", "pr/u", "0" * 40,
                                [("[Core] Fix it", "Why.\n\nHow.")], None, before, after,
                                ME, tpl)
        md = path.read_text()
    assert sections(md) == ["Purpose", "Test Plan", "Test Result"]
    purpose, plan, result = (md.split(f"## {s}")[1] for s in ("Purpose", "Test Plan", "Test Result"))
    assert "It was broken. Related: #12." in purpose and "- Fixed." in purpose
    unit.overview = "Fixes #12: it was broken."  # a thread the overview names is not repeated
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "u" / "PR.md"
        path.parent.mkdir()
        kit.write_pr_md(path, unit, "0.22.1", "v0.22.1", "pr/u", "0" * 40,
                        [("[Core] Fix it", "Why.\n\nHow.")], None, before, after, ME, tpl)
        assert "Fixes #12: it was broken.\n" in path.read_text()
    assert "pytest -q tests/test_a.py" in plan.split("## ")[0]
    assert "| `tests/test_a.py::test_a` | failed: `assert 1 == 2` | passed |" in result
    assert "- [x] The test results" in md and "- [ ] (Optional)" in md
    assert words == kit.visible_words(md) <= kit.VISIBLE_WORDS


def test_pr_md_of_tests_that_pass_before_says_they_guard():
    """A unit whose tests pass on the tag too (tests only) says so: its PR.md claims no
    failure on the tag, in the result, the commands or the checklist."""
    tpl = kit.parse_template(TEMPLATE_UPSTREAM, "0.34.0's")
    unit = kit.Unit("u", "[Core] Test it", [], tests=["tests/test_a.py"], threads=[],
                    overview="Tests only: it was untested.", claims=["Tested."])
    run = {"cases": {"tests/test_a.py::test_a": ("passed", "")}, "seconds": 1, "rc": 0,
           "command": "pytest"}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "u" / "PR.md"
        path.parent.mkdir()
        kit.write_pr_md(path, unit, "0.34.0", "v0.34.0", "pr/u", "0" * 40,
                        [("[Core] Test it", "Why.")], None, run, run, ME, tpl,
                        (["base"], 1), run)  # on a base unit: it guards there too
        md = path.read_text()
    assert "it passes on `v0.34.0` and with this change: it guards existing" in md
    assert "# passes on v0.34.0 and on this branch" in md
    assert "tests passing before and after" in md
    assert "fail" not in md.lower()


def test_pr_md_counts_tests_a_module_error_failed_before():
    """A test module that cannot be imported on the tag fails every test in it: the PR.md's
    count is of those tests, not of the modules (it said 2 of 11 failed)."""
    tpl = kit.parse_template(TEMPLATE_UPSTREAM, "0.34.0's")
    unit = kit.Unit("u", "[Core] Fix it", [], tests=["tests/test_a.py", "tests/test_b.py"],
                    threads=[], overview="It was broken.", claims=["Fixed."])
    cases = [f"tests/test_a.py::test_{i}" for i in range(3)] + ["tests/test_b.py::test_b"]
    before = {"cases": {"tests/test_a.py": ("error", "collection failure"),
                        "tests/test_b.py::test_b": ("passed", "")},
              "seconds": 1, "rc": 1, "command": "pytest"}
    after = {"cases": {c: ("passed", "") for c in cases}, "seconds": 1, "rc": 0,
             "command": "pytest"}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "u" / "PR.md"
        path.parent.mkdir()
        kit.write_pr_md(path, unit, "0.34.0", "v0.34.0", "pr/u", "0" * 40,
                        [("[Core] Fix it", "Why.")], None, before, after, ME, tpl)
        md = path.read_text()
    assert "4 test cases in" in md
    assert ": 3 fail on `v0.34.0` and pass with this change; the others pass on both." in md


def stacked_pr_md(before: dict, on_base: dict, after: dict) -> str:
    """PR.md of a unit "u" on one base unit, "base", from these test runs."""
    import tempfile

    tpl = kit.parse_template(TEMPLATE_UPSTREAM, "0.34.0's")
    unit = kit.Unit("u", "[Core] Fix more", [], tests=["tests/test_a.py"], threads=[],
                    overview="It was broken.", claims=["Fixed."])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "u" / "PR.md"
        path.parent.mkdir()
        kit.write_pr_md(path, unit, "0.34.0", "v0.34.0", "pr/u", "0" * 40,
                        [("[Core] Fix more", "Why.")], None, before, after, ME, tpl,
                        (["base"], 1), on_base)
        return path.read_text()


def run_of(cases: dict, command: str = "pytest") -> dict:
    return {"cases": cases, "seconds": 1, "command": command,
            "rc": int(any(v[0] in ("failed", "error") for v in cases.values()))}


def test_pr_md_of_a_stacked_unit_shows_its_tests_on_its_bases():
    """A unit on a base unit runs its tests on the base's code too (the tag + the base's
    patches): its PR.md says how many fail there, for what reason, beside the tag's."""
    cases = ["tests/test_a.py::test_a", "tests/test_a.py::test_b"]
    md = stacked_pr_md(
        run_of({"tests/test_a.py": ("error", "ImportError: no module named x")},
               "pytest on the tag"),
        run_of({cases[0]: ("failed", "AssertionError: 6 files over max_bytes"),
                cases[1]: ("passed", "")}, "pytest on the base"),
        run_of({c: ("passed", "") for c in cases}, "pytest after"))
    assert ": 2 fail on `v0.34.0` and pass with this change." in md
    assert "On `pr/base` alone, 1 fails: this PR's own commits fix it." in md
    assert "| test | its bases alone | this PR |" in md
    assert "| `tests/test_a.py::test_a` | failed: `AssertionError: 6 files over max_bytes` |" in md
    # the tag's column is folded, with all three
    assert "| test | before (v0.34.0) | on `pr/base` | after (pr/u) |" in md
    assert ("| `tests/test_a.py::test_b` | error: `ImportError: no module named x` | passed "
            "| passed |") in md
    assert "pytest on the base" in md


def test_pr_md_of_a_stacked_unit_shows_first_what_fails_on_its_bases():
    """With more failing tests than the table shows, the rows that fail on the bases (what
    the unit's own commits fix) come first; a test that passes on the tag but fails on the
    bases is no test of existing behaviour."""
    cases = [f"tests/test_a.py::test_{i}" for i in range(10)]
    md = stacked_pr_md(
        run_of({c: ("failed", "ImportError") for c in cases[:9]} | {cases[9]: ("passed", "")}),
        run_of({c: ("passed", "") for c in cases[:9]}
               | {cases[9]: ("failed", "AssertionError: own")}),
        run_of({c: ("passed", "") for c in cases}))
    visible = md.split("<details>")[0]
    assert "| `tests/test_a.py::test_9` | failed: `AssertionError: own` | passed |" in visible
    assert "On `pr/base` alone, 1 fails" in visible
    assert "guard" not in visible


def test_every_unit_of_the_upstream_track_fits_400_words():
    """Each unit of patches/0.34.0/pr-units.toml, with its real commit messages and a
    before/after table of 40 tests (and the column of its bases' code for a unit on base
    units), shows at most 400 words before any <details>."""
    import tempfile

    units = kit.load_units("0.34.0")
    tpl = kit.parse_template(TEMPLATE_UPSTREAM, "0.34.0's")
    cases = {f"t.py::test_{i}": ("failed" if i % 2 else "passed", "AssertionError: " + "x" * 200)
             for i in range(40)}
    before = {"cases": cases, "seconds": 9, "rc": 1, "command": "pytest before"}
    after = {"cases": {k: ("passed", "") for k in cases}, "seconds": 9, "rc": 0,
             "command": "pytest after"}
    for unit in units:
        msgs = []
        for p in unit.patches:
            m = re.search(r"^Subject: \[PATCH[^\]]*\] (.*?)\n\n(.*?)\n---\n", p.read_text(),
                          re.S | re.M)
            subject = m.group(1).replace("\n ", " ")
            msgs.append((subject, kit.clean_message(f"{subject}\n\n{m.group(2)}")
                         .split("\n\n", 1)[1]))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / unit.name / "PR.md"
            path.parent.mkdir()
            bases = kit.builds_on(unit, units)
            # a unit on base units shows its tests on their code too
            words = kit.write_pr_md(path, unit, "0.34.0", "v0.34.0", f"pr/{unit.name}",
                                    "0" * 40, msgs, None, before, after, ME, tpl, bases,
                                    before if bases[0] else None)
        assert words <= kit.VISIBLE_WORDS, (unit.name, words)


def test_the_fs_tier_fixes_are_two_review_sized_units():
    """The eight fs tier fault fixes are two units (issue 33): the block files' faults, on
    the tag alone, and the root's faults on it; each lists every test its fixes add."""
    units = {u.name: u for u in kit.load_units("0.34.0")}
    fs = {n: [p.name[:4] for p in u.patches] for n, u in units.items() if n.startswith("fs-")}
    assert fs == {
        "fs-block-files": ["0007", "0008", "0009", "0010"],
        "fs-root-faults": ["0007", "0008", "0009", "0010", "0013", "0014", "0015", "0016"]}
    assert kit.builds_on(units["fs-root-faults"], list(units.values()))[0] == ["fs-block-files"]
    for n in fs:
        assert kit.review_limits(units[n], list(units.values()))[1] == [], n
        assert units[n].tests and all("::test_" in t for t in units[n].tests), n
    tests = [t for n in fs for t in units[n].tests]
    assert len(tests) == len(set(tests))  # no test claimed by two units


def test_a_fix_whose_code_stands_alone_gets_its_own_branch(track):
    """Patches of a series append their tests to one test file, so a later patch's test hunk
    has the earlier patches' tests as context. make pr merges that test file's hunk (union),
    so a unit of the later patch alone builds on the pristine tag."""
    repo = track / "build" / "vllm"
    (repo / "tests").mkdir()
    (repo / "tests" / "test_x.py").write_text("def test_base():\n    pass\n")
    commit(repo, "tests")
    git(repo, "tag", "-f", "v0.22.1")
    git(repo, "reset", "-q", "--hard", "v0.22.1")
    for i, name in enumerate(("one", "two")):
        (repo / "vllm" / f"{name}.py").write_text(f"N = {i}\n")
        with open(repo / "tests" / "test_x.py", "a") as f:
            f.write(f"\n\ndef test_{name}():\n    from vllm import {name}\n")
        commit(repo, f"[Core] Add {name}\n\nWhy {name}.\n")
    series = track / "patches" / V
    for p in series.glob("*.patch"):
        p.unlink()
    git(repo, "format-patch", "-q", "--zero-commit", "--no-signature", "--full-index",
        "-o", str(series), "v0.22.1..HEAD")
    (series / "pr-units.toml").write_text('[[unit]]\nname = "two"\ntitle = "[Core] Add two"\n'
                                          'patches = ["0002"]\n')
    r = make_pr(track, "--no-hooks", "--no-tests", "two")
    assert r.returncode == 0, r.stderr
    pr_repo = track / "build" / "pr" / V / "repo"
    test_file = git(pr_repo, "show", "pr/two:tests/test_x.py")
    assert "def test_two()" in test_file and "def test_one()" not in test_file
    assert git(pr_repo, "diff", "--name-only", "v0.22.1", "pr/two").split() == [
        "tests/test_x.py", "vllm/two.py"]


def test_a_stacked_units_base_code_is_its_bases_patches_and_head_goes_back(track):
    """base_code(): the tag + the patches of a unit that are not its own, on no branch; HEAD
    is back on pr/<unit> afterwards, where a later step or run expects it."""
    r = make_pr(track, "--no-hooks", "--no-tests", "x-and-y")
    assert r.returncode == 0, r.stderr
    repo = track / "build" / "pr" / V / "repo"
    series = sorted((track / "patches" / V).glob("0*.patch"))
    unit = kit.Unit("x-and-y", "[KV Offloading] Make X two and add Y", series[:2])
    rev = kit.base_code(repo, "v0.22.1", unit, series[1:2])
    assert git(repo, "show", f"{rev}:vllm/a.py") == "X = 2"
    assert git(repo, "ls-tree", "--name-only", rev, "vllm/").split() == [
        "vllm/__init__.py", "vllm/a.py"]
    assert git(repo, "rev-parse", "--abbrev-ref", "HEAD") == "pr/x-and-y"


def test_failing_hook_stops_the_kit_and_names_hook_and_file(track):
    r = make_pr(track, "z", "x-and-y")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "hook no-forbidden-word failed on vllm/c.py" in r.stderr
    assert "vllm/c.py:1:Z = 'FORBIDDEN'" in r.stderr
    repo = track / "build" / "pr" / V / "repo"
    assert git(repo, "branch", "--show-current") == "pr/z"  # left there for fixing
    assert "pr/x-and-y" not in git(repo, "branch", "--list")  # the kit stopped at z

    r = make_pr(track, "x-and-y")  # the hook passes on a unit without the word
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hooks passed: no-forbidden-word" in r.stdout
    assert "vLLM's pre-commit hooks" in (track / "build/pr" / V / "x-and-y/PR.md").read_text()


def test_fresh_clone_names_the_command_that_builds_the_upstream_track(project_copy, tmp_path):
    """A fresh clone has neither build/vllm-<v> nor .venv-<v> of the track make pr picks by
    itself (the newest series): it stops before building anything, with the command that
    makes them for that track (a bare `make apply` builds the other one)."""
    newest = max((p.name for p in (project_copy / "patches").iterdir() if p.is_dir()),
                 key=lambda v: tuple(map(int, v.split("."))))
    assert newest != V  # the upstream track, not the default one
    gitconfig = tmp_path / "gitconfig"
    gitconfig.write_text(f"[user]\n\tname = {ME[0]}\n\temail = {ME[1]}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "VLLM_"))}
    env["GIT_CONFIG_GLOBAL"] = str(gitconfig)

    def run(*args):
        return subprocess.run([sys.executable, "scripts/make_pr.py", *args], cwd=project_copy,
                              env=env, capture_output=True, text=True)

    r = run("--no-hooks")
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip()
    assert err.count("\n") == 0, err  # one sentence, no traceback
    assert f"build/vllm-{newest} and .venv-{newest} missing" in err
    assert f"run `VLLM_VERSION={newest} make apply` first" in err

    r = run("--no-hooks", "--no-tests")  # the branches alone need the checkout only
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"(build/vllm-{newest} missing): run `VLLM_VERSION={newest} make checkout` first" \
        in r.stderr

    (project_copy / "build" / f"vllm-{newest}" / ".git").mkdir(parents=True)  # checkout only
    r = run("--no-hooks")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"(.venv-{newest} missing): run `VLLM_VERSION={newest} make apply` first" in r.stderr
    assert not (project_copy / "build" / "pr").exists()  # refused before anything was made


def test_clean_message_keeps_problem_and_change_of_every_real_patch():
    for p in sorted((ROOT / "patches").glob("*/*.patch")):
        text = p.read_text()
        m = re.search(r"^Subject: \[PATCH[^\]]*\] (.*?)\n\n(.*?)\n---\n", text, re.S | re.M)
        subject, body = m.group(1).replace("\n ", " "), m.group(2)
        cleaned = kit.clean_message(f"{subject}\n\n{body}")
        assert cleaned.startswith(f"{subject}\n\n{body.split(chr(10) * 2)[0]}"), p.name
        assert "Upstream status:" not in cleaned, p.name
        assert not re.search(r"can be dropped|[Dd]rop this patch|[Kk]eep (its|the) tests?\b",
                             cleaned), p.name


def test_every_units_file_of_the_project_loads(monkeypatch):
    files = sorted((ROOT / "patches").glob(f"*/{kit.UNITS_FILE}"))
    assert files
    for f in files:
        units = kit.load_units(f.parent.name)
        assert units and all(u.patches for u in units), f


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_units_measurement_is_folded_into_details_and_left_unchanged():
    """A unit's `measured` files go into PR.md's Details, folded under their heading; the file
    itself is only read."""
    import tempfile

    units = {u.name: u for u in kit.load_units("0.34.0")}
    unit = next(u for u in units.values() if u.measured)
    tpl = kit.parse_template(TEMPLATE_UPSTREAM, "0.34.0's")
    sources = {p: p.read_bytes() for p in unit.measured}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "PR.md"
        words = kit.write_pr_md(path, unit, "0.34.0", "v0.34.0", f"pr/{unit.name}", "0" * 40,
                                [], None, None, None, ME, tpl,
                                kit.builds_on(unit, list(units.values())))
        md = path.read_text()
    for p, data in sources.items():
        assert p.read_bytes() == data
        heading, _, body = data.decode().partition("\n")
        assert f"<summary>{heading.lstrip('# ')}</summary>" in md
        assert body.strip().splitlines()[0] in md
    shown = re.sub(r"<details>.*?</details>", " ", md, flags=re.S)
    assert body.strip().splitlines()[0] not in shown  # folded, not counted in the 400 words
    assert words == kit.visible_words(md) <= kit.VISIBLE_WORDS


def test_sites_hold_the_native_module_of_their_revision(tmp_path, monkeypatch):
    """The before and after sites hold the native module built from that revision's source,
    never the venv's (the whole series': a C-path test would pass on the tag), and none
    where the revision has no source."""
    venv_vllm = tmp_path / "venv" / "vllm"
    venv_vllm.mkdir(parents=True)
    (venv_vllm / "__init__.py").write_text("")
    (venv_vllm / "fs_io_C.abi3.so").write_bytes(b"the series' module")
    monkeypatch.setattr(kit, "site_packages_dir", lambda: tmp_path / "venv")
    import make_wheel

    monkeypatch.setattr(make_wheel, "compile_native_cached", lambda src, code: b"built from " + code)
    repo = tmp_path / "repo"
    (repo / "csrc").mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "csrc" / "fs_io.cpp").write_bytes(b"the tag's source")
    commit(repo, "with")
    git(repo, "tag", "with")
    (repo / "csrc" / "fs_io.cpp").unlink()
    (repo / "README").write_text("x")
    commit(repo, "without")
    site = kit.build_site(tmp_path / "site-with", repo, "with", set())
    assert (site / "vllm" / "fs_io_C.abi3.so").read_bytes() == b"built from the tag's source"
    assert (venv_vllm / "fs_io_C.abi3.so").read_bytes() == b"the series' module"
    site = kit.build_site(tmp_path / "site-without", repo, "HEAD", set())
    assert not (site / "vllm" / "fs_io_C.abi3.so").exists()
    assert (site / "vllm" / "__init__.py").exists()


def test_worktree_site_compiles_the_trees_native_source(tmp_path, monkeypatch):
    """worktree_site.py's site holds fs_io_C built from the work tree's csrc/fs_io.cpp,
    uncommitted edits included, never the venv's; none where the tree has no source."""
    import make_wheel
    import worktree_site

    venv_vllm = tmp_path / "venv" / "vllm"
    venv_vllm.mkdir(parents=True)
    (venv_vllm / "fs_io_C.abi3.so").write_bytes(b"the installed module")
    monkeypatch.setattr(worktree_site, "site_packages", lambda: tmp_path / "venv")
    monkeypatch.setattr(worktree_site, "BUILD", tmp_path / "build")
    monkeypatch.setattr(worktree_site, "ROOT", tmp_path)
    monkeypatch.setattr(worktree_site, "load_pin", lambda: {"tag": "v1"})
    monkeypatch.setattr(worktree_site, "changed_vllm_files", lambda repo, tag: [])
    monkeypatch.setattr(worktree_site, "OVERLAY", tmp_path / "overlay")
    monkeypatch.setattr(make_wheel, "compile_native_cached", lambda src, code: b"built from " + code)
    repo = tmp_path / "vllm"
    (repo / ".git").mkdir(parents=True)
    (repo / "csrc").mkdir()
    (repo / "csrc" / "fs_io.cpp").write_bytes(b"an uncommitted edit")
    site = worktree_site.build(repo)
    assert (site / "vllm" / "fs_io_C.abi3.so").read_bytes() == b"built from an uncommitted edit"
    assert (venv_vllm / "fs_io_C.abi3.so").read_bytes() == b"the installed module"
    (repo / "csrc" / "fs_io.cpp").unlink()
    assert not (worktree_site.build(repo) / "vllm" / "fs_io_C.abi3.so").exists()


def test_worktree_site_takes_the_trees_version_of_every_file_the_series_patches(
        tmp_path, monkeypatch):
    """A checkout of an earlier patch runs its own code: a file the venv's series patches is
    the work tree's even where the tree has it as the tag has it (git sees no change there),
    and a file the series adds that the tree has not yet is not in the site."""
    import worktree_site

    venv_vllm = tmp_path / "venv" / "vllm"
    venv_vllm.mkdir(parents=True)
    (venv_vllm / "base.py").write_text("the series' version")
    (venv_vllm / "added.py").write_text("added by a later patch")
    (venv_vllm / "other.py").write_text("the tag's")
    overlay = tmp_path / "overlay" / "vllm"
    overlay.mkdir(parents=True)
    (overlay / "base.py").write_text("the series' version")
    (overlay / "added.py").write_text("added by a later patch")
    monkeypatch.setattr(worktree_site, "site_packages", lambda: tmp_path / "venv")
    monkeypatch.setattr(worktree_site, "BUILD", tmp_path / "build")
    monkeypatch.setattr(worktree_site, "ROOT", tmp_path)
    monkeypatch.setattr(worktree_site, "OVERLAY", tmp_path / "overlay")
    monkeypatch.setattr(worktree_site, "load_pin", lambda: {"tag": "v1"})
    monkeypatch.setattr(worktree_site, "changed_vllm_files", lambda repo, tag: [])
    monkeypatch.setattr(worktree_site, "place_native", lambda out, read: None)
    repo = tmp_path / "vllm"
    (repo / ".git").mkdir(parents=True)
    (repo / "vllm").mkdir()
    (repo / "vllm" / "base.py").write_text("the tag's")
    site = worktree_site.build(repo) / "vllm"
    assert (site / "base.py").read_text() == "the tag's"
    assert not (site / "added.py").exists()
    assert (site / "other.py").read_text() == "the tag's"
    assert (venv_vllm / "base.py").read_text() == "the series' version"


def test_a_units_validation_file_is_shown_in_validation():
    """A unit's `validation` files (an end-to-end reproduction) are shown in PR.md's
    Validation section, under their heading, within the visible-word limit."""
    import tempfile

    units = {u.name: u for u in kit.load_units("0.34.0")}
    unit = next(u for u in units.values() if u.validation)
    tpl = kit.parse_template(TEMPLATE_UPSTREAM, "0.34.0's")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "PR.md"
        words = kit.write_pr_md(path, unit, "0.34.0", "v0.34.0", f"pr/{unit.name}", "0" * 40,
                                [], None, None, None, ME, tpl,
                                kit.builds_on(unit, list(units.values())))
        md = path.read_text()
    validation = md.partition("Validation")[2].partition("\n## ")[0]
    for p in unit.validation:
        heading, _, body = p.read_text().partition("\n")
        assert f"**{heading.lstrip('# ')}**" in validation
        assert body.strip().splitlines()[0] in validation
    assert words == kit.visible_words(md) <= kit.VISIBLE_WORDS


def _format_patch(path: Path, subject: str, body_lines: int, changed: int) -> Path:
    body = "".join(f"Why, line {i}.\n" for i in range(body_lines))
    diff = "".join(f"+line {i}\n" if i % 2 else f"-line {i}\n" for i in range(changed))
    path.write_text(f"From 0 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] {subject}\n\n{body}"
                    f"---\n f | {changed}\n\ndiff --git a/f b/f\n--- a/f\n+++ b/f\n"
                    f"@@ -1 +1 @@\n{diff}")
    return path


def test_review_limits_count_a_units_own_lines_its_stack_and_its_messages(tmp_path):
    """A unit is measured by the patches its base does not carry; it is flagged above
    UNIT_LINES_MAX lines, on two bases, on a base with a base, or for a long message."""
    p = [_format_patch(tmp_path / f"000{i}.patch", f"[KV Offloading] Fix {i}", 3, n)
         for i, n in enumerate((400, 300, 100, 50))]
    long_msg = _format_patch(tmp_path / "0005.patch", "x" * 73, kit.BODY_MAX + 1, 10)
    assert kit.patch_size(p[0]) == (400, "[KV Offloading] Fix 0", 3)
    a = kit.Unit("a", "A", [p[0]])
    b = kit.Unit("b", "B", [p[0], p[1]])  # 300 of its own on a
    c = kit.Unit("c", "C", [p[0], p[1], p[2]])  # on b, which stands on a
    d = kit.Unit("d", "D", [p[3]])
    e = kit.Unit("e", "E", [p[0], p[3], long_msg])  # on a and d
    big = kit.Unit("big", "Big", [p[0], p[1], p[2]])
    units = [a, b, c, d, e]
    assert kit.review_limits(a, units) == (400, [])
    assert kit.review_limits(b, units) == (300, [])
    lines, why = kit.review_limits(c, units)
    assert lines == 100 and len(why) == 1 and "its base b stands on another unit" in why[0]
    lines, why = kit.review_limits(e, units)
    assert lines == 10 and "stands on 2 units (a, d)" in why[0]
    assert "subject 73 characters, body 16 lines" in why[1]
    lines, why = kit.review_limits(big, [big])
    assert lines == 800 and "800 changed lines of its own" in why[0]


def test_review_limits_count_the_glue_a_unit_carries_apart(tmp_path):
    """Glue (patches in no unit that let a unit written on the tag sit beside another's lines)
    is not a unit's own change: the unit on the tag is measured alone; one that carries the
    glue is flagged for it, its glue lines named apart from its own."""
    p = [_format_patch(tmp_path / f"000{i}.patch", f"[KV Offloading] Fix {i}", 3, n)
         for i, n in enumerate((100, 300, 200, 400, 50))]
    fixes = kit.Unit("fixes", "F", [p[0]])
    private = kit.Unit("private", "P", [p[2]])  # written on the tag; 0001/0003 are glue
    on_both = kit.Unit("on-both", "B", [p[0], p[1], p[2], p[3], p[4]])
    units, glue = [fixes, private, on_both], {p[1], p[3]}
    assert kit.review_limits(private, units, glue) == (200, [])
    lines, why = kit.review_limits(on_both, units, glue)
    assert lines == 50
    assert why[0] == "carries the glue 0001, 0003 (700 lines) between units it stands on"
    assert "stands on 2 units (fixes, private)" in why[1]


def test_glue_must_name_patches_of_the_series(tmp_path, monkeypatch):
    """pr-units.toml's glue names patches of the series; another name is refused, named."""
    (tmp_path / "0001-KV-Offloading-Fix.patch").write_text("")
    (tmp_path / "pr-units.toml").write_text('glue = ["0001", "0099"]\n')
    monkeypatch.setattr(kit, "series_dir", lambda version: tmp_path)
    with pytest.raises(kit.UserError, match=r"glue names 0099, not patches of"):
        kit.load_glue("9.9.9")
    (tmp_path / "pr-units.toml").write_text('glue = ["0001"]\n')
    assert kit.load_glue("9.9.9") == {tmp_path / "0001-KV-Offloading-Fix.patch"}


def test_every_unit_of_the_upstream_track_is_review_sized():
    """Issue 33: each unit at most 600 changed lines of its own, on the tag or on one base
    unit that stands on the tag (glue counted apart)."""
    units, glue = kit.load_units("0.34.0"), kit.load_glue("0.34.0")
    over = {u.name: why for u in units if (why := kit.review_limits(u, units, glue)[1])}
    assert not over, over


def test_patch_deps_names_the_earlier_patch_whose_lines_a_hunk_changes_or_sits_beside(
        tmp_path):
    """scripts/patch_deps.py: a hunk depends on the earlier commit that last changed a line it
    changes or one beside it (a three-way merge conflicts there too), not on the tag's lines
    nor on a commit whose lines it leaves a line away; a new file depends on nothing."""
    import patch_deps

    repo = tmp_path / "repo"
    repo.mkdir()

    def commit(lines: dict[int, str], new_file: bool = False) -> str:
        path = repo / "a.py"
        text = path.read_text().splitlines() if path.exists() else [f"{i}" for i in range(1, 13)]
        for n, line in lines.items():
            text[n - 1] = line
        path.write_text("\n".join(text) + "\n")
        if new_file:
            (repo / "b.py").write_text("new\n")
        kit.git("add", "-A", cwd=repo)
        kit.git("commit", "-q", "-m", f"change {sorted(lines)}", cwd=repo)
        return kit.git("rev-parse", "HEAD", cwd=repo)

    kit.git("init", "-q", cwd=repo)
    commit({})
    kit.git("tag", "v1", cwd=repo)
    commits = [
        commit({3: "three"}),  # 0
        commit({8: "eight"}),  # 1
        commit({4: "four"}, new_file=True),  # 2: beside 0's line 3
        commit({10: "ten"}),  # 3: a line away from 1's line 8
        commit({1: "one", 9: "nine"}),  # 4: beside 1's line 8 and 3's line 10; line 1 is v1's
    ]
    deps = patch_deps.dependencies(repo, "v1", commits)
    assert [sorted(d) for d in deps] == [
        [], [], [(0, "a.py")], [], [(1, "a.py"), (3, "a.py")],
    ]
    assert patch_deps.touched_lines("diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -5,0 +6 @@\n") == {
        "x": [(5, 6, (5, 6))]}


def test_patch_deps_takes_no_line_of_brackets_alone_for_a_dependency(tmp_path):
    """A line of brackets (or a blank one) beside a hunk is anyone's: a hunk beside one that
    an earlier commit wrote does not build on that commit; beside a line with words, or
    changing the brackets themselves, it does."""
    import patch_deps

    repo = tmp_path / "repo"
    repo.mkdir()
    path = repo / "a.py"
    path.write_text("".join(f"{i}\n" for i in range(1, 13)))
    kit.git("init", "-q", cwd=repo)
    kit.git("add", "-A", cwd=repo)
    kit.git("commit", "-q", "-m", "tag", cwd=repo)
    kit.git("tag", "v1", cwd=repo)
    commits = []
    for n, text in ((3, "    )"), (8, "eight"), (4, "four"), (9, "nine"), (3, "    ],")):
        lines = path.read_text().splitlines()
        lines[n - 1] = text
        path.write_text("\n".join(lines) + "\n")
        kit.git("commit", "-q", "-a", "-m", f"line {n}", cwd=repo)
        commits.append(kit.git("rev-parse", "HEAD", cwd=repo))
    deps = patch_deps.dependencies(repo, "v1", commits)
    assert [sorted(d) for d in deps] == [
        [], [], [], [(1, "a.py")], [(0, "a.py"), (2, "a.py")]]


def test_patch_deps_follows_each_units_code_down_to_the_tag():
    """patch_deps.code_stacks(): a unit whose code builds on nothing is a stack of one; one on
    a unit on another is a stack of three, holding both, whichever order they are listed in."""
    import patch_deps

    stacks = patch_deps.code_stacks({"top": {"mid", "root"}, "mid": {"root"}, "root": set(),
                                     "alone": set()})
    assert stacks == {"top": (3, {"mid", "root"}), "mid": (2, {"root"}), "root": (1, set()),
                      "alone": (1, set())}
