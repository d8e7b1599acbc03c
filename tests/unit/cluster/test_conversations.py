"""Conversations with tools, reasoning and content parts, held to references outside the planner.

Real chat templates (tests/chat_templates/, sources in its README) plan agentic rows to exactly
the tokens `apply_chat_template` gives for messages written here by hand in the form the
template should get; masks equal transformers' own `{% generation %}` masks, or hand-written
turn texts; ShareGPT rows equal their OpenAI twins; Parquet and datasets directories equal
JSONL; the content format equals SGLang's own detection.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster.config import DataConfig
from cluster.content_format import content_format
from cluster.conversation import parse_openai
from cluster.images import NO_IMAGE_TOKEN
from cluster.plan import Plan, Reject, build_plan
from cluster.plan_encode import UNRENDERED
from tests.helpers.prompts import write_jsonl
from tests.helpers.sglang_chat import served_template_inputs
from tools.tiny_models import CHAT_TEMPLATE as TINY_TEMPLATE

TEMPLATES = Path(__file__).resolve().parents[2] / "chat_templates"
KIMI_TOKENS = [
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_system|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]
LLAMA3_TOKENS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
SHAREGPT_ROLE_LIST = (
    "human, user, gpt, assistant, chatgpt, system, tool, observation, function_response, "
    "function_call"
)


def function(name: str, description: str, **properties: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": [next(iter(properties))]}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": schema},
    }


TOOLS = [
    function(
        "get_weather",
        "Current weather in a city",
        city={"type": "string", "description": "City name"},
        unit={"type": "string", "enum": ["celsius", "fahrenheit"]},
    ),
    function("search_web", "Search the web", query={"type": "string"}),
    function("get_time", "Local time in a timezone", timezone={"type": "string"}),
]


def call(call_id: str, name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# -- the rows, as users bring them --------------------------------------------------------------

PARALLEL = {  # a parallel call: two calls in one turn, two tool results in a row
    "id": "parallel",
    "tools": TOOLS,
    "messages": [
        {"role": "system", "content": "You are a travel assistant."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Weather in Paris,"},
                {"type": "input_text", "text": "and any news?"},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two lookups at once.",
            "tool_calls": [
                call(
                    "functions.get_weather:0",
                    "get_weather",
                    '{"city": "Paris", "unit": "celsius"}',
                ),
                call("functions.search_web:1", "search_web", {"query": "Paris news"}),
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "functions.get_weather:0",
            "name": "get_weather",
            "content": "18C, sunny",
        },
        {
            "role": "tool",
            "tool_call_id": "functions.search_web:1",
            "name": "search_web",
            "content": "A new bridge opened.",
        },
        {
            "role": "assistant",
            "content": "It is 18C and sunny; a new bridge opened.",
            "reasoning_content": "Both answers are in.",
        },
    ],
}
ENDS_IN_CALL = {  # content "", arguments as an object, the row's last turn a call
    "id": "ends-in-call",
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "What time is it in Tokyo?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Ask the clock.",
            "tool_calls": [call("functions.get_time:0", "get_time", {"timezone": "Asia/Tokyo"})],
        },
    ],
}
TEXT_AND_CALL = {  # text with a call (arguments as JSON text), then more turns
    "id": "text-and-call",
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "Find me a museum in Rome."},
        {
            "role": "assistant",
            "content": "Let me search for that.",
            "tool_calls": [
                call("functions.search_web:0", "search_web", '{"query": "museum Rome"}')
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "functions.search_web:0",
            "content": "The Vatican Museums.",
        },
        {"role": "assistant", "content": "Try the Vatican Museums."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome.", "reasoning_content": "Be polite."},
    ],
}
AGENTIC_ROWS = [PARALLEL, ENDS_IN_CALL, TEXT_AND_CALL]

# -- what the template should get for them, written out ----------------------------------------

WEATHER_CALL = call("functions.get_weather:0", "get_weather", {"city": "Paris", "unit": "celsius"})
NEWS_CALL = call("functions.search_web:1", "search_web", {"query": "Paris news"})
REFERENCE = {
    "parallel": [
        {"role": "system", "content": "You are a travel assistant."},
        {"role": "user", "content": "Weather in Paris, and any news?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Two lookups at once.",
            "tool_calls": [WEATHER_CALL, NEWS_CALL],
        },
        {
            "role": "tool",
            "tool_call_id": "functions.get_weather:0",
            "name": "get_weather",
            "content": "18C, sunny",
        },
        {
            "role": "tool",
            "tool_call_id": "functions.search_web:1",
            "name": "search_web",
            "content": "A new bridge opened.",
        },
        {
            "role": "assistant",
            "content": "It is 18C and sunny; a new bridge opened.",
            "reasoning_content": "Both answers are in.",
        },
    ],
    "ends-in-call": [
        {"role": "user", "content": "What time is it in Tokyo?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Ask the clock.",
            "tool_calls": [call("functions.get_time:0", "get_time", {"timezone": "Asia/Tokyo"})],
        },
    ],
    "text-and-call": [
        {"role": "user", "content": "Find me a museum in Rome."},
        {
            "role": "assistant",
            "content": "Let me search for that.",
            "tool_calls": [call("functions.search_web:0", "search_web", {"query": "museum Rome"})],
        },
        {
            "role": "tool",
            "tool_call_id": "functions.search_web:0",
            "content": "The Vatican Museums.",
        },
        {"role": "assistant", "content": "Try the Vatican Museums."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome.", "reasoning_content": "Be polite."},
    ],
}
# Kimi's template loops over content parts ("openai"): the user's parts reach it as parts.
KIMI_USER_PARTS = [
    {"type": "text", "text": "Weather in Paris,"},
    {"type": "text", "text": "and any news?"},
]
KIMI_REFERENCE = {
    **REFERENCE,
    "parallel": [
        REFERENCE["parallel"][0],
        {"role": "user", "content": KIMI_USER_PARTS},
        *REFERENCE["parallel"][2:],
    ],
}

# -- the assistant tokens each template's mask should hold, per row -----------------------------

QWEN_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'  # noqa: E501
QWEN_NEWS = (
    '<tool_call>\n{"name": "search_web", "arguments": {"query": "Paris news"}}\n</tool_call>'
)
QWEN_TIME = (
    '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n</tool_call>'
)
QWEN_MUSEUM = (
    '<tool_call>\n{"name": "search_web", "arguments": {"query": "museum Rome"}}\n</tool_call>'
)
EXPECTED_RUNS = {
    "qwen3": {  # reasoning only after the last user turn, and always on the last turn
        "parallel": [
            f"<think>\nTwo lookups at once.\n</think>\n\n{QWEN_WEATHER}\n{QWEN_NEWS}<|im_end|>",
            "<think>\nBoth answers are in.\n</think>\n\n"
            "It is 18C and sunny; a new bridge opened.<|im_end|>",
        ],
        "ends-in-call": [f"<think>\nAsk the clock.\n</think>\n\n{QWEN_TIME}<|im_end|>"],
        "text-and-call": [
            f"Let me search for that.\n{QWEN_MUSEUM}<|im_end|>",
            "Try the Vatican Museums.<|im_end|>",
            "<think>\nBe polite.\n</think>\n\nYou are welcome.<|im_end|>",
        ],
    },
    "qwen2_5": {  # no reasoning; a call-only turn starts "\n<tool_call>"
        "parallel": [
            f"{QWEN_WEATHER}\n{QWEN_NEWS}<|im_end|>",
            "It is 18C and sunny; a new bridge opened.<|im_end|>",
        ],
        "ends-in-call": [f"{QWEN_TIME}<|im_end|>"],
        "text-and-call": [
            f"Let me search for that.\n{QWEN_MUSEUM}<|im_end|>",
            "Try the Vatican Museums.<|im_end|>",
            "You are welcome.<|im_end|>",
        ],
    },
    "kimi_k2_thinking": {  # reasoning only after the last turn without calls
        "parallel": [
            "<think></think><|tool_calls_section_begin|>"
            "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris", "unit": "celsius"}<|tool_call_end|>'
            "<|tool_call_begin|>functions.search_web:1<|tool_call_argument_begin|>"
            '{"query": "Paris news"}<|tool_call_end|>'
            "<|tool_calls_section_end|><|im_end|>",
            "<think></think>It is 18C and sunny; a new bridge opened.<|im_end|>",
        ],
        "ends-in-call": [
            "<think>Ask the clock.</think><|tool_calls_section_begin|>"
            "<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>"
            '{"timezone": "Asia/Tokyo"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        ],
        "text-and-call": [
            "<think></think>Let me search for that.<|tool_calls_section_begin|>"
            "<|tool_call_begin|>functions.search_web:0<|tool_call_argument_begin|>"
            '{"query": "museum Rome"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
            "<think></think>Try the Vatican Museums.<|im_end|>",
            "<think></think>You are welcome.<|im_end|>",
        ],
    },
    "llama3_3": {  # a call is its JSON alone (its text and reasoning are dropped)
        "ends-in-call": [
            '{"name": "get_time", "parameters": {"timezone": "Asia/Tokyo"}}<|eot_id|>'
        ],
        "text-and-call": [
            '{"name": "search_web", "parameters": {"query": "museum Rome"}}<|eot_id|>',
            "Try the Vatican Museums.<|eot_id|>",
            "You are welcome.<|eot_id|>",
        ],
    },
}
LLAMA3_PARALLEL = "chat template error: This model only supports single tool-calls at once!"


# -- helpers ------------------------------------------------------------------------------------


def plan_rows(tmp_path: Path, rows: list[Any], model: Path, **data: Any) -> Plan:
    path = write_jsonl(tmp_path / f"rows{len(list(tmp_path.iterdir()))}.jsonl", rows)
    return build_plan(DataConfig(paths=[str(path)], **data), model)


def by_id(plan: Plan) -> dict[str, tuple[list[int], list[int]]]:
    return {
        sid: (ids.tolist(), mask.tolist())
        for sid, ids, mask in zip(plan.sample_ids, plan.input_ids, plan.loss_masks, strict=True)
    }


def mask_runs(ids: list[int], mask: list[int], tok: Any) -> list[str]:
    """The decoded text of each run of 1s in the mask."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(tok.decode(ids[start:i]))
            start = None
    return runs


def unmasked_text(ids: list[int], mask: list[int], tok: Any) -> str:
    return tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])


def reference(tok: Any, messages: list[dict[str, Any]], template: str, **kw: Any) -> Any:
    """The tokens of the request as SGLang's server renders it (its own code's inputs)."""
    messages, tools = served_template_inputs(messages, TOOLS)
    return tok.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=True, return_dict=True, **kw
    )


def template_path(name: str) -> str:
    return str(TEMPLATES / f"{name}.jinja")


@pytest.fixture(scope="module")
def tok(llama_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_path)


@pytest.fixture(scope="module")
def with_specials(
    llama_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, list[str]], tuple[Path, Any]]:
    """A copy of the tiny model (no weights) whose tokenizer has `tokens` as special tokens,
    and whose vocab_size covers them: the real models' markup is one token each."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    def make(name: str, tokens: list[str]) -> tuple[Path, Any]:
        dst = tmp_path_factory.mktemp("models") / name
        shutil.copytree(llama_path, dst, ignore=shutil.ignore_patterns("*.safetensors"))
        tokenizer = AutoTokenizer.from_pretrained(dst)
        tokenizer.add_tokens([AddedToken(t, special=True) for t in tokens], special_tokens=True)
        tokenizer.save_pretrained(dst)
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, "vocab_size": len(tokenizer)}))
        tokenizer = AutoTokenizer.from_pretrained(dst)
        assert all(len(tokenizer.encode(t, add_special_tokens=False)) == 1 for t in tokens)
        return dst, tokenizer

    return make


@pytest.fixture(scope="module")
def models(
    llama_path: Path, tok: Any, with_specials: Callable[[str, list[str]], tuple[Path, Any]]
) -> dict[str, tuple[Path, Any]]:
    """Each real template's model: the tiny one, or a copy with the template's markup."""
    kimi = with_specials("kimi", KIMI_TOKENS)
    llama3 = with_specials("llama3", LLAMA3_TOKENS)
    tiny = (llama_path, tok)
    return {"qwen3": tiny, "qwen2_5": tiny, "kimi_k2_thinking": kimi, "llama3_3": llama3}


# -- 1, 2: real templates, token for token, and their masks ---------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "qwen2_5", "kimi_k2_thinking", "llama3_3"])
def test_real_templates_plan_agentic_rows_token_for_token(
    tmp_path: Path, models: dict[str, tuple[Path, Any]], name: str
) -> None:
    model, tok = models[name]
    plan = plan_rows(tmp_path, AGENTIC_ROWS, model, chat_template=template_path(name))
    template = (TEMPLATES / f"{name}.jinja").read_text()
    refs = KIMI_REFERENCE if name == "kimi_k2_thinking" else REFERENCE
    expected = EXPECTED_RUNS[name]

    if name == "llama3_3":  # one call per turn: the parallel row is the template's to refuse
        assert plan.rejected == [{"sample_id": "parallel", "reason": LLAMA3_PARALLEL}]
    else:
        assert plan.rejected == []
    samples = by_id(plan)
    assert list(samples) == list(expected)
    for row_id, (ids, mask) in samples.items():
        assert ids == reference(tok, refs[row_id], template)["input_ids"], row_id
        assert mask_runs(ids, mask, tok) == expected[row_id], row_id
        # Every other turn's text is among the unmasked tokens (Llama 3.3 prints the tool
        # results as JSON strings: their text, quoted).
        rest = unmasked_text(ids, mask, tok)
        for message in refs[row_id]:
            if message["role"] != "assistant":
                content = message["content"]
                texts = [content] if isinstance(content, str) else [p["text"] for p in content]
                assert all(text in rest for text in texts), (row_id, message)

    # The check tells the forms apart: the row rendered as it is, not as SGLang serves it (a
    # tool's defer_loading null, a call's index null), or for Kimi the user's parts joined,
    # are other tokens.
    raw = tok.apply_chat_template(refs["ends-in-call"], tools=TOOLS, chat_template=template)
    assert samples["ends-in-call"][0] != raw["input_ids"]
    if name == "kimi_k2_thinking":
        assert (
            samples["parallel"][0] != reference(tok, REFERENCE["parallel"], template)["input_ids"]
        )


def marked_reference(tok: Any, row_id: str) -> tuple[list[int], list[int]]:
    """transformers' own assistant mask, from Qwen3 with {% generation %} markers."""
    template = (TEMPLATES / "qwen3_marked.jinja").read_text()
    out = reference(tok, REFERENCE[row_id], template, return_assistant_tokens_mask=True)
    return out["input_ids"], out["assistant_masks"]


@pytest.mark.parametrize("name", ["qwen3", "qwen3_marked"])
def test_qwen3_masks_equal_transformers_generation_masks(
    tmp_path: Path, llama_path: Path, tok: Any, name: str
) -> None:
    # qwen3: the planner's spans (no markers); qwen3_marked: the planner's markers path.
    plan = plan_rows(tmp_path, AGENTIC_ROWS, llama_path, chat_template=template_path(name))
    assert plan.rejected == []
    for row_id, (ids, mask) in by_id(plan).items():
        assert (ids, mask) == marked_reference(tok, row_id), row_id
        assert mask_runs(ids, mask, tok) == EXPECTED_RUNS["qwen3"][row_id]


def test_a_mask_shifted_by_one_token_fails_both_checks(
    tmp_path: Path, llama_path: Path, tok: Any
) -> None:
    plan = plan_rows(tmp_path, [PARALLEL], llama_path, chat_template=template_path("qwen3"))
    ids, mask = by_id(plan)["parallel"]
    shifted = np.roll(mask, 1).tolist()
    assert (ids, shifted) != marked_reference(tok, "parallel")
    assert mask_runs(ids, shifted, tok) != EXPECTED_RUNS["qwen3"]["parallel"]


# -- 3: ShareGPT ------------------------------------------------------------------------------

SHAREGPT_TURNS = [
    {"from": "human", "value": "Weather in Paris, and any news?"},
    {
        "from": "function_call",
        "value": json.dumps(
            [
                {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                {"name": "search_web", "arguments": '{"query": "Paris news"}'},
            ]
        ),
    },
    {"from": "observation", "value": "18C, sunny"},
    {"from": "function_response", "value": "A new bridge opened."},
    {"from": "gpt", "value": "It is 18C and sunny; a new bridge opened."},
    {"from": "user", "value": "Time in Tokyo?"},
    {
        "from": "function_call",
        "value": json.dumps({"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}),
    },
    {"from": "tool", "value": "09:00"},
    {"from": "assistant", "value": "It is 9 am in Tokyo."},
    {"from": "human", "value": "Thanks."},
    {"from": "chatgpt", "value": "Any time."},
]


def untagged_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


SHAREGPT_AS_OPENAI = [  # ShareGPT has no call ids: neither has its twin
    {"role": "system", "content": "You are a travel assistant."},
    {"role": "user", "content": "Weather in Paris, and any news?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            untagged_call("get_weather", {"city": "Paris", "unit": "celsius"}),
            untagged_call("search_web", {"query": "Paris news"}),
        ],
    },
    {"role": "tool", "content": "18C, sunny"},
    {"role": "tool", "content": "A new bridge opened."},
    {"role": "assistant", "content": "It is 18C and sunny; a new bridge opened."},
    {"role": "user", "content": "Time in Tokyo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [untagged_call("get_time", {"timezone": "Asia/Tokyo"})],
    },
    {"role": "tool", "content": "09:00"},
    {"role": "assistant", "content": "It is 9 am in Tokyo."},
    {"role": "user", "content": "Thanks."},
    {"role": "assistant", "content": "Any time."},
]
SYSTEM = "You are a travel assistant."
SYSTEM_TURN = {"from": "system", "value": SYSTEM}


def test_sharegpt_rows_plan_as_their_openai_twins(tmp_path: Path, llama_path: Path) -> None:
    rows = [
        {"id": "openai", "tools": TOOLS, "messages": SHAREGPT_AS_OPENAI},
        {"id": "row-system", "system": SYSTEM, "tools": TOOLS, "conversations": SHAREGPT_TURNS},
        {
            "id": "system-turn",
            "tools": json.dumps(TOOLS),
            "conversations": [SYSTEM_TURN, *SHAREGPT_TURNS],
        },
        {"id": "in-messages", "system": SYSTEM, "tools": TOOLS, "messages": SHAREGPT_TURNS},
    ]
    plan = plan_rows(tmp_path, rows, llama_path, chat_template=template_path("qwen3"))
    assert plan.rejected == []
    samples = by_id(plan)
    assert list(samples) == ["openai", "row-system", "system-turn", "in-messages"]
    assert all(samples[k] == samples["openai"] for k in samples)
    # The twin is not equal by accident: a ShareGPT row without its system prompt differs.
    bare = plan_rows(
        tmp_path,
        [{"id": "bare", "tools": TOOLS, "conversations": SHAREGPT_TURNS}],
        llama_path,
        chat_template=template_path("qwen3"),
    )
    assert by_id(bare)["bare"][0] != samples["openai"][0]


def test_sharegpt_schema_with_a_renamed_field(tmp_path: Path, llama_path: Path) -> None:
    template = template_path("qwen3")
    twin = [{"id": "x", "tools": TOOLS, "messages": SHAREGPT_AS_OPENAI}]
    twin_plan = plan_rows(tmp_path, twin, llama_path, chat_template=template)
    rows = [{"id": "x", "system": SYSTEM, "tools": TOOLS, "turns": SHAREGPT_TURNS}]
    plan = plan_rows(
        tmp_path,
        rows,
        llama_path,
        chat_template=template,
        row_schema="sharegpt",
        conversations_field="turns",
    )
    assert plan.rejected == [] and by_id(plan) == by_id(twin_plan)
    # Under `auto` the renamed field is no field of any schema.
    auto = plan_rows(tmp_path, rows, llama_path, chat_template=template)
    assert auto.rejected == [
        {"sample_id": "x", "reason": "row has none of text, messages, conversations"}
    ]


CALL = call("c0", "get_time", {"timezone": "UTC"})
HI = {"role": "user", "content": "hi"}


def assistant(**fields: Any) -> list[dict[str, Any]]:
    return [HI, {"role": "assistant", **fields}]


def fc(value: str) -> list[dict[str, str]]:
    return [{"from": "human", "value": "hi"}, {"from": "function_call", "value": value}]


BAD_ROWS: list[tuple[dict[str, Any], str]] = [
    (
        {"messages": [{**HI, "tool_calls": [CALL]}]},
        "messages[0] has tool_calls but is a user turn",
    ),
    (
        {"messages": assistant(content=None)},
        "messages[1].content is null (allowed only on an assistant turn with tool_calls)",
    ),
    (  # an empty tool_calls is no calls, as many logs write it
        {"messages": assistant(content=None, tool_calls=[])},
        "messages[1].content is null (allowed only on an assistant turn with tool_calls)",
    ),
    (
        {"messages": assistant(content="x", reasoning_content=5)},
        "messages[1].reasoning_content must be a string, got int",
    ),
    (
        {"messages": assistant(tool_calls={"function": CALL["function"]})},
        "messages[1].tool_calls must be a non-empty list, got object",
    ),
    (
        {"messages": assistant(tool_calls=[{"id": "c0"}])},
        "messages[1].tool_calls[0] must be an object with a function object",
    ),
    (
        {"messages": assistant(tool_calls=[{"function": {"name": "", "arguments": {}}}])},
        "messages[1].tool_calls[0].function.name must be a non-empty string",
    ),
    (
        {"messages": assistant(tool_calls=[call("c0", "get_time", "{timezone: UTC}")])},
        "messages[1].tool_calls[0].function.arguments is not valid JSON: Expecting property "
        "name enclosed in double quotes: line 1 column 2 (char 1)",
    ),
    (
        {"messages": assistant(tool_calls=[call("c0", "get_time", "[1, 2]")])},
        "messages[1].tool_calls[0].function.arguments must be a JSON object",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}]},
        "messages[0].content[0].type 'input_audio' is not a text or image part",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].image_url.url must be a string, got null",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "input_image", "image_url": 5}]}]},
        "messages[0].content[0].image_url must be a string, got int",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "url": ""}]}]},
        "messages[0].content[0].url is an empty string",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "path": "a", "url": "b"}]}]},
        "messages[0].content[0] must hold one of image, url, path",
    ),
    (  # a well-formed image part, on a model that takes none (the tiny llama)
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.png"}]}]},
        NO_IMAGE_TOKEN,
    ),
    (
        {"messages": [{"role": "user", "content": ["hi"]}]},
        "messages[0].content[0] must be an object, got string",
    ),
    (
        {"messages": [{"role": "user", "content": []}]},
        "messages[0].content is an empty list of parts",
    ),
    ({"messages": [HI], "tools": {"type": "function"}}, "tools must be a list, got object"),
    ({"messages": [HI], "tools": ["get_time"]}, "tools[0] must be an object, got string"),
    (
        {"messages": [HI], "tools": "[{"},
        "tools is a string but not JSON: Expecting property name enclosed in double quotes: "
        "line 1 column 3 (char 2)",
    ),
    (
        {"conversations": [{"from": "bot", "value": "hi"}]},
        f"conversations[0].from 'bot' is not a ShareGPT role ({SHAREGPT_ROLE_LIST})",
    ),
    ({"conversations": [{"value": "hi"}]}, "conversations[0].from must be a string, got null"),
    (
        {"conversations": [{"from": "human", "value": 3}]},
        "conversations[0].value must be a string, got int",
    ),
    ({"conversations": ["hi"]}, "conversations[0] must be an object, got string"),
    ({"conversations": "hi"}, "conversations must be a list, got string"),
    ({"conversations": []}, "empty conversations"),
    (
        {"system": 1, "conversations": [{"from": "human", "value": "hi"}]},
        "system must be a string, got int",
    ),
    (
        {"conversations": fc("get_time()")},
        "conversations[1]: a function_call value must be JSON (Expecting value: line 1 column "
        "1 (char 0))",
    ),
    (
        {"conversations": fc('{"arguments": {}}')},
        'conversations[1]: a function_call value must be {"name", "arguments"} or a list of them',
    ),
    (
        {"conversations": fc("[]")},
        'conversations[1]: a function_call value must be {"name", "arguments"} or a list of them',
    ),
    (  # checked as the OpenAI call it becomes, and named so
        {"conversations": fc('{"name": "get_time", "arguments": "{oops"}')},
        "conversations[1].tool_calls[0].function.arguments is not valid JSON: Expecting "
        "property name enclosed in double quotes: line 1 column 2 (char 1)",
    ),
    (
        {"messages": [HI], "conversations": [{"from": "human", "value": "hi"}]},
        "row has both messages and conversations",
    ),
]


def test_every_conversation_reject_reason_and_the_job_goes_on(
    tmp_path: Path, llama_path: Path
) -> None:
    good = [
        {"id": "good-openai", "messages": [HI, {"role": "assistant", "content": "hello"}]},
        {
            "id": "good-sharegpt",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
        },
    ]
    bad = [{"id": f"bad-{i}", **row} for i, (row, _) in enumerate(BAD_ROWS)]
    plan = plan_rows(tmp_path, [good[0], *bad, good[1]], llama_path)
    assert plan.sample_ids == ["good-openai", "good-sharegpt"]
    assert plan.rejected == [
        {"sample_id": f"bad-{i}", "reason": reason} for i, (_, reason) in enumerate(BAD_ROWS)
    ]


IMAGE_PARTS = [
    {"type": "image_url", "image_url": {"url": "a.png", "detail": "low"}},
    {"type": "image_url", "image_url": "a.png"},
    {"type": "input_image", "image_url": "a.png"},
    {"type": "image", "image": "a.png"},
    {"type": "image", "url": "a.png"},
    {"type": "image", "path": "a.png"},
]


@pytest.mark.parametrize("part", IMAGE_PARTS)
def test_every_image_part_shape_comes_out_in_one(part: dict[str, Any]) -> None:
    text = {"type": "text", "text": "what?"}
    conv = parse_openai([{"role": "user", "content": [text, part]}], None, "m", "t", ["user"])
    assert not isinstance(conv, str)
    assert conv.messages[0]["content"] == [text, {"type": "image", "image": "a.png"}]


def test_text_parts_are_kept_as_they_are() -> None:
    content = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]
    conv = parse_openai([{"role": "user", "content": content}], None, "m", "t", ["user"])
    assert not isinstance(conv, str) and conv.messages[0]["content"] is content


# -- 4: Parquet and datasets directories --------------------------------------------------------


def columnar(
    rows: list[dict[str, Any]], arguments: str, tools: str, contents: str
) -> list[dict[str, Any]]:
    """`rows` in a shape one Arrow column holds: every call's arguments as JSON text or as
    objects, tools as a list or as JSON text, every content as text or as parts (a column
    holds strings or lists, not both)."""
    out = []
    for row in copy.deepcopy(rows):
        for message in row["messages"]:
            for tool_call in message.get("tool_calls", []):
                args = tool_call["function"]["arguments"]
                args = json.loads(args) if isinstance(args, str) else args
                tool_call["function"]["arguments"] = (
                    json.dumps(args) if arguments == "string" else args
                )
            content = message["content"]
            if isinstance(content, list) and contents == "string":
                message["content"] = " ".join(p["text"] for p in content)
            elif isinstance(content, str) and contents == "parts":
                message["content"] = [{"type": "text", "text": content}]
        if tools == "json":
            row["tools"] = json.dumps(row["tools"])
        out.append(row)
    return out


@pytest.mark.parametrize(
    ("name", "arguments", "tools", "contents"),
    [
        ("qwen3", "object", "list", "string"),
        ("qwen3", "string", "json", "parts"),
        ("kimi_k2_thinking", "string", "json", "parts"),  # the parts reach Kimi as parts
    ],
)
def test_parquet_and_datasets_dirs_plan_as_jsonl(
    tmp_path: Path,
    models: dict[str, tuple[Path, Any]],
    name: str,
    arguments: str,
    tools: str,
    contents: str,
) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    template = template_path(name)
    model = models[name][0]
    ref = plan_rows(tmp_path, AGENTIC_ROWS, model, chat_template=template)
    assert ref.rejected == [] and len(ref.sample_ids) == 3
    rows = columnar(AGENTIC_ROWS, arguments, tools, contents)
    table = pa.Table.from_pylist(rows)
    # The columns do fill in what a row lacks: a user turn gets null tool_calls, a call's
    # arguments or a tool's properties the keys of the others'.
    assert table.to_pylist() != rows
    pq.write_table(table, tmp_path / "rows.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    for path in ("rows.parquet", "ds"):
        plan = build_plan(DataConfig(paths=[str(tmp_path / path)], chat_template=template), model)
        assert plan.rejected == [], path
        assert by_id(plan) == by_id(ref), path


def test_openai_and_sharegpt_rows_in_one_parquet_messages_column(
    tmp_path: Path, llama_path: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"id": "openai", "messages": [HI, {"role": "assistant", "content": "yo"}]},
        {
            "id": "sharegpt",
            "messages": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mixed.parquet")
    plan = build_plan(DataConfig(paths=[str(tmp_path / "mixed.parquet")]), llama_path)
    assert plan.rejected == []
    assert by_id(plan)["sharegpt"] == by_id(plan)["openai"]


NULL_ARGUMENT_CALL = [
    HI,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [call("c0", "get_weather", {"city": "Paris", "unit": None})],
    },
]


def test_a_null_argument_renders_alike_as_an_object_and_as_json_text(
    tmp_path: Path, llama_path: Path
) -> None:
    as_text = copy.deepcopy(NULL_ARGUMENT_CALL)
    as_text[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris", "unit": null}'
    rows = [
        {"id": "object", "tools": TOOLS, "messages": NULL_ARGUMENT_CALL},
        {"id": "text", "tools": TOOLS, "messages": as_text},
    ]
    plan = plan_rows(tmp_path, rows, llama_path, chat_template=template_path("qwen3"))
    samples = by_id(plan)
    assert samples["object"] == samples["text"]


def test_a_tool_schema_null_reaches_the_template(
    tmp_path: Path, llama_path: Path, tok: Any
) -> None:
    tools = copy.deepcopy(TOOLS)
    tools[0]["function"]["parameters"]["properties"]["unit"]["default"] = None
    messages = [HI, {"role": "assistant", "content": "hello"}]
    plan = plan_rows(
        tmp_path,
        [{"id": "x", "tools": tools, "messages": messages}],
        llama_path,
        chat_template=template_path("qwen3"),
    )
    template = (TEMPLATES / "qwen3.jinja").read_text()
    served, served_tools = served_template_inputs(messages, tools)
    assert served_tools is not None
    assert served_tools[0]["function"]["parameters"]["properties"]["unit"]["default"] is None
    ref = tok.apply_chat_template(served, tools=served_tools, chat_template=template, tokenize=True)
    assert by_id(plan)["x"][0] == ref["input_ids"]


# -- 5: content format ----------------------------------------------------------------------------

STRING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PARTS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}[{{ part['text'] }}]{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A loop over parts inside {% generation %} markers: transformers' parser (SGLang's) knows the
# tag.
MARKED_PARTS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}<|im_end|>"
    "{% endgeneration %}\n{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
)
# ChatML that prints only roles and contents: no tools, no calls (the tiny model's template
# before it learnt them).
NO_TOOLS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def sglang_detect() -> Callable[[str], str]:
    """SGLang's own detect_jinja_template_content_format. `import sglang` takes ~7 s, so the
    module is run from its file with the one import it does not use here stubbed."""
    name = "sglang.srt.parser.jinja_template_utils"
    if name in sys.modules:
        return sys.modules[name].detect_jinja_template_content_format
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0], "srt", "parser", "jinja_template_utils.py")
    module_spec = importlib.util.spec_from_file_location("sglang_jinja_template_utils", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    utils = types.ModuleType("sglang.srt.utils")  # media helpers, for other functions
    utils.GLM_MEDIA_CONFIG_KEYS, utils.ImageData, utils.VideoData = (), object, object  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as patch:
        if "sglang.srt.utils" not in sys.modules:
            patch.setitem(sys.modules, "sglang.srt.utils", utils)
        module_spec.loader.exec_module(module)
    return module.detect_jinja_template_content_format


FORMAT_CASES = {
    **{p.stem: p.read_text() for p in sorted(TEMPLATES.glob("*.jinja"))},
    "tiny": TINY_TEMPLATE,
    "string": STRING_TEMPLATE,
    "parts": PARTS_TEMPLATE,
    "no_tools": NO_TOOLS_TEMPLATE,
}


@pytest.mark.parametrize("name", list(FORMAT_CASES))
def test_auto_content_format_is_sglangs(name: str, sglang_detect: Callable[[str], str]) -> None:
    assert content_format(FORMAT_CASES[name], "auto") == sglang_detect(FORMAT_CASES[name])


def test_the_format_cases_hold_both_formats(sglang_detect: Callable[[str], str]) -> None:
    formats = {name: sglang_detect(t) for name, t in FORMAT_CASES.items()}
    assert formats["parts"] == formats["kimi_k2_thinking"] == "openai"
    assert formats["string"] == formats["qwen3"] == formats["no_tools"] == "string"


def test_a_marked_template_that_loops_over_parts_is_openai(
    sglang_detect: Callable[[str], str],
) -> None:
    assert sglang_detect(MARKED_PARTS_TEMPLATE) == "openai"
    assert content_format(MARKED_PARTS_TEMPLATE, "auto") == "openai"


def test_a_forced_content_format_wins() -> None:
    assert content_format(STRING_TEMPLATE, "openai") == "openai"
    assert content_format(PARTS_TEMPLATE, "string") == "string"
    assert content_format(PARTS_TEMPLATE, "auto") == "openai"


PARTS_ROW = {
    "id": "parts",
    "messages": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "alpha"}, {"type": "input_text", "text": "beta"}],
        },
        {"role": "assistant", "content": "gamma"},
    ],
}
AS_TEXT = [{"role": "user", "content": "alpha beta"}, {"role": "assistant", "content": "gamma"}]
AS_PARTS = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "alpha"}, {"type": "text", "text": "beta"}],
    },
    {"role": "assistant", "content": "gamma"},
]


@pytest.mark.parametrize(
    ("template", "setting", "expected"),
    [
        (STRING_TEMPLATE, "auto", AS_TEXT),
        (PARTS_TEMPLATE, "auto", AS_PARTS),
        (PARTS_TEMPLATE, "string", AS_TEXT),
        (STRING_TEMPLATE, "openai", AS_PARTS),  # printed as Python's list: the setting won
    ],
)
def test_parts_reach_the_template_in_its_format(
    tmp_path: Path,
    llama_path: Path,
    tok: Any,
    template: str,
    setting: str,
    expected: list[dict[str, Any]],
) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(template)
    plan = plan_rows(
        tmp_path, [PARTS_ROW], llama_path, chat_template=str(path), content_format=setting
    )
    ids, mask = by_id(plan)["parts"]
    ref = tok.apply_chat_template(expected, chat_template=template, tokenize=True)
    assert ids == ref["input_ids"]
    assert mask_runs(ids, mask, tok) == ["gamma<|im_end|>"]
    other = AS_PARTS if expected is AS_TEXT else AS_TEXT
    assert ids != tok.apply_chat_template(other, chat_template=template, tokenize=True)["input_ids"]


# -- 6: a template without tool support ----------------------------------------------------------


def test_a_template_without_tool_support_refuses_tools_and_calls(
    tmp_path: Path, llama_path: Path
) -> None:
    rows = [
        {"id": "plain", "messages": [HI, {"role": "assistant", "content": "hello"}]},
        {"id": "tools", "tools": TOOLS, "messages": [HI, {"role": "assistant", "content": "x"}]},
        {"id": "calls", "messages": assistant(content=None, tool_calls=[CALL])},
        {"id": "sharegpt-call", "conversations": fc(json.dumps({"name": "get_time"}))},
        {"id": "after", "messages": [HI, {"role": "assistant", "content": "bye"}]},
    ]
    template = tmp_path / "no_tools.jinja"
    template.write_text(NO_TOOLS_TEMPLATE)
    plan = plan_rows(tmp_path, rows, llama_path, chat_template=str(template))
    assert plan.sample_ids == ["plain", "after"]
    assert plan.rejected == [
        {"sample_id": "tools", "reason": UNRENDERED.format(what="the row's tools")},
        {"sample_id": "calls", "reason": UNRENDERED.format(what="the tool calls of messages[1]")},
        {
            "sample_id": "sharegpt-call",
            "reason": UNRENDERED.format(what="the tool calls of messages[1]"),
        },
    ]


# -- a review's cases ---------------------------------------------------------------------------


def test_generating_with_tools_on_templates_that_concatenate_a_content(
    tmp_path: Path, llama_path: Path, tok: Any
) -> None:
    """Qwen3 and Qwen2.5 add strings to a message's content: the turn to write is checked
    as empty, and the prompt ends with the header the model writes after."""
    from actors.config import GenerateConfig
    from cluster.plan import PlanStream, Sample

    path = write_jsonl(tmp_path / "g.jsonl", [TEXT_AND_CALL])
    for name in ("qwen3", "qwen2_5"):
        for turns in ("last", "all"):
            data = DataConfig(paths=[str(path)], chat_template=template_path(name))
            generate = GenerateConfig(turns=turns, max_new_tokens=8)
            (got,) = [x for x in PlanStream(data, llama_path, generate=generate) if
                      isinstance(x, Sample | Reject)]  # fmt: skip
            assert isinstance(got, Sample), (name, turns, got)
            ends = np.cumsum(got.prompt["segments"])
            for end in ends:
                assert tok.decode(got.input_ids[:end]).endswith("<|im_start|>assistant\n")
            # all: the two text turns anew; the call its result answers stays
            assert len(ends) == (1 if turns == "last" else 2), (name, turns)


def test_a_header_quoted_in_a_user_turn_is_never_an_assistant_turns(
    tmp_path: Path, models: dict[str, tuple[Path, Any]]
) -> None:
    """The header count matches (one quoted, the named assistant's own is another): the
    quoted one lies inside the user's content, so the row is rejected, never mis-masked."""
    model, _ = models["kimi_k2_thinking"]
    quoted = {"role": "user", "content": "say <|im_assistant|>assistant<|im_middle|>"}
    rows = [
        {
            "id": "named",
            "messages": [quoted, {"role": "assistant", "name": "kimi", "content": "a"}],
        },
        {"id": "plain", "messages": [quoted, {"role": "assistant", "content": "a"}]},
    ]
    plan = plan_rows(tmp_path, rows, model, chat_template=template_path("kimi_k2_thinking"))
    assert [r["sample_id"] for r in plan.rejected] == ["named"]
    assert "cannot find where assistant turn 0 starts" in plan.rejected[0]["reason"]
    _, tokenizer = models["kimi_k2_thinking"]
    ids, mask = by_id(plan)["plain"]
    assert mask_runs(ids, mask, tokenizer) == ["<think></think>a<|im_end|>"]


def test_a_generation_prompt_that_opens_the_reasoning_marks_earlier_turns_too(
    tmp_path: Path, llama_path: Path, tok: Any
) -> None:
    """Qwen3-Thinking's prompt ends with "<think>\\n", which earlier turns never render: their
    header is the part both share, and each turn is found."""
    thinking = (
        (TEMPLATES / "qwen3.jinja")
        .read_text()
        .replace(
            "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking",
            "{{- '<|im_start|>assistant\\n<think>\\n' }}\n    {%- if enable_thinking",
        )
    )
    assert thinking != (TEMPLATES / "qwen3.jinja").read_text()
    path = tmp_path / "thinking.jinja"
    path.write_text(thinking)
    rows = [{"id": "two", "messages": [HI, {"role": "assistant", "content": "a"}, HI,
             {"role": "assistant", "content": "b", "reasoning_content": "r"}]}]  # fmt: skip
    ids, mask = by_id(plan_rows(tmp_path, rows, llama_path, chat_template=str(path)))["two"]
    assert mask_runs(ids, mask, tok) == ["a<|im_end|>", "<think>\nr\n</think>\n\nb<|im_end|>"]


def test_tools_and_turns_as_other_converters_write_them(tmp_path: Path, llama_path: Path) -> None:
    """LLaMA-Factory's "" for no tools and bare function definitions, a `conversations` list
    of OpenAI messages, and a call whose arguments are null: each as its usual twin."""
    template = template_path("qwen3")
    bare = [tool["function"] for tool in TOOLS]
    no_args = assistant(content=None, tool_calls=[call("c0", "get_time", {})])
    null_args = copy.deepcopy(no_args)
    null_args[1]["tool_calls"][0]["function"]["arguments"] = None
    rows = [
        {"id": "plain", "messages": [HI, {"role": "assistant", "content": "x"}]},
        {"id": "empty-tools", "tools": "", "messages": [HI, {"role": "assistant", "content": "x"}]},
        {"id": "in-conversations", "conversations": [HI, {"role": "assistant", "content": "x"}]},
        {"id": "wrapped", "tools": TOOLS, "messages": no_args},
        {"id": "bare", "tools": bare, "messages": no_args},
        {"id": "null-arguments", "tools": TOOLS, "messages": null_args},
    ]  # fmt: skip
    samples = by_id(plan_rows(tmp_path, rows, llama_path, chat_template=template))
    assert samples["empty-tools"] == samples["plain"] == samples["in-conversations"]
    assert samples["bare"] == samples["wrapped"] == samples["null-arguments"]
