# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The other layouts in an fs tier root, and the mark that tells them apart.

A root may hold the directories of other layouts (an earlier version's,
another model's, other settings'): the tier never reads, removes or counts
them, and names them at start for their owner to remove, least recently
used first, with how long ago and what differs (report_other_layouts()).
"Used" is the layout directory's mtime, which a running tier sets every
LAYOUT_MARK_INTERVAL_S (LayoutMark): a layout whose mtime is older has no
engine running on it.
"""

import contextlib
import fcntl
import json
import os
import stat
import threading
import time

import regex as re

from vllm.logger import init_logger
from vllm.v1.kv_offload import kv_values

logger = init_logger(__name__)

# The most layout names a start-up line gives (then "and N more").
LAYOUTS_NAMED = 5
# A running tier sets its layout directory's mtime (<model>_<layout digest>,
# its config.json's) to now every so often, and an engine's start changes it
# too (the O_DIRECT probe): a layout whose mtime is older has no engine
# running on it, which another engine's start-up line says (describe_layouts()).
LAYOUT_MARK_INTERVAL_S = 3600.0
# A mark that keeps failing is reported at the first failure and then once
# every so many intervals, with the count.
MARK_FAILURES_REPORTED_EVERY = 24
# FileMapper's directories: <model>_<layout digest> (its config.json) and
# <model>_<layout digest>_r<rank> (a rank's blocks).
_LAYOUT_DIR = re.compile(r"(.+)_[0-9a-f]{12}(_r[0-9]+)?")


def other_layouts(root_dir: str, base_path: str) -> tuple[list[str], list[str]]:
    """Return the `<model>_<layout digest>` names of the layouts with
    directories in `root_dir` other than `base_path`'s, sorted: this model's,
    then other models'. One listing, no walk; a listing that fails part way
    returns what it saw."""
    own = os.path.basename(base_path)
    own_model = _LAYOUT_DIR.fullmatch(own)
    same: set[str] = set()
    other: set[str] = set()
    with contextlib.suppress(OSError), os.scandir(root_dir) as entries:
        for entry in entries:
            match = _LAYOUT_DIR.fullmatch(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False):
                continue
            name = entry.name.removesuffix(match.group(2) or "")
            if name == own:
                continue
            model = match.group(1)
            (same if own_model and model == own_model.group(1) else other).add(name)
    return sorted(same), sorted(other)


def _age(seconds: float) -> str:
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"


def describe_layouts(
    root_dir: str, layouts: list[str], fields: dict | None = None
) -> str:
    """The layouts, least recently used first (their directory's mtime,
    see LAYOUT_MARK_INTERVAL_S), each with how long ago and, given this
    layout's `fields`, what differs in theirs (kv_values.layout_change)."""
    mtimes = {}
    for name in layouts:
        with contextlib.suppress(OSError):
            path = os.path.join(root_dir, name)
            mtimes[name] = os.stat(path, follow_symlinks=False).st_mtime
    now = time.time()
    aged = sorted(layouts, key=lambda n: (n in mtimes, mtimes.get(n, 0.0), n))
    described = []
    for name in aged[:LAYOUTS_NAMED]:
        notes = []
        if name in mtimes:
            notes.append(f"last used {_age(max(0.0, now - mtimes[name]))} ago")
        if fields is not None:
            notes.append(kv_values.layout_change(fields, _read_fields(root_dir, name)))
        described.append(f"{name!r} ({'; '.join(notes)})" if notes else repr(name))
    named = ", ".join(described)
    if len(layouts) > LAYOUTS_NAMED:
        named += f" and {len(layouts) - LAYOUTS_NAMED} more"
    return named


def _read_fields(root_dir: str, name: str) -> dict | None:
    """Another layout's recorded fields (its config.json), or None. A link
    there is not followed, nor is a FIFO waited on: whoever may write into
    the root (a group_access group) could plant either."""
    path = os.path.join(root_dir, name, "config.json")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            fcntl.fcntl(fd, fcntl.F_SETFL, 0)  # a regular file: reads block
            fields = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    return fields if isinstance(fields, dict) else None


def report_other_layouts(
    label: str, root_dir: str, base_path: str, fields: dict, budgeted: bool
) -> None:
    """Name the root's other layouts at start: this model's (a warning with a
    budget, which does not count them) and other models' (likely live)."""
    same, other = other_layouts(root_dir, base_path)
    counted = ", nor counts them in max_bytes" if budgeted else ""
    if same:
        (logger.warning if budgeted else logger.info)(
            "%s: directories of %d other layout(s) of this model are in the "
            "root (other weights', model config's, vLLM version's, tier "
            "setting's or parallelism's): %s (<name> and <name>_r<rank>; its "
            "config.json records the settings). This tier never reads or "
            "removes them%s: if no engine uses one, remove it (running engines "
            "of this version mark theirs every %.0f min).",
            label,
            len(same),
            describe_layouts(root_dir, same, fields),
            counted,
            LAYOUT_MARK_INTERVAL_S / 60,
        )
    if other:
        logger.info(
            "%s: directories of %d other model(s)' layouts are in the root: "
            "%s. This tier never reads or removes them%s.",
            label,
            len(other),
            describe_layouts(root_dir, other),
            counted,
        )


class LayoutMark:
    """A thread of its own that sets the layout directory's mtime to now, at
    start and every LAYOUT_MARK_INTERVAL_S until stop(): what tells another
    engine sharing the root that this layout is in use (the directory, not
    config.json: on a group_access root the group may write it). A failing
    mark is reported at once, then with its count every
    MARK_FAILURES_REPORTED_EVERY intervals: the layout looks unused."""

    def __init__(self, layout_dir: str, label: str) -> None:
        self._layout_dir = layout_dir
        self._label = label
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="vllm_kv_py_fs_layout_mark", daemon=True
        )
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        failures = 0
        while True:
            try:
                os.utime(self._layout_dir, follow_symlinks=False)
                if failures:
                    logger.info(
                        "%s: marks its layout in use again after %d failure(s)",
                        self._label,
                        failures,
                    )
                failures = 0
            except OSError as e:
                if failures % MARK_FAILURES_REPORTED_EVERY == 0:
                    logger.warning(
                        "%s: could not mark its layout in use (%d time(s) in a "
                        "row; %s): other engines sharing the root see it as "
                        "unused",
                        self._label,
                        failures + 1,
                        e,
                    )
                failures += 1
            if self._stop.wait(LAYOUT_MARK_INTERVAL_S):
                return
