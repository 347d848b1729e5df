"""``inflight serve``'s flags: the server's own, then every engine flag
(``EngineConfig.add_cli_args``); the data-parallel ones are ``cluster/options.py``'s."""

from __future__ import annotations

import argparse
from typing import Any

from inflight.config import (DEFAULT_MAX_NUM_WAITING, DEFAULT_MAX_STEP_TIME,
                             DEFAULT_OVERLOAD_TTFT, EngineConfig)
from inflight.engine.watchdog import EXIT_ENGINE_DEAD
from inflight.server.app import DEFAULT_MAX_BODY_BYTES
from inflight.server.embeddings_serving import POOLING_CHOICES
from inflight.server.tenants import add_tenant_args
from inflight.server.tool_parsers import TOOL_PARSERS

DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``inflight serve`` (server flags plus every engine flag) to ``subparsers``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000)")
    add_tenant_args(p)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients use in 'model' (default: the --model argument, or the "
                        "bundled model's name)")
    p.add_argument("--max-num-waiting", type=int, default=DEFAULT_MAX_NUM_WAITING,
                   help="sequences allowed to wait for admission; past it requests get 503 "
                        "with Retry-After (default %(default)s)")
    p.add_argument("--max-tokens-default", type=int, default=None, metavar="N",
                   help="tokens a request generates when it sets no max_tokens (chat, or a "
                        "completion with max_tokens null; a completion that leaves it out "
                        "keeps OpenAI's 16); default: what max_model_len leaves, as vLLM")
    p.add_argument("--pooling", choices=POOLING_CHOICES, default="last",
                   help="how /v1/embeddings pools a prompt's final hidden states before "
                        "L2-normalizing: the last token's (vLLM's default for a decoder "
                        "model) or the mean over every token (default %(default)s)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 (default %(default)s)")
    p.add_argument("--stats-window", type=float, default=60.0,
                   help="seconds of the latency percentile window of /stats (default %(default)s)")
    p.add_argument("--stats-log-interval", type=float, default=10.0,
                   help="seconds between stats log lines while busy; 0 disables (default %(default)s)")
    _add_runtime_args(p)
    EngineConfig.add_cli_args(p)
    # A server protects its running requests by default; the engine (offline batches) not.
    p.set_defaults(overload_ttft=DEFAULT_OVERLOAD_TTFT,
                   max_step_time=DEFAULT_MAX_STEP_TIME)
    return p


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535, got {port}")
    return port


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Shutdown, watchdog, logging, chat template and tool-call flags."""
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGINT/SIGTERM, seconds running requests get to finish before "
                        "they are aborted (default %(default)s)")
    p.add_argument("--watchdog-timeout", type=float, default=None, metavar="S",
                   help="seconds one engine step may run before the engine is declared dead: "
                        "/health answers 503, requests in flight get an error, the process "
                        "exits with status %d for its supervisor to restart (SGLang's flag); "
                        "default: 20 x the predicted full-budget step, at least 60 s; 0: off"
                        % EXIT_ENGINE_DEAD)
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="log every HTTP request")
    p.add_argument("--step-log", metavar="FILE.jsonl",
                   help="write every engine step's shape and time here, to fit a simulator profile "
                        "from real serving (`inflight profile --from-step-log`)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) to use instead "
                        "of the model's, e.g. one that renders tools (vLLM's flag)")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="how replies are parsed into tool calls for tool_choice auto: hermes "
                        "(<tool_call> JSON, Hermes / Qwen) or llama3_json (Llama 3.1+)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice auto (needs --tool-call-parser), as vLLM")
