"""Shared helpers for the scripts: the pin, the cache, and a failure that reads as a sentence."""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINS = ROOT / "pins"
BUILD = ROOT / "build"
TARGETS = ("cpu", "cuda")
# One series per pinned release, each in its own folders, so no command of one track can
# write over the other: patches/<version>/, vllm_overlay/<version>/, build/vllm[-<version>],
# .venv[-<version>]. SERIES_VERSION is the default track (the operators' fork); the newest
# pinned release is the upstream track (the PRs). VLLM_VERSION selects a track.
SERIES_VERSION = "0.22.1"


class UserError(Exception):
    """A failure the user can act on; main() prints it as one sentence, no traceback."""


def say(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def run_main(fn) -> None:
    try:
        fn()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        # One line, no traceback; every step is safe to run again (downloads land in the
        # cache only once verified, the checkout and .venv are rebuilt or resumed).
        print(f"\ninterrupted: {Path(sys.argv[0]).name} stopped; run the same command again "
              "to resume", file=sys.stderr)
        sys.exit(130)


def vllm_version() -> str:
    return os.environ.get("VLLM_VERSION") or SERIES_VERSION


def series_dir(version: str) -> Path:
    return ROOT / "patches" / version


def overlay_dir(version: str) -> Path:
    return ROOT / "vllm_overlay" / version


def venv_dir(version: str) -> Path:
    """.venv for the default track (the path operators and the e2e harness use), else
    .venv-<version>: the environments of both tracks live side by side."""
    return ROOT / ".venv" if version == SERIES_VERSION else ROOT / f".venv-{version}"


def checkout_dir(version: str | None = None) -> Path:
    """build/vllm for the default track; build/vllm-<version> for another release."""
    version = version or vllm_version()
    return BUILD / "vllm" if version == SERIES_VERSION else BUILD / f"vllm-{version}"


def rel(path: Path) -> str:
    """A project path as the user sees it (relative to the clone), others in full."""
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def series_versions() -> list[str]:
    return sorted((p.name for p in (ROOT / "patches").iterdir() if p.is_dir()),
                  key=lambda v: tuple(int(x) for x in v.split(".")))


def series_of(version: str) -> str:
    """The track whose series a release applies: its own, or the one its pin names with
    `series = "<version>"` (patches/<version>/, vllm_overlay/<version>/; `make patches` never
    writes them from the borrowing release). No pin borrows today: vLLM 0.32.0 lends the
    upstream track its compiled ops (pins/vllm-0.34.0.toml: cpu_engine) and has no series."""
    path = PINS / f"vllm-{version}.toml"
    if not path.exists():
        return version  # load_pin() names the known versions when a script needs the pin
    with path.open("rb") as f:
        return tomllib.load(f).get("series", version)


def borrowed_series(version: str | None = None) -> str | None:
    """The other track whose series this release applies, or None (it has its own)."""
    version = version or vllm_version()
    other = series_of(version)
    return other if other != version else None


# The selected track's folders (VLLM_VERSION is read once, when a script starts).
CHECKOUT = checkout_dir(SERIES_VERSION)
PATCHES = series_dir(series_of(vllm_version()))
OVERLAY = overlay_dir(series_of(vllm_version()))
VENV = venv_dir(vllm_version())


def target() -> str:
    """TARGET, else the pin's default_target (cpu where the release has a CPU build)."""
    pin = load_pin()
    t = os.environ.get("TARGET") or pin.get("default_target", "cpu")
    if t not in TARGETS:
        raise UserError(f"unknown TARGET={t!r}; valid targets: {', '.join(TARGETS)}")
    if t not in pin["artifacts"]:
        have = [k for k in TARGETS if k in pin["artifacts"]]
        raise UserError(f"vLLM {pin['version']} has no {t} build pinned ({pin['pin_file'].name}); "
                        f"use TARGET={'|'.join(have)}")
    return t


def load_pin(version: str | None = None) -> dict:
    version = version or vllm_version()
    path = PINS / f"vllm-{version}.toml"
    if not path.exists():
        known = sorted(p.stem.removeprefix("vllm-") for p in PINS.glob("vllm-*.toml"))
        raise UserError(
            f"no pin for VLLM_VERSION={version} (no {path.relative_to(ROOT)}); "
            f"pinned versions: {', '.join(known)}. To try another release, copy a pin "
            f"file to pins/vllm-<version>.toml and fill in its artifact hashes"
        )
    with path.open("rb") as f:
        pin = tomllib.load(f)
    pin["pin_file"] = path
    return pin


def cache_dir() -> Path:
    """Downloads live outside the clone so fresh clones on one machine share them."""
    env = os.environ.get("VLLM_HMA_CACHE")
    if env:
        d = Path(env)
    else:
        d = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-hma-tiering"
    d.mkdir(parents=True, exist_ok=True)
    return d


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sh(cmd: list, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("check", True)
    return subprocess.run([str(c) for c in cmd], **kw)


def git_env() -> dict:
    env = dict(os.environ)
    # Commits made by the scripts are reproducible: same author, same date.
    env.update(
        GIT_AUTHOR_NAME=env.get("GIT_AUTHOR_NAME", "vllm-hma-tiering"),
        GIT_AUTHOR_EMAIL=env.get("GIT_AUTHOR_EMAIL", "vllm-hma-tiering@localhost"),
        GIT_COMMITTER_NAME="vllm-hma-tiering",
        GIT_COMMITTER_EMAIL="vllm-hma-tiering@localhost",
        GIT_COMMITTER_DATE="2026-01-01T00:00:00+00:00",
    )
    return env


def git(*args, cwd: Path = CHECKOUT, capture: bool = True, check: bool = True,
        strip: bool = True) -> str:
    r = subprocess.run(
        ["git", *args], cwd=cwd, env=git_env(), text=True,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.PIPE if capture else None,
    )
    if check and r.returncode != 0:
        raise UserError(f"git {' '.join(args)} failed in {cwd}: {(r.stderr or '').strip()}")
    out = r.stdout or ""
    # strip=False for line formats whose first column matters (`status --porcelain`).
    return out.strip() if strip else out


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


class Timer:
    def __enter__(self):
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.monotonic() - self.t0


# pip repeats this for every requirement when a configured --find-links folder is missing;
# it says nothing about our install. Everything else pip prints is kept.
PIP_NOISE = re.compile(r"^WARNING: Location .* is ignored")
PROGRESS_EVERY_S = 15


def run_quiet(cmd: list, label: str, *, show: bool = True, **kw) -> tuple[int, list[str]]:
    """Run cmd with its output captured; print a progress line every PROGRESS_EVERY_S
    seconds, then (show=True) the lines it printed, less pip's noise. Returns (rc, lines)."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", **kw)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    t0 = last = time.monotonic()
    try:
        while proc.poll() is None:
            time.sleep(0.5)
            now = time.monotonic()
            if now - last >= PROGRESS_EVERY_S:
                print(f"    ... {label}: {now - t0:.0f} s", flush=True)
                last = now
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    reader.join()
    kept = [ln.rstrip("\n") for ln in lines if ln.strip() and not PIP_NOISE.match(ln)]
    if show:
        for ln in kept:
            print(f"    {ln}", flush=True)
    return proc.returncode, kept
