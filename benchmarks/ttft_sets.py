"""TTFT through `engine.answer` on the questions of a quality set (the speed axis of the
quality-vs-speed figure).

    python benchmarks/ttft_sets.py --dataset ../shared/data/hotpotqa/hotpotqa_train.json --limit 5 \\
        --jsonl benchmarks/results/quality/hotpot.ttft.records.jsonl

Per question: a fresh store folder (`open_engine`, the tiered store users get), the
question's passages ingested with `engine.build_chunks` (node ids `p0`, `p1`, ...), one
warm-up answer, then for every method x ratio `--runs` calls of `engine.answer(question,
passages, node_ids=..., method=M, ratio=R, max_new_tokens=1)` - text in, first token out,
what users run - and the median of their `ttft_ms`. Methods and ratios run interleaved
round by round, so a change of the machine's load falls on every configuration alike.
One record per question (appended; questions already in --jsonl are skipped).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from qcfuse_core.datasets import dataset_name, load_dataset  # noqa: E402
from qcfuse_core.engine import EngineConfig, open_engine  # noqa: E402

RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5)


def configs(methods, ratios):
    out = []
    for m in methods:
        out += [(m, None)] if m in ("full", "naive") else [(m, r) for r in ratios]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--methods", nargs="+", default=["full", "naive", "qcfuse", "cacheblend", "epic"])
    ap.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=None, help="model dtype (default: the engine's CPU default, bf16)")
    ap.add_argument("--jsonl", required=True)
    a = ap.parse_args(argv)
    out = Path(a.jsonl)
    done = {json.loads(l)["id"] for l in out.read_text().splitlines() if l.strip()} if out.is_file() else set()
    name = dataset_name(a.dataset)
    for ex in load_dataset(a.dataset, limit=a.limit, offset=a.offset):
        if ex.id in done:
            continue
        t0 = time.perf_counter()
        passages, ids = list(ex.passages), [f"p{i}" for i in range(len(ex.passages))]
        with tempfile.TemporaryDirectory() as tmp:
            engine = open_engine(tmp, dtype=a.dtype, config=EngineConfig(threads=a.threads))
            engine.build_chunks(passages, ids)
            engine.answer(ex.question, passages, node_ids=ids, method="qcfuse", ratio=0.15, max_new_tokens=1)
            cfgs = configs(a.methods, a.ratios)
            times: dict[str, list[float]] = {f"{m}@{r}" if r is not None else m: [] for m, r in cfgs}
            meta = {}
            for _ in range(a.runs):
                for m, r in cfgs:
                    res = engine.answer(ex.question, passages, node_ids=ids, method=m, ratio=r, max_new_tokens=1)
                    label = f"{m}@{r}" if r is not None else m
                    times[label].append(res.ttft_ms)
                    meta[label] = dict(method=res.method, recomputed=res.recomputed_tokens, context=res.context_tokens)
            rec = dict(id=ex.id, dataset=name, dtype=str(engine.adapter.dtype).replace("torch.", ""), threads=a.threads,
                       runs=a.runs, ttft_ms={k: statistics.median(v) for k, v in times.items()}, all_ms=times,
                       served=meta, torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{name} {ex.id}: {time.perf_counter() - t0:.0f} s; " +
              " ".join(f"{k} {v:.0f}" for k, v in rec["ttft_ms"].items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
