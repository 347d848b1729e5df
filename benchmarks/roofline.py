"""Roofline for the bundled model on this machine, and where the engine's decode sits on it.

Measures, in one run:
- matmul throughput (GFLOP/s), float32 and bfloat16, on a large square GEMM (the peak)
  and on the model's own decode shapes (batch x hidden -> qkv / o / gate_up / down);
- memory bandwidth (GB/s) from a large tensor copy (bytes read + written), and reads alone;
- from them, the bounds on decode tokens/s: bandwidth-bound at batch 1 (every step reads
  all weights once), compute-bound at large batch (2 FLOPs per weight per token);
- the engine's steady-state decode tokens/s at batch 1, 8, 32, 64, 128 and its share of
  each bound;
- with ``--gguf``, the same for the default mode (the GGUF's own blocks, ``--quantization
  gguf``): the bytes a decode step streams are the blocks each linear layer and the LM head
  hold, and the floor is those bytes over the read bandwidth (issue 51's goal: one stream
  within 80 % of it).

    .venv/bin/python benchmarks/roofline.py --dtypes bfloat16 float32 --batches 1 8 32 64 128
    .venv/bin/python benchmarks/roofline.py --gguf --dtypes bfloat16 --batches 1

The machine is shared: run it idle, and read the printed load average.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from inflight.bench.timing import seconds_per_call


def _bench(fn, min_time: float = 0.5) -> float:
    """Seconds per call, best of three timings of at least ``min_time / 3`` seconds each."""
    return min(seconds_per_call(fn, min_time / 3) for _ in range(3))


def matmul_gflops(m: int, n: int, k: int, dtype: torch.dtype) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    return 2 * m * n * k / _bench(lambda: a @ b) / 1e9


def bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _bench(lambda: dst.copy_(src), min_time=1.0) / 1e9


def read_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Bytes read per second by a sum over a large tensor: reads only, as a decode step's
    weight stream. Printed beside the copy figure, which has swung by 1.5x on this machine."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    return nbytes / _bench(lambda: src.sum(), min_time=1.0) / 1e9


def decode_tokens_per_s(model, dtype: torch.dtype, batch: int, context: int = 128,
                        steps: int = 16) -> float:
    from inflight.config import EngineConfig
    from inflight.engine import Engine
    from inflight.runner import ModelRunner
    from inflight.sampler import Sampler
    from inflight.sampling_params import SamplingParams

    blocks = batch * ((context + steps) // 16 + 2)
    runner = ModelRunner(model, blocks, 16, dtype, Sampler())
    engine = Engine(EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch)),
                    runner=runner, num_blocks=blocks, max_model_len=4096, eos_token_ids=[])
    for i in range(batch):
        engine.add_request(str(i), [(100 + i + j) % 40000 + 100 for j in range(context)],
                           SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill, not timed
    engine.step()
    t0 = time.perf_counter()
    n = 0
    for _ in range(steps):
        engine.step()
        n += 1
    return batch * n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64, 128])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--gguf", action="store_true", help="the default mode: the GGUF's blocks")
    args = ap.parse_args()
    if args.gguf:
        gguf_floor(args)
        return

    from inflight.model.bundled import find_bundled_model
    from inflight.model.llama import LlamaForCausalLM
    from inflight.model.loader import load_model

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    bw = bandwidth_gbs()
    print(f"memory bandwidth (copy): {bw:.1f} GB/s; reads alone (sum): "
          f"{read_bandwidth_gbs():.1f} GB/s")
    config, state = load_model(find_bundled_model())
    c = config
    layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
             + 3 * c.hidden_size * c.intermediate_size)
    matmul_params = c.num_hidden_layers * layer + c.vocab_size * c.hidden_size
    shapes = {"qkv": (c.hidden_size, c.q_size + 2 * c.kv_size), "o": (c.q_size, c.hidden_size),
              "gate_up": (c.hidden_size, 2 * c.intermediate_size),
              "down": (c.intermediate_size, c.hidden_size)}
    for name in args.dtypes:
        dtype = getattr(torch, name)
        elem = torch.empty((), dtype=dtype).element_size()
        peak = matmul_gflops(2048, 2048, 2048, dtype)
        print(f"\n== {name}: large GEMM peak {peak:.0f} GFLOP/s")
        for batch in args.batches:
            own = {k: matmul_gflops(batch, n, kk, dtype) for k, (kk, n) in shapes.items()}
            print(f"  model shapes at batch {batch:4d}: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in own.items()) + " GFLOP/s")
        bw_bound = bw * 1e9 / (matmul_params * elem)  # bw: bytes moved (read + write) per s
        compute_bound = peak * 1e9 / (2 * matmul_params)
        print(f"  bounds: batch-1 bandwidth bound {bw_bound:.0f} tok/s "
              f"({matmul_params * elem / 1e6:.0f} MB of weights a step); "
              f"compute bound {compute_bound:.0f} tok/s")
        model = LlamaForCausalLM(config, dtype=dtype)
        model.load_weights(state)
        for batch in args.batches:
            tps = decode_tokens_per_s(model, dtype, batch, args.context)
            print(f"  engine decode batch {batch:4d}: {tps:8.1f} tok/s = "
                  f"{100 * tps / bw_bound:5.1f}% of bandwidth bound, "
                  f"{100 * tps / compute_bound:5.1f}% of compute bound", flush=True)
        del model
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


def streamed_bytes(model) -> int:
    """Bytes a batch-1 decode step reads for the linear layers and the LM head: a layer's
    blocks (packed values, scales, minimums) where it has them, else its dense weight."""
    from inflight.model.linear import Linear

    total = 0
    for m in model.modules():
        if not isinstance(m, Linear):
            continue
        q = m.quant
        parts = [m.weight] if q is None else [q.qs, q.scales] + ([] if q.mins is None else [q.mins])
        total += sum(t.numel() * t.element_size() for t in parts)
    return total


def gguf_floor(args: argparse.Namespace) -> None:
    """The default mode's decode against its bandwidth floor: the blocks' bytes over the
    read bandwidth."""
    from inflight.engine.loading import load_model_and_tokenizer
    from inflight.model.bundled import find_bundled_model

    reads = read_bandwidth_gbs()
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}; "
          f"read bandwidth {reads:.1f} GB/s")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        _, model, _ = load_model_and_tokenizer(find_bundled_model(), dtype, torch.device("cpu"),
                                               "gguf")
        nbytes = streamed_bytes(model)
        floor = reads * 1e9 / nbytes
        print(f"== {name}, GGUF blocks: {nbytes / 1e6:.1f} MB a step; floor {floor:.0f} tok/s")
        for batch in args.batches:
            tps = max(decode_tokens_per_s(model, dtype, batch, args.context, steps=32)
                      for _ in range(3))
            print(f"  engine decode batch {batch:4d}: {tps:8.1f} tok/s (best of 3) = "
                  f"{100 * tps / floor:5.1f}% of the floor" if batch == 1 else
                  f"  engine decode batch {batch:4d}: {tps:8.1f} tok/s (best of 3)", flush=True)
        del model


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
