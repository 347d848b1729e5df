"""Where a decode step's time goes at 1, 32 and 256 running requests (issue 6).

One engine on the bundled model with ``step_breakdown`` on (``inflight.profiling``). For
each batch size N it runs N requests (``--prompt-len`` prompt tokens, ``--output-len``
output tokens, ignore_eos) together and averages the pure decode steps (N sequences, N
tokens): scheduling, input preparation, forward (attention apart), sampling, output
processing, and the rest of the step. CPU-side work = everything but the forward.

    .venv/bin/python benchmarks/step_breakdown.py                        # float32, 1/32/256
    .venv/bin/python benchmarks/step_breakdown.py --dtype bfloat16 --save out.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import torch

from inflight.config import EngineConfig
from inflight.engine import Engine
from inflight.profiling import PHASES, StepTimer
from inflight.sampling_params import SamplingParams


def run_batch(engine: Engine, n: int, prompt_len: int, output_len: int, tag: str) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    vocab = engine.tokenizer.vocab_size
    for i in range(n):
        # Distinct prompts: the prefix cache must not turn prefills into hits.
        ids = [(1000 + 7919 * (i * prompt_len + j)) % (vocab - 200) + 100 for j in range(prompt_len)]
        engine.add_request(f"{tag}-{i}", ids, params)
    engine.step_timer.records.clear()
    while engine.has_unfinished_requests():
        engine.step()
    decode = [r for r in engine.step_timer.records if r.num_seqs == n and r.num_tokens == n]
    s = engine.step_timer.summary(decode)
    if not s:
        raise RuntimeError(f"no pure decode step with {n} sequences (max_num_seqs too small?)")
    s["cpu_side_ms"] = s["total_ms"] - s["forward_ms"]
    s["cpu_side_share"] = s["cpu_side_ms"] / s["total_ms"]
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", default="1,32,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--save", type=pathlib.Path)
    args = ap.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    blocks = max(sizes) * (-(-(args.prompt_len + args.output_len) // 16)) + 16
    engine = Engine(EngineConfig(dtype=args.dtype, max_num_seqs=max(sizes), num_kv_blocks=blocks,
                                 num_threads=args.num_threads, step_breakdown=True))
    run_batch(engine, min(4, max(sizes)), 16, 4, "warmup")
    print(f"dtype {args.dtype}, threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.2f}")
    rows = {}
    for n in sizes:
        s = rows[n] = run_batch(engine, n, args.prompt_len, args.output_len, f"b{n}")
        print(f"batch {n:4d}: {StepTimer.format(s)}; CPU-side {s['cpu_side_ms']:.1f} ms "
              f"({100 * s['cpu_side_share']:.1f}%)", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}\n")
    print("| running | step ms | " + " | ".join(PHASES) + " | other | CPU-side share |")
    print("|---" * (len(PHASES) + 4) + "|")
    for n, s in rows.items():
        print(f"| {n} | {s['total_ms']:.1f} | " + " | ".join(f"{s[f'{p}_ms']:.1f}" for p in PHASES)
              + f" | {s['other_ms']:.1f} | {100 * s['cpu_side_share']:.1f}% |")
    if args.save:
        args.save.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "threads": torch.get_num_threads(),
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
