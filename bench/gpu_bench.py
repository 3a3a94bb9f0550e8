#!/usr/bin/env python3
"""make bench-gpu: the benchmark on a GPU runner.

Without a GPU (torch.cuda.is_available() is False) it prints "no GPU" and exits 0.
With one, it runs `make bench` (scheduler side and disk tier do not need the GPU) and states
that the end-to-end cold-restart time-to-first-token comparison on real models is not
implemented yet (issue 9, section 4).
"""

import subprocess
from pathlib import Path

from common import VENV_PY, check_venv, run_main, say

HERE = Path(__file__).resolve().parent


def main() -> int:
    check_venv()
    probe = subprocess.run(
        [str(VENV_PY), "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
    )
    if probe.stdout.strip().splitlines()[-1:] != ["True"]:
        print("no GPU")
        return 0
    say(
        "GPU found: running the CPU-side benchmark; the end-to-end time to first token "
        "after a cold restart (disk tier vs recompute) is not implemented yet"
    )
    return subprocess.call([str(VENV_PY), str(HERE / "run_bench.py")])


if __name__ == "__main__":
    run_main(main)
