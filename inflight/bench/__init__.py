"""``inflight bench``: a load tool for any OpenAI-compatible server (inflight, vLLM, llama.cpp).

It is a client only and imports nothing from the engine. Modules: ``datasets`` (request
mixes), ``prompts`` (prompt text of an exact token count), ``arrivals`` (send schedules),
``schedule`` (a point's phases: warm-up, window, cool-down), ``client`` (streaming
requests, chunk timings), ``stats`` (latency percentiles, goodput), ``confidence``
(intervals of SLO statistics), ``sustain`` (is a load sustained: the verdict and its
evidence), ``metrics_scrape`` (server ``/metrics``), ``runner`` (one point), ``capacity``
(search and hold), ``limit`` (one configuration's operating limit), ``tune`` (one knob at a
time), ``server_proc`` (a server per configuration), ``report`` (table, JSON/CSV, plots),
``report_page`` (the operating-limit report), ``machine`` (what it ran on), ``commands``
(serve, sweep, capacity), ``cli`` (``add_bench_parser``, ``run_bench``).
See docs/bench.md and docs/capacity.md.
"""
