"""What structured output costs a decode step (issue 16: batch 32 with half the batch
constrained, goal under 10 % over unconstrained).

One engine in this process, the bundled model with ``make serve``'s defaults. Each trial
queues 32 requests of 64 prompt tokens and ``--output-len`` tokens out, greedy; in the
constrained trial 16 of them carry a grammar (by default a regex that cannot end before
the output does, so every step masks 16 rows; ``--spec json`` uses a JSON schema
instead). Trials alternate, ``--repeats`` of each, and the figure is the median wall time
of pure decode steps with all 32 running. The sampler's own share (masks filled, applied,
grammars advanced) is timed apart with the same rows.

    .venv/bin/python benchmarks/structured_output.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from inflight.config import EngineConfig  # noqa: E402
from inflight.engine import Engine  # noqa: E402
from inflight.sampling_params import SamplingParams  # noqa: E402
from inflight.structured_output import StructuredOutputsParams  # noqa: E402

SPECS = {
    "regex": StructuredOutputsParams(regex="[a-z ,.]{400,800}"),
    "json": StructuredOutputsParams(json={
        "type": "object", "properties": {"items": {"type": "array", "items": {
            "type": "object", "properties": {"name": {"type": "string"},
                                             "n": {"type": "integer"}},
            "required": ["name", "n"]}}}, "required": ["items"]}),
}


def trial(engine: Engine, constrained: int, spec: StructuredOutputsParams, batch: int,
          output_len: int, tag: str) -> list[float]:
    """Decode-step wall times (ms) while all ``batch`` requests run."""
    for i in range(batch):
        so = spec if i < constrained else None
        sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=so is None,
                            structured_outputs=so)
        engine.add_request(f"{tag}-{i}", [1000 + 7 * i + j for j in range(64)], sp)
    times = []
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        dt = (time.perf_counter() - t0) * 1e3
        plan = engine.last_plan
        if running == batch and plan is not None and plan.num_batched_tokens == batch:
            times.append(dt)
    return times


def sampler_share(engine: Engine, spec: StructuredOutputsParams, batch: int,
                  constrained: int, steps: int = 64) -> float:
    """Median ms of ``Sampler.sample`` alone on ``[batch, vocab]`` random logits with
    ``constrained`` rows under ``spec`` (their grammars advanced by the sampled tokens)."""
    import torch

    from inflight.request import Request
    from inflight.sampler import Sampler
    from inflight.structured_output import GrammarState

    compiled = engine.compile_grammar(spec)
    vocab = engine.tokenizer.vocab_size
    reqs = []
    for i in range(batch):
        so = spec if i < constrained else None
        r = Request(f"s{i}", [1], SamplingParams(temperature=0, structured_outputs=so),
                    eos_token_ids=frozenset(engine.eos_token_ids))
        r.grammar = GrammarState(compiled) if so is not None else None
        reqs.append(r)
    sampler, gen, times = Sampler(), torch.Generator().manual_seed(0), []
    for _ in range(steps):
        for r in reqs:  # random logits end a grammar early: start it over
            if r.grammar is not None and r.grammar.is_terminated:
                r.grammar = GrammarState(compiled)
        logits = torch.randn(batch, vocab, generator=gen)
        t0 = time.perf_counter()
        sampler.sample(logits, reqs)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--spec", choices=sorted(SPECS), default="regex")
    args = ap.parse_args()
    engine = Engine(EngineConfig())
    spec = SPECS[args.spec]
    engine.compile_grammar(spec)  # xgrammar's import and vocabulary tables, once
    half = args.batch // 2
    trial(engine, half, spec, args.batch, 8, "warm")
    results: dict[int, list[float]] = {0: [], half: []}
    for rep in range(args.repeats):
        for constrained in (0, half):
            steps = trial(engine, constrained, spec, args.batch, args.output_len,
                          f"{rep}-{constrained}")
            results[constrained].append(statistics.median(steps))
            print(f"repeat {rep} constrained {constrained:2d}/{args.batch}: median decode "
                  f"step {results[constrained][-1]:.2f} ms over {len(steps)} steps", flush=True)
    base, con = results[0], results[half]
    ratios = [c / b for b, c in zip(base, con)]
    print(f"\nload average {os.getloadavg()[0]:.2f}; spec {args.spec}; batch {args.batch}")
    print(f"unconstrained: {min(base):.2f} / {statistics.median(base):.2f} / {max(base):.2f} ms"
          " (min / median / max of repeats)")
    print(f"{half} constrained: {min(con):.2f} / {statistics.median(con):.2f} / "
          f"{max(con):.2f} ms")
    print(f"ratio per repeat: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f} (goal < 1.10)")
    free = sampler_share(engine, spec, args.batch, 0)
    held = sampler_share(engine, spec, args.batch, half)
    print(f"sampler alone (random logits, 64 steps, median): {free:.2f} ms unconstrained, "
          f"{held:.2f} ms with {half} constrained (+{held - free:.2f} ms a step)")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
