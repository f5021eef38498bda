"""What a request's tools, ``tool_choice`` and ``response_format`` allow the reply to be, as a grammar.

- tool_choice "any" or a tool's name: the reply is tool calls (to that tool), arguments valid
  under each tool's schema.
- tool_choice None/"auto": the model may answer instead; a ``<tool_call>`` it opens must be valid.
  With a ``response_format`` too (``create_agent``'s provider strategy binds both), the answer
  is a JSON value valid under that schema.
- ``response_format`` alone: the reply is that JSON value.

``response_format`` takes what LangChain and OpenAI-style callers pass: ``{"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}}}``, ``{"type": "json_object"}``, a bare JSON schema,
a pydantic model or a TypedDict.

``structured_parser`` turns the model's JSON reply into the schema's type for
``with_structured_output(method="json_schema" | "json_mode")``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.runnables import RunnableLambda
from langchain_core.utils.function_calling import convert_to_json_schema
from pydantic import BaseModel

from agentspec import grammar as G


def is_pydantic_class(schema: Any) -> bool:
    if not isinstance(schema, type):
        return False
    if issubclass(schema, BaseModel):
        return True
    try:  # pydantic.v1 models (langchain still accepts them)
        from pydantic.v1 import BaseModel as V1Model

        return issubclass(schema, V1Model)
    except ImportError:  # pragma: no cover
        return False


def response_schema(response_format: Any) -> dict | None:
    """The JSON schema a ``response_format`` asks for (None: no constraint on the answer)."""
    if response_format is None:
        return None
    if isinstance(response_format, dict):
        kind = response_format.get("type")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ValueError('response_format {"type": "json_schema"} needs json_schema.schema, a dict')
            return schema
        if kind == "json_object":
            return {"type": "object"}
        if kind == "text":
            return None
        if "properties" in response_format or kind == "object" or "$schema" in response_format:
            return response_format  # a bare JSON schema
        raise ValueError(
            f"response_format: expected {{'type': 'json_schema' | 'json_object' | 'text', ...}}, a JSON "
            f"schema, a pydantic model or a TypedDict, got {response_format!r}"
        )
    try:
        return convert_to_json_schema(response_format)
    except Exception as exc:
        raise ValueError(
            f"response_format: cannot read a JSON schema from {response_format!r}: {exc}"
        ) from exc


def output_grammar(
    tools: Sequence[dict], tool_choice: str | None, answer: dict | None, tool_format: str, single: bool
) -> G.Grammar | None:
    """The grammar of the whole reply, or None when the reply is free text.

    ``tools``: the bound tools the reply may call (empty: none may be called); ``tool_choice``
    normalised by ``normalise_tool_choice`` ("any", a name, or None for auto).
    """
    if tools:
        if tool_choice is None:
            return G.tool_calls(tools, "auto", tool_format=tool_format, single=single, answer=answer)
        chosen = [t for t in tools if t["function"]["name"] == tool_choice] or list(tools)
        return G.tool_calls(chosen, "any", tool_format=tool_format, single=single)
    if answer is not None:
        return G.json_schema(answer)
    return None


def structured_parser(schema: Any) -> RunnableLambda:
    """Parse a (whole) JSON reply into ``schema``'s type: a pydantic instance, else a dict.

    A RunnableLambda sees the complete message even when the chain is streamed, so a stream yields
    one parsed object at the end rather than partial, invalid ones.
    """

    def parse(message: Any) -> Any:
        text = message.content if hasattr(message, "content") else message
        if not isinstance(text, str):
            text = message.text
        if is_pydantic_class(schema):
            if issubclass(schema, BaseModel):
                return schema.model_validate_json(text)
            return schema.parse_raw(text)
        return json.loads(text)

    return RunnableLambda(parse, name="parse_structured_output")
