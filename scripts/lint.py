#!/usr/bin/env python3
"""Run vLLM's own ruff (version and settings of the pinned checkout) on the files we touch."""

from _lib import VENV, UserError, checkout_dir, git, load_pin, run_main, say, sh


def main() -> None:
    pin = load_pin()
    repo = checkout_dir(pin["version"])
    files = [f for f in git("diff", "--name-only", "--diff-filter=AM", pin["tag"], cwd=repo).split()
             if f.endswith(".py")]
    if not files:
        raise UserError("the series touches no Python file; nothing to lint")
    ruff = VENV / "bin" / "ruff"
    say(f"ruff check + format --check on {len(files)} file(s)")
    ok = sh([ruff, "check", *files], cwd=repo, check=False).returncode == 0
    ok &= sh([ruff, "format", "--check", *files], cwd=repo, check=False).returncode == 0
    if not ok:
        raise UserError(f"ruff found problems; fix them in {repo}, or `ruff format` there")


if __name__ == "__main__":
    run_main(main)
