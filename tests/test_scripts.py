"""The scripts import each other in one direction only: shared functions live in _lib.py and
_series.py, never in another script's entry point."""

import ast

from conftest import ROOT

SCRIPTS = ROOT / "scripts"


def script_imports() -> dict[str, set[str]]:
    """{module: scripts it imports anywhere in its body (lazy imports inside functions too)}."""
    names = {p.stem for p in SCRIPTS.glob("*.py")}
    graph = {}
    for p in SCRIPTS.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module.split(".")[0])
        graph[p.stem] = (deps & names) - {p.stem}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_scripts_form_no_import_circle():
    graph = script_imports()
    assert {"check_sync", "make_env", "make_wheel", "sync_site"} <= graph.keys()
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_circle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_summary_counts_strict_xfails_as_xfailed(tmp_path):
    """run_tests.py reads pytest's junit xml: an expected failure (strict or not) is
    "xfailed" in the summary, a skip "skipped", a strict xfail that passes a failure."""
    import subprocess
    import sys

    import run_tests

    (tmp_path / "test_outcomes.py").write_text(
        "import pytest\n"
        "def test_pass(): pass\n"
        "def test_fail(): assert False, 'boom'\n"
        "@pytest.mark.skip(reason='no')\ndef test_skip(): pass\n"
        "@pytest.mark.xfail(strict=True, reason='known')\ndef test_xfail_strict(): assert False\n"
        "@pytest.mark.xfail(reason='known')\ndef test_xfail(): assert False\n"
        "@pytest.mark.xfail(strict=True, reason='known')\ndef test_xpass_strict(): pass\n")
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={xml}", "test_outcomes.py"], cwd=tmp_path, capture_output=True)
    c = run_tests.count_junit(xml)
    assert (c["passed"], c["failed"], c["skipped"], c["xfailed"]) == (1, 2, 1, 2)
    assert run_tests.summary_line(c) == "   1 passed,   2 failed,   1 skipped, 2 xfailed"
