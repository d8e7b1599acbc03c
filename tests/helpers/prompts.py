"""Prompts for tests on real models: chat and text rows of varied lengths, rows each plan
reject reason refuses, and a JSONL writer for rows of a test's own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer

WORDS = "a draft model learns what the target model would say next at every token".split()


# Short: the tiny tokenizer spends about a token a character on JSON, and test jobs take 256.
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]


def agentic_row(i: int, text: str) -> dict[str, Any]:
    """A row as an agent's log holds it, in the form a template takes (content "" on the
    call, arguments an object): tools, reasoning, a call, its result, the answer."""
    function = {"name": "lookup", "arguments": {"word": WORDS[i % len(WORDS)]}}
    call = {"id": f"call-{i}", "type": "function", "function": function}
    return {
        "id": f"agent-{i}",
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": f"{text} #{i}?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "look it up",
                "tool_calls": [call],
            },
            {"role": "tool", "tool_call_id": f"call-{i}", "content": "a draft model"},
            {"role": "assistant", "content": "it is a draft model."},
        ],
    }


def good_rows(count: int) -> list[dict[str, Any]]:
    """Chat rows (some with two assistant turns, the eleventh an agent's: TOOLS, a call, its
    result) and plain text rows of varied lengths."""
    rows = []
    for i in range(count):
        text = " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(3 + (i * 7) % 30))
        if i == 10:  # short: the tools and the call as SGLang serves them take ~230 tokens
            rows.append(agentic_row(i, " ".join(text.split()[:3])))
            continue
        if i % 3 == 2:
            rows.append({"id": f"text-{i}", "text": f"{text} #{i}."})
            continue
        messages = [
            {"role": "user", "content": f"{text} #{i}?"},
            {"role": "assistant", "content": " ".join(WORDS[: 2 + i % 8])},
        ]
        if i % 3 == 1:
            messages += [
                {"role": "user", "content": "and then?"},
                {"role": "assistant", "content": "it keeps going."},
            ]
        rows.append({"id": f"chat-{i}", "messages": messages})
    return rows


BAD_LINES = {
    "bad-empty": json.dumps({"id": "bad-empty", "text": ""}),
    "bad-long": json.dumps({"id": "bad-long", "text": "word " * 400}),
    "bad-type": json.dumps({"id": "bad-type", "text": 5}),
    "bad-content": json.dumps({"id": "bad-content", "messages": [{"role": "user", "content": 3}]}),
}


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Rows are JSON values, or bytes written as the line itself."""
    with path.open("wb") as f:
        for row in rows:
            f.write(row if isinstance(row, bytes) else json.dumps(row).encode())
            f.write(b"\n")
    return path


def write_prompts(path: Path, count: int, bad: bool = False) -> list[dict[str, Any]]:
    rows = good_rows(count)
    lines = [json.dumps(r) for r in rows]
    if bad:  # spread among the good rows, plus a line that is not JSON at all
        for j, line in enumerate(BAD_LINES.values()):
            lines.insert(2 + 3 * j, line)
        lines.insert(5, '{"id": "truncated", "text": "no end')
    path.write_text("\n".join(lines) + "\n")
    return rows


def chat_prompts(model_path: Path, count: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Chat prompts of varied lengths (token ids, loss mask over assistant tokens)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    words = "a draft model learns what the target model would say next at every token".split()
    ids, masks = [], []
    for i in range(count):
        question = " ".join(words[(i * 3 + k) % len(words)] for k in range(4 + (i * 11) % 40))
        messages = [
            {"role": "user", "content": f"{question} #{i}?"},
            {"role": "assistant", "content": " ".join(words[: 3 + i % 9])},
        ]
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids.append(np.array(out["input_ids"], np.int32))
        masks.append(np.array(out["assistant_masks"], np.uint8))
    return ids, masks
