"""What SGLang's `/v1/chat/completions` hands the chat template, from SGLang's own code.

    messages, tools = served_template_inputs(messages, tools)   # or SGLangRefused(reason)

The request is validated by SGLang's ChatCompletionRequest and run through the real
`OpenAIServingChat._validate_request` (its tool schema checks, which rewrite DB-style types) and
`_process_messages` (sglang/srt/entrypoints/openai/serving_chat.py), with a tokenizer that records
its `apply_chat_template` call instead of rendering: an independent reference for the planner's
normalization (cluster/served_form.py), which reuses only SGLang's models.
"""

from __future__ import annotations

import types
from collections import OrderedDict
from typing import Any

# A last turn the server would treat as a request's (an assistant turn to continue becomes a
# user turn): the rows planned are whole conversations, so one is added and dropped again.
_TAIL = {"role": "user", "content": "HSX-REFERENCE-TAIL"}


class SGLangRefused(Exception):
    """The server would answer 400: its reason."""


class _RecordingTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
        self.recorded = {"messages": messages, **kwargs}
        return "PROMPT"

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return [1]


def _serving_chat(tokenizer: _RecordingTokenizer, content_format: str) -> Any:
    """An OpenAIServingChat with only what the Jinja path reads (no server, no model)."""
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

    chat = OpenAIServingChat.__new__(OpenAIServingChat)
    chat.tokenizer_manager = types.SimpleNamespace(
        tokenizer=tokenizer,
        served_model_name="m",
        model_config=types.SimpleNamespace(is_multimodal=False),
    )
    chat.template_manager = types.SimpleNamespace(
        chat_template_name=None,
        jinja_template_content_format=content_format,
        jinja_template_may_reorder_tool_results=False,
        reasoning_config=None,
        python_chat_template=None,
    )
    for name in ("chat_encoding_spec", "_encoding_adapter", "reasoning_parser", "tool_call_parser"):
        setattr(chat, name, None)
    for name in ("is_minimax_m3", "is_gpt_oss", "is_gemma4"):
        setattr(chat, name, False)
    chat._reasoning_detector = None
    chat.default_chat_template_kwargs = {}
    chat._prompt_text_round_trip_is_lossy = chat._tokenizer_auto_adds_specials = False
    chat._chat_template_cache = OrderedDict()
    chat._thinking_requested = lambda request: False
    return chat


def served_template_inputs(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    content_format: str = "openai",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) as SGLang passes them to `apply_chat_template` for this request."""
    from pydantic import ValidationError
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    body: dict[str, Any] = {"model": "m", "messages": [*messages, _TAIL]}
    if tools is not None:
        body["tools"] = tools
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise SGLangRefused(str(exc)) from None
    tokenizer = _RecordingTokenizer()
    chat = _serving_chat(tokenizer, content_format)
    try:
        refused = chat._validate_request(request)
    except Exception as exc:  # past the checks it needs a running server's model; too late
        if "model" not in str(exc):
            raise
        refused = None
    if refused:
        raise SGLangRefused(refused)
    try:
        chat._process_messages(request, False)
    except ValueError as exc:  # arguments that are not a JSON object: a 400
        raise SGLangRefused(str(exc)) from None
    served = tokenizer.recorded["messages"]
    assert served[-1]["content"] == _TAIL["content"]
    return served[:-1], tokenizer.recorded.get("tools")
