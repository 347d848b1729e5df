"""A request's outputs on the event loop: ``RequestStream`` and ``merge_outputs``.

The engine thread ``put``s each delta (or the error that ends the request) through
``loop.call_soon_threadsafe``; deltas that arrive before the reader took the previous one
are merged into it, so a slow reader gets one chunk instead of a backlog (vLLM v1's output
processor merges the same way) and an unread stream's buffer stays bounded.

A ``final_only`` stream (a non-streamed API call: nobody reads its tokens one by one) holds
its deltas on the producer's side and wakes the event loop once, with the final output:
vLLM's ``RequestOutputKind.FINAL_ONLY``. Deltas are still made every step, because the
metrics listener counts tokens and inter-token gaps from them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from inflight.outputs import CompletionOutput, RequestOutput


class RequestStream:
    """The outputs of one request, as an async iterator of deltas.

    Each item is a ``RequestOutput`` whose completions hold only what is new (text, token
    ids, logprobs) since the previous item; deltas that arrived while nobody read are
    merged as they arrive, so an unread stream holds at most one pending output (and the
    error that ends it), never a backlog that grows with every step: a client that stops
    reading costs its own text, not memory per token, and never slows the engine, whose
    ``put`` does not block. The last item has ``finished=True`` (``error`` set if the engine
    failed the request), then iteration stops. ``abort()`` cancels the request; iterating
    on then yields its final ``finish_reason="abort"`` output.

    Raises (from iteration) ``EngineError``:
        InvalidRequestError: the engine refused the request (a prompt it cannot hold).
        RequestFailedError: the engine loop failed while running it.
        EngineDeadError: the engine loop stopped.
    """

    def __init__(self, request_id: str, abort: Callable[[str], None],
                 loop: asyncio.AbstractEventLoop, *, final_only: bool = False) -> None:
        self.request_id = request_id
        self._abort = abort
        self._loop = loop
        self.final_only = final_only
        self._held: list[RequestOutput] = []  # final_only: deltas not yet handed over
        self._pending: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Deliver an output or the error that ends the stream; called by one producer
        thread (the engine's, or the event loop itself), thread-safe, never blocks. A
        ``final_only`` stream keeps unfinished outputs until the last one comes."""
        if self.final_only and isinstance(item, RequestOutput) and not item.finished:
            self._held.append(item)  # only the producer touches _held
            return
        items: list[RequestOutput | BaseException] = [*self._held, item]
        self._held = []
        try:
            self._loop.call_soon_threadsafe(self._push, items)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    def _push(self, items: list[RequestOutput | BaseException]) -> None:
        outputs = [o for o in items if isinstance(o, RequestOutput)]
        last = self._pending[-1] if self._pending else None
        if isinstance(last, RequestOutput) and not last.finished and outputs:
            self._pending.pop()
            outputs.insert(0, last)
        if outputs:
            self._pending.append(merge_outputs(*outputs) if len(outputs) > 1 else outputs[0])
        self._pending.extend(o for o in items if isinstance(o, BaseException))
        self._ready.set()

    @property
    def num_pending(self) -> int:
        """Items delivered and not yet read (at most 2: an output and an error)."""
        return len(self._pending)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        item = self._pending.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request if it has not finished (idempotent, never blocks)."""
        if not self.finished:
            self._abort(self.request_id)


def merge_outputs(*deltas: RequestOutput) -> RequestOutput:
    """Fold consecutive deltas of one request, oldest first, into one output (a new one;
    one pass, so folding a whole request's deltas costs its length, not its square).

    Text, token ids and logprobs of each completion (by ``index``) are concatenated; status
    fields (``finish_reason``, ``finished``, ``metrics``, ``error``) come from the last
    delta, a completion's ``finish_reason`` and ``stop_reason`` from its last delta that
    has one; ``prompt_logprobs`` from the last delta that has them.

    Raises:
        ValueError: no deltas.
    """
    if not deltas:
        raise ValueError("merge_outputs: no deltas")
    parts: dict[int, list[CompletionOutput]] = {}
    prompt_logprobs = None
    for d in deltas:
        for c in d.outputs:
            parts.setdefault(c.index, []).append(c)
        if d.prompt_logprobs is not None:
            prompt_logprobs = d.prompt_logprobs  # sent once, with the first delta that has them all
    return replace(deltas[-1], outputs=[_merge_completions(parts[i]) for i in sorted(parts)],
                   prompt_logprobs=prompt_logprobs)


def _merge_completions(cs: list[CompletionOutput]) -> CompletionOutput:
    logprobs = None
    if any(c.logprobs is not None for c in cs):
        logprobs = [lp for c in cs for lp in c.logprobs or ()]
    ended = [c for c in cs if c.finish_reason]
    return CompletionOutput(
        index=cs[0].index, text="".join(c.text for c in cs),
        token_ids=[t for c in cs for t in c.token_ids], logprobs=logprobs,
        finish_reason=ended[-1].finish_reason if ended else None,
        stop_reason=ended[-1].stop_reason if ended else None)
