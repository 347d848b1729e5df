"""The discrete-event simulator: the real engine on a virtual clock (``simulator``,
``virtual_replica``), step-time profiles (``step_shape``, ``profile``) measured
(``measure``, ``fitted_cost``) or derived by roofline (``roofline``), and the bench glue
(``bench``: ``inflight bench ... --simulate``). See docs/simulator.md."""
