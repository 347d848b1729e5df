"""``inflight serve`` flags of data-parallel serving. Ray-free: the one-engine server
parses them without loading Ray."""

from __future__ import annotations

import argparse

from inflight.routing import ROUTERS

DEFAULT_ROUTER = "prefix_affinity"
# Sequences of extra load the prefix's replica may carry over the least-loaded one.
DEFAULT_AFFINITY_THRESHOLD = 8


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--data-parallel-size``, ``--ray-address``, ``--router`` and
    ``--router-threshold`` to the ``serve`` parser."""
    g = parser.add_argument_group("data parallel (Ray)")
    g.add_argument("--data-parallel-size", "-dp", type=_positive, default=1,
                   help="engine replicas behind this endpoint, each a Ray actor (vLLM's flag); "
                        "1 (default): one engine in this process, Ray is not imported")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. 'auto' or 'HOST:6379'); default: start a "
                        "local one on 127.0.0.1 for the life of the server, no dashboard")
    g.add_argument("--router", choices=ROUTERS, default=DEFAULT_ROUTER,
                   help="how requests are spread over replicas (default %(default)s: the "
                        "replica holding the prompt's prefix blocks, unless its load exceeds "
                        "the least loaded one's by --router-threshold sequences)")
    g.add_argument("--router-threshold", type=int, default=DEFAULT_AFFINITY_THRESHOLD,
                   help="prefix_affinity: sequences of imbalance tolerated for a prefix hit "
                        "(default %(default)s)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
