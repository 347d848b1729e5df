"""The discrete-event simulator: the real engine on a virtual clock (``cluster``), step-time
profiles measured (``measure``, ``profile``) or derived by roofline (``roofline``), and the
bench glue (``bench``: ``inflight bench ... --simulate``). See docs/simulator.md."""
