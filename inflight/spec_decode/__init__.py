"""Draft proposers for speculative decoding (``core.speculation`` decides when, the runner
and ``rejection_sampler`` verify). ``make_proposer`` builds the one ``--speculative-config``
names."""

from __future__ import annotations

from typing import Any

from inflight.core.spec_config import SpeculativeConfig
from inflight.core.speculation import Proposer
from inflight.spec_decode.ngram import NgramProposer


def make_proposer(config: SpeculativeConfig, **context: Any) -> Proposer:
    """The proposer for ``config.method``.

    Args:
        config: the parsed speculative config.
        context: what a model-based proposer needs from the engine (``draft_model``:
            ``engine_config``, the target's settings, and ``target_kv_tokens``, the
            target's KV pool in tokens, which the draft's own pool matches).

    Raises:
        ValueError: a method this build cannot run, naming it.
    """
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "draft_model":
        from inflight.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, **context)
    raise ValueError(f"speculative_config.method: {config.method!r} is not supported")
