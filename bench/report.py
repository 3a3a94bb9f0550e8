#!/usr/bin/env python3
"""Write the Markdown tables and the plot from the sections' JSON files; print the goals.

Every figure is shown as median (best) over its samples. Ratios are shown as best (median):
the best samples are the least disturbed by other jobs on a shared machine, so the goals are
judged on them; the ratio of medians says how steady that is.
"""

import argparse
import itertools
import json
import math
import re
import statistics
import time
from pathlib import Path

from common import PATCHED_SITE, QUICK, RESULTS, ROOT, TMP, fmt_bytes, machine, run_main, say
from plot import plot_rows

# The goals of issue 20 (numbered as there); each is judged on its own figures.
GOAL_RATIO = 1.10  # 1: patched / pristine, every scheduler-side phase
GOAL_FS = 0.9  # 2: fs tier / raw, store and load
GOAL_FS_ROWS = (64 << 10, 256 << 10)  # 2: the row sizes goal 2 names
GOAL_HMA = 0.8  # 3: the tier's 4 groups / 1 group, per-token throughput (absolute)
GOAL_INTEGRITY = 0.95  # 4: checksum on / off at 64 KiB, with the checksum on by default
GOAL_SIZES = (4 << 10, 4 << 20)  # 6: the file sizes the tier is measured at, at least
GOAL_DOCS_HEADING = "## Picking `blocks_per_chunk`: file size"  # 6: the operators' guidance
LINEAR = 1.5  # promotion time may grow at most 1.5x as fast as the number of keys


def med(xs):
    return statistics.median(xs) if xs else None


def cell(xs, digits=2):
    """median (best) of time-like samples."""
    return "n/a" if not xs else f"{med(xs):.{digits}f} ({min(xs):.{digits}f})"


def tratio(a, b):
    """(best, median) of a / b for two lists of time-like samples; None when missing."""
    if not a or not b:
        return None
    return min(a) / min(b), med(a) / med(b)


def paired(a, b, coverage: float = 0.90):
    """a / b per round, for two sides whose samples were taken round by round (a round runs
    its sides back to back): (median, low, high, the interval's coverage), the interval the
    distribution-free one of the median (order statistics). None when missing.

    A small cost cannot be told by best or median alone on a shared machine: the disk's
    state drifts between rounds, and a ratio within each round cancels the drift."""
    if not a or not b or len(a) != len(b):
        return None
    ratios = sorted(x / y for x, y in zip(a, b, strict=True))
    n = len(ratios)
    # the widest k whose [k-th, (n+1-k)-th] interval still has the coverage asked for
    k, tail = 0, 0.0
    for j in range(n // 2):
        tail += math.comb(n, j) / 2**n
        if 1 - 2 * tail < coverage:
            break
        k = j + 1
    if k == 0:  # too few rounds for that coverage: all of them
        lo, hi, got = ratios[0], ratios[-1], 1 - 2 / 2**n
    else:
        lo, hi = ratios[k - 1], ratios[n - k]
        got = 1 - 2 * sum(math.comb(n, j) for j in range(k)) / 2**n
    return statistics.median(ratios), lo, hi, got


def ptxt(p, bold: bool = False) -> str:
    """A paired() ratio: median [low-high]."""
    if p is None:
        return "n/a"
    m = f"**{p[0]:.2f}**" if bold else f"{p[0]:.2f}"
    return f"{m} [{p[1]:.2f}-{p[2]:.2f}]"


def over(a, b):
    """(best, median) of a / b for two (best, median) ratios; None when either is missing."""
    return None if a is None or b is None else (a[0] / b[0], a[1] / b[1])


def rcell(r):
    return "n/a" if r is None else f"**{r[0]:.2f}** ({r[1]:.2f})"


def ratio_txt(r):
    """A ratio shown, not judged: plain, best (median)."""
    return "n/a" if r is None else f"{r[0]:.2f} ({r[1]:.2f})"


def rtxt(r):
    return "n/a" if r is None else f"{r[0]:.2f} (median {r[1]:.2f})"


def tput(nbytes, times):
    """median (best) MB/s from times."""
    if not times:
        return "failed"
    return f"{nbytes / med(times) / 1e6:.0f} ({nbytes / min(times) / 1e6:.0f})"


class Goals:
    """The goals' verdicts, listed by the issue's goal number ("goal N, ..." in the name;
    other lines after goal 1), in the order added within a goal."""

    def __init__(self):
        self._lines: list[tuple[int, str]] = []

    def add(self, name: str, met: bool | None, detail: str, noisy: bool = False) -> None:
        """met: True, False (not met), None (not measured by this run); noisy: measured, but
        this run's control differs by more than the goal's margin, so it judges nothing."""
        if noisy:
            state = "not judged (noise)"
        else:
            state = "not measured" if met is None else "met" if met else "NOT MET"
        number = re.match(r"goal (\d+)", name)
        order = int(number.group(1)) if number else 1
        self._lines.append((order, f"- **{state}**: {name}: {detail}"))

    @property
    def lines(self) -> list[str]:
        return [line for _, line in sorted(self._lines, key=lambda x: x[0])]


def perkey_table(d: dict, goals: Goals) -> list[str]:
    c, cmds = d["cases"], d["commands"]
    if "perkey g=1" not in cmds:
        return []
    first = cmds["perkey g=1"]
    keys = first["groups"] * first["blocks"]
    out = [
        f"### 1b. Per-key cost through the connector scheduler: {keys} keys per request "
        "for every G (store, then hit + load)",
        "",
        "A request stores all its blocks of every group through the connector "
        "scheduler (get_num_new_matched_tokens, build_connector_meta, "
        "update_connector_output, take_events); a second request with the same prompt hits "
        "and loads them (+ update_state_after_alloc). us per key, median (best); each "
        "phase is judged on its own, the total is shown only.",
        "",
        "| groups | blocks per group | store patched | store pristine | patched / pristine "
        "| hit+load patched | hit+load pristine | patched / pristine "
        "| total: patched / pristine | patched total: G / 1 group |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    by_phase: dict[str, list] = {"store": [], "hit+load": []}
    worst_flat, base = [], None
    for g in (1, 2, 4, 8):
        r = c.get(f"perkey g={g}")
        if not r:
            continue
        p, q = r["patched"].get("samples", {}), r["pristine"].get("samples", {})
        rt = tratio(p.get("total_us_per_key"), q.get("total_us_per_key"))
        r_store = tratio(p.get("store_us_per_key"), q.get("store_us_per_key"))
        r_hit = tratio(p.get("hit_load_us_per_key"), q.get("hit_load_us_per_key"))
        by_phase["store"].append((r_store, g))
        by_phase["hit+load"].append((r_hit, g))
        if base is None:
            base = p.get("total_us_per_key")
        flat = tratio(p.get("total_us_per_key"), base)
        if g > 1:
            worst_flat.append((flat, g))
        out.append(
            f"| {g} | {cmds[f'perkey g={g}']['blocks']} | {cell(p.get('store_us_per_key'))} | "
            f"{cell(q.get('store_us_per_key'))} | {rcell(r_store)} | "
            f"{cell(p.get('hit_load_us_per_key'))} | {cell(q.get('hit_load_us_per_key'))} | "
            f"{rcell(r_hit)} | {ratio_txt(rt)} | {rcell(flat)} |"
        )
    for phase, items in by_phase.items():
        judge(
            goals,
            f"goal 1, {phase} through the connector scheduler, per key: patched / pristine "
            f"<= {GOAL_RATIO:.2f} at 1, 2, 4, 8 groups",
            items,
            GOAL_RATIO,
            "G={}",
        )
    judge(
        goals,
        "per-key cost flat across groups: patched G groups / 1 group <= 1.10",
        worst_flat,
        GOAL_RATIO,
        "G={}",
    )
    return out


def judge(
    goals: Goals, name: str, items, limit: float, label: str, low=False, missing=(), note=""
) -> None:
    """items: [((best, median) or None, key)]; met when every best is within the limit
    and nothing is missing (missing: what the goal names that this run did not measure);
    note: said after the figures, judges nothing."""
    known = [(r, k) for r, k in items if r is not None]
    gaps = [f"{m}: not measured" for m in missing]
    if not known:
        goals.add(name, None, "; ".join(gaps) or "no figures")
        return
    ok = all((r[0] >= limit) if low else (r[0] <= limit) for r, _ in known)
    goals.add(
        name,
        ok and len(known) == len(items) and not gaps,
        "; ".join([*(f"{label.format(k)}: {rtxt(r)}" for r, k in known), *gaps]) + note,
    )


PHASES = {  # sched_worker.PHASES: the label of each phase in the tables and goals
    "store": "store",
    "cold": "lookup of a cold prompt",
    "step1": "step 1: hits + promotions started",
    "step2": "step 2: lookup of ready keys",
    "load": "prepare/complete_load",
}


def phase_cases(c: dict) -> list[tuple[str, int, bool, dict]]:
    """(name, n, full, results) of the phases cases, room before full, by size."""
    out = []
    for name, r in c.items():
        if name.startswith("phases"):
            out.append((name, int(name.split("n=")[1].split()[0]), name.endswith(" full"), r))
    return sorted(out, key=lambda x: (x[2], x[1]))


def phases_table(d: dict, goals: Goals) -> list[str]:
    cases = phase_cases(d["cases"])
    if not cases:
        return []
    out = [
        "### 1a. The phases of a request on the tiering manager, each on its own",
        "",
        "n keys per phase: **store** (prepare_store + complete_store of n keys, end of "
        "step), **lookup of a cold prompt** (n keys no tier holds, end of step), **step 1** "
        "(lookup of the n stored keys, hits, and n keys only the secondary tier holds, "
        "promotions started; end of step: the promotion job is submitted), **step 2** "
        "(lookup of the 2n keys again, all ready), **prepare/complete_load** (prepare_load "
        "of the 2n keys, end of step, complete_load). The CPU tier holds 2n blocks; "
        '"full": taken beforehand by another request, so the store evicts n of them and '
        "the promotions the other n. ms, median (best); patched / pristine: best (median).",
        "",
        "| phase | n | CPU tier | patched | pristine | patched / pristine | patched us/key |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios: dict[str, list] = {phase: [] for phase in PHASES}
    for phase, label in PHASES.items():
        metric = f"{phase}_ms"
        keys_per_phase = 2 if phase in ("step1", "step2", "load") else 1
        for _, n, full, r in cases:
            p, q = r["patched"], r["pristine"]
            ps, qs = p.get("samples", {}), q.get("samples", {})
            where = f"n={n}{' full' if full else ''}"
            if p.get("stopped") and qs.get(metric) and p.get("limit_s"):
                bound = p["limit_s"] * 1e3 / min(qs[metric])  # the whole case vs one phase
                r_cell = f"**> {bound:.0f}**"
                ratios[phase].append(((bound, bound), f"{where} (stopped; lower bound)"))
            else:
                rt = tratio(ps.get(metric), qs.get(metric))
                r_cell = rcell(rt)
                ratios[phase].append((rt, where))
            pc = f"stopped ({p['stopped']})" if p.get("stopped") else cell(ps.get(metric))
            qc = f"stopped ({q['stopped']})" if q.get("stopped") else cell(qs.get(metric))
            per_key = (
                f"{med(ps[metric]) * 1e3 / (keys_per_phase * n):.3f}" if ps.get(metric) else "n/a"
            )
            out.append(
                f"| {label} | {n} | {'full' if full else 'room'} | {pc} | {qc} | "
                f"{r_cell} | {per_key} |"
            )
    for phase, label in PHASES.items():
        judge(
            goals,
            f"goal 1, {label}: patched / pristine <= {GOAL_RATIO:.2f} at every n, room and full",
            ratios[phase],
            GOAL_RATIO,
            "{}",
        )
    out += growth_table(cases, goals)
    return out


def growth_table(cases: list, goals: Goals) -> list[str]:
    """How each phase grows from one size to the next (best samples): linear or not."""
    growth = []  # (phase, full, tree, lo, hi, text, verdict)
    for phase in PHASES:
        metric = f"{phase}_ms"
        for full in (False, True):
            by_n = {n: r for _, n, f, r in cases if f == full}
            sizes = sorted(by_n)
            pairs = list(itertools.pairwise(sizes))
            if len(sizes) > 2:
                pairs.append((sizes[0], sizes[-1]))
            for tree in ("patched", "pristine"):
                for lo, hi in pairs:
                    a, b = by_n[lo][tree], by_n[hi][tree]
                    s_lo = a.get("samples", {}).get(metric)
                    s_hi = b.get("samples", {}).get(metric)
                    if not s_hi and b.get("limit_s") and s_lo:
                        g = b["limit_s"] * 1e3 / min(s_lo)  # a lower bound
                        verdict = "NOT linear" if g > LINEAR * hi / lo else "stopped"
                        growth.append((phase, full, tree, lo, hi, f"> {g:.1f}", verdict))
                        continue
                    if not s_hi or not s_lo:
                        continue  # stopped at the smaller size already
                    g = min(s_hi) / min(s_lo)
                    verdict = "linear" if g <= LINEAR * hi / lo else "NOT linear"
                    growth.append((phase, full, tree, lo, hi, f"{g:.1f}", verdict))
    out = [
        "",
        "Growth of each phase (best samples) from one size to the next, and from the "
        f"smallest to the largest (linear: at most {LINEAR}x the growth of the keys; "
        "quadratic: its square):",
        "",
        "| phase | CPU tier | tree | "
        + " | ".join(
            f"{lo} -> {hi} ({hi // lo}x keys)"
            for lo, hi in dict.fromkeys((x[3], x[4]) for x in growth)
        )
        + " |",
        "| --- | --- | --- |" + " --- |" * len(dict.fromkeys((x[3], x[4]) for x in growth)),
    ]
    rows: dict = {}
    for phase, full, tree, _lo, _hi, text, verdict in growth:
        mark = "" if verdict == "linear" else f" ({verdict})"
        rows.setdefault((phase, full, tree), []).append(f"{text}x{mark}")
    for (phase, full, tree), cells in rows.items():
        out.append(
            f"| {PHASES[phase]} | {'full' if full else 'room'} | {tree} | "
            + " | ".join(cells)
            + " |"
        )
    pg = [x for x in growth if x[2] == "patched"]
    bad = [x for x in pg if x[6] != "linear"]
    goals.add(
        "goal 1, every phase grows linearly in the keys of the step (patched)",
        bool(pg) and not bad,
        (
            f"{len(pg) - len(bad)} of {len(pg)} size steps linear"
            + (
                "; not: "
                + "; ".join(
                    f"{PHASES[x[0]]} {'full' if x[1] else 'room'} {x[3]} -> {x[4]}: {x[5]}x"
                    for x in bad
                )
                if bad
                else ""
            )
        )
        if pg
        else "no figures",
    )
    return out


def cold_table(d: dict, goals: Goals) -> list[str]:
    r = d["cases"].get("cold")
    if not r:
        return []
    p, q = r["patched"].get("samples", {}), r["pristine"].get("samples", {})
    out = [
        "",
        "### 1c. Lookup of a long cold prompt through real secondary tiers "
        f"({d['commands']['cold']['blocks']} keys, all misses): us per key, median (best)",
        "",
        "| secondary tier | patched | pristine | patched / pristine |",
        "| --- | --- | --- | --- |",
    ]
    judged = []
    for metric, label in (
        ("example_us_per_key", "in-memory example"),
        ("fs_us_per_key", "fs_python (a stat per key)"),
    ):
        rt = tratio(p.get(metric), q.get(metric))
        judged.append((rt, label))
        out.append(f"| {label} | {cell(p.get(metric))} | {cell(q.get(metric))} | {rcell(rt)} |")
    judge(
        goals,
        f"goal 1, lookup of a cold prompt ({d['commands']['cold']['blocks']} keys) through "
        f"a real secondary tier: patched / pristine <= {GOAL_RATIO:.2f}",
        judged,
        GOAL_RATIO,
        "{}",
    )
    out += [
        "",
        "The connector scheduler stops at the first miss of a full-attention group, so a "
        "cold prompt costs it one lookup; a sliding-window-only layout scans every key, "
        "at the cost above.",
    ]
    return out


def sched_section(d: dict, goals: Goals) -> list[str]:
    out = [
        "## 1. Scheduler side: patched vs pristine 0.22.1",
        "",
        f"Each tree in its own process; the same cases in {d['rounds']} interleaved "
        "round(s), the order alternating. Real `OffloadingConnectorScheduler`, "
        "`TieringOffloadingManager`, `CPUPrimaryTierOffloadingManager` over a "
        "`SharedOffloadRegion`; the managers are built directly (pristine "
        "`TieringOffloadingSpec.get_manager` refuses 2+ groups), so the same code path runs "
        "on both trees. Secondary tier: a tier that holds a given set of keys and finishes "
        "its jobs at once (1a), vLLM's in-memory example tier (1b, 1c), the fs_python tier "
        "(1c).",
        "",
    ]
    out += phases_table(d, goals) + [""] + perkey_table(d, goals) + cold_table(d, goals)
    out += ["", f"Scheduler side: {d['seconds']:.0f} s; patched side: {d['patched_site']}."]
    return out


def integrity_lines(d: dict) -> list[str]:
    """The fs tier's checksum (`checksum`, or 0.34.0's `checksum_blocks`): on vs off."""
    setting = "checksum_blocks" if d.get("tier_type") == "fs" else "checksum"
    if not d.get("integrity_check"):
        return ["Integrity check: none in this tree (nothing to measure)."]
    if not d.get("integrity"):
        return [
            f"Integrity check: the tier's `{setting}` setting (off by default, as in the "
            "figures above); on/off not measured in this run."
        ]
    out = [
        f"Integrity check (the tier's `{setting}` setting; the figures above are with its "
        "default): the tier checking blocks vs not, same rows; one tier, its check switched "
        "per side (the same directories, buffer and threads), the three sides of a round back "
        "to back, the order rotating per round (the second 'off' is an A/A control). MB/s of "
        "payload: median (best); on / off and A/A: the median of the per-round ratios "
        "[its 90% interval], in throughput.",
        "",
        "| row | blocks | rounds | checksum | store on | store off | on / off | A/A | load on "
        "| load off | on / off | A/A |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in d["integrity"]:
        nbytes = r["row_bytes"] * r["blocks"]
        on, off = r["on"], r["off"]
        ck = r["checksum"] or {}
        aa = r.get("off_aa", {})
        cells = []
        for op in ("store_s", "load_s"):
            cells += [
                tput(nbytes, on[op]),
                tput(nbytes, off[op]),
                ptxt(paired(off[op], on[op]), bold=True),
                ptxt(paired(off[op], aa.get(op))),
            ]
        out.append(
            f"| {r['label']} | {r['blocks']} | {len(on['store_s'])} | {ck.get('algorithm')} "
            f"({where(ck)}) | " + " | ".join(cells) + " |"
        )
    out += [""] + [f"- {r['label']}: {cpu_txt(r)}" for r in d["integrity"] if cpu_txt(r)]
    return out


def cpu_txt(r: dict) -> str:
    """The check's CPU per block (process CPU time, every thread; median), on vs off, and
    what checksumming a just-loaded block once costs (the least any check can)."""
    on, off = r["on"], r["off"]
    if not on.get("load_cpu_s"):
        return ""
    us = {
        (side, op): 1e6 * med(x[f"{op}_cpu_s"]) / r["blocks"]
        for side, x in (("on", on), ("off", off))
        for op in ("store", "load")
    }
    txt = ", ".join(
        f"{op} {us['on', op]:.0f} / {us['off', op]:.0f} us "
        f"(+{us['on', op] - us['off', op]:.1f}, {us['on', op] / us['off', op]:.2f}x)"
        for op in ("store", "load")
    )
    once = r.get("hash_once_s")
    if once:
        txt += f"; checksumming a loaded block once: {1e6 * med(once) / r['blocks']:.1f} us"
    read = r.get("read_once_s")
    if read:
        # a check that reads every byte costs at least this; where stores keep every core
        # busy (CPU per block >= the cores' wall per block), its share is a throughput floor
        floor = 1e6 * med(read) / r["blocks"]
        cores = med(off["store_cpu_s"]) / med(off["store_s"])
        txt += (
            f"; reading a loaded block once (any check's floor): {floor:.1f} us, "
            f"{100 * floor / us['off', 'store']:.1f}% of a store's CPU with the check off; "
            f"the stores kept {cores:.1f} of {r.get('cpus', '?')} CPUs busy"
        )
    return "CPU per block, on / off: " + txt


def where(ck: dict) -> str:
    """Where a block's checksum lives: the file's xattr, or a trailer of so many bytes."""
    return f"xattr {ck['xattr']}" if ck.get("xattr") else f"+{ck.get('trailer_bytes')} B"


def goal_integrity(goals: Goals, d: dict, track: str = "", opt_in: bool = False) -> None:
    """Goal 4: the checksum on by default, costing <= 5 % at 64 KiB, store and load (opt_in:
    a track that follows upstream's opt-in #57912, judged on the cost alone)."""
    cost = f"at <= {100 * (1 - GOAL_INTEGRITY):.0f}% cost at 64 KiB, store and load"
    name = (
        f"goal 4{track}, integrity (opt-in, as #57912) {cost}"
        if opt_in
        else f"goal 4{track}, integrity on by default {cost}"
    )
    if not d.get("integrity_check"):
        goals.add(name, False, "the tier of this tree has no integrity check")
        return
    default = d.get("checksum_default", "unknown (not recorded by disk_bench.py)")
    row = next((r for r in d.get("integrity", []) if r["row_bytes"] == 64 << 10), None)
    if row is None:
        goals.add(name, None, f"default {default!r}; on / off not measured in this run")
        return
    on, off, aa = row["on"], row["off"], row.get("off_aa", {})
    # judged per round (paired()): the three sides of a round run back to back, so the
    # ratio within a round cancels the disk's drift that best or median alone would keep
    items = [
        (paired(off["store_s"], on["store_s"]), "store on / off"),
        (paired(off["load_s"], on["load_s"]), "load on / off"),
    ]
    controls = [
        (paired(off["store_s"], aa.get("store_s")), "A/A store"),
        (paired(off["load_s"], aa.get("load_s")), "A/A load"),
    ]
    known = [(p, k) for p, k in items if p is not None]
    cheap = len(known) == 2 and all(p[0] >= GOAL_INTEGRITY for p, _ in known)
    controls = [(p, k) for p, k in controls if p is not None]
    # two identical sides further apart than the goal's margin: the run cannot tell a cost
    # of that size from its noise, either way
    noisy = any(not GOAL_INTEGRITY <= p[0] <= 1 / GOAL_INTEGRITY for p, _ in controls)
    rounds = len(on["store_s"])
    coverage = known[0][0][3] if known else 0.0
    cpu = cpu_txt(row)
    goals.add(
        name,
        cheap and (opt_in or default not in ("none", "False", None)),
        f"default checksum {default!r}; {rounds} rounds, the median of the per-round ratios "
        f"[its {100 * coverage:.0f}% interval]: "
        + "; ".join(f"{k}: {ptxt(p)}" for p, k in known + controls)
        + (f"; {cpu}" if cpu else "")
        + (
            f"; the A/A control is outside {GOAL_INTEGRITY:.2f}-{1 / GOAL_INTEGRITY:.2f}: "
            "this run's noise exceeds the goal's margin (judge on the CPU per block, or "
            "rerun on a quieter machine)"
            if noisy
            else ""
        ),
        noisy=noisy,
    )


def goal_file_sizes(goals: Goals, points: list[dict]) -> None:
    """Goal 6: tier throughput plotted against file size, 4 KiB - 4 MiB, and the docs."""
    sizes = sorted(p["x"] for p in points)
    lo, hi = GOAL_SIZES
    covered = bool(sizes) and sizes[0] <= lo and sizes[-1] >= hi
    docs = ROOT / "docs" / "operators.md"
    documented = docs.exists() and GOAL_DOCS_HEADING in docs.read_text()
    goals.add(
        f"goal 6, tier throughput against file size from {fmt_bytes(lo)} to "
        f"{fmt_bytes(hi)} (blocks_per_chunk's lever) and the docs on picking it",
        covered and documented,
        f"files measured: {', '.join(fmt_bytes(x) for x in sizes) or 'none'}"
        + ("" if covered else f" (the range to {fmt_bytes(hi)} is not covered)")
        + "; docs/operators.md "
        + (f"has {GOAL_DOCS_HEADING!r}" if documented else f"lacks {GOAL_DOCS_HEADING!r}"),
    )


CHUNK_NOT_TAKEN = (
    "the fs tier's lookup (one stat per key), atomic store (temp file + rename per key), "
    "size check, per-file checksum / HMAC and restart index all rest on one key = "
    "one file; a chunk's G keys may be stored in different jobs (the budget tracks a "
    "per-chunk group bitmask), so one file per chunk needs per-row presence inside the "
    "file, in-place row writes into a live file (no atomic rename) or a rewrite of the "
    "chunk, and a new FileMapper namespace; the budget already evicts by chunk. Details: "
    "docs/benchmark.md"
)


def chunk_layout_table(hma: list[dict]) -> tuple[list[str], list]:
    """The raw one-file-per-chunk layout beside raw file-per-group; (lines, the 4-group /
    1-group ratios of the chunk layout)."""
    if not hma or "chunk" not in hma[0]:
        return [], []
    base = next((r for r in hma if r["groups"] == 1), None)
    out = [
        "### 3a. Layout alternative: one file per chunk (raw), beside file per group",
        "",
        "The same chunks and threads as above, raw I/O: the G rows of a chunk in one file at "
        "page-aligned offsets, stored with one writev per chunk, loaded with one preadv of the "
        "whole chunk, or one task per key that opens the chunk file and preads its group's "
        "row at its offset (as a per-key tier would serve a key; a sliding-window group read "
        "alone). MB/s: median (best); vs 1 group: best (median), against the same layout "
        "at 1 group (one file per chunk = one file per key there).",
        "",
        "| groups | chunk file | store | vs 1 group | load whole chunk | vs 1 group "
        "| load per key by offset | vs 1 group | store file per group (raw) "
        "| load file per group (raw) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios = []
    for r in hma:
        nbytes = r["chunk_bytes"] * r["chunks"]
        c, w = r["chunk"], r["raw"]
        by_key = r.get("chunk_by_group", {}).get("load_s")
        b = base["chunk"] if base else {}
        vs_s = tratio(b.get("store_s"), c["store_s"])
        vs_l = tratio(b.get("load_s"), c["load_s"])
        vs_k = tratio(b.get("load_s"), by_key) if by_key else None
        if r["groups"] == 4:
            ratios = [(vs_s, "store"), (vs_l, "load whole chunk"), (vs_k, "load per key")]
        out.append(
            f"| {r['groups']} | {fmt_bytes(r['chunk_bytes'])} | {tput(nbytes, c['store_s'])} "
            f"| {rcell(vs_s)} | {tput(nbytes, c['load_s'])} | {rcell(vs_l)} | "
            f"{tput(nbytes, by_key) if by_key else '-'} | {rcell(vs_k) if by_key else '-'} | "
            f"{tput(nbytes, w['store_s'])} | {tput(nbytes, w['load_s'])} |"
        )
    return out, [(x, k) for x, k in ratios if x is not None]


def rows_table(d: dict, goals: Goals, title: str, track: str = "") -> tuple[list[str], list]:
    """The tier vs raw by row size, and goal 2 judged on it (track: said in the goal's name)."""
    out = [
        title,
        "",
        f"{d['threads']} I/O threads on both sides (the tier: half read-, half "
        "write-priority, all serve either queue; jobs of 16 rows submitted at once), "
        f"{d['rounds']} round(s) (at least one per side, two per side for the goal rows: the "
        "order rotates, so every side runs in every position), the same directory "
        f"tree under `{d['dir']}` (directories made beforehand, files deleted between rounds, "
        "pages dropped before loads). Raw: open/write/close (open/readv/close) of the "
        "payload; the tier adds an existence check, a temporary file and a rename per block. "
        "MB/s of payload: median (best); tier / raw: best (median).",
        "",
        "| row | blocks | tier I/O | raw I/O | store tier | store raw | tier / raw "
        "| load tier | load raw | tier / raw |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    points, judged, floors, defaults = [], [], [], []
    for r in d["rows"]:
        nbytes = r["payload"] * r["blocks"]
        t, w = r["tier"], r["raw"]
        rs = tratio(w["store_s"], t["store_s"])  # throughput ratio = inverse time ratio
        rl = tratio(w["load_s"], t["load_s"])
        mode = "O_DIRECT" if r["tier_direct"] else "buffered"
        if t.get("error") and not t["store_s"]:
            mode += f" (failed: {t['error']})"
        out.append(
            f"| {r['label']} | {r['blocks']} | {mode} | "
            f"{'O_DIRECT' if r['raw_direct'] else 'buffered'} | {tput(nbytes, t['store_s'])} | "
            f"{tput(nbytes, w['store_s'])} | {rcell(rs)} | {tput(nbytes, t['load_s'])} | "
            f"{tput(nbytes, w['load_s'])} | {rcell(rl)} |"
        )
        if r["row_bytes"] == r["payload"]:
            pt = {"x": r["payload"]}
            for side, key in (("tier", "tier"), ("raw", "raw")):
                for op in ("store", "load"):
                    times = r[key][f"{op}_s"]
                    pt[f"{side} {op}"] = nbytes / med(times) / 1e6 if times else None
            points.append(pt)
            if r["payload"] in GOAL_FS_ROWS:
                u = r.get("tier_nocheck")
                if u and u["store_s"]:
                    # the tier's own cost: checking nothing, as raw; goal 4 prices the check
                    judged += [
                        (tratio(w["store_s"], u["store_s"]), f"{r['label']} store"),
                        (tratio(w["load_s"], u["load_s"]), f"{r['label']} load"),
                    ]
                    defaults.append(f"{r['label']} store {rtxt(rs)}, load {rtxt(rl)}")
                else:
                    judged += [(rs, f"{r['label']} store"), (rl, f"{r['label']} load")]
                for side, how in (
                    ("raw_atomic", "temp + rename"),
                    ("raw_linkat", "O_TMPFILE + linkat"),
                ):
                    a = r.get(side)
                    if a and a["store_s"]:
                        floors.append(
                            f"{r['label']}: raw with an atomic publish ({how}) / raw "
                            f"{rtxt(tratio(w['store_s'], a['store_s']))}, tier / it "
                            f"{rtxt(tratio(a['store_s'], t['store_s']))}"
                        )
                    elif a and a.get("error"):
                        floors.append(f"{r['label']}: raw with {how} failed ({a['error']})")
    if defaults:
        out += [
            "",
            "Goal 2 is judged on the tier with its integrity check off, as raw checks nothing "
            "(goal 4 prices the check). The tier with its default check, tier / raw, as in the "
            "table: " + "; ".join(defaults),
        ]
    goal2 = (
        f"goal 2{track}, the fs tier's own cost: tier / raw >= {GOAL_FS} at "
        + " and ".join(fmt_bytes(b) for b in GOAL_FS_ROWS)
        + " rows, store and load"
    )
    missing = [fmt_bytes(b) for b in GOAL_FS_ROWS if not any(p["x"] == b for p in points)]
    # store only: a load has nothing to publish
    floor = "; stores against this disk's floors: " + "; ".join(floors) if floors else ""
    if defaults:
        floor = (
            "; the tier with its check off, as raw (with its default check, which goal 4 "
            "prices: " + "; ".join(defaults) + ")" + floor
        )
    judge(goals, goal2, judged, GOAL_FS, "{}", low=True, missing=missing, note=floor)
    if floors:
        out += [
            "",
            "Stores against this disk's cost of publishing atomically (no reader sees a partial "
            "file; no fsync on either side, as the tier does none): " + "; ".join(floors),
        ]
    return out, points


def disk_upstream_section(d: dict, goals: Goals) -> list[str]:
    """The 0.34.0 track's fs tier (its C batch path) vs raw: goals 2 and 4 on that track."""
    track = " (0.34.0 track)"
    out, _ = rows_table(
        d,
        goals,
        "### 2b. The 0.34.0 track's `fs` tier (a job is one C batch, GIL released) vs raw",
        track,
    )
    out += ["", *integrity_lines(d)]
    goal_integrity(goals, d, track, opt_in=True)
    return out


def disk_section(
    d: dict, goals: Goals, d_upstream: dict | None = None
) -> tuple[list[str], list[dict]]:
    out, points = rows_table(
        d, goals, f"## 2. Disk tier: {d.get('tier_type', 'fs_python')} vs raw file-per-block I/O"
    )
    goal_file_sizes(goals, points)
    out += ["", *integrity_lines(d)]
    goal_integrity(goals, d)
    if d_upstream:
        out += ["", *disk_upstream_section(d_upstream, goals)]

    h0 = d["hma"][0]
    out += [
        "",
        "## 3. HMA cost: equal bytes per token as 1, 2 or 4 KV cache groups",
        "",
        f"Chunks of {fmt_bytes(h0['chunk_bytes'])} (all groups together), {h0['chunks']} "
        "chunks per round: G groups write G files of 1/G the size per chunk, the same bytes "
        "and tokens for every G, through the fs tier (jobs of 16 chunks submitted at once, "
        "every file its own task) "
        "and raw (one task per file; serial: one task per chunk, its G files in sequence). "
        "MB/s: median (best); vs 1 group: best (median). G files of 1/G the size cost the "
        "disk itself (raw) more than one file: the goal is that the tier adds no cost of its "
        "own, i.e. its 4-group / 1-group ratio over raw's.",
        "",
        "| groups | file | store tier | vs 1 group | load tier | vs 1 group "
        "| store raw | vs 1 group | load raw | vs 1 group | load raw serial |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base, judged, over_raw = None, [], []
    for r in d["hma"]:
        nbytes = r["chunk_bytes"] * r["chunks"]
        t, w = r["tier"], r["raw"]
        if r["groups"] == 1:
            base = r
        vs = {
            (side, op): tratio(base[side][f"{op}_s"], r[side][f"{op}_s"]) if base else None
            for side in ("tier", "raw")
            for op in ("store", "load")
        }
        if r["groups"] == 4:
            judged = [(vs["tier", op], op) for op in ("store", "load")]
            over_raw = [(over(vs["tier", op], vs["raw", op]), op) for op in ("store", "load")]
        serial = r.get("raw_serial", {}).get("load_s")
        out.append(
            f"| {r['groups']} | {fmt_bytes(r['row_bytes'])} | {tput(nbytes, t['store_s'])} | "
            f"{rcell(vs['tier', 'store'])} | {tput(nbytes, t['load_s'])} | "
            f"{rcell(vs['tier', 'load'])} | {tput(nbytes, w['store_s'])} | "
            f"{rcell(vs['raw', 'store'])} | {tput(nbytes, w['load_s'])} | "
            f"{rcell(vs['raw', 'load'])} | {tput(nbytes, serial) if serial else '-'} |"
        )
    chunk_lines, chunk_ratios = chunk_layout_table(d["hma"])
    out += ["", *chunk_lines]
    goal3 = (
        f"goal 3, HMA per-token throughput: the tier's 4 groups / 1 group >= {GOAL_HMA}, "
        "store and load, absolute"
    )
    known = [(r, op) for r, op in judged if r is not None]
    if not known:
        goals.add(goal3, None, "no figures")
    else:
        goals.add(
            goal3,
            len(known) == 2 and all(r[0] >= GOAL_HMA for r, _ in known),
            "; ".join(f"{op}: {rtxt(r)}" for r, op in known)
            + " (over raw file per group's own 4-group / 1-group: "
            + "; ".join(f"{op} {rtxt(r)}" for r, op in over_raw)
            + "). Layout alternative, one file per chunk, raw (section 3a): 4 groups / 1 "
            "group "
            + ("; ".join(f"{k} {rtxt(r)}" for r, k in chunk_ratios) or "not measured")
            + "; not taken by the tier: "
            + CHUNK_NOT_TAKEN,
        )
    out += ["", f"Disk sections: {d['seconds']:.0f} s."]
    return out, points


def layout_section(d: dict | None, goals: Goals) -> list[str]:
    """Goal 5: useful / allocated bytes per layout, CPU tier and fs tier (layout_bytes.py)."""
    name = (
        "goal 5, only useful bytes on disk (a key's file holds its group's bytes, "
        "page-aligned) and the CPU tier's used / allocated bytes per layout"
    )
    out = ["## 3c. Useful bytes per KV cache group: CPU tier rows and fs tier files", ""]
    if d is None:
        out.append("Not measured: layout_bytes.py did not run.")
        goals.add(name, None, "layout_bytes.py did not run")
        return out
    out += [
        "Per layout (the regression suite's, then real model sizes: assumptions in the "
        "names), vLLM's own grouping (get_kv_cache_configs) and the real "
        "TieringOffloadingSpec: the row every group's block gets (cpu_page_size_per_worker, "
        "page-aligned), each group's useful bytes per offloaded block (its layers x the real "
        "page bytes, no padding), and used / allocated for a chunk (one block of every "
        "group): the CPU tier, the fs tier under test (no checksum), a file of the "
        "group's bytes rounded up to the page (goal 5; also the bytes of per-group CPU "
        "rows and of one file per chunk at page-aligned offsets), one file per chunk "
        "packed.",
        "",
        "| layout | blocks per chunk | row | groups: useful bytes per block | CPU tier | "
        "fs tier | group's bytes, page-aligned | chunk file, packed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    worst = None
    for r in d["layouts"]:
        if "error" in r:
            out.append(f"| {r['name']} | {r['blocks_per_chunk']} | {r['error']} | | | | | |")
            continue
        per = "; ".join(
            f"{x['kind'].removesuffix('Spec')} x{x['layers']} {fmt_size(x['useful'])}"
            for x in r["groups"]
        )
        out.append(
            f"| {r['name']} | {r['blocks_per_chunk']} | {fmt_size(r['row'])} | {per} | "
            f"{r['cpu_today']:.2f} | {r['disk_today']:.2f} | {r['disk_useful']:.2f} | "
            f"{r['disk_chunk_packed']:.2f} |"
        )
        gap = r["disk_useful"] - r["disk_today"]
        if worst is None or gap > worst["disk_useful"] - worst["disk_today"]:
            worst = r
    ok = [r for r in d["layouts"] if "error" not in r]
    useful_only = all(r["disk_today"] >= r["disk_useful"] - 1e-9 for r in ok)
    goals.add(
        name,
        useful_only,
        (
            "the fs tier writes each group's bytes, page-aligned"
            if ok and all(r.get("disk_group_files") for r in ok)
            else "the fs tier writes the padded row per key"
        )
        + (
            f": disk used / allocated down to {worst['disk_today']:.2f} ({worst['name']}, "
            f"blocks_per_chunk {worst['blocks_per_chunk']}) where the group's bytes, "
            f"page-aligned, would give {worst['disk_useful']:.2f}"
            if worst and not useful_only
            else ""
        )
        + "; CPU tier used / allocated per layout in section 3c",
    )
    return out


def fmt_size(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} B"


def budget_section(d: dict | None, goals: Goals) -> list[str]:
    """The fs tier's max_bytes budget (issue 19 goal 6): with vs without, side by side."""
    name_s = "issue 19 (max_bytes), scheduler per-key cost with a budget / without <= 1.10"
    name_t = "issue 19 (max_bytes), store throughput at a full budget / unbounded >= 0.9"
    out = ["## 3b. The fs tier's max_bytes budget (issue 19), patched side", ""]
    if d is None or "skipped" in d:
        why = "budget_bench.py did not run" if d is None else d["skipped"]
        out.append(f"Not measured: {why}.")
        goals.add(name_s, None, why)
        goals.add(name_t, None, why)
        return out
    s, t = d["sched"], d["store"]
    rs = tratio(s["max_bytes"], s["unbounded"])
    rc = tratio(s.get("max_bytes_cpu"), s.get("unbounded_cpu"))
    rt = (max(t["max_bytes"]) / max(t["unbounded"]), med(t["max_bytes"]) / med(t["unbounded"]))
    out += [
        "Both tiers in one process (vLLM files "
        f"{d['fingerprint']['digest']}, newest {d['fingerprint']['newest']}), rounds "
        "interleaved. Scheduler: "
        "requests of 256 new blocks through the real connector scheduler, CPU tier and fs_python "
        f"tier, over max_bytes = {fmt_bytes(s['budget_bytes'])} (a quarter of the workload; "
        f"{s['evicted_files']} files evicted, {fmt_bytes(s['used_bytes'])} used at the end) vs "
        "no budget; timed: every connector call and the take_events() that collects the tier's "
        "jobs once its I/O (untimed) is done; goal judged on wall time, the scheduler "
        "thread's CPU time shown beside it. Store: jobs of 8 rows of 64 KiB, 8 write "
        "threads, at a full budget "
        f"({t['evicted_files']} files evicted; full: {t['full']}"
        + (
            f": the timed rounds evicted {t['evicted_share']:.0%} of the files they wrote and "
            f"left the budget at {t['min_used_share']:.0%} of max_bytes or more"
            if "evicted_share" in t
            else ""
        )
        + ") vs unbounded; the budgeted side's time includes removing what it evicted.",
        "",
        "| | unbounded | max_bytes | ratio |",
        "| --- | --- | --- | --- |",
        f"| scheduler, us per key (wall) | {cell(s['unbounded'])} | {cell(s['max_bytes'])} "
        f"| {rcell(rs)} |",
        f"| scheduler thread, CPU us per key | {cell(s.get('unbounded_cpu', []))} | "
        f"{cell(s.get('max_bytes_cpu', []))} | {ratio_txt(rc)} |",
        f"| store, keys/s | {med(t['unbounded']):.0f} ({max(t['unbounded']):.0f}) | "
        f"{med(t['max_bytes']):.0f} ({max(t['max_bytes']):.0f}) | {rcell(rt)} |",
    ]
    judge(goals, name_s, [(rs, "wall, with / without")], 1.10, "{}")
    fl = d.get("floor")
    rf = None
    if fl and fl.get("plain") and fl.get("removing"):
        rf = (max(fl["removing"]) / max(fl["plain"]), med(fl["removing"]) / med(fl["plain"]))
        out.append(
            f"| raw writes, files/s: without / with removing as many (this disk's floor) | "
            f"{med(fl['plain']):.0f} ({max(fl['plain']):.0f}) | "
            f"{med(fl['removing']):.0f} ({max(fl['removing']):.0f}) | {rcell(rf)} |"
        )
    floor = (
        f"; raw writes on this disk, removing as many files as they write / not: {rtxt(rf)} "
        "(a budget at its limit removes a file per file it writes)"
        if rf
        else ""
    )
    goals.add(name_t, rt[0] >= 0.9, f"full / unbounded: {rtxt(rt)}{floor}")
    return out


def reach_section(d: dict | None, goals: Goals) -> list[str]:
    """The budget's unreachable share of kept bytes (issue 19), per layout, vs per-key LRU."""
    name = "issue 19 (max_bytes), unreachable share of kept bytes <= 5% at every layout"
    out = ["### 3b.1 What the max_bytes budget keeps can still hit (issue 19), patched side", ""]
    if d is None or "skipped" in d:
        why = "budget_reach.py did not run" if d is None else d["skipped"]
        out.append(f"Not measured: {why}.")
        goals.add(name, None, why)
        return out
    w = d["workload"]
    out += [
        "A kept file is unreachable when a full-attention chunk of its prompt up to its end is "
        "not on disk (it can never hit). Through the real connector scheduler, CPU tier "
        f"({w['cpu_blocks']} blocks) and fs_python tier (vLLM files "
        f"{d['fingerprint']['digest']}, newest {d['fingerprint']['newest']}): "
        f"{w['prompts']} prompts of {w['head_chunks']} chunks of one of {w['heads']} shared "
        f"heads and {w['tail_chunks']} of their own, then {w['revisits']} revisits, over "
        f"{w['budget_chunks']} chunks (one file of every group each); per-key LRU: the same "
        "tier unbounded, trimmed after every step least recently used file first to the same "
        "bytes. Share of kept bytes, the mean over the requests once the budget is full "
        "(each sampled at rest: its store jobs done, the budget's removals done) and at the "
        "end.",
        "",
        "| layout | budget, mean | budget, end | per-key LRU, mean | per-key LRU, end | "
        "tokens hit, budget / LRU | files not written as unreachable |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def pct(x):
        return "n/a" if x is None else f"{x:.1%}"

    judged = []
    for layout, c in d["cases"].items():
        b, lru = c["max_bytes"], c["lru"]
        out.append(
            f"| {layout} | {pct(b['mean'])} | {pct(b['end'])} | {pct(lru['mean'])} | "
            f"{pct(lru['end'])} | {b['tokens_hit']} / {lru['tokens_hit']} | "
            f"{b.get('not_written_unreachable', 'n/a')} |"
        )
        worst = max(x for x in (b["mean"], b["end"]) if x is not None)
        judged.append((layout, worst))
    bad = [f"{layout} {x:.1%}" for layout, x in judged if x > d["goal"]]
    goals.add(
        name,
        not bad,
        ("over: " + ", ".join(bad))
        if bad
        else "worst " + ", ".join(f"{layout} {x:.1%}" for layout, x in judged),
    )
    return out


def fmt_frac(max_bytes: int, w: dict) -> str:
    """max_bytes as S or S / k."""
    k = w["budget_files"] * w["file_bytes"] // max_bytes
    return "S" if k == 1 else f"S / {k}"


def shared_root_section(d: dict | None, goals: Goals) -> list[str]:
    """N engines on one root (issue 35): one max_bytes for the root vs a budget per engine."""
    name = "issue 35, N engines on one root: one budget keeps >= 80% of it, unreachable <= 5%"
    out = ["### 3b.2 N engines on one root: one budget for the root (issue 35)", ""]
    if d is None or "skipped" in d:
        why = "shared_root.py did not run" if d is None else d["skipped"]
        out.append(f"Not measured: {why}.")
        goals.add(name, None, why)
        return out
    w = d["workload"]
    out += [
        f"N engines (processes), each an FsTierBudget (vLLM files {d['fingerprint']['digest']}) "
        f"over one root of real {w['file_bytes'] >> 10} KiB files, driven as the tier drives it: "
        f"{w['requests_per_engine']} requests per engine, each {w['head_chunks']} chunks of one "
        f"of {w['heads']} shared heads and {w['tail_chunks']} of its own, looked up in prompt "
        "order, the rest stored in one job. S = "
        f"{w['budget_files']} files. One budget: max_bytes = S on every engine (ledgers read "
        f"every tick, the root listed at most every {w['rescan_s']} s); a budget per engine: "
        "max_bytes = S / N each (what an operator had to set) and S each (settings unchanged as N "
        "grows), the budget before this one. Utilization: the root's bytes over S, every "
        "0.1 s once it reached 80%; unreachable: the share of the root's files past a missing "
        "chunk of their prompt, every 0.5 s (mean) and at the end.",
        "",
        "| N | budget | utilization, mean (min-max) | at the end | shared-head hit rate | "
        "unreachable, mean (end) | store MB/s per engine | files refused |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def pct(x):
        return "n/a" if x is None else f"{x:.0%}"

    def pct1(x):
        return "n/a" if x is None else f"{x:.1%}"

    bad = []
    for r in d["runs"]:
        mbs = r["mb_s_per_engine"]
        out.append(
            f"| {r['n']} | {'one for the root' if r['one_budget'] else 'one per engine'}, "
            f"max_bytes {fmt_frac(r['max_bytes_each'], w)} | "
            f"{pct(r['util_mean'])} ({pct(r['util_min'])}-{pct(r['util_max'])}) | "
            f"{pct(r['util_end'])} | {r['head_hit_rate']:.0%} | "
            f"{pct1(r.get('unreachable_mean'))} ({pct1(r['unreachable'])}) | "
            f"{sum(mbs) / len(mbs):.0f} | {r['rejected_files']} |"
        )
        unreachable = max(r.get("unreachable_mean") or 0, r["unreachable"] or 0)
        if r["one_budget"] and ((r["util_mean"] or 0) < 0.8 or unreachable > 0.05):
            bad.append(f"N={r['n']}")
    goals.add(name, not bad, ("not met at " + ", ".join(bad)) if bad else "met at every N")
    return out


def runtime(total_s: float | None, sched: dict | None, disk: dict | None) -> str:
    """make bench's wall time, or (report.py run on its own) the sections' measured."""
    if total_s is not None:
        return f"{total_s:.0f} s"
    parts = [(name, d["seconds"]) for name, d in (("scheduler", sched), ("disk", disk)) if d]
    if not parts:
        return "unknown (no section ran)"
    return (
        f"{sum(s for _, s in parts):.0f} s in the sections ("
        + ", ".join(f"{name} {s:.0f} s" for name, s in parts)
        + "; report.py run on its own, without make bench's --total-s)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sched", default=str(TMP / "sched.json"))
    ap.add_argument("--disk", default=str(TMP / "disk.json"))
    ap.add_argument("--disk-upstream", default=str(TMP / "disk-upstream.json"))
    ap.add_argument("--budget", default=str(TMP / "budget.json"))
    ap.add_argument("--reach", default=str(TMP / "reach.json"))
    ap.add_argument("--layout", default=str(TMP / "layout.json"))
    ap.add_argument("--shared-root", default=str(TMP / "shared-root.json"))
    ap.add_argument("--e2e", default="skipped")
    ap.add_argument(
        "--total-s",
        type=float,
        default=None,
        help="make bench's runtime (run_bench.py passes it); without it, the sections' own",
    )
    ap.add_argument("--tag", default="", help="suffix of the results' file names")
    args = ap.parse_args()
    m = machine()
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = RESULTS / f"{time.strftime('%Y-%m-%d')}-{m['host']}{'-quick' if QUICK else ''}"
    if args.tag:
        base = base.with_name(f"{base.name}-{args.tag}")
    sched = json.loads(Path(args.sched).read_text()) if Path(args.sched).exists() else None
    disk = json.loads(Path(args.disk).read_text()) if Path(args.disk).exists() else None
    versions = "; ".join(f"{t}: {v}" for t, v in sched["versions"].items()) if sched else "?"
    goals = Goals()
    lines = [
        f"# make bench{' (BENCH_QUICK=1)' if QUICK else ''}: {time.strftime('%Y-%m-%d %H:%M %Z')}",
        "",
        "| | |",
        "| --- | --- |",
        f"| machine | {m['host']}: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB; load "
        f"average {m['load_at_start']} at the end (a shared machine) |",
        f"| vLLM, scheduler side | {versions} |",
        f"| vLLM, disk sections | {disk['fingerprint'] if disk else '?'} |",
        f"| commit | {m['commit']}; build/vllm at {m['series_head']}"
        + (f"; patched side: BENCH_PATCHED_SITE={PATCHED_SITE}" if PATCHED_SITE else "")
        + " |",
        f"| total runtime | {runtime(args.total_s, sched, disk)} |",
        "",
    ]
    warnings = list(sched.get("changed", [])) if sched else []
    if sched and disk:
        sched_fp = sched["versions"]["patched"].rsplit("(", 1)[-1]
        if (
            sched_fp != disk["fingerprint"].rsplit("(", 1)[-1]
            and sched["patched_site"] == "(.venv)"
        ):
            warnings.append(
                "the patched files differ between the scheduler and disk sections "
                "(the tree was rebuilt during the run)"
            )
    if warnings:
        lines += ["**Warning**: " + "; ".join(warnings), ""]
        for w in warnings:
            say("warning: " + w)
    points: list[dict] = []
    if sched:
        lines += sched_section(sched, goals) + [""]
    if disk:
        p_upstream = Path(args.disk_upstream)
        d_upstream = json.loads(p_upstream.read_text()) if p_upstream.exists() else None
        disk_lines, points = disk_section(disk, goals, d_upstream)
        lines += disk_lines + [""]
    else:
        for n in range(2, 7):
            goals.add(f"goal {n}", None, "the disk sections did not run")
    budget = json.loads(Path(args.budget).read_text()) if Path(args.budget).exists() else None
    lines += budget_section(budget, goals) + [""]
    reach = json.loads(Path(args.reach).read_text()) if Path(args.reach).exists() else None
    lines += reach_section(reach, goals) + [""]
    p_shared = Path(args.shared_root)
    shared = json.loads(p_shared.read_text()) if p_shared.exists() else None
    lines += shared_root_section(shared, goals) + [""]
    layout = json.loads(Path(args.layout).read_text()) if Path(args.layout).exists() else None
    lines += layout_section(layout, goals) + [""]
    lines += ["## 4. End to end on the CPU engine", "", args.e2e, ""]
    png = base.with_suffix(".png")
    note = plot_rows(points, png) if points else "no plot: no disk figures"
    lines += ["## Plot", "", note or f"![throughput vs row size]({png.name})", ""]
    lines += [
        "## Goals",
        "",
        "Judged on the best samples; medians in parentheses."
        + (" Smoke run (BENCH_QUICK=1): one round, small sizes; indicative only." if QUICK else ""),
        "",
        *goals.lines,
        "",
    ]
    md = base.with_suffix(".md")
    md.write_text("\n".join(lines))
    say(
        f"results: {md.relative_to(RESULTS.parents[1])}"
        + (f" ({note})" if note else f", plot: {png.relative_to(RESULTS.parents[1])}")
    )
    print(
        "\nGoals (best samples; medians in parentheses)"
        + (": smoke run, indicative only" if QUICK else "")
        + ":"
    )
    for ln in goals.lines:
        print("  " + ln.replace("**", ""))
    return 0


if __name__ == "__main__":
    run_main(main)
