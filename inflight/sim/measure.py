"""``inflight profile``: time real engine steps over a grid of shapes and fit a profile.

The engine is the server's (same flags as ``inflight serve``), so a step is timed as the
server's engine thread runs it: schedule, model, sampling, detokenization, outputs. Each
case of the grid queues synthetic requests (random token ids, ``ignore_eos``) and steps
until they end; every step is a sample (its shape read from the plan the runner gets):

- decode: ``B`` requests at context ``L`` for ``B`` in powers of two up to
  ``max_num_seqs``, ``L`` in 16, 256, 1024 (bounded in prefill tokens per case); their
  admission gives prefill samples of many sizes;
- mixed: ``D`` requests decoding while a prompt of ``P`` tokens arrives.

The grid runs ``--repeats`` times, interleaved (the machine drifts). ``--hardware NAME``
derives a roofline profile instead (:mod:`inflight.sim.roofline`), measuring nothing;
``--from-step-log`` fits one to a serving engine's own steps (:mod:`inflight.sim.steplog`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import logging
import pathlib
import sys
import time
from typing import Any

import numpy as np

from inflight.sim.profile import (StepProfile, StepShape, fit_cost_model, profile_warnings, sample_row, save_profile,
                                  summary_line)

logger = logging.getLogger(__name__)

CONTEXTS = (16, 256, 1024)
MAX_CASE_PREFILL = {16: 1 << 20, 256: 8192, 1024: 4096}  # prefill tokens per decode case
MIXED = [(d, p) for d in (4, 16, 64) for p in (64, 512, 2048)]


def add_profile_parser(sub: Any) -> None:
    from inflight.config import EngineConfig

    p = sub.add_parser("profile", help="measure (or derive) a step-time profile for the simulator",
                       description="Time real engine steps over a grid of shapes and fit a step-time "
                                   "model for `inflight bench ... --simulate` (docs/simulator.md).")
    p.add_argument("--output", "-o", required=True, metavar="PROFILE.json")
    p.add_argument("--repeats", type=int, default=2, help="passes over the grid (default %(default)s)")
    p.add_argument("--decode-steps", type=int, default=6, help="decode steps timed per case (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="a small grid (tests, a first look)")
    p.add_argument("--hardware", metavar="NAME|FILE.json",
                   help="derive a roofline profile for this hardware instead of measuring "
                        "(shipped: inflight/sim/hardware/*.json)")
    p.add_argument("--from-step-log", nargs="+", metavar="LOG.jsonl",
                   help="fit the profile from a serving engine's steps (`inflight serve --step-log`) "
                        "instead of timing a grid; engine flags are then the log's")
    p.add_argument("--request-overhead", type=float, default=0.002, metavar="S",
                   help="seconds from a request's arrival to the engine queue (HTTP, template, tokenizer)")
    p.add_argument("--delivery-latency", type=float, default=0.0005, metavar="S",
                   help="seconds from a step's end to the client reading its tokens")
    p.add_argument("--max-num-waiting", type=int, default=512, help="the server's admission bound to simulate")
    EngineConfig.add_cli_args(p)


def _model_info(model_config: Any, path: Any) -> dict[str, Any]:
    from inflight.sim.roofline import ModelShape
    return {"name": getattr(path, "stem", str(path)), "architecture": model_config.architecture,
            "max_position_embeddings": model_config.max_position_embeddings,
            "tie_word_embeddings": model_config.tie_word_embeddings,
            **dataclasses.asdict(ModelShape.from_config(model_config))}


def _engine_info(config: Any, dtype: str, num_blocks: int | None, max_model_len: int, eos: Any, block_bytes: int,
                 path: Any, max_num_waiting: int | None) -> dict[str, Any]:
    cfg = dataclasses.asdict(config)
    cfg["model"] = str(path)
    return {"config": cfg, "dtype": dtype, "block_size": config.block_size, "num_kv_blocks": num_blocks,
            "max_model_len": max_model_len, "eos_token_ids": sorted(eos), "kv_block_bytes": block_bytes,
            "model_path": str(path), "max_num_waiting": max_num_waiting}


def run_profile(args: argparse.Namespace) -> int:
    from inflight.config import EngineConfig

    config = EngineConfig.from_cli_args(args)
    out = pathlib.Path(args.output)
    if not out.parent.is_dir() or out.is_dir():
        raise ValueError(f"--output {out}: {'a directory' if out.is_dir() else 'no such folder ' + str(out.parent)}")
    if args.hardware and args.from_step_log:
        raise ValueError("--hardware derives a profile, --from-step-log fits one: give one of them")
    if args.from_step_log:
        profile = from_step_logs(args.from_step_log)
    else:
        profile = derive(config, args) if args.hardware else measure(config, args)
    profile.request_overhead_s, profile.delivery_s = args.request_overhead, args.delivery_latency
    profile.created_at = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    save_profile(args.output, profile)
    print(f"wrote {args.output}: {profile.describe()}")
    for note, _ in profile_warnings(profile):
        print(f"WARNING: {note}; a simulation on this profile predicts that, not this server "
              f"(measure again on an idle machine)", file=sys.stderr)
    return 0


def derive(config: Any, args: argparse.Namespace) -> StepProfile:
    """A roofline profile of ``config``'s model on ``--hardware`` (reads the model's shapes
    from its file, loads no weights)."""
    from inflight.engine.loading import resolve_model_path
    from inflight.model.gguf_file import read_gguf_tensors
    from inflight.model.loader import load_model, read_gguf_config
    from inflight.sim.roofline import DTYPE_BYTES, Hardware, ModelShape, derive_profile

    hw = Hardware.load(args.hardware)
    path = resolve_model_path(config.model)
    if path.suffix == ".gguf":
        meta, tensors = read_gguf_tensors(path)
        mc = read_gguf_config(meta, {t.name for t in tensors})
    else:
        mc, _ = load_model(path)
    dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if hw.kind == "gpu" else "float32")
    shape = ModelShape.from_config(mc)
    max_len = config.max_model_len or mc.max_position_embeddings
    engine = _engine_info(config, dtype, config.num_kv_blocks, max_len, mc.eos_token_ids,
                          shape.kv_bytes_per_token(DTYPE_BYTES[dtype]) * config.block_size, path, args.max_num_waiting)
    prof = derive_profile(hw, shape, engine, _model_info(mc, path))
    if not prof.engine.get("eos_token_ids"):
        from inflight.tokenizer import Tokenizer
        prof.engine["eos_token_ids"] = sorted(Tokenizer.from_gguf(path).eos_token_ids)
    return prof


def _cases(config: Any, quick: bool) -> list[tuple[str, list[int], list[int]]]:
    """``(name, initial prompt lengths, late prompt lengths)``; a late prompt arrives after
    the initial ones' prefill, while they decode."""
    seqs = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= config.max_num_seqs]
    contexts: tuple[int, ...] = CONTEXTS
    mixed = MIXED
    if quick:
        seqs, contexts, mixed = [b for b in seqs if b <= 8], (16, 128), [(4, 64), (4, 256)]
    budget = config.max_num_batched_tokens
    cases: list[tuple[str, list[int], list[int]]] = []
    for ctx in contexts:
        for b in seqs:
            if b * ctx <= MAX_CASE_PREFILL.get(ctx, 4096) or b == 1:
                cases.append((f"decode b={b} ctx={ctx}", [ctx] * b, []))
    for d, p in mixed:
        if d <= config.max_num_seqs - 1 and (p <= budget or config.enable_chunked_prefill):
            cases.append((f"mixed d={d} p={p}", [64] * d, [p]))
    return cases


def engine_header(engine: Any, max_num_waiting: int | None) -> dict[str, Any]:
    """``{"engine": ..., "model": ...}`` of a loaded ``Engine`` (with a ``ModelRunner``), as
    a profile saves them."""
    from inflight.engine.loading import resolve_device, resolve_dtype, resolve_model_path
    from inflight.runner import kv_block_bytes

    config = engine.config
    model_config = engine.runner.model.config
    path = resolve_model_path(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    kv_dtype = dtype if config.kv_cache_dtype == "auto" else resolve_dtype(config.kv_cache_dtype, device)
    info = _engine_info(config, str(dtype).removeprefix("torch."), engine.kv_cache.num_blocks, engine.max_model_len,
                        engine.eos_token_ids, kv_block_bytes(model_config, config.block_size, kv_dtype), path,
                        max_num_waiting)
    return {"engine": info, "model": _model_info(model_config, path)}


def from_step_logs(paths: list[str]) -> StepProfile:
    """A profile fitted to the back-to-back steps of serving step logs."""
    from inflight.bench.machine import describe_machine
    from inflight.sim.steplog import read_step_logs

    header, shapes, seconds = read_step_logs(paths)
    if not shapes:
        raise ValueError("the step logs hold no back-to-back steps: serve some load with --step-log first")
    cost = fit_cost_model(shapes, seconds)
    for kind, fit in cost.fits.items():
        print(f"  {kind}: {summary_line(fit)}", file=sys.stderr)
    machine = {**describe_machine(), "step_logs": [str(p) for p in paths]}
    return StepProfile("serving", cost, header["engine"], header["model"], machine,
                       samples=[sample_row(s, t) for s, t in zip(shapes, seconds)])


def measure(config: Any, args: argparse.Namespace) -> StepProfile:
    """Time the grid on the engine ``config`` describes; fit and return the profile."""
    from inflight.bench.machine import HostMonitor, describe_machine
    from inflight.engine.engine import Engine
    from inflight.sampling_params import SamplingParams

    machine_start = describe_machine()
    engine = Engine(config)
    runner: Any = engine.runner
    model_config = runner.model.config
    rng = np.random.default_rng(config.seed)
    vocab = model_config.vocab_size
    shapes: list[StepShape] = []
    seconds: list[float] = []
    steps = args.decode_steps
    counter = 0

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.integers(100, vocab, n)]

    def step_timed() -> None:
        before = engine.last_plan
        t = time.perf_counter()
        engine.step()
        dt_s = time.perf_counter() - t
        plan = engine.last_plan
        if plan is not None and plan is not before:  # a step ran (not an empty one)
            shapes.append(StepShape.of(plan.scheduled))
            seconds.append(dt_s)

    def prefilling() -> bool:
        sched = engine.scheduler
        return bool(sched.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)

    def run(initial: list[int], late: list[int]) -> None:
        nonlocal counter
        params = SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0.0)
        for n in initial:
            counter += 1
            engine.add_request(f"p{counter}", prompt(min(n, engine.max_model_len - steps - 3)), params)
        while late and prefilling():  # the late prompts arrive while the others decode
            step_timed()
        for n in late:
            counter += 1
            engine.add_request(f"p{counter}", prompt(min(n, engine.max_model_len - steps - 3)),
                               SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
        while engine.has_unfinished_requests():
            step_timed()

    run([16, 16], [])  # warm-up: kernels compiled, caches touched; not kept
    shapes.clear()
    seconds.clear()
    cases = _cases(config, args.quick)
    monitor = HostMonitor().start()
    t0 = time.perf_counter()
    for rep in range(args.repeats):
        for name, initial, late in cases:
            run(initial, late)
            engine.reset_prefix_cache()  # each case's prompts are new anyway; keep the pool clean
        print(f"pass {rep + 1}/{args.repeats}: {len(shapes)} steps so far, {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    cost = fit_cost_model(shapes, seconds)
    for kind, fit in cost.fits.items():
        print(f"  {kind}: {summary_line(fit)}", file=sys.stderr)
    host = monitor.stop()
    machine = {**machine_start, "end": describe_machine(), "profile_seconds": time.perf_counter() - t0,
               "host_load": None if host is None else host.to_json()}
    header = engine_header(engine, args.max_num_waiting)
    return StepProfile("measured", cost, header["engine"], header["model"], machine,
                       samples=[sample_row(s, t) for s, t in zip(shapes, seconds)])
