"""``inflight bench``: a load tool for any OpenAI-compatible server (inflight, vLLM, llama.cpp).

It is a client only and imports nothing from the engine, nor the simulator: ``--simulate``
and ``--calibrate`` run on a ``simulation.Simulator`` that the top-level command line
plugs in. The run: ``arguments`` (the parser and ``run_bench``) -> ``configure`` (the flags,
once, into ``run_config``'s frozen settings; ``vllm_compat``: vLLM's spellings) -> the
sub-commands (``subcommands``: serve, sweep; ``capacity_command``; ``tune`` with
``knob_flags``) -> ``connect`` (servers started per configuration, sessions) -> ``session``
(a run's fixed part, ``run_point`` on its ``PointTarget``: ``http_target`` with
``server_routes``, or a simulator) and ``limit`` (one configuration's operating limit).
Measuring: ``datasets``, ``prompts``, ``arrivals``, ``schedule``, ``client``, ``looks``,
``metrics_scrape``, ``summary``, ``confidence``, ``sustain``; reporting: ``report``,
``report_page``, ``vllm_result``, ``machine``. See docs/bench.md and docs/capacity.md.
"""
