"""One bad row never stops a plan: values no tokenizer takes, JSON Python cannot read, tools the
server refuses, each rejected with a reason naming its row and field, beside good rows planned.

On the tiny Llama's real tokenizer, through `build_plan` and `run --dry-run`; a tool is held to
what SGLang's own `/v1/chat/completions` code gives the template (tests/helpers/sglang_chat.py).
Images: test_bad_images.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster.config import DataConfig
from cluster.plan import Plan, build_plan
from tests.helpers.jobs import dry_run
from tests.helpers.prompts import write_jsonl
from tests.helpers.sglang_chat import SGLangRefused, served_template_inputs

TEMPLATES = Path(__file__).resolve().parents[2] / "chat_templates"
HI = {"role": "user", "content": "hi"}
HELLO = {"role": "assistant", "content": "hello"}
GOOD = {"id": "good", "messages": [HI, HELLO]}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


def plan_rows(tmp_path: Path, model: Path, rows: list[Any], **data: Any) -> Plan:
    path = write_jsonl(tmp_path / f"rows{len(list(tmp_path.iterdir()))}.jsonl", rows)
    return build_plan(DataConfig(paths=[str(path)], **data), model)


def reasons(plan: Plan) -> dict[str, str]:
    return {r["sample_id"]: r["reason"] for r in plan.rejected}


def call_row(row_id: str, arguments: Any) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}
    return {
        "id": row_id,
        "tools": [TOOL],
        "messages": [
            HI,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "x"},
            HELLO,
        ],
    }


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


# -- 1: lone surrogates -------------------------------------------------------------------------


def lone(code: str, at: int) -> str:
    return (
        f"holds a lone UTF-16 surrogate (U+{code} at character {at}): not Unicode text (a "
        "writer cut a character in half)"
    )


# The tiny model's own template has {% generation %} markers; Qwen3's has none (another path).
@pytest.mark.parametrize("template", ["model", str(TEMPLATES / "qwen3.jinja")])
def test_a_lone_surrogate_rejects_its_row_naming_the_field(
    tmp_path: Path, llama_path: Path, template: str
) -> None:
    cut = "cut \ud83d"  # half an emoji, as a writer that split its UTF-16 leaves it
    rows = [
        {"id": "text", "text": cut},
        {"id": "turn", "messages": [{"role": "user", "content": cut}, HELLO]},
        {"id": "part", "messages": [{"role": "user", "content": [{"type": "text", "text": cut}]}]},
        call_row("args", {"q": "\udfff"}),
        call_row("args-text", json.dumps({"q": "\ud800"})),  # the escape inside the JSON text
        {"id": "tools", "tools": [{**TOOL, "x": {"\ud800": 1}}], "messages": [HI, HELLO]},
        {"id": "\ud800", "text": "an id no store can hold"},
        {"id": "sharegpt", "conversations": [{"from": "human", "value": cut}]},
        GOOD,
    ]
    plan = plan_rows(tmp_path, llama_path, rows, chat_template=template)
    assert plan.sample_ids == ["good"]
    name = Path(plan.sources[0]["path"]).name
    args = "messages[1].tool_calls[0].function.arguments.q"
    assert reasons(plan) == {
        "text": f"text {lone('D83D', 4)}",
        "turn": f"messages[0].content {lone('D83D', 4)}",
        "part": f"messages[0].content[0].text {lone('D83D', 4)}",
        "args": f"{args} {lone('DFFF', 0)}",
        "args-text": f"{args} {lone('D800', 0)}",
        "tools": f"tools[0].x has a key that {lone('D800', 0)}",
        f"{name}:7": f"id {lone('D800', 0)}",
        "sharegpt": f"conversations[0].value {lone('D83D', 4)}",
    }


# -- 5: JSON Python cannot read, and JSON nested too deep ----------------------------------------


def test_json_too_deep_or_with_a_huge_integer_rejects_its_row(
    tmp_path: Path, llama_path: Path
) -> None:
    huge = "1" * 5000
    too_deep = "[" * 100_000 + "]" * 100_000  # beyond Python's parser, whatever its stack
    rows = [
        f'{{"id": "deep-line", "text": {too_deep}}}'.encode(),
        f'{{"id": "huge-line", "text": "x", "n": {huge}}}'.encode(),
        {"id": "deep-turn", "messages": [{"role": "user", "content": nested(80)}, HELLO]},
        call_row("deep-args", nested(80)),
        call_row("deep-args-text", too_deep),
        call_row("huge-args-text", f'{{"n": {huge}}}'),
        {"id": "deep-tools-text", "tools": too_deep, "messages": [HI, HELLO]},
        {"id": "huge-tools-text", "tools": f"[{huge}]", "messages": [HI, HELLO]},
        {
            "id": "deep-call",
            "conversations": [
                {"from": "human", "value": "hi"},
                {"from": "function_call", "value": too_deep},
            ],
        },
        GOOD,
    ]
    plan = plan_rows(tmp_path, llama_path, rows)
    assert plan.sample_ids == ["good"]
    got = reasons(plan)
    name = Path(plan.sources[0]["path"]).name
    parser = "nested too deep for Python's parser (a row may nest 64 levels)"
    digits = "an integer of more than 4300 digits"
    assert got[f"{name}:1"] == f"malformed JSON: {parser}"
    assert got[f"{name}:2"].startswith(f"malformed JSON: {digits} (")
    assert got["deep-turn"].startswith("messages[0].content[0][0][0]")
    assert got["deep-turn"].endswith(" is nested deeper than 64 levels")
    assert got["deep-args"].startswith("messages[1].tool_calls[0].function.arguments[0]")
    assert got["deep-args"].endswith(" is nested deeper than 64 levels")
    args = "messages[1].tool_calls[0].function.arguments is not valid JSON"
    assert got["deep-args-text"] == f"{args}: {parser}"
    assert got["huge-args-text"].startswith(f"{args}: {digits} (")
    assert got["deep-tools-text"] == f"tools is a string but not JSON: {parser}"
    assert got["huge-tools-text"].startswith(f"tools is a string but not JSON: {digits} (")
    assert got["deep-call"] == f"conversations[1]: a function_call value must be JSON ({parser})"


def test_a_parquet_rows_json_strings_are_held_to_the_same_bounds(
    tmp_path: Path, llama_path: Path
) -> None:
    path = tmp_path / "rows.parquet"
    table = pa.table(
        {
            "id": ["deep", "huge", "good"],
            "tools": ["[" * 100_000 + "]" * 100_000, "[" + "7" * 5000 + "]", json.dumps([TOOL])],
            "messages": [[HI, HELLO]] * 3,
        }
    )
    pq.write_table(table, path)
    plan = build_plan(DataConfig(paths=[str(path)]), llama_path)
    assert plan.sample_ids == ["good"]
    got = reasons(plan)
    assert got["deep"] == (
        "tools is a string but not JSON: nested too deep for Python's parser (a row may nest 64 "
        "levels)"
    )
    assert got["huge"].startswith("tools is a string but not JSON: an integer of more than 4300")


# -- 7: tools and turns as SGLang serves them ---------------------------------------------------


def served_tokens(tok: Any, messages: list[Any], tools: list[Any] | None, template: str) -> Any:
    """The row's tokens as SGLang's server renders the same request (its own code's inputs)."""
    served, served_tools = served_template_inputs(messages, tools)
    out = tok.apply_chat_template(served, tools=served_tools, chat_template=template, tokenize=True)
    return out["input_ids"]


@pytest.mark.parametrize("name", ["qwen3", "kimi_k2_thinking"])
def test_tools_and_turns_are_planned_as_sglang_serves_them(
    tmp_path: Path, llama_path: Path, name: str
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_path)
    template_file = TEMPLATES / f"{name}.jinja"
    template = template_file.read_text()
    # Keys SGLang's models drop: a function's `returns`, a tool's own key, a user's `name`
    # (Kimi renders it as the speaker), an unknown key on an assistant turn.
    extra_tool = {
        "type": "function",
        "x-origin": "catalog",
        "function": {"name": "lookup", "returns": "a word", "parameters": {"type": "object"}},
    }
    messages = [
        {"role": "user", "content": "hi", "name": "alice"},
        {"role": "assistant", "content": "hello", "mood": "glad"},
    ]
    rows = [{"id": "extra", "tools": [extra_tool], "messages": messages}]
    plan = plan_rows(tmp_path, llama_path, rows, chat_template=str(template_file))
    assert plan.rejected == []
    ids = plan.input_ids[0].tolist()
    assert ids == served_tokens(tok, messages, [extra_tool], template)
    # The check tells: the row as it is (what was planned before) is other tokens.
    raw = tok.apply_chat_template(messages, tools=[extra_tool], chat_template=template)
    assert ids != raw["input_ids"]
    text = tok.decode(ids)
    assert "returns" not in text and "x-origin" not in text and "alice" not in text


REFUSED_TOOLS = [
    ({}, "tools[0]: SGLang refuses this tool (function: Field required)"),
    ({"type": "function"}, "tools[0]: SGLang refuses this tool (function: Field required)"),
    (
        {"type": "function", "function": [{"name": "f"}]},
        "tools[0]: SGLang refuses this tool (function: Input should be a valid dictionary or "
        "instance of Function)",
    ),
    (
        {"type": "function", "function": {"name": 5}},
        "tools[0]: SGLang refuses this tool (function.name: Input should be a valid string)",
    ),
    (
        {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}},
        "tools[0].function.parameters is not a JSON Schema: 5 is not valid under any of the "
        "given schemas",
    ),
]


def test_a_tool_sglang_refuses_rejects_its_row(tmp_path: Path, llama_path: Path) -> None:
    rows = [
        {"id": f"t{k}", "tools": [tool], "messages": [HI, HELLO]}
        for k, (tool, _) in enumerate(REFUSED_TOOLS)
    ]
    plan = plan_rows(tmp_path, llama_path, [*rows, GOOD])
    assert plan.sample_ids == ["good"]
    assert reasons(plan) == {f"t{k}": reason for k, (_, reason) in enumerate(REFUSED_TOOLS)}
    for tool, _ in REFUSED_TOOLS:  # and SGLang's own request path refuses each (HTTP 400)
        with pytest.raises(SGLangRefused):
            served_template_inputs([HI, HELLO], [tool])


# -- run --dry-run ------------------------------------------------------------------------------


def test_a_dry_run_over_bad_rows_says_each_and_plans_the_good(
    tmp_path: Path, deepseek_path: Path, capsys: pytest.CaptureFixture
) -> None:
    rows = [
        {"id": "cut", "text": "cut \ud83d"},
        {"id": "deep", "messages": [{"role": "user", "content": nested(80)}, HELLO]},
        {"id": "tool", "tools": [{}], "messages": [HI, HELLO]},
        {"id": "good", "text": "a draft model learns what the target would say"},
    ]
    assert dry_run(tmp_path, deepseek_path, rows) == 0
    out = capsys.readouterr().out
    assert "1 samples" in out and "3 rejected" in out
    assert "rejected cut: text holds a lone UTF-16 surrogate (U+D83D at character 4)" in out
    assert "rejected deep: messages[0].content[0]" in out
    assert "rejected tool: tools[0]: SGLang refuses this tool (function: Field required)" in out
