"""Multi-LoRA throughput (issue 33, item 5): the same workload on the base model and spread
over adapters, side by side in one process, interleaved (ABAB...).

Two engines on the bundled model in its default mode: ``base`` without LoRA, ``lora`` with
``--enable-lora --max-loras 8``. Adapters are written here in Hugging Face PEFT's format
(random A and B with fixed seeds, all seven projections, rank ``--rank``), never downloaded.
Workloads (``LLM.generate``, greedy, EOS ignored, random prompt ids, fresh per run so no
prefix-cache hit): ``32x8``: 32 requests at once, request ``i`` on adapter ``i % 8`` against
the base engine's 32 requests; ``1x1``: one request on one adapter against one on the
base. Prints each run's output tok/s, the medians, the ratio of medians and the range of
the per-pair ratios, and the load average before each run.

    .venv/bin/python benchmarks/lora_throughput.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from inflight.entrypoints.llm import LLM
from inflight.lora.lora_config import LoRAConfig, LoRAModule
from inflight.sampling_params import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: Path, config: object, rank: int, seed: int) -> None:
    """A PEFT LoRA directory for a Llama of ``config``'s shapes (``ModelConfig``): every
    projection of every layer, A and B ~ N(0, 0.02), ``lora_alpha = 2 * rank``."""
    c: Any = config
    shapes = {"q_proj": (c.hidden_size, c.q_size), "k_proj": (c.hidden_size, c.kv_size),
              "v_proj": (c.hidden_size, c.kv_size), "o_proj": (c.q_size, c.hidden_size),
              "gate_proj": (c.hidden_size, c.intermediate_size),
              "up_proj": (c.hidden_size, c.intermediate_size),
              "down_proj": (c.intermediate_size, c.hidden_size)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(c.num_hidden_layers):
        for name, (fan_in, fan_out) in shapes.items():
            kind = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{i}.{kind}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "fan_in_fan_out": False, "task_type": "CAUSAL_LM"}))


def run_once(llm: LLM, n: int, adapters: list[str | None], args: argparse.Namespace,
             rng: random.Random) -> float:
    """Output tok/s of ``n`` requests at once, request ``i`` on ``adapters[i % len]``."""
    vocab = llm.engine.tokenizer.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    names = [adapters[i % len(adapters)] for i in range(n)]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_name=names)
    dt = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--workloads", default="32x8,1x1")
    args = p.parse_args()
    common = dict(max_num_seqs=32, num_kv_blocks=2048)
    base = LLM(None, **common)
    with tempfile.TemporaryDirectory() as tmp:
        modules = []
        for k in range(args.adapters):
            path = Path(tmp) / f"adapter{k}"
            write_random_adapter(path, base.engine.runner.model.config, args.rank, seed=k)
            modules.append(LoRAModule(f"adapter{k}", str(path)))
        lora = LLM(None, **common, lora_config=LoRAConfig(
            max_loras=args.adapters, max_lora_rank=args.rank, lora_modules=tuple(modules)))
        rng = random.Random(0)
        for spec in args.workloads.split(","):
            n, k = (int(x) for x in spec.split("x"))
            names: list[str | None] = [m.name for m in modules[:k]]
            run_once(base, n, [None], args, rng)  # warm both before timing
            run_once(lora, n, names, args, rng)
            b, a = [], []
            for r in range(args.repeats):
                load = os.getloadavg()[0]
                b.append(run_once(base, n, [None], args, rng))
                a.append(run_once(lora, n, names, args, rng))
                print(f"{spec} repeat {r}: base {b[-1]:.1f} tok/s, {k} adapters {a[-1]:.1f} "
                      f"tok/s, ratio {a[-1] / b[-1]:.3f} (load before {load:.2f})", flush=True)
            ratios = [x / y for x, y in zip(a, b)]
            print(f"{spec}: base median {statistics.median(b):.1f}, adapters median "
                  f"{statistics.median(a):.1f}, ratio of medians "
                  f"{statistics.median(a) / statistics.median(b):.3f} (pairs "
                  f"{min(ratios):.3f}-{max(ratios):.3f})", flush=True)


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
