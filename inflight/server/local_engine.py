"""The one-engine ``EngineLauncher`` of ``inflight serve``: the model in this process,
stepped by an ``AsyncEngine`` thread (``--data-parallel-size 1``, the default)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from fastapi import FastAPI

from inflight.config import EngineConfig, ServingConfig
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.engine_client import EngineClient
from inflight.server.lifecycle import build_engine_off_main_thread

if TYPE_CHECKING:
    from inflight.sim.steplog import StepLog


class LocalEngine:
    """Builds one ``Engine`` (off the main thread) and its ``AsyncEngine``; with
    ``--step-log``, records every step for the simulator.

    Args:
        args: the parsed ``serve`` flags.

    Raises:
        ValueError: a bad engine flag.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.config = EngineConfig.from_cli_args(args)
        self._template: str | None = None
        self._client: AsyncEngine | None = None
        self._step_log: StepLog | None = None

    def prepare(self, chat_template: str | None) -> None:
        """Nothing to load before binding; the template goes in once the model is."""
        self._template = chat_template

    def start(self, serving: ServingConfig, model_name: str) -> EngineClient:
        """Load the model, refuse an unsafe chat template, start nothing yet (the app's
        lifespan starts the engine thread)."""
        from inflight.engine import Engine

        args = self.args
        core = build_engine_off_main_thread(lambda: Engine(self.config))
        if self._template is not None:
            from inflight.tokenizer import check_chat_template

            core.tokenizer.chat_template = self._template
            check_chat_template(core.tokenizer, args.chat_template)  # refuse an unsafe one
        client = self._client = AsyncEngine(
            core, max_num_waiting=serving.max_num_waiting, log_interval_s=args.stats_log_interval,
            watchdog_timeout_s=args.watchdog_timeout, watchdog_backstop=True)
        if args.step_log:
            from inflight.sim.steplog import StepLog
            self._step_log = StepLog(args.step_log, client, serving.max_num_waiting)
            client.listeners.append(self._step_log)
        return client

    def install(self, app: FastAPI, client: EngineClient) -> None:
        """The one-engine app needs nothing more."""

    def describe(self) -> str:
        return ""

    def stop(self) -> None:
        """Join the engine thread, close the step log."""
        if self._client is not None:
            self._client.shutdown()
        if self._step_log is not None:
            self._step_log.close()
