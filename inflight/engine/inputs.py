"""Prompt input: text or token ids -> validated token ids (vLLM's input processor's part)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inflight.errors import InvalidRequestError


def tokenize_prompt(tokenizer: Any, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of a prompt.

    Args:
        tokenizer: an ``inflight.tokenizer.Tokenizer``, or None (then only ids are taken).
        prompt: text, tokenized here, or token ids, checked against the vocabulary.

    Raises:
        InvalidRequestError (``param="prompt"``): text without a tokenizer, an id that is not
            an int in ``[0, vocab_size)``, or an empty prompt.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("prompt: text needs a tokenizer; pass token ids",
                                      param="prompt")
        text: str | None = prompt
        ids = list(tokenizer.encode(prompt))
    else:
        text, ids = None, list(prompt)
        check_token_ids(ids, getattr(tokenizer, "vocab_size", None))
    if not ids:
        raise InvalidRequestError("prompt: must not be empty", param="prompt")
    return text, ids


def check_token_ids(ids: Sequence[int], vocab_size: int | None, param: str = "prompt") -> None:
    """Raise ``InvalidRequestError`` naming ``param`` unless every id is an int in
    ``[0, vocab_size)`` (any non-negative int when ``vocab_size`` is None)."""
    for t in ids:
        if (not isinstance(t, int) or isinstance(t, bool) or t < 0
                or (vocab_size is not None and t >= vocab_size)):
            bound = f"[0, {vocab_size})" if vocab_size is not None else "(ids are >= 0)"
            raise InvalidRequestError(f"{param}: token id {t!r} is outside the vocabulary "
                                      f"{bound}", param=param)
