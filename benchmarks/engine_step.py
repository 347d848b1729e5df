"""Offline engine speed at a few batch sizes: output tokens/s and mean step time.

Requests of ``--input-len`` random token ids each generate exactly ``--output-len`` tokens
(``ignore_eos``, greedy), all added at once, so a run is ``--batch`` decode rows per step
after the first prefill steps. Batch 1 shows what the engine adds around a step; a large
batch shows throughput. ``--fake-runner`` replaces the model with a runner that returns a
fixed token at once (the bundled tokenizer still detokenizes, with a stop string to watch),
so the step time is the engine's own bookkeeping alone: scheduler, output processor,
outputs.

Compare two checkouts on one machine, interleaved: run this file with each checkout first on
``PYTHONPATH`` (a script's own folder, not the current one, heads ``sys.path``):

    for i in 1 2 3; do for tree in /path/a /path/b; do
      PYTHONPATH=$tree .venv/bin/python benchmarks/engine_step.py --batch 1 64; done; done
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time


class _FixedTokenRunner:
    """Every sampling row gets ``token_id`` at once."""

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    def execute(self, out):
        try:
            from inflight.core.output import SampleResult
        except ImportError:  # a checkout from before the engine split, for A/B runs
            from inflight.sampler import SampleResult
        return [SampleResult(s.request, self.token_id, None) for s in out.scheduled if s.samples]


def _engine(args):
    from inflight.config import EngineConfig
    from inflight.engine import Engine

    batch = max(args.batch)
    blocks = batch * (args.input_len + args.output_len) // 16 + 64
    config = EngineConfig(dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=batch,
                          num_kv_blocks=blocks)
    if not args.fake_runner:
        return Engine(config)
    from inflight.model.bundled import find_bundled_model
    from inflight.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(find_bundled_model())
    return Engine(config, runner=_FixedTokenRunner(tok.encode(" hi")[0]), tokenizer=tok,
                  num_blocks=blocks, max_model_len=4096, eos_token_ids=tok.eos_token_ids)


def _run(engine, prompts, params) -> None:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--fake-runner", action="store_true",
                    help="no model: time the engine's own work per step")
    args = ap.parse_args()

    import inflight
    from inflight import SamplingParams
    from inflight.bench.machine import cpu_shares, cpu_ticks

    engine = _engine(args)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            stop=["\x00never"])
    rng = random.Random(0)
    _run(engine, [[rng.randrange(100, 10_000) for _ in range(16)]] * 2, params)  # warm-up
    for batch in args.batch:
        prompts = [[rng.randrange(100, 10_000) for _ in range(args.input_len)]
                   for _ in range(batch)]
        stats0, ticks0 = engine.get_stats(), cpu_ticks()
        t0 = time.perf_counter()
        _run(engine, prompts, params)
        dt = time.perf_counter() - t0
        stats = engine.get_stats()
        steps = stats.num_steps - stats0.num_steps
        tokens = stats.generation_tokens - stats0.generation_tokens
        print(json.dumps({
            "tree": os.path.dirname(os.path.dirname(inflight.__file__)),
            "runner": "fake" if args.fake_runner else "model", "batch": batch,
            "output_tok_s": round(tokens / dt, 1), "step_ms": round(1e3 * dt / steps, 3),
            "steps": steps, "loadavg_1m": os.getloadavg()[0],
            "cpu": cpu_shares({"cpu_ticks": ticks0}, {"cpu_ticks": cpu_ticks()})}))


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
