"""Throughput vs file size as a PNG: matplotlib when installed, else a plain Pillow drawing."""

import math
from pathlib import Path

SERIES = {  # name -> RGB
    "tier store": (31, 119, 180),
    "raw store": (31, 119, 180),
    "tier load": (214, 39, 40),
    "raw load": (214, 39, 40),
}
TITLE = "fs_python tier vs raw I/O: MB/s against file size (one KV cache group)"


def plot_rows(points: list[dict], png: Path) -> str:
    """Write png; return "" on success, else the line saying why there is no plot."""
    points = sorted(points, key=lambda p: p["x"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, rgb in SERIES.items():
            xs = [p["x"] for p in points if p.get(name)]
            ys = [p[name] for p in points if p.get(name)]
            ax.plot(
                xs,
                ys,
                "--" if name.startswith("raw") else "-",
                marker="o",
                color=tuple(c / 255 for c in rgb),
                label=name,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("file size (bytes): blocks_per_chunk x a group's row bytes")
        ax.set_ylabel("MB/s (median)")
        ax.set_title(TITLE)
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=100)
        return ""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return "no plot: neither matplotlib nor Pillow is installed in .venv"
    return _pillow(points, png, Image, ImageDraw)


def _pillow(points, png, Image, ImageDraw) -> str:
    w, h, left, right, top, bottom = 800, 500, 80, 150, 40, 60
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    ys = [p[n] for p in points for n in SERIES if p.get(n)]
    if not ys:
        return "no plot: no successful disk figures"
    x_lo, x_hi = math.log2(points[0]["x"]), math.log2(points[-1]["x"])
    y_lo = math.floor(math.log10(min(ys)))
    y_hi = math.ceil(math.log10(max(ys)))
    if y_hi == y_lo:
        y_hi += 1

    def px(x, y):
        fx = (math.log2(x) - x_lo) / ((x_hi - x_lo) or 1)
        fy = (math.log10(y) - y_lo) / (y_hi - y_lo)
        return left + fx * (w - left - right), h - bottom - fy * (h - top - bottom)

    d.rectangle([left, top, w - right, h - bottom], outline="black")
    for e in range(y_lo, y_hi + 1):
        _, y = px(points[0]["x"], 10**e)
        d.line([left, y, w - right, y], fill=(220, 220, 220))
        d.text((left - 50, y - 6), f"{10**e:g}", fill="black")
    for p in points:
        x, _ = px(p["x"], 10**y_lo)
        d.line([x, top, x, h - bottom], fill=(220, 220, 220))
        label = (
            f"{p['x'] >> 20} MiB"
            if p["x"] >= 1 << 20
            else (f"{p['x'] >> 10} KiB" if p["x"] % 1024 == 0 else f"{p['x']} B")
        )
        d.text((x - 18, h - bottom + 8), label, fill="black")
    d.text(
        (w // 2 - 160, h - 25),
        "file size (log): blocks_per_chunk x a group's row bytes",
        fill="black",
    )
    d.text((10, top - 18), "MB/s, median (log)", fill="black")
    d.text((left + 120, 8), TITLE, fill="black")
    for i, (name, rgb) in enumerate(SERIES.items()):
        xy = [px(p["x"], p[name]) for p in points if p.get(name)]
        dashed = name.startswith("raw")
        for a, b in zip(xy, xy[1:], strict=False):
            if dashed:
                for k in range(0, 20, 2):
                    t0, t1 = k / 20, (k + 1) / 20
                    d.line(
                        [
                            a[0] + (b[0] - a[0]) * t0,
                            a[1] + (b[1] - a[1]) * t0,
                            a[0] + (b[0] - a[0]) * t1,
                            a[1] + (b[1] - a[1]) * t1,
                        ],
                        fill=rgb,
                        width=2,
                    )
            else:
                d.line([a, b], fill=rgb, width=2)
        for x, y in xy:
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=rgb)
        ly = top + 10 + 20 * i
        d.line([w - right + 10, ly, w - right + 40, ly], fill=rgb, width=1 if dashed else 3)
        d.text((w - right + 45, ly - 6), name + (" (dashed)" if dashed else ""), fill="black")
    img.save(png)
    return ""
