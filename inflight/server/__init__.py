"""The OpenAI-compatible HTTP server (``inflight serve``): routes in ``app``, request
models in ``protocol``, responses in ``serving``, Prometheus metrics in ``metrics``."""
