"""Routing requests across engine replicas: which replica serves a request. Torch-free.

Policies (``make_router``):

- ``round_robin``: replicas in turn.
- ``least_load``: the replica with the fewest waiting + running sequences, then the lowest
  KV usage, then the lowest index (deterministic, so a simulation repeats).
- ``prefix_affinity``: the replica most likely to hold the prompt's prefix in its prefix
  cache, if it holds more than ``match_threshold`` of the prompt's blocks and its load
  exceeds the least-loaded replica's by at most ``threshold`` sequences; otherwise least
  load. Prefixes are the chained hashes of the prompt's full KV blocks
  (``core.kv_cache.hash_block``, exactly what an engine's cache reuses); the router
  remembers, per replica, the block hashes it sent there and, where the caller reports
  finished requests (``observe``), those of their answers, which the engine caches too
  (bounded, oldest forgotten first). SGLang's cache-aware router keeps an approximate
  tree per worker and routes by it only above a match rate (its ``cache_threshold``,
  0.5); Ray Serve LLM's ``PrefixCacheAffinityRouter`` falls back to load past an
  imbalance threshold.

A replica's load is what it last reported (:class:`ReplicaLoad`), as a router sees it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from inflight.core.kv_cache import hash_block

ROUTERS = ("round_robin", "least_load", "prefix_affinity")


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's reported state. Counts in sequences; ``kv_cache_usage`` in [0, 1]."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting


class Router(Protocol):
    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        """The index of the replica (into ``loads``) to send the request to."""
        ...


class RoundRobinRouter:
    def __init__(self) -> None:
        self._next = 0

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        i = self._next % len(loads)
        self._next = i + 1
        return i


def least_loaded(loads: Sequence[ReplicaLoad]) -> int:
    return min(range(len(loads)), key=lambda i: (loads[i].num_requests, loads[i].kv_cache_usage, i))


class LeastLoadRouter:
    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        return least_loaded(loads)


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[bytes]:
    """Chained hashes of the full ``block_size``-token blocks of ``token_ids`` (the prefix
    cache's keys), the first ``max_blocks`` of them."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    hashes: list[bytes] = []
    for b in range(n):
        hashes.append(hash_block(hashes[-1] if hashes else b"", list(token_ids[b * block_size:(b + 1) * block_size])))
    return hashes


class PrefixAffinityRouter:
    """Args:
        block_size: the engines' KV block size (tokens).
        threshold: sequences of extra load the prefix's replica may carry over the least
            loaded one before load wins.
        max_blocks: prompt blocks hashed per request (the prefix that matters).
        capacity: block hashes remembered per replica.
        match_threshold: the fraction of the prompt's hashed blocks a replica must hold
            (strictly more than) to be chosen for its prefix. Below it the saving is small
            against the imbalance: a short prompt whose only known prefix is a system
            prompt every request starts with would otherwise follow that prompt to one
            replica (measured: 63 of 64 multi-turn chat requests, docs/scale_out.md).

    Attributes:
        hits, overrides: requests sent to a replica holding more than ``match_threshold``
            of their prefix; requests whose prefix replica was passed over for load.
    """

    def __init__(self, block_size: int, threshold: int = 8, max_blocks: int = 64,
                 capacity: int = 100_000, match_threshold: float = 0.5) -> None:
        self.block_size, self.threshold = block_size, threshold
        self.max_blocks, self.capacity = max_blocks, capacity
        self.match_threshold = match_threshold
        self._seen: list[OrderedDict[bytes, None]] = []
        self.hits = self.overrides = 0

    def _matched(self, replica: int, hashes: list[bytes]) -> int:
        seen = self._seen[replica]
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def forget(self, replica: int) -> None:
        """Drop what was sent to ``replica``: it restarted, its prefix cache is empty."""
        if replica < len(self._seen):
            self._seen[replica].clear()

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        while len(self._seen) < len(loads):
            self._seen.append(OrderedDict())
        hashes = prefix_block_hashes(prompt_token_ids, self.block_size, self.max_blocks)
        lightest = least_loaded(loads)
        matched = [self._matched(i, hashes) for i in range(len(loads))]
        best = max(range(len(loads)), key=lambda i: (matched[i], -loads[i].num_requests, -i))
        choice = lightest
        if matched[best] > self.match_threshold * len(hashes):
            if loads[best].num_requests - loads[lightest].num_requests <= self.threshold:
                choice = best
                self.hits += 1
            else:
                self.overrides += 1
        else:
            # A prefix no replica holds: among the least loaded, the one whose cache holds
            # least, so new prefixes spread over the pools (idle replicas tie, and the
            # lowest index would otherwise take every new prefix and thrash its pool).
            tie = (loads[lightest].num_requests, loads[lightest].kv_cache_usage)
            choice = min((i for i in range(len(loads))
                          if (loads[i].num_requests, loads[i].kv_cache_usage) == tie),
                         key=lambda i: (len(self._seen[i]), i))
        self._remember(choice, hashes)
        return choice

    def observe(self, replica: int, token_ids: Sequence[int]) -> None:
        """A request finished on ``replica`` with ``token_ids`` (prompt + generated ids)
        in its KV: the engine caches the answer's full blocks too, and a chat's next turn
        starts with them."""
        if replica < len(self._seen):
            self._remember(replica, prefix_block_hashes(token_ids, self.block_size, self.max_blocks))

    def _remember(self, replica: int, hashes: list[bytes]) -> None:
        seen = self._seen[replica]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)


def make_router(name: str, block_size: int = 16, threshold: int = 8) -> Router:
    """A router by policy name (``ROUTERS``). ValueError for an unknown name."""
    if name == "round_robin":
        return RoundRobinRouter()
    if name == "least_load":
        return LeastLoadRouter()
    if name == "prefix_affinity":
        return PrefixAffinityRouter(block_size, threshold)
    raise ValueError(f"router: unknown policy {name!r} (choose from {', '.join(ROUTERS)})")
