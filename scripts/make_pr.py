#!/usr/bin/env python3
"""Turn PR units of the series into branches ready to push to a fork of vLLM.

For each unit of patches/<version>/pr-units.toml (all units, or those named):
  1. branch pr/<unit> in build/pr/<version>/repo (a `git clone --shared` of the track's
     checkout, which is only read): the pristine tag + the unit's patches (`git am`), each
     commit rewritten with you as author and a Signed-off-by line in your name (from
     `git config --global user.name/user.email` or GIT_AUTHOR_NAME/GIT_AUTHOR_EMAIL), the
     fork-only notes (`Upstream status:`, when to drop the patch) taken out of the message;
  2. vLLM's own pre-commit hooks on the files the branch changes (scripts/pr_hooks.py);
  3. the unit's tests on the pristine tag (before) and on the branch (after); a unit on
     base units also on their code alone (the tag + their patches: what its own commits
     fix);
  4. build/pr/<version>/<unit>/PR.md in the structure of the tag's own
     .github/PULL_REQUEST_TEMPLATE.md (0.34.0: Overview, Claims, Validation with the
     before/after table and the commands, Details; the per-commit reasoning, the hooks and the
     exact commands folded in <details>; at most 400 words shown; the checklist ticked only
     where make pr saw it done), PUSH.md (how to open it from a fork) and patches/.
A second run with nothing changed gives the same commit ids and says so. A branch or clone
with work of yours on it is never overwritten: the kit stops and says how to keep or drop it.

Usage: make_pr.py [--list] [--no-hooks] [--no-tests] [--rerun] [UNIT ...]
VLLM_VERSION selects the track; by default the newest pinned release with a series.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path


def _default_track() -> None:
    """make pr's track: VLLM_VERSION, else the newest pinned release that has a series
    (the upstream track once its series lands). Set before _lib reads it."""
    if os.environ.get("VLLM_VERSION"):
        return
    root = Path(__file__).resolve().parent.parent
    have = [p.name for p in (root / "patches").iterdir()
            if p.is_dir() and (root / "pins" / f"vllm-{p.name}.toml").exists()
            and re.fullmatch(r"\d+(\.\d+)*", p.name)]
    if have:
        os.environ["VLLM_VERSION"] = max(have, key=lambda v: tuple(map(int, v.split("."))))


if __name__ == "__main__":  # not when imported (tests): the caller's environment stays
    _default_track()

from _lib import (  # noqa: E402
    BUILD, ROOT, SERIES_VERSION, VENV, Timer, UserError, checkout_dir, git, git_env, load_pin,
    run_main, run_quiet, say, series_dir, vllm_version,
)
from apply import AM_ARGS, conflicting_files  # noqa: E402
from make_wheel import place_native  # noqa: E402
from export_patches import FORMAT_PATCH_ARGS  # noqa: E402

UNITS_FILE = "pr-units.toml"
PR_ROOT = BUILD / "pr"
PLACEHOLDER_NAME = "vllm-hma-tiering"
STATE = "hma-pr"  # .git/hma-pr/<unit>: the HEAD make pr built for pr/<unit> last
UNIT_KEYS = {"name", "title", "patches", "tests", "threads", "layouts", "problem", "change",
             "overview", "claims", "measured", "validation"}
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
TITLE_RE = re.compile(r"^\[[^\]]+\] \S")
# Sentences of a commit message that only concern the fork: when the patch can go.
DROP_KEEP_RE = re.compile(
    r"can be dropped|\b[Dd]rop (?:this|the) patch|\b[Dd]rop (?:it|the code|the manager part)"
    r"|^[Kk]eep (?:its|the|this) test|; keep (?:its|the) tests?|\bkeep this test\b")


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


# ----------------------------------------------------------------------------- units file
@dataclass
class Unit:
    name: str
    title: str
    patches: list[Path]
    tests: list[str] = field(default_factory=list)
    threads: list[str] = field(default_factory=list)
    layouts: list[str] = field(default_factory=list)
    problem: str = ""
    change: str = ""
    overview: str = ""  # PR.md's Overview: 1-2 lines (default: the problem's first sentence)
    claims: list[str] = field(default_factory=list)  # a few bullets (default: commit subjects)
    measured: list[Path] = field(default_factory=list)  # markdown files, folded into Details
    validation: list[Path] = field(default_factory=list)  # markdown files, shown in Validation


def resolve_patch(ref: str, series: list[Path]) -> Path | None:
    """'0003', '3' or a file name (with or without .patch) -> the patch file."""
    ref = ref.strip()
    if ref.isdigit():
        hits = [p for p in series if p.name.startswith(f"{int(ref):04d}-")]
    else:
        hits = [p for p in series if p.name in (ref, ref + ".patch")]
    return hits[0] if len(hits) == 1 else None


def load_units(version: str) -> list[Unit]:
    folder = series_dir(version)
    path = folder / UNITS_FILE
    if not path.exists():
        others = sorted(rel(p) for p in (ROOT / "patches").glob(f"*/{UNITS_FILE}"))
        raise UserError(f"no {rel(path)}: list the PR units of the {version} series there"
                        + (f" (the format: {others[0]})" if others else "")
                        + "; or choose another track with VLLM_VERSION")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{rel(path)} is not valid TOML: {e}") from None
    series = sorted(folder.glob("*.patch"))
    raw = data.get("unit")
    if not isinstance(raw, list) or not raw:
        raise UserError(f"{rel(path)} has no [[unit]] table; each unit needs name, title, patches")
    units, seen = [], set()
    for i, u in enumerate(raw, 1):
        name = u.get("name")
        where = f"unit {name!r} of {rel(path)}" if name else f"unit #{i} of {rel(path)}"
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise UserError(f"{where}: name must be lowercase letters, digits, '.', '_' or '-' "
                            "(it becomes the branch pr/<name>)")
        if name in seen:
            raise UserError(f"{where}: the name is used twice; give each unit its own name")
        seen.add(name)
        unknown = sorted(set(u) - UNIT_KEYS)
        if unknown:
            raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(UNIT_KEYS))}")
        title = u.get("title", "")
        if not isinstance(title, str) or not TITLE_RE.match(title):
            raise UserError(f"{where}: title {title!r} must follow vLLM's convention, an area "
                            "tag then a sentence, e.g. \"[KV Offloading] Make tiering work for "
                            "HMA models\"")
        refs = u.get("patches")
        if not isinstance(refs, list) or not refs or not all(isinstance(r, str) for r in refs):
            raise UserError(f"{where}: patches must be a non-empty list of patch numbers "
                            "(\"0003\") or file names, in the order they apply")
        patches = []
        for ref in refs:
            p = resolve_patch(ref, series)
            if p is None:
                have = (f"{series[0].name} to {series[-1].name}" if series else "none")
                raise UserError(f"{where} names patch {ref!r}, which is not in "
                                f"{rel(folder)}/ (patches there: {have}); use a number prefix "
                                "such as \"0003\" or a file name")
            if p in patches:
                raise UserError(f"{where} names {p.name} twice")
            patches.append(p)
        for key in ("tests", "threads", "layouts", "claims"):
            v = u.get(key, [])
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise UserError(f"{where}: {key} must be a list of strings")
        for key in ("problem", "change", "overview"):
            if not isinstance(u.get(key, ""), str):
                raise UserError(f"{where}: {key} must be a string (markdown)")
        files = {}
        for key in ("measured", "validation"):
            files[key] = u.get(key, [])
            if not isinstance(files[key], list) or not all(isinstance(x, str) for x in files[key]):
                raise UserError(f"{where}: {key} must be a list of markdown files in {rel(folder)}/")
            missing = [x for x in files[key] if not (folder / x).is_file()]
            if missing:
                raise UserError(f"{where}: {key} names {', '.join(missing)}, not in "
                                f"{rel(folder)}/; write the file there or drop the name")
        units.append(Unit(name, title, patches, list(u.get("tests", [])),
                          list(u.get("threads", [])), list(u.get("layouts", [])),
                          u.get("problem", "").strip(), u.get("change", "").strip(),
                          " ".join(u.get("overview", "").split()), list(u.get("claims", [])),
                          [folder / x for x in files["measured"]],
                          [folder / x for x in files["validation"]]))
    return units


def load_glue(version: str) -> set[Path]:
    """pr-units.toml's `glue`: patches in no unit that let a unit written on the tag sit in
    the series beside another unit's lines (one sets those lines aside before it, one brings
    them back after it, combined). Upstream, the second of the two to land takes it on."""
    folder = series_dir(version)
    path = folder / UNITS_FILE
    refs = tomllib.loads(path.read_text()).get("glue", [])
    series = sorted(folder.glob("*.patch"))
    glue = {ref: resolve_patch(ref, series) for ref in refs if isinstance(ref, str)}
    bad = [ref for ref, p in glue.items() if p is None] + [
        repr(r) for r in refs if not isinstance(r, str)]
    if bad:
        raise UserError(f"{rel(path)}: glue names {', '.join(bad)}, not patches of "
                        f"{rel(folder)}/; use number prefixes such as \"0019\"")
    return {p for p in glue.values() if p is not None}


def select(units: list[Unit], names: list[str]) -> list[Unit]:
    if not names:
        return units
    by = {u.name: u for u in units}
    bad = [n for n in names if n not in by]
    if bad:
        raise UserError(f"no unit named {', '.join(bad)}; units: {', '.join(by)}")
    return [by[n] for n in names]


# ----------------------------------------------------------------------------- identity
def git_config_global(key: str) -> str:
    r = subprocess.run(["git", "config", "--global", "--get", key], capture_output=True,
                       text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def identity() -> tuple[str, str]:
    """The person who signs the commits off: GIT_AUTHOR_NAME/EMAIL, else git's global config.
    The checkout's own config (the project placeholder) is not asked on purpose."""
    name = os.environ.get("GIT_AUTHOR_NAME") or git_config_global("user.name")
    email = os.environ.get("GIT_AUTHOR_EMAIL") or git_config_global("user.email")
    how = ('`git config --global user.name "Your Name"` and '
           "`git config --global user.email you@example.com` (or GIT_AUTHOR_NAME and "
           "GIT_AUTHOR_EMAIL), then run make pr again")
    if not name or not email:
        missing = " and ".join(k for k, v in (("user.name", name), ("user.email", email)) if not v)
        raise UserError(f"make pr signs every commit off in your name (the DCO), but git has no "
                        f"{missing}: set {how}")
    if name == PLACEHOLDER_NAME or email.endswith("@localhost") or email == f"{PLACEHOLDER_NAME}":
        raise UserError(f"git's identity is {name} <{email}>, the project's placeholder, which "
                        f"cannot sign the DCO for a pull request: set yours with {how}")
    if "@" not in email or "<" in name or ">" in name:
        raise UserError(f"{name} <{email}> is not a usable identity: set {how}")
    return name, email


# ----------------------------------------------------------------------------- messages
def clean_message(msg: str) -> str:
    """Drop the fork-only notes from a commit message: the `Upstream status:` paragraph (or
    the part of a paragraph from it on) and the sentences saying when to drop/keep the
    patch. The subject, the problem and the change stay as they are."""
    paras = re.split(r"\n[ \t]*\n", msg.strip())
    subject, body = paras[0], paras[1:]
    kept = []
    for para in body:
        if re.match(r"(Signed-off-by|Co-authored-by):", para):
            continue
        idx = para.find("Upstream status:")
        if idx >= 0:
            para = para[:idx].rstrip()
        sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z(])", para)
        keep = [s for s in sentences if not DROP_KEEP_RE.search(s)]
        para = " ".join(keep) if len(keep) != len(sentences) else para
        if para.strip():
            kept.append(para.strip())
    return "\n\n".join([subject, *kept]) + "\n"


def signed(msg: str, name: str, email: str) -> str:
    return msg.rstrip("\n") + f"\n\nSigned-off-by: {name} <{email}>\n"


# ----------------------------------------------------------------------------- the clone
def make_command(target: str, version: str) -> str:
    """The make command for the track make pr works on (it picks the newest one by itself;
    a bare `make apply` would build the default track's)."""
    return (f"make {target}" if version == SERIES_VERSION
            else f"VLLM_VERSION={version} make {target}")


def check_prerequisites(version: str, checkout: Path, needs_venv: bool) -> None:
    """Before anything is built: the track's checkout (the branches' source) and, when tests
    run, its venv. A fresh clone has neither for the upstream track."""
    have_checkout = (checkout / ".git").exists()
    have_venv = (VENV / "bin" / "python").exists()
    if needs_venv and not (have_checkout and have_venv):
        missing = " and ".join(rel(p) for p, ok in ((checkout, have_checkout), (VENV, have_venv))
                               if not ok)
        raise UserError(f"make pr needs vLLM {version}'s checkout and venv to build and test "
                        f"the branches ({missing} missing): run `{make_command('apply', version)}` "
                        "first, or `make pr PR_ARGS=--no-tests` to skip the tests")
    if not have_checkout:
        raise UserError(f"make pr needs vLLM {version}'s checkout to build the branches "
                        f"({rel(checkout)} missing): run `{make_command('checkout', version)}` "
                        "first")


def ensure_repo(checkout: Path, repo: Path, tag: str, ident: tuple[str, str]) -> None:
    if not (checkout / ".git").exists():
        raise UserError(f"no checkout at {rel(checkout)}; "
                        f"`{make_command('checkout', vllm_version())}` builds it")
    if not (repo / ".git").exists():
        say(f"cloning {rel(checkout)} to {rel(repo)} (git clone --shared: the checkout is "
            "only read)")
        if repo.exists():
            raise UserError(f"{rel(repo)} exists but is no git repository; move it away")
        repo.parent.mkdir(parents=True, exist_ok=True)
        git("clone", "-q", "--shared", "--no-checkout", str(checkout), str(repo), cwd=repo.parent)
        (repo / ".git" / "info" / "exclude").write_text("__pycache__/\n*.pyc\n.pytest_cache/\n")
        git("checkout", "-q", "--detach", tag, cwd=repo)
    origin = git("config", "--get", "remote.origin.url", cwd=repo, check=False)
    if Path(origin).resolve() != checkout.resolve():
        raise UserError(f"{rel(repo)} is a clone of {origin or 'nothing'}, not of "
                        f"{rel(checkout)}; move it away and run make pr again")
    if not git("rev-parse", "-q", "--verify", f"{tag}^{{commit}}", cwd=repo, check=False):
        raise UserError(f"{rel(repo)} cannot read {tag} from {rel(checkout)} any more (the "
                        f"checkout was rebuilt or pruned); remove {rel(repo)} (keep branches "
                        "you changed first) and run make pr again")
    # A unit's patches are applied on the pristine tag without the series' earlier patches,
    # which append their own tests to the same test files: scripts/merge_test_appends.py
    # merges such a test file hunk as "the branch's file + what this patch adds", so a fix
    # whose code stands alone gets its own branch. Code files merge as usual (a conflict
    # there names the patch it builds on).
    driver = Path(__file__).resolve().parent / "merge_test_appends.py"
    git("config", "merge.hma-test-appends.name", "the unit's own tests only", cwd=repo)
    git("config", "merge.hma-test-appends.driver", f"{sys.executable} {driver} %O %A %B",
        cwd=repo)
    (repo / ".git" / "info" / "attributes").write_text("tests/**/test_*.py merge=hma-test-appends\n")
    # Commits you make there for a fix carry your name, like the ones make pr writes.
    git("config", "user.name", ident[0], cwd=repo)
    git("config", "user.email", ident[1], cwd=repo)


def state_file(repo: Path, unit: str) -> Path:
    return repo / ".git" / STATE / unit


def check_repo_clean(repo: Path) -> None:
    where = git("branch", "--show-current", cwd=repo) or "a detached HEAD"
    if (repo / ".git" / "rebase-apply").exists():
        raise UserError(f"a `git am` is in progress in {rel(repo)} ({where}). Finish it "
                        f"(`git -C {repo} am --continue`) or drop it (`git -C {repo} am "
                        "--abort`), then run make pr again")
    dirty = [ln for ln in git("status", "--porcelain", cwd=repo, strip=False).splitlines() if ln]
    if dirty:
        files = ", ".join(ln[3:] for ln in dirty[:5]) + (", ..." if len(dirty) > 5 else "")
        raise UserError(
            f"{rel(repo)} has uncommitted edits on {where} ({files}); make pr rebuilds "
            f"branches there and would lose them. Keep them: `git -C {repo} commit -s -a`, then "
            f"rename that branch (`git -C {repo} branch -m {where} {where}-mine`) and make the "
            f"same fix in the series (build/vllm, `make patches`); or discard them: "
            f"`git -C {repo} reset -q --hard && git -C {repo} clean -fdq`")


def check_branch_is_ours(repo: Path, branch: str, unit: str) -> str | None:
    """-> the HEAD make pr built last, None for a new branch; refuses a branch with commits
    that make pr did not make."""
    head = git("rev-parse", "-q", "--verify", f"refs/heads/{branch}", cwd=repo, check=False)
    if not head:
        return None
    sf = state_file(repo, unit)
    built = sf.read_text().strip() if sf.exists() else ""
    if head != built:
        what = (f"HEAD {head[:12]}, make pr built {built[:12]}" if built
                else f"HEAD {head[:12]}, not made by make pr")
        raise UserError(
            f"branch {branch} of {rel(repo)} has commits make pr did not make ({what}). Keep "
            f"them: `git -C {repo} branch -m {branch} {branch}-mine`; or discard them: "
            f"`git -C {repo} branch -D {branch}`; then run make pr again")
    return head


def apply_patches(repo: Path, tag: str, unit: Unit, patches: list[Path]) -> None:
    """HEAD = tag + patches (of unit), detached, as `git am` commits them."""
    git("checkout", "-q", "--detach", tag, cwd=repo)
    for i, p in enumerate(patches):
        r = subprocess.run(["git", *AM_ARGS, str(p)], cwd=repo, env=git_env(),
                           capture_output=True, text=True)
        if r.returncode == 0 and not (repo / ".git" / "rebase-apply").exists():
            continue
        unmerged = git("diff", "--name-only", "--diff-filter=U", cwd=repo, check=False).split()
        files = unmerged or conflicting_files(r.stdout + r.stderr) or ["(git named no file)"]
        git("am", "--abort", cwd=repo, check=False)
        git("checkout", "-q", "-f", "--detach", tag, cwd=repo)
        before = ", ".join(q.name[:4] for q in patches[:i]) or "none"
        raise UserError(
            f"unit {unit.name!r}: {rel(p)} does not apply on {tag} after the unit's earlier "
            f"patches ({before}); conflicting file(s): {', '.join(files)}. A unit is its "
            "patches on the pristine tag: add the patch it builds on to the unit (in order), "
            f"or merge the two units, in {rel(p.parent / UNITS_FILE)}")


def build_branch(repo: Path, tag: str, unit: Unit, ident: tuple[str, str]) -> str:
    """pr/<unit> = tag + the unit's patches, rewritten (author, sign-off, message)."""
    name, email = ident
    apply_patches(repo, tag, unit, unit.patches)
    parent = git("rev-parse", f"{tag}^{{commit}}", cwd=repo)
    for c in git("rev-list", "--reverse", f"{tag}..HEAD", cwd=repo).split():
        tree = git("rev-parse", f"{c}^{{tree}}", cwd=repo)
        date = git("log", "-1", "--format=%ad", "--date=raw", c, cwd=repo)
        msg = git("log", "-1", "--format=%B", c, cwd=repo, strip=False)
        env = dict(os.environ, GIT_AUTHOR_NAME=name, GIT_AUTHOR_EMAIL=email,
                   GIT_AUTHOR_DATE=date, GIT_COMMITTER_NAME=name, GIT_COMMITTER_EMAIL=email,
                   GIT_COMMITTER_DATE=date)
        parent = subprocess.run(
            ["git", "commit-tree", tree, "-p", parent, "-F", "-"], cwd=repo, env=env,
            input=signed(clean_message(msg), name, email), text=True, capture_output=True,
            check=True).stdout.strip()
    branch = f"pr/{unit.name}"
    git("checkout", "-q", "-B", branch, parent, cwd=repo)
    sf = state_file(repo, unit.name)
    sf.parent.mkdir(exist_ok=True)
    sf.write_text(parent + "\n")
    return parent


# ----------------------------------------------------------------------------- tests
def site_packages_dir() -> Path:
    from _series import site_packages

    return site_packages()


def touched_by_track(checkout: Path, tag: str) -> set[str]:
    """vllm/ files the track's venv may hold in another version than the tag: those the
    series changes (the venv of the default track is the series' wheel) and those the
    checkout changes."""
    from _series import changed_vllm_files, series_files

    names = set(changed_vllm_files(checkout, tag))
    if series_dir(vllm_version()).is_dir():
        names |= {n for n in series_files(checkout, tag) if n.startswith("vllm/")}
    return names


def build_site(out: Path, repo: Path, rev: str, touched: set[str]) -> Path:
    """The venv's vllm package, hard-linked, with every touched vllm/ file as `rev` has it
    (removed where rev has none): what worktree_site.py / unpatched_site.py build. The
    native modules a series may change (make_wheel.NATIVE) are compiled from `rev`'s source,
    or removed where rev has none: the venv's are the whole series', which would let a
    C-path test pass on the tag."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copytree(site_packages_dir() / "vllm", out / "vllm", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for path in sorted(touched):
        dest = out / path
        dest.unlink(missing_ok=True)  # a hard link into the venv: never write through it
        code = git_show(repo, rev, path)
        if code is not None:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(code)
    place_native(out, lambda src: git_show(repo, rev, src))
    return out


def git_show(repo: Path, rev: str, path: str) -> bytes | None:
    """*path* as *rev* has it, or None where rev has no such file."""
    r = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=repo, capture_output=True)
    return r.stdout if r.returncode == 0 else None


def prepare_testroot(repo: Path, rev: str, out: Path) -> None:
    """The branch's tests/ and pyproject.toml without its vllm/ (which would shadow the site)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "tests", "pyproject.toml"], cwd=repo,
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "x"], cwd=out, input=archive, check=True)


def test_command(site: Path, tests: list[str], xml: Path) -> tuple[list[str], dict]:
    from run_tests import HF_HOME, prepare_hf_home

    prepare_hf_home()
    empty = PR_ROOT / "empty-overlay"
    empty.mkdir(parents=True, exist_ok=True)
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(HF_HOME),
           # hma_pytest: skips what cannot run here, removes leaked /dev/shm regions; the
           # imported vllm is checked by make pr itself (an empty overlay, nothing to compare)
           "HMA_OVERLAY": str(empty), "HMA_UNPATCHED": "1",
           "PYTHONPATH": os.pathsep.join([str(site), str(ROOT / "scripts" / "pytest_plugins")])}
    cmd = [str(VENV / "bin" / "python"), "-m", "pytest", "-p", "hma_pytest",
           "-p", "no:cacheprovider", "-q", "-rfE", "--tb=short", "--disable-warnings",
           # on the tag, a test module that imports what the unit adds fails to collect:
           # the unit's other tests still run there
           "--continue-on-collection-errors",
           f"--junitxml={xml}", *tests]
    return cmd, env


def run_tests(label: str, site: Path, testroot: Path, tests: list[str], out: Path) -> dict:
    xml = out / f"tests-{label}.xml"
    log = out / f"tests-{label}.log"
    xml.unlink(missing_ok=True)
    cmd, env_add = test_command(site, tests, xml)
    shown = " ".join(f"{k}={v}" for k, v in env_add.items() if k in ("PYTHONPATH",))
    say(f"  tests {label}: {shown} {rel(Path(cmd[0]))} -m pytest ... {' '.join(tests)}")
    check = subprocess.run(
        [cmd[0], "-c", "import vllm, sys; print(vllm.__file__)"], cwd=testroot,
        env=dict(os.environ, **env_add), capture_output=True, text=True)
    if not check.stdout.strip().startswith(str(site)):
        raise UserError(f"the tests would not import vllm from {rel(site)} "
                        f"({(check.stdout + check.stderr).strip()[-300:]}); run `make apply`")
    with Timer() as t:
        rc, lines = run_quiet(cmd, f"tests {label}", show=False, cwd=testroot,
                              env=dict(os.environ, **env_add))
    log.write_text("\n".join(lines) + "\n")
    cases = parse_junit(xml, testroot)
    counts = {k: sum(1 for c in cases.values() if c[0] == k)
              for k in ("passed", "failed", "error", "skipped")}
    say(f"  tests {label}: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
        + f" (exit {rc}, {t.elapsed:.0f} s; {rel(log)})")
    env_words = [f"{k}={v}" for k, v in env_add.items()]
    return {"rc": rc, "cases": cases, "seconds": round(t.elapsed, 1),
            "command": f"cd {shlex.quote(str(testroot))} && "
                       + shlex.join([*env_words, *cmd])}


def nodeid(classname: str, name: str, root: Path) -> str:
    if not classname:  # a module pytest could not collect: name is its dotted path
        path = name.replace(".", "/") + ".py"
        return path if (root / path).exists() else name
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if (root / path).exists():
            return "::".join([path, *parts[i:], name])
    return "::".join([classname, name])


def parse_junit(xml: Path, root: Path) -> dict[str, tuple[str, str]]:
    """{nodeid: (passed|failed|error|skipped, first line of the reason)}"""
    if not xml.exists():
        return {}
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        nid = nodeid(case.get("classname", ""), case.get("name", ""), root)
        status, why = "passed", ""
        for tag, st in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                status = st
                why = (el.get("message") or el.text or tag).strip().splitlines()[0]
                text = (el.text or "").splitlines()
                locs = [i for i, ln in enumerate(text) if re.match(r"^\S+\.py:\d+: ", ln)]
                if " " not in why and locs:  # a bare `assert`: say where it stopped
                    i = locs[-1]
                    where = re.sub(r"^.*?/(?=(vllm|tests)/)", "", text[i].split(": ")[0])
                    code = text[i + 1].strip() if i + 1 < len(text) else ""
                    why = f"{why} at {where}" + (f": {code}" if code and not
                                                 code.startswith("E ") else "")
                why = why[:160]
                break
        out[nid] = (status, why)
    return out


# ----------------------------------------------------------------------------- PR.md
def commit_messages(repo: Path, tag: str, branch: str) -> list[tuple[str, str]]:
    out = []
    for c in git("rev-list", "--reverse", f"{tag}..{branch}", cwd=repo).split():
        msg = git("log", "-1", "--format=%B", c, cwd=repo)
        subject, _, body = msg.partition("\n")
        body = re.sub(r"\n*Signed-off-by: .*$", "", body.strip(), flags=re.M).strip()
        out.append((subject.strip(), body))
    return out


def unwrap(para: str) -> str:
    return re.sub(r"\s*\n\s*", " ", para.strip())


def before_result(before: dict, nid: str) -> tuple[str, str] | None:
    """A test's result in the before run; a test the run could not collect (its module
    failed to import) takes its module's error."""
    return before["cases"].get(nid) or before["cases"].get(nid.split("::")[0])


def failing_before(before: dict, after: dict) -> int:
    """How many of the after run's tests failed, or could not be collected, before."""
    return sum((before_result(before, nid) or ("not run",))[0] in ("failed", "error")
               for nid in after["cases"])


def result_rows(before: dict, after: dict) -> list[tuple[str, str, str]]:
    """One row per test function: (test, before, after), parametrized cases counted."""
    groups: dict[str, dict] = {}
    names = [*after["cases"], *[n for n in before["cases"]
                                if n not in after["cases"] and "::" in n]]
    for nid in names:
        key = nid.split("[")[0]
        g = groups.setdefault(key, {"n": 0, "before": {}, "after": {}, "why": ""})
        g["n"] += 1
        for side, res in (("before", before), ("after", after)):
            got = before_result(res, nid) if side == "before" else res["cases"].get(nid)
            st, why = got or ("not run", "")
            g[side][st] = g[side].get(st, 0) + 1
            if side == "before" and st in ("failed", "error") and not g["why"]:
                g["why"] = why
    rows = []
    for key, g in groups.items():
        def fmt(d, n=g["n"]):
            if len(d) == 1:
                st = next(iter(d))
                return st if n == 1 else f"{n} {st}"
            return ", ".join(f"{k} {st}" for st, k in sorted(d.items()))
        b = fmt(g["before"]) + (f": `{g['why'][:160]}`" if g["why"] else "")
        name = key + (f" ({g['n']} cases)" if g["n"] > 1 else "")
        rows.append((f"`{name}`", b.replace("|", "\\|"), fmt(g["after"])))
    return rows


TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
VISIBLE_WORDS = 400  # what a reviewer reads before opening any <details>
# vLLM 0.34.0's section names, for a tag without a template of its own
DEFAULT_SECTIONS = ["Overview", "Claims", "Validation", "Details"]


def shown_validation(unit: Unit) -> list[str]:
    """The unit's validation files (an end-to-end reproduction), each under its heading."""
    lines: list[str] = []
    for path in unit.validation:
        heading, _, text = path.read_text().strip().partition("\n")
        lines += [f"**{heading.lstrip('# ')}**", "", text.strip(), ""]
    return lines


@dataclass
class Template:
    """The sections of the tag's .github/PULL_REQUEST_TEMPLATE.md, in order, its checklist
    (a <details> block of '- [ ]' items) and what follows it (vLLM's 'BEFORE SUBMITTING')."""

    sections: list[str]
    checklist_summary: str = ""
    checklist: list[str] = field(default_factory=list)
    tail: str = ""
    source: str = ""


def read_template(repo: Path, rev: str) -> Template:
    """The template of the tag the branches are built on (each release has its own)."""
    text = git("show", f"{rev}:{TEMPLATE}", cwd=repo, check=False, strip=False)
    if not text:
        return Template(DEFAULT_SECTIONS, source=f"no {TEMPLATE} at {rev}: vLLM 0.34.0's sections")
    return parse_template(text, f"{TEMPLATE} at {rev}")


def parse_template(text: str, source: str) -> Template:
    sections = re.findall(r"^## (.+?)\s*$", text, re.M)
    tpl = Template(sections or DEFAULT_SECTIONS, source=source)
    m = re.search(r"<details>\s*<summary>(.*?)</summary>(.*?)</details>(.*)", text, re.S)
    if m and "- [ ]" in m.group(2):
        tpl.checklist_summary = m.group(1).strip()
        tpl.checklist = [ln.strip()[len("- [ ] "):] for ln in m.group(2).splitlines()
                         if ln.strip().startswith("- [ ] ")]
        tpl.tail = m.group(3).strip()
    return tpl


def visible_words(markdown: str) -> int:
    """Words a reviewer sees on the PR page without opening a <details> block (HTML comments
    are not shown either)."""
    text = re.sub(r"<!--.*?-->", " ", markdown, flags=re.S)
    text = re.sub(r"<details>.*?</details>", " ", text, flags=re.S)
    return len(re.findall(r"\S+", text))


def section_role(name: str) -> str:
    n = name.lower()
    for role, words in (("overview", ("overview", "purpose", "summary")),
                        ("claims", ("claim",)), ("plan", ("test plan",)),
                        ("result", ("test result",)), ("validation", ("validation", "test")),
                        ("details", ("detail",))):
        if any(w in n for w in words):
            return role
    return ""


def first_sentence(text: str) -> str:
    text = unwrap(re.split(r"\n\s*\n", text.strip())[0]) if text.strip() else ""
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    return (m.group(1) if m else text)[:300]


def fold(summary: str, body: list[str]) -> list[str]:
    return ["<details>", f"<summary>{summary}</summary>", "", *body, "", "</details>", ""]


def checklist_state(item: str, tested: bool, hooks_ok: bool,
                    guards: bool = False) -> tuple[bool, str]:
    """(checked, why) for a checklist item: ticked only where make pr itself saw it done or
    wrote it; judgement calls (design fit, documentation, contents) stay open for the author."""
    i = item.lower()
    if "ai assistance" in i:
        return True, "the series was written with AI assistance"
    if "/pr-checklist" in i:
        return False, "make pr does not run that skill"
    if i.startswith("the purpose"):
        return True, "the overview"
    if "test plan" in i:
        return True, "the commands under the test plan"
    if "test result" in i or "testing and validation" in i:
        return tested, ("tests passing before and after (they guard existing behaviour)"
                        if guards else "tests failing before, passing after" if tested
                        else "tests not run (`--no-tests`)")
    if "code quality" in i:
        return False, (("vLLM's pre-commit hooks passed; " if hooks_ok else "hooks not run; ")
                       + "documentation: for the author to confirm")
    return False, "for the author to confirm"


def own_patches(unit: Unit, units: list[Unit]) -> list[Path]:
    """The unit's patches that none of the units it carries has: its own change."""
    theirs = {p for u in units if set(u.patches) < set(unit.patches) for p in u.patches}
    return [p for p in unit.patches if p not in theirs]


def base_code(repo: Path, tag: str, unit: Unit, own: list[Path],
              glue: set[Path] | frozenset = frozenset()) -> str:
    """What a stacked unit's own patches apply to: the tag + its base units' patches, and
    the glue among them, up to its own first change (a commit on no branch; HEAD goes back
    to pr/<unit>). Its tests run there too: they should fail for what its own commits fix,
    not only for what its bases add."""
    mine = [p for p in own if p not in glue]
    first = unit.patches.index(mine[0]) if mine else len(unit.patches)
    theirs = unit.patches[:first]
    try:
        apply_patches(repo, tag, unit, theirs)
    except UserError:
        raise UserError(
            f"unit {unit.name!r}: its bases' patches ({', '.join(p.name[:4] for p in theirs)}) "
            f"do not apply on {tag} without its own ({', '.join(p.name[:4] for p in own)}): "
            "in pr-units.toml, its own patches must come after every base patch they "
            "need") from None
    try:
        return git("rev-parse", "HEAD", cwd=repo)
    finally:
        git("checkout", "-q", f"pr/{unit.name}", cwd=repo)


def builds_on(unit: Unit, units: list[Unit]) -> tuple[list[str], int]:
    """The units whose patches this one carries first (the largest only: a unit a base
    already carries is not named again), and how many commits are this unit's own."""
    subs = [u for u in units if set(u.patches) < set(unit.patches)]
    bases = [u for u in subs if not any(set(u.patches) < set(v.patches) for v in subs)]
    return [u.name for u in bases], len(own_patches(unit, units))


# What a reviewer can take in one PR: a unit's own patches change at most UNIT_LINES_MAX
# lines, tests included, and it stands on the tag or on one base unit that does (a stack of
# two at most); its commit messages are as vLLM writes them.
UNIT_LINES_MAX = 600
SUBJECT_MAX = 72
BODY_MAX = 15
_DIFF_HEADER = ("+++ a/", "+++ b/", "+++ /dev/null", "--- a/", "--- b/", "--- /dev/null")


def patch_size(patch: Path) -> tuple[int, str, int]:
    """A format-patch's changed lines (+ and -, tests included), subject and body lines."""
    head, _, diff = patch.read_text(errors="replace").partition("\n---\n")
    header, _, body = head.partition("\n\n")
    m = re.search(r"^Subject: (.*(?:\n[ \t].*)*)", header, re.M)
    subject = re.sub(r"^\[PATCH[^\]]*\] ", "", re.sub(r"\n[ \t]", " ", m.group(1))) if m else ""
    body_lines = [ln for ln in body.rstrip("\n").split("\n")
                  if ln and not re.match(r"(Signed-off-by|Co-authored-by):", ln)] if body else []
    changed = sum(1 for ln in diff.splitlines()
                  if ln[:1] in ("+", "-") and not ln.startswith(_DIFF_HEADER))
    return changed, subject, len(body_lines)


def review_limits(unit: Unit, units: list[Unit],
                  glue: set[Path] | frozenset = frozenset()) -> tuple[int, list[str]]:
    """The unit's own changed lines (not counting the glue it carries), and what keeps a
    reviewer from taking it alone."""
    bases, _ = builds_on(unit, units)
    base_units = [u for u in units if u.name in bases]
    theirs = {p for u in base_units for p in u.patches}
    own = [p for p in unit.patches if p not in theirs]
    sizes = {p: patch_size(p) for p in own}
    lines = sum(size[0] for p, size in sizes.items() if p not in glue)
    why = []
    carried = [p for p in own if p in glue]
    if carried:
        why.append(f"carries the glue {', '.join(p.name[:4] for p in carried)} ("
                   f"{sum(sizes[p][0] for p in carried)} lines) between units it stands on")
    if lines > UNIT_LINES_MAX:
        why.append(f"{lines} changed lines of its own, tests included (at most "
                   f"{UNIT_LINES_MAX}): split it, or move patches to a base unit")
    if len(bases) > 1:
        why.append(f"stands on {len(bases)} units ({', '.join(bases)}): one base at most")
    deeper = [u.name for u in base_units if builds_on(u, units)[0]]
    if deeper:
        why.append(f"its base {deeper[0]} stands on another unit: a stack of two at most")
    for p, (_, subject, body) in sizes.items():
        if len(subject) > SUBJECT_MAX or body > BODY_MAX:
            why.append(f"{p.name[:4]}'s message: subject {len(subject)} characters, body "
                       f"{body} lines (at most {SUBJECT_MAX} and {BODY_MAX})")
    return lines, why


def failed(cell: str) -> bool:
    """Whether a result cell of result_rows() ("2 failed: `why`") counts a failure."""
    return bool(re.search(r"failed|error", cell.split(":")[0]))


def write_pr_md(path: Path, unit: Unit, version: str, tag: str, branch: str, head: str,
                msgs: list[tuple[str, str]], hooks: dict | None, before: dict | None,
                after: dict | None, ident: tuple[str, str], template: Template | None = None,
                builds_on: tuple[list[str], int] = ([], 0), on_base: dict | None = None) -> int:
    """PR.md in the structure of the tag's pull request template; returns its visible words.
    Overview, claims, the before/after evidence and the commands are shown; the reasoning of
    each commit, the full table, the hooks and the exact commands are folded in <details>.
    on_base: a stacked unit's tests on its base units' code (what its own commits fix)."""
    tpl = template or Template(DEFAULT_SECTIONS)
    tested = before is not None and after is not None
    hooks_ok = hooks is not None
    tests = " ".join(unit.tests)
    # tests that pass on the tag too: the unit guards existing behaviour (tests only)
    guards = tested and not any(v[0] in ("failed", "error") for run in (before, on_base or before)
                                for v in run["cases"].values())
    refs = sorted(set(re.findall(r"#\d+", " ".join(unit.threads))), key=lambda r: int(r[1:]))
    # --- what each role says
    overview = [unit.overview or first_sentence(unit.problem)
                or first_sentence(msgs[0][1] if msgs else "") or unit.title]
    refs = [r for r in refs if not re.search(rf"{r}\b", overview[-1])]  # said already
    if refs:
        overview[-1] += " Related: " + ", ".join(refs) + "."
    bases, own = builds_on
    if bases:
        overview += ["", f"Builds on {', '.join(f'`pr/{b}`' for b in bases)}: "
                     + ("its" if len(bases) == 1 else "their") + " commits come "
                     "first; this PR's own change is the last "
                     + (f"{own} commits." if own > 1 else "commit.")]
    claims = [f"- {c}" for c in unit.claims] or [f"- {s}" for s, _ in msgs]
    rows = result_rows(before, after) if tested else []
    where = f"`pr/{bases[0]}`" if len(bases) == 1 else f"its {len(bases)} base units"
    # a stacked unit's tests on its bases' code, by row: what its own commits fix
    on_bases = ({r[0]: r[1] for r in result_rows(on_base, after)}
                if tested and on_base is not None and not guards else None)
    failing = [r for r in rows if failed(r[1])]
    result: list[str] = []
    if not unit.tests:
        result += ["This unit names no tests.", ""]
    elif not tested:
        result += [f"Tests: `{tests}` (not run for this description: `make pr --no-tests`).", ""]
    else:
        n_cases = len(after["cases"])
        n_fail = failing_before(before, after)
        others = "; the others pass on both" if n_fail < n_cases else ""
        verb = "fails on `{}` and passes" if n_fail == 1 else "fail on `{}` and pass"
        cases = f"{n_cases} test case{'s' if n_cases > 1 else ''} in `{tests}`"
        one = n_cases == 1
        result += [f"{cases}: {'it passes' if one else 'they pass'} on `{tag}` and with this "
                   f"change: {'it guards' if one else 'they guard'} existing behaviour." if guards else
                   f"{cases}: {n_fail} " + verb.format(tag) + f" with this change{others}.", ""]
        if on_base is not None and not guards:
            n_base = failing_before(on_base, after)
            result += [f"On {where} alone, {n_base} " + ("fails: this PR's own commits fix it."
                       if n_base == 1 else "fail: this PR's own commits fix them." if n_base
                       else "fail: they test what its bases add."), ""]

        def cut(text: str, n: int) -> str:
            return text[:n] + ("...`" if len(text) > n else "")

        if on_bases is not None:  # what its own commits fix first
            fixed = [r for r in rows if failed(on_bases.get(r[0], ""))]
            failing = fixed + [r for r in failing if r not in fixed]
        shown = failing[:6]
        if shown and on_bases is None:
            result += [f"| test | `{tag}` | this PR |", "| --- | --- | --- |"]
            result += [f"| {a} | {cut(b, 90)} | {c} |" for a, b, c in shown]
            result += [""]
        elif shown:
            # the tag's column is in the fold: on the tag, a stacked unit's tests fail for
            # what its bases add too
            result += ["| test | its bases alone | this PR |", "| --- | --- | --- |"]
            result += [f"| {a} | {cut(on_bases.get(a, 'not run'), 70)} | {c} |"
                       for a, b, c in shown]
            result += [""]
        base_col = on_bases is not None
        result += [] if len(shown) == len(rows) and not base_col else fold(
            f"All {len(rows)} tests, before and after", [
            f"| test | before ({tag}) |" + (f" on {where} |" if base_col else "")
            + f" after ({branch}) |", "| --- | --- |" + (" --- |" if base_col else "") + " --- |",
            *[f"| {a} | {b} |" + (f" {on_bases.get(a, 'not run')} |" if base_col else "")
              + f" {c} |" for a, b, c in rows]])
    result += ["vLLM's pre-commit hooks: "
               + (f"{sum(h['status'] == 'Passed' for h in hooks['results'])} passed on the "
                  f"{len(hooks['files'])} changed file(s)." if hooks else "not run (`--no-hooks`)."),
               ""]
    outcome = (f"passes on {tag} and on this branch" if guards
               else f"fails on {tag}, passes on this branch")
    plan = ["```bash", f"pytest -q {tests}   # {outcome}",
            "```", ""] if unit.tests else []
    exact = [f"git checkout {branch}",
             f"git diff {tag} HEAD -- vllm/ | git apply -R   # the code of {tag}, the branch's tests",
             f"pytest -q {tests}   # {'passes' if guards else 'fails'}",
             "git checkout HEAD -- vllm/   # the branch's code",
             f"pytest -q {tests}   # passes"]
    if tested:
        exact += ["", "# what make pr ran (vLLM's test tree, the installed vLLM with the "
                  "touched files as the tag / the branch has them):",
                  f"# before: {before['seconds']} s, exit {before['rc']}", before["command"],
                  f"# after: {after['seconds']} s, exit {after['rc']}", after["command"]]
        if on_bases is not None:
            exact += [f"# on {where} alone: {on_base['seconds']} s, exit {on_base['rc']}",
                      on_base["command"]]
    plan += fold("The exact commands", ["```bash", *exact, "```"]) if unit.tests else []
    details = [f"{len(msgs)} commit(s); each message says why the change exists (folded "
               "below, one per commit).", ""]
    for i, (subject, body) in enumerate(msgs, 1):
        details += fold(f"{i}. {subject}", [body or "(no message body)"])
    if unit.layouts:
        details += fold("Layouts covered", [f"- {x}" for x in unit.layouts])
    if hooks is not None:
        ran = [h["id"] for h in hooks["results"] if h["status"] == "Passed"]
        other = [h["id"] for h in hooks["results"] if h["status"] != "Passed"]
        details += fold("vLLM's pre-commit hooks", [
            f"{tag}'s .pre-commit-config.yaml on the {len(hooks['files'])} file(s) the branch "
            f"changes: passed: {', '.join(ran) or 'none'}"
            + (f"; no files for: {', '.join(other)}" if other else "") + ".",
            *(["", "Not run here:"] + [f"- `{i}`: {why}" for i, why in hooks["not_run"]]
              if hooks["not_run"] else [])])
    for measured in unit.measured:  # a measurement this unit's reviewers need, its heading the summary
        heading, _, text = measured.read_text().strip().partition("\n")
        details += fold(heading.lstrip("# "), [text.strip()])
    if unit.threads:
        details += fold("Related upstream threads", [f"- {x}" for x in unit.threads])
    # --- the template's sections, in its order
    roles = {section_role(s) for s in tpl.sections}
    content = {
        "overview": overview + ([""] + claims if "claims" not in roles else []),
        "claims": claims,
        "plan": plan,
        "result": result,
        "validation": result + plan + shown_validation(unit),
        "details": details,
    }
    L = [f"# {unit.title}", "",
         f"<!-- generated by `make pr` (scripts/make_pr.py) from patches/{version}/{UNITS_FILE} "
         f"in the structure of {tpl.source or 'vLLM 0.34.0s template'}; branch {branch} = "
         f"{head[:12]} on {tag}, commits signed off by {ident[0]} <{ident[1]}> -->", ""]
    placed = set()
    for s in tpl.sections:
        role = section_role(s)
        if role in placed:
            body = ["(see above)"]
        else:
            body = content.get(role) or ["(nothing for this section)"]
        placed.add(role)
        L += [f"## {s}", "", *body, ""]
    if "details" not in roles:
        L += details
    if tpl.checklist:
        L += ["---", "", "<details>", f"<summary> {tpl.checklist_summary} </summary>", ""]
        for item in tpl.checklist:
            ok, why = checklist_state(item, tested, hooks_ok, guards)
            L += [f"- [{'x' if ok else ' '}] {item}" + (f" <!-- {why} -->" if why else "")]
        L += ["</details>", ""]
    if tpl.tail:
        L += [tpl.tail, ""]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(L))
    path.write_text(text)
    (path.parent / "PUSH.md").write_text("\n".join([
        f"# Opening {branch} as a PR from a fork", "",
        "The branch is on the pristine release tag; rebase it onto upstream main before "
        "pushing (vLLM takes PRs against main):", "", "```bash",
        f"cd {rel(path.parent.parent / 'repo')}",
        "git remote add upstream https://github.com/vllm-project/vllm.git",
        "git remote add fork https://github.com/<you>/vllm.git",
        "git fetch upstream main",
        f"git rebase upstream/main {branch}   # the commits keep their Signed-off-by",
        "pre-commit run --from-ref upstream/main --to-ref HEAD   # vLLM's hooks, online",
        f"git push -u fork {branch}", "```", "",
        f"Title: `{unit.title}`. Body: `{rel(path)}`. The commits as patch files: "
        f"`{rel(path.parent / 'patches')}/` (`git am` them onto another tree).", ""]))
    return visible_words(text)


# ----------------------------------------------------------------------------- main
def results_key(head: str, unit: Unit, hooks_cfg: str, own: list[Path]) -> str:
    """What the last run's results depend on; own: the unit's own patches (the others are
    its bases', whose code its tests also ran on)."""
    import hashlib

    stamp = VENV / "hma-wheel.json"
    h = hashlib.sha256()
    for part in (head, "\0".join(unit.tests), hooks_cfg, "\0".join(p.name for p in own),
                 stamp.read_text() if stamp.exists() else str(VENV)):
        h.update(part.encode() + b"\1")
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("units", nargs="*", help="unit names (default: every unit)")
    ap.add_argument("--list", action="store_true", help="list the units and exit")
    ap.add_argument("--no-hooks", action="store_true", help="skip vLLM's pre-commit hooks")
    ap.add_argument("--no-tests", action="store_true", help="skip the before/after tests")
    ap.add_argument("--rerun", action="store_true",
                    help="run hooks and tests again even when nothing changed")
    opts = ap.parse_args()
    version = vllm_version()
    pin = load_pin(version)
    tag = pin["tag"]
    all_units = load_units(version)
    glue = load_glue(version)
    units = select(all_units, opts.units)
    template = None
    if opts.list:
        for u in units:
            lines, why = review_limits(u, all_units, glue)
            base = builds_on(u, all_units)[0]
            print(f"{u.name:24s} {lines:5d} lines{' on ' + ', '.join(base) if base else ''}"
                  f"{'  OVER: ' + '; '.join(why) if why else ''}\n{'':24s} {u.title}  "
                  f"({', '.join(p.name[:4] for p in u.patches)})")
        return
    ident = identity()
    checkout = checkout_dir(version)
    check_prerequisites(version, checkout, needs_venv=not opts.no_tests
                        and any(u.tests for u in units))
    out_root = PR_ROOT / version
    repo = out_root / "repo"
    say(f"vLLM {version}: {len(units)} unit(s), signed off by {ident[0]} <{ident[1]}>")
    ensure_repo(checkout, repo, tag, ident)
    check_repo_clean(repo)
    for u in units:  # refuse before building anything
        check_branch_is_ours(repo, f"pr/{u.name}", u.name)
    touched = None
    pristine_site = None
    summary, over = [], []
    with Timer() as total:
        for unit in units:
            branch = f"pr/{unit.name}"
            out = out_root / unit.name
            out.mkdir(parents=True, exist_ok=True)
            old = check_branch_is_ours(repo, branch, unit.name)
            with Timer() as t:
                head = build_branch(repo, tag, unit, ident)
            state = ("unchanged" if head == old else f"rebuilt (was {old[:12]})" if old
                     else "new")
            say(f"{branch}: {len(unit.patches)} commit(s), HEAD {head[:12]}, {state} "
                f"({t.elapsed:.1f} s)")
            fp = out / "patches"
            shutil.rmtree(fp, ignore_errors=True)
            fp.mkdir()
            git(*FORMAT_PATCH_ARGS, "-o", str(fp), f"{tag}..{branch}", cwd=repo)
            files = git("diff", "--name-only", "--diff-filter=AMR", tag, branch, cwd=repo).split()
            prev = {}
            res_file = out / "results.json"
            if res_file.exists():
                prev = json.loads(res_file.read_text())
            hooks = None
            hooks_cfg = ""
            if not opts.no_hooks:
                import pr_hooks

                hooks_cfg = pr_hooks.config_digest(repo)
            own = own_patches(unit, all_units)
            key = results_key(head, unit, hooks_cfg, own)
            reuse = prev.get("key") == key and not opts.rerun
            if not opts.no_hooks:
                if reuse and prev.get("hooks"):
                    hooks = prev["hooks"]
                    say(f"  hooks: same branch and hook config as the last run, "
                        f"{sum(h['status'] == 'Passed' for h in hooks['results'])} passed "
                        "then (--rerun runs them again)")
                else:
                    hooks = pr_hooks.run(repo, files, out, branch)
            before = after = on_base = None
            if unit.tests and not opts.no_tests:
                if reuse and prev.get("before") and prev.get("after") and "on_base" in prev:
                    before, after, on_base = prev["before"], prev["after"], prev["on_base"]
                    say("  tests: same branch, tests and venv as the last run; results "
                        "reused (--rerun runs them again)")
                else:
                    if not (VENV / "bin" / "python").exists():
                        raise UserError(f"no {rel(VENV)} to run unit {unit.name!r}'s tests; "
                                        f"`{make_command('apply', version)}` builds it (or "
                                        "run make pr PR_ARGS=--no-tests)")
                    if touched is None:
                        touched = touched_by_track(checkout, tag)
                    mine = set(git("diff", "--name-only", "--no-renames", tag, branch, "--",
                                   "vllm/", cwd=repo).split())
                    if pristine_site is None or not mine <= touched:
                        touched |= mine
                        pristine_site = build_site(out_root / "site-pristine", repo, tag, touched)
                    site = build_site(out / "site", repo, branch, touched)
                    testroot = out / "testroot"
                    prepare_testroot(repo, branch, testroot)
                    before = run_tests("before", pristine_site, testroot, unit.tests, out)
                    after = run_tests("after", site, testroot, unit.tests, out)
                    if len(own) < len(unit.patches):  # stacked: its tests on its bases too
                        rev = base_code(repo, tag, unit, own, glue)
                        on_base = run_tests("on-base", build_site(out / "site-base", repo, rev,
                                                                  touched),
                                            testroot, unit.tests, out)
                        if on_base["rc"] not in (0, 1) and not on_base["cases"]:
                            raise UserError(
                                f"unit {unit.name!r}: its tests did not run on its bases' "
                                f"code (exit {on_base['rc']}; "
                                f"{rel(out / 'tests-on-base.log')})")
            res_file.write_text(json.dumps({"key": key, "head": head, "hooks": hooks,
                                            "before": before, "after": after,
                                            "on_base": on_base}, indent=1))
            msgs = commit_messages(repo, tag, branch)
            if template is None:
                template = read_template(repo, tag)
            words = write_pr_md(out / "PR.md", unit, version, tag, branch, head, msgs, hooks,
                                before, after, ident, template, builds_on(unit, all_units),
                                on_base)
            if words > VISIBLE_WORDS:
                say(f"  warning: {rel(out / 'PR.md')} shows {words} words before any "
                    f"<details> (at most {VISIBLE_WORDS}: shorten the unit's overview/claims)")
            verdict = ""
            if after is not None:
                bad_after = [k for k, v in after["cases"].items() if v[0] in ("failed", "error")]
                n_before = failing_before(before, after)
                if bad_after or not after["cases"] or after["rc"] not in (0,):
                    raise UserError(
                        f"unit {unit.name!r}: its tests do not pass on {branch} ({len(bad_after)} "
                        f"failed, exit {after['rc']}; {rel(out / 'tests-after.log')}). The unit "
                        "probably lacks a patch its tests need: add it to the unit")
                verdict = (f"; tests: {n_before} failing before, all "
                           f"{len(after['cases'])} passing after")
                if n_before == 0:
                    say(f"  warning: no test of unit {unit.name!r} fails on {tag}: the PR shows "
                        "no regression test")
                if on_base is not None:
                    n_base = failing_before(on_base, after)
                    verdict += f", {n_base} failing on its bases alone"
                    if n_base == 0 and n_before:
                        say(f"  warning: no test of unit {unit.name!r} fails on its base units' "
                            "code: the PR shows no test of its own change")
            lines, why = review_limits(unit, all_units, glue)
            if why:
                over.append(f"{unit.name}: " + "; ".join(why))
            summary.append(f"{branch:28s} {head[:12]} {state.split()[0]:9s} "
                           f"{rel(out / 'PR.md')} ({words} words shown, {lines} lines)"
                           f"{verdict}")
    say(f"done in {total.elapsed:.0f} s; branches in {rel(repo)}:")
    for line in summary:
        print(f"    {line}")
    print(f"    patch files: {rel(out_root)}/<unit>/patches/")
    if over:
        raise UserError(f"{len(over)} unit(s) too large for one review (the branches are "
                        "built; split the units in pr-units.toml):\n  " + "\n  ".join(over))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    run_main(main)
