#!/usr/bin/env python3
"""Write the Markdown tables and the plot from sched.json and disk.json; print the goals.

Every figure is shown as median (best) over its samples. Ratios are shown as best (median):
the best samples are the least disturbed by other jobs on a shared machine, so the goals are
judged on them; the ratio of medians says how steady that is.
"""

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

from common import QUICK, RESULTS, TMP, fmt_bytes, machine, run_main, say
from plot import plot_rows

GOAL_RATIO = 1.10  # patched / pristine; G groups / 1 group per key
GOAL_FS = 0.9  # fs tier / raw, rows >= 64 KiB
GOAL_HMA = 0.8  # tier's 4 groups / 1 group over raw's, per-token throughput
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


def over(a, b):
    """(best, median) of a / b for two (best, median) ratios; None when either is missing."""
    return None if a is None or b is None else (a[0] / b[0], a[1] / b[1])


def rcell(r):
    return "n/a" if r is None else f"**{r[0]:.2f}** ({r[1]:.2f})"


def rtxt(r):
    return "n/a" if r is None else f"{r[0]:.2f} (median {r[1]:.2f})"


def tput(nbytes, times):
    """median (best) MB/s from times."""
    if not times:
        return "failed"
    return f"{nbytes / med(times) / 1e6:.0f} ({nbytes / min(times) / 1e6:.0f})"


class Goals:
    def __init__(self):
        self.lines: list[str] = []

    def add(self, name: str, met: bool | None, detail: str) -> None:
        state = "n/a" if met is None else "met" if met else "MISSED"
        self.lines.append(f"- **{state}**: {name}: {detail}")


def perkey_table(d: dict, goals: Goals) -> list[str]:
    c, cmds = d["cases"], d["commands"]
    if "perkey g=1" not in cmds:
        return []
    first = cmds["perkey g=1"]
    keys = first["groups"] * first["blocks"]
    out = [
        f"### 1a. Per-key cost: {keys} keys per request for every G (store, then hit + load)",
        "",
        "A request stores all its blocks of every group through the connector "
        "scheduler (get_num_new_matched_tokens, build_connector_meta, "
        "update_connector_output, take_events); a second request with the same prompt hits "
        "and loads them (+ update_state_after_alloc). us per key, median (best).",
        "",
        "| groups | blocks per group | store patched | store pristine | hit+load patched "
        "| hit+load pristine | total: patched / pristine | patched: G / 1 group |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    worst, worst_flat, base = [], [], None
    for g in (1, 2, 4, 8):
        r = c.get(f"perkey g={g}")
        if not r:
            continue
        p, q = r["patched"].get("samples", {}), r["pristine"].get("samples", {})
        rt = tratio(p.get("total_us_per_key"), q.get("total_us_per_key"))
        if base is None:
            base = p.get("total_us_per_key")
        flat = tratio(p.get("total_us_per_key"), base)
        worst.append((rt, g))
        if g > 1:
            worst_flat.append((flat, g))
        out.append(
            f"| {g} | {cmds[f'perkey g={g}']['blocks']} | {cell(p.get('store_us_per_key'))} | "
            f"{cell(q.get('store_us_per_key'))} | {cell(p.get('hit_load_us_per_key'))} | "
            f"{cell(q.get('hit_load_us_per_key'))} | {rcell(rt)} | {rcell(flat)} |"
        )
    judge(
        goals,
        "per-key scheduler cost, patched / pristine <= 1.10 at 1, 2, 4, 8 groups",
        worst,
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


def judge(goals: Goals, name: str, items, limit: float, label: str, low=False) -> None:
    """items: [((best, median) or None, key)]; met when every best is within the limit."""
    known = [(r, k) for r, k in items if r is not None]
    if not known:
        goals.add(name, None, "no figures")
        return
    ok = all((r[0] >= limit) if low else (r[0] <= limit) for r, _ in known)
    goals.add(
        name,
        ok and len(known) == len(items),
        "; ".join(f"{label.format(k)}: {rtxt(r)}" for r, k in known),
    )


def promotion_table(d: dict, goals: Goals) -> list[str]:
    c = d["cases"]
    out = [
        "### 1b. Promotion: one request, n keys ready in the CPU tier + n keys only in the "
        "secondary tier",
        "",
        "Step 1: lookup of all 2n keys (n hits, n promotions started) and the end of the "
        "step (take_events submits the promotion job); step 2: lookup of all 2n again (all "
        'ready). "full": the CPU tier holds exactly 2n blocks, the oldest n of another '
        "request, so every promotion evicts one. ms, median (best).",
        "",
        "| n | CPU tier | step 1 patched | step 1 pristine | patched / pristine "
        "| step 2 patched | step 2 pristine | step 1 us/key patched |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios, growth = [], []
    for full in (False, True):
        step1 = {}
        for name, r in c.items():
            if not name.startswith("promotion") or name.endswith(" full") != full:
                continue
            n = int(name.split("n=")[1].split()[0])
            label = f"n={n}{' full' if full else ''}"
            p, q = r["patched"], r["pristine"]
            ps, qs = p.get("samples", {}), q.get("samples", {})
            rt = tratio(ps.get("step1_ms"), qs.get("step1_ms"))
            if p.get("stopped") and qs.get("step1_ms") and p.get("limit_s"):
                bound = p["limit_s"] * 1e3 / min(qs["step1_ms"])
                r_cell = f"**> {bound:.0f}**"
                ratios.append(((bound, bound), f"{label} (stopped; lower bound)"))
            else:
                r_cell = rcell(rt)
                ratios.append((rt, label))
            p1 = f"stopped ({p['stopped']})" if p.get("stopped") else cell(ps.get("step1_ms"))
            q1 = f"stopped ({q['stopped']})" if q.get("stopped") else cell(qs.get("step1_ms"))
            per_key = f"{med(ps['step1_ms']) * 1e3 / (2 * n):.2f}" if ps.get("step1_ms") else "n/a"
            out.append(
                f"| {n} | {'full' if full else 'room'} | {p1} | {q1} | {r_cell} | "
                f"{cell(ps.get('step2_ms'))} | {cell(qs.get('step2_ms'))} | {per_key} |"
            )
            step1[n] = {t: r[t] for t in ("patched", "pristine")}
        sizes = sorted(step1)
        overall = [(sizes[0], sizes[-1])] if len(sizes) > 2 else []
        for lo, hi in [*itertools.pairwise(sizes), *overall]:
            for tree in ("patched", "pristine"):
                a, b = step1[lo][tree], step1[hi][tree]
                s_lo = a.get("samples", {}).get("step1_ms")
                s_hi = b.get("samples", {}).get("step1_ms")
                if not s_hi and b.get("limit_s") and s_lo:
                    g = b["limit_s"] * 1e3 / min(s_lo)  # a lower bound
                    verdict = "NOT linear" if g > LINEAR * hi / lo else "stopped: not shown"
                    growth.append((tree, full, lo, hi, f"> {g:.1f}", verdict))
                    continue
                elif not s_hi or not s_lo:
                    continue  # stopped at the smaller size already
                else:
                    g = min(s_hi) / min(s_lo)
                    g_txt = f"{g:.1f}"
                verdict = "linear" if g <= LINEAR * hi / lo else "NOT linear"
                growth.append((tree, full, lo, hi, g_txt, verdict))
    out += [
        "",
        f"Growth of step 1 (best) from one size to the next, and from the smallest to the "
        f"largest (linear: at most {LINEAR}x the growth of the keys; quadratic: its square):",
        "",
        "| CPU tier | tree | n | step 1 grows | verdict |",
        "| --- | --- | --- | --- | --- |",
    ]
    for tree, full, lo, hi, g_txt, linear in growth:
        out.append(
            f"| {'full' if full else 'room'} | {tree} | {lo} -> {hi} ({hi // lo}x keys)"
            f" | {g_txt}x | {linear} |"
        )
    judge(
        goals, "promotion cost, patched / pristine <= 1.10 at every size", ratios, GOAL_RATIO, "{}"
    )
    pg = [x for x in growth if x[0] == "patched"]
    goals.add(
        "promotion grows linearly (patched)",
        bool(pg) and all(x[5] == "linear" for x in pg),
        "; ".join(
            f"{'full' if x[1] else 'room'} {x[2]} -> {x[3]}: {x[4]}x for {x[3] // x[2]}x keys"
            for x in pg
        )
        or "n/a",
    )
    return out


def cold_table(d: dict) -> list[str]:
    r = d["cases"].get("cold")
    if not r:
        return []
    p, q = r["patched"].get("samples", {}), r["pristine"].get("samples", {})
    out = [
        "",
        f"### 1c. Lookup of a long cold prompt ({d['commands']['cold']['blocks']} keys, "
        "all misses): us per key, median (best)",
        "",
        "| secondary tier | patched | pristine | patched / pristine |",
        "| --- | --- | --- | --- |",
    ]
    for metric, label in (
        ("example_us_per_key", "in-memory example"),
        ("fs_us_per_key", "fs_python (a stat per key)"),
    ):
        out.append(
            f"| {label} | {cell(p.get(metric))} | {cell(q.get(metric))} | "
            f"{rcell(tratio(p.get(metric), q.get(metric)))} |"
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
        "on both trees. Secondary tier: vLLM's in-memory example tier (1a, 1c), a tier that "
        "always hits and finishes its jobs at once (1b).",
        "",
    ]
    out += perkey_table(d, goals) + [""] + promotion_table(d, goals) + cold_table(d)
    out += ["", f"Scheduler side: {d['seconds']:.0f} s; patched side: {d['patched_site']}."]
    return out


def integrity_lines(d: dict) -> list[str]:
    """The fs tier's checksum (its `checksum` setting): on vs off, same rows."""
    if not d.get("integrity_check"):
        return ["Integrity check: none in this tree (nothing to measure)."]
    if not d.get("integrity"):
        return [
            "Integrity check: the tier's `checksum` setting (off by default, as in the "
            "figures above); on/off not measured in this run."
        ]
    out = [
        "Integrity check (the tier's `checksum` setting; the figures above are with its "
        "default): the tier with a checksum vs `checksum: none`, same rows, rounds "
        "alternated. MB/s of payload: median (best); on / off: best (median).",
        "",
        "| row | blocks | checksum | store on | store off | on / off | load on | load off "
        "| on / off |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in d["integrity"]:
        nbytes = r["row_bytes"] * r["blocks"]
        on, off = r["on"], r["off"]
        ck = r["checksum"] or {}
        out.append(
            f"| {r['label']} | {r['blocks']} | {ck.get('algorithm')} "
            f"(+{ck.get('trailer_bytes')} B) | {tput(nbytes, on['store_s'])} | "
            f"{tput(nbytes, off['store_s'])} | {rcell(tratio(off['store_s'], on['store_s']))} | "
            f"{tput(nbytes, on['load_s'])} | {tput(nbytes, off['load_s'])} | "
            f"{rcell(tratio(off['load_s'], on['load_s']))} |"
        )
    return out


def disk_section(d: dict, goals: Goals) -> tuple[list[str], list[dict]]:
    out = [
        "## 2. Disk tier: fs_python vs raw file-per-block I/O",
        "",
        f"{d['threads']} I/O threads on both sides (the tier: half read-, half "
        f"write-priority, all serve either queue), {d['rounds']} round(s), the same directory "
        f"tree under `{d['dir']}` (directories made beforehand, files deleted between rounds, "
        "pages dropped before loads). Raw: open/write/close (open/readv/close) of the "
        "payload; the tier adds an existence check, a temporary file and a rename per block. "
        "MB/s of payload: median (best); tier / raw: best (median).",
        "",
        "| row | blocks | tier I/O | raw I/O | store tier | store raw | tier / raw "
        "| load tier | load raw | tier / raw |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    points, judged = [], []
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
            if r["payload"] >= 64 << 10:
                judged += [(rs, f"{r['label']} store"), (rl, f"{r['label']} load")]
    judge(
        goals,
        "fs tier >= 0.9x raw O_DIRECT for rows >= 64 KiB, store and load",
        judged,
        GOAL_FS,
        "{}",
        low=True,
    )
    out += ["", *integrity_lines(d)]

    h0 = d["hma"][0]
    out += [
        "",
        "## 3. HMA cost: equal bytes per token as 1, 2 or 4 KV cache groups",
        "",
        f"Chunks of {fmt_bytes(h0['chunk_bytes'])} (all groups together), {h0['chunks']} "
        "chunks per round: G groups write G files of 1/G the size per chunk, the same bytes "
        "and tokens for every G, through the fs tier (one job, every file its own task) "
        "and raw (one task per file; serial: one task per chunk, its G files in sequence). "
        "MB/s: median (best); vs 1 group: best (median). G files of 1/G the size cost the "
        "disk itself (raw) more than one file: the goal is that the tier adds no cost of its "
        "own, i.e. its 4-group / 1-group ratio over raw's.",
        "",
        "| groups | file | store tier | vs 1 group | load tier | vs 1 group "
        "| store raw | vs 1 group | load raw | vs 1 group | load raw serial |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base, judged = None, []
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
            judged = [(over(vs["tier", op], vs["raw", op]), op) for op in ("store", "load")]
        serial = r.get("raw_serial", {}).get("load_s")
        out.append(
            f"| {r['groups']} | {fmt_bytes(r['row_bytes'])} | {tput(nbytes, t['store_s'])} | "
            f"{rcell(vs['tier', 'store'])} | {tput(nbytes, t['load_s'])} | "
            f"{rcell(vs['tier', 'load'])} | {tput(nbytes, w['store_s'])} | "
            f"{rcell(vs['raw', 'store'])} | {tput(nbytes, w['load_s'])} | "
            f"{rcell(vs['raw', 'load'])} | {tput(nbytes, serial) if serial else '-'} |"
        )
    judge(
        goals,
        "the fs tier adds no HMA cost of its own: 4 groups / 1 group, per-token throughput, "
        ">= 0.8x raw file-per-block I/O's",
        judged,
        GOAL_HMA,
        "{}",
        low=True,
    )
    out += ["", f"Disk sections: {d['seconds']:.0f} s."]
    return out, points


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sched", default=str(TMP / "sched.json"))
    ap.add_argument("--disk", default=str(TMP / "disk.json"))
    ap.add_argument("--e2e", default="skipped")
    ap.add_argument("--total-s", type=float, default=0.0)
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
        f"| commit | {m['commit']}; build/vllm at {m['series_head']} |",
        f"| total runtime | {args.total_s:.0f} s |",
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
        disk_lines, points = disk_section(disk, goals)
        lines += disk_lines + [""]
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
