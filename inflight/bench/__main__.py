"""``python -m inflight.bench [bench] serve|sweep|capacity ...``: the bench CLI on its own."""

from __future__ import annotations

import argparse
import sys

from inflight.bench.arguments import add_bench_parser, run_bench


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m inflight.bench")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    # Accept both `python -m inflight.bench serve ...` and `... bench serve ...`.
    if not argv or argv[0] != "bench":
        argv = ["bench", *argv]
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
