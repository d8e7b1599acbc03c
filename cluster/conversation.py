"""Chat rows as users bring them, checked and put in one shape: OpenAI messages plus tools.

    conv = parse_openai(row["messages"], row.get("tools"), "messages", "tools", roles)
    conv = parse_sharegpt(row["conversations"], row.get("tools"), row.get("system"), ...)
    # a Conversation(messages, tools), or a reject reason naming the field and what is wrong

The shapes are checked here: null members dropped, a null content "", a tool call's JSON
`arguments` string the object it holds, as SGLang's /v1/chat/completions does; the messages
and tools then pass through SGLang's own request models (cluster/served_form.py), so the
captured prompt is the served one. Content parts stay parts here, an image part as
{"type": "image", "image": its source} whatever shape it came in (LLaMA-Factory's row-level
images placed at their tags: `place_row_images`); cluster/content_format.py shapes them for
the template. The accepted shapes, with a row of each: docs/input-formats.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.row_values import RowValueError, bad_value, load_json

# ShareGPT's `from` values and their roles, as the common converters map them (FastChat,
# LLaMA-Factory, axolotl). `function_call` is an assistant turn calling tools.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
    "function_call": "assistant",
}
SHAREGPT_SYSTEM_FIELD = "system"  # a ShareGPT row's system prompt (LLaMA-Factory's)
TEXT_PART_TYPES = ("text", "input_text")
IMAGE_PART_TYPES = ("image_url", "image", "input_image")
IMAGE_PART = "image"  # an image part as checked: {"type": "image", "image": its source}
_IMAGE_KEYS = ("image", "url", "path")  # where transformers' image parts hold the source


@dataclass(frozen=True)
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


def type_name(value: Any) -> str:
    names = {type(None): "null", dict: "object", str: "string", bool: "bool"}
    return names.get(type(value), type(value).__name__)


def parse_tools(tools: Any, field: str) -> list[dict[str, Any]] | str | None:
    """A row's tool definitions: a list of objects, or a JSON string holding one (as many
    datasets store them); None: the row has none."""
    if tools is None or tools == "":  # "": LLaMA-Factory's "no tools"
        return None
    if isinstance(tools, str):
        try:
            tools = load_json(tools)
        except RowValueError as exc:
            return f"{field} is a string but not JSON: {exc}"
        if reason := bad_value(tools, field):
            return reason
    if not isinstance(tools, list):
        return f"{field} must be a list, got {type_name(tools)}"
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            return f"{field}[{i}] must be an object, got {type_name(tool)}"
    # A bare function definition (LLaMA-Factory's), in the OpenAI shape a server takes.
    wrapped = [
        {"type": "function", "function": t} if "function" not in t and "name" in t else t
        for t in tools
    ]
    return wrapped or None


def _not_a_list(items: Any, field: str) -> str | None:
    if not isinstance(items, list):
        return f"{field} must be a list, got {type_name(items)}"
    return None if items else f"empty {field}"


def parse_openai(
    messages: Any, tools: Any, field: str, tools_field: str, roles: list[str]
) -> Conversation | str:
    """OpenAI chat messages: string or parts content, assistant tool calls, tool results."""
    parsed_tools = parse_tools(tools, tools_field)
    if isinstance(parsed_tools, str):
        return parsed_tools
    if reason := _not_a_list(messages, field):
        return reason
    out = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            return f"{where} must be an object, got {type_name(message)}"
        message = {k: v for k, v in message.items() if v is not None}
        checked = _check_message(message, where, roles)
        if isinstance(checked, str):
            return checked
        out.append(checked)
    return Conversation(out, parsed_tools)


def _check_message(message: dict[str, Any], where: str, roles: list[str]) -> dict[str, Any] | str:
    role = message.get("role")
    if not isinstance(role, str):
        return f"{where}.role must be a string, got {type_name(role)}"
    if role not in roles:
        return f"{where}.role {role!r} is not one of data.roles {roles}"
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        return f"{where}.reasoning_content must be a string, got {type_name(reasoning)}"
    calls = message.get("tool_calls")
    if calls == []:  # what many logs write for "no calls"
        message = {k: v for k, v in message.items() if k != "tool_calls"}
        calls = None
    if calls is not None:
        if role != "assistant":
            return f"{where} has tool_calls but is a {role} turn"
        calls = _check_tool_calls(calls, f"{where}.tool_calls")
        if isinstance(calls, str):
            return calls
        message = {**message, "tool_calls": calls}
    content = message.get("content")
    if content is None:
        if not calls:
            return f"{where}.content is null (allowed only on an assistant turn with tool_calls)"
        return {**message, "content": ""}
    if isinstance(content, list):
        parts = _check_parts(content, f"{where}.content")
        if isinstance(parts, str):
            return parts
        return message if parts is content else {**message, "content": parts}
    if not isinstance(content, str):
        return f"{where}.content must be a string or a list of parts, got {type_name(content)}"
    return message


def _check_tool_calls(calls: Any, where: str) -> list[dict[str, Any]] | str:
    if not isinstance(calls, list) or not calls:
        return f"{where} must be a non-empty list, got {type_name(calls)}"
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            return f"{where}[{j}] must be an object with a function object"
        name = function.get("name")
        if not isinstance(name, str) or not name:
            return f"{where}[{j}].function.name must be a non-empty string"
        arguments = function.get("arguments")
        if arguments is None:  # absent or null: a call without arguments
            arguments = {}
        if isinstance(arguments, str):  # OpenAI's JSON text; templates want the object
            try:
                arguments = load_json(arguments)
            except RowValueError as exc:
                return f"{where}[{j}].function.arguments is not valid JSON: {exc}"
            if reason := bad_value(arguments, f"{where}[{j}].function.arguments"):
                return reason
        if not isinstance(arguments, dict):
            return f"{where}[{j}].function.arguments must be a JSON object"
        out.append(
            {
                **call,
                "type": call.get("type", "function"),
                "function": {**function, "arguments": arguments},
            }
        )
    return out


def _check_parts(parts: list[Any], where: str) -> list[dict[str, Any]] | str:
    """The parts, image parts in one shape (`parts` itself where there is none), or why not."""
    if not parts:
        return f"{where} is an empty list of parts"
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PART_TYPES:
            if not isinstance(part.get("text"), str):
                return f"{where}[{j}].text must be a string, got {type_name(part.get('text'))}"
        elif kind in IMAGE_PART_TYPES:
            source, reason = _image_source(part, f"{where}[{j}]")
            if reason:
                return reason
            part = {"type": IMAGE_PART, "image": source}
        elif isinstance(part, dict):
            return f"{where}[{j}].type {kind!r} is not a text or image part"
        else:
            return f"{where}[{j}] must be an object, got {type_name(part)}"
        out.append(part)
    return parts if all(a is b for a, b in zip(out, parts, strict=True)) else out


def _image_source(part: dict[str, Any], where: str) -> tuple[str, str | None]:
    """(an image part's source, a URL or a path; or why it has none) from OpenAI's
    `image_url` ({"url": U} or U; `input_image` too) or transformers' `image`, `url` or
    `path`."""
    if part["type"] == "image":
        held = [key for key in _IMAGE_KEYS if part.get(key) is not None]
        if len(held) != 1:
            return "", f"{where} must hold one of {', '.join(_IMAGE_KEYS)}"
        key = held[0]
        value = part[key]
    else:
        key, value = "image_url", part.get("image_url")
        if isinstance(value, dict):
            key, value = "image_url.url", value.get("url")
    if not isinstance(value, str):
        return "", f"{where}.{key} must be a string, got {type_name(value)}"
    if not value:
        return "", f"{where}.{key} is an empty string"
    return value, None


def image_sources(messages: list[dict[str, Any]], field: str) -> list[tuple[str, str]]:
    """(where, source) of each image part of checked messages, in prompt order."""
    return [
        (f"{field}[{k}].content[{j}]", part["image"])
        for k, message in enumerate(messages)
        if isinstance(message.get("content"), list)
        for j, part in enumerate(message["content"])
        if part.get("type") == IMAGE_PART
    ]


def place_row_images(
    messages: list[dict[str, Any]], images: Any, tag: str, field: str, images_field: str
) -> list[dict[str, Any]] | str:
    """LLaMA-Factory's multimodal rows: a row-level list of image sources (`images_field`), each
    placed where its `tag` (`<image>`) stands in the turns' text, in order: the turns as content
    parts. An image part beside them, or a count of tags other than the images', is refused:
    no image is dropped and no tag stays text."""
    if not isinstance(images, list):
        return f"{images_field} must be a list of image sources, got {type_name(images)}"
    for i, source in enumerate(images):
        if not isinstance(source, str) or not source:
            return f"{images_field}[{i}] must be a non-empty string (a path or URL)"
    if image_sources(messages, field):
        return f"row has both image parts in {field} and a row-level {images_field} list"
    tags = sum(text.count(tag) for m in messages for text in _texts(m))
    if tags != len(images):
        return f"{field} holds {tags} {tag} tags for the {len(images)} images of {images_field}"
    if not images:
        return messages
    sources = iter(images)

    def split(text: str) -> list[dict[str, Any]]:
        pieces = text.split(tag)
        parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
        for piece in pieces[1:]:
            parts.append({"type": IMAGE_PART, "image": next(sources)})
            if piece:
                parts.append({"type": "text", "text": piece})
        return parts

    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str) and tag in content:
            message = {**message, "content": split(content)}
        elif isinstance(content, list) and any(tag in text for text in _texts(message)):
            parts = [q for p in content for q in (split(p["text"]) if "text" in p else [p])]
            message = {**message, "content": parts}
        out.append(message)
    return out


def _texts(message: dict[str, Any]) -> list[str]:
    """A checked message's content as its text pieces."""
    content = message["content"]
    return [content] if isinstance(content, str) else [p["text"] for p in content if "text" in p]


def by_digest(messages: list[dict[str, Any]], digests: list[str]) -> list[dict[str, Any]]:
    """The messages with their image parts, in prompt order, naming `digests` in place of their
    sources: `{"type": "image", "digest": ...}` (the image in the store, hsx_store/images.py)."""
    named = iter(digests)

    def part(p: dict[str, Any]) -> dict[str, Any]:
        return {"type": IMAGE_PART, "digest": next(named)} if p.get("type") == IMAGE_PART else p

    out = [
        {**m, "content": [part(p) for p in m["content"]]}
        if isinstance(m.get("content"), list)
        else m
        for m in messages
    ]
    assert next(named, None) is None, "one digest per image part"
    return out


def parse_sharegpt(
    turns: Any, tools: Any, system: Any, field: str, tools_field: str, roles: list[str]
) -> Conversation | str:
    """ShareGPT `[{"from": ..., "value": ...}, ...]`, with LLaMA-Factory's optional row-level
    `system` prompt and `tools`; a `function_call` value is the JSON of one call
    (`{"name", "arguments"}`) or a list of them (parallel calls)."""
    parsed_tools = parse_tools(tools, tools_field)
    if isinstance(parsed_tools, str):
        return parsed_tools
    if reason := _not_a_list(turns, field):
        return reason
    messages: list[dict[str, Any]] = []
    if system is not None:
        if not isinstance(system, str):
            return f"system must be a string, got {type_name(system)}"
        if system:
            messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        where = f"{field}[{i}]"
        message = _sharegpt_message(turn, where)
        if not isinstance(message, str):
            message = _check_message(message, where, roles)
        if isinstance(message, str):
            return message
        messages.append(message)
    return Conversation(messages, parsed_tools)


def _sharegpt_message(turn: Any, where: str) -> dict[str, Any] | str:
    if not isinstance(turn, dict):
        return f"{where} must be an object, got {type_name(turn)}"
    speaker, value = turn.get("from"), turn.get("value")
    if not isinstance(speaker, str):
        return f"{where}.from must be a string, got {type_name(speaker)}"
    if speaker not in SHAREGPT_ROLES:
        return f"{where}.from {speaker!r} is not a ShareGPT role ({', '.join(SHAREGPT_ROLES)})"
    if not isinstance(value, str):
        return f"{where}.value must be a string, got {type_name(value)}"
    if speaker != "function_call":
        return {"role": SHAREGPT_ROLES[speaker], "content": value}
    try:
        calls = load_json(value)
    except RowValueError as exc:
        return f"{where}: a function_call value must be JSON ({exc})"
    if reason := bad_value(calls, f"{where}.value"):
        return reason
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and "name" in c for c in calls):
        return f'{where}: a function_call value must be {{"name", "arguments"}} or a list of them'
    functions = [{"name": c["name"], "arguments": c.get("arguments", {})} for c in calls]
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": f} for f in functions],
    }
