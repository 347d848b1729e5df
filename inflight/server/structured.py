"""The API's spellings of structured output, mapped onto ``StructuredOutputsParams``.

Accepted, as OpenAI and vLLM define them: OpenAI's ``response_format`` (``text``,
``json_object``, ``json_schema``; https://platform.openai.com/docs/guides/structured-outputs),
vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` fields (https://docs.vllm.ai/en/latest/features/structured_outputs.html).
A request names at most one of them; the spec is compiled on a worker thread before the
request is queued, so a bad schema, regex or grammar is a 400 naming its field.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from inflight.errors import EngineError, InvalidRequestError
from inflight.server.error_responses import bad_request, to_openai
from inflight.structured_output import StructuredOutputsParams

if TYPE_CHECKING:
    from inflight.server.generation import ServerContext
    from inflight.server.protocol import SamplingRequest


def structured_outputs_of(req: SamplingRequest) -> tuple[StructuredOutputsParams, str] | None:
    """The body's structured-output spec and the field that carried it; None if none.

    Raises:
        OpenAIError: 400 when more than one field asks for one, or a field's value is
            malformed (``response_format`` of type ``json_schema`` without a schema).
    """
    found: list[tuple[StructuredOutputsParams, str]] = []

    def add(field: str, **spec: Any) -> None:
        try:
            found.append((StructuredOutputsParams(**spec), field))
        except ValueError as e:
            raise bad_request(str(e).replace("structured_outputs", field, 1),
                              param=field) from None

    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        add("response_format", json_object=True)
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format: json_schema.schema is required for type "
                              "json_schema", param="response_format")
        add("response_format", json=rf.json_schema.schema_)
    so = req.structured_outputs
    if so is not None:
        add("structured_outputs", json=so.json_, regex=so.regex, choice=so.choice,
            grammar=so.grammar, json_object=bool(so.json_object))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            add(name, **{key: value})
    if len(found) > 1:
        names = ", ".join(f for _, f in found)
        raise bad_request(f"only one structured output may be given, got {names}",
                          param=found[1][1])
    return found[0] if found else None


async def check_structured_outputs(
        ctx: ServerContext, req: SamplingRequest,
        forced: tuple[StructuredOutputsParams, str] | None = None,
) -> StructuredOutputsParams | None:
    """``structured_outputs_of`` compiled once off the event loop (errors are 400s naming
    the field); the engine's own compile then hits the compiler's cache. ``forced`` is a
    spec the server adds with the field it comes from (a forced tool call's parameters);
    the body may not ask for another."""
    found = structured_outputs_of(req)
    if forced is not None:
        if found is not None:
            raise bad_request(f"{found[1]}: cannot be combined with a forced tool_choice",
                              param=found[1])
        found = forced
    if found is None:
        return None
    params, field = found
    try:
        await asyncio.to_thread(ctx.engine.compile_grammar, params)
    except InvalidRequestError as e:
        raise bad_request(str(e).replace("structured_outputs", field, 1), param=field) from None
    except EngineError as e:
        raise to_openai(e) from None
    return params
