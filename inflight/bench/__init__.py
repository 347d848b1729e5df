"""``inflight bench``: a load tool for any OpenAI-compatible server (inflight, vLLM, llama.cpp).

It is a client only and imports nothing from the engine. Modules: ``datasets`` (request
mixes), ``prompts`` (prompt text of an exact token count), ``arrivals`` (send schedules),
``client`` (streaming requests, chunk timings), ``stats`` (latency percentiles, goodput),
``metrics_scrape`` (server ``/metrics``), ``runner`` (one run), ``capacity`` (SLO limit
search), ``server_proc`` (a server per knob value), ``report`` (table, JSON/CSV, plots),
``commands`` (serve, sweep, capacity), ``cli`` (``add_bench_parser``, ``run_bench``).
See docs/bench.md.
"""
