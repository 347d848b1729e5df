"""inflight: an LLM inference server built around continuous batching over a paged KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from inflight.config import EngineConfig
from inflight.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inflight.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inflight.entrypoints.llm import LLM

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "RequestMetrics"]
__version__ = "0.1.0"


def __getattr__(name: str) -> type[LLM]:
    # LLM pulls in torch; import it lazily so `import inflight` stays light for the bench
    # client and the torch-free core.
    if name == "LLM":
        from inflight.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
