"""A request's outputs on the event loop: ``RequestStream`` and ``merge_outputs``.

The engine thread ``put``s each delta (or the error that ends the request) through
``loop.call_soon_threadsafe``; deltas that arrive before the reader took the previous one
are merged into it, so a slow reader gets one chunk instead of a backlog (vLLM v1's output
processor merges the same way) and an unread stream's buffer stays bounded.
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
                 loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._abort = abort
        self._loop = loop
        self._pending: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Deliver an output or the error that ends the stream; called on the engine
        thread (thread-safe, never blocks)."""
        try:
            self._loop.call_soon_threadsafe(self._push, item)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    def _push(self, item: RequestOutput | BaseException) -> None:
        last = self._pending[-1] if self._pending else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and not last.finished:
            self._pending[-1] = merge_outputs(last, item)
        else:
            self._pending.append(item)
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


def merge_outputs(acc: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Fold the delta ``new`` into ``acc`` (same request); returns a new output.

    Text, token ids and logprobs of each completion (by ``index``) are concatenated; status
    fields (``finish_reason``, ``finished``, ``metrics``, ``error``) come from ``new``;
    ``prompt_logprobs`` from whichever has them.
    """
    by_index = {c.index: c for c in acc.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            by_index[c.index] = replace(c, token_ids=list(c.token_ids))
            continue
        logprobs = None
        if old.logprobs is not None or c.logprobs is not None:
            logprobs = list(old.logprobs or []) + list(c.logprobs or [])
        by_index[c.index] = CompletionOutput(
            index=c.index, text=old.text + c.text, token_ids=list(old.token_ids) + list(c.token_ids),
            logprobs=logprobs, finish_reason=c.finish_reason or old.finish_reason,
            stop_reason=c.stop_reason if c.finish_reason else old.stop_reason)
    prompt_logprobs = new.prompt_logprobs if new.prompt_logprobs is not None \
        else acc.prompt_logprobs  # sent once, with the first delta that has them all
    return replace(new, outputs=[by_index[i] for i in sorted(by_index)],
                   prompt_logprobs=prompt_logprobs)
