"""The parsed ``bench`` flags into the run's frozen configuration, once (:func:`bench_config`):
below this module nothing sees an argparse Namespace."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import fields
from typing import Any

from inflight.bench.datasets import DatasetConfig
from inflight.bench.knob_flags import parse_knob
from inflight.bench.limit import SearchSpace
from inflight.bench.lora_modules import LoraModules, parse_lora_modules, server_flags
from inflight.bench.run_config import BenchConfig, OutputOptions, ServerOptions
from inflight.bench.session import ArrivalConfig, LoadConfig
from inflight.bench.simulation import SimulateOptions
from inflight.bench.summary import SLO, parse_slo
from inflight.bench.confidence import n_min_for
from inflight.bench.tiers import SloTier
from inflight.bench.sustain import (DEFAULT_PREEMPTION_THRESHOLD, DEFAULT_QUEUE_TOLERANCE, DEFAULT_RATE_TOLERANCE,
                                    Thresholds, strictest_n_min)
from inflight.bench.vllm_compat import (SAMPLING_FLAGS, Resolved, SpelledFlags, merge_goodput,
                                        parse_metric_percentiles, parse_percentile_metrics, resolve_vllm_args)

DEFAULT_WINDOW_S = {"capacity": 60.0, "tune": 60.0}  # --duration where a point must be a steady state
SEARCHES = ("capacity", "tune")


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """The run's configuration from parsed ``bench`` flags, vLLM's spellings folded into ours
    (``vllm_compat.resolve_vllm_args``). ValueError on flags that contradict, or (capacity,
    tune) without aggregate SLOs, or a bad search."""
    command = str(getattr(args, "bench_command", None))
    resolved = resolve_vllm_args(_spelled(args))
    load = _load(args, resolved, command)
    _check_simulate(args)
    lora = _lora(args)
    dataset = _dataset(args, resolved, lora)
    _check_arrival(args, resolved)
    slo = merge_goodput(parse_slo(args.slo), args.goodput)
    arrival = _arrival(args, resolved, command, slo)
    space: SearchSpace | None = None
    knobs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    tiers = _tiers(args, command)
    if command in SEARCHES:
        if not tiers:
            require_aggregate(slo)
        space = search_space(args, arrival)
        if command == "tune":
            knobs = tuple((name, tuple(values)) for name, values in map(parse_knob, args.knob))
    return BenchConfig(command=command, load=load, dataset=dataset, arrival=arrival, slo=slo,
                       thresholds=_thresholds(args), output=_output(args), server=_server(args, lora),
                       simulate=(SimulateOptions(args.simulate, args.replicas, args.router)
                                 if args.simulate else None),
                       space=space, request_rates=tuple(getattr(args, "request_rates", None) or ()),
                       time_scales=tuple(getattr(args, "time_scales", None) or ()), knobs=knobs,
                       fresh=bool(getattr(args, "fresh", False)), recorded=_recorded(args, resolved), tiers=tiers)


def _tiers(args: argparse.Namespace, command: str) -> tuple[SloTier, ...]:
    tiers: tuple[SloTier, ...] = getattr(args, "slo_tiers", None) or ()
    if tiers and (command != "capacity" or not args.users):
        raise ValueError("--slo-tiers finds the users sustained per tier: it needs bench capacity --users")
    return tiers


def _spelled(args: argparse.Namespace) -> SpelledFlags:
    given = {f.name: getattr(args, f.name) for f in fields(SpelledFlags)
             if f.name not in ("sampling", "extra_body") and hasattr(args, f.name)}
    sampling = {k: v for k in SAMPLING_FLAGS if (v := getattr(args, k, None)) is not None}
    return SpelledFlags(**given, sampling=sampling, extra_body=args.extra_body or {})


def _recorded(args: argparse.Namespace, resolved: Resolved) -> dict[str, Any]:
    """The flags as a result records them: JSON values only, the API key left out, what
    vLLM's spellings set folded in."""
    flags = dict(vars(args))
    for f in fields(Resolved):
        value = getattr(resolved, f.name)
        if f.name in flags or value is not None:
            flags[f.name] = value
    return {k: v for k, v in flags.items()
            if not k.startswith("_") and isinstance(v, (str, int, float, bool, list, dict, type(None)))
            and k != "api_key"}


def _load(args: argparse.Namespace, resolved: Resolved, command: str) -> LoadConfig:
    reset = args.reset_prefix_cache
    if reset is None:
        # A search re-sends the same prompts at every load: without a reset, later points
        # would find them cached and skip their prefill.
        reset = command in DEFAULT_WINDOW_S
    return LoadConfig(base_url=resolved.base_url, model=resolved.model, endpoint=resolved.endpoint_type,
                      api_key=args.api_key, temperature=args.temperature, extra_body=resolved.extra_body,
                      request_timeout=args.request_timeout, max_concurrency=args.max_concurrency,
                      num_warmups=args.num_warmups, scrape_metrics=args.metrics, reset_prefix_cache=reset,
                      metrics_interval=args.metrics_interval, tokenize=args.tokenize,
                      tokenizer=args.tokenizer, progress=not args.disable_tqdm)


def _check_simulate(args: argparse.Namespace) -> None:
    if not args.simulate and (args.replicas != 1 or args.router != "prefix_affinity"):
        raise ValueError("--replicas and --router simulate replicas: they need --simulate PROFILE.json "
                         "(a real run measures the server at --base-url as it is)")


def _lora(args: argparse.Namespace) -> LoraModules:
    """``--lora-modules``, parsed; ValueError where adapter paths have no server to go to,
    or the server command names its own adapters too."""
    lora = parse_lora_modules(getattr(args, "lora_modules", None))
    if lora.paths and not args.serve_cmd and not args.simulate:
        raise ValueError("--lora-modules NAME=PATH loads the adapters into the server bench starts (--serve-cmd); "
                         "for a server already running give the names it serves them under: --lora-modules NAME ...")
    if lora.paths and args.serve_cmd:
        server_flags(lora, args.serve_cmd)
    return lora


def _dataset(args: argparse.Namespace, r: Resolved, lora: LoraModules) -> DatasetConfig:
    users = getattr(args, "users", None) is not None
    if args.shuffle and r.arrival == "trace":
        raise ValueError("--shuffle would scramble the trace's arrival times; it needs a rate (--arrival poisson ...)")
    shuffle = args.shuffle if args.shuffle is not None else (r.dataset == "trace" and r.arrival != "trace")
    dataset = DatasetConfig(name=r.dataset, num_prompts=r.num_prompts, seed=args.seed,
                            data_dir=args.data_dir, input_len=r.input_len, output_len=r.output_len,
                            range_ratio=args.range_ratio, prefix_len=r.prefix_len,
                            trace_file=r.trace_file, trace_format=args.trace_format,
                            trace_skip=args.trace_skip, length_scale=args.length_scale,
                            min_input_len=args.min_input_len, max_input_len=args.max_input_len,
                            min_output_len=args.min_output_len, max_output_len=args.max_output_len,
                            prefix_blocks=args.prefix_blocks, chat_file=r.chat_file, sonnet_file=r.sonnet_file,
                            ignore_eos=args.ignore_eos, shuffle=shuffle, lora_modules=lora.names,
                            sessions=r.dataset == "trace" and users,
                            conversation_turns=args.conversation_turns,
                            active_conversations=args.active_conversations or DatasetConfig.active_conversations)
    if args.conversation_turns > 1 and r.dataset != "chat":
        raise ValueError("--conversation-turns replays multi-turn chats: it needs --dataset chat")
    if args.active_conversations is not None and args.conversation_turns == 1:
        raise ValueError("--active-conversations shapes a multi-turn replay: it needs --conversation-turns > 1")
    if dataset.conversation_turns > 1 and dataset.num_prompts <= dataset.active_conversations and not users:
        print(f"note: the first {dataset.active_conversations} requests of the mix are first turns "
              f"(--active-conversations); with --num-prompts {dataset.num_prompts} no follow-up "
              f"turn is sent unless a measurement window extends the mix", file=sys.stderr)
    return dataset


def _check_arrival(args: argparse.Namespace, r: Resolved) -> None:
    if r.arrival == "poisson" and args.burstiness != 1.0:
        raise ValueError("--burstiness needs --arrival gamma")
    if r.arrival == "trace" and r.dataset != "trace":
        raise ValueError("--arrival trace needs --dataset trace")


def _arrival(args: argparse.Namespace, r: Resolved, command: str, slo: SLO) -> ArrivalConfig:
    duration = args.duration if args.duration is not None else DEFAULT_WINDOW_S.get(command)
    if duration is not None and not duration > 0:
        raise ValueError("--duration must be > 0")
    if duration is None and (args.warmup_duration is not None or args.drain_timeout is not None):
        raise ValueError("--warmup-duration and --drain-timeout need --duration (a measurement window)")
    min_requests = max(r.num_prompts, strictest_n_min(slo, args.confidence)) if duration else 0
    if args.users:
        if command == "sweep":
            raise ValueError("bench sweep varies the request rate; for users run bench serve --users N per count, "
                             "or bench capacity --users")
        _check_users(args, r, duration)
        # A tier's p95s need the sample of one, whatever --slo holds.
        min_requests = max(min_requests, n_min_for("p95", args.confidence))
    else:
        given = [flag for flag, v in (("--think-time", args.think_time), ("--ramp-duration", args.ramp_duration),
                                      ("--think-time-distribution", args.think_time_distribution),
                                      ("--users-min", getattr(args, "users_min", None)),
                                      ("--users-max", getattr(args, "users_max", None))) if v]
        if given:
            raise ValueError(f"{', '.join(given)} shape closed-loop users: they need --users N")
    return ArrivalConfig(process=r.arrival, rate=args.request_rate, burstiness=args.burstiness,
                         time_scale=args.time_scale, seed=args.seed, duration=duration,
                         warmup_duration=args.warmup_duration, drain_timeout=args.drain_timeout,
                         min_requests=min_requests, users=args.users, think_time=args.think_time,
                         think_distribution=args.think_time_distribution or "constant",
                         ramp_duration=args.ramp_duration)


# The defaults of the flags that set (serve) or search (capacity) a request rate.
RATE_DEFAULTS: dict[str, Any] = {"arrival": None, "request_rate": math.inf, "burstiness": 1.0, "time_scale": 1.0,
                                 "rate_start": 1.0, "rate_min": 0.05, "rate_max": 1000.0}


def _check_users(args: argparse.Namespace, r: Resolved, duration: float | None) -> None:
    if duration is None:
        raise ValueError("--users is measured over a window: give --duration S")
    if r.arrival == "trace" or args.max_concurrency:
        raise ValueError("--users is a closed loop: its users set the arrivals and the concurrency "
                         "(no --arrival trace or --max-concurrency)")
    if args.think_time < 0 or (args.ramp_duration is not None and args.ramp_duration < 0):
        raise ValueError("--think-time and --ramp-duration must be >= 0")
    # The users set the load: a flag that sets or searches a rate would be silently ignored.
    rate_flags = ["--" + k.replace("_", "-") for k, v in RATE_DEFAULTS.items() if getattr(args, k, v) != v]
    if rate_flags:
        raise ValueError(f"{', '.join(rate_flags)} set or search a request rate; with --users the users' think "
                         f"times and the server's speed set it (search users with --users-min / --users-max)")
    lo, hi = getattr(args, "users_min", None) or 1, getattr(args, "users_max", None) or 4096
    if not lo <= args.users <= hi:
        raise ValueError(f"--users {args.users} is the first count tried: it must lie within --users-min {lo} "
                         f"and --users-max {hi}")


def _thresholds(args: argparse.Namespace) -> Thresholds:
    """What a sustained point must show, from the flags (sustain.Thresholds' defaults)."""
    return Thresholds(confidence=args.confidence,
                      rate_tolerance=getattr(args, "rate_tolerance", DEFAULT_RATE_TOLERANCE),
                      queue_tolerance=getattr(args, "queue_tolerance", DEFAULT_QUEUE_TOLERANCE),
                      preemption_threshold=getattr(args, "preemption_threshold", DEFAULT_PREEMPTION_THRESHOLD))


def require_aggregate(slo: SLO) -> None:
    """ValueError unless ``slo`` has aggregate targets (an operating limit needs them)."""
    if not slo.aggregate:
        raise ValueError("an operating limit needs aggregate SLOs, e.g. --slo ttft_p95=1s,itl_p95=100ms")


def search_space(args: argparse.Namespace, base: ArrivalConfig) -> SearchSpace:
    """The capacity search over rates, or over 1 / time scale for trace replay; its limit
    held for ``--hold-duration`` (default 5 windows)."""
    hold = args.hold_duration if args.hold_duration is not None else 5 * (base.duration or 0)
    if hold < 0:
        raise ValueError("--hold-duration must be >= 0")
    if hold and base.duration and hold <= base.duration:
        raise ValueError(f"--hold-duration {hold:g} s is not longer than a search window (--duration "
                         f"{base.duration:g} s): a hold would only repeat the search's point (0 turns holds off)")
    common: dict[str, Any] = dict(tolerance=args.tolerance, max_points=args.max_points, repeats=args.repeats,
                                  hold_duration=hold or None, max_holds=args.max_holds,
                                  max_extensions=args.max_extensions)
    if base.users:
        return SearchSpace(False, base.users, args.users_min or 1, args.users_max or 4096, users=True, **common)
    if base.process == "trace":
        return SearchSpace(True, 1 / base.time_scale, 1 / args.time_scale_max, 1 / args.time_scale_min, **common)
    return SearchSpace(False, args.rate_start, args.rate_min, args.rate_max, **common)


def _output(args: argparse.Namespace) -> OutputOptions:
    return OutputOptions(save_result=args.save_result, result_dir=args.result_dir,
                         result_filename=args.result_filename, label=args.label,
                         metadata=tuple(args.metadata or ()),
                         percentile_metrics=tuple(parse_percentile_metrics(args.percentile_metrics)),
                         metric_percentiles=tuple(parse_metric_percentiles(args.metric_percentiles)),
                         vllm_block=bool(args.percentile_metrics or args.metric_percentiles),
                         plot=args.plot, save_csv=getattr(args, "save_csv", None),
                         report=getattr(args, "report", None))


def _server(args: argparse.Namespace, lora: LoraModules) -> ServerOptions:
    return ServerOptions(serve_cmd=args.serve_cmd, lora=lora, values=tuple(getattr(args, "values", None) or ()),
                         start_timeout=args.server_start_timeout, stop_timeout=args.server_stop_timeout,
                         log_dir=args.server_log_dir, on_busy_host=getattr(args, "on_busy_host", "warn"),
                         calibrate=bool(getattr(args, "calibrate", False)))
