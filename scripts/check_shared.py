#!/usr/bin/env python3
"""Fail when a file the two tracks share differs between their overlays.

One implementation per feature: where the fork (vllm_overlay/0.22.1/) and the upstream
track (the newest series in patches/) need the same code, it is the same file, byte for
byte; what differs between the releases lives in a compat module. SHARED lists the files
converged so far. The fs tier's files are reported with the share of their lines both
tracks carry (a rough figure: blank and closing lines count too), so it says how far the
rest has to go (docs/series.md, "One fs tier"). The overlays are compared as committed:
`make check`'s check_sync.py ties each to its series (for the selected track).
"""

import difflib
from pathlib import Path

from _lib import SERIES_VERSION, UserError, overlay_dir, rel, run_main, say, series_versions

# Identical on both tracks: a change to one is made to the other in the same commit.
SHARED = (
    "csrc/fs_io.cpp",
    "vllm/v1/kv_offload/kv_values.py",
    "vllm/v1/kv_offload/tiering/fs/budget.py",
    "vllm/v1/kv_offload/tiering/fs/files.py",
    "vllm/v1/kv_offload/tiering/fs/io.py",
    "vllm/v1/kv_offload/tiering/fs/layouts.py",
    "vllm/v1/kv_offload/tiering/fs/report.py",
    "vllm/v1/kv_offload/tiering/fs/security.py",
    "vllm/v1/kv_offload/tiering/fs/thread_pool.py",
)
# The fs tier's code on the upstream track, for the shared-lines figure.
FS_TIER = ("vllm/v1/kv_offload/tiering/fs/*.py", "csrc/fs_io.cpp")


def shared_lines(upstream: Path, fork: Path) -> int:
    """Lines of *upstream* that *fork* carries too, in the same order (difflib's blocks)."""
    if not fork.exists():
        return 0
    a, b = upstream.read_text().splitlines(), fork.read_text().splitlines()
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())


def main() -> None:
    fork, upstream = overlay_dir(SERIES_VERSION), overlay_dir(series_versions()[-1])
    if fork == upstream:
        raise UserError(f"only one series in patches/ ({SERIES_VERSION}): nothing to compare")
    problems = []
    for name in SHARED:
        a, b = fork / name, upstream / name
        missing = [rel(p) for p in (a, b) if not p.is_file()]
        if missing:
            problems.append(f"{name}: missing from {', '.join(missing)}")
        elif a.read_bytes() != b.read_bytes():
            problems.append(f"{name}: differs between {rel(a)} and {rel(b)}")
    if problems:
        raise UserError("files both tracks share differ (make the same change on both "
                        "series, or move what truly differs into the compat module):\n  "
                        + "\n  ".join(problems))
    files = sorted(p for pattern in FS_TIER for p in upstream.glob(pattern))
    total = same = 0
    for path in files:
        lines = len(path.read_text().splitlines())
        total += lines
        same += shared_lines(path, fork / path.relative_to(upstream))
    say(f"{len(SHARED)} file(s) identical on both tracks; fs tier: {same}/{total} lines of "
        f"{rel(upstream)} also in {rel(fork)} ({100 * same // max(total, 1)}%)")


if __name__ == "__main__":
    run_main(main)
