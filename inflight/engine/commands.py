"""Commands from the event loop to the engine thread: typed, immutable, one per action.

``AsyncEngine`` puts them on a thread-safe queue; the engine thread drains it between steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from inflight.request import RequestOptions
from inflight.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """Queue a request (``Engine.add_request`` in streaming mode)."""

    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    arrival_time: float
    options: RequestOptions


@dataclass(frozen=True)
class Abort:
    """Abort one request, if it is still unfinished."""

    request_id: str


@dataclass(frozen=True)
class AbortAll:
    """Abort everything in flight (shutdown's grace period ran out)."""


@dataclass(frozen=True)
class Call:
    """Run ``fn()`` on the engine thread between steps; its result settles ``done``."""

    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[Any]


Command = AddRequest | Abort | AbortAll | Call
