"""Scrape a server's Prometheus ``/metrics`` during a run.

Reads the scheduler's view that a client cannot see: requests waiting and running, KV-cache
usage and the preemption counter. Names are inflight's (``inflight:``), with vLLM's and
llama.cpp's equivalents accepted so the tool can measure those servers too.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from inflight.bench.client import HTTP_ERRORS

# First name found wins. KV usage is a fraction in [0, 1] for all of them (vLLM's "perc"
# gauges are fractions despite the name).
SERIES: dict[str, tuple[str, ...]] = {
    "waiting": ("inflight:num_requests_waiting", "vllm:num_requests_waiting", "llamacpp:requests_deferred"),
    "running": ("inflight:num_requests_running", "vllm:num_requests_running", "llamacpp:requests_processing"),
    "kv_cache_usage": ("inflight:kv_cache_usage_perc", "vllm:kv_cache_usage_perc",
                       "vllm:gpu_cache_usage_perc", "llamacpp:kv_cache_usage_ratio"),
    "preemptions": ("inflight:num_preemptions_total", "vllm:num_preemptions_total"),
}


@dataclass
class Snapshot:
    """One scrape: every sample summed over its label sets, plus ``*_info`` labels."""

    values: dict[str, float] = field(default_factory=dict)
    info: dict[str, dict[str, str]] = field(default_factory=dict)

    def get(self, series: str) -> float | None:
        for name in SERIES[series]:
            if name in self.values:
                return self.values[name]
        return None

    def known(self) -> dict[str, float | None]:
        return {k: self.get(k) for k in SERIES}


def parse_metrics(text: str) -> Snapshot:
    """Parse Prometheus text exposition with prometheus_client's parser."""
    snap = Snapshot()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue  # per-bucket counts and creation stamps say nothing summed over labels
            snap.values[s.name] = snap.values.get(s.name, 0.0) + float(s.value)
            if family.type == "info" or s.name.endswith("_info"):
                # Config gauges (vLLM's cache_config_info) carry server knobs as labels.
                snap.info[s.name] = dict(s.labels)
    return snap


def counter_deltas(before: Snapshot | None, after: Snapshot | None) -> dict[str, float]:
    """Growth of every ``*_total`` counter between two scrapes."""
    if before is None or after is None:
        return {}
    return {k: v - before.values.get(k, 0.0) for k, v in after.values.items()
            if k.endswith("_total")}


class Scraper:
    """Polls ``GET {base_url}/metrics``; disables itself after the first failed scrape
    (``why_not`` says why)."""

    def __init__(self, client: aiohttp.ClientSession, base_url: str, headers: dict[str, str] | None = None,
                 timeout: float = 5.0) -> None:
        self._client = client
        self._url = base_url.rstrip("/") + "/metrics"
        self._headers = headers or {}
        self._timeout = timeout
        self.available: bool | None = None  # unknown until the first scrape
        self.why_not: str | None = None  # why the scrape that turned it off failed ("HTTP 501")
        self.samples: list[dict[str, Any]] = []

    async def scrape(self) -> Snapshot | None:
        if self.available is False:
            return None
        try:
            async with self._client.get(self._url, headers=self._headers,
                                        timeout=aiohttp.ClientTimeout(total=self._timeout)) as resp:
                resp.raise_for_status()
                snap = parse_metrics(await resp.text())
        except (*HTTP_ERRORS, ValueError) as e:
            # llama-server answers 501 without --metrics; other servers 404.
            self.available = False
            self.why_not = (f"HTTP {e.status}" if isinstance(e, aiohttp.ClientResponseError)
                            else f"{type(e).__name__}: {e}")
            return None
        self.available = True
        return snap

    async def run(self, stop: asyncio.Event, interval: float, t0: float) -> None:
        """Append ``{"t": s since t0, waiting, running, kv_cache_usage, preemptions}`` until ``stop``."""
        while not stop.is_set():
            snap = await self.scrape()
            if snap is None:
                return
            self.samples.append({"t": time.perf_counter() - t0, **snap.known()})
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except TimeoutError:
                pass


def prefix_hit_rate(counters: dict[str, float]) -> float | None:
    """Prefix-cache hits over queries (tokens) during a run, from the server's counters as
    scraped (``inflight:`` or ``vllm:`` names); None where the server reports neither or
    nothing was queried."""
    def total(name: str) -> float | None:
        vals = [v for k, v in counters.items() if k.rsplit(":", 1)[-1] == name]
        return sum(vals) if vals else None
    queries, hits = total("prefix_cache_queries_total"), total("prefix_cache_hits_total")
    if not queries or hits is None:
        return None
    return hits / queries
