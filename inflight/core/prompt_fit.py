"""The one prompt-fit rule: can a prompt (and the tokens it asks for) ever run on an engine
with these limits? The scheduler applies it to every request it queues; a cluster ingress,
which holds no KV pool, applies the same rule with its replicas' limits."""

from __future__ import annotations

from dataclasses import dataclass

from inflight.core.scheduler_config import SchedulerConfig
from inflight.errors import InvalidRequestError


@dataclass(frozen=True)
class PromptFit:
    """An engine's limits on one request's length, in tokens.

    Attributes:
        max_model_len: longest sequence (prompt + output) the engine serves.
        max_sequence_len: longest sequence its KV pool can hold (<= ``max_model_len``).
        max_num_batched_tokens: the step's token budget.
        enable_chunked_prefill: off: a prompt must fit in one step's budget.
    """

    max_model_len: int
    max_sequence_len: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool

    @classmethod
    def for_pool(cls, config: SchedulerConfig, pool_tokens: int,
                 max_model_len: int | None = None) -> "PromptFit":
        """The limits of an engine with ``config`` and a KV pool of ``pool_tokens`` tokens;
        ``max_model_len``: the model's context when ``config`` sets none (else the pool's)."""
        mml = config.max_model_len or max_model_len or pool_tokens
        return cls(mml, min(mml, pool_tokens), config.max_num_batched_tokens,
                   config.enable_chunked_prefill)

    def check(self, num_prompt_tokens: int, max_tokens: int | None = None) -> int:
        """Raise unless a prompt of ``num_prompt_tokens`` (plus ``max_tokens``, when given:
        vLLM's server rule) can ever run here.

        Returns:
            ``max_tokens``, or ``max_model_len - num_prompt_tokens`` when it is None.

        Raises:
            InvalidRequestError: with ``param`` ``prompt`` (no room to generate within
                ``max_model_len``, or for ``max_tokens`` 0 longer than it; larger than the
                KV pool, or past the step budget with
                chunked prefill off) or ``max_tokens`` (prompt + ``max_tokens`` past
                ``max_model_len``); ``code`` ``context_length_exceeded``.
        """
        n, mml = num_prompt_tokens, self.max_model_len
        # A prefill-only request (max_tokens 0: scoring, embeddings) needs no room for a
        # token: a prompt of exactly max_model_len fits, as in vLLM.
        extra = 0 if max_tokens == 0 else 1
        if n + extra > mml:
            room = "" if extra == 0 else ", which leaves no room to generate"
            raise _refuse(f"This model's maximum context length (max_model_len) is {mml} "
                          f"tokens. However, your prompt has {n} tokens{room}. Please reduce "
                          f"the length of the input.")
        if n + extra > self.max_sequence_len:
            raise _refuse(f"The prompt ({n} tokens) does not fit in the KV cache "
                          f"({self.max_sequence_len} tokens).")
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            raise _refuse(f"The prompt ({n} tokens) exceeds max_num_batched_tokens "
                          f"({self.max_num_batched_tokens}) with chunked prefill off.")
        if max_tokens is None:
            return mml - n
        if n + max_tokens > mml:
            raise _refuse(f"This model's maximum context length is {mml} tokens. However, you "
                          f"requested {n + max_tokens} tokens ({n} in the input, {max_tokens} "
                          f"in the completion). Please reduce the length of the input or "
                          f"completion.", param="max_tokens")
        return max_tokens


def _refuse(message: str, param: str = "prompt") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="context_length_exceeded")
