#!/usr/bin/env python3
"""`make clean`: remove build/ and the venvs of both tracks; the download cache stays, so `make apply` after it
needs no network. Like `make apply`, it never destroys work: a checkout under build/ with
uncommitted edits or commits not exported to patches/ stops it (FORCE=1 removes anyway)."""

import shutil

from _lib import BUILD, ROOT, UserError, load_pin, run_main, say
from apply import check_no_local_work


def main() -> None:
    for repo in sorted(BUILD.glob("vllm*")):
        if not (repo / ".git").exists():
            continue
        version = repo.name.removeprefix("vllm-") if repo.name != "vllm" else None
        try:
            tag = load_pin(version)["tag"]
        except UserError:
            continue  # no pin for it: nothing we applied there
        try:
            check_no_local_work(repo, tag)
        except UserError as e:
            raise UserError(f"{e}. Nothing was removed (`make clean FORCE=1` removes anyway)")
    for path in (BUILD, *sorted(ROOT.glob(".venv*"))):
        if path.exists():
            shutil.rmtree(path)
            say(f"removed {path.relative_to(ROOT)}/")
    say("the download cache stays; `make apply` rebuilds both without the network")


if __name__ == "__main__":
    run_main(main)
