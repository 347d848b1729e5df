"""The skinny linear kernel against oneDNN's prepacked GEMM at decode batch 1-4 (issue 6).

Two measurements, interleaved and repeated (the machine is noisy):
- per layer shape of the bundled model (qkv, o, gate_up, down, lm_head), microseconds per
  call and the weight bytes streamed per second, with enough copies of each weight that
  they come from DRAM as in a real step (the model's 269 MB of bfloat16 weights exceed L3);
- the engine's decode tokens/s at batch 1 and 2 (a 128-token prompt, 64 tokens out, greedy)
  three ways: oneDNN through the modules; the skinny kernel through the modules; the skinny
  kernel with the whole stack in one native call (decode_layers.c, the default).

    .venv/bin/python benchmarks/skinny_linear.py --dtypes bfloat16 float32
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

import inflight.model.linear as linear
import inflight.model.llama as llama
from inflight.bench.timing import seconds_per_call
from inflight.model.kernels import skinny_linear
from inflight.model.kernels.native_lib import native_library

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def shapes(dtype: torch.dtype, rows: list[int], repeats: int) -> None:
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * torch.tensor([], dtype=dtype).element_size()
        layers = []
        for _ in range(max(1, int(96e6 // nbytes))):  # > L3: weights stream from DRAM
            lin = linear.Linear(k, n, bias=False)
            lin.weight = torch.nn.Parameter(torch.randn(n, k).to(dtype), requires_grad=False)
            lin.prepack()
            layers.append(lin)
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            turn = iter(range(1 << 62))
            onednn = lambda: layers[next(turn) % len(layers)](x)  # noqa: E731 (prepacked path)
            ours = lambda: skinny_linear(x, layers[next(turn) % len(layers)].weight)  # noqa: E731
            with kernel_off():
                best_a = min(seconds_per_call(onednn) for _ in range(repeats))
            best_b = min(seconds_per_call(ours) for _ in range(repeats))
            print(f"  {name:8s} M={m}: oneDNN {1e6 * best_a:7.1f} us ({nbytes / best_a / 1e9:5.1f} "
                  f"GB/s), skinny {1e6 * best_b:7.1f} us ({nbytes / best_b / 1e9:5.1f} GB/s)",
                  flush=True)


@contextlib.contextmanager
def kernel_off():
    """Route ``Linear`` to oneDNN for any row count while inside (the skinny kernel
    declines, so generated rows fall back to the GEMM)."""
    real = linear.skinny_linear
    linear.skinny_linear = lambda *args, **kwargs: None
    try:
        yield
    finally:
        linear.skinny_linear = real


@contextlib.contextmanager
def modules():
    """The skinny kernel, but layer by layer through the modules, not decode_layers.c."""
    llama.LlamaForCausalLM.fused_decode = False
    try:
        yield
    finally:
        llama.LlamaForCausalLM.fused_decode = True


def engine(dtype: str, batches: list[int], repeats: int) -> None:
    from inflight import LLM, SamplingParams

    llm = LLM(dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for b in batches:
        prompts = [list(range(100 + i, 228 + i)) for i in range(b)]
        llm.generate(prompts, [params] * b, use_tqdm=False)  # warm-up
        modes = {"oneDNN": kernel_off, "skinny, per module": modules, "skinny, one call":
                 contextlib.nullcontext}
        results: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(repeats):
            for mode in results:
                with modes[mode]():
                    t0 = time.perf_counter()
                    llm.generate(prompts, [params] * b, use_tqdm=False)
                    results[mode].append(64 * b / (time.perf_counter() - t0))
        print("  engine batch %d: " % b + ", ".join(
            f"{mode} {', '.join(f'{v:.1f}' for v in vals)} tok/s" for mode, vals in results.items()),
            flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if native_library() is None:
        raise SystemExit("the native kernels could not be built here")
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    for dtype in args.dtypes:
        print(f"== {dtype}")
        shapes(getattr(torch, dtype), args.rows, args.repeats)
        engine(dtype, args.batches, args.repeats)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
