#!/usr/bin/env python3
"""Run the test groups with HF_HUB_OFFLINE=1 and print one summary.

Groups:
  project     this project's own tests (tests/)
  regression  the tests our series adds or changes in vLLM (vllm_overlay/tests/)
  upstream    vLLM's own tests for this area, from the patched checkout
  e2e         the CI-sized end-to-end run on the real engine (e2e/test_e2e.py)

Usage: run_tests.py [--unpatched] [GROUP ...]
--unpatched runs against pristine vLLM: by default the regression group, which is expected
to fail; `--unpatched upstream` gives the pristine baseline of vLLM's own tests.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from _lib import BUILD, OVERLAY, ROOT, VENV, UserError, checkout_dir, load_pin, run_main, say

UPSTREAM_PATHS = [
    "tests/v1/kv_offload",
    "tests/v1/kv_connector/unit/offloading_connector",
    "tests/v1/kv_connector/unit/test_offloading_connector.py",
]
TESTROOT = BUILD / "testroot"
HF_HOME = BUILD / "hf-home"
OPT_FIXTURE = ROOT / "tests" / "fixtures" / "facebook--opt-125m"


def prepare_testroot(rev: str | None = None) -> None:
    """vLLM's tests run from a copy of the checkout's tests/ without its vllm/ source:
    tests/__init__.py makes pytest put the checkout root on sys.path, and the source tree
    there lacks the compiled parts of the installed wheel. rev=None copies the work tree;
    a tag copies that commit (pristine upstream tests for the baseline)."""
    repo = checkout_dir()
    if not (repo / "tests").exists():
        raise UserError(f"no checkout at {repo}; run `make apply` first")
    shutil.rmtree(TESTROOT, ignore_errors=True)
    TESTROOT.mkdir(parents=True)
    if rev is None:
        shutil.copytree(repo / "tests", TESTROOT / "tests")
        shutil.copy(repo / "pyproject.toml", TESTROOT)
        return
    archive = subprocess.run(["git", "archive", rev, "tests", "pyproject.toml"], cwd=repo,
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "x"], cwd=TESTROOT, input=archive, check=True)


def prepare_hf_home() -> None:
    """facebook/opt-125m's config.json laid out as a hub cache, so upstream tests that
    build a ModelConfig for it run offline (they need no weights)."""
    repo = HF_HOME / "hub" / "models--facebook--opt-125m"
    rev = "0" * 37 + "125"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)
    shutil.copy(OPT_FIXTURE / "config.json", snap / "config.json")


def regression_tests() -> list[str]:
    return sorted(str(p.relative_to(OVERLAY)) for p in (OVERLAY / "tests").rglob("test_*.py"))


def env_for(unpatched: bool) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(HF_HOME))
    paths = [str(ROOT / "scripts" / "pytest_plugins")]
    if unpatched:
        from unpatched_site import build

        paths.insert(0, build())
        env["HMA_UNPATCHED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_group(name: str, args: list[str], cwd: Path, env: dict, extra: list[str]) -> dict:
    xml = BUILD / f"junit-{name}.xml"
    cmd = [str(VENV / "bin" / "python"), "-m", "pytest", "-p", "hma_pytest",
           "-p", "no:cacheprovider", "-rfEs", f"--junitxml={xml}", *extra, *args]
    say(f"[{name}] {' '.join(cmd[2:])}")
    t0 = time.monotonic()
    rc = subprocess.run(cmd, cwd=cwd, env=env).returncode
    counts = {"passed": 0, "failed": 0, "skipped": 0, "rc": rc, "seconds": time.monotonic() - t0}
    if xml.exists():
        for suite in ET.parse(xml).getroot().iter("testsuite"):
            tests = int(suite.get("tests", 0))
            failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped = int(suite.get("skipped", 0))
            counts["failed"] += failed
            counts["skipped"] += skipped
            counts["passed"] += tests - failed - skipped
    if rc not in (0, 1) and counts["failed"] == 0:
        counts["failed"] = 1  # pytest itself failed: usage error, abort, or no tests (5)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--unpatched", action="store_true")
    ap.add_argument("groups", nargs="*")
    opts = ap.parse_args()
    groups = opts.groups or (["regression"] if opts.unpatched else
                             ["project", "regression", "upstream", "e2e"])
    if not (VENV / "bin" / "python").exists():
        raise UserError("no .venv; run `make apply` first")
    prepare_hf_home()
    env = env_for(opts.unpatched)
    results = {}
    for g in groups:
        if g == "project":
            results[g] = run_group(g, ["tests"], ROOT, env, [])
        elif g == "regression":
            if not regression_tests():
                raise UserError("vllm_overlay/tests/ holds no test_*.py; run `make patches`")
            prepare_testroot()
            extra = ["--tb=short"] if opts.unpatched else []
            results[g] = run_group(g, regression_tests(), TESTROOT, env, extra)
        elif g == "upstream":
            if opts.unpatched:  # the baseline: pristine tests on pristine vLLM
                prepare_testroot(load_pin()["tag"])
                ignore = []
            else:  # the tests the series changes run in the regression group
                prepare_testroot()
                ignore = [f"--ignore={t}" for t in regression_tests()]
            results[g] = run_group(g, UPSTREAM_PATHS, TESTROOT, env, ignore)
        elif g == "e2e":
            if not (ROOT / "e2e" / "test_e2e.py").exists():
                continue
            results[g] = run_group(g, ["e2e/test_e2e.py"], ROOT, env, [])
        else:
            raise UserError(f"unknown test group {g!r}; groups: project, regression, upstream, e2e")
    print("\n==== summary" + (" (pristine vLLM, expected to fail)" if opts.unpatched else "") + " ====")
    for g, c in results.items():
        print(f"{g:11s} {c['passed']:4d} passed, {c['failed']:3d} failed, {c['skipped']:3d} skipped"
              f"   ({c['seconds']:.0f} s)")
    total = {k: sum(c[k] for c in results.values()) for k in ("passed", "failed", "skipped")}
    print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    bad = total["failed"] or any(c["rc"] != 0 for c in results.values())
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    run_main(main)
