"""Log-probabilities in OpenAI's two shapes, with each token's text and exact bytes.

Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``;
chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``
(https://platform.openai.com/docs/api-reference/chat/object#chat/object-choices).
The engine gives per token ``{token_id: logprob}``: the sampled token plus the top-k.
"""

from __future__ import annotations

import re
from typing import Any

from inflight.outputs import CompletionOutput

def _gpt2_byte_decoder() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable-char map (byte-level BPE vocabularies spell
    # every token with these chars); inverted to recover a token's exact bytes.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _gpt2_byte_decoder()
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenTexts:
    """Per-token text and bytes for logprobs, cached (the tokenizer is thread-safe)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        decoder = getattr(getattr(tokenizer, "backend", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        t = self._texts.get(token_id)
        if t is None:
            t = self._texts[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return t

    def bytes(self, token_id: int) -> list[int]:
        """The token's UTF-8 bytes; exact even for a piece of a multi-byte character."""
        piece = self._tok.convert_ids_to_tokens([token_id])[0] or ""
        if self._byte_level and piece and all(ch in _BYTE_DECODER for ch in piece):
            return [_BYTE_DECODER[ch] for ch in piece]
        m = _BYTE_FALLBACK.match(piece)
        if m:
            return [int(m.group(1), 16)]
        return list(self.text(token_id).encode("utf-8"))


def completion_logprobs(tt: TokenTexts, c: CompletionOutput, text_offset: int) -> dict[str, Any]:
    """Legacy completions ``logprobs`` object for the tokens of ``c``."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp in zip(c.token_ids, c.logprobs or []):
        text = tt.text(tid)
        tokens.append(text)
        token_lps.append(lp.get(tid))
        tops.append({tt.text(k): v for k, v in lp.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


# vLLM's clamp of a -inf logprob: JSON has no infinity.
_MIN_LOGPROB = -9999.0


def echo_logprobs(tt: TokenTexts, prompt_ids: list[int],
                  prompt_lps: list[dict[int, tuple[float, int]] | None] | None) -> dict[str, Any]:
    """The legacy ``logprobs`` object of an echoed prompt (``echo`` with ``logprobs``):
    the first token's logprob and alternatives are null, as OpenAI and vLLM send them.
    ``completion_logprobs`` of the generated tokens continues it at ``text_offset``
    ``sum(len(t) for t in tokens)``."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for pos, tid in enumerate(prompt_ids):
        text = tt.text(tid)
        entry = prompt_lps[pos] if prompt_lps is not None and pos < len(prompt_lps) else None
        tokens.append(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(max(entry[tid][0], _MIN_LOGPROB))
            tops.append({tt.text(k): max(v[0], _MIN_LOGPROB) for k, v in entry.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def prompt_logprobs(tt: TokenTexts,
                    lps: list[dict[int, tuple[float, int]] | None] | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token_id:
    {"logprob", "rank", "decoded_token"}}`` of the token and the top-k."""
    if lps is None:
        return None
    return [None if e is None else {
        str(t): {"logprob": max(lp, _MIN_LOGPROB), "rank": rank, "decoded_token": tt.text(t)}
        for t, (lp, rank) in e.items()} for e in lps]


def chat_logprobs(tt: TokenTexts, c: CompletionOutput, top_k: int) -> dict[str, Any]:
    """Chat ``logprobs`` object: per token its logprob, bytes and ``top_k`` alternatives."""
    content = []
    for tid, lp in zip(c.token_ids, c.logprobs or []):
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_k]
        content.append({
            "token": tt.text(tid), "logprob": lp.get(tid), "bytes": tt.bytes(tid),
            "top_logprobs": [{"token": tt.text(k), "logprob": v, "bytes": tt.bytes(k)}
                             for k, v in top]})
    return {"content": content}
