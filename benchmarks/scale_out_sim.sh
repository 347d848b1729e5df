#!/usr/bin/env bash
# The simulator's what-if for docs/scale_out.md: 1, 2, 4 and 8 replicas (a 2-core machine
# each, bfloat16 roofline profile) behind each router, on the shared-prefix workload at
# 2 req/s per replica and on random prompts (no shared prefix) at 3 req/s per replica.
# About 40 s in all. Usage: benchmarks/scale_out_sim.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1
mkdir -p "$OUT"
.venv/bin/inflight profile --hardware cpu-2core-xeon --dtype bfloat16 -o "$OUT/profile.json" > /dev/null
.venv/bin/python benchmarks/scale_out_prefixes.py "$OUT/prefixes.jsonl" 400
SERVE=".venv/bin/inflight serve --num-kv-blocks 256 --max-model-len 2048 --max-num-seqs 32"
COMMON="--simulate $OUT/profile.json --num-prompts 400 --seed 1 --disable-tqdm
        --percentile-metrics ttft,itl,e2el --metric-percentiles 50,95,99"
for n in 1 2 4 8; do
  for router in prefix_affinity least_load round_robin; do
    .venv/bin/inflight bench serve $COMMON --serve-cmd "$SERVE" --replicas $n --router $router \
        --dataset-name custom --dataset-path "$OUT/prefixes.jsonl" --skip-chat-template \
        --custom-output-len 32 --ignore-eos --request-rate $((2 * n)) \
        --save-result "$OUT/prefixes-dp$n-$router-r1.json" > /dev/null
    .venv/bin/inflight bench serve $COMMON --serve-cmd "$SERVE" --replicas $n --router $router \
        --dataset random --input-len 256 --output-len 32 --range-ratio 0.5 \
        --request-rate $((3 * n)) --save-result "$OUT/random-dp$n-$router-r1.json" > /dev/null
  done
done
.venv/bin/python benchmarks/scale_out_table.py "$OUT"
