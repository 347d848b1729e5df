"""Speculative decoding's Prometheus counters and ``GET /stats`` object (vLLM's
``SpecDecodingProm``, ``vllm/v1/spec_decode/metrics.py``), named ``inflight:spec_decode_*``.

Registered only when the server speculates (``--speculative-config``), as vLLM registers
them only with a speculative config, so a dashboard tells "off" (absent) from "no drafts
yet" (zeros). The counters (exposed with ``_total``):

- ``inflight:spec_decode_num_drafts``: verifications (one request's drafts checked in a step).
- ``inflight:spec_decode_num_draft_tokens``: draft tokens verified.
- ``inflight:spec_decode_num_accepted_tokens``: of those, accepted.
- ``inflight:spec_decode_num_accepted_tokens_per_pos{position="0".."k-1"}``: accepted at
  each position of their verification (position i only when 0..i-1 were too).

PromQL as vLLM documents it: acceptance rate = ``rate(accepted) / rate(draft_tokens)``,
mean acceptance length = ``1 + rate(accepted) / rate(drafts)``, per-position acceptance =
``rate(accepted_per_pos) / rate(drafts)``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter

from inflight.engine.stats import EngineStats


class SpecDecodeSeries:
    """The four counters of one server, fed from ``EngineStats`` deltas.

    Args:
        registry: the app's registry.
        labels: the label values every series of the app carries (``model_name``).
        num_speculative_tokens: k; one ``position`` series per draft position 0..k-1.
    """

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str],
                 num_speculative_tokens: int) -> None:
        names = list(labels)

        def counter(name: str, doc: str) -> Any:
            c = Counter(name, doc, names, registry=registry)
            return c.labels(**labels) if labels else c

        self.num_drafts = counter("inflight:spec_decode_num_drafts",
                                  "Speculative decoding verifications (a request's drafts "
                                  "checked in one step).")
        self.num_draft_tokens = counter("inflight:spec_decode_num_draft_tokens",
                                        "Draft tokens verified.")
        self.num_accepted_tokens = counter("inflight:spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted.")
        per_pos = Counter("inflight:spec_decode_num_accepted_tokens_per_pos",
                          "Draft tokens accepted, by position in their verification.",
                          [*names, "position"], registry=registry)
        # One series per position from the start (vLLM's): zeros until a draft is accepted.
        self.per_pos = [per_pos.labels(**labels, position=str(i))
                        for i in range(num_speculative_tokens)]

    @classmethod
    def when_on(cls, registry: CollectorRegistry, labels: dict[str, str],
                num_speculative_tokens: int | None) -> "SpecDecodeSeries | None":
        """The series when the server speculates (k given); None when it does not."""
        if num_speculative_tokens is None:
            return None
        return cls(registry, labels, num_speculative_tokens)

    def on_step(self, stats: EngineStats, last: EngineStats) -> None:
        """Add what the counters in ``stats`` gained since ``last``."""
        for counter, now, before in (
                (self.num_drafts, stats.spec_decode_num_drafts, last.spec_decode_num_drafts),
                (self.num_draft_tokens, stats.spec_decode_num_draft_tokens,
                 last.spec_decode_num_draft_tokens),
                (self.num_accepted_tokens, stats.spec_decode_num_accepted_tokens,
                 last.spec_decode_num_accepted_tokens)):
            if now > before:
                counter.inc(now - before)
        now_pos = stats.spec_decode_num_accepted_tokens_per_pos
        before_pos = last.spec_decode_num_accepted_tokens_per_pos
        for i, counter in enumerate(self.per_pos[:len(now_pos)]):
            gained = now_pos[i] - (before_pos[i] if i < len(before_pos) else 0)
            if gained > 0:
                counter.inc(gained)
