"""run_tests.py's pytest-xdist mode, through the real hma_pytest plugin on a tiny test tree:
the deadline-bound tests (hma_serial.SERIAL) are split off the xdist part, and the /dev/shm
regions the tests leave are removed by the controller, after every worker has finished, not
by a worker (which would remove regions another worker still uses)."""

import glob
import os
import re
import subprocess
import uuid

import pytest
from conftest import ROOT

VENV_PY = ROOT / ".venv" / "bin" / "python"
FAKE = """\
import uuid

TAG = {tag!r}


def _leak():
    open(f"/dev/shm/vllm_offload_{{TAG}}-{{uuid.uuid4().hex}}.mmap", "wb").close()


def test_multi_worker_race_leaks():
    _leak()


def test_plain_leaks():
    _leak()


def test_plain_also_leaks():
    _leak()


def test_plain_leaks_too():
    _leak()
"""


def removed(out: str) -> int:
    m = re.search(r"removed (\d+) CPU offloading region\(s\)", out)
    return int(m.group(1)) if m else 0


def have_xdist() -> bool:
    return VENV_PY.exists() and subprocess.run(
        [VENV_PY, "-c", "import xdist"], capture_output=True).returncode == 0


@pytest.mark.skipif(not have_xdist(), reason="needs .venv with pytest-xdist (make apply)")
def test_xdist_part_leaves_serial_tests_out_and_the_controller_cleans_up(tmp_path):
    tag = f"hma-xdist-test-{uuid.uuid4().hex[:8]}"
    d = tmp_path / "tests" / "v1" / "kv_offload" / "cpu"
    d.mkdir(parents=True)
    (d / "test_shared_offload_region.py").write_text(FAKE.format(tag=tag))
    overlay = tmp_path / "overlay"  # no vllm/ files: the patched-vLLM check has nothing to compare
    overlay.mkdir()
    env = dict(os.environ, HMA_OVERLAY=str(overlay),
               PYTHONPATH=str(ROOT / "scripts" / "pytest_plugins"))
    env.pop("HMA_UNPATCHED", None)

    def pytest_run(part, *args):
        r = subprocess.run([VENV_PY, "-m", "pytest", "-p", "hma_pytest", "-p", "no:cacheprovider",
                            "-q", *args, "tests"], cwd=tmp_path, capture_output=True, text=True,
                           env=dict(env, HMA_PART=part))
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    try:
        out = pytest_run("parallel", "-n", "2")
        assert "3 passed in" in out, out  # (workers deselect: the controller does not count it)
        # every worker's regions, removed by the controller (a worker's output is not shown;
        # other sessions running on the machine may add theirs to the count)
        assert removed(out) >= 3, out
        assert not glob.glob(f"/dev/shm/vllm_offload_{tag}-*")

        out = pytest_run("serial")
        assert "1 passed, 3 deselected" in out, out
        assert removed(out) >= 1, out
        assert not glob.glob(f"/dev/shm/vllm_offload_{tag}-*")
    finally:
        for path in glob.glob(f"/dev/shm/vllm_offload_{tag}-*"):
            os.remove(path)
