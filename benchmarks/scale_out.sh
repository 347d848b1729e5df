#!/usr/bin/env bash
# Data-parallel comparison for docs/scale_out.md: one server configuration per run, the same
# `inflight bench serve` load against each, the server's /stats (prefix-cache counters,
# requests per replica) read after the load. Usage:
#   benchmarks/scale_out.sh OUT_DIR REPEATS WORKLOAD CONFIG...
# WORKLOAD: prefixes (16 distinct ~400-token documents, each request one of them plus a
# question: the shared-prefix case), mooncake (the trace with prefix blocks; little reuse
# within 100 requests), multiturn (MT-Bench conversations of $TURNS turns, $ACTIVE at a time,
# each follow-up sent with the history and the server's answers), random (no shared prefix) or serial (one request at a time: what the
# Ray hop costs). CONFIG: dp1t1 (1 replica x 1 thread), dp1t2 (1 replica
# x 2 threads), or dp2-<router> (2 replicas x 1 thread: dp2-prefix_affinity, dp2-round_robin,
# dp2-least_load). Needs an otherwise idle machine; logs the load average per run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1; REPEATS=$2; WORKLOAD=$3; shift 3
PORT=${PORT:-8311}
RATE=${RATE:-2}
NUM=${NUM:-100}
mkdir -p "$OUT"
# The same KV memory in total: $KV blocks (512) for one replica, half each for two.
source benchmarks/scale_out_configs.sh
COMMON="--port $PORT --max-model-len 2048 --max-num-seqs 32 --stats-log-interval 0"
case $WORKLOAD in
  prefixes)
    .venv/bin/python benchmarks/scale_out_prefixes.py "$OUT/prefixes.jsonl" "$NUM"
    LOAD="--dataset-name custom --dataset-path $OUT/prefixes.jsonl --skip-chat-template
          --custom-output-len 32 --ignore-eos" ;;
  mooncake) LOAD="--dataset trace --trace-file ../shared/data/mooncake_conversation_0-30min.jsonl
              --trace-format mooncake --prefix-blocks --no-shuffle --length-scale 0.0625
              --max-input-len 768 --max-output-len 64 --ignore-eos" ;;
  multiturn) LOAD="--dataset chat --conversation-turns ${TURNS:-4} --active-conversations ${ACTIVE:-16}
               --output-len ${OUTPUT_LEN:-128}" ;;
  random) LOAD="--dataset random --input-len 256 --output-len 32 --range-ratio 0.5" ;;
  serial) LOAD="--dataset random --input-len 128 --output-len 64 --max-concurrency 1" ;;
  *) echo "unknown workload $WORKLOAD" >&2; exit 2 ;;
esac
for rep in $(seq 1 "$REPEATS"); do
  for cfg in "$@"; do
    FLAGS=$(config_flags "$cfg")
    tag="$WORKLOAD-$cfg-r$rep"
    .venv/bin/inflight serve $COMMON $FLAGS > "$OUT/$tag.server.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do curl -sf "127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
    echo "$tag start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    .venv/bin/inflight bench serve --base-url "http://127.0.0.1:$PORT" $LOAD --seed "$rep" \
        --num-prompts "$NUM" --request-rate "$RATE" --disable-tqdm \
        --percentile-metrics ttft,itl,e2el --metric-percentiles 50,95,99 \
        --save-result "$OUT/$tag.json" > "$OUT/$tag.bench.log" 2>&1 || echo "$tag bench failed"
    curl -s "127.0.0.1:$PORT/stats" > "$OUT/$tag.stats.json"
    echo "$tag end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    kill -TERM "$pid"; wait "$pid" || true
  done
done
