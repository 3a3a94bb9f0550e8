# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""fs tiers of engines sharing a root keep ledger files of the bytes they
stored and removed, and count each other's: the root stays within one
max_bytes, shared. Real fs tiers, real files."""

import itertools
import os
import struct
import threading
import time

import pytest

from tests.v1.kv_offload.tiering.test_fs_tier import _page_aligned_zero_tensor
from tests.v1.kv_offload.tiering.test_fs_tier_max_bytes import (
    block_key,
    disk_bytes,
    make_tier,
    on_disk,
    page,
    store,
)
from vllm.v1.kv_offload.base import ScheduleEndContext
from vllm.v1.kv_offload.tiering.fs import budget as budget_module

LEDGER_DIR = "budget-ledgers"


@pytest.fixture
def rows():
    return _page_aligned_zero_tensor(4, 1024)


@pytest.fixture(autouse=True)
def quick_ledgers(monkeypatch):
    """Ledgers read every 10 ms; no listing of the root after start. The
    names but LEDGER_READ_S are the series' later budget's (it polls the
    ledgers and lists the root), which this file also runs on: absent here."""
    for name, value in (("LEDGER_READ_S", 0.01), ("LEDGER_POLL_S", 0.01)):
        monkeypatch.setattr(budget_module, name, value, raising=False)
    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 1e9, raising=False)
    monkeypatch.setattr(budget_module, "RESCAN_COST_FACTOR", 1, raising=False)


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def ledger_dir(tier) -> str:
    mapper = tier.file_mapper
    return os.path.join(f"{mapper.base_path}_r{mapper.rank}", LEDGER_DIR)


def make_ledger_dir(root_dir, rows) -> str:
    """The ledgers' directory of the tiers make_tier() puts on root_dir,
    made before they start (a tier may write its ledger only once there)."""
    probe = make_tier(root_dir, rows)  # no budget: the path only
    path = ledger_dir(probe)
    probe.shutdown()
    os.makedirs(path)
    return path


def ledgers(tier) -> dict[str, tuple[int, int]]:
    """The ledgers on the tier's rank directory: name -> (added, removed)."""
    out = {}
    names = os.listdir(ledger_dir(tier)) if os.path.isdir(ledger_dir(tier)) else []
    for name in names:
        path = os.path.join(ledger_dir(tier), name)
        if name.endswith(".tmp") or not os.path.isfile(path):
            continue  # being written, or no file (a FIFO)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue  # replaced meanwhile
        if len(data) == 16:
            out[name] = struct.unpack("<qq", data)
    return out


def write_ledger(path: str, added: int, removed: int) -> None:
    """Another engine's ledger, replaced at once."""
    with open(path + ".new", "wb") as f:
        f.write(struct.pack("<qq", added, removed))
    os.replace(path + ".new", path)


def step_and(tier, condition):
    def stepped():
        tier.on_schedule_end(ScheduleEndContext((), ()))
        return condition()

    return stepped


def test_engines_on_one_root_count_each_others_stores_at_once(tmp_path, rows):
    """Two engines' tiers on one root, max_bytes four files: once the first
    stored four files, the second counts them (the first's ledger), so its
    store cannot take the root past max_bytes: refused, as no file of its
    own could make room; the first's files stay."""
    make_ledger_dir(tmp_path, rows)
    first = make_tier(tmp_path, rows, max_bytes=4 * page)
    second = make_tier(tmp_path, rows, max_bytes=4 * page)
    keys = [block_key(n) for n in range(5)]
    try:
        wait_until(lambda: len(ledgers(first)) == 2, "both engines' ledgers exist")
        assert store(first, keys[:4], 0, rows)[0].success
        counted = second._budget
        assert counted is not None
        wait_until(
            lambda: counted.others == 4 * page,
            "the second engine counts the first's four files",
        )
        assert [r.success for r in store(second, keys[4:], 10, rows)] == [False]
        assert on_disk(first, keys) == [True] * 4 + [False]
        assert disk_bytes(tmp_path) == 4 * page
    finally:
        first.shutdown()
        second.shutdown()


def test_an_engine_evicts_its_own_when_the_others_fill_the_root(tmp_path, rows):
    """An engine stored three files of a four-file root; another engine's
    ledger then grows by three: this engine evicts its own least recently
    used files until the root's total is within max_bytes again."""
    other = os.path.join(make_ledger_dir(tmp_path, rows), "other-engine")
    write_ledger(other, 0, 0)
    tier = make_tier(tmp_path, rows, max_bytes=4 * page)
    keys = [block_key(n) for n in range(3)]
    try:
        for n, key in enumerate(keys):
            assert store(tier, [key], 10 * n, rows)[0].success
        own = lambda: [v for k, v in ledgers(tier).items() if k != "other-engine"]  # noqa: E731
        wait_until(lambda: own() == [(3 * page, 0)], "its ledger holds its files")
        write_ledger(other, 3 * page, 0)
        wait_until(
            step_and(tier, lambda: on_disk(tier, keys) == [False, False, True]),
            "the engine's two least recently used files are gone",
        )
        wait_until(lambda: own() == [(3 * page, 2 * page)], "its ledger says so")
    finally:
        tier.shutdown()


def test_a_single_engine_keeps_its_ledger_and_stores_alone(tmp_path, rows):
    """Alone on its root, an engine keeps one ledger, the bytes of its files
    on disk, and its budget of one engine: every store fits by eviction. It
    removes its ledger at shutdown."""
    tier = make_tier(tmp_path, rows, max_bytes=4 * page)
    try:
        for n in range(6):
            assert store(tier, [block_key(n)], 10 * n, rows)[0].success
        assert disk_bytes(tmp_path) == 4 * page
        wait_until(
            lambda: [a - r for a, r in ledgers(tier).values()] == [4 * page],
            "its one ledger holds the bytes of its files",
        )
    finally:
        tier.shutdown()
    assert ledgers(tier) == {}


def test_a_dead_engines_ledger_is_removed_once_stale(tmp_path, rows, monkeypatch):
    """A ledger not rewritten for LEDGER_STALE_S (its engine died) is
    removed, a live one is kept, and an engine removes its own at shutdown:
    the ledgers are bounded by the engines alive or recently dead."""
    monkeypatch.setattr(budget_module, "LEDGER_STALE_S", 60.0)
    # the later budget removes stale ledgers as it lists the root
    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 0.05, raising=False)
    ledgers_at = make_ledger_dir(tmp_path, rows)
    for name, age in (("dead", 3600), ("alive", 0)):
        path = os.path.join(ledgers_at, name)
        write_ledger(path, 2 * page, 0)
        os.utime(path, (time.time() - age,) * 2)
    tier = make_tier(tmp_path, rows, max_bytes=4 * page)
    try:
        wait_until(lambda: "dead" not in ledgers(tier), "the stale ledger is gone")
        assert store(tier, [block_key(1)], 0, rows)[0].success
        wait_until(lambda: len(ledgers(tier)) == 2, "its own ledger and 'alive'")
        assert "alive" in ledgers(tier)
    finally:
        tier.shutdown()
    assert list(ledgers(tier)) == ["alive"]


def test_a_ledger_that_is_not_one_is_not_believed(tmp_path, rows):
    """A FIFO in the ledgers' directory never blocks the tier, and a ledger
    that claims more than max_bytes (from the start, or by a jump) is not
    believed: the engine stores as if they were not there, and stops."""
    ledgers_at = make_ledger_dir(tmp_path, rows)
    os.mkfifo(os.path.join(ledgers_at, "fifo"))
    with open(os.path.join(ledgers_at, "short"), "wb") as f:
        f.write(b"\1" * 8)
    write_ledger(os.path.join(ledgers_at, "liar"), 2**40, 0)
    write_ledger(os.path.join(ledgers_at, "jumper"), 0, 0)
    tier = make_tier(tmp_path, rows, max_bytes=4 * page)
    keys = [block_key(n) for n in range(4)]
    try:
        foreign = {"liar", "jumper"}  # "short" is no ledger
        mine = lambda: [v for k, v in ledgers(tier).items() if k not in foreign]  # noqa: E731
        wait_until(lambda: mine() == [(0, 0)], "its ledger is written")
        write_ledger(os.path.join(ledgers_at, "jumper"), 2**40, 0)
        for n, key in enumerate(keys):
            assert store(tier, [key], 10 * n, rows)[0].success
        wait_until(lambda: mine() == [(4 * page, 0)], "its ledger holds 4 files")
        tier.on_schedule_end(ScheduleEndContext((), ()))
        assert on_disk(tier, keys) == [True] * 4
    finally:
        stopping = threading.Thread(target=tier.shutdown)
        stopping.start()
        stopping.join(30)
        assert not stopping.is_alive()


def test_an_engine_whose_files_fill_the_root_makes_room(tmp_path, rows, monkeypatch):
    """The first engine's idle files fill the root: the second engine's
    stores succeed all the same (the first evicts its least recently used
    files down to its share), and the root is within max_bytes."""
    # the later budget lists the root: the second evicts the first's files
    monkeypatch.setattr(budget_module, "ROOT_RESCAN_S", 0.05, raising=False)
    make_ledger_dir(tmp_path, rows)
    first = make_tier(tmp_path, rows, max_bytes=4 * page)
    second = make_tier(tmp_path, rows, max_bytes=4 * page)
    jobs = itertools.count(10)

    def stepped_store(key):
        def stored():
            for tier in (first, second):
                tier.on_schedule_end(ScheduleEndContext((), ()))
            return store(second, [key], next(jobs), rows)[0].success

        return stored

    try:
        assert store(first, [block_key(n) for n in range(4)], 0, rows)[0].success
        budget = second._budget
        assert budget is not None
        wait_until(lambda: budget.used + budget.others == 4 * page, "it counts them")
        for key in (block_key(10), block_key(11)):
            wait_until(stepped_store(key), "the second stores a key")
        assert on_disk(second, [block_key(10), block_key(11)]) == [True, True]
        assert disk_bytes(tmp_path) <= 4 * page
    finally:
        first.shutdown()
        second.shutdown()


@pytest.mark.parametrize("owner", ["writable by others", "another user's"])
def test_a_ledger_another_user_could_write_is_not_counted(tmp_path, rows, owner):
    """A ledger of 3 files another user owns or may write is not counted: the
    engine keeps its 4 files; a ledger of its own that then holds 2 files is
    (its 2 least recently used files go)."""
    if owner == "another user's" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    ledgers_at = make_ledger_dir(tmp_path, rows)
    planted, other = (os.path.join(ledgers_at, n) for n in ("planted", "other"))
    write_ledger(planted, 3 * page, 0)
    if owner == "another user's":
        os.chown(planted, 65534, 65534)
    else:
        os.chmod(planted, 0o666)
    write_ledger(other, 0, 0)
    tier = make_tier(tmp_path, rows, max_bytes=4 * page)
    keys = [block_key(n) for n in range(4)]
    try:
        for n, key in enumerate(keys):
            assert store(tier, [key], 10 * n, rows)[0].success
        foreign = {"planted", "other"}
        mine = lambda: [v for k, v in ledgers(tier).items() if k not in foreign]  # noqa: E731
        wait_until(lambda: mine() == [(4 * page, 0)], "its ledger holds 4 files")
        write_ledger(other, 2 * page, 0)
        wait_until(
            step_and(tier, lambda: on_disk(tier, keys).count(True) <= 2),
            "the engine counts the other ledger",
        )
        assert on_disk(tier, keys) == [False, False, True, True]
    finally:
        tier.shutdown()


def test_a_linked_ledger_directory_is_not_followed(tmp_path, rows, caplog_vllm):
    """The ledgers' directory is a link: the engine writes no ledger through
    it (and counts none there), with a warning; its stores fit alone."""
    ledgers_at = make_ledger_dir(tmp_path, rows)
    os.rmdir(ledgers_at)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_ledger(str(elsewhere / "planted"), 3 * page, 0)
    os.symlink(elsewhere, ledgers_at)
    tier = make_tier(tmp_path, rows, max_bytes=4 * page)
    keys = [block_key(n) for n in range(4)]
    try:
        wait_until(
            lambda: (
                "budget ledger" in caplog_vllm.text or len(os.listdir(elsewhere)) > 1
            ),
            "the engine warns (or writes through the link)",
        )
        assert os.listdir(elsewhere) == ["planted"]
        for n, key in enumerate(keys):
            assert store(tier, [key], 10 * n, rows)[0].success
        tier.on_schedule_end(ScheduleEndContext((), ()))
        assert on_disk(tier, keys) == [True] * 4
    finally:
        tier.shutdown()
    assert os.listdir(elsewhere) == ["planted"]
