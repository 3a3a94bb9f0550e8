"""The README and docs/ say only what exists and runs: every `make` target and project file
they name exists, the README's `make` commands run as written (dry run: `make -n`, and
`make help` for real), and the README stays a front door (at most 150 lines)."""

import os
import re
import shlex
import subprocess

import pytest
from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-z0-9][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))


def code(text: str) -> list[str]:
    """Inline code spans and fenced blocks: where the docs name commands and files."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    rest = re.sub(r"```[a-z]*\n.*?```", " ", text, flags=re.S)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


def sh_commands(text: str) -> list[str]:
    """The `make` command lines of the ```sh blocks (comments and placeholders dropped)."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;", line.split(" #", 1)[0]):
                part = part.strip()
                if "make" not in part.split() or "<" in part:
                    continue
                words = shlex.split(part)
                i = next((k for k, w in enumerate(words) if "=" not in w), None)
                if i is not None and words[i] == "make":
                    out.append(part)
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_make_target_the_docs_name_exists(doc):
    named = {m for c in code(doc.read_text())
             for m in re.findall(r"(?:^|[\s(;&|])make ([a-z][a-z0-9-]*)", c)}
    assert named, f"{doc.name} names no make target"
    missing = sorted(named - makefile_targets())
    assert not missing, f"{doc.name} names make targets the Makefile lacks: {missing}"


def vllm_path(path: str) -> bool:
    """A path in vLLM's tree (its tests/v1/...), or a placeholder (X.Y.Z): it exists in an
    overlay or a checkout of a track."""
    if "X.Y.Z" in path:
        return True
    trees = [*(ROOT / "vllm_overlay").iterdir(), *(ROOT / "build").glob("vllm*")]
    return any((tree / path).exists() for tree in trees)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_project_file_the_docs_name_exists(doc):
    text = doc.read_text()
    paths = {p for c in code(text) for p in re.findall(
        r"(?<![\w/.-])((?:scripts|tests|e2e|bench|ci|pins|requirements|patches|docs)/"
        r"[\w./-]*\.(?:py|toml|txt|md|yml|yaml|sh))", c) if "<" not in p}
    links = {m for m in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in m}
    missing = sorted(p for p in paths if not (ROOT / p).exists() and not vllm_path(p))
    missing += sorted(m for m in links if not (doc.parent / m).exists())
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    text = "\n".join(lines)
    for doc in ("docs/operators.md", "docs/contributors.md", "docs/testing.md",
                "docs/benchmark.md", "docs/series.md"):
        assert f"]({doc})" in text, f"the README's map does not link {doc}"


def test_make_help_lists_every_target_the_readme_lists():
    r = subprocess.run(["make", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    listed = set(re.findall(r"^  make (\S+)", r.stdout, re.M))
    readme = (ROOT / "README.md").read_text()
    in_readme = set(re.findall(r"^make ([a-z][a-z0-9-]*) ", readme, re.M))
    assert in_readme and in_readme <= listed, sorted(in_readme - listed)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_make_commands_run_as_written(doc):
    """Each `make` line of a ```sh block, as a dry run (`make -n`: the target exists, its
    variables parse, nothing runs)."""
    for line in sh_commands(doc.read_text()):
        words = shlex.split(line)
        i = words.index("make")
        env = dict(os.environ, **dict(w.split("=", 1) for w in words[:i]))
        cmd = ["make", "-n", *words[i + 1:]]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{doc.name}: `{line}` as a dry run: {r.stderr.strip()}"
