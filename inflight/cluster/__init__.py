"""Data-parallel serving on Ray: N engine replicas behind the one FastAPI app.

``inflight serve --data-parallel-size N`` (N > 1) runs each engine in a Ray actor
(``replica.ReplicaServer``: an ``Engine`` and its ``AsyncEngine`` loop, its own metrics)
and keeps the HTTP server in the ingress process, where ``ray_engine.ClusterEngine`` is the
``EngineClient`` the routes talk to: it admits, routes each request with
``inflight.routing`` on the replicas' reported loads, streams outputs back, and fails a
dead replica's requests at once. ``serve.RayReplicas`` builds it for ``server.lifecycle.run_serve``;
``runtime.RayRuntime`` starts or joins Ray. docs/scale_out.md says why Ray core actors
rather than Ray Serve.

Importing this package (and ``options``) does not import Ray: a one-engine server never
loads it. ``replica``, ``ray_engine``, ``runtime`` and ``serve`` need the ``cluster`` extra
(``pip install 'inflight-serve[cluster]'``).
"""
