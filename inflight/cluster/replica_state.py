"""The ingress's view of each replica (``ReplicaState``), and helpers of ``ClusterEngine``
that need no Ray: the ingress's tokenizer, Ray errors made short."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from inflight.engine.stats import EngineStats
from inflight.routing import ReplicaLoad

# A down replica's load as the router sees it: never the least loaded.
_DOWN_LOAD = ReplicaLoad(num_running=0, num_waiting=1 << 30, kv_cache_usage=1.0)


def zero_stats() -> EngineStats:
    """The stats of a replica that has reported nothing (or died)."""
    return EngineStats(0, 0, 0.0, 0, 0, 0, 0)


@dataclass
class ReplicaState:
    """The ingress's view of one replica.

    Attributes:
        index: 0..N-1, its ``replica`` label.
        actor: the Ray actor handle.
        up: routed to; False from its death until its restart is ready.
        pid: its process id (last seen).
        stats: its ``EngineStats`` as last reported (with its last outputs).
        num_waiting: its waiting sequences as last reported (queued adds included).
        seqs: sequences in flight there per request id, as this ingress counts them.
        routed, lost, restarts: requests routed there; requests failed because it died;
            times it died and came back.
    """

    index: int
    actor: Any
    up: bool = False
    pid: int | None = None
    stats: EngineStats = field(default_factory=zero_stats)
    num_waiting: int = 0
    seqs: dict[str, int] = field(default_factory=dict)
    routed: int = 0
    lost: int = 0
    restarts: int = 0

    def load(self) -> ReplicaLoad:
        """What the router sees: in-flight sequences (counted here), split into running
        and waiting by the last report, and the reported KV usage."""
        if not self.up:
            return _DOWN_LOAD
        outstanding = sum(self.seqs.values())
        running = min(outstanding, self.stats.num_running)
        return ReplicaLoad(running, outstanding - running, self.stats.kv_cache_usage)


def load_tokenizer(model: str | None) -> Any:
    """The model's tokenizer alone (the ingress templates and tokenizes; replicas hold the
    weights): a GGUF file's, or an HF directory's. Raises ``FileNotFoundError`` for no
    such model and ``UnsafeChatTemplateError`` for a template the server refuses."""
    from inflight.engine.loading import resolve_model_path
    from inflight.tokenizer import Tokenizer, check_chat_template

    path = resolve_model_path(model)
    tok = Tokenizer.from_pretrained(path) if path.is_dir() else Tokenizer.from_gguf(path)
    check_chat_template(tok, path)
    return tok


def ray_error_cause(e: BaseException) -> str:
    """A short description of a Ray error: the exception its traceback ends with, where it
    carries one (a replica's ``__init__`` error: ``ValueError: max_model_len: ...``), else
    its (cause's) first line."""
    cause = getattr(e, "cause", None) or e
    lines = [ln.strip() for ln in str(cause).strip().splitlines() if ln.strip()]
    raised = [ln for ln in lines[1:] if re.match(r"[A-Za-z_][\w.]*(Error|Exception)\b.*:", ln)]
    if raised:
        return _strip_ansi(raised[-1])[:300]
    return f"{type(cause).__name__}: {_strip_ansi(lines[0]) if lines else ''}"[:300]


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)
