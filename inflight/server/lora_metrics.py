"""``inflight:lora_requests_info``: vLLM's ``vllm:lora_requests_info`` gauge
(``vllm/v1/metrics/loggers.py``), which adapters the running and the waiting requests use.

One series, computed at scrape time from the engine's last stats
(``EngineStats.running_lora_adapters`` / ``waiting_lora_adapters`` / ``max_lora``), labels
``running_lora_adapters`` and ``waiting_lora_adapters`` (the adapter names, sorted,
comma-joined; empty for none) and ``max_lora`` (``--max-loras``), plus this server's
``model_name`` as every series here has. Its value is the scrape's Unix time in seconds,
as vLLM sets it, so a dashboard takes the series of the newest value. Registered only with
LoRA on (``lora_routes.install_lora``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily

from inflight.server.metrics import EngineState

_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")


class LoRAInfoCollector:
    """A Prometheus collector of the one ``inflight:lora_requests_info`` series.

    Args:
        engine_state: the engine client (``get_stats()``, read at each scrape).
        model_name: the ``model_name`` label; None leaves it off.
    """

    def __init__(self, engine_state: EngineState, model_name: str | None) -> None:
        self._engine_state = engine_state
        self._model = {} if model_name is None else {"model_name": model_name}

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "inflight:lora_requests_info",
            "LoRA adapters of the running and waiting requests, and --max-loras (vLLM's "
            "lora_requests_info); the value is the scrape's Unix time.",
            labels=[*_LABELS, *self._model])

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Registration asks for the names here rather than through a first collect().
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._engine_state.get_stats()
        fam = self._family()
        fam.add_metric([",".join(s.running_lora_adapters), ",".join(s.waiting_lora_adapters),
                        str(s.max_lora), *self._model.values()], time.time())
        yield fam
