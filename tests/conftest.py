"""Fixtures for the project's own tests: they run the real scripts, as a user would."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def run_script(root: Path, name: str, *args, env: dict | None = None, **kw):
    """Run scripts/<name> with the system Python, as the Makefile does."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, str(root / "scripts" / name), *args],
        cwd=root, env=full_env, capture_output=True, text=True, **kw,
    )


@pytest.fixture
def project_copy(tmp_path) -> Path:
    """A copy of the project as a fresh clone has it (no build/, no .venv), so a test can
    build and break its own checkout without touching the real one."""
    dest = tmp_path / "project"
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        "build", ".venv*", ".git", "__pycache__", ".pytest_cache"))
    return dest
