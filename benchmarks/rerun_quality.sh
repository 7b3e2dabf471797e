#!/usr/bin/env bash
# Rerun `qcfuse` (0.15, 0.3) on the three quality sets after a selection change, keeping the
# other methods' committed records (CPU, fp32, 1 thread per process: musique_s on one
# process, hotpotqa then wikimqa_s_clean on the other). Full prefill is read from (or, the
# first time, written to) the per-question references in $R/reference (not committed: ~200
# KB a question), so a later rerun costs the rerun method only. Questions already in the new
# records are skipped: run it again after an interruption. Then merge and rebuild the table:
#     bash benchmarks/rerun_quality.sh          # runs until every question is done, then the table
#     bash benchmarks/rerun_quality.sh table    # only merge + rebuild quality.json / .png / .summary.json
# TAG names the rerun's records ($R/SET.$TAG.records.jsonl); the old qcfuse rows stay in the
# table as OLD_AS (the selection before the change).
set -uo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results/quality
D=../shared/data
PY=${PYTHON:-.venv/bin/python}
TAG=${TAG:-rerun}
OLD_AS=${OLD_AS:-qcfuse_before}
TMP=$(mktemp -d)
M="--methods full qcfuse --ratios 0.15 0.3 --max-new-tokens 24 --threads 1 --reference $R/reference"
one() {  # one set: name, data file
    $PY -m qcfuse_core.cli bench quality --dataset "$D/$2" $M --jsonl "$R/$1.$TAG.records.jsonl" \
        --json "$TMP/$1.json" >> "$R/$1.$TAG.log" 2>&1
}
if [ "${1:-}" != "table" ]; then
    one musique musique/musique_s.json &
    (one hotpot hotpotqa/hotpotqa_train.json; one wikimqa 2wikimqa/wikimqa_s_clean.json) &
    wait
fi
$PY benchmarks/merge_quality.py --old $R/hotpot.records.jsonl $R/musique.records.jsonl $R/wikimqa.records.jsonl \
    --new $R/hotpot.$TAG.records.jsonl $R/musique.$TAG.records.jsonl $R/wikimqa.$TAG.records.jsonl \
    --methods qcfuse --keep-old-as qcfuse=$OLD_AS --out "$TMP/all.records.jsonl"
$PY -m qcfuse_core.cli bench quality --dataset $D/hotpotqa/hotpotqa_train.json $D/musique/musique_s.json \
    $D/2wikimqa/wikimqa_s_clean.json --aggregate-only --jsonl "$TMP/all.records.jsonl" \
    --json $R/quality.json --plot $R/quality.png
rm -rf "$TMP"
