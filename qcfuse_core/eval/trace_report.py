"""The summary of benchmarks/gpu.sh's trace step: `python -m qcfuse_core.eval.trace_report OUT`.

Reads the `trace_*.json` files of `qcfuse bench trace` under OUT and prints, in markdown,
each run's speedup per batch (qcfuse's TTFT p50 over full prefill's, the client's clock, the
server's in brackets), then over HTTP against in process: TTFT p50 and ITL p50 of the same
trace (the runs of the pool of 50), per mode, summed over the batches from the second on.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _load(out: Path) -> dict[str, list[dict]]:
    return {p.stem.removeprefix("trace_"): json.loads(p.read_text())["rows"] for p in sorted(out.glob("trace_*.json"))}


def speedups(runs: dict[str, list[dict]]) -> str:
    """A line per (run, mode): the speedup of each batch."""
    lines = [
        "| run | mode | where | speedup per batch (client clock; server clock) | cached per batch |",
        "|---|---|---|---|---|",
    ]
    for name, rows in runs.items():
        for mode in dict.fromkeys(r["mode"] for r in rows):
            qc = [r for r in rows if r["mode"] == mode and r["method"] != "full"]
            speed = " ".join(f"{r['speedup'] or 0:.2f}x ({r['server_speedup'] or 0:.2f}x)" for r in qc)
            cached = " ".join(f"{100 * (r['cached_share'] or 0):.0f}%" for r in qc)
            lines.append(f"| {name} | {mode} | {qc[0]['where'] if qc else '-'} | {speed} | {cached} |")
    return "\n".join(lines)


def overhead(runs: dict[str, list[dict]]) -> str:
    """Over HTTP against in process, per mode and method: the medians over batches 2.. of the
    batch TTFT p50 and ITL p50."""
    inproc = runs.get("inprocess50", [])
    lines = [
        "| mode | method | TTFT p50 in process ms | over HTTP | diff | ITL p50 in process ms | over HTTP | diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in ("learned", "registered"):
        http = runs.get(f"{mode}50", [])
        for method in ("qcfuse", "full"):
            cells = []
            for key in ("ttft_ms_p50", "itl_ms_p50"):
                a = _median(inproc, mode, method, key)
                b = _median(http, mode, method, key)
                cells += [f"{a:.1f}" if a else "-", f"{b:.1f}" if b else "-", f"{(b - a) / a:+.1%}" if a and b else "-"]
            lines.append(f"| {mode} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _median(rows: list[dict], mode: str, method: str, key: str) -> float | None:
    xs = [r[key] for r in rows if r["mode"] == mode and r["method"] == method and r["batch"] >= 2 and r[key]]
    return statistics.median(xs) if xs else None


def main(argv: list[str] | None = None) -> int:
    out = Path((argv or sys.argv[1:] or ["."])[0])
    runs = _load(out)
    if not runs:
        print(f"no trace_*.json under {out}")
        return 1
    print(speedups(runs) + "\n\nOver HTTP against in process (medians over batches 2..):\n\n" + overhead(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
