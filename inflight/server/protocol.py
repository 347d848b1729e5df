"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Fields follow OpenAI's Completions and Chat Completions references
(https://platform.openai.com/docs/api-reference/completions,
https://platform.openai.com/docs/api-reference/chat) plus vLLM's extra sampling fields
(``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``repetition_penalty``,
``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``prompt_logprobs``;
https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html). Validation is strict
(``"5"`` is not an integer, ``NaN`` is not a number); unknown fields are ignored, as in vLLM.
Value ranges of sampling fields are checked by ``SamplingParams``, which names the field.
"""

from __future__ import annotations

from typing import Any, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.config import JsonDict

from inflight.request import RequestOptions

# A cap on ``n`` so one request cannot queue an unbounded number of sequences.
MAX_N = 128
MAX_LOGPROBS = 20
# OpenAI's legacy completions, and vLLM's, generate 16 tokens when the body leaves
# ``max_tokens`` out (``serving.completion_max_tokens`` applies it).
COMPLETION_DEFAULT_MAX_TOKENS = 16


# Value ranges are declared here so /openapi.json says what the server accepts (a client or
# a fuzzer learns them there); SamplingParams checks them again for the offline API.
# The app's OpenAPI document fills in this server's bounds where these marks stand
# (server/openapi.py): the vocabulary size, max_model_len, and whether "" has a token.
TOKEN_ID_MARK = "x-inflight-token-id"
MAX_TOKENS_MARK = "x-inflight-max-tokens"
PROMPT_TEXT_MARK = "x-inflight-prompt-text"
# A completions text prompt. "" is its BOS alone where the tokenizer adds one (vLLM's and
# llama.cpp's behaviour) and a 400 where it adds none: the document's minLength says which.
PromptText = Annotated[str, Field(json_schema_extra={PROMPT_TEXT_MARK: True})]
NonEmptyStr = Annotated[str, Field(min_length=1)]
StopString = NonEmptyStr
TokenId = Annotated[int, Field(ge=0, json_schema_extra={TOKEN_ID_MARK: True})]
# ``max_tokens: 0`` is one policy everywhere (vLLM's): the prompt is prefilled, nothing is
# generated, ``finish_reason`` is ``length`` and ``usage.completion_tokens`` 0 (docs/server.md).
MaxTokens = Annotated[int, Field(ge=0, json_schema_extra={MAX_TOKENS_MARK: True})]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    """``stream_options`` (OpenAI's): ``include_usage`` adds a last chunk with ``usage`` and no
    choices, and ``"usage": null`` on every other chunk; vLLM's ``continuous_usage_stats``
    (with ``include_usage``) puts the running usage on every chunk instead."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


# OpenAI / vLLM request fields this server does not implement. Sent with a value that
# would change the output, they get a 400 naming the field rather than being ignored;
# other unknown fields (``user``, ``metadata``, ``store``, ...) are ignored, as OpenAI does.
# ``echo`` and ``best_of`` are completions fields (``CompletionRequest`` declares them):
# sent to chat they are refused here.
UNSUPPORTED_FIELDS = frozenset({
    "functions",
    "function_call", "echo", "suffix", "best_of", "chat_template",
    "chat_template_kwargs", "continue_final_message", "logits_processors",
    "audio", "modalities", "prediction", "bad_words", "allowed_token_ids",
})


def _is_inert(name: str, value: Any, n: int) -> bool:
    """Whether an unsupported field's value asks for nothing beyond the defaults."""
    if value is None or value is False or value in ("", {}, []):
        return True
    return name == "best_of" and value == n


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema`` (OpenAI's): the schema the output must satisfy."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False,
                              populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format`` (OpenAI's): ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema`` (the output validates against ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs`` object: exactly one of ``json`` (a JSON schema),
    ``regex``, ``choice``, ``grammar`` (EBNF, start rule ``root``), ``json_object``."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False,
                              populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    def unsupported_fields(self) -> list[str]:
        """Fields of ``UNSUPPORTED_FIELDS`` sent with a value that matters."""
        extra = self.model_extra or {}
        return [k for k, v in extra.items()
                if k in UNSUPPORTED_FIELDS and not _is_inert(k, v, self.n)]

    model: str | None = Field(None, description="a served model name; None: the first one")
    max_tokens: MaxTokens | None = Field(
        None, description="output tokens per choice; None: up to max_model_len")
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = None
    # A signed 64-bit integer, as OpenAI documents; torch's generators take no wider seed.
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters.
    top_k: Annotated[int, Field(ge=-1, description="-1 or 0: disabled")] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, description="at most max_tokens")] = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's prompt logprobs: per prompt token (None for the first) its logprob, rank and
    # the top ``prompt_logprobs`` alternatives. Not with stream=true (as vLLM; 0 is inert).
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # OpenAI's: token id (a decimal string) -> bias in [-100, 100] added to its logit
    # before sampling; returned logprobs stay the model's raw ones (vLLM's default).
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # Structured output (``server/structured.py`` maps these; at most one per request).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # vLLM's; accepted and ignored (xgrammar)
    # Scheduling (vLLM's ``priority``; inflight's latency targets for --scheduling-policy slo).
    priority: int = 0
    ttft_slo: Annotated[float, Field(gt=0)] | None = None
    itl_slo: Annotated[float, Field(gt=0)] | None = None
    # vLLM's: requests share cached prefix blocks only when their salts are equal.
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    def options(self) -> RequestOptions:
        """The scheduler's per-request fields."""
        return RequestOptions(self.priority, self.ttft_slo, self.itl_slo)


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``.

    ``prompt`` is a string, a list of strings, a list of token ids, or a list of such lists;
    each prompt becomes ``n`` choices, indexed ``prompt_index * n + i``. ``logprobs`` asks
    for that many top log-probabilities per token (0..20; the sampled token's own is
    always included). ``echo`` puts the prompt text before each choice's text and, with
    ``logprobs``, the prompt tokens' logprobs before the generated ones (the first prompt
    token's are null), as OpenAI's legacy API and vLLM; ``max_tokens: 0`` generates
    nothing (``finish_reason`` ``length``), with ``echo`` the scoring request. ``best_of`` (>= n, not with stream) generates that many
    candidates per prompt and returns the ``n`` with the highest cumulative logprob.
    ``prompt_logprobs`` (vLLM's) adds ``prompt_logprobs`` to each choice. ``suffix`` is not
    supported and answered with 400. ``max_tokens`` left out is 16, as in OpenAI's legacy
    API and vLLM (``serving.completion_max_tokens``); ``null`` runs to the context's end. A
    text prompt may be ``""``: it is the BOS alone where the tokenizer adds one (vLLM and
    llama.cpp's server generate from it), else a 400 (no tokens).
    """

    prompt: (PromptText | Annotated[list[PromptText], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: MaxTokens | None = \
        Field(COMPLETION_DEFAULT_MAX_TOKENS, description="output tokens per choice; left out: 16 (OpenAI's and vLLM's "
                                "default); null: up to max_model_len; 0: nothing "
                                "generated (with echo: scoring the prompt)")
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None


class TextPart(_Strict):
    """A ``{"type": "text", "text": ...}`` content part (the only kind supported)."""

    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    """A call the assistant made: the function's name and its arguments as JSON text."""

    name: NonEmptyStr
    arguments: str


class ToolCall(_Strict):
    """An assistant message's ``tool_calls[]`` entry (OpenAI's shape)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# The rule the validators below enforce, said in the document too (fuzzers and clients
# read it there): content is required, except on an assistant message with tool calls.
_MESSAGE_RULE: JsonDict = {"anyOf": [
    {"properties": {"role": {"const": "assistant"}},
     "anyOf": [{"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
               {"required": ["tool_calls"], "properties": {"tool_calls": {"minItems": 1}}}]},
    {"properties": {"role": {"enum": ["system", "developer", "user", "tool"]},
                    "content": {"not": {"type": "null"}}, "tool_calls": {"type": "null"}},
     "required": ["content"]},
]}


class ChatMessage(_Strict):
    """One chat message; list content is joined into one string (text parts only).

    ``content`` may be null only on an assistant message that carries ``tool_calls``; a
    ``tool`` message answers the call named by ``tool_call_id``."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False,
                              json_schema_extra=_MESSAGE_RULE)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Declared before ``content`` so that its check sees them (an error names the field).
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""

    @field_validator("tool_calls")
    @classmethod
    def _calls_from_assistant(cls, v: Any, info: ValidationInfo) -> Any:
        if v and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return v

    @field_validator("content")
    @classmethod
    def _content_or_calls(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and not (info.data.get("role") == "assistant"
                              and info.data.get("tool_calls")):
            raise ValueError("required unless an assistant message has tool_calls")
        return v


class FunctionDefinition(_Strict):
    """``tools[].function``: a name, what it does, and its parameters' JSON schema."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    """One entry of ``tools`` (OpenAI's: functions only)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: NonEmptyStr


class NamedToolChoice(_Strict):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``.

    ``messages`` go through the model's chat template (``add_generation_prompt`` as
    vLLM). ``max_completion_tokens`` takes precedence over the deprecated ``max_tokens``.
    ``logprobs=true`` returns the sampled token's log-probability, ``top_logprobs`` (0..20)
    that many alternatives. ``prompt_logprobs`` (vLLM's) adds ``prompt_logprobs`` to the
    response. ``tools`` and ``tool_choice`` as OpenAI's (``server/tools.py``).
    ``echo`` and ``best_of`` other than ``n`` are not supported (400).
    """

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # False: at most one call (OpenAI's meaning); ``required`` then makes exactly one.
    parallel_tool_calls: bool = True


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM): either ``prompt`` or ``messages``.

    ``add_special_tokens`` defaults to true for a prompt (as completions tokenize it) and
    false for messages (the template already holds them).
    """

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM): token ids to text."""

    model: str | None = None
    tokens: list[TokenId]
