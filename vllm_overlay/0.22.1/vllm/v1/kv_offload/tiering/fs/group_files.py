# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Each KV cache group's block file holds only the bytes of a CPU row that
the group's transfers use (cpu/row_extents.py): not the tensors of other
groups' layers, not the padding of a mamba state.

A group whose bytes are one page-aligned run of the row is written and read
in place; else its runs are gathered into (and scattered from) a page-aligned
per-thread buffer, so that O_DIRECT works for every group. The files are
stored and loaded by io.py's batch calls, a group at a time; a load writes
only the group's runs of the row.
"""

import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.row_extents import group_row_runs
from vllm.v1.kv_offload.tiering.fs.files import FileModes
from vllm.v1.kv_offload.tiering.fs.io import (
    BLOCK_ERRNOS,
    BlockMac,
    batch_load_block,
    batch_store_block,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

# The most bytes of group files gathered per batch call: bounds each I/O
# thread's buffer (1 MiB, or one group file where that is larger; 32 MiB for
# the default 16 + 16 threads). Real layouts' runs are 1 MiB or more, so a
# call per MiB costs no throughput (bench/io_gather.py).
GATHER_BYTES = 1 << 20

_thread_local = threading.local()


@dataclass(frozen=True)
class GroupFile:
    """How a KV cache group's block file maps to a row of the primary tier:
    *size* bytes (the group's, page-aligned), at *offset* of the row when
    runs is None, else gathered from (and scattered to) the row's *runs*
    ((offset, length) pairs)."""

    offset: int
    size: int
    runs: tuple[tuple[int, int], ...] | None = None


def group_files(
    offloading_spec: "OffloadingSpec", row_bytes: int
) -> list[GroupFile] | None:
    """Each KV cache group's file, from the CPU tier's row layout; None where
    the rows (*row_bytes* each) are not the CPU offloading rows that
    group_row_runs() describes (files of whole rows then)."""
    per_worker = getattr(offloading_spec, "cpu_page_size_per_worker", None)
    num_workers = offloading_spec.vllm_config.parallel_config.world_size
    if (
        not isinstance(per_worker, int)
        or not isinstance(num_workers, int)
        or per_worker * num_workers != row_bytes
    ):
        return None
    # O_DIRECT needs page-aligned lengths, where the rows allow it at all
    align = mmap.PAGESIZE if row_bytes % mmap.PAGESIZE == 0 else 1
    files = []
    for runs in group_row_runs(
        offloading_spec.kv_cache_config,
        offloading_spec.block_size_factor,
        per_worker,
        num_workers,
    ):
        size = -(-sum(n for _, n in runs) // align) * align
        if len(runs) == 1 and runs[0][1] == size and runs[0][0] % align == 0:
            files.append(GroupFile(runs[0][0], size))  # in place
        else:
            files.append(GroupFile(0, size, tuple(runs)))
    return files


def _gather_buffer(size: int) -> memoryview:
    """This thread's page-aligned buffer of *size* bytes (O_DIRECT needs
    one). Grown to the largest batch (GATHER_BYTES, or one group file),
    never shrunk."""
    buf = getattr(_thread_local, "buffer", None)
    if buf is None or len(buf) < size:
        buf = _thread_local.buffer = mmap.mmap(-1, max(size, mmap.PAGESIZE))
    return memoryview(buf)[:size]


def _batches(gf: GroupFile, count: int) -> list[range]:
    """Index ranges of one batch call each: all at once in place, else
    GATHER_BYTES of gathered files at most (one file at least)."""
    step = count if gf.runs is None else max(1, GATHER_BYTES // gf.size)
    return [range(i, min(i + step, count)) for i in range(0, count, step)]


def _gather(buf: memoryview, row: memoryview, row_offset: int, gf: GroupFile):
    assert gf.runs is not None
    pos = 0
    for run_offset, length in gf.runs:
        start = row_offset + run_offset
        buf[pos : pos + length] = row[start : start + length]
        pos += length
    buf[pos:] = bytes(len(buf) - pos)


def _scatter(buf: memoryview, row: memoryview, row_offset: int, gf: GroupFile):
    assert gf.runs is not None
    pos = 0
    for run_offset, length in gf.runs:
        start = row_offset + run_offset
        row[start : start + length] = buf[pos : pos + length]
        pos += length


def store_group_files(
    gf: GroupFile,
    paths: list[str],
    view: memoryview,
    row_offsets: list[int],
    use_o_direct: bool,
    modes: FileModes,
    mac: BlockMac | None,
    keys: Sequence[OffloadKey],
    checksum: bool,
) -> None:
    """Store one group's files of the rows at *row_offsets* (batch_store_block
    per batch). A file's own failure does not stop the others, any other
    error stops the group's batches too; the error that stopped them, else
    the first, is raised once they are done."""
    flat = view.cast("B")
    first_exc: Exception | None = None
    for batch in _batches(gf, len(paths)):
        if first_exc is not None and stops_batch(first_exc):
            break  # the batches after it would meet it too
        if gf.runs is None:
            source, offsets = flat, [row_offsets[i] + gf.offset for i in batch]
        else:
            source = _gather_buffer(len(batch) * gf.size)
            offsets = [j * gf.size for j in range(len(batch))]
            for j, i in enumerate(batch):
                _gather(
                    source[offsets[j] : offsets[j] + gf.size], flat, row_offsets[i], gf
                )
        try:
            batch_store_block(
                [paths[i] for i in batch],
                source,
                offsets,
                gf.size,
                use_o_direct,
                modes,
                mac,
                [keys[i] for i in batch],
                checksum,
            )
        except OSError as exc:
            if first_exc is None or stops_batch(exc):
                first_exc = exc
    if first_exc is not None:
        raise first_exc


def stops_batch(exc: Exception) -> bool:
    """Whether *exc* is not a block's own failure (BLOCK_ERRNOS): the error
    a batch raises when it stopped, over an earlier block's."""
    return getattr(exc, "errno", None) not in BLOCK_ERRNOS


def load_group_files(
    gf: GroupFile,
    paths: list[str],
    view: memoryview,
    row_offsets: list[int],
    use_o_direct: bool,
    mac: BlockMac | None,
    keys: Sequence[OffloadKey],
    checksum: bool,
) -> None:
    """Load one group's files into the rows at *row_offsets*
    (batch_load_block per batch): a gathered file's bytes reach the row's
    runs only once it loaded and checked. A file's own failure does not
    stop the others, any other error stops the group's batches too (the rest
    untried). The error that stopped them, else the first, is raised once
    they are done, carrying batch_load_block's ``failed_indices``,
    ``untried`` and ``integrity_failed`` as indices of *paths*."""
    flat = view.cast("B")
    first_exc: OSError | None = None
    failed: list[int] = []
    untried: list[int] = []
    integrity_failed: list[int] = []
    for batch in _batches(gf, len(paths)):
        if first_exc is not None and stops_batch(first_exc):
            failed.extend(batch)  # the batches after it would meet it too
            untried.extend(batch)
            continue
        if gf.runs is None:
            target, offsets = flat, [row_offsets[i] + gf.offset for i in batch]
        else:
            target = _gather_buffer(len(batch) * gf.size)
            offsets = [j * gf.size for j in range(len(batch))]
        batch_failed: list[int] = []
        try:
            batch_load_block(
                [paths[i] for i in batch],
                target,
                offsets,
                gf.size,
                use_o_direct,
                mac,
                [keys[i] for i in batch],
                checksum,
            )
        except OSError as exc:
            if first_exc is None or stops_batch(exc):
                first_exc = exc
            batch_failed = getattr(exc, "failed_indices", None) or list(
                range(len(batch))
            )
            failed.extend(batch[j] for j in batch_failed)
            # where nothing says which blocks were read, none is looked at
            known = hasattr(exc, "failed_indices")
            batch_untried = getattr(exc, "untried", () if known else batch_failed)
            untried.extend(batch[j] for j in batch_untried)
            integrity_failed.extend(
                batch[j] for j in getattr(exc, "integrity_failed", ())
            )
        if gf.runs is not None:
            skip = set(batch_failed)
            for j, i in enumerate(batch):
                if j not in skip:
                    _scatter(
                        target[offsets[j] : offsets[j] + gf.size],
                        flat,
                        row_offsets[i],
                        gf,
                    )
    if first_exc is not None:
        first_exc.failed_indices = failed  # type: ignore[attr-defined]
        first_exc.untried = untried  # type: ignore[attr-defined]
        first_exc.integrity_failed = integrity_failed  # type: ignore[attr-defined]
        raise first_exc
