"""The OpenAI-compatible HTTP server (``inflight serve``): the app factory in ``app``,
routes in ``routes``, request models in ``protocol``, responses in ``serving``, Prometheus
metrics in ``metrics``, flags in ``serve_args``, the process in ``lifecycle``."""
