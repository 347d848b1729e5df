"""A request's outputs on the event loop: ``RequestStream`` and ``merge_outputs``.

The engine thread ``put``s each delta (or the error that ends the request) through
``loop.call_soon_threadsafe``; the reader merges deltas that piled up between reads, so a
slow reader gets one chunk instead of a backlog (vLLM v1's output processor does the same).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from inflight.outputs import CompletionOutput, RequestOutput


class RequestStream:
    """The outputs of one request, as an async iterator of deltas.

    Each item is a ``RequestOutput`` whose completions hold only what is new (text, token
    ids, logprobs) since the previous item; deltas that arrived together are merged. The
    last item has ``finished=True`` (``error`` set if the engine failed the request), then
    iteration stops. ``abort()`` cancels the request; iterating on then yields its final
    ``finish_reason="abort"`` output.

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
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Deliver an output or the error that ends the stream; called on the engine
        thread (thread-safe)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        # Merge what else is already queued, so a slow reader gets one chunk, not a backlog.
        while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
            nxt = self._queue.get_nowait()
            if isinstance(nxt, BaseException):
                self._queue.put_nowait(nxt)  # deliver the output first, the error next
                break
            item = merge_outputs(item, nxt)
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
    fields (``finish_reason``, ``finished``, ``metrics``, ``error``) come from ``new``.
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
    return replace(new, outputs=[by_index[i] for i in sorted(by_index)])
