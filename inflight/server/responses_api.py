"""``POST /v1/responses``: the request body, and the response body for the OpenAPI document.

Fields follow OpenAI's Responses reference
(https://platform.openai.com/docs/api-reference/responses/create; the ``openai`` package's
``types/responses`` are the ground truth for names) as far as a stateless text server can
serve them, and vLLM's ``/v1/responses`` without its store
(``vllm/entrypoints/openai/responses/serving.py``): ``store`` is answered as false,
``previous_response_id`` is a 400. ``responses_serving`` maps the body onto a chat
completion; ``responses_stream`` sends its events.

Validation is strict, as for chat (``protocol.py``). Unknown fields are ignored, except
the Responses fields this server cannot honour (``REFUSED_FIELDS``): sent with a value
that would change the answer, they get a 400 naming them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from inflight.server.protocol import MAX_TOKENS_MARK, NonEmptyStr

# Responses fields that would change the answer and that this server does not implement;
# ``null``, ``false``, ``""``, ``[]``, ``{}`` (and ``truncation: "disabled"``) are inert.
REFUSED_FIELDS = ("background", "conversation", "prompt", "include", "max_tool_calls",
                  "top_logprobs", "truncation")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(_Strict):
    """A message's content part: ``input_text``, or ``output_text`` (an assistant turn
    fed back from an earlier response's output; its ``annotations`` are ignored)."""

    type: Literal["input_text", "output_text"]
    text: str


Content = str | Annotated[list[TextPart], Field(max_length=1024)]


def _joined(content: Content) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


class MessageItem(_Strict):
    """``{"role", "content"}`` (``type: "message"`` optional, OpenAI's EasyInputMessage);
    an earlier output's ``id`` and ``status`` are ignored."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content

    def text(self) -> str:
        """The content's text parts joined with newlines, as chat joins them."""
        return _joined(self.content)


class FunctionCallItem(_Strict):
    """A call the model made (an earlier response's ``function_call`` output item)."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str


class FunctionCallOutputItem(_Strict):
    """The result of the call ``call_id``, fed back as a chat ``tool`` message."""

    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: Content

    def text(self) -> str:
        """The output's text (parts joined with newlines)."""
        return _joined(self.output)


_ITEM_TAGS = {"message": "Message", "function_call": "FunctionCall",
              "function_call_output": "FunctionCallOutput"}


def _item_tag(value: Any) -> str | None:
    # A message may leave ``type`` out (OpenAI's EasyInputMessage). The tags are
    # capitalized so the error paths name the item (``input[2].role``), not the tag.
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return _ITEM_TAGS.get(kind) if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")] | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
    Discriminator(_item_tag, custom_error_type="input_item",
                  custom_error_message="must be an item of type message, function_call or "
                                       "function_call_output (text only)")]


class FormatText(_Strict):
    """``text.format: {"type": "text"}``: no constraint (the default)."""

    type: Literal["text"]


class FormatJsonObject(_Strict):
    """``text.format: {"type": "json_object"}``: any JSON object."""

    type: Literal["json_object"]


class FormatJsonSchema(_Strict):
    """``text.format`` of type ``json_schema``: the output validates against ``schema``."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False,
                              populate_by_name=True)
    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


def _format_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return {"text": "Text", "json_object": "JsonObject",
            "json_schema": "JsonSchema"}.get(kind) if isinstance(kind, str) else None


TextFormat = Annotated[
    Annotated[FormatText, Tag("Text")] | Annotated[FormatJsonObject, Tag("JsonObject")]
    | Annotated[FormatJsonSchema, Tag("JsonSchema")],
    Discriminator(_format_tag, custom_error_type="text_format",
                  custom_error_message="type must be text, json_object or json_schema")]


class TextConfig(_Strict):
    """``text``: the output's ``format`` (structured output); ``verbosity`` is ignored."""

    format: TextFormat | None = None


class FunctionTool(_Strict):
    """A ``tools[]`` entry, Responses' flat shape (only ``function`` tools are served)."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Strict):
    """``tool_choice: {"type": "function", "name": ...}``: that call is forced."""

    type: Literal["function"]
    name: NonEmptyStr


class ResponsesRequest(_Strict):
    """``POST /v1/responses``: ``input`` (a string, one user message, or a list of items)
    after ``instructions`` (a system message), through the chat template.

    ``max_output_tokens`` bounds the output (None: what ``max_model_len`` leaves, or
    ``--max-tokens-default``); ``text.format`` asks for structured output; ``tools`` and
    ``tool_choice`` are chat's (``server/tools.py``) in Responses' shapes. ``store`` is
    accepted and answered as false: nothing is kept, so ``previous_response_id`` is a 400.
    """

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = Field(None, description="a served model name; None: the first one")
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=4096)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, json_schema_extra={MAX_TOKENS_MARK: True})] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    store: bool | None = Field(None, description="accepted; answered as false (nothing is kept)")
    previous_response_id: str | None = Field(
        None, description="refused (400): this server keeps no responses")
    metadata: dict[str, str] | None = None
    user: str | None = None

    def refused_fields(self) -> list[str]:
        """``REFUSED_FIELDS`` sent with a value that would change the answer."""
        extra = self.model_extra or {}
        return [k for k in REFUSED_FIELDS if k in extra and not _inert(k, extra[k])]


def _inert(name: str, value: Any) -> bool:
    if value is None or value is False or value in ("", [], {}, 0):
        return True
    return name == "truncation" and value == "disabled"


# --- the response body, for the OpenAPI document (the routes build plain dicts) ----------
class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    """A streamed response that failed after its 200 (``response.failed``)."""

    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """``POST /v1/responses`` without ``stream`` (with it: ``text/event-stream`` of
    ``response.*`` events, ``response.completed`` or ``response.incomplete`` last)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "cancelled", "failed", "in_progress"]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage | OutputFunctionCall]
    parallel_tool_calls: bool
    previous_response_id: None
    store: Literal[False]
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    metadata: dict[str, str]
    user: str | None
