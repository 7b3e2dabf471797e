"""Benchmark figures: panels of lines, one line per method (matplotlib if installed, else Pillow).

`plot_panels` draws any such figure; `plot_quality` is `bench quality`'s (x = measured
recompute share; first-token KL(full || method), lower is better, and ROUGE-L agreement with
full prefill's answer, higher is better, averaged over the datasets in the rows; ratio-free
methods (naive, full) are points); `bench load` draws TTFT and throughput against load with
it (qcfuse_core/eval/load.py). matplotlib is the `plot` extra (`pip install 'qcfuse[plot]'`);
without it the figure is drawn with Pillow, plainer but complete.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PANELS = (("kl_first_token", "first-token KL(full || method)"), ("agree_rouge_l", "ROUGE-L vs full's answer"))
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf"]


@dataclass(frozen=True)
class Panel:
    """One panel: a line per label through its (x, y) points, sorted by x."""

    title: str
    xlabel: str
    lines: dict[str, list[tuple[float, float]]]
    log_x: bool = False  # load axes (1 2 4 ... 32 clients) read better on a log scale
    xlim: tuple[float, float] | None = None  # None: the data's range


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
    xlabel = "share of context tokens recomputed"
    panels = [Panel(title, xlabel, series(rows, metric), xlim=(0.0, 1.0)) for metric, title in PANELS]
    return plot_panels(panels, path)


def plot_panels(panels: list[Panel], path: Path, columns: int = 2) -> Path:
    """The panels in rows of `columns`, written as a PNG to `path` -> path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_pillow(panels, path, columns)
    cols = min(columns, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4.2 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for i, (label, pts) in enumerate(sorted(panel.lines.items())):
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", label=label, color=COLORS[i % len(COLORS)])
        if panel.log_x:
            ax.set_xscale("log", base=2)
        if panel.xlim is not None:
            ax.set_xlim(*panel.xlim)
        ax.set_xlabel(panel.xlabel)
        ax.set_title(panel.title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_pillow(panels: list[Panel], path: Path, columns: int) -> Path:
    import math

    from PIL import Image, ImageDraw

    W, H, pad = 560, 380, 50
    cols = min(columns, len(panels))
    img = Image.new("RGB", (cols * W, -(-len(panels) // cols) * H), "white")
    d = ImageDraw.Draw(img)
    for p, panel in enumerate(panels):
        x0, y0 = (p % cols) * W, (p // cols) * H
        fx = (lambda x: math.log2(x)) if panel.log_x else (lambda x: x)
        pts = [(fx(x), y) for line in panel.lines.values() for x, y in line]
        xs = [fx(x) for x in panel.xlim] if panel.xlim else [x for x, _ in pts] or [0.0, 1.0]
        xlo, xhi = min(xs), max(xs)
        ys = [y for _, y in pts] or [0.0, 1.0]
        lo, hi = min(0.0, min(ys)), max(ys) or 1.0
        d.rectangle([x0 + pad, y0 + pad, x0 + W - 20, y0 + H - pad], outline="black")
        d.text((x0 + pad, y0 + 15), panel.title, fill="black")
        d.text(
            (x0 + pad, y0 + H - pad + 20), f"{panel.xlabel} ({_num(xlo, panel)} .. {_num(xhi, panel)})", fill="black"
        )
        d.text((x0 + 5, y0 + pad), f"{hi:.3g}", fill="black")
        d.text((x0 + 5, y0 + H - pad - 10), f"{lo:.3g}", fill="black")

        def xy(x, y, x0=x0, y0=y0, xlo=xlo, xhi=xhi, lo=lo, hi=hi):
            return (
                x0 + pad + (x - xlo) / ((xhi - xlo) or 1) * (W - 20 - pad),
                y0 + H - pad - (y - lo) / ((hi - lo) or 1) * (H - 2 * pad),
            )

        for i, (label, line) in enumerate(sorted(panel.lines.items())):
            c = COLORS[i % len(COLORS)]
            pix = [xy(fx(x), y) for x, y in sorted(line)]
            if len(pix) > 1:
                d.line(pix, fill=c, width=2)
            for px, py in pix:
                d.ellipse([px - 3, py - 3, px + 3, py + 3], fill=c)
            d.text((x0 + W - 150, y0 + pad + 5 + 12 * i), label, fill=c)
    img.save(path)
    return path


def _num(x: float, panel: Panel) -> str:
    return f"{2**x:.3g}" if panel.log_x else f"{x:.3g}"


PARETO = (
    ("answer_agree", "answer-token agreement with full prefill (teacher-forced, eval/fidelity.py)"),
    ("agree_exact", "answer agreement with full prefill (exact match)"),
    ("agree_rouge_l", "answer agreement with full prefill (ROUGE-L)"),
)


def plot_pareto(
    rows: list[dict], path: Path, methods: tuple[str, ...] = ("qcfuse", "qcfuse+guard", "cacheblend", "epic")
) -> Path:
    """`bench quality --pareto`: answer agreement with full prefill against the mean recompute
    share (the guard's: every pass it ran), averaged over the datasets in the rows - qcfuse's
    fixed ratios as a line, the guard as a point beside them, CacheBlend's and EPIC's ratios as
    lines, full prefill at (1, 1)."""
    xlabel = "mean share of context tokens recomputed"
    panels = []
    for metric, title in PARETO:
        lines = {m: pts for m, pts in series(rows, metric).items() if m in (*methods, "full")}
        panels.append(Panel(title, xlabel, lines, xlim=(0.0, 1.05)))
    return plot_panels(panels, path)
