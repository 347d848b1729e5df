"""Per-request sampling parameters.

Field names, defaults and meanings follow vLLM's ``SamplingParams``
(https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html) so that client code migrates
unchanged. Every invalid value raises ``ValueError`` whose message starts with the field name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from inflight.structured_output import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# ``SamplingParams.pooling``: None (generate), last token's or mean hidden state (embeddings).
POOLING_TYPES = (None, "last", "mean")


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop, for one request.

    Attributes:
        n: number of independent completions returned for the prompt.
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling, keep the smallest set of tokens whose probability mass is
            at least ``top_p`` (0, 1].
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below ``min_p`` times the top token's.
        seed: seeds a per-request generator, so a seeded request yields the same tokens
            whatever it is batched with.
        repetition_penalty: CTRL-style multiplicative penalty (>1 discourages) on tokens in
            the prompt or output; 1 disables.
        presence_penalty: OpenAI-style additive penalty on tokens already generated, [-2, 2].
        frequency_penalty: OpenAI-style penalty times each generated token's count, [-2, 2].
        max_tokens: maximum output tokens per completion (None: up to the context length;
            0: the prompt is prefilled and nothing generated, scoring a prompt with
            ``prompt_logprobs``: the request finishes ``length`` with no output token).
        min_tokens: EOS and stop token ids are suppressed until this many tokens exist.
        stop: strings that end the completion; the stop string is cut from the output
            unless ``include_stop_str_in_output``.
        stop_token_ids: token ids that end the completion (kept in ``token_ids``).
        include_stop_str_in_output: keep the matched stop string in the text.
        ignore_eos: keep generating past EOS (benchmarks force output lengths with it).
        logprobs: number of top log-probabilities to return per output token (None: none).
            The sampled token's own log-probability is always included when set.
        skip_special_tokens: drop special tokens from the detokenized text.
        prompt_logprobs: number of top log-probabilities to return per prompt token (None:
            none); each prompt token's own log-probability and rank are always included,
            the first token has none (vLLM's ``prompt_logprobs``). Such a request reads
            nothing from the prefix cache: every prompt position is computed.
        logit_bias: ``{token_id: bias}`` added to the logits before sampling (OpenAI's
            ``logit_bias``, bias in [-100, 100]); returned logprobs stay the raw ones.
        structured_outputs: what the output must match (a JSON schema, regex, choice or
            grammar; ``inflight.structured_output``); None: unconstrained.
        pooling: ``"last"`` or ``"mean"``: an embedding request (vLLM's pooling runner for
            a decoder model): the prompt is prefilled and its final (normed) hidden states
            pooled, the last token's or the mean over every prompt token, L2-normalized,
            into ``RequestOutput.embedding``. Needs ``max_tokens == 0`` and ``n == 1``;
            ``"mean"`` reads nothing from the prefix cache (every position is pooled).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    pooling: str | None = None
    # Filled in from ``stop`` / ``stop_token_ids``: always tuples.
    stop_strings: tuple[str, ...] = field(init=False, default=())
    stop_ids: tuple[int, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = ()
        elif isinstance(self.stop, str):
            self.stop_strings = (self.stop,)
        else:
            self.stop_strings = tuple(self.stop)
        self.stop_token_ids = self.stop_ids = tuple(self.stop_token_ids or ())
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {msg}, got {getattr(self, name)!r}")

        check(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        check(_is_num(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1),
              "top_k", "must be -1 (disabled), 0 (disabled) or a positive integer")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**63),
              "seed", "must be a signed 64-bit integer or None")
        check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
              "repetition_penalty", "must be > 0")
        check(_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
              "presence_penalty", "must be in [-2, 2]")
        check(_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
              "frequency_penalty", "must be in [-2, 2]")
        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 0),
              "max_tokens", "must be an integer >= 0 or None")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        if self.max_tokens is not None and _is_int(self.min_tokens):
            check(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        check(all(isinstance(s, str) and s for s in self.stop_strings),
              "stop", "must be a non-empty string or a list of non-empty strings")
        check(all(_is_int(t) and t >= 0 for t in self.stop_ids),
              "stop_token_ids", "must be a list of non-negative integers")
        check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
              "logprobs", "must be an integer in [0, 20] or None")
        check(self.prompt_logprobs is None
              or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
              "prompt_logprobs", "must be an integer in [0, 20] or None")
        check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            _is_int(t) and t >= 0 and _is_num(b) and -100 <= b <= 100
            for t, b in self.logit_bias.items())),
            "logit_bias", "must map token ids to biases in [-100, 100]")
        check(self.structured_outputs is None
              or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be a StructuredOutputsParams or None")
        check(self.pooling in POOLING_TYPES, "pooling", f"must be one of {POOLING_TYPES}")
        if self.pooling is not None:
            check(self.max_tokens == 0, "max_tokens", "must be 0 for a pooling request")
            check(self.n == 1, "n", "must be 1 for a pooling request")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            check(isinstance(getattr(self, name), bool), name, "must be a bool")

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes: Any) -> "SamplingParams":
        """A validated copy with ``changes`` applied (used to fan out ``n`` completions)."""
        return replace(self, **changes)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
