#!/usr/bin/env bash
# The CPU figures of docs/benchmarks.md: store reads, TTFT on both packaged models, 4 concurrent
# clients against 1 (`bench load`), the default tiers under uniform and Zipf draws, 8 clients in process against 8
# over HTTP (`qcfuse serve`), chunks the server learns from prompts
# (k=10, full prefill against qcfuse over HTTP),
# chunk-affinity routing on 2 Ray Serve replicas (`bench routing`), the demo, and the quality tables. Run from the repository root after `make setup` (or `make test`):
#
#     bash benchmarks/cpu.sh                                  # every step (quality: hours to days)
#     QUICK=1 DATA=path/to/data bash benchmarks/cpu.sh        # smoke run: few runs, one question a set
#     STEPS="store ttft" bash benchmarks/cpu.sh               # some steps only
#
# Steps: store ttft load tiers http learned routing demo quality. Results go under $OUT (default bench-results/cpu), one
# JSON (and a log) per figure. The quality step needs DATA: a folder holding
# hotpotqa/hotpotqa_train.json, musique/musique_s.json, musique/musique_train.json and
# 2wikimqa/wikimqa_s_clean.json (the evaluation sets are not shipped); without it the step
# is skipped. Quality records are appended (--jsonl): an interrupted run resumes where it
# stopped when started again with the same OUT. Full prefill's outputs are kept per question
# under $OUT/reference and reused by the later commands.
set -uo pipefail
OUT=${OUT:-bench-results/cpu}
STEPS=${STEPS:-store ttft load tiers http learned routing demo quality}
QUICK=${QUICK:-}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONUNBUFFERED=1
QC="$PY -m qcfuse_core.cli"
mkdir -p "$OUT"
if [ -n "$QUICK" ]; then REPEATS=3 LIMIT="--limit 1" BOUND=1 STORED=1
else REPEATS=9 LIMIT="" BOUND=15 STORED=3; fi

{ date -u; uname -srm; echo "cores: $(nproc)"; uptime
  $PY -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)'
} 2>&1 | tee "$OUT/env.txt"

has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
step() { echo; echo "== $*"; }

if has store; then
  step "store: one layer of 10 chunks x 1024 tokens (Llama-3.1-8B KV shape) from each tier"
  timeout 1800 $PY -m qcfuse_core.eval.store_bench --threads 1 --repeats $REPEATS \
      --json "$OUT/store_cpu.json" 2>&1 | tee "$OUT/store_cpu.log" | tail -12
  timeout 1800 $PY -m qcfuse_core.eval.store_bench --threads 1 --repeats 3 --storage fp8 \
      --json "$OUT/store_cpu_fp8.json" 2>&1 | tee "$OUT/store_cpu_fp8.log" | tail -6
fi

if has ttft; then
  # the thread settings a user gets: no --threads
  TTFT="bench ttft --device cpu --chunks 8 --chunk-tokens 256 --query-tokens 32
        --methods full naive cacheblend qcfuse epic --ratios 0.15 0.3"
  if [ -n "$QUICK" ]; then RUNS_S="--runs 2 --warmup 1 --breakdown-runs 1"; RUNS_G=$RUNS_S
  else RUNS_S="--runs 7"; RUNS_G="--runs 5 --warmup 1"; fi
  step "ttft: SmolLM2-135M (the embedded model), 8 x 256 tokens"
  timeout 3600 $QC $TTFT $RUNS_S --json "$OUT/ttft_cpu_smollm2.json" --markdown "$OUT/ttft_cpu_smollm2.md" \
      2>&1 | tee "$OUT/ttft_cpu_smollm2.log" | tail -12
  step "ttft: Gemma-3-270M, 8 x 256 tokens"
  timeout 3600 $QC $TTFT --model gemma3-270m $RUNS_G --json "$OUT/ttft_cpu_gemma3.json" \
      --markdown "$OUT/ttft_cpu_gemma3.md" 2>&1 | tee "$OUT/ttft_cpu_gemma3.log" | tail -12
fi

if has load; then
  # closed loop, 1 then 4 clients against one engine: each request 4 of a pool of 20 chunks of
  # 128 tokens, its own 16-token question, 64 new tokens (about 3 minutes on 2 cores). fp32: a
  # CPU without bf16 instructions emulates bf16 matmuls, and 4 clients' full prefills in bf16
  # run past the 120 s cap there
  step "load: SmolLM2-135M (the embedded model), fp32, 1 and 4 clients, qcfuse 0.15 and full"
  timeout 1200 $QC bench load --device cpu --dtype fp32 --tier host --pool-chunks 20 --chunk-tokens 128 --chunks-per-request 4 \
      --query-tokens 16 --max-new-tokens 64 --clients 1 4 --requests-per-client 3 --methods qcfuse full \
      --ratios 0.15 --duration-s 120 --json "$OUT/load_cpu.json" --markdown "$OUT/load_cpu.md" \
      --plot "$OUT/load_cpu.png" 2>&1 | tee "$OUT/load_cpu.log" | tail -6
fi

if has tiers; then
  # the engine's default tiers (--tier default), 1 client, each request 4 of a pool of 20 chunks
  # of 128 tokens, drawn uniformly, then by Zipf(1.0) popularity, then Zipf with the host tier
  # capped at 48 MiB (8 of the 20 chunks in fp32): where each chunk came from, beside TTFT
  TIERW="--device cpu --dtype fp32 --pool-chunks 20 --chunk-tokens 128 --chunks-per-request 4 --query-tokens 16
         --max-new-tokens 16 --clients 1 --requests-per-client 10 --methods full qcfuse --ratios 0.15 --duration-s 300"
  for run in "uniform --popularity uniform" "zipf --popularity zipf" "zipf48 --popularity zipf --host-bytes 48M"; do
    set -- $run; name=$1; shift
    step "tiers: default tiers, $name"
    timeout 1200 $QC bench load $TIERW "$@" --json "$OUT/tiers_$name.json" --markdown "$OUT/tiers_$name.md" \
        --plot "$OUT/tiers_$name.png" 2>&1 | tee "$OUT/tiers_$name.log" | tail -4
  done
fi

if has http; then
  # 8 streaming clients for 60 s, closed loop, against the async API in process and then against
  # `qcfuse serve` over the loopback interface: the same pool, requests and settings (fp32, each
  # request 4 of 20 chunks of 128 tokens, 32 new tokens, EOS ignored); TTFT on the engine's clock
  LOADW="--pool-chunks 20 --chunk-tokens 128 --chunks-per-request 4 --query-tokens 16 --max-new-tokens 32
         --clients 8 --requests-per-client 100 --methods qcfuse --ratios 0.15 --duration-s 60"
  step "http: 8 clients for 60 s, in process"
  timeout 900 $QC bench load --device cpu --dtype fp32 --tier host $LOADW --json "$OUT/http_inprocess.json" \
      --markdown "$OUT/http_inprocess.md" 2>&1 | tee "$OUT/http_inprocess.log" | tail -4
  step "http: 8 clients for 60 s, over HTTP (qcfuse serve on 127.0.0.1)"
  PORT=${PORT:-8731}
  rm -rf "$OUT/http-store"
  $QC serve --store "$OUT/http-store" --dtype fp32 --port "$PORT" > "$OUT/http_server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
  timeout 900 $QC bench load --url "http://127.0.0.1:$PORT" $LOADW --json "$OUT/http_served.json" \
      --markdown "$OUT/http_served.md" 2>&1 | tee "$OUT/http_served.log" | tail -4
  kill -TERM $SERVER; wait $SERVER
fi

if has learned; then
  # issue 55: no chunk registered - `qcfuse serve` learns them from the prompts. Each pool chunk
  # is shown once (bench load --chunks learn), then 1 streaming client sends requests of 10 of
  # a pool of 50 chunks of 128 tokens (their order drawn per request), full prefill and qcfuse
  # 0.15, 16 new tokens (about 5 minutes on 2 cores)
  step "learned: k=10 over HTTP, the chunks learned from the prompts"
  PORT=${PORT:-8731}
  rm -rf "$OUT/learned-store"
  $QC serve --store "$OUT/learned-store" --dtype fp32 --port "$PORT" > "$OUT/learned_server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
  timeout 1200 $QC bench load --url "http://127.0.0.1:$PORT" --chunks learn --pool-chunks 50 --chunk-tokens 128 \
      --chunks-per-request 10 --query-tokens 16 --max-new-tokens 16 --clients 1 --requests-per-client 10 \
      --methods full qcfuse --ratios 0.15 --duration-s 300 --json "$OUT/learned_http.json" \
      --markdown "$OUT/learned_http.md" 2>&1 | tee "$OUT/learned_http.log" | tail -4
  curl -s "http://127.0.0.1:$PORT/metrics" | grep '^qcfuse_learned' > "$OUT/learned_metrics.txt"
  kill -TERM $SERVER; wait $SERVER
fi

if has routing; then
  # 2 replicas of the embedded model on Ray Serve over one store: Ray's default router, then
  # chunk affinity, on the same replayed mix (pool of 50 chunks, 10 per request, 8 of them from
  # one of 5 topics; each replica's memory holds 25 chunks)
  step "routing: 2 replicas, default router vs chunk affinity"
  timeout 1800 $QC bench routing --replicas 2 --requests 60 --clients 4 --chunk-words 20 \
      --port "${RAY_PORT:-8732}" --json "$OUT/routing_cpu.json" --markdown "$OUT/routing_cpu.md" \
      2>&1 | tee "$OUT/routing_cpu.log" | tail -4
fi

if has demo; then
  step "demo: the sample corpus, three questions, full prefill beside each method, with its fidelity"
  DEMO="demo --store $OUT/demo-store"
  timeout 1200 $QC $DEMO --json "$OUT/demo_qcfuse_0.15.json" 2>&1 | tee "$OUT/demo.log" | tail -4
  timeout 600 $QC $DEMO --ratio 0.3 --json "$OUT/demo_qcfuse_0.3.json" 2>&1 | tail -2
  for mode in epic cacheblend naive; do
    timeout 600 $QC $DEMO --mode $mode --json "$OUT/demo_$mode.json" 2>&1 | tail -2
  done
fi

if has quality; then
  if [ -z "${DATA:-}" ]; then
    step "quality: skipped (set DATA to the folder holding the evaluation sets; see the header)"
  else
    HOTPOT=$DATA/hotpotqa/hotpotqa_train.json MUSIQUE=$DATA/musique/musique_s.json
    WIKI=$DATA/2wikimqa/wikimqa_s_clean.json
    Q="bench quality --max-new-tokens 24 --threads 1 --reference $OUT/reference"
    BASE="--methods full naive qcfuse cacheblend epic --ratios 0.15 0.3"
    mkdir -p "$OUT/quality"
    for model in smollm2-135m gemma3-270m; do
      for set in hotpot:$HOTPOT musique:$MUSIQUE wikimqa:$WIKI; do
        name=${set%%:*} file=${set#*:}
        step "quality: $model, $name (every question: hours on 2 cores)"
        timeout 259200 $QC $Q --model $model $BASE --dataset "$file" $LIMIT \
            --jsonl "$OUT/quality/$model.$name.records.jsonl" --json "$OUT/quality/$model.$name.json" \
            2>&1 | tail -12
      done
    done
    step "quality: oracle and adaptive budget, hotpotqa_train questions 0-14 (SmolLM2-135M)"
    timeout 86400 $QC $Q --methods full naive oracle qcfuse adaptive cacheblend epic --ratios 0.15 0.3 \
        --dataset "$HOTPOT" --limit $BOUND \
        --jsonl "$OUT/quality/smollm2-135m.hotpot.bound.records.jsonl" \
        --json "$OUT/quality/smollm2-135m.hotpot.bound.json" 2>&1 | tail -14
    step "quality: Gemma-3-270M above 0.3 on musique_s"
    timeout 259200 $QC $Q --model gemma3-270m --methods full qcfuse --ratios 0.35 0.4 --dataset "$MUSIQUE" $LIMIT \
        --jsonl "$OUT/quality/gemma3-270m.musique.ratios.records.jsonl" \
        --json "$OUT/quality/gemma3-270m.musique.ratios.json" 2>&1 | tail -6
    for storage in bf16 fp8; do
      step "quality: chunk caches stored as $storage, hotpotqa_train questions 0-2"
      timeout 21600 $QC $Q --methods full naive qcfuse --ratios 0.15 0.3 --storage $storage \
          --dataset "$HOTPOT" --limit $STORED \
          --jsonl "$OUT/quality/smollm2-135m.hotpot.$storage.records.jsonl" \
          --json "$OUT/quality/smollm2-135m.hotpot.$storage.json" 2>&1 | tail -8
    done
    # the quality guard (docs/benchmarks.md, "Quality guard"): 32-token answers for questions
    # 0-49 of each set, first tokens for the rest; the threshold calibrated on hotpotqa_train
    G="bench quality --threads 1 --methods full qcfuse"
    for set in hotpot:$HOTPOT musique:$MUSIQUE wikimqa:$WIKI; do
      name=${set%%:*} file=${set#*:}
      step "quality guard: $name, answers (0-49) and first tokens (50-)"
      timeout 259200 $QC $G --ratios 0.15 0.3 0.5 --limit 50 --max-new-tokens 32 --dataset "$file" \
          --jsonl "$OUT/quality/guard.ans.$name.records.jsonl" --json "$OUT/quality/guard.ans.$name.json" 2>&1 | tail -3
      timeout 259200 $QC $G --ratios 0.15 --offset 50 --max-new-tokens 1 --dataset "$file" \
          --jsonl "$OUT/quality/guard.ft.$name.records.jsonl" --json "$OUT/quality/guard.ft.$name.json" 2>&1 | tail -3
    done
    $QC calibrate-guard --records "$OUT/quality/guard.ans.hotpot.records.jsonl" \
        "$OUT/quality/guard.ft.hotpot.records.jsonl" --catch 0.9 --out "$OUT/quality/guard.calibration.json"
    cat "$OUT"/quality/guard.ans.*.records.jsonl "$OUT"/quality/guard.ft.*.records.jsonl > "$OUT/quality/guard.all.records.jsonl"
    $QC bench quality --aggregate-only --guard --dataset "$HOTPOT" --jsonl "$OUT/quality/guard.all.records.jsonl" \
        --json "$OUT/quality/guard.all.json" 2>&1 | tail -8
    $QC bench quality --aggregate-only --guard --dataset "$HOTPOT" --jsonl "$OUT/quality/guard.ans.hotpot.records.jsonl" \
        --json "$OUT/quality/guard.ans.hotpot.json" --pareto "$OUT/quality/guard-pareto.png" 2>&1 | tail -4
  fi
fi
echo; echo "results under $OUT"
