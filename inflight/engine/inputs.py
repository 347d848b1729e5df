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
        vocab = getattr(tokenizer, "vocab_size", None)
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab and t >= vocab):
                raise InvalidRequestError(f"prompt: token id {t!r} is not in the vocabulary",
                                          param="prompt")
    if not ids:
        raise InvalidRequestError("prompt: must not be empty", param="prompt")
    return text, ids
