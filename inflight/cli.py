"""``inflight serve | generate | bench | profile``: the command line.

Engine flags are spelled as vLLM's (``--max-num-seqs``, ``--max-num-batched-tokens``,
``--block-size``, ...); see ``EngineConfig.add_cli_args``.

How OpenMP's threads wait is left to libgomp (or the user's ``GOMP_SPINCOUNT`` /
``OMP_WAIT_POLICY``): a busy neighbour is met by the model's thread team, which gives up
the cores other processes hold (``model/thread_team.py``; docs/performance.md, "Threads").
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from inflight.bench.simulation import Simulator

def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from inflight.config import EngineConfig

    p = sub.add_parser("generate", help="generate from prompts offline (no server)")
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt; repeat the flag for several (they are batched together)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap each prompt as a user message through the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)
    EngineConfig.add_cli_args(p)


def _run_generate(args: argparse.Namespace) -> int:
    from inflight.config import EngineConfig
    from inflight.entrypoints.llm import LLM
    from inflight.sampling_params import SamplingParams

    config = EngineConfig.from_cli_args(args)
    llm = LLM(**vars(config))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params,
                           use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, out in zip(args.prompt, outputs):
        c = out.outputs[0]
        print(f"### prompt: {prompt}\n{c.text}\n"
              f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    try:
        from inflight.cluster.options import add_cluster_args
        from inflight.server.serve_args import add_serve_parser
        add_cluster_args(add_serve_parser(sub))
    except ImportError:
        pass
    try:
        from inflight.bench.arguments import add_bench_parser
        add_bench_parser(sub)
    except ImportError:
        pass
    from inflight.sim.measure import add_profile_parser
    add_profile_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve" and args.data_parallel_size > 1:
            from inflight.cluster.serve import RayReplicas  # imports Ray
            from inflight.server.lifecycle import run_serve
            try:
                status = run_serve(args, RayReplicas(args))
            except RuntimeError as e:  # Ray missing, a replica that did not start
                print(f"inflight: error: {e}", file=sys.stderr)
                status = 2
            _exit_at_once(status)
        if args.command == "serve":
            from inflight.server.lifecycle import run_serve
            _exit_at_once(run_serve(args))
        if args.command == "bench":
            from inflight.bench.arguments import run_bench
            return run_bench(args, _bench_simulator(args))
        if args.command == "profile":
            from inflight.sim.measure import run_profile
            return run_profile(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"inflight: error: {e}", file=sys.stderr)
        return 2
    return 1


def _bench_simulator(args: argparse.Namespace) -> Simulator | None:
    """The simulator ``inflight bench`` runs ``--simulate`` and ``--calibrate`` on (bench
    imports none), reading ``--serve-cmd`` with ``inflight serve``'s own parser; None for
    a measuring run, which then loads no simulator."""
    if not (getattr(args, "simulate", None) or getattr(args, "calibrate", False)):
        return None
    from inflight.sim.bench_simulator import BenchSimulator
    return BenchSimulator(_serve_parser().parse_args)


def _serve_parser() -> argparse.ArgumentParser:
    """``inflight serve``'s parser alone: server flags, cluster flags and every engine flag."""
    from inflight.cluster.options import add_cluster_args
    from inflight.server.serve_args import add_serve_parser

    sub = argparse.ArgumentParser(prog="inflight").add_subparsers(dest="command")
    p = add_serve_parser(sub)
    add_cluster_args(p)
    return p


def _exit_at_once(status: int) -> NoReturn:
    """End the process now, skipping the interpreter's teardown: a server that shut down
    cleanly has joined its engine thread and closed its sockets and files, and torch's
    teardown took 1-3 s more on 2 busy cores, past ``--shutdown-timeout + 1`` s."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
