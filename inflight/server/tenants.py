"""Tenants: named API keys, per-tenant limits (429 + ``Retry-After``) and per-tenant series.

A tenant is the name of the API key a request came with (``--api-key NAME=SECRET``,
repeated, or ``--api-key-file``); a key given without a name, or no key at all, is the
tenant ``default``. The name goes with each request to the scheduler (``--scheduling-policy
fair`` shares the engine between tenants) and, unless ``--shared-prefix-cache``, into the
prefix cache's hash (a cache hit answers faster, so a shared cache lets one tenant learn
what another's prompts begin with: the side channel vLLM's ``cache_salt`` closes).

Limits, per tenant (``--tenant-max-concurrent-requests``, ``--tenant-tokens-per-minute``):
a request over one is refused before its body is tokenized with HTTP 429, OpenAI's
``rate_limit_exceeded`` code and a ``Retry-After``. Tokens per minute count prompt tokens at
admission and generated tokens as they stream, over a sliding 60 s window (OpenAI's TPM,
without its estimate of ``max_tokens`` up front: a request admitted under the limit may run
past it, and the next one waits until the window has room).
"""

from __future__ import annotations

import argparse
import math
import re
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from inflight.server.error_responses import OpenAIError

DEFAULT_TENANT = "default"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
WINDOW_S = 60.0


def parse_api_keys(values: Iterable[str], keys_file: str | None = None) -> dict[str, str]:
    """``--api-key`` values and a keys file -> ``{secret: tenant}``.

    A value ``NAME=SECRET`` names its tenant (``NAME``: letters, digits, ``_.-``, at most
    64); a value without ``=`` (or whose text before it is no name) is a key of the tenant
    ``default``. ``NAME=`` alone, or ``NAME=`` and only ``=`` padding, is refused rather
    than taken as the guessable key ``NAME=`` (write such a key ``default=KEY``). The file
    holds one ``NAME=SECRET`` per line; blank lines and ``#`` comments are skipped.

    Raises:
        ValueError: an empty key or name, a key given twice, a file line that is not
            ``NAME=SECRET``, a file with no keys, an unreadable file (the message says
            where).
    """
    entries = [(v, "--api-key") for v in values]
    if keys_file:
        try:
            with open(keys_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file {keys_file}: {e.strerror or e}") from None
        entries += [(line.strip(), f"{keys_file}:{i}") for i, line in enumerate(lines, 1)
                    if line.strip() and not line.lstrip().startswith("#")]
    if keys_file and not any(w != "--api-key" for _, w in entries):
        raise ValueError(f"--api-key-file {keys_file}: holds no keys (an empty file would "
                         "leave the server open)")
    keys: dict[str, str] = {}
    for value, where in entries:
        name, sep, secret = value.partition("=")
        if sep and _NAME.fullmatch(name):
            if not secret.strip("="):
                # "alice=" ($UNSET) must not become the guessable key "alice=".
                raise ValueError(f"{where}: empty key for tenant {name!r} (a key that ends "
                                 "in '=' is written default=KEY)")
        elif sep and not name:
            raise ValueError(f"{where}: empty tenant name before '='")
        elif where != "--api-key":
            raise ValueError(f"{where}: expected NAME=SECRET, NAME letters, digits and "
                             "_.- (at most 64)")
        else:  # no name: the whole value is a key of the default tenant
            name, secret = DEFAULT_TENANT, value
        if not secret:
            raise ValueError(f"{where}: empty API key")
        if secret in keys:
            raise ValueError(f"{where}: the same API key is given twice")
        keys[secret] = name
    return keys


class TenantKeys:
    """Which tenant an ``Authorization`` header belongs to.

    Args:
        keys: ``{secret: tenant}`` (``parse_api_keys``).
    """

    def __init__(self, keys: dict[str, str]) -> None:
        self._keys = [(f"Bearer {s}".encode(), t) for s, t in keys.items()]
        self.names = sorted(set(keys.values()))

    def tenant(self, authorization: bytes) -> str | None:
        """The tenant of ``authorization`` (the header's raw bytes), or None for no match.
        Every key is compared in constant time, so the time does not tell which matched."""
        found = None
        for expected, name in self._keys:
            if secrets.compare_digest(authorization, expected):
                found = name
        return found


@dataclass
class _Usage:
    in_flight: int = 0
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (monotonic seconds, tokens)
    total: int = 0  # tokens in ``tokens``


class TenantLimits:
    """Per-tenant concurrency and tokens-per-minute limits, and their Prometheus series.

    Args:
        max_concurrent_requests: requests a tenant may have in flight (None: no limit).
        tokens_per_minute: prompt + generated tokens a tenant may use in any 60 s (None:
            no limit).
        tenants: the configured tenant names (the label set stays bounded: an unknown name
            is counted as ``default``).
        registry: the registry of ``/metrics``.
        model_name: the ``model_name`` label every series of this server carries (vLLM's).
        clock: seconds (``time.monotonic``).
    """

    def __init__(self, max_concurrent_requests: int | None, tokens_per_minute: int | None,
                 tenants: Iterable[str], registry: CollectorRegistry,
                 model_name: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_concurrent = max_concurrent_requests
        self.tpm = tokens_per_minute
        self.clock = clock
        self.names = set(tenants) | {DEFAULT_TENANT}
        self._usage = {n: _Usage() for n in self.names}
        lab = {} if model_name is None else {"model_name": model_name}
        names = list(lab)
        self._lab = lab
        self._requests = Counter("inflight:tenant_requests", "Requests per tenant and outcome: "
                                 "admitted, or rate_limited (429 from a per-tenant limit).",
                                 [*names, "tenant", "outcome"], registry=registry)
        self._tokens = Counter("inflight:tenant_tokens", "Tokens per tenant: prompt tokens of "
                               "admitted requests and generated tokens.",
                               [*names, "tenant", "kind"], registry=registry)
        in_flight = Gauge("inflight:tenant_requests_in_flight", "Requests in flight per tenant.",
                          [*names, "tenant"], registry=registry)
        for n in self.names:
            in_flight.labels(**lab, tenant=n).set_function(self._in_flight_reader(n))
            for outcome in ("admitted", "rate_limited"):
                self._requests.labels(**lab, tenant=n, outcome=outcome)
        # Resolved once: charging runs for every streamed delta.
        self._token_series = {(n, kind): self._tokens.labels(**lab, tenant=n, kind=kind)
                              for n in self.names for kind in ("prompt", "generation")}

    @property
    def limited(self) -> bool:
        """True when some limit is set (requests may get 429)."""
        return self.max_concurrent is not None or self.tpm is not None

    def _in_flight_reader(self, name: str) -> Callable[[], float]:
        return lambda: self._usage[name].in_flight

    def _label(self, tenant: str | None) -> str:
        return tenant if tenant in self.names else DEFAULT_TENANT

    def admit(self, tenant: str | None) -> "TenantLease":
        """Take a place for one request of ``tenant``.

        Raises:
            OpenAIError: 429 ``rate_limit_exceeded`` with ``Retry-After`` (seconds, at least
                1) when the tenant is at its concurrency limit or its window is full.
        """
        name = self._label(tenant)
        usage = self._usage[name]
        retry, why, kind = None, "", "requests"
        if self.max_concurrent is not None and usage.in_flight >= self.max_concurrent:
            retry, why = 1, (f"{usage.in_flight} requests in flight, the limit is "
                             f"{self.max_concurrent}")
        elif self.tpm is not None:
            now = self.clock()
            self._expire(usage, now)
            if usage.total >= self.tpm:
                # Room returns when enough of the window's oldest tokens expire.
                need, freed, when = usage.total - self.tpm + 1, 0, now
                for t, n in usage.tokens:
                    freed += n
                    when = t + WINDOW_S
                    if freed >= need:
                        break
                retry, kind = max(1, math.ceil(when - now)), "tokens"
                why = f"{usage.total} tokens in the last minute, the limit is {self.tpm}"
        if retry is not None:
            self._requests.labels(**self._lab, tenant=name, outcome="rate_limited").inc()
            raise OpenAIError(429, f"Rate limit reached for tenant {name!r}: {why}; retry "
                              f"after {retry} s.", code="rate_limit_exceeded", type=kind,
                              headers={"Retry-After": str(retry)})
        usage.in_flight += 1
        self._requests.labels(**self._lab, tenant=name, outcome="admitted").inc()
        return TenantLease(self, name)

    def _expire(self, usage: _Usage, now: float) -> None:
        while usage.tokens and usage.tokens[0][0] <= now - WINDOW_S:
            usage.total -= usage.tokens.popleft()[1]

    def _charge(self, name: str, tokens: int, kind: str) -> None:
        if tokens <= 0:
            return
        self._token_series[name, kind].inc(tokens)
        if self.tpm is not None:
            usage = self._usage[name]
            usage.tokens.append((self.clock(), tokens))
            usage.total += tokens

    def in_flight(self, tenant: str | None) -> int:
        return self._usage[self._label(tenant)].in_flight


class TenantLease:
    """One admitted request's place; ``charge`` its tokens, ``release`` it once (later
    calls do nothing)."""

    def __init__(self, limits: TenantLimits, name: str) -> None:
        self.limits, self.name = limits, name
        self._released = False

    def charge(self, tokens: int, kind: str = "generation") -> None:
        """Count ``tokens`` (``kind``: ``prompt`` or ``generation``) against the tenant."""
        self.limits._charge(self.name, tokens, kind)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.limits._usage[self.name].in_flight -= 1


@dataclass(frozen=True)
class TenantSettings:
    """What ``inflight serve``'s tenant flags configure (``from_cli_args``).

    Attributes:
        keys: ``{secret: tenant}``; empty: no key needed, every request is ``default``.
        max_concurrent_requests, tokens_per_minute: per-tenant limits (None: none).
        shared_prefix_cache: tenants share cached prefix blocks; False salts each tenant's.
    """

    keys: dict[str, str] = field(default_factory=dict)
    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None
    shared_prefix_cache: bool = True

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, env_key: str | None = None) -> "TenantSettings":
        """From ``--api-key`` (repeated), ``--api-key-file``, the ``env_key`` value (an
        unnamed key, used when no flag gives one), the limit flags and
        ``--shared-prefix-cache`` (default: shared unless a key names a tenant).

        Raises:
            ValueError: a bad key or file (``parse_api_keys``), a limit below 1.
        """
        values = list(args.api_key or []) or ([env_key] if env_key else [])
        keys = parse_api_keys(values, args.api_key_file)
        for name in ("tenant_max_concurrent_requests", "tenant_tokens_per_minute"):
            v = getattr(args, name)
            if v is not None and v < 1:
                raise ValueError(f"{name}: must be >= 1, got {v}")
        shared = args.shared_prefix_cache
        if shared is None:  # separate caches once keys name tenants
            shared = all(name == DEFAULT_TENANT for name in keys.values())
        return cls(keys, args.tenant_max_concurrent_requests, args.tenant_tokens_per_minute,
                   shared)


def add_tenant_args(p: argparse.ArgumentParser) -> None:
    """``inflight serve``'s tenant flags on the argparse parser ``p``."""
    import argparse

    p.add_argument("--api-key", action="append", default=None, metavar="[NAME=]KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes; NAME= names the "
                        "key's tenant (repeat for several; default: $INFLIGHT_API_KEY)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="more keys, one NAME=KEY per line ('#' comments)")
    p.add_argument("--tenant-max-concurrent-requests", type=int, default=None, metavar="N",
                   help="requests one tenant may have in flight; more get 429 + Retry-After")
    p.add_argument("--tenant-tokens-per-minute", type=int, default=None, metavar="N",
                   help="prompt + generated tokens one tenant may use in any 60 s; past it, "
                        "429 + Retry-After")
    p.add_argument("--shared-prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="let tenants share cached prefix blocks (a hit answers faster, so "
                        "sharing is a timing side channel between tenants); default: shared "
                        "unless --api-key names tenants")


def describe_tenants(t: TenantSettings) -> str:
    """The start-up line's words for ``t``: keys, tenants, limits, cache sharing."""
    names = sorted(set(t.keys.values())) or [DEFAULT_TENANT]
    parts = [f"API key required; tenants {', '.join(names)}" if t.keys
             else "API key not required; every request is tenant default"]
    if t.max_concurrent_requests is not None:
        parts.append(f"{t.max_concurrent_requests} requests in flight each")
    if t.tokens_per_minute is not None:
        parts.append(f"{t.tokens_per_minute} tokens per minute each")
    if t.keys:
        parts.append("prefix cache " + ("shared" if t.shared_prefix_cache else "per tenant"))
    return "; ".join(parts)
