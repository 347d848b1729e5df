"""The data-parallel parts that need neither Ray nor the model: flags, the one-engine path
staying Ray-free, metric relabelling, the router forgetting a restarted replica."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from inflight.cli import build_parser
from inflight.cluster.replica_metrics import merge_families
from inflight.cluster.runtime import import_ray
from inflight.routing import PrefixAffinityRouter, ReplicaLoad


def test_serve_flags():
    args = build_parser().parse_args(["serve"])
    assert (args.data_parallel_size, args.router, args.ray_address) == (1, "prefix_affinity", None)
    args = build_parser().parse_args(["serve", "--data-parallel-size", "2", "--router",
                                      "least_load", "--ray-address", "auto"])
    assert (args.data_parallel_size, args.router, args.ray_address) == (2, "least_load", "auto")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--data-parallel-size", "0"])


def test_one_engine_server_does_not_import_ray():
    code = ("import sys; from inflight.cli import build_parser; import inflight.server.app; "
            "build_parser().parse_args(['serve']); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_missing_ray_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(RuntimeError, match=r"pip install 'inflight-serve\[cluster\]'"):
        import_ray()


def _families(tokens: int) -> list:
    r = CollectorRegistry()
    Counter("inflight:generation_tokens", "doc", ["model_name"], registry=r).labels("m").inc(tokens)
    Histogram("inflight:ttft_seconds", "doc", ["model_name"], buckets=(1.0,),
              registry=r).labels("m").observe(0.5)
    return list(r.collect())


def test_merge_families_adds_the_replica_label():
    merged = {f.name: f for f in merge_families([_families(3), None, _families(5)])}
    assert set(merged) == {"inflight:generation_tokens", "inflight:ttft_seconds"}
    tokens = [(s.labels, s.value) for s in merged["inflight:generation_tokens"].samples
              if s.name.endswith("_total")]
    assert tokens == [({"model_name": "m", "replica": "0"}, 3.0),
                      ({"model_name": "m", "replica": "2"}, 5.0)]
    buckets = [s for s in merged["inflight:ttft_seconds"].samples if s.name.endswith("_bucket")]
    assert {s.labels["replica"] for s in buckets} == {"0", "2"}
    assert all("le" in s.labels for s in buckets)


def test_prefix_router_forgets_a_restarted_replica():
    router = PrefixAffinityRouter(block_size=4, threshold=8)
    loads = [ReplicaLoad(), ReplicaLoad()]
    prompt = list(range(12))
    assert router.route(prompt, loads) == 0
    assert router.route(prompt, [ReplicaLoad(0, 1), ReplicaLoad()]) == 0  # affinity
    router.forget(0)
    assert router.route(prompt, [ReplicaLoad(0, 1), ReplicaLoad()]) == 1  # least load now


def test_prefix_router_spreads_new_prefixes_over_idle_replicas():
    router = PrefixAffinityRouter(block_size=4, threshold=8)
    idle = [ReplicaLoad(), ReplicaLoad()]
    a, b = list(range(12)), list(range(100, 112))
    assert router.route(a, idle) == 0
    assert router.route(b, idle) == 1  # not the lowest index again: the emptier cache
    assert router.route(a, idle) == 0 and router.route(b, idle) == 1  # affinity
    assert router.hits == 2
