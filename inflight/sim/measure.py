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
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from inflight.sim.acceptance import acceptance_of
from inflight.sim.fitted_cost import FittedCostModel, fit_cost_model, summary_line
from inflight.sim.profile import StepProfile, profile_warnings, sample_row, save_profile
from inflight.sim.step_shape import StepShape

if TYPE_CHECKING:  # the engine and the model load torch: imported where they run
    from inflight.config import EngineConfig
    from inflight.engine.engine import Engine
    from inflight.model.hparams import ModelConfig
    from inflight.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CONTEXTS = (16, 256, 1024)
MAX_CASE_PREFILL = {16: 1 << 20, 256: 8192, 1024: 4096}  # prefill tokens per decode case
MIXED = [(d, p) for d in (4, 16, 64) for p in (64, 512, 2048)]


def add_profile_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from inflight.config import DEFAULT_MAX_NUM_WAITING, EngineConfig

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
    p.add_argument("--max-num-waiting", type=int, default=DEFAULT_MAX_NUM_WAITING, help="the server's admission bound to simulate")
    EngineConfig.add_cli_args(p)


def _model_info(model_config: ModelConfig, path: pathlib.Path) -> dict[str, Any]:
    from inflight.sim.roofline import ModelShape
    return {"name": getattr(path, "stem", str(path)), "architecture": model_config.architecture,
            "max_position_embeddings": model_config.max_position_embeddings,
            "tie_word_embeddings": model_config.tie_word_embeddings,
            **dataclasses.asdict(ModelShape.from_config(model_config))}


def _engine_info(config: EngineConfig, dtype: str, num_blocks: int | None, max_model_len: int, eos: Iterable[int],
                 block_bytes: int, path: pathlib.Path, max_num_waiting: int | None) -> dict[str, Any]:
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


def derive(config: EngineConfig, args: argparse.Namespace) -> StepProfile:
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
    # `auto` as the engine resolves it: bfloat16 where the hardware computes it natively
    # (a GPU, or a CPU whose file lists bfloat16 FLOP/s), else float32.
    native_bf16 = hw.kind == "gpu" or "bfloat16" in hw.peak_flops
    dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if native_bf16 else "float32")
    shape = ModelShape.from_config(mc)
    max_len = config.max_model_len or mc.max_position_embeddings
    engine = _engine_info(config, dtype, config.num_kv_blocks, max_len, mc.eos_token_ids,
                          shape.kv_bytes_per_token(DTYPE_BYTES[dtype]) * config.block_size, path, args.max_num_waiting)
    prof = derive_profile(hw, shape, engine, _model_info(mc, path))
    if not prof.engine.get("eos_token_ids"):
        from inflight.tokenizer import Tokenizer
        prof.engine["eos_token_ids"] = sorted(Tokenizer.from_gguf(path).eos_token_ids)
    return prof


def _cases(config: EngineConfig, quick: bool) -> list[tuple[str, list[int], list[int]]]:
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


def engine_header(engine: Engine, max_num_waiting: int | None) -> dict[str, Any]:
    """``{"engine": ..., "model": ...}`` of a loaded ``Engine`` (with a ``ModelRunner``), as
    a profile saves them."""
    from inflight.engine.loading import (resolve_device, resolve_dtype, resolve_kv_cache_dtype,
                                         resolve_model_path)
    from inflight.runner import kv_block_bytes

    config = engine.config
    model_config = _model_config(engine)
    path = resolve_model_path(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
    info = _engine_info(config, str(dtype).removeprefix("torch."), engine.kv_cache.num_blocks, engine.max_model_len,
                        engine.eos_token_ids, kv_block_bytes(model_config, config.block_size, kv_dtype), path,
                        max_num_waiting)
    return {"engine": info, "model": _model_info(model_config, path)}


def _model_config(engine: Engine) -> ModelConfig:
    """The hyperparameters of the model a loaded engine runs (its runner, built from its
    config, is a ``ModelRunner``; the ``Runner`` protocol does not say it has a model)."""
    config: ModelConfig = cast(Any, engine.runner).model.config
    return config


def from_step_logs(paths: list[str]) -> StepProfile:
    """A profile fitted to the back-to-back steps of serving step logs."""
    from inflight.bench.machine import describe_machine
    from inflight.sim.steplog import read_step_logs

    header, shapes, seconds = read_step_logs(paths)
    if not shapes:
        raise ValueError("the step logs hold no back-to-back steps: serve some load with --step-log first")
    cost = _fit_and_report(shapes, seconds)
    machine = {**describe_machine(), "step_logs": [str(p) for p in paths]}
    return StepProfile("serving", cost, header["engine"], header["model"], machine,
                       samples=[sample_row(s, t) for s, t in zip(shapes, seconds)],
                       acceptance=acceptance_of(header.get("spec_decode")))


def measure(config: EngineConfig, args: argparse.Namespace) -> StepProfile:
    """Time the grid on the engine ``config`` describes; fit and return the profile."""
    from inflight.bench.machine import HostMonitor, describe_machine
    from inflight.engine.engine import Engine

    machine_start = describe_machine()
    engine = Engine(config)
    grid = _GridTimer(engine, config.seed, args.decode_steps)
    grid.run_case([16, 16], [])  # warm-up: kernels compiled, caches touched; not kept
    grid.forget_steps()
    cases = _cases(config, args.quick)
    monitor = HostMonitor().start()
    t0 = time.perf_counter()
    for rep in range(args.repeats):
        for _, initial, late in cases:
            grid.run_case(initial, late)
            engine.reset_prefix_cache()  # each case's prompts are new anyway; keep the pool clean
        print(f"pass {rep + 1}/{args.repeats}: {len(grid.shapes)} steps so far, {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    cost = _fit_and_report(grid.shapes, grid.seconds)
    host = monitor.stop()
    machine = {**machine_start, "end": describe_machine(), "profile_seconds": time.perf_counter() - t0,
               "host_load": None if host is None else host.to_json()}
    header = engine_header(engine, args.max_num_waiting)
    return StepProfile("measured", cost, header["engine"], header["model"], machine,
                       samples=[sample_row(s, t) for s, t in zip(grid.shapes, grid.seconds)])


def _fit_and_report(shapes: list[StepShape], seconds: list[float]) -> FittedCostModel:
    """:func:`~inflight.sim.fitted_cost.fit_cost_model`, each step kind's error on stderr."""
    cost = fit_cost_model(shapes, seconds)
    for kind, fit in cost.fits.items():
        print(f"  {kind}: {summary_line(fit)}", file=sys.stderr)
    return cost


class _GridTimer:
    """Runs the grid's cases on a loaded engine, keeping each step's shape and seconds.

    Prompts are random token ids (from ``seed``) that ignore EOS: a request of the initial
    prompts decodes ``decode_steps`` tokens past its first, one of the late prompts one.
    """

    def __init__(self, engine: Engine, seed: int, decode_steps: int) -> None:
        self.engine = engine
        self.decode_steps = decode_steps
        self.shapes: list[StepShape] = []
        self.seconds: list[float] = []
        self._rng = np.random.default_rng(seed)
        self._vocab = _model_config(engine).vocab_size
        self._num_requests = 0

    def run_case(self, initial: list[int], late: list[int]) -> None:
        """Queue prompts of the ``initial`` lengths; once they have prefilled (they decode
        then), those of the ``late`` lengths; step until every request has ended."""
        from inflight.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=self.decode_steps + 2, ignore_eos=True, temperature=0.0)
        for n in initial:
            self._add(n, params)
        while late and self._prefilling():  # the late prompts arrive while the others decode
            self._step()
        for n in late:
            self._add(n, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
        while self.engine.has_unfinished_requests():
            self._step()

    def forget_steps(self) -> None:
        """Drop the steps timed so far (the warm-up's)."""
        self.shapes.clear()
        self.seconds.clear()

    def _add(self, prompt_len: int, params: SamplingParams) -> None:
        self._num_requests += 1
        n = min(prompt_len, self.engine.max_model_len - self.decode_steps - 3)
        prompt = [int(t) for t in self._rng.integers(100, self._vocab, n)]
        self.engine.add_request(f"p{self._num_requests}", prompt, params)

    def _step(self) -> None:
        """One engine step, timed; kept if it ran (a step with an empty plan is not)."""
        before = self.engine.last_plan
        t = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - t
        plan = self.engine.last_plan
        if plan is not None and plan is not before:
            self.shapes.append(StepShape.of(plan.scheduled))
            self.seconds.append(seconds)

    def _prefilling(self) -> bool:
        sched = self.engine.scheduler
        return bool(sched.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)
