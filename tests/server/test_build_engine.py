"""The server builds its engine off the main thread (docs/performance.md: libgomp teams)."""

from __future__ import annotations

import threading

import pytest

from inflight.server.lifecycle import build_engine_off_main_thread


def test_the_engine_is_built_on_a_thread_that_is_gone():
    seen = {}

    def build():
        seen["thread"] = threading.current_thread()
        return "engine"
    assert build_engine_off_main_thread(build) == "engine"
    assert seen["thread"] is not threading.main_thread()
    assert not seen["thread"].is_alive()  # its OpenMP team went with it


def test_a_failed_build_raises_on_the_caller():
    def build():
        raise FileNotFoundError("no model")
    with pytest.raises(FileNotFoundError, match="no model"):
        build_engine_off_main_thread(build)
