"""Read the bound / adaptive / answer-level runs: the tables of docs/benchmarks.md (Quality).

    python benchmarks/bound_report.py R/hotpot.bound.records.jsonl R/musique.bound.records.jsonl ... \\
        [--lost R/hotpot.records.jsonl] [--json OUT]

Per set and ratio, on the questions where every method finished (95% paired bootstrap
intervals, 2000 resamples, seed 0):

- bound: qcfuse's mean first-token KL over the oracle's (target <= 1.1x);
- adaptive vs fixed: the share of naive's first-token KL gap each closes, and the difference
  (adaptive - fixed); per-question recompute shares of adaptive (mean, sd, min-max);
- answer fidelity: answer-level KL, exact and ROUGE-L agreement with full's answer, gold NLL,
  contains, per method;
- with --lost (the committed all-method records of hotpotqa): the questions where full
  prefill's answer contains gold and qcfuse@0.3's does not, and adaptive's share on them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

N_BOOT, SEED = 2000, 0


def read(paths) -> list[dict]:
    out = []
    for p in paths:
        out += [json.loads(l) for l in Path(p).read_text().splitlines() if l.strip()]
    return out


def lab(r: dict) -> str:
    return r["method"] if r.get("ratio") is None else f"{r['method']}@{r['ratio']:g}"


def by_question(records: list[dict]) -> dict[str, dict[str, dict[str, dict]]]:
    out: dict[str, dict[str, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        if "variant" not in r:
            out[r["dataset"]][r["id"]][lab(r)] = r
    return out


def boot(fn, n: int) -> list[float]:
    g = torch.Generator().manual_seed(SEED)
    idx = torch.randint(n, (N_BOOT, n), generator=g)
    vals = torch.tensor([fn(i) for i in idx], dtype=torch.float64)
    lo, hi = torch.quantile(vals, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return [round(lo, 4), round(hi, 4)]


def col(qs, ids, label, key) -> torch.Tensor:
    return torch.tensor([qs[i][label][key] for i in ids], dtype=torch.float64)


def report(records: list[dict], lost_records: list[dict] | None = None) -> dict:
    out = {}
    for ds, qs in by_question(records).items():
        labels = sorted({l for d in qs.values() for l in d})
        ids = sorted(i for i, d in qs.items() if set(labels) <= set(d))
        n = len(ids)
        d: dict = {"n": n, "methods": {}}
        for l in labels:
            m = {k: round(float(col(qs, ids, l, k).mean()), 5) for k in
                 ("kl_first_token", "answer_kl", "gold_nll", "agree_exact", "agree_rouge_l", "contains", "recompute_share")
                 if all(qs[i][l].get(k) is not None for i in ids)}
            d["methods"][l] = m
        naive = col(qs, ids, "naive", "kl_first_token") if "naive" in labels else None
        for r in sorted({float(l.split("@")[1]) for l in labels if "@" in l}):
            q, o, a = f"qcfuse@{r:g}", f"oracle@{r:g}", f"adaptive@{r:g}"
            row: dict = {}
            if q in labels and o in labels:
                kq, ko = col(qs, ids, q, "kl_first_token"), col(qs, ids, o, "kl_first_token")
                row["qcfuse_over_oracle"] = round(float(kq.mean() / ko.mean()), 4)
                row["qcfuse_over_oracle_ci"] = boot(lambda i: float(kq[i].mean() / ko[i].mean()), n)
                row["oracle_lower_kl_questions"] = int((ko < kq).sum())
            if q in labels and a in labels and naive is not None:
                kq, ka = col(qs, ids, q, "kl_first_token"), col(qs, ids, a, "kl_first_token")
                row["gap_closed_fixed"] = round(float(1 - kq.mean() / naive.mean()), 4)
                row["gap_closed_adaptive"] = round(float(1 - ka.mean() / naive.mean()), 4)
                row["gap_closed_adaptive_minus_fixed_ci"] = boot(
                    lambda i: float((kq[i].mean() - ka[i].mean()) / naive[i].mean()), n)
                sa, sq = col(qs, ids, a, "recompute_share"), col(qs, ids, q, "recompute_share")
                row["share_fixed_mean"] = round(float(sq.mean()), 4)
                row["share_adaptive"] = dict(mean=round(float(sa.mean()), 4), sd=round(float(sa.std()), 4),
                                             min=round(float(sa.min()), 4), max=round(float(sa.max()), 4))
            if a in labels and naive is not None:  # the fixed budget at adaptive's realised mean share
                sa = col(qs, ids, a, "recompute_share")
                fixed = [(abs(float(l.split("@")[1]) - float(sa.mean())), l) for l in labels if l.startswith("qcfuse@")]
                gap, near = min(fixed) if fixed else (1.0, None)
                if near is not None and gap <= 0.02:
                    kq, ka = col(qs, ids, near, "kl_first_token"), col(qs, ids, a, "kl_first_token")
                    row["matched_fixed"] = dict(
                        label=near, share=round(float(col(qs, ids, near, "recompute_share").mean()), 4),
                        gap_closed=round(float(1 - kq.mean() / naive.mean()), 4),
                        gap_closed_adaptive=round(float(1 - ka.mean() / naive.mean()), 4),
                        adaptive_minus_fixed_ci=boot(lambda i: float((kq[i].mean() - ka[i].mean()) / naive[i].mean()), n))
            if row:
                d[f"ratio {r:g}"] = row
        out[ds] = d
    if lost_records:
        lq = by_question(lost_records)
        for ds, d in out.items():
            if ds not in lq:
                continue
            lost = [i for i, x in lq[ds].items() if "qcfuse@0.3" in x and x["full"]["contains"] > x["qcfuse@0.3"]["contains"]]
            qs = by_question(records)[ds]
            have = [i for i in lost if "adaptive@0.3" in qs.get(i, {})]
            d["lost_by_fixed_at_0.3"] = dict(
                questions=lost, in_this_run=have,
                adaptive_share=[round(qs[i]["adaptive@0.3"]["recompute_share"], 4) for i in have],
                adaptive_contains=[qs[i]["adaptive@0.3"]["contains"] for i in have],
                oracle_contains=[qs[i]["oracle@0.3"]["contains"] for i in have if "oracle@0.3" in qs[i]])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+")
    ap.add_argument("--lost", nargs="*", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rep = report(read(a.records), read(a.lost) if a.lost else None)
    text = json.dumps(rep, indent=1)
    if a.json:
        Path(a.json).write_text(text + "\n")
    for ds, d in rep.items():
        print(f"\n## {ds} (n={d['n']})")
        print("| method | first-token KL | answer KL | gold NLL | agree exact | agree ROUGE-L | contains | share |")
        print("|---|---|---|---|---|---|---|---|")
        for l, m in d["methods"].items():
            print(f"| {l} | " + " | ".join("-" if m.get(k) is None else f"{m[k]:.4f}" for k in (
                "kl_first_token", "answer_kl", "gold_nll", "agree_exact", "agree_rouge_l", "contains",
                "recompute_share")) + " |")
        for k, row in d.items():
            if k.startswith("ratio"):
                print(k, json.dumps(row))
        if "lost_by_fixed_at_0.3" in d:
            print("lost at 0.3:", json.dumps(d["lost_by_fixed_at_0.3"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
