"""The one error type a request meets between the engine and its client. Torch-free.

Everything the engine can say about a request it will not serve is an ``EngineError``,
whose ``kind`` names the class of failure; the HTTP server turns it into an OpenAI error
body in one place (``inflight.server.error_responses.to_openai``), offline callers catch it as is.
Refusals of bad input are also ``ValueError``, so ``except ValueError`` keeps working for
callers of ``Engine.add_request``.
"""

from __future__ import annotations

from typing import ClassVar


class EngineError(Exception):
    """Why a request is not (or no longer) served.

    Args:
        message: human-readable text.
        param: the request field at fault (``prompt``, ``max_tokens``, ``n``), if any.
        code: machine-readable code (``context_length_exceeded``, ...), if any.
        retry_after: seconds after which a retry may succeed (overload, unavailable).

    ``kind`` (class attribute): ``invalid_request`` (the client's input; retrying the same
    request cannot help), ``overloaded`` (retry later), ``unavailable`` (the engine is
    stopping or stopped), ``engine_error`` (a fault inside the engine).
    """

    kind: ClassVar[str] = "engine_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after


class InvalidRequestError(EngineError, ValueError):
    """A request the engine can never run as given (a prompt that cannot fit, an unknown
    token id, a duplicate id)."""

    kind = "invalid_request"


class RequestTooLargeError(InvalidRequestError):
    """More sequences (prompts x ``n``) than the server could ever queue at once."""


class EngineOverloadedError(EngineError):
    """Too many requests wait already, or load shedding dropped this one; retry later."""

    kind = "overloaded"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message, retry_after=retry_after)


class EngineDeadError(EngineError):
    """The engine loop is stopped (shut down, crashed, stuck past the watchdog), or it cut
    the request short while stopping. Retryable: another replica, or this one restarted,
    can serve it (``retry_after`` 1 s by default, the ``Retry-After`` of its 503)."""

    kind = "unavailable"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message, retry_after=retry_after)


class RequestFailedError(EngineError):
    """The engine could not run a request (a failed step or a bug, not the client's input)."""

    kind = "engine_error"
