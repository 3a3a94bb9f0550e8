#!/usr/bin/env python3
"""Fail when the selected track's series (patches/<version>/) and overlay
(vllm_overlay/<version>/) disagree, or its venv does not hold the patched files (pip's vllm
must be the series' wheel, its RECORD true for every patched file).

The series is applied to the pristine tag in a scratch git index (the checkout's objects,
not its work tree), and every file it yields must equal the overlay byte for byte, with no
extra file on either side.
"""

from _lib import (
    OVERLAY, PATCHES, ROOT, VENV, UserError, borrowed_series, checkout_dir, load_pin, rel,
    run_main, say, target,
)
from _series import (  # noqa: F401  (series_files: tests and older callers import it from here)
    env_stamp, installed_version, local_version, record_problems, series_files, site_packages,
)
from apply import series


def main() -> None:
    pin = load_pin()
    repo = checkout_dir(pin["version"])
    if not (repo / ".git").exists():
        raise UserError(f"no checkout at {rel(repo)}: `VLLM_VERSION={pin['version']} make checkout` "
                        "makes one (the series is checked against the pristine tag)")
    if not PATCHES.is_dir():
        raise UserError(f"vLLM {pin['version']} has no series ({PATCHES.relative_to(ROOT)}/); "
                        "a port is exported there by `make patches`")
    expected = series_files(repo, pin["tag"])
    series_name, overlay_name, venv_name = (rel(x) + "/" for x in (PATCHES, OVERLAY, VENV))
    actual = {str(p.relative_to(OVERLAY)): p.read_bytes()
              for p in OVERLAY.rglob("*") if p.is_file()}
    problems = [f"{n}: in {series_name}, missing from {overlay_name}" for n in expected.keys() - actual.keys()]
    problems += [f"{n}: in {overlay_name}, not in {series_name}" for n in actual.keys() - expected.keys()]
    if not borrowed_series():
        # A borrowed series' overlay is its own track's files (the patches applied on that
        # tag): on this release's tag the same patches give other bytes wherever upstream
        # changed the file in between, so only the file list is compared.
        problems += [f"{n}: differs between {series_name} and {overlay_name}"
                     for n in expected.keys() & actual.keys() if expected[n] != actual[n]]
    if problems:
        raise UserError(
            f"{series_name} and {overlay_name} disagree:\n  " + "\n  ".join(sorted(problems))
            + f"\nEdit in {repo.relative_to(ROOT)}, commit, and run `make patches` "
            "(it regenerates both)"
        )
    say(f"{series_name} ({len(series())} patches) and {overlay_name} ({len(actual)} files) agree")
    if not (VENV / "bin" / "python").exists():
        say(f"no {venv_name} yet: `make apply` builds it")
        return
    want = local_version(pin, (env_stamp(VENV) or {}).get("target") or target())
    have = installed_version()
    if have != want:
        raise UserError(f"{venv_name} has vllm {have or '(none)'} installed, not {want} (the series "
                        f"of {series_name}); run `make patches` or `make apply` to install it")
    sp = site_packages()
    names = sorted(n for n in expected if n.startswith("vllm/"))
    stale = [n for n in names if not (sp / n).exists() or (sp / n).read_bytes() != expected[n]]
    if stale:
        raise UserError(f"{venv_name} does not hold the patched {', '.join(stale)}; run `make apply`")
    bad = record_problems(VENV, names)
    if bad:
        raise UserError(f"{venv_name}'s files disagree with pip's RECORD: " + "; ".join(bad)
                        + "; run `make apply`")
    say(f"{venv_name} holds the patched files (pip: vllm {want}, RECORD verified)")


if __name__ == "__main__":
    run_main(main)
