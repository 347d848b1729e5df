"""Incremental detokenization with stop strings, for streaming one request's output.

Follows vLLM's ``detokenize_incrementally`` / HF TGI's ``decode_token``: keep a small window of
ids ``[prefix_offset, read_offset)`` whose text was already emitted, decode that window with
and without the new ids, and emit the difference once it no longer ends in U+FFFD (an incomplete
UTF-8 character). Decoding the window rather than a single id keeps tokenizer context (leading
spaces of sentencepiece pieces, multi-token characters) and costs O(window) per token instead of
re-decoding the whole output.
"""

from __future__ import annotations

from collections.abc import Sequence

from inflight.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens kept as decoding context.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Per request. Turns output token ids into text deltas and watches for stop strings.

    ``add_tokens`` decodes new ids into ``output_text`` (only complete characters) and reports
    a stop string as soon as it appears, even when split across tokens; ``get_delta`` hands out
    the text not returned before, holding back what a stop string could still cut off.
    After a stop string matched, further ``add_tokens`` calls are ignored.

    Attributes: ``output_text`` (str, text so far, truncated at a matched stop string),
    ``matched_stop`` (the stop string that ended the text, or ``None``),
    ``num_output_tokens`` (ids accepted so far).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        if isinstance(stop, str):  # a bare string would otherwise be read as one stop per char
            stop = (stop,)
        self.stop: tuple[str, ...] = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.include_stop_str_in_output = include_stop_str_in_output

        context = [int(i) for i in prompt_token_ids[len(prompt_token_ids) - _PROMPT_CONTEXT:]]
        self._ids: list[int] = context  # window ids only; older ids are dropped
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # cached decode of [prefix_offset, read_offset)

        self.output_text = ""
        self.matched_stop: str | None = None
        self.num_output_tokens = 0
        self._sent = 0  # chars of output_text already returned by get_delta

    # ---------------------------------------------------------------------------- decoding
    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _step(self, token_id: int) -> str:
        """Append one id; return the newly completed text ('' while it is held back)."""
        self._ids.append(int(token_id))
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(self._prefix_text) or full.endswith(_REPLACEMENT):
            return ""  # incomplete character, or a skipped special token: wait for more ids
        new_text = full[len(self._prefix_text):]
        # Slide the window: what was read becomes the context for the next ids.
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = None
        return new_text

    # ------------------------------------------------------------------------ stop strings
    def _append(self, new_text: str) -> str | None:
        if not new_text:
            return None
        old_len = len(self.output_text)
        self.output_text += new_text
        best: tuple[int, str] | None = None
        for s in self.stop:
            # A match must end inside the new text, so it starts at most len(s)-1 chars earlier.
            idx = self.output_text.find(s, max(0, old_len - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        end = idx + len(s) if self.include_stop_str_in_output else idx
        self.output_text = self.output_text[:end]
        self.matched_stop = s
        return s

    def _held_back(self) -> int:
        # Longest suffix of output_text that is a proper prefix of some stop string.
        text, held = self.output_text, 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held

    # ----------------------------------------------------------------------------- public
    def add_tokens(self, token_ids: Sequence[int], check_stop: bool = True) -> str | None:
        """Append new output ids and update ``output_text``.

        Returns the stop string now present in the output (``output_text`` is then cut just
        before it, or just after it with ``include_stop_str_in_output``), else ``None``. When
        several stop strings appear, the one starting earliest wins. Once a stop matched, later
        calls change nothing and return that stop string again. With ``check_stop=False``
        (while the output has at most ``min_tokens`` tokens, vLLM v1's rule) the text grows
        and no stop string is looked for; a later check finds only matches that end in text
        added then, though they may start in text added before.
        """
        if self.matched_stop is not None:
            return self.matched_stop
        new_text = "".join(self._step(token_id) for token_id in token_ids)
        self.num_output_tokens += len(token_ids)
        if not check_stop:
            self.output_text += new_text
            return None
        return self._append(new_text)

    def get_delta(self, finished: bool = False) -> str:
        """Text not returned by an earlier call.

        While not ``finished``, holds back an incomplete UTF-8 character and the trailing chars
        that could still begin a stop string, so no returned text is ever cut off later. With
        ``finished=True`` returns everything left in ``output_text``. Ids that never completed
        a character (a completion cut by ``max_tokens`` mid-emoji) are dropped, never sent as
        U+FFFD, so streamed and non-streamed text agree.
        """
        if finished or self.matched_stop is not None:
            end = len(self.output_text)
        else:
            end = max(self._sent, len(self.output_text) - self._held_back())
        delta = self.output_text[self._sent:end]
        self._sent = end
        return delta
