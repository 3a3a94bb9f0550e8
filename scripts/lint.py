#!/usr/bin/env python3
"""Run vLLM's own ruff (the version its pre-commit config pins, the settings of the pinned
checkout) on the files we touch."""

import re
import sys
from pathlib import Path

from _lib import BUILD, UserError, checkout_dir, git, load_pin, run_main, say, sh


def pinned_ruff(repo: Path) -> Path:
    """The ruff of the checkout's .pre-commit-config.yaml (a `rev: vX.Y.Z`, or a frozen SHA
    with `# frozen: vX.Y.Z`), installed once into build/ruff-<version>/ from PyPI."""
    config = (repo / ".pre-commit-config.yaml").read_text()
    m = re.search(r"astral-sh/ruff-pre-commit\s*\n\s*rev:\s*(?:v([\d.]+)|\S+\s*#\s*frozen:\s*v([\d.]+))",
                  config)
    if not m:
        raise UserError(f"{repo}/.pre-commit-config.yaml names no ruff version; lint needs "
                        "vLLM's own (its ruff-pre-commit rev)")
    version = m.group(1) or m.group(2)
    venv = BUILD / f"ruff-{version}"
    ruff = venv / "bin" / "ruff"
    if not ruff.is_file():
        say(f"installing ruff=={version} (vLLM's pre-commit pin) into {venv.relative_to(BUILD.parent)}")
        sh([sys.executable, "-m", "venv", str(venv)])
        sh([str(venv / "bin" / "pip"), "install", "-q", f"ruff=={version}"])
    return ruff


def main() -> None:
    pin = load_pin()
    repo = checkout_dir(pin["version"])
    files = [f for f in git("diff", "--name-only", "--diff-filter=AM", pin["tag"], cwd=repo).split()
             if f.endswith(".py")]
    if not files:
        raise UserError("the series touches no Python file; nothing to lint")
    ruff = pinned_ruff(repo)
    say(f"ruff check + format --check on {len(files)} file(s)")
    ok = sh([ruff, "check", *files], cwd=repo, check=False).returncode == 0
    ok &= sh([ruff, "format", "--check", *files], cwd=repo, check=False).returncode == 0
    if not ok:
        raise UserError(f"ruff found problems; fix them in {repo}, or `ruff format` there")


if __name__ == "__main__":
    run_main(main)
