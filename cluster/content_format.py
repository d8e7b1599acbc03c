"""Content parts as a chat template takes them: parts for templates that iterate them, text
for templates that print a string.

    fmt = content_format(template, "auto")         # "openai" or "string"
    messages = for_template(messages, fmt)

`auto` decides as SGLang's server does (sglang/srt/parser/jinja_template_utils.py, itself
vLLM's `--chat-template-content-format auto`), so the captured prompt is the one SGLang serves:
a template that names images, audio, video or vision, or that loops over a message's content,
takes parts; any other takes a string, the text parts joined by a space. A tool turn's text
parts are always joined (SGLang's normalize_tool_content). An image part reaches a template
that takes parts as SGLang gives it, `{"type": "image"}` (the template renders its
placeholder; the image itself goes to the processor); a template that takes a string renders
no image, so a row with images is rejected there (`unrendered_image`).
"""

from __future__ import annotations

from typing import Any, Literal

import jinja2
import jinja2.nodes
from transformers.utils.chat_template_utils import _compile_jinja_template

from cluster.conversation import IMAGE_PART, TEXT_PART_TYPES

ContentFormat = Literal["openai", "string"]
_MESSAGE_NAMES = ("message", "msg", "m")  # what templates call the loop's message
_MULTIMODAL_WORDS = ("image", "audio", "video", "vision")


def content_format(template: str | None, setting: str) -> ContentFormat:
    """The setting where it is forced, else what the template's loops tell."""
    if setting in ("openai", "string"):
        return setting  # type: ignore[return-value]
    if not template:
        return "string"
    if any(word in template for word in _MULTIMODAL_WORDS):
        return "openai"
    try:  # transformers' environment: its {% generation %} tag included, as SGLang parses
        tree = _compile_jinja_template(template).environment.parse(template)
    except jinja2.TemplateError:
        return "string"  # rendering will say what is wrong, row by row
    for loop in tree.find_all(jinja2.nodes.For):
        if any(_reads_content(loop.iter, name) for name in _MESSAGE_NAMES):
            return "openai"
    return "string"


def _reads_content(node: jinja2.nodes.Node, name: str) -> bool:
    """`node` is `name.content` or `name['content']`, through filters, tests and slices."""
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) or (
        isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
    ):
        if node.node is None:
            return False
        node = node.node
    if isinstance(node, jinja2.nodes.Getattr):
        key, base = node.attr, node.node
    elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        key, base = node.arg.value, node.node
    else:
        return False
    return key == "content" and isinstance(base, jinja2.nodes.Name) and base.name == name


def unrendered_image(messages: list[dict[str, Any]], field: str, fmt: ContentFormat) -> str | None:
    """Why an image part of checked messages would not reach the template in format `fmt`:
    a template taking a string renders none, and a tool turn's content is joined text."""
    for k, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if part["type"] != IMAGE_PART:
                continue
            where = f"{field}[{k}].content[{j}]"
            if fmt == "string":
                return (
                    f"{where} is an image, but the chat template takes text content and "
                    "renders no images (data.content_format)"
                )
            if message["role"] == "tool":
                return (
                    f"{where} is an image in a tool turn, whose content the template gets as text"
                )
    return None


def joined_text(parts: list[dict[str, Any]]) -> str:
    return " ".join(p["text"] for p in parts if p.get("type") in TEXT_PART_TYPES)


def for_template(messages: list[dict[str, Any]], fmt: ContentFormat) -> list[dict[str, Any]]:
    """`messages` with list contents in the template's format (others as they are)."""
    if not any(isinstance(m.get("content"), list) for m in messages):
        return messages
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            if fmt == "string" or message["role"] == "tool":
                content = joined_text(content)
            else:
                content = [
                    {"type": "image"}
                    if p["type"] == IMAGE_PART
                    else {"type": "text", "text": p["text"]}
                    for p in content
                ]
            message = {**message, "content": content}
        out.append(message)
    return out
