"""What verifying k drafts costs: one request's step with 0..K drafts, through the real
runner (issue 31). Each draft is one more decode row in the step; this prints the median
seconds of the step by k, and its ratio to the plain decode step, so the break-even
acceptance (tokens a verification must yield) can be read off.

    .venv/bin/python benchmarks/verification_step.py --dtype auto --quantization auto
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from inflight.core.output import ScheduledRequest, SchedulerOutput
from inflight.entrypoints.llm import LLM
from inflight.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--drafts", type=int, nargs="+", default=[0, 1, 2, 3, 4, 6, 8])
    ap.add_argument("--context", type=int, default=200, help="tokens already in the KV cache")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, quantization=args.quantization)
    engine = llm.engine
    engine.add_request("r", list(range(100, 100 + args.context)),
                       SamplingParams(temperature=0, max_tokens=1000))
    while not engine.scheduler.running or engine.scheduler.running[0].num_output_tokens == 0:
        engine.step()
    req = engine.scheduler.running[0]
    engine.kv_cache.allocate(req, max(args.drafts) + 1)
    table = engine.kv_cache.get_block_table("r")
    start = req.num_computed_tokens
    base = None
    print(f"load average {os.getloadavg()[0]:.2f}; {args.dtype}, quantization {args.quantization}")
    for k in args.drafts:
        out = SchedulerOutput()
        out.scheduled.append(ScheduledRequest(req, [7] * (k + 1), start, table, True,
                                              num_draft_tokens=k))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.runner.execute(out)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times[2:])  # the first calls build oneDNN primitives
        base = base or med
        print(f"k={k:2d}: {1e3 * med:6.1f} ms median (min {1e3 * min(times[2:]):.1f}), "
              f"{med / base:.2f}x the plain step")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
