#!/usr/bin/env bash
# The quality benchmark on Gemma-3-270M (the second packaged model): the three reporting sets,
# every question, full / naive / qcfuse / cacheblend / epic at 0.15 and 0.3, fp32, 1 thread,
# one process (the sets take turns, STEP questions at a time, so a partial run covers all
# three). Questions already in a records file are skipped: run it again after an
# interruption. Then the table:
#     bash benchmarks/gemma_quality.sh          # runs until every question is done, then the table
#     bash benchmarks/gemma_quality.sh table    # only rebuild quality.json / .png / .summary.json
# Records per set S (hotpot, musique, wikimqa), one file per role, so a new profile reruns
# only qcfuse:
#     S.base.records.jsonl             full, naive, cacheblend, epic (they read no profile)
#     S.qcfuse.records.jsonl           qcfuse with the packaged profile (its full rows repeat
#                                      the base file's and are dropped from the table)
#     S.qcfuse_sliding.records.jsonl   qcfuse with the first profile (sliding layers
#                                      [7, 13, 9], no prior): kept for docs/quality-history.md
#     S.qcfuse_prior2.records.jsonl    qcfuse with the second profile ([17, 11, 5],
#                                      position_prior=2), kept for quality-history.md
#     S.adaptive_prior2.records.jsonl  adaptive calibrated on that profile's ranking, likewise
#     S.oracle.records.jsonl           the selection bound (oracle), S.adaptive.records.jsonl the
#                                      calibrated adaptive budget: first questions only (`bound`)
# The table covers the questions both files of a set hold.
#     bash benchmarks/gemma_quality.sh bound    # oracle and adaptive rows on the first questions,
#                                               # then their table ($R/bound_table.md)
#     bash benchmarks/gemma_quality.sh ratios   # qcfuse at 0.35 and 0.4 on musique_s, every question,
#                                               # then $R/ratio_sweep_musique.md
# Full prefill's per-question outputs are kept in $R/reference (not committed) for reruns.
# The table step also rebuilds SmolLM2-135M's table over the same questions from its
# committed records ($R/quality_smollm2_same_questions.json), for the side-by-side.
set -uo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results/quality/gemma3
D=../shared/data
PY=${PYTHON:-.venv/bin/python}
STEP=${STEP:-5}
mkdir -p $R
M="--model gemma3-270m --ratios 0.15 0.3 --max-new-tokens 24 --threads 1 --reference $R/reference"
one() {  # name, data file, limit
    $PY -m qcfuse_core.cli bench quality --dataset "$D/$2" $M --methods full naive cacheblend epic --limit "$3" \
        --jsonl "$R/$1.base.records.jsonl" --json "$R/.$1.part.json" >> "$R/$1.log" 2>&1
    $PY -m qcfuse_core.cli bench quality --dataset "$D/$2" $M --methods qcfuse --limit "$3" \
        --jsonl "$R/$1.qcfuse.records.jsonl" --json "$R/.$1.part.json" >> "$R/$1.qcfuse.log" 2>&1
}
if [ "${1:-}" = "bound" ]; then  # as SmolLM2's partial sets: hotpotqa 15, musique 10, wikimqa 5 questions
    for spec in hotpot:hotpotqa/hotpotqa_train.json:15 musique:musique/musique_s.json:10 wikimqa:2wikimqa/wikimqa_s_clean.json:5; do
        IFS=: read -r name file n <<< "$spec"
        for method in oracle adaptive; do
            $PY -m qcfuse_core.cli bench quality --dataset "$D/$file" $M --methods $method --limit "$n" \
                --jsonl "$R/$name.$method.records.jsonl" --json "$R/.$name.part.json" >> "$R/$name.$method.log" 2>&1
        done
    done
    $PY - $R > $R/bound_table.md <<'PYEOF'
import json, sys
from qcfuse_core.bench_quality import aggregate
R = sys.argv[1]
sets = {"hotpot": "hotpotqa_train", "musique": "musique_s", "wikimqa": "wikimqa_s_clean"}
labels = ["naive", "qcfuse@0.15", "adaptive@0.15", "oracle@0.15", "epic@0.15", "qcfuse@0.3", "adaptive@0.3",
          "oracle@0.3", "epic@0.3"]
print("| set (questions) | " + " | ".join(labels) + " |")
print("|---|" + "---|" * len(labels))
for stem, name in sets.items():
    recs = {}
    for role in ("base", "qcfuse", "oracle", "adaptive"):
        for r in map(json.loads, open(f"{R}/{stem}.{role}.records.jsonl")):
            if r["method"] != "full" or role == "base":
                recs.setdefault(r["id"], []).append(r)
    ids = [i for i, rs in recs.items() if {r["method"] for r in rs} >= {"full", "naive", "qcfuse", "oracle", "adaptive"}]
    rows = {r["method"] + ("" if r["ratio"] is None else f"@{r['ratio']}"): r
            for r in aggregate([r for i in ids for r in recs[i]])}
    naive = rows["naive"]["kl_first_token"]
    cell = lambda lab: f"{rows[lab]['kl_first_token']:.4f} ({100 * (1 - rows[lab]['kl_first_token'] / naive):.1f}%)"
    print(f"| {name} ({len(ids)}) | {naive:.4f} | " + " | ".join(cell(lab) for lab in labels[1:]) + " |")
PYEOF
    cat $R/bound_table.md
    exit 0
fi
if [ "${1:-}" = "ratios" ]; then  # qcfuse above 0.3 on musique_s, every question: the ratio its target needs
    $PY -m qcfuse_core.cli bench quality --dataset "$D/musique/musique_s.json" ${M/--ratios 0.15 0.3/--ratios 0.35 0.4} \
        --methods qcfuse --jsonl "$R/musique.qcfuse_ratios.records.jsonl" --json "$R/.musique.part.json" \
        >> "$R/musique.qcfuse_ratios.log" 2>&1
    $PY - $R > $R/.ratios.records.jsonl <<'PYEOF'
import json, sys
R = sys.argv[1]
recs = {}
for role in ("base", "qcfuse", "qcfuse_ratios"):
    for r in map(json.loads, open(f"{R}/musique.{role}.records.jsonl")):
        if r["method"] != "full" or role == "base":
            recs.setdefault(r["id"], []).append(r)
for i, rs in recs.items():
    if {r["ratio"] for r in rs if r["method"] == "qcfuse"} >= {0.15, 0.3, 0.35, 0.4}:
        for r in rs:
            print(json.dumps(r))
PYEOF
    $PY -m qcfuse_core.cli bench quality --dataset $D/musique/musique_s.json --aggregate-only \
        --jsonl $R/.ratios.records.jsonl --json $R/ratio_sweep_musique.json > /dev/null
    $PY - $R > $R/ratio_sweep_musique.md <<'PYEOF'
import json, sys
R = sys.argv[1]
per = json.load(open(f"{R}/ratio_sweep_musique.summary.json"))["per_set"]["musique_s"]
rows = {r["method"] + ("" if r.get("ratio") is None else f"@{r['ratio']}"): r
        for r in json.load(open(f"{R}/ratio_sweep_musique.json"))}
n = len({json.loads(l)["id"] for l in open(f"{R}/.ratios.records.jsonl")})
print(f"| musique_s ({n} questions) | first-token KL | KL gap closed (95% CI) | recompute share |")
print("|---|---|---|---|")
print(f"| naive | {rows['naive']['kl_first_token']:.4f} | - | 0.000 |")
for lab in ("cacheblend@0.3", "epic@0.3", "qcfuse@0.15", "qcfuse@0.3", "qcfuse@0.35", "qcfuse@0.4"):
    g, (lo, hi) = per[lab], per[lab]["kl_gap_closed_ci"]
    print(f"| {lab} | {rows[lab]['kl_first_token']:.4f} | {100 * g['kl_gap_closed']:.1f}% ({100 * lo:.1f}-{100 * hi:.1f}) "
          f"| {rows[lab]['recompute_share']:.3f} |")
PYEOF
    rm -f $R/.ratios.records.jsonl $R/.musique.part*.json
    cat $R/ratio_sweep_musique.md
    exit 0
fi
if [ "${1:-}" != "table" ]; then
    for ((n = STEP; n < 150 + STEP; n += STEP)); do  # musique_s has 150 questions, the others ~100
        one hotpot hotpotqa/hotpotqa_train.json $n
        one musique musique/musique_s.json $n
        one wikimqa 2wikimqa/wikimqa_s_clean.json $n
    done
fi
$PY - $R/{hotpot,musique,wikimqa} > $R/.all.records.jsonl <<'PYEOF'
import json, sys
from pathlib import Path
for stem in sys.argv[1:]:
    if not (Path(stem + ".base.records.jsonl").is_file() and Path(stem + ".qcfuse.records.jsonl").is_file()):
        continue  # a set not started yet
    base = [json.loads(l) for l in open(stem + ".base.records.jsonl")]
    ours = [r for r in map(json.loads, open(stem + ".qcfuse.records.jsonl")) if r["method"] == "qcfuse"]
    both = {r["id"] for r in base} & {r["id"] for r in ours}
    for r in base + ours:
        if r["id"] in both:
            print(json.dumps(r))
PYEOF
$PY -m qcfuse_core.cli bench quality --dataset $D/hotpotqa/hotpotqa_train.json $D/musique/musique_s.json \
    $D/2wikimqa/wikimqa_s_clean.json --aggregate-only --jsonl $R/.all.records.jsonl \
    --json $R/quality.json --plot $R/quality.png
# SmolLM2-135M on the same questions (its committed records), for the side-by-side table
$PY - "$R/.all.records.jsonl" benchmarks/results/quality/{hotpot,musique,wikimqa}.records.jsonl > $R/.smol.records.jsonl <<'PYEOF'
import json, sys
done = {(r["dataset"], r["id"]) for r in map(json.loads, open(sys.argv[1]))}
for path in sys.argv[2:]:
    for line in open(path):
        r = json.loads(line)
        if (r["dataset"], r["id"]) in done and r["method"] in ("full", "naive", "qcfuse", "cacheblend", "epic"):
            print(line, end="")
PYEOF
$PY -m qcfuse_core.cli bench quality --dataset $D/hotpotqa/hotpotqa_train.json $D/musique/musique_s.json \
    $D/2wikimqa/wikimqa_s_clean.json --aggregate-only --jsonl $R/.smol.records.jsonl \
    --json $R/quality_smollm2_same_questions.json
# the docs' table: Gemma beside SmolLM2 over the same questions and over every question
$PY - $R .all.records.jsonl benchmarks/results/quality/quality.summary.json > $R/quality_table.md <<'PYEOF'
import json, sys
R = sys.argv[1]
gem = json.load(open(f"{R}/quality.summary.json"))["per_set"]
same = json.load(open(f"{R}/quality_smollm2_same_questions.summary.json"))["per_set"]
every = json.load(open(sys.argv[3]))["per_set"]
kl = {(r["dataset"], r["method"] + ("" if r.get("ratio") is None else f"@{r['ratio']}")): r["kl_first_token"]
      for r in json.load(open(f"{R}/quality.json"))}
n = {}
for line in open(f"{R}/{sys.argv[2]}"):
    r = json.loads(line)
    n.setdefault(r["dataset"], set()).add(r["id"])
labels = ["qcfuse@0.15", "cacheblend@0.15", "epic@0.15", "qcfuse@0.3", "cacheblend@0.3", "epic@0.3"]
sets = [d for d in ("hotpotqa_train", "musique_s", "wikimqa_s_clean") if d in gem]
pct = lambda x: f"{100 * x:.1f}%"
print("| set (questions) | method | Gemma-3-270M KL gap closed (95% CI) | SmolLM2-135M, same questions | SmolLM2-135M, every question |")
print("|---|---|---|---|---|")
for d in sets:
    for lab in labels:
        g = gem[d][lab]
        lo, hi = g["kl_gap_closed_ci"]
        print(f"| {d} ({len(n[d])}) | {lab} | {pct(g['kl_gap_closed'])} ({100 * lo:.1f}-{100 * hi:.1f}) | "
              f"{pct(same[d][lab]['kl_gap_closed'])} | {pct(every[d][lab]['kl_gap_closed'])} |")
print()
print("| set | naive KL | " + " | ".join(labels) + " |")
print("|---|---|" + "---|" * len(labels))
for d in sets:
    print(f"| {d} | {kl[(d, 'naive')]:.4f} | " + " | ".join(f"{kl[(d, lab)]:.4f}" for lab in labels) + " |")
PYEOF
rm -f $R/.all.records.jsonl $R/.smol.records.jsonl $R/.*.part*.json
