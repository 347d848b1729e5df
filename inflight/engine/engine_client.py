"""``EngineClient``: what the HTTP server asks of the engine(s) behind it.

The routes, the admission middleware, the metrics and the shutdown drain talk to this
protocol only (vLLM's ``EngineClient``, vllm/engine/protocol.py, plays the same part).
Two implementations:

- ``engine.async_engine.AsyncEngine``: one in-process ``Engine`` stepped by a background
  thread;
- ``cluster.ray_engine.ClusterEngine``: N engine replicas on Ray, each request routed to
  one.

Both share admission (``engine.admission.Admission``: the waiting bound, reservations) and
the request rules (``engine.request_rules.RequestRules``: prompt fit, grammars).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from inflight.config import EngineConfig
from inflight.engine.admission import Reservation
from inflight.engine.stats import EngineStats
from inflight.engine.stream import RequestStream
from inflight.errors import EngineError
from inflight.lora.lora_config import LoRAModule
from inflight.outputs import RequestOutput
from inflight.request import RequestOptions
from inflight.sampling_params import SamplingParams
from inflight.structured_output import StructuredOutputsParams

# Called after each step (or batch of replica outputs) as ``listener(stats, outputs, now)``,
# ``now`` on the ``time.monotonic()`` clock; the server's metrics hook in here.
StepListener = Callable[[EngineStats, list[RequestOutput], float], None]


class EngineClient(Protocol):
    """The engine surface the server uses; every method is called on the event loop
    unless it says otherwise.

    Attributes:
        listeners: step listeners (``StepListener``), called off the event loop for an
            in-process engine.
        on_dead: called once with the reason when the engine dies for good; the server
            then exits non-zero.
    """

    listeners: list[StepListener]
    on_dead: list[Callable[[str], None]]

    # --- model and settings (read-only) ---------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        """The engine settings (each replica's, for a cluster)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (``inflight.tokenizer.Tokenizer``): templates, encoding."""
        ...

    @property
    def max_model_len(self) -> int:
        """Longest sequence, prompt plus output tokens."""
        ...

    @property
    def num_kv_blocks(self) -> int:
        """KV pool size in blocks (of one engine)."""
        ...

    @property
    def kv_cache_dtype(self) -> str:
        """The KV pool's element type (``float32``...), or the ``--kv-cache-dtype``
        setting where this process holds no KV tensors."""
        ...

    def check_prompt_fits(self, num_prompt_tokens: int, max_tokens: int | None = None) -> int:
        """The prompt-fit rule: ``max_tokens`` or its default; ``InvalidRequestError``."""
        ...

    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        """Compile a structured-output spec (thread-safe, cached); ``InvalidRequestError``."""
        ...

    # --- state ------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        """Started, not shut down, not dead."""
        ...

    @property
    def is_accepting(self) -> bool:
        """Running and taking new requests (not draining)."""
        ...

    @property
    def num_in_flight(self) -> int:
        """API-level requests queued or running."""
        ...

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission, places reserved or queued included."""
        ...

    def get_stats(self) -> EngineStats:
        """The engine's stats as last known (never blocks); any thread."""
        ...

    # --- admission ----------------------------------------------------------------------------
    def refusal(self, num_seqs: int = 1) -> EngineError | None:
        """The error ``reserve(num_seqs)`` would raise now, else None; takes nothing."""
        ...

    def reserve(self, num_seqs: int) -> Reservation:
        """Hold places for ``num_seqs`` sequences before templating and tokenizing.
        Raises ``EngineDeadError``, ``RequestTooLargeError``, ``EngineOverloadedError``."""
        ...

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    sampling_params: SamplingParams, *, arrival_time: float | None = None,
                    options: RequestOptions | None = None,
                    reservation: Reservation | None = None,
                    final_only: bool = False) -> RequestStream:
        """Queue a request; its ``RequestStream`` at once. ``final_only``: the stream
        delivers only the final output (a non-streamed API call). Raises as
        ``AsyncEngine.add_request``."""
        ...

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when it already finished)."""
        ...

    def abort_all(self) -> None:
        """Abort every request in flight (shutdown's grace ran out)."""
        ...

    async def reset_prefix_cache(self) -> int:
        """Drop idle cached KV blocks; how many. ``EngineDeadError`` when not running."""
        ...

    # --- LoRA adapters (--enable-lora) ---------------------------------------------------------
    def lora_modules(self) -> list[LoRAModule]:
        """The LoRA adapters served now (name, path, base model), in load order; empty
        with LoRA off. Cheap: the routes read it for each request's ``model``."""
        ...

    async def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> int:
        """Load the PEFT adapter at ``path`` as ``name`` (vLLM's ``/v1/load_lora_adapter``);
        its id. Raises ``LoRAError`` (a ``ValueError``: a bad adapter or a taken name),
        ``InvalidRequestError`` (LoRA off, or this client cannot load at runtime),
        ``EngineDeadError``."""
        ...

    async def remove_lora(self, name: str) -> bool:
        """Unload adapter ``name`` (requests in flight on it finish); False: not loaded.
        Raises as ``add_lora``."""
        ...

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start serving (on the event loop the app runs on; idempotent)."""
        ...

    def drain(self) -> None:
        """Refuse new requests, let those in flight run on (shutdown's first phase)."""
        ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop; requests in flight end. Any thread; idempotent."""
        ...
