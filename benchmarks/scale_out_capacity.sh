#!/usr/bin/env bash
# The operating limit of each data-parallel configuration under one SLO, for
# docs/scale_out.md: `inflight bench capacity` (search, then hold the limit; the sustained
# check of docs/capacity.md) on the multi-turn chat replay, one configuration after the
# other, each on a server of its own. Usage:
#   benchmarks/scale_out_capacity.sh OUT_DIR CONFIG...
# CONFIG as in benchmarks/scale_out.sh (dp1t2, dp2-prefix_affinity, dp2-round_robin,
# dp2-least_load). About 10-12 minutes per configuration; needs an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1; shift
PORT=${PORT:-8312}
SLO=${SLO:-ttft_p95=1.5,itl_p95=0.2}
mkdir -p "$OUT"
source benchmarks/scale_out_configs.sh
COMMON="--port $PORT --max-model-len 2048 --max-num-seqs 32 --stats-log-interval 0"
for cfg in "$@"; do
  FLAGS=$(config_flags "$cfg")
  echo "$cfg start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  .venv/bin/inflight bench capacity --serve-cmd ".venv/bin/inflight serve $COMMON $FLAGS" \
      --base-url "http://127.0.0.1:$PORT" --server-log-dir "$OUT/$cfg.logs" \
      --dataset chat --conversation-turns 4 --active-conversations 16 --output-len 128 \
      --slo "$SLO" --rate-start "${RATE_START:-1.5}" --rate-min 0.25 --rate-max 8 \
      --max-points "${MAX_POINTS:-5}" --hold-duration "${HOLD:-120}" --max-holds "${MAX_HOLDS:-3}" \
      --disable-tqdm --save-result "$OUT/$cfg.json" --report "$OUT/$cfg.report" \
      > "$OUT/$cfg.log" 2>&1 || echo "$cfg: capacity exited $?"
  grep -h "operating limit\|no load" "$OUT/$cfg.log" | sed "s/^/$cfg: /"
  echo "$cfg end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
done
