#!/usr/bin/env python3
"""Build build/unpatched-site-<version>/: the installed vllm package with our changes taken out again.

Put it first on PYTHONPATH to run anything against pristine upstream with the same .venv:
    PYTHONPATH=$(python3 scripts/unpatched_site.py) .venv/bin/python ...
Files are hard links to the installed package, except those the series touches: the files
patches/ changes or adds, and those build/vllm's work tree changes (committed or not), each
put back to the pristine tag's bytes (or removed where the tag has no such file).
"""

import os
import shutil

from _lib import BUILD, VENV, UserError, checkout_dir, load_pin, run_main, say, vllm_version
from _series import changed_vllm_files, pristine_blob, series_files, site_packages

UNPATCHED = BUILD / f"unpatched-site-{vllm_version()}"


def build() -> str:
    pin = load_pin()
    repo = checkout_dir(pin["version"])
    if not (VENV / "bin" / "python").exists() or not (repo / ".git").exists():
        raise UserError(f"no {VENV.name} or no {repo.name}; run `make apply` first")
    touched = {p for p in series_files(repo, pin["tag"]) if p.startswith("vllm/")}
    touched |= set(changed_vllm_files(repo, pin["tag"]))
    shutil.rmtree(UNPATCHED, ignore_errors=True)
    UNPATCHED.mkdir(parents=True)
    src = site_packages() / "vllm"
    shutil.copytree(src, UNPATCHED / "vllm", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for path in sorted(touched):
        dest = UNPATCHED / path
        dest.unlink(missing_ok=True)  # a hard link: never write through it
        blob = pristine_blob(repo, pin["tag"], path)
        if blob is not None:
            dest.write_bytes(blob)
    return str(UNPATCHED)


def main() -> None:
    path = build()
    say(f"pristine vLLM {load_pin()['version']} importable from {path}")
    print(path)


if __name__ == "__main__":
    run_main(main)
