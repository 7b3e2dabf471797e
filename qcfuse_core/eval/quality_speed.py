"""Quality against speed: first-token KL (and gold NLL) against TTFT through `engine.answer`.

    python -m qcfuse_core.eval.quality_speed --records R/hotpot.bound.records.jsonl R/hotpot.sweep.records.jsonl ... \\
        --ttft R/hotpot.ttft.records.jsonl ... --plot docs/quality-speed.png --json R/quality_speed.json

Quality comes from `bench quality` records (fp32; means over the questions every plotted
method finished), speed from `benchmarks/ttft_sets.py` records (TTFT medians per question,
averaged over its questions). One row of panels per set. The table answers: at the KL that
cacheblend (or epic) reaches at 0.3, which is the smallest measured ratio at which qcfuse's
mean KL is at most that, and how much faster is qcfuse there - TTFT ratio of the two
configurations, both measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qcfuse_core.eval.quality import aggregate  # noqa: E402

METHODS = ("qcfuse", "cacheblend", "epic", "naive", "full")
COLORS = {
    "qcfuse": "#1f77b4",
    "cacheblend": "#d62728",
    "epic": "#2ca02c",
    "naive": "#7f7f7f",
    "full": "#000000",
    "oracle": "#9467bd",
}


def read(paths) -> list[dict]:
    out = []
    for p in paths:
        out += [json.loads(l) for l in Path(p).read_text().splitlines() if l.strip()]
    return out


def label(method: str, ratio) -> str:
    return method if ratio is None else f"{method}@{ratio:g}"


def quality_points(records: list[dict], methods) -> dict[str, dict[str, dict]]:
    """set -> label -> table row (means over the questions every kept method finished)."""
    keep = [r for r in records if r["method"] in methods and "variant" not in r]
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for row in aggregate(keep):
        out[row["dataset"]][label(row["method"], row["ratio"])] = row
    return out


def ttft_points(records: list[dict]) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """set -> label -> mean over questions of the per-question median TTFT (ms); set -> number of records."""
    acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    n: dict[str, int] = defaultdict(int)
    for r in records:
        n[r["dataset"]] += 1
        for k, v in r["ttft_ms"].items():
            acc[r["dataset"]][k].append(v)
    return {ds: {k: statistics.mean(v) for k, v in d.items()} for ds, d in acc.items()}, dict(n)


def _norm_label(k: str) -> str:
    m, _, r = k.partition("@")
    return label(m, float(r)) if r else m


def matched(q: dict[str, dict], t: dict[str, float], baseline: str, ratio: float = 0.3) -> dict | None:
    """qcfuse's smallest measured ratio at which its KL <= baseline@ratio's, with both TTFTs."""
    base = q.get(label(baseline, ratio))
    if base is None:
        return None
    ours = sorted((row["ratio"], row) for k, row in q.items() if row["method"] == "qcfuse")
    hit = next(((r, row) for r, row in ours if row["kl_first_token"] <= base["kl_first_token"]), None)
    out = dict(
        baseline=label(baseline, ratio),
        baseline_kl=base["kl_first_token"],
        baseline_ttft_ms=t.get(label(baseline, ratio)),
    )
    if hit is None:
        return dict(out, qcfuse_ratio=None)
    r, row = hit
    tt = t.get(label("qcfuse", r))
    out.update(
        qcfuse_ratio=r,
        qcfuse_kl=row["kl_first_token"],
        qcfuse_ttft_ms=tt,
        speedup=(out["baseline_ttft_ms"] / tt) if tt and out["baseline_ttft_ms"] else None,
    )
    return out


def plot(q_all, t_all, path: Path, sets) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(sets), 2, figsize=(11, 3.6 * len(sets)), squeeze=False)
    for i, ds in enumerate(sets):
        q, t = q_all[ds], t_all.get(ds, {})
        for j, (metric, title) in enumerate(
            (("kl_first_token", "first-token KL(full || method)"), ("gold_nll", "gold NLL (nats / token)"))
        ):
            ax = axes[i][j]
            if "full" in t:  # the reference: KL 0 (off a log axis), its TTFT a line
                ax.axvline(t["full"], color=COLORS["full"], ls="--", lw=1, label="full prefill")
                if metric == "gold_nll" and "full" in q:
                    ax.axhline(q["full"]["gold_nll"], color=COLORS["full"], ls=":", lw=1)
            for m in METHODS[:-1]:
                pts = sorted(
                    (
                        (t[k], row[metric], row["ratio"])
                        for k, row in q.items()
                        if row["method"] == m and k in t and row.get(metric) is not None
                    ),
                    key=lambda p: p[2] or 0,
                )
                if not pts:
                    continue
                xs, ys, rs = zip(*pts)
                style = dict(marker="o" if m not in ("full", "naive") else "s", color=COLORS[m], label=m)
                ax.plot(xs, ys, **style)
                for x, y, r in pts:
                    if r is not None and m == "qcfuse":
                        ax.annotate(
                            f"{r:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7, color=COLORS[m]
                        )
            ax.set_xlabel("TTFT through engine.answer (ms, this CPU)")
            ax.set_title(f"{ds}: {title}", fontsize=10)
            ax.grid(alpha=0.3)
            if metric == "kl_first_token":
                ax.set_yscale("log")
        axes[i][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", nargs="+", required=True)
    ap.add_argument("--ttft", nargs="+", required=True)
    ap.add_argument("--plot", required=True)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    q_all = quality_points(read(a.records), METHODS)
    t_raw, n_t = ttft_points(read(a.ttft))
    t_all = {ds: {_norm_label(k): v for k, v in d.items()} for ds, d in t_raw.items()}
    sets = [ds for ds in q_all if ds in t_all]
    plot(q_all, t_all, Path(a.plot), sets)
    out = {}
    print(
        "| set | quality n | TTFT n | baseline @0.3 | its KL | its TTFT ms | qcfuse ratio needed | qcfuse KL | "
        "qcfuse TTFT ms | speedup | full TTFT ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for ds in sets:
        q, t = q_all[ds], t_all[ds]
        n_q = next(iter(q.values()))["n"]
        out[ds] = dict(
            quality_n=n_q,
            ttft_n=n_t[ds],
            full_ttft_ms=t.get("full"),
            points={
                k: dict(
                    kl_first_token=row["kl_first_token"],
                    gold_nll=row["gold_nll"],
                    answer_kl=row.get("answer_kl"),
                    ttft_ms=t.get(k),
                )
                for k, row in q.items()
            },
            matched=[m for b in ("cacheblend", "epic") if (m := matched(q, t, b))],
        )
        for m in out[ds]["matched"]:
            f = lambda v, p=".4f": "-" if v is None else format(v, p)
            print(
                f"| {ds} | {n_q} | {n_t[ds]} | {m['baseline']} | {f(m['baseline_kl'])} | {f(m['baseline_ttft_ms'], '.0f')} | "
                f"{m.get('qcfuse_ratio') if m.get('qcfuse_ratio') is not None else 'none measured'} | "
                f"{f(m.get('qcfuse_kl'))} | {f(m.get('qcfuse_ttft_ms'), '.0f')} | "
                f"{f(m.get('speedup'), '.2f')}x | {f(t.get('full'), '.0f')} |"
            )
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
