"""``--speculative-config``: which proposer drafts tokens and how many. Torch-free.

The JSON keys and method names are vLLM's (``vllm/config/speculative.py``), so a vLLM
command line starts here unchanged where the method exists:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "/path/to/small.gguf", "num_speculative_tokens": 4}

An unknown method or key is a start-up error naming it, never silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How requests speculate (Leviathan et al., ICML 2023; Chen et al., 2023).

    Attributes:
        method: ``ngram`` (prompt lookup: the tokens that followed the latest earlier
            occurrence of the sequence's last n-gram, Saxena 2023 / vLLM's ``ngram``) or
            ``draft_model`` (a smaller model with the same vocabulary proposes greedily).
        num_speculative_tokens: k, the most draft tokens a request verifies in one step.
        prompt_lookup_max, prompt_lookup_min: ngram: the longest and shortest suffix
            n-gram looked up (longest first).
        model: draft_model: a ``.gguf`` file or HF directory.
        disable_by_batch_size: no drafts in a step with at least this many running
            requests (vLLM's key); None: decided from the measured step cost instead
            (``core.speculation``).
        min_acceptance_rate: a request whose drafts are accepted less often than this
            (after ``acceptance_window`` drafted tokens) stops drafting for a while.
        acceptance_window: drafted tokens a request's acceptance rate is judged over.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    disable_by_batch_size: int | None = None
    min_acceptance_rate: float = 0.1
    acceptance_window: int = 32

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"speculative_config.{name}: {msg}, got {getattr(self, name)!r}")

        check(self.method in SPEC_METHODS, "method", f"must be one of {SPEC_METHODS}")
        check(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens",
              "must be in 1..16")
        check(self.prompt_lookup_min >= 1, "prompt_lookup_min", "must be >= 1")
        check(self.prompt_lookup_max >= self.prompt_lookup_min, "prompt_lookup_max",
              "must be >= prompt_lookup_min")
        check((self.model is not None) == (self.method == "draft_model"), "model",
              "is required by method draft_model and only by it")
        check(self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
              "disable_by_batch_size", "must be >= 1")
        check(0.0 <= self.min_acceptance_rate < 1.0, "min_acceptance_rate", "must be in [0, 1)")
        check(self.acceptance_window >= 1, "acceptance_window", "must be >= 1")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SpeculativeConfig":
        """Build from vLLM's JSON keys.

        Raises:
            ValueError: unknown keys (named), a missing or unknown method, bad values.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        if "method" not in data:
            raise ValueError(f"speculative_config.method: required, one of {SPEC_METHODS}")
        return cls(**data)

    @classmethod
    def parse(cls, text: str) -> "SpeculativeConfig":
        """``--speculative-config`` JSON text -> config.

        Raises:
            ValueError: not a JSON object, or as ``from_dict``.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not JSON ({e.msg})") from None
        if not isinstance(data, dict):
            raise ValueError("speculative_config: expected a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        return cls.from_dict(data)
