"""What a request must satisfy before it is queued, checked where the request arrives.

``Engine`` checks every request with its ``RequestRules``; a ``ClusterEngine`` ingress,
which holds no model, builds the same rules from the replicas' KV pool and context length
(``RequestRules.for_pool``), so a request a replica would refuse gets its 400 at the
ingress, from the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inflight.config import EngineConfig
from inflight.core.prompt_fit import PromptFit
from inflight.errors import InvalidRequestError
from inflight.structured_output import GrammarCompiler, StructuredOutputsParams

PromptFitCheck = Callable[[int, "int | None"], int]


class RequestRules:
    """The prompt-fit rule and the structured-output grammar compiler of one engine.

    Args:
        prompt_fits: ``PromptFit.check`` with the limits of the engine the requests go to.
        tokenizer: the engine's tokenizer; None: no grammar can be compiled.
    """

    def __init__(self, prompt_fits: PromptFitCheck, tokenizer: Any) -> None:
        self._prompt_fits = prompt_fits
        self.grammar_compiler = GrammarCompiler(tokenizer) if tokenizer is not None else None

    @classmethod
    def for_pool(cls, config: EngineConfig, tokenizer: Any, *, num_blocks: int,
                 max_model_len: int) -> "RequestRules":
        """The rules of an engine with ``config``, a KV pool of ``num_blocks`` and
        ``max_model_len``, without its model (a cluster ingress)."""
        fit = PromptFit.for_pool(config, num_blocks * config.block_size, max_model_len)
        return cls(fit.check, tokenizer)

    def check_prompt_fits(self, num_prompt_tokens: int, max_tokens: int | None = None) -> int:
        """The engine's one prompt-fit rule (``PromptFit.check``): returns
        ``max_tokens`` or its default; raises ``InvalidRequestError`` naming the field.
        Reads only settings, so any thread may call it."""
        return self._prompt_fits(num_prompt_tokens, max_tokens)

    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar for ``params`` (cached; thread-safe, so the server compiles
        on a worker thread first and the engine thread then finds it in the cache).

        Raises:
            InvalidRequestError: the spec does not compile, or there is no tokenizer.
        """
        if self.grammar_compiler is None:
            raise InvalidRequestError("structured_outputs: needs the model's tokenizer")
        try:
            return self.grammar_compiler.compile(params)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
