#!/usr/bin/env bash
# The selection bound, the adaptive budget and the answer-level metric on the three reporting
# sets (CPU, fp32, one thread per process, nice 19). Records append to
# benchmarks/results/quality/SET.bound.records.jsonl; questions already there are skipped, so
# rerunning resumes. Full prefill is kept in $R/reference (not committed) and reused by the
# second pass. Usage:
#     bash benchmarks/issue23_quality.sh SET [LIMIT]          # SET: hotpot | musique | wikimqa
#     bash benchmarks/issue23_quality.sh table                # merge + table + summary
set -uo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results/quality
D=../shared/data
PY=${PYTHON:-.venv/bin/python}
declare -A FILE=([hotpot]=hotpotqa/hotpotqa_train.json [musique]=musique/musique_s.json [wikimqa]=2wikimqa/wikimqa_s_clean.json)
M="--ratios 0.15 0.3 --max-new-tokens 24 --threads 1 --reference $R/reference"
METHODS=${METHODS:-full naive oracle qcfuse adaptive cacheblend epic}
TAG=${TAG:-bound}
if [ "$1" != "table" ]; then
    LIMIT=${2:+--limit $2}
    nice -n 19 $PY -m qcfuse_core.cli bench quality --dataset "$D/${FILE[$1]}" --methods $METHODS $M $LIMIT \
        --jsonl "$R/$1.$TAG.records.jsonl" --json "$(mktemp -d)/$1.json" >> "$R/$1.$TAG.log" 2>&1
    exit
fi
cat $R/hotpot.$TAG.records.jsonl $R/musique.$TAG.records.jsonl $R/wikimqa.$TAG.records.jsonl > $R/all.$TAG.records.jsonl
$PY -m qcfuse_core.cli bench quality --dataset x --aggregate-only --jsonl $R/all.$TAG.records.jsonl \
    --json $R/quality.$TAG.json
