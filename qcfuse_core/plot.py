"""Quality-vs-recompute plot for `bench quality` rows (matplotlib if installed, else Pillow).

Two panels, one line per method, x = measured recompute share: first-token KL(full ||
method) (lower is better) and ROUGE-L agreement with full prefill's answer (higher is
better), averaged over the datasets in the rows. Ratio-free methods (naive, full) are points.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

PANELS = (("kl_first_token", "first-token KL(full || method)"), ("agree_rouge_l", "ROUGE-L vs full's answer"))
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf"]


def series(rows: list[dict], metric: str) -> dict[str, list[tuple[float, float]]]:
    """method -> [(recompute share, metric)] averaged over datasets, sorted by share."""
    acc: dict[tuple[str, float | None], list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        if r.get(metric) is not None:
            acc[(r["method"], r["ratio"])].append((r["recompute_share"], r[metric]))
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for (method, _), pts in acc.items():
        out[method].append((sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)))
    return {m: sorted(p) for m, p in out.items()}


def plot_quality(rows: list[dict], path: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_pillow(rows, path)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (metric, title) in zip(axes, PANELS):
        for i, (method, pts) in enumerate(sorted(series(rows, metric).items())):
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=method, color=COLORS[i % len(COLORS)])
        ax.set_xlabel("share of context tokens recomputed")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_pillow(rows: list[dict], path: Path) -> Path:
    from PIL import Image, ImageDraw

    W, H, pad = 560, 380, 50
    img = Image.new("RGB", (2 * W, H), "white")
    d = ImageDraw.Draw(img)
    for p, (metric, title) in enumerate(PANELS):
        data = series(rows, metric)
        ys = [y for pts in data.values() for _, y in pts] or [0.0, 1.0]
        lo, hi = min(0.0, min(ys)), max(ys) or 1.0
        x0 = p * W
        d.rectangle([x0 + pad, pad, x0 + W - 20, H - pad], outline="black")
        d.text((x0 + pad, 15), title, fill="black")
        d.text((x0 + pad, H - pad + 20), "share of context recomputed (0 .. 1)", fill="black")
        d.text((x0 + 5, pad), f"{hi:.3g}", fill="black")
        d.text((x0 + 5, H - pad - 10), f"{lo:.3g}", fill="black")

        def xy(x, y, x0=x0, lo=lo, hi=hi):
            return (x0 + pad + x * (W - 20 - pad), H - pad - (y - lo) / ((hi - lo) or 1) * (H - 2 * pad))

        for i, (method, pts) in enumerate(sorted(data.items())):
            c = COLORS[i % len(COLORS)]
            pix = [xy(x, y) for x, y in pts]
            if len(pix) > 1:
                d.line(pix, fill=c, width=2)
            for px, py in pix:
                d.ellipse([px - 3, py - 3, px + 3, py + 3], fill=c)
            d.text((x0 + W - 110, pad + 5 + 12 * i), method, fill=c)
    img.save(path)
    return path
