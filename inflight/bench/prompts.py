"""Prompt text of an exact token count.

Trace replay needs prompts whose length, *as the server counts it*, equals the trace's
prompt length. Three ways to count, tried in this order by ``make_counter(mode="auto")``:

1. ``server``: the server's ``POST /tokenize`` (vLLM's shape: body ``{"model", "prompt"}``,
   answer ``{"tokens": [...], "count": n}``; or llama.cpp's llama-server's, body
   ``{"content", "add_special": true}``, answer ``{"tokens": [...]}``, tried when vLLM's
   is refused or counts nothing). Counts include the special tokens the server adds to a
   completion prompt (BOS), so they match ``usage.prompt_tokens``.
2. ``local``: a Hugging Face tokenizer from ``--tokenizer PATH`` (a directory, or a ``.gguf``
   file whose tokenizer transformers reads with ``gguf_file=``).
3. ``approx-words``: whitespace-separated words. Not exact; results say so.

A server without a usable ``/tokenize`` is no error in ``auto`` mode: ``make_counter``
falls back to 2, then 3, and says why in ``skipped`` (``"tokenize: HTTP 404"``).

``fit_prompt`` then finds, with a handful of counts, the longest run of source words whose
text is at most the target and pads with one-token filler words to hit it exactly.
"""

from __future__ import annotations

import asyncio
import pathlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import aiohttp

from inflight.bench.client import HTTP_ERRORS, post_json

# Words that are a single token in every BPE/SentencePiece vocabulary we know of when
# preceded by a space, so appending one moves the count by exactly one.
_FILLERS = ("a", "the", "and", "of", "to", "I", "in", "it")


class TokenCounter(Protocol):
    """Counts the tokens of a prompt text the way the server will see it."""

    mode: str  # "server", "local" or "approx-words"
    exact: bool  # False when counts only approximate the server's tokenizer

    async def count(self, text: str) -> int: ...


class WordCounter:
    """Approximation used when no tokenizer is reachable: one token per whitespace word."""

    mode = "approx-words"
    exact = False

    async def count(self, text: str) -> int:
        return len(text.split())


class LocalCounter:
    """A Hugging Face tokenizer loaded from disk; counts include added special tokens."""

    mode = "local"
    exact = True

    def __init__(self, tokenizer: Any, source: str) -> None:  # a transformers tokenizer
        self._tokenizer = tokenizer
        self.source = source

    async def count(self, text: str) -> int:
        return len(self._tokenizer(text, add_special_tokens=True)["input_ids"])


class TokenizeError(RuntimeError):
    """``/tokenize`` answered, but not with a count (``status``: its HTTP status)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ServerCounter:
    """The server's own tokenizer through ``POST /tokenize``: ``shape`` "vllm" (body
    ``{"model", "prompt"}``, inflight's and vLLM's) or "llama.cpp" (``{"content",
    "add_special": true}``, llama-server's: its completions add BOS, and so must the count)."""

    mode = "server"
    exact = True

    def __init__(self, client: aiohttp.ClientSession, base_url: str, model: str | None,
                 headers: dict[str, str] | None = None, max_parallel: int = 8, shape: str = "vllm") -> None:
        self._client = client
        self._url = base_url.rstrip("/") + "/tokenize"
        self._model = model
        self._headers = headers or {}
        self.shape = shape
        # Tokenizing runs before the timed run but still shares the server; keep it polite.
        self._sem = asyncio.Semaphore(max_parallel)

    def _body(self, text: str) -> dict[str, Any]:
        if self.shape == "llama.cpp":
            return {"content": text, "add_special": True}
        body: dict[str, Any] = {"prompt": text}
        if self._model:
            body["model"] = self._model
        return body

    async def count(self, text: str) -> int:
        """The tokens of ``text`` as the server counts them.

        Raises:
            TokenizeError: an answer that is not 200 or carries no count.
            aiohttp.ClientError, TimeoutError: no answer.
        """
        async with self._sem:
            status, data = await post_json(self._client, self._url, self._body(text), self._headers)
        if status != 200:
            raise TokenizeError(f"HTTP {status}", status)
        if isinstance(data, dict):
            count = data.get("count")
            if isinstance(count, int):
                return count
            if isinstance(data.get("tokens"), list):
                return len(data["tokens"])
        raise TokenizeError(f"answered {str(data)[:80]!r}, not a count", status)


def load_local_tokenizer(path: str | pathlib.Path) -> LocalCounter:
    """Load a tokenizer from a HF directory (or hub-style name) or from a ``.gguf`` file."""
    from transformers import AutoTokenizer  # heavy import: only when asked for

    p = pathlib.Path(path)
    if p.suffix == ".gguf":
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    else:
        tok = AutoTokenizer.from_pretrained(str(p))
    return LocalCounter(tok, str(p))


# Statuses of a server without the route (or the method) at all.
MISSING_ROUTE = (404, 405, 501)


async def find_server_counter(client: aiohttp.ClientSession, base_url: str, model: str | None,
                              headers: dict[str, str] | None = None) -> tuple[ServerCounter | None, str]:
    """A ServerCounter for the first body shape ``/tokenize`` counts with ("vllm", then
    "llama.cpp"), or None and why not (``"HTTP 404"``, ``"ClientConnectorError: ..."``,
    what it answered instead of a count)."""
    why = ""
    for shape in ("vllm", "llama.cpp"):
        counter = ServerCounter(client, base_url, model, headers, shape=shape)
        try:
            n = await counter.count("hello world")
        except TokenizeError as e:
            why = why or str(e)
            if e.status in MISSING_ROUTE:
                break  # the route itself is missing: no other body will do
            continue
        except HTTP_ERRORS as e:
            return None, f"{type(e).__name__}: {e}"
        if n > 0:
            return counter, ""
        why = why or "counted 0 tokens"  # llama-server's answer to vLLM's body: {"tokens": []}
    return None, why


async def probe_server_counter(client: aiohttp.ClientSession, base_url: str, model: str | None,
                               headers: dict[str, str] | None = None) -> ServerCounter | None:
    """A ServerCounter if ``/tokenize`` answers sensibly, else None (404, error, odd shape)."""
    return (await find_server_counter(client, base_url, model, headers))[0]


async def make_counter(mode: str, client: aiohttp.ClientSession, base_url: str, model: str | None,
                       tokenizer_path: str | None, headers: dict[str, str] | None = None,
                       skipped: list[str] | None = None) -> TokenCounter:
    """Pick the counter for ``mode`` in {"auto", "server", "local", "approx"}.

    ``auto`` prefers the server (it is the ground truth), then ``--tokenizer``, then words;
    where the server cannot count, ``"tokenize: WHY"`` is appended to ``skipped``.
    An explicit mode that cannot be satisfied raises ``RuntimeError``.
    """
    if mode in ("auto", "server"):
        counter, why = await find_server_counter(client, base_url, model, headers)
        if counter is not None:
            return counter
        if mode == "server":
            raise RuntimeError(f"{base_url}/tokenize is not available ({why})")
        if skipped is not None:
            skipped.append(f"tokenize: {why}")
    if mode in ("auto", "local") and tokenizer_path:
        return load_local_tokenizer(tokenizer_path)
    if mode == "local":
        raise RuntimeError("--tokenize local needs --tokenizer PATH")
    return WordCounter()


@dataclass(frozen=True)
class FittedPrompt:
    text: str
    num_tokens: int  # as counted by the counter
    exact: bool  # num_tokens == target and the counter is exact


def _join(prefix: str, words: Sequence[str], k: int) -> str:
    body = " ".join(words[:k])
    if not prefix or not body:
        return prefix + body
    return prefix + ("" if prefix[-1].isspace() else " ") + body


async def fit_prompt(counter: TokenCounter, words: Sequence[str], target: int,
                     prefix: str = "", max_counts: int = 40) -> FittedPrompt:
    """Text = ``prefix`` + the first k ``words`` (+ fillers) with exactly ``target`` tokens.

    Searches k by interpolation inside a bracket (token count grows about linearly with
    words, so a few counts suffice), then appends one-token filler words for the last few
    tokens a multi-token word would overshoot. At most ``max_counts`` calls to the counter.
    ``words`` should hold at least ``target`` words: every space-separated word costs at
    least one token, so k never exceeds ``target``.
    """
    calls = 0
    cache: dict[int, int] = {}

    async def c(k: int) -> int:
        nonlocal calls
        if k not in cache:
            calls += 1
            cache[k] = await counter.count(_join(prefix, words, k))
        return cache[k]

    def done(text: str, n: int) -> FittedPrompt:
        return FittedPrompt(text, n, n == target and counter.exact)

    c0 = await c(0)
    if c0 >= target or not words:
        return done(_join(prefix, words, 0), c0)
    lo, hi = 0, min(len(words), max(1, target - c0))
    while await c(hi) < target and hi < len(words) and calls < max_counts:
        lo, hi = hi, min(len(words), hi * 2)
    if await c(hi) <= target:
        # Too few words to reach the target (or exact at hi): take them all.
        k = hi
    else:
        # Invariant: c(lo) < target < c(hi) or c(lo) <= target; find the largest k with c(k) <= target.
        while hi - lo > 1 and calls < max_counts:
            c_lo, c_hi = await c(lo), await c(hi)
            guess = lo + round((target - c_lo) * (hi - lo) / max(1, c_hi - c_lo))
            mid = min(hi - 1, max(lo + 1, guess))
            if await c(mid) <= target:
                lo = mid
            else:
                hi = mid
        k = lo
    text, n = _join(prefix, words, k), await c(k)
    return await _pad(counter, text, n, target, max_counts - calls, done)


async def _pad(counter: TokenCounter, text: str, n: int, target: int, budget: int,
               done: Callable[[str, int], FittedPrompt]) -> FittedPrompt:
    best_text, best_n = text, n
    m = target - n
    tries = 0
    while m > 0 and best_n != target and tries < max(1, budget):
        tries += 1
        candidate = text + "".join(" " + _FILLERS[i % len(_FILLERS)] for i in range(m))
        cn = await counter.count(candidate)
        if abs(cn - target) < abs(best_n - target) or (cn == target):
            best_text, best_n = candidate, cn
        if cn == target:
            break
        m += target - cn
    return done(best_text, best_n)
