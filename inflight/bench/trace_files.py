"""Request traces on file: the Azure LLM inference trace and Mooncake's.

- Azure: a CSV of ``TIMESTAMP,ContextTokens,GeneratedTokens`` (timestamps to 100 ns, UTC).
- Mooncake (FAST'25): JSONL of ``timestamp`` (ms), ``input_length``, ``output_length`` and
  ``hash_ids`` (the prompt's prefix blocks: requests sharing ids share prefix text).

Rows keep the trace's lengths and arrival times; ``datasets`` makes requests of them.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import pathlib
from dataclasses import dataclass


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
