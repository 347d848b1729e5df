"""Request traces on file: the Azure LLM inference trace and Mooncake's.

- Azure: a CSV of ``TIMESTAMP,ContextTokens,GeneratedTokens`` (timestamps to 100 ns, UTC).
- Mooncake (FAST'25): JSONL of ``timestamp`` (ms), ``input_length``, ``output_length`` and
  ``hash_ids`` (the prompt's prefix blocks: requests sharing ids share prefix text). Its
  conversations are not labelled; ``trace_sessions`` recovers them from the blocks.

Rows keep the trace's lengths and arrival times; ``datasets`` makes requests of them.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import pathlib
from dataclasses import dataclass
from typing import Any, Sequence

BLOCK_TOKENS = 512  # Mooncake's hash block size, tokens (FAST25-release/README.md)


@dataclass
class TraceRow:
    """One request of a trace: when it came and its lengths (tokens, unscaled)."""

    time: float  # seconds since the first row of the file
    input_len: int
    output_len: int
    hash_ids: list[int] | None = None


def _parse_azure_time(s: str) -> int:
    """Azure ``TIMESTAMP`` as integer 100 ns ticks since the epoch (UTC, no timezone given).

    Seven fractional digits do not fit datetime's microseconds, and a float of seconds
    since 1970 keeps only about 0.2 us: integers keep inter-arrival times exact.
    """
    whole, _, frac = s.strip().partition(".")
    base = dt.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.timezone.utc)
    return int(base.timestamp()) * 10_000_000 + int((frac + "0000000")[:7])


def load_trace(path: str | pathlib.Path, fmt: str = "auto") -> list[TraceRow]:
    """Rows of an Azure CSV or Mooncake JSONL trace; ``time`` relative to the first row (s)."""
    path = pathlib.Path(path)
    if fmt == "auto":
        with path.open() as f:
            first = f.readline().lstrip()
        fmt = "mooncake" if first.startswith("{") else "azure"
    rows: list[TraceRow] = []
    if fmt == "azure":
        with path.open(newline="") as f:
            raw = [(_parse_azure_time(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
                   for r in csv.DictReader(f)]
        t0 = raw[0][0] if raw else 0
        rows = [TraceRow((t - t0) / 1e7, i, o) for t, i, o in raw]
    elif fmt == "mooncake":
        with path.open() as f:
            for line in f:
                if line.strip():
                    o = json.loads(line)
                    rows.append(TraceRow(o["timestamp"], int(o["input_length"]),
                                         int(o["output_length"]), list(o.get("hash_ids") or [])))
        start = rows[0].time if rows else 0.0
        for r in rows:
            r.time = (r.time - start) / 1000.0
    else:
        raise ValueError(f"unknown trace format {fmt!r} (azure, mooncake)")
    return rows


def scale_length(n: int, scale: float, lo: int, hi: int | None) -> int:
    """``round(n * scale)`` clipped to ``[lo, hi]`` (tokens)."""
    v = max(lo, int(round(n * scale)))
    return min(v, hi) if hi is not None else v


def trace_sessions(rows: Sequence[TraceRow], block_tokens: int = BLOCK_TOKENS) -> list[list[int]]:
    """The trace's conversations: lists of row indices, each in turn order, in the order of
    their first turns; every row is in exactly one (a row without ``hash_ids`` is its own).

    A row continues an earlier one when its prompt starts with all of that row's complete
    blocks (``input_len // block_tokens`` of its ``hash_ids``: the last, partial block
    changes once the prompt grows past it), and those blocks reach beyond the prefix every
    row shares (Mooncake's first block is one system prompt for all). The deepest such row
    that has no continuation yet is the previous turn; later rows reaching the same turn
    start conversations of their own (a regenerated answer forks, it does not continue).
    """
    common = _common_prefix([r.hash_ids for r in rows if r.hash_ids])
    trie: dict[Any, Any] = {}  # block id -> node; a node's None key: the row ending there, open for a next turn
    session_of: list[int] = []
    sessions: list[list[int]] = []
    for i, row in enumerate(rows):
        h = row.hash_ids or []
        node, prev = trie, None
        for depth, block in enumerate(h, 1):
            if block not in node:
                break
            node = node[block]
            if depth > common and node.get(None) is not None:
                prev = (node, node[None])
        if prev is None:
            session_of.append(len(sessions))
            sessions.append([i])
        else:
            prev[0][None] = None  # continued once: a second continuation is a fork
            session_of.append(session_of[prev[1]])
            sessions[session_of[prev[1]]].append(i)
        node = trie
        for block in h[:row.input_len // block_tokens]:
            node = node.setdefault(block, {})
        if node is not trie:
            node[None] = i
    return sessions


def _common_prefix(ids: list[list[int]]) -> int:
    """How many leading blocks every list shares."""
    if not ids:
        return 0
    n = min(len(h) for h in ids)
    first = ids[0]
    for k in range(n):
        if any(h[k] != first[k] for h in ids):
            return k
    return n
