"""``inflight bench serve | sweep | capacity | tune``: the argument parser and the entry point.

``add_bench_parser(subparsers)`` adds the ``bench`` command to any argparse subparsers
object; ``run_bench(args)`` runs what was parsed and returns the exit code:
0 done, 1 the run could not measure anything (server unreachable, every request failed,
no load passed the capacity SLO), 2 usage error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from typing import Any, Callable, Coroutine, TypeVar

import aiohttp

from inflight.bench.arrivals import PROCESSES
from inflight.bench.capacity_command import capacity
from inflight.bench.client import event_loop_factory
from inflight.bench.confidence import DEFAULT_CONFIDENCE
from inflight.bench.configure import RATE_DEFAULTS, bench_config
from inflight.bench.connect import Run
from inflight.bench.datasets import BUILDERS, DatasetConfig, default_data_dir
from inflight.bench.simulation import Simulator
from inflight.bench.subcommands import serve, sweep
from inflight.bench.sustain import DEFAULT_PREEMPTION_THRESHOLD, DEFAULT_QUEUE_TOLERANCE, DEFAULT_RATE_TOLERANCE
from inflight.bench.tiers import parse_tiers
from inflight.bench.tune import tune
from inflight.bench.users import THINK_DISTRIBUTIONS
from inflight.bench.vllm_compat import add_vllm_args, endpoint_type

Command = Callable[[Run], Coroutine[Any, Any, int]]
COMMANDS: dict[str, Command] = {"serve": serve, "sweep": sweep, "capacity": capacity, "tune": tune}


# ---------------------------------------------------------------- parsing

def _rate(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError("must be > 0 (or inf)")
    return v


def _count(minimum: int) -> Callable[[str], int]:
    """An int flag of at least ``minimum``: argparse names the flag in its error."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}")
        return v
    return parse


def _command(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give the command that starts the server")
    return text


def _tiers(text: str) -> Any:
    try:
        return parse_tiers(text)
    except ValueError as e:  # argparse says only "invalid value" for a ValueError
        raise argparse.ArgumentTypeError(str(e)) from None


def _floats(text: str) -> list[float]:
    return [_rate(x) for x in text.split(",") if x.strip()]


def _json_obj(text: str) -> dict[str, Any]:
    try:
        v = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


def _common_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    _server_flags(p)
    _dataset_flags(p)
    _arrival_flags(p)
    _output_flags(p)
    add_vllm_args(p)
    _simulation_flags(p)
    return p


def _server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None,
                   help="server root (default http://127.0.0.1:8000, or http://--host:--port)")
    g.add_argument("--model", help="model name to send (default: first of GET /v1/models)")
    g.add_argument("--endpoint-type", "--backend", dest="endpoint_type", type=endpoint_type,
                   metavar="{completions,chat}",
                   help="API to call; vLLM's openai/vllm = completions, openai-chat = chat "
                        "(default: chat for --dataset chat, else completions)")
    g.add_argument("--api-key", default=os.environ.get("INFLIGHT_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token (default: $INFLIGHT_API_KEY or $OPENAI_API_KEY)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    g.add_argument("--extra-body", type=_json_obj, default={}, metavar="JSON",
                   help='extra request fields, e.g. \'{"top_k": 20}\'')
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="per-request limit in seconds; a request over it fails (default %(default)s)")
    g.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="scrape GET /metrics during the run (default on)")
    g.add_argument("--metrics-interval", type=float, default=1.0, metavar="S", help="scrape period (s)")


def _dataset_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=tuple(BUILDERS), default=None, help="default random (or --dataset-name)")
    g.add_argument("--data-dir", default=None,
                   help=f"folder of the data files (default $INFLIGHT_DATA_DIR or {default_data_dir()})")
    g.add_argument("--num-prompts", type=_count(1), default=None,
                   help="requests counted (default 100; 1000 with --dataset-name, as vLLM)")
    g.add_argument("--num-warmups", type=int, default=0, help="uncounted requests sent first")
    g.add_argument("--reset-prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="POST /reset_prefix_cache before each measured point, to start cold "
                        "(default: on for capacity and tune, which re-send prompts at every load)")
    g.add_argument("--seed", type=int, default=0, help="seed of datasets and arrivals")
    g.add_argument("--input-len", "--random-input-len", "--sonnet-input-len", dest="input_len", type=int,
                   default=None, help="random/sonnet prompt tokens (default 256; vLLM's with --dataset-name)")
    g.add_argument("--output-len", "--random-output-len", "--sonnet-output-len", dest="output_len", type=int,
                   default=None, help="random/sonnet/chat max_tokens (default 128; vLLM's with --dataset-name)")
    g.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                   help="random: lengths uniform in len*(1±ratio)")
    g.add_argument("--prefix-len", "--sonnet-prefix-len", dest="prefix_len", type=int,
                   default=None, help="random/sonnet: shared prefix tokens, counted in --input-len (default 0)")
    g.add_argument("--random-prefix-len", type=int, default=None,
                   help="random: shared prefix tokens before --input-len more, as vLLM")
    g.add_argument("--trace-file", help="Azure CSV or Mooncake JSONL (default: the Azure conv slice)")
    g.add_argument("--trace-format", choices=("auto", "azure", "mooncake"), default="auto")
    g.add_argument("--trace-skip", type=int, default=0, help="trace rows skipped first")
    g.add_argument("--length-scale", type=float, default=1.0, help="trace: multiplies prompt and output lengths")
    g.add_argument("--min-input-len", type=int, default=1)
    g.add_argument("--max-input-len", type=int, default=None, help="trace: cap on prompt tokens (after scaling)")
    g.add_argument("--min-output-len", type=int, default=1)
    g.add_argument("--max-output-len", type=int, default=None, help="trace: cap on output tokens (after scaling)")
    g.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=None,
                   help="trace: send the rows in a seeded random order (default: on, except with "
                        "--arrival trace, where the order is the trace's time)")
    g.add_argument("--prefix-blocks", action=argparse.BooleanOptionalAction, default=True,
                   help="Mooncake: requests sharing hash_ids share prompt prefixes (default on)")
    g.add_argument("--chat-file", default="mt_bench", help="mt_bench, vicuna or a JSONL path")
    g.add_argument("--conversation-turns", type=_count(1), default=1,
                   help="chat: user turns per conversation; above 1 a multi-turn replay, each "
                        "follow-up sent with the history and the server's earlier answers, after "
                        "the previous answer ended (default 1)")
    g.add_argument("--active-conversations", type=_count(1), default=None,
                   help="chat, multi-turn: conversations interleaved in the mix; a conversation's "
                        "next turn comes this many requests after its previous one (default "
                        f"{DatasetConfig.active_conversations})")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="send ignore_eos (default: on except for chat)")
    g.add_argument("--tokenize", choices=("auto", "server", "local", "approx"), default="auto",
                   help="how prompt tokens are counted: server /tokenize, --tokenizer, or whitespace words")
    g.add_argument("--tokenizer", metavar="PATH", help="local HF tokenizer dir or .gguf file")


def _arrival_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("arrivals")
    g.add_argument("--arrival", choices=PROCESSES, default=RATE_DEFAULTS["arrival"],
                   help="default poisson; gamma when --burstiness is not 1, as vLLM")
    g.add_argument("--request-rate", type=_rate, default=RATE_DEFAULTS["request_rate"],
                   help="requests/s; inf = all at once")
    g.add_argument("--burstiness", type=float, default=RATE_DEFAULTS["burstiness"],
                   help="gamma shape (1 = Poisson; <1 burstier)")
    g.add_argument("--time-scale", type=float, default=RATE_DEFAULTS["time_scale"],
                   help="trace: multiplies trace times (2 = half the rate)")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--users", type=_count(1), default=None, metavar="N",
                   help="closed loop: N concurrent users, each replaying conversations turn by turn (needs "
                        "--duration; capacity: search the users sustained, starting at N)")
    g.add_argument("--think-time", type=float, default=0.0, metavar="S",
                   help="--users: seconds between an answer's end and the user's next turn (mean)")
    g.add_argument("--think-time-distribution", choices=THINK_DISTRIBUTIONS, default=None,
                   help="--users: how think times are drawn (default constant)")
    g.add_argument("--ramp-duration", "--concurrency-ramp-duration", dest="ramp_duration", type=float,
                   default=None, metavar="S", help="--users: the users start evenly over S s (default: half "
                                                   "the warm-up)")
    g.add_argument("--duration", type=float, default=None, metavar="S",
                   help="measurement window: the requests arriving during S seconds (and at least "
                        "--num-prompts) are the sample, after a warm-up and followed by a cool-down "
                        "(default: 60 for capacity and tune; none for serve and sweep, whose sample "
                        "is the --num-prompts requests)")
    g.add_argument("--warmup-duration", type=float, default=None, metavar="S",
                   help="with --duration: uncounted arrivals before the window (default duration / 6)")
    g.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                   help="with --duration: how long after the window the sample may take to finish, "
                        "under continued arrivals; still unfinished then = censored (default duration / 2)")


def _output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--slo", default=None,
                   help="targets, seconds or 'ms': ttft=,tpot=,itl=,e2e= per request (goodput); "
                        "ttft_p95=, itl_p99=, ... on the run's statistics")
    g.add_argument("--confidence", type=_fraction, default=DEFAULT_CONFIDENCE,
                   help="confidence of the SLO statistics' intervals; a windowed point passes on "
                        "their upper ends (default %(default)s)")
    g.add_argument("--save-result", metavar="FILE.json", nargs="?", const=True, default=None,
                   help="write the result as JSON (alone: vLLM's file name, in --result-dir)")
    g.add_argument("--plot", metavar="FILE.png", help="write a plot")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _simulation_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulation (no server: docs/simulator.md)")
    g.add_argument("--simulate", metavar="PROFILE.json",
                   help="simulate the run on a step-time profile (`inflight profile`) instead of sending "
                        "requests: the real scheduler on a virtual clock; engine settings from --serve-cmd, "
                        "else the profile's")
    g.add_argument("--replicas", type=_count(1), default=1, help="--simulate: engine replicas (default 1)")
    g.add_argument("--router", default="prefix_affinity",
                   help="--simulate with --replicas > 1: round_robin, least_load or prefix_affinity "
                        "(inflight.routing; default %(default)s)")


def _fraction(text: str) -> float:
    v = float(text)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError("must be between 0 and 1")
    return v


def _server_args(p: argparse.ArgumentParser, tune: bool = False) -> None:
    g = p.add_argument_group("server per configuration")
    if tune:
        g.add_argument("--serve-cmd", metavar="COMMAND", required=True, type=_command,
                       help="the base server command, e.g. 'inflight serve --port 8000 --max-num-seqs 32'; "
                            "each --knob value is set on it in turn")
    else:
        g.add_argument("--serve-cmd", metavar="TEMPLATE", type=_command,
                       help="start the server per value: a command with {value}, e.g. "
                            "'inflight serve --port 8000 --max-num-seqs {value}'")
        g.add_argument("--values", type=lambda s: [v.strip() for v in s.split(",") if v.strip()],
                       help="comma-separated values substituted for {value}")
    g.add_argument("--server-start-timeout", type=float, default=600.0, metavar="S")
    g.add_argument("--server-stop-timeout", type=float, default=15.0, metavar="S",
                   help="wait after SIGINT before SIGTERM")
    g.add_argument("--server-log-dir", help="keep each server's output here (default: a temp file)")


def add_bench_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench`` with sub-commands ``serve``, ``sweep``, ``capacity`` and ``tune`` to ``subparsers``."""
    common = _common_parser()
    bench = subparsers.add_parser("bench", help="load-test an OpenAI-compatible server",
                                  description="Load-test any OpenAI-compatible server.")
    bench.set_defaults(bench_command=None, _bench_parser=bench)
    sub = bench.add_subparsers(dest="bench_command", metavar="{serve,sweep,capacity,tune}")

    serve = sub.add_parser("serve", parents=[common], help="one run: latency percentiles, throughput, goodput",
                           description="Send a request mix at one load and report latencies and throughput.")
    serve.add_argument("--serve-cmd", metavar="COMMAND", type=_command,
                       help="start this server for the run and stop it after (with --simulate: the "
                            "`inflight serve ...` command whose engine settings are simulated)")
    serve.add_argument("--server-start-timeout", type=float, default=600.0, metavar="S")
    serve.add_argument("--server-stop-timeout", type=float, default=15.0, metavar="S")
    serve.add_argument("--server-log-dir", help="keep the server's output here (default: a temp file)")

    sweep = sub.add_parser("sweep", parents=[common], help="runs over request rates (and server knob values)",
                           description="One run per request rate (or trace time scale), optionally per "
                                       "server knob value with --serve-cmd.")
    sweep.add_argument("--request-rates", type=_floats, help="comma-separated rates (req/s), e.g. 1,2,4,8")
    sweep.add_argument("--time-scales", type=_floats, help="--arrival trace: comma-separated time scales")
    sweep.add_argument("--save-csv", metavar="FILE.csv", help="write one row per point")
    _server_args(sweep)

    capacity = sub.add_parser("capacity", parents=[common], help="highest sustained load meeting p95 SLOs",
                              description="Bracket and bisect the highest request rate (or smallest trace "
                                          "time scale) the server sustains while the aggregate SLOs hold "
                                          "with confidence and nothing fails.")
    _search_args(capacity)
    capacity.add_argument("--report", metavar="DIR", help="write a report page (Markdown + PNGs) here")
    _server_args(capacity)

    tuning = sub.add_parser("tune", parents=[common], help="one knob at a time: the operating limit per value",
                            description="Vary one server knob at a time around a base command, find the "
                                        "operating limit of each value, keep the best, move to the next "
                                        "knob; report the recommended configuration. Resumable.")
    tuning.add_argument("--knob", action="append", required=True, metavar="NAME=V1,V2,...",
                        help="a flag of the served command and its values, e.g. max-num-seqs=8,16,32, or "
                             "parallel=8,16,32 for llama-server (repeat for more knobs, tuned in the order "
                             "given; on/off for a boolean flag). It replaces the flag where the command has it, "
                             "in any spelling: parallel and np both set llama-server's --parallel / -np "
                             "(llama-server's and vLLM's short forms are known: np, c, b, ub, t, ngl, fa, "
                             "ctk, ctv, cb, tp, pp, dp, ...); another short flag: --knob=-x=1,2")
    tuning.add_argument("--report", metavar="DIR", default="tune-report",
                        help="report page, plots and the resumable state (default %(default)s)")
    tuning.add_argument("--fresh", action="store_true", help="ignore saved points in --report and start over")
    _search_args(tuning)
    _server_args(tuning, tune=True)


def _search_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("search")
    g.add_argument("--rate-start", type=_rate, default=RATE_DEFAULTS["rate_start"], help="first rate tried (req/s)")
    g.add_argument("--rate-min", type=_rate, default=RATE_DEFAULTS["rate_min"])
    g.add_argument("--rate-max", type=_rate, default=RATE_DEFAULTS["rate_max"])
    g.add_argument("--time-scale-min", type=_rate, default=0.001, help="--arrival trace: smallest time scale")
    g.add_argument("--time-scale-max", type=_rate, default=1000.0, help="--arrival trace: largest time scale")
    g.add_argument("--users-min", type=_count(1), default=None, help="--users: fewest users tried (default 1)")
    g.add_argument("--users-max", type=_count(1), default=None, help="--users: most users tried (default 4096)")
    g.add_argument("--slo-tiers", type=_tiers, default=None, metavar="TOK_S:TTFT,...",
                   help="--users: the users sustained per tier, each a per-user output speed floor and a TTFT "
                        "ceiling (tpot_p95 <= 1/speed, ttft_p95 <= TTFT), e.g. 10:2s,30:1s")
    g.add_argument("--tolerance", type=_rate, default=0.1, help="stop when hi/lo <= 1 + tolerance")
    g.add_argument("--max-points", type=_count(1), default=12, help="points per search")
    g.add_argument("--repeats", type=_count(1), default=1, help="searches (seeds seed, seed+1, ...)")
    g.add_argument("--hold-duration", type=float, default=None, metavar="S",
                   help="hold each search's limit for a window of S s before reporting it; if it fails, "
                        "step down by 1 + tolerance and hold again (default 5 x --duration; 0: no hold)")
    g.add_argument("--max-holds", type=_count(0), default=3, help="holds per search, at most (default %(default)s)")
    g.add_argument("--max-extensions", type=_count(0), default=2,
                   help="a search point whose evidence is inconclusive (a p95 interval straddling its target, "
                        "queue growth or throughput within noise of its tolerance) is extended by one "
                        "--duration at a time, arrivals going on, at most this many times (default "
                        "%(default)s; 0: one look, an inconclusive point fails)")
    g.add_argument("--calibrate", action="store_true",
                   help="predict, then verify: ramp the server to saturation with its --step-log on, fit a "
                        "profile to its steps, simulate the search, start the real one at the prediction and "
                        "verify around it (needs --serve-cmd 'inflight serve ...'; a fit that is poor or "
                        "measured on a busy host is not used, and says so)")
    g.add_argument("--on-busy-host", choices=("warn", "stop"), default="warn",
                   help="other processes busy on this machine before the run (probed for 3 s): warn at once "
                        "(default) or stop")
    g = p.add_argument_group("sustained load")
    g.add_argument("--preemption-threshold", type=float, default=DEFAULT_PREEMPTION_THRESHOLD,
                   help="fail a point above this many preemptions per completed request")
    g.add_argument("--rate-tolerance", type=_fraction, default=DEFAULT_RATE_TOLERANCE,
                   help="completed / offered rate over the window, at least (default %(default)s)")
    g.add_argument("--queue-tolerance", type=float, default=DEFAULT_QUEUE_TOLERANCE,
                   help="in-flight growth over the window's second half / its arrivals, at most "
                        "(default %(default)s)")


def run_bench(args: argparse.Namespace, simulator: Simulator | None = None) -> int:
    """Run the parsed ``bench`` sub-command; returns the process exit code. ``simulator``:
    what runs ``--simulate`` and ``--calibrate`` (the top-level command line plugs in
    ``inflight.sim``'s; without one, those flags are a usage error).

    SIGTERM cancels the run like Ctrl-C does, so servers it started are stopped (143).
    """
    command = getattr(args, "bench_command", None)
    if command not in COMMANDS:
        parser = getattr(args, "_bench_parser", None)
        if parser is not None:
            parser.print_help(sys.stderr)
        return 2
    try:
        run = Run(bench_config(args), simulator)
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(_cancellable(COMMANDS[command](run)))
    except ValueError as e:
        print(f"inflight bench {command}: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, aiohttp.ClientError) as e:
        folder = str(getattr(args, "data_dir", None) or default_data_dir())
        hint = (f"; data files are read from {folder} (--data-dir, or $INFLIGHT_DATA_DIR)"
                if isinstance(e, FileNotFoundError) and str(e.filename or "").startswith(folder) else "")
        print(f"inflight bench {command}: error: {e}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except asyncio.CancelledError:
        print(f"inflight bench {command}: terminated; servers it started are stopped", file=sys.stderr)
        return 143


T = TypeVar("T")


async def _cancellable(coro: Coroutine[Any, Any, T]) -> T:
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
        pass
    try:
        return await task
    finally:
        try:
            loop.remove_signal_handler(signal.SIGTERM)
        except (NotImplementedError, RuntimeError):
            pass
