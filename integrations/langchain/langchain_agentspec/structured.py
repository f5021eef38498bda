"""Structured output in LangChain's terms: schemas as ``response_format`` dicts, replies parsed back.

``response_format`` takes what LangChain and OpenAI-style callers pass: ``{"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}}}``, ``{"type": "json_object"}``, a bare JSON schema
(all read by ``agentspec.chat``), a pydantic model or a TypedDict (turned into the first form here).

``structured_parser`` turns the model's JSON reply into the schema's type for
``with_structured_output(method="json_schema" | "json_mode")``.
"""

from __future__ import annotations

import json
from typing import Any

from langchain_core.messages import BaseMessage
from langchain_core.runnables import RunnableLambda
from langchain_core.utils.function_calling import convert_to_json_schema
from pydantic import BaseModel


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


def openai_response_format(response_format: Any) -> dict | None:
    """``response_format`` as a dict ``agentspec.chat`` reads: a pydantic model or a TypedDict becomes
    ``{"type": "json_schema", ...}``; a dict (or None) is passed on as it is."""
    if response_format is None or isinstance(response_format, dict):
        return response_format
    try:
        schema = convert_to_json_schema(response_format)
    except Exception as exc:
        raise ValueError(
            f"response_format: cannot read a JSON schema from {response_format!r}: {exc}"
        ) from exc
    name = schema.get("title", "response")
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def structured_parser(schema: Any) -> RunnableLambda:
    """Parse a (whole) JSON reply into ``schema``'s type: a pydantic instance, else a dict.

    A RunnableLambda sees the complete message even when the chain is streamed, so a stream yields
    one parsed object at the end rather than partial, invalid ones.
    """

    def parse(message: BaseMessage) -> Any:
        text = message.text
        if is_pydantic_class(schema):
            if issubclass(schema, BaseModel):
                return schema.model_validate_json(text)
            return schema.parse_raw(text)
        return json.loads(text)

    return RunnableLambda(parse, name="parse_structured_output")
