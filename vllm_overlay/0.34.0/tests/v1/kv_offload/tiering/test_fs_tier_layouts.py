# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for what the fs tier says of the other layouts in its root: the
directories of an earlier version's, another setting's or another model's
layout, which it never reads or removes. Real tiers on real directories."""

import dataclasses
import json
import logging
import os
import threading
import time

from tests.v1.kv_offload.test_kv_values import _source as values_source
from tests.v1.kv_offload.tiering.test_fs_tier import (
    _make_offloading_spec,
    _page_aligned_zero_tensor,
)
from vllm.v1.kv_offload.tiering.fs import layouts as fs_layouts
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

_ROW_ELEMENTS = 1024  # float32: a 4 KiB block file


def make_tier(root_dir: str, rows, kv_values_source=None, **config):
    """An fs tier over rows (a page-aligned tensor), with what the model's
    K/V values depend on (none: not known)."""
    spec = _make_offloading_spec(enable_kv_cache_events=False)
    spec.config = dataclasses.replace(
        spec.config,
        model=dataclasses.replace(spec.config.model, kv_values_source=kv_values_source),
    )
    return FileSystemTierManager(
        offloading_spec=spec,
        primary_kv_view=memoryview(rows.numpy()),
        tier_type="fs",
        root_dir=root_dir,
        n_read_threads=1,
        n_write_threads=1,
        **config,
    )


def test_other_layouts_in_the_root_are_named_at_start(tmp_path, caplog_vllm):
    """This model's other layouts in the root (an earlier version's, another
    tier setting's) are never read, removed or counted by max_bytes: one line
    at start names them (five, then a count), a warning with a budget. Other
    models' layouts (likely live) get an info line. The tier's own
    directories (its config's, every rank's), links and files are not named."""
    rows = _page_aligned_zero_tensor(2, _ROW_ELEMENTS)
    block_bytes = _ROW_ELEMENTS * 4
    root = str(tmp_path)
    first = make_tier(root, rows)
    first.shutdown()
    own = os.path.basename(first.file_mapper.base_path)
    model = own[:-13]  # FileMapper's <model>_<12 hex digits>
    os.makedirs(os.path.join(root, f"{own}_r1"))  # another rank of this layout
    olds = [f"{model}_{i:012x}" for i in range(1, 7)]
    for old in olds:
        os.makedirs(os.path.join(root, old))
    old_block = os.path.join(root, f"{olds[0]}_r0", "abc", "de_g0", "abcde.bin")
    os.makedirs(os.path.dirname(old_block))
    with open(old_block, "wb") as f:
        f.write(bytes(block_bytes))
    os.makedirs(os.path.join(root, "other_model_0123456789ab_r0"))
    not_layouts = [f"{model}_{7:012x}", f"{model}_{8:012x}", "notes_0123456789ab.d"]
    os.symlink(os.path.join(root, olds[0]), os.path.join(root, not_layouts[0]))
    open(os.path.join(root, not_layouts[1]), "w").close()
    os.makedirs(os.path.join(root, not_layouts[2]))
    for max_bytes, level in ((4 * block_bytes, logging.WARNING), (None, logging.INFO)):
        caplog_vllm.clear()
        with caplog_vllm.at_level(logging.INFO):
            make_tier(root, rows, max_bytes=max_bytes).shutdown()
        lines = [
            (r.getMessage(), r.levelno)
            for r in caplog_vllm.records
            if "are in the root" in r.getMessage()
        ]
        assert len(lines) == 2, lines
        (same, same_level), (other, other_level) = lines
        assert "6 other layout(s) of this model" in same and same_level == level
        assert all(repr(old) in same for old in olds[:5]), same
        assert repr(olds[5]) not in same and "and 1 more" in same, same
        assert "1 other model(s)'" in other and other_level == logging.INFO
        assert "'other_model_0123456789ab'" in other, other
        for name in (own, *not_layouts):
            assert name not in same + other, name
        assert ("max_bytes" in same) == (max_bytes is not None), same
    assert os.path.exists(old_block)


def test_other_layouts_are_named_least_recently_used_first(
    tmp_path, caplog_vllm, monkeypatch
):
    """A running tier marks its layout in use (its directory's mtime) at
    start and every LAYOUT_MARK_INTERVAL_S until shutdown, and the start-up
    line names the other layouts least recently used first, each with how
    long ago: an operator tells a layout nobody runs from another engine's."""
    monkeypatch.setattr(fs_layouts, "LAYOUT_MARK_INTERVAL_S", 0.05)
    rows = _page_aligned_zero_tensor(2, _ROW_ELEMENTS)
    root = str(tmp_path)
    first = make_tier(root, rows)
    layout_dir = first.file_mapper.base_path
    old = int(time.time()) - 10 * 86400
    try:
        for _ in range(2):  # marked again and again, not only at start
            os.utime(layout_dir, (old, old))
            deadline = time.monotonic() + 10
            while os.stat(layout_dir).st_mtime == old:
                assert time.monotonic() < deadline, "the layout was not marked again"
                time.sleep(0.01)
    finally:
        first.shutdown()
    assert not first._marker.is_alive()
    model = os.path.basename(layout_dir)[:-13]  # FileMapper's <model>_<digest>
    now = int(time.time())
    expected = []
    for i, (age_s, age) in enumerate(
        ((40 * 86400, "40 days"), (3 * 3600, "3 h"), (5 * 60, "5 min")), 1
    ):
        other = os.path.join(root, f"{model}_{i:012x}")
        os.makedirs(other)
        os.utime(other, (now - age_s, now - age_s))
        expected.append(f"'{model}_{i:012x}' (last used {age} ago;")
    os.utime(layout_dir, (old, old))
    monkeypatch.setattr(fs_layouts, "LAYOUT_MARK_INTERVAL_S", 3600.0)
    with caplog_vllm.at_level(logging.INFO):
        make_tier(root, rows).shutdown()
    (line,) = [
        r.getMessage()
        for r in caplog_vllm.records
        if "other layout(s) of this model" in r.getMessage()
    ]
    positions = [line.find(name) for name in expected]
    assert -1 not in positions and positions == sorted(positions), line
    assert "mark theirs every 60 min" in line, line
    assert os.stat(layout_dir).st_mtime > old + 86400  # marked at start


def test_other_layouts_say_what_differs(tmp_path, caplog_vllm):
    """A model changed at its path (new weights, another config) starts a new
    layout; the start-up line names this model's old layouts with what
    differs in their config.json, so that an operator sees why they are
    unused and can remove them."""
    rows = _page_aligned_zero_tensor(2, _ROW_ELEMENTS)
    root = str(tmp_path)
    source = values_source(
        model="test-model", hf_config="1" * 32, dtype="float16", max_model_len=1024
    )
    first = make_tier(root, rows, kv_values_source=source)
    first.shutdown()
    fields = first.file_mapper.fields
    values = fields["kv_values"]
    model = os.path.basename(first.file_mapper.base_path)[:-13]
    weights = {"source": "local", "digest": "0" * 32}
    old_fields = {
        "weights changed": {**fields, "kv_values": {**values, "weights": weights}},
        "model config changed": {
            **fields,
            "kv_values": {**values, "hf_config": "0" * 32},
        },
        "written before the model's values were recorded": {
            k: v for k, v in fields.items() if k != "kv_values"
        },
        "no readable config.json": None,
    }
    names = {}
    for i, (change, old) in enumerate(old_fields.items(), 1):
        names[change] = f"{model}_{i:012x}"
        os.makedirs(os.path.join(root, names[change]))
        if old is not None:
            with open(os.path.join(root, names[change], "config.json"), "w") as f:
                json.dump(old, f)
    with caplog_vllm.at_level(logging.INFO):
        make_tier(root, rows, kv_values_source=source).shutdown()
    (line,) = [
        r.getMessage()
        for r in caplog_vllm.records
        if "other layout(s) of this model" in r.getMessage()
    ]
    for change, name in names.items():
        assert f"'{name}' (last used 0 min ago; {change})" in line, line


def test_a_failing_layout_mark_is_reported_rate_limited_with_counts(
    tmp_path, caplog_vllm, monkeypatch
):
    """A layout mark that keeps failing (a read-only root, another owner) is a
    warning at the first failure and then once every
    MARK_FAILURES_REPORTED_EVERY failures, with the count, and an info line
    once it works again: never silent, and not a line per interval for ever."""
    monkeypatch.setattr(fs_layouts, "LAYOUT_MARK_INTERVAL_S", 0.01)
    real_utime = os.utime
    state = {"fail": False, "failures": 0}

    def utime(*args, **kwargs):
        if state["fail"]:
            state["failures"] += 1
            raise PermissionError(13, "Permission denied")
        return real_utime(*args, **kwargs)

    monkeypatch.setattr(os, "utime", utime)

    def messages(text: str) -> list[str]:
        return [r.getMessage() for r in caplog_vllm.records if text in r.getMessage()]

    with caplog_vllm.at_level(logging.INFO):
        tier = make_tier(str(tmp_path), _page_aligned_zero_tensor(2, _ROW_ELEMENTS))
        try:
            state["fail"] = True
            deadline = time.monotonic() + 10
            while state["failures"] < 30:
                assert time.monotonic() < deadline, state
                time.sleep(0.01)
            state["fail"] = False
            while not messages("again after"):
                assert time.monotonic() < deadline + 10, "no line on recovery"
                time.sleep(0.01)
        finally:
            tier.shutdown()
    failures = state["failures"]
    every = fs_layouts.MARK_FAILURES_REPORTED_EVERY
    warnings = messages("could not mark its layout in use")
    assert len(warnings) == -(-failures // every) >= 2, (failures, warnings)
    assert "(1 time(s) in a row; " in warnings[0], warnings
    assert f"({every + 1} time(s) in a row; " in warnings[1], warnings
    assert "Permission denied" in warnings[0], warnings
    (recovered,) = messages("again after")
    assert f"again after {failures} failure(s)" in recovered, recovered


def test_a_fifo_for_another_layouts_config_is_not_waited_on(tmp_path):
    """Another layout's config.json that is a FIFO (planted by whoever may
    write into the root) reads as none: the tier's start does not wait for a
    writer, as it did, forever."""
    fifo = tmp_path / "other" / "config.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    fields: list = []
    reader = threading.Thread(
        target=lambda: fields.append(fs_layouts._read_fields(str(tmp_path), "other")),
        daemon=True,
    )
    reader.start()
    reader.join(timeout=10)
    blocked = reader.is_alive()
    if blocked:  # a writer's open lets it go on
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
    assert not blocked and fields == [None]
