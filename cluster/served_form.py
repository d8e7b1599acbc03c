"""A chat row's messages and tools as SGLang's `/v1/chat/completions` gives them to the template.

    served = served_form(messages, tools, "messages", "tools")   # (messages, tools), or a reason

A capture's prompt must be the one the model is served: the server validates a request with
its own pydantic models (sglang/srt/entrypoints/openai/protocol.py), refuses what they refuse
(HTTP 400), and renders their dumps (serving_chat.py `_process_messages`, `_validate_request`):
unknown keys dropped (a user turn keeps only role and content; a function its name,
description, parameters, strict), a missing description null, a tool's `defer_loading` null,
a tool call's missing id and index null, a tool's parameters' DB-style types (`varchar`)
rewritten to JSON Schema's, and a parameters schema that is not one refused. These are SGLang's
own models and functions, so a new SGLang's rules come with it. A role the server does not
take (one data.roles adds, for a template that knows it) keeps every key. Content stays as
checked here (cluster/conversation.py: image parts in one shape; cluster/content_format.py
shapes it as the server does).
"""

from __future__ import annotations

import copy
import functools
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

# A turn of only these (checked: a string or parts) is served as itself, whatever its role.
_PLAIN = frozenset({"role", "content"})


@dataclass(frozen=True)
class _SGLang:
    """SGLang's message models by role (a user's, every other role's), its tool model, its
    rewrite of a tool's parameters and the schema check it runs on them."""

    user: Any
    generic: Any
    roles: frozenset[str]
    tool: Any
    normalize_types: Callable[[Any], None]
    check_schema: Callable[[Any], None]


@functools.cache
def _sglang() -> _SGLang:
    from jsonschema import Draft202012Validator
    from sglang.srt.entrypoints.openai import protocol
    from sglang.srt.function_call.utils import normalize_json_schema_types

    user, generic = (
        protocol.ChatCompletionMessageUserParam,
        protocol.ChatCompletionMessageGenericParam,
    )
    roles = frozenset(
        role
        for model in (user, generic)
        for role in typing.get_args(model.model_fields["role"].annotation)
    )
    return _SGLang(
        user,
        generic,
        roles,
        protocol.Tool,
        normalize_json_schema_types,
        Draft202012Validator.check_schema,
    )


def served_form(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, field: str, tools_field: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None] | str:
    """(the messages, the tools) as the server renders them, or why it refuses them."""
    served_tools = None
    if tools:
        served_tools = _served_tools(tools, tools_field)
        if isinstance(served_tools, str):
            return served_tools
    out = []
    for k, message in enumerate(messages):
        # As SGLang dumps it (most turns): spared the model, and a text job SGLang's import.
        if message.keys() <= _PLAIN:
            out.append(message)
            continue
        sglang = _sglang()
        if message["role"] not in sglang.roles:  # one data.roles adds: no request carries it
            out.append(message)
            continue
        # "": content is judged and shaped elsewhere (SGLang's part models take fewer shapes
        # than a dataset row may hold: `image` parts, `input_text`).
        model = sglang.user if message["role"] == "user" else sglang.generic
        try:
            dumped = model.model_validate({**message, "content": ""}).model_dump()
        except ValidationError as exc:
            return f"{field}[{k}]: SGLang refuses this message ({_first_error(exc)})"
        served = {key: value for key, value in dumped.items() if value is not None}
        out.append({**served, "content": message["content"]})
    return out, served_tools


def _served_tools(tools: list[dict[str, Any]], field: str) -> list[dict[str, Any]] | str:
    sglang = _sglang()
    from jsonschema.exceptions import SchemaError

    out = []
    for i, tool in enumerate(tools):
        try:
            model = sglang.tool.model_validate(copy.deepcopy(tool))  # the rewrite is in place
        except ValidationError as exc:
            return f"{field}[{i}]: SGLang refuses this tool ({_first_error(exc)})"
        if (parameters := model.function.parameters) is not None:
            try:
                sglang.normalize_types(parameters)
                sglang.check_schema(parameters)
            except SchemaError as exc:
                return f"{field}[{i}].function.parameters is not a JSON Schema: {exc.message}"
        out.append(model.model_dump())
    return out


def _first_error(exc: ValidationError) -> str:
    """A validation error's first complaint, where and what, without the input's value."""
    error = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(step) for step in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]
