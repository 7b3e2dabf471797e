"""Whole-answer fidelity of selection variants on a calibration split (not a reporting set).

    python benchmarks/diag_answer_fidelity.py --dataset ../shared/data/musique/musique_train.json \\
        --limit 12 --ratio 0.3 --jsonl OUT.jsonl

First-token KL measures the first answer token only; agreement with full prefill's greedy
answer depends on every later token too. This teacher-forces full prefill's own greedy answer
after each method's fused prompt (`run_example(target="full")`) and reports, per variant:
first-token KL, the excess NLL of full's answer over full prefill's own (nats per token: 0
means the fused cache predicts full's whole answer as full prefill does), and exact /
ROUGE-L agreement of the greedy answers. Variants: qcfuse with spread 0 (default), 2 and 4,
cacheblend and epic, all at --ratio (`--set spread`), or qcfuse with other anchor shares,
anchor methods and critical layers (`--set explore`), or qcfuse with the budget split over
chunks by their share of the mass (`--set alloc`). Records append to --jsonl (done ids
skipped).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from qcfuse_core.bench_quality import run_example  # noqa: E402
from qcfuse_core.datasets import dataset_name, load_dataset  # noqa: E402
from qcfuse_core.engine import QCFuseEngine  # noqa: E402
from qcfuse_core.model import load_model  # noqa: E402


SETS = {
    # the benchmark's methods only (an evaluation, fine on a reporting set)
    "baselines": lambda r: [("qcfuse", "qcfuse", r, {}), ("cacheblend", "cacheblend", r, {}), ("epic", "epic", r, {})],
    # neighbours of attended tokens, against the baselines
    "spread": lambda r: [("qcfuse", "qcfuse", r, {}), ("qcfuse-spread2", "qcfuse", r, {"spread": 2}),
                         ("qcfuse-spread4", "qcfuse", r, {"spread": 4}), ("cacheblend", "cacheblend", r, {}),
                         ("epic", "epic", r, {})],
    # the budget split over chunks by their mass share, against the paper's global top-k
    "alloc": lambda r: [("qcfuse", "qcfuse", r, {}), ("qcfuse-chunk-alloc", "qcfuse", r, {"allocation": "chunk"})],
    # what issue 4 names: anchor method and share, critical layers
    "explore": lambda r: [("qcfuse", "qcfuse", r, {}), ("anchors-0.25", "qcfuse", r, {"anchor_share": 0.25}),
                          ("anchors-repeat", "qcfuse", r, {"anchor_method": "repeat"}),
                          ("layers-5.8.11.13.15", "qcfuse", r, {"critical_layers": (5, 8, 11, 13, 15)}),
                          ("layer-8", "qcfuse", r, {"critical_layers": (8,)}),
                          ("layers-15.20.23", "qcfuse", r, {"critical_layers": (15, 20, 23)})],
}


def summarize(records: list[dict]) -> list[dict]:
    by_id: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in records:
        by_id[r["id"]][r.get("variant", r["method"])] = r
    rows = []
    labels = list(dict.fromkeys(k for d in by_id.values() for k in d if k != "full"))
    ids = [i for i, d in by_id.items() if "full" in d and all(l in d for l in labels)]
    for label in labels:
        rs = [by_id[i][label] for i in ids]
        excess = [r["gold_nll"] - by_id[i]["full"]["gold_nll"] for i, r in zip(ids, rs)]
        rows.append(dict(variant=label, n=len(rs), kl_first_token=statistics.mean(r["kl_first_token"] for r in rs),
                         excess_answer_nll=statistics.mean(excess), agree_exact=statistics.mean(r["agree_exact"] for r in rs),
                         agree_rouge_l=statistics.mean(r["agree_rouge_l"] for r in rs),
                         recompute_share=statistics.mean(r["recompute_share"] for r in rs)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--jsonl", required=True)
    ap.add_argument("--set", default="spread", choices=sorted(SETS), help="which variants to run")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    engine = QCFuseEngine(load_model(dtype="fp32"))
    out = Path(a.jsonl)
    done = {json.loads(l)["id"] for l in out.read_text().splitlines() if l} if out.is_file() else set()
    name = dataset_name(a.dataset)
    for ex in load_dataset(a.dataset, limit=a.limit, offset=a.offset):
        if ex.id in done:
            continue
        t0 = time.perf_counter()
        recs = run_example(engine, ex, None, None, {}, a.max_new_tokens, variants=SETS[a.set](a.ratio), target="full")
        with out.open("a") as f:
            for r in recs:
                f.write(json.dumps(dict(r, dataset=name)) + "\n")
        print(f"{ex.id}: {time.perf_counter() - t0:.1f} s", flush=True)
    rows = summarize([json.loads(l) for l in out.read_text().splitlines() if l])
    print("| variant | n | first-token KL | excess answer NLL | agree exact | agree ROUGE-L | recompute share |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['n']} | {r['kl_first_token']:.4f} | {r['excess_answer_nll']:.4f} | "
              f"{r['agree_exact']:.3f} | {r['agree_rouge_l']:.3f} | {r['recompute_share']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
