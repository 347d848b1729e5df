"""Structured output: constrain sampling to a JSON schema, a regex, a choice or a grammar.

The request side follows vLLM's ``StructuredOutputsParams`` (``json``, ``regex``,
``choice``, ``grammar``, ``json_object``;
https://docs.vllm.ai/en/latest/features/structured_outputs.html); OpenAI's
``response_format`` maps onto it in the server. The mechanism is xgrammar's (Dong et al.,
"XGrammar", MLSys 2025): a grammar compiled once per distinct spec against the tokenizer's
vocabulary (cached by the compiler), one matcher per sequence that yields a bitmask of the
tokens allowed next, applied to that row's logits in the batched sampler, and advanced by
the sampled token.

Why xgrammar rather than llguidance (both serve vLLM): measured here on the bundled
vocabulary (49,152 tokens) and a nested schema, the next-token mask took 2.0 us median /
116 us worst per step against llguidance's 16.5 / 1,378 us, and its CPU kernel applies 32
rows of masks in 48 us (``benchmarks/structured_output.py`` measures the whole step).

JSON is generated compact (no free whitespace between tokens): a small model given
``any_whitespace`` can emit newlines until ``max_tokens`` (a failure vLLM users reported;
vLLM's ``disable_any_whitespace`` does the same).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# One compiled grammar per distinct (kind, spec) string: xgrammar's compiler caches them.
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match; exactly one field set (vLLM's ``StructuredOutputsParams``).

    Attributes:
        json: a JSON schema (dict, or its JSON text).
        regex: a regular expression the whole output matches (ECMAScript syntax).
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (GBNF / xgrammar syntax, start rule ``root``).
        json_object: any JSON object (OpenAI's ``{"type": "json_object"}``).

    Raises:
        ValueError: none or more than one field set, or a field of the wrong type; the
            message starts with ``structured_outputs``.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("structured_outputs: set exactly one of json, regex, choice, "
                             f"grammar, json_object (got {', '.join(kinds) or 'none'})")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs: json must be a schema object or its JSON text")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs: {name} must be a non-empty string")
        if self.choice is not None and (
                not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs: choice must be a non-empty list of "
                             "non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """``(kind, spec text)``: equal for specs that compile to the same grammar."""
        kind = self.kind
        if kind == "json":
            # insertion order kept: the schema's property order is the output's
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json)
        elif kind == "choice":
            spec = json.dumps(self.choice)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        return kind, spec


def _choice_grammar(choices: Sequence[str]) -> str:
    # JSON string literals are valid EBNF literals in xgrammar (the same escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _message(e: Exception) -> str:
    """xgrammar's error text without its ``[time] file.cc:line:`` prefix."""
    text = str(e).strip()
    text = re.sub(r"^\[[0-9:]+\]\s+\S+:\d+:\s*", "", text)
    return text.split("\n")[0][:300]


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` against one tokenizer; thread-safe, cached.

    xgrammar and its vocabulary tables are loaded on the first call (about 3 s here), so a
    server that never sees a structured request never pays for them.

    Args:
        tokenizer: the engine's tokenizer (``backend``: a ``tokenizers.Tokenizer``,
            ``vocab_size``: the model's logits width, ``eos_token_ids``).
        max_threads: threads xgrammar may use to compile one grammar.
    """

    def __init__(self, tokenizer: Any, max_threads: int = 1) -> None:
        self._tokenizer = tokenizer
        self._max_threads = max_threads
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                tok = self._tokenizer
                info = xgr.TokenizerInfo.from_huggingface(
                    PreTrainedTokenizerFast(tokenizer_object=tok.backend),
                    vocab_size=tok.vocab_size, stop_token_ids=sorted(tok.eos_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (``xgrammar.CompiledGrammar``) for ``params``.

        Raises:
            ValueError: the schema, regex or grammar does not compile; the message starts
                with ``structured_outputs`` and carries xgrammar's reason.
        """
        compiler = self._get()
        kind, spec = params.key()
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":
                # an object, as OpenAI's json_object promises (xgrammar's builtin JSON
                # grammar would also take an array or a bare number)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(_choice_grammar(params.choice or ()))
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs: invalid {kind}: {_message(e)}") from None


class GrammarState:
    """One sequence's position in its grammar (an ``xgrammar.GrammarMatcher``).

    Only the engine thread touches it: the sampler fills its row of the step's bitmask,
    then advances it with the sampled token.
    """

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted its stop token: nothing may follow."""
        return bool(self.matcher.is_terminated())

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False if the grammar does not allow it (state unchanged)."""
        return bool(self.matcher.accept_token(int(token_id)))


def apply_grammar_masks(logits: Any, states: Iterable[tuple[int, GrammarState]]) -> Any:
    """Set the logits of tokens each row's grammar forbids to ``-inf``, in place.

    Args:
        logits: ``[num_rows, vocab_size]`` float32 (CPU or CUDA).
        states: ``(row, GrammarState)`` for the constrained rows.

    Returns:
        The ``[num_rows, ceil(vocab/32)]`` int32 bitmask (all bits set on unconstrained rows).
    """
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    rows = []
    for row, state in states:
        state.matcher.fill_next_token_bitmask(bitmask, row)
        rows.append(row)
    if rows:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return bitmask
