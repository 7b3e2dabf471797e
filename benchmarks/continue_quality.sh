#!/usr/bin/env bash
# Resume the issue-4 quality benchmark where the committed records stop (CPU, fp32, 1 thread
# per process, one process per dataset). Questions already in a records file are skipped, so
# running this again after an interruption only runs what is missing. Then rebuild the table:
#     bash benchmarks/continue_quality.sh          # runs until every question is done
#     bash benchmarks/continue_quality.sh table    # only rebuild quality.json / quality.png
set -uo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results/quality
D=../shared/data
PY=${PYTHON:-.venv/bin/python}
TMP=$(mktemp -d)  # this run's per-dataset tables; the combined one is rebuilt below
M="--methods full naive qcfuse cacheblend epic --ratios 0.15 0.3 --max-new-tokens 24 --threads 1"
if [ "${1:-}" != "table" ]; then
    $PY -m qcfuse_core.cli bench quality --dataset $D/musique/musique_s.json $M \
        --jsonl $R/musique.records.jsonl --json $TMP/musique.json >> $R/musique_rest.log 2>&1 &
    $PY -m qcfuse_core.cli bench quality --dataset $D/2wikimqa/wikimqa_s_clean.json $M \
        --jsonl $R/wikimqa.records.jsonl --json $TMP/wikimqa.json >> $R/wikimqa_rest.log 2>&1 &
    $PY -m qcfuse_core.cli bench quality --dataset $D/hotpotqa/hotpotqa_train.json $M \
        --jsonl $R/hotpot.records.jsonl --json $TMP/hotpot.json >> $R/hotpot_rest.log 2>&1
    wait
fi
cat $R/hotpot.records.jsonl $R/musique.records.jsonl $R/wikimqa.records.jsonl > $TMP/all.records.jsonl
$PY -m qcfuse_core.cli bench quality --dataset $D/hotpotqa/hotpotqa_train.json $D/musique/musique_s.json \
    $D/2wikimqa/wikimqa_s_clean.json --aggregate-only --jsonl $TMP/all.records.jsonl \
    --json $R/quality.json --plot $R/quality.png
rm -rf "$TMP"
