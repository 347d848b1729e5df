"""Starting or joining Ray for ``--data-parallel-size``, and leaving nothing behind.

``RayRuntime(address=None)`` starts a local Ray on 127.0.0.1 (no dashboard, no usage
statistics sent, a small object store: only outputs and metrics travel through it) and
``stop()`` shuts it down with every process it started; with an ``address`` it joins that
cluster and ``stop()`` only disconnects this driver.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)

# Outputs, metrics and stats are small and inlined; the store only needs Ray's minimum.
_OBJECT_STORE_BYTES = 128 << 20


def import_ray() -> Any:
    """``import ray``, or a RuntimeError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("--data-parallel-size > 1 needs Ray: pip install "
                           "'inflight-serve[cluster]' (or `make install`)") from None
    return ray


class RayRuntime:
    """Ray for this process, started or joined.

    Args:
        address: a cluster to join (``ray.init(address=...)``: ``auto``, ``HOST:PORT``);
            None starts a local one bound to 127.0.0.1 that ``stop()`` takes down.
        num_cpus: CPUs the local Ray advertises (None: this machine's count); ignored
            when joining.

    Raises:
        RuntimeError: Ray is not installed.
    """

    def __init__(self, address: str | None = None, num_cpus: int | None = None) -> None:
        self.ray = import_ray()
        self.address = address
        self.started_here = False
        t0 = time.monotonic()
        if self.ray.is_initialized():
            logger.info("Ray already initialised in this process; using it")
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # never phone home
        if not sys.stderr.isatty():  # replicas' log lines without colour codes in a log file
            os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        if address is None:
            _loopback_only(self.ray)
            self.ray.init(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False,
                          _node_ip_address="127.0.0.1", object_store_memory=_OBJECT_STORE_BYTES,
                          configure_logging=False, log_to_driver=True)
            self.started_here = True
        else:
            if address.rsplit(":", 1)[0].strip("[]") in ("127.0.0.1", "localhost", "::1"):
                _loopback_only(self.ray)  # this node is that cluster's loopback node
            _token_auth_if_token(self.ray)
            try:
                self.ray.init(address=address, configure_logging=False, log_to_driver=True)
            except ConnectionError as e:
                raise RuntimeError(f"--ray-address {address}: {e}") from None
        logger.info("Ray %s %s in %.1f s", self.ray.__version__,
                    "started on 127.0.0.1" if self.started_here else f"joined at {address}",
                    time.monotonic() - t0)

    def stop(self) -> None:
        """Disconnect; a local Ray started here is shut down with its processes
        (idempotent)."""
        if self.ray.is_initialized():
            self.ray.shutdown()


def _loopback_only(ray: Any) -> None:
    """Make a local Ray bind and advertise 127.0.0.1 only.

    ``ray.init(_node_ip_address="127.0.0.1")`` alone is replaced by the machine's reachable
    address (``services.resolve_ip_for_localhost``), and Ray's servers then listen on it.
    Ray uses the loopback address only where it supports no multi-node cluster
    (``ray_constants.ENABLE_RAY_CLUSTER``, off on Windows and macOS, read at each call;
    its environment variable ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` for the processes Ray
    spawns). A single-machine server wants exactly that. Checked with ``ss -ltnp``: gcs,
    raylet and workers then listen on 127.0.0.1 only (Ray 2.60).
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        from ray._private import ray_constants
        ray_constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError):  # another Ray layout: its default binding
        logger.warning("could not restrict Ray to 127.0.0.1 (Ray %s)", ray.__version__)


def _token_auth_if_token(ray: Any) -> None:
    """Joining a cluster: use Ray's token authentication when this machine has a token.

    ``ray start`` turns token authentication on when ``~/.ray/auth_token`` exists, and a
    driver joining it must too. Ray 2.60's ``ray.init(address=...)`` decides so only after
    its first request to the GCS, which is then refused ("Authentication token is missing
    or incorrect") until the connection times out; deciding first, with Ray's own rule,
    joins at once (measured: 0.9 s). ``RAY_AUTH_MODE`` set by the user wins.
    """
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available)
    except ImportError:  # another Ray layout: its own rule
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
