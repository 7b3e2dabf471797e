"""Which budget brings back the answers a method loses (diagnostic).

    python benchmarks/diag_ratio_sweep.py --dataset ../shared/data/hotpotqa/hotpotqa_train.json \\
        --records benchmarks/results/quality/hotpot.records.jsonl --lost qcfuse@0.3 \\
        --ratios 0.4 0.5 0.7 0.9 --reference benchmarks/results/quality/reference --jsonl OUT.jsonl

Picks the questions of committed `bench quality` records where full prefill's answer contains
a gold alias and the `--lost` run's does not, reruns `qcfuse` on them at higher ratios (same
prompts, chunk caches and scoring as `bench quality`; full prefill read from the stored
references) and prints, per ratio, how many answers contain the gold alias again, with the
first-token KL and gold NLL. Records: `bench quality`'s, appended.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from qcfuse_core.bench_quality import reference_path, run_example  # noqa: E402
from qcfuse_core.datasets import dataset_name, load_dataset  # noqa: E402
from qcfuse_core.engine import QCFuseEngine  # noqa: E402
from qcfuse_core.model import load_model  # noqa: E402
from merge_quality import read  # noqa: E402  (benchmarks/ is this script's own folder)


def lost_ids(records: list[dict], lost: str) -> list[str]:
    """Questions where full's answer contains a gold alias and the `method@ratio` run's does not."""
    method, ratio = lost.split("@")
    full = {r["id"]: r for r in records if r["method"] == "full"}
    run = {r["id"]: r for r in records if r["method"] == method and r.get("ratio") == float(ratio)
           and r.get("variant") is None}
    return [i for i in full if i in run and full[i]["contains"] == 1.0 and run[i]["contains"] == 0.0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--records", required=True, help="committed bench-quality records of this dataset")
    ap.add_argument("--lost", default="qcfuse@0.3", help="method@ratio whose lost answers to rerun")
    ap.add_argument("--ratios", type=float, nargs="+", required=True)
    ap.add_argument("--reference", required=True)
    ap.add_argument("--jsonl", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    a = ap.parse_args()
    torch.set_num_threads(1)
    name = dataset_name(a.dataset)
    ids = lost_ids(read(Path(a.records)), a.lost)
    print(f"{name}: {len(ids)} answers lost by {a.lost}: {ids}", flush=True)
    out = Path(a.jsonl)
    done = {r["id"] for r in read(out)}
    engine = QCFuseEngine(load_model(dtype="fp32"))
    for ex in load_dataset(a.dataset):
        if ex.id not in ids or ex.id in done:
            continue
        recs = run_example(engine, ex, ["full", "qcfuse"], a.ratios, {}, a.max_new_tokens,
                           reference=reference_path(Path(a.reference), name, ex.id))
        with out.open("a") as f:
            for r in recs:
                f.write(json.dumps(dict(r, dataset=name)) + "\n")
        print(ex.id + ": " + ", ".join(f"{r['ratio']}: contains {r['contains']:.0f} KL {r['kl_first_token']:.4f}"
                                       for r in recs if r["method"] == "qcfuse"), flush=True)
    recs = [r for r in read(out) if r["id"] in ids and r["method"] == "qcfuse"]
    print("| ratio | n | answers containing the gold alias again | first-token KL | gold NLL |")
    print("|---|---|---|---|---|")
    for ratio in sorted({r["ratio"] for r in recs}):
        rs = [r for r in recs if r["ratio"] == ratio]
        print(f"| {ratio:g} | {len(rs)} | {sum(r['contains'] for r in rs):.0f} | "
              f"{statistics.mean(r['kl_first_token'] for r in rs):.4f} | {statistics.mean(r['gold_nll'] for r in rs):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
