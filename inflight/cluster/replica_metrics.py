"""``/metrics`` and ``/stats`` of a data-parallel server: every replica's series with a
``replica`` label, the router's counters, and latency percentiles across replicas.

Each replica keeps the one-engine ``ServerMetrics`` (same names, same rules for aborted
requests, docs/server.md); the ingress asks them for their metric families when scraped
and adds ``replica="<index>"`` to every sample, so a dashboard sums or splits them. A
replica that is down (restarting) is absent from that scrape; its counters restart from
zero when it comes back (a Prometheus counter reset). The ingress adds:

- ``inflight:router_requests_total{replica}``: requests routed to each replica.
- ``inflight:router_prefix_hits_total``, ``inflight:router_prefix_overrides_total``:
  ``prefix_affinity`` requests sent to a replica holding most of their prefix, and those
  whose prefix replica was passed over for load (absent under other routers).
- ``inflight:replica_up{replica}`` (1 while routed to), ``inflight:replica_restarts_total``,
  ``inflight:replica_lost_requests_total`` (requests failed because their replica died).

``GET /stats`` is the one-engine JSON computed by the app's own ``ServerMetrics``, which
the ``ClusterEngine`` feeds every replica's outputs (so its p50/p95/p99 are over all
requests of all replicas, with gauges and counters summed), plus ``data_parallel_size``,
``router`` and ``replicas`` (each replica's own ``/stats`` and its state).

Served by an ASGI middleware ahead of the app's routes (``ClusterMetricsMiddleware``), so
the one-engine app is unchanged and the scrape awaits the replicas without blocking the
event loop.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.responses import JSONResponse, Response

from inflight.cluster.ray_engine import ClusterEngine

_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def merge_families(per_replica: list[list[Any] | None]) -> list[Metric]:
    """One family per metric name, holding every replica's samples with a ``replica``
    label added (replica i is ``per_replica[i]``; None: down, left out)."""
    merged: dict[str, Metric] = {}
    for i, families in enumerate(per_replica):
        for fam in families or ():
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                out.samples.append(s._replace(labels={**s.labels, "replica": str(i)}))
    return list(merged.values())


def router_families(cluster: ClusterEngine) -> list[Metric]:
    """The ingress's own series: routing counts and replica states."""
    lab = ["model_name", "replica"]
    name = cluster.model_name
    routed = CounterMetricFamily("inflight:router_requests", "Requests routed to each replica.",
                                 labels=lab)
    up = GaugeMetricFamily("inflight:replica_up", "1 while the replica is routed to.", labels=lab)
    restarts = CounterMetricFamily("inflight:replica_restarts",
                                   "Times the replica died and Ray brought it back.", labels=lab)
    lost = CounterMetricFamily("inflight:replica_lost_requests",
                               "Requests failed because their replica died.", labels=lab)
    for r in cluster.replicas:
        values = [name, str(r.index)]
        routed.add_metric(values, r.routed)
        up.add_metric(values, 1.0 if r.up else 0.0)
        restarts.add_metric(values, r.restarts)
        lost.add_metric(values, r.lost)
    out: list[Metric] = [routed, up, restarts, lost]
    if hasattr(cluster.router, "hits"):
        for attr, doc in (("hits", "Requests sent to a replica holding more than half of their prefix blocks."),
                          ("overrides", "Requests whose prefix replica was passed over for load.")):
            fam = CounterMetricFamily(f"inflight:router_prefix_{attr}", doc, labels=["model_name"])
            fam.add_metric([name], getattr(cluster.router, attr))
            out.append(fam)
    return out


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


async def render(cluster: ClusterEngine) -> bytes:
    """The Prometheus text exposition of all replicas and the router."""
    families = merge_families(await cluster.gather("families")) + router_families(cluster)
    return generate_latest(_Families(families))


# /stats keys summed over the live replicas' own answers. The token totals are not among
# them: the ingress counts those itself, and they survive a replica's restart.
_SUMMED = ("num_requests_running", "num_requests_waiting", "num_preemptions_total", "num_steps",
           "prefix_cache_queries_total", "prefix_cache_hits_total", "num_recomputed_tokens_total")


async def stats(cluster: ClusterEngine, server_metrics: Any) -> dict[str, Any]:
    """``GET /stats``: the cluster-wide one-engine dict plus router and replicas. Latency
    windows and token totals are the ingress's (every replica's requests); gauges and the
    engine counters are the live replicas' summed (KV usage: their mean), as they answer
    now."""
    out: dict[str, Any] = server_metrics.stats()
    per_replica = await cluster.gather("stats")
    fresh = [s for s in per_replica if s is not None]
    if fresh:  # the replicas' gauges now, rather than as of their last outputs
        for key in _SUMMED:
            out[key] = sum(s[key] for s in fresh)
        out["num_requests_waiting"] += cluster.num_pending
        out["kv_cache_usage_perc"] = sum(s["kv_cache_usage_perc"] for s in fresh) / len(fresh)
    out["data_parallel_size"] = len(cluster.replicas)
    router: dict[str, Any] = {"policy": cluster.router_name}
    for attr in ("hits", "overrides"):
        if hasattr(cluster.router, attr):
            router[attr] = getattr(cluster.router, attr)
    out["router"] = router
    out["replicas"] = [{"replica": r.index, "up": r.up, "pid": r.pid, "restarts": r.restarts,
                        "requests_routed": r.routed, "requests_lost": r.lost, "stats": s}
                       for r, s in zip(cluster.replicas, per_replica)]
    return out


class ClusterMetricsMiddleware:
    """Answers ``GET``/``HEAD /metrics`` and ``GET /stats`` for a ``ClusterEngine`` app;
    passes everything else to the app.

    Args:
        app: the ASGI app (Starlette passes it).
        cluster: the engine the app serves.
        server_metrics: the app's ``ServerMetrics`` (``app.state.ctx.metrics``).
    """

    def __init__(self, app: Any, cluster: ClusterEngine, server_metrics: Any) -> None:
        self.app = app
        self.cluster = cluster
        self.server_metrics = server_metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path, method = scope["path"], scope["method"]
            response: Response | None = None
            if path == "/metrics" and method in ("GET", "HEAD"):
                response = Response(await render(self.cluster), media_type=_CONTENT_TYPE)
            elif path == "/stats" and method == "GET":
                response = JSONResponse(await stats(self.cluster, self.server_metrics))
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install(app: Any, cluster: ClusterEngine) -> None:
    """Put ``ClusterMetricsMiddleware`` in front of ``app`` (before it starts)."""
    app.add_middleware(ClusterMetricsMiddleware, cluster=cluster,
                       server_metrics=app.state.ctx.metrics)
