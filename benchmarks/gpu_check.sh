#!/usr/bin/env bash
# The CUDA path on a CUDA machine, in under 5 minutes (issue 6):
#   1. the GPU tests (tests/cuda: paged logits vs HF on the GPU in float32 and bfloat16,
#      greedy tokens of the bundled GGUF vs HF generate, KV sized by gpu_memory_utilization,
#      seeded sampling) and the CPU HF-equality tests beside them;
#   2. benchmarks/offline_throughput.py on the GPU: 256 requests, 128 in / 128 out,
#      bfloat16, inflight vs HF static generate at batch 32.
# Needs a Python with a CUDA build of torch and the project's dependencies (make install,
# or PYTHON=... pointing at one) and the bundled model. Results go to $OUT (the device
# tool's folder) or /tmp/inflight-gpu-check.
#
#     bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
RESULTS=${OUT:-/tmp/inflight-gpu-check}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$PY" - <<'PYEOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device")
free, total = torch.cuda.mem_get_info()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
      f"{free / 2**30:.0f} of {total / 2**30:.0f} GiB free")
PYEOF
start=$(date +%s)
timeout 210 "$PY" -m pytest -q -x -rs tests/cuda tests/model/test_llama_vs_hf.py 2>&1 \
    | tee "$RESULTS/gpu_tests.log"
timeout 150 "$PY" benchmarks/offline_throughput.py --device cuda --num-requests 256 \
    --dtypes bfloat16 --save "$RESULTS/offline_throughput_cuda.json" 2>&1 \
    | tee "$RESULTS/offline_throughput_cuda.log"
echo "gpu_check: done in $(( $(date +%s) - start )) s; results in $RESULTS"
