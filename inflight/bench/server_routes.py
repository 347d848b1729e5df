"""What a session asks of the server over HTTP, beyond the measured requests: the models it
serves, a request sent (warm-ups, a ramp's), its prefix cache reset, and a wait until it is
idle. The optional routes a server may lack are skipped (``Session.skipped``)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import aiohttp

from inflight.bench.client import HTTP_ERRORS, RequestRecord, build_payload, endpoint_path, post_json, stream_request
from inflight.bench.datasets import RequestSpec
from inflight.bench.metrics_scrape import Scraper
from inflight.bench.prompts import MISSING_ROUTE
from inflight.bench.session import Session

logger = logging.getLogger(__name__)


def http_client(session: Session) -> aiohttp.ClientSession:
    """The session's HTTP client. RuntimeError for a session without a server (simulated)."""
    if session.client is None:
        raise RuntimeError("this session has no server to send to (it is simulated)")
    return session.client


async def server_models(client: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    """``GET /v1/models``'s list ([] where it has none). RuntimeError: no connection."""
    try:
        async with client.get(base_url.rstrip("/") + "/v1/models", headers=headers,
                              timeout=aiohttp.ClientTimeout(total=30.0)) as resp:
            resp.raise_for_status()
            return list((await resp.json(content_type=None)).get("data") or [])
    except aiohttp.ClientConnectorError as e:
        raise RuntimeError(f"cannot connect to {base_url}: {e}; is the server running "
                           f"(see --base-url)?") from None
    except (*HTTP_ERRORS, ValueError, AttributeError):
        return []


async def send_request(session: Session, spec: RequestSpec, record: RequestRecord,
                       clock: Callable[[], float]) -> RequestRecord:
    """Stream ``spec`` to the server, filling ``record`` (times from ``clock``, in s). The
    body names the spec's LoRA adapter where it has one (``--lora-modules``), else the
    session's model."""
    url = session.load.base_url.rstrip("/") + endpoint_path(session.endpoint)
    model = spec.model or session.model
    payload = build_payload(spec, session.endpoint, model, session.load.temperature, session.load.extra_body)
    record.prompt_len, record.output_len, record.model = spec.prompt_len, spec.output_len, model
    await stream_request(http_client(session), url, payload, record, session.headers,
                         session.load.request_timeout, clock)
    if record.connection_retries:
        # Counted (summary "connection_retries"), not a failure; said as it happens too.
        logger.warning("request %d sent again on a new connection: the first failed before the server "
                       "answered%s", record.index, f" (then: {record.error})" if record.error else "")
    return record


async def warm_up(session: Session) -> None:
    """Send the warm-up requests (not counted) once per session, all at once."""
    if session.warmed_up or not session.warmups:
        session.warmed_up = True
        return
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0
    await asyncio.gather(*(send_request(session, s, RequestRecord(i, 0.0, warmup=True, phase="session-warmup"),
                                        clock) for i, s in enumerate(session.warmups)))
    session.warmed_up = True


async def reset_prefix_cache(session: Session) -> bool:
    """``POST /reset_prefix_cache`` (inflight's and vLLM's route) so the point starts with a
    cold prefix cache. Returns False where it was not reset. A server without the route
    (404, 405, 501, or no connection for it) has it skipped from then on: recorded in
    ``session.skipped`` and said in one warning. Another failure warns each time."""
    entry = "reset_prefix_cache:"
    if any(s.startswith(entry) for s in session.skipped):
        return False
    url = session.load.base_url.rstrip("/") + "/reset_prefix_cache"
    try:
        status, _ = await post_json(http_client(session), url, None, session.headers)
    except HTTP_ERRORS as e:
        # No connection for the route (refused, or closed twice before an answer) is a
        # missing route; a timeout is a busy server.
        why = f"{type(e).__name__}: {e}"
        missing = isinstance(e, aiohttp.ClientConnectionError) and not isinstance(e, TimeoutError)
    else:
        if status == 200:
            return True
        why, missing = f"HTTP {status}", status in MISSING_ROUTE
    if not missing:
        logger.warning("reset_prefix_cache: the server answered %s; the prefix cache was not reset", why)
        return False
    session.skipped.append(f"{entry} {why}")
    logger.warning("%s lacks /reset_prefix_cache (%s); skipped from now on: the prefix cache is not reset "
                   "between points", session.load.base_url, why)
    return False


async def wait_idle(session: Session, timeout: float = 30.0) -> None:
    """Wait (bounded, ``timeout`` s) until the server reports nothing running or waiting:
    from its Prometheus gauges, else from llama-server's ``GET /slots`` (a slot
    ``is_processing``), else not at all."""
    deadline = time.perf_counter() + timeout
    scraper = Scraper(http_client(session), session.load.base_url, session.headers)
    while time.perf_counter() < deadline:
        snap = await scraper.scrape() if session.load.scrape_metrics else None
        if snap is not None:
            busy = bool(snap.get("running") or snap.get("waiting"))
        else:
            slots = await _slots_busy(session)
            if slots is None:
                return
            busy = slots
        if not busy:
            return
        await asyncio.sleep(0.2)


async def _slots_busy(session: Session) -> bool | None:
    """Whether any of llama-server's slots is processing (``GET /slots``); None where the
    server has no such route."""
    try:
        async with http_client(session).get(session.load.base_url.rstrip("/") + "/slots",
                                            headers=session.headers,
                                            timeout=aiohttp.ClientTimeout(total=10.0)) as r:
            if r.status != 200:
                return None
            slots = await r.json(content_type=None)
    except (*HTTP_ERRORS, ValueError):
        return None
    if not isinstance(slots, list):
        return None
    return any(isinstance(s, dict) and s.get("is_processing") for s in slots)
