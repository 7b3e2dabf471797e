#!/usr/bin/env bash
# Rerun `qcfuse` (0.15, 0.3) on the three quality sets after a selection change, keeping the
# other methods' committed records (CPU, fp32, 1 thread per process: musique_s on one
# process, hotpotqa then wikimqa_s_clean on the other). Full prefill is read from (or, the
# first time, written to) the per-question references in $R/reference (not committed: ~200
# KB a question), so a later rerun costs the rerun method only. Questions already in the new
# records are skipped: run it again after an interruption. Then merge and rebuild the table:
#     bash benchmarks/rerun_quality.sh          # runs until every question is done, then the table
#     bash benchmarks/rerun_quality.sh table    # only merge + build quality.$TAG.json / .png / .summary.json
# (the committed quality.json stays as it is until a rerun is complete and adopted).
# TAG names the rerun's records ($R/SET.$TAG.records.jsonl); the old qcfuse rows stay in the
# table as OLD_AS (the selection before the change). To evaluate an option without changing
# the default, pass it and file the new rows beside qcfuse:
#     TAG=dev2 EXTRA="--option deviation_pool=2" NEW_AS=qcfuse_dev2 bash benchmarks/rerun_quality.sh
set -uo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results/quality
D=../shared/data
PY=${PYTHON:-.venv/bin/python}
TAG=${TAG:-rerun}
OLD_AS=${OLD_AS:-qcfuse_before}
EXTRA=${EXTRA:-}
NEW_AS=${NEW_AS:-}
TMP=$(mktemp -d)
M="--methods full qcfuse --ratios 0.15 0.3 --max-new-tokens 24 --threads 1 --reference $R/reference $EXTRA"
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
    --methods qcfuse $(if [ -n "$NEW_AS" ]; then echo --new-as qcfuse=$NEW_AS; else echo --keep-old-as qcfuse=$OLD_AS; fi) \
    --out "$TMP/all.records.jsonl"
$PY -m qcfuse_core.cli bench quality --dataset $D/hotpotqa/hotpotqa_train.json $D/musique/musique_s.json \
    $D/2wikimqa/wikimqa_s_clean.json --aggregate-only --jsonl "$TMP/all.records.jsonl" \
    --json $R/quality.$TAG.json --plot $R/quality.$TAG.png
rm -rf "$TMP"
