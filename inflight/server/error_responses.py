"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports, from a malformed body to an engine fault, uses this body
(https://platform.openai.com/docs/guides/error-codes), so the official clients raise their
typed exceptions (``BadRequestError``, ``NotFoundError``, ...).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inflight.errors import EngineError, InvalidRequestError

logger = logging.getLogger(__name__)
# fastapi/routing.py: the detail of the 400 raised when a body cannot be read as JSON.
FASTAPI_BODY_DECODE_ERROR = "There was an error parsing the body"

_TYPES = {
    400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
    405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
    503: "server_error",
}


class OpenAIError(Exception):
    """An error response. Raise it anywhere in a route; the app turns it into the body.

    Args:
        status: HTTP status.
        message: human-readable text.
        param: the request field at fault, if any.
        code: machine-readable code (``model_not_found``, ``context_length_exceeded``, ...).
        type: OpenAI's error type; derived from ``status`` when None.
        headers: extra response headers (``Retry-After``, ``WWW-Authenticate``).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The JSON body of an error response (also the payload of an SSE error event)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def from_value_error(e: ValueError, param_names: dict[str, str] | None = None) -> OpenAIError:
    """400 from a ``ValueError`` whose message starts with ``field:`` (``SamplingParams``
    and the engine name the field so); ``param_names`` maps internal to API field names."""
    return to_openai(InvalidRequestError(str(e)), param_names)


def _field_of(message: str) -> str | None:
    field, sep, _ = message.partition(":")
    return field.strip() if sep and field.strip().isidentifier() else None


# EngineError.kind -> (HTTP status, OpenAI error code when the error names none).
_ENGINE_STATUS = {
    "invalid_request": (400, None),
    "overloaded": (503, "server_overloaded"),
    "unavailable": (503, "server_unavailable"),
    "engine_error": (500, "engine_error"),
}


def to_openai(e: EngineError, param_names: dict[str, str] | None = None) -> OpenAIError:
    """The HTTP edge's one conversion of an engine error into a response: 400 for input the
    engine can never run, 503 (with ``Retry-After`` on overload) while it cannot now, 500
    for a fault inside it. ``param_names`` maps engine field names (``prompt``,
    ``max_tokens``) to the API's (``messages``, ``max_completion_tokens``)."""
    status, code = _ENGINE_STATUS.get(e.kind, (500, "engine_error"))
    param = e.param or (_field_of(e.message) if status == 400 else None)
    if param and param_names:
        param = param_names.get(param, param)
    message = e.message
    if status == 500:
        message = f"the request failed in the engine: {message}"
    headers = None
    if e.retry_after is not None:
        headers = {"Retry-After": str(max(1, round(e.retry_after)))}
    return OpenAIError(status, message, param=param, code=e.code or code, headers=headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "set", "tuple"}


def _is_field(p: object) -> bool:
    # Our fields are snake_case; pydantic's union member tags are type names ("str",
    # "list[TextPart]", "TextPart", "function-after[...]").
    return isinstance(p, str) and p.isidentifier() and p == p.lower() and p not in _TYPE_TAGS


def _path(loc: tuple[Any, ...], stop_at_tag: bool) -> str:
    # "messages[0].content" from ("body", "messages", 0, "content", "list[TextPart]", 0):
    # with stop_at_tag the path ends at the union (the field the client sent), without it
    # the member's tag is skipped and the path goes on to the part at fault.
    out = ""
    for p in loc:
        if p == "body" and not out:
            continue
        if isinstance(p, int):
            out += f"[{p}]"
        elif _is_field(p):
            out += f".{p}" if out else p
        elif stop_at_tag:
            break
    return out


def _param_of(loc: tuple[Any, ...]) -> str | None:
    return _path(loc, stop_at_tag=True) or None


# pydantic error types that mean "not this JSON type", in plain words.
_EXPECTED = {
    "string_type": "a string", "int_type": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "bool_type": "a boolean", "list_type": "an array",
    "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
    "none_required": "null",
}


def _json_type(value: object) -> str:
    for t, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                    (list, "array"), (dict, "object")):
        if isinstance(value, t):
            return name
    return "null" if value is None else type(value).__name__


_WORDS = {"str": ("a string", "strings"), "int": ("an integer", "integers"),
          "float": ("a number", "numbers"), "bool": ("a boolean", "booleans"),
          "none": ("null", "nulls")}


def _describe(tag: str, plural: bool = False) -> str:
    """A union member's tag in words: ``list[list[int]]`` -> "an array of arrays of integers"."""
    tag = tag.removeprefix("constrained-")  # pydantic's tag of an Annotated[str, Field(...)]
    if tag.startswith("list[") and tag.endswith("]"):
        inner = _describe(tag[5:-1], plural=True)
        return f"arrays of {inner}" if plural else f"an array of {inner}"
    if tag.startswith("dict["):
        return "objects" if plural else "an object"
    if tag in _WORDS:
        return _WORDS[tag][plural]
    words = re.sub(r"(?<!^)(?=[A-Z])", " ", tag).lower()  # TextPart -> "text part"
    return f"{words} objects" if plural else f"a {words} object"


def _tag_of(loc: tuple[Any, ...]) -> str | None:
    return next((p for p in loc if isinstance(p, str) and p != "body" and not _is_field(p)), None)


def _plain(e: dict[str, Any]) -> str:
    kind = e.get("type")
    if kind == "missing":
        return "is required"
    if kind in ("string_too_short", "too_short") and (e.get("ctx") or {}).get("min_length") == 1:
        return "must not be empty"
    return str(e.get("msg"))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One plain sentence for the first invalid field, and that field's name.

    pydantic reports one error per member of a union (``messages.0.content.str`` and
    ``messages.0.content.list[TextPart]``); the client sent one field, so they are read
    together: a member whose type matched but whose value or inside is wrong names that
    (``messages[0].content[0].type``), else the field gets the forms it may take."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    param = _param_of(tuple(first.get("loc", ())))
    if param is None:
        if first.get("type") == "missing":
            return "the request body is required (a JSON object)", None
        return f"the request body: {first.get('msg')}", None
    group = [e for e in errors if _param_of(tuple(e.get("loc", ()))) == param]
    tags = list(dict.fromkeys(t for e in group if (t := _tag_of(tuple(e["loc"]))) is not None))
    # A member whose JSON type matched failed on its value or inside: that is the fault.
    matched = [e for e in group if e.get("type") not in _EXPECTED]
    got = f" (got {_json_type(first.get('input'))})"
    # Members whose container type matched (an array for an array) but whose element did
    # not: the element is at fault, with the forms it may take there.
    inside = [e for e in group if len(_path(tuple(e["loc"]), False)) > len(param)]
    if matched:
        e = matched[0]
        param = _path(tuple(e["loc"]), False)
        msg = f"{param}: {_plain(e)}"
    elif inside:
        param = _path(tuple(inside[0]["loc"]), False)
        at = [e for e in inside if _path(tuple(e["loc"]), False) == param]
        kinds = list(dict.fromkeys(_EXPECTED[e["type"]] for e in at))
        words = kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"
        msg = f"{param}: must be {words} (got {_json_type(at[0].get('input'))})"
    elif len(tags) > 1:
        kinds = [_describe(t) for t in tags]
        msg = f"{param}: must be {', '.join(kinds[:-1])} or {kinds[-1]}{got}"
    else:
        msg = f"{param}: must be {_EXPECTED[first['type']]}{got}"
    others = len({_param_of(tuple(e.get("loc", ()))) for e in errors}) - 1
    if others:
        msg += f" (and {others} more invalid field{'s' if others > 1 else ''})"
    return msg, param


def install_error_handlers(app: FastAPI) -> None:
    """Render validation failures as 400, HTTP errors and crashes in OpenAI's shape."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        ctype = request.headers.get("content-type", "")
        errors = exc.errors()
        body_not_object = bool(errors) and tuple(errors[0].get("loc", ())) == ("body",)
        if ctype and "json" not in ctype.lower() and body_not_object:
            # FastAPI parses only JSON content types; any other hands pydantic raw bytes,
            # whose "not a dict" message would send the user looking in the wrong place.
            return bad_request(f"the request body must be a JSON object sent as "
                               f"Content-Type: application/json (got {ctype!r})").response()
        message, param = _validation_message(exc)
        return bad_request(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400 and message == FASTAPI_BODY_DECODE_ERROR:
            # FastAPI's words when the bytes are not JSON text at all (not UTF-8, nested past
            # the decoder's depth); said as malformed JSON, as a syntax error is.
            message = "malformed JSON body: not decodable as UTF-8 JSON text (or nested too deeply)"
        return OpenAIError(exc.status_code, message,
                           headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        return OpenAIError(500, f"internal server error: {type(exc).__name__}").response()
