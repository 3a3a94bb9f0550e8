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
    assert "vllm-project/vllm#12345" in pr_md and "git rebase upstream/main pr/x-and-y" in pr_md
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
