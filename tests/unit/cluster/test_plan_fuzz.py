"""No row, however shaped, raises out of `build_plan`: generated rows of every shape (text, OpenAI,
ShareGPT, LLaMA-Factory images, junk) in JSONL and Parquet, each accepted or rejected with a
reason of its own (never PLANNER_FAULT, the guard that keeps one row's bug from stopping a job).

Hypothesis, derandomized (the same examples every run) and bounded in examples; the tiny Llama's
tokenizer and the tiny Qwen2.5-VL's processor, whose image rows read real sources: files in
the input's folder, a FIFO, data URLs, a URL to a closed loopback port, URLs that do not parse.
"""

from __future__ import annotations

import base64
import copy
import functools
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from cluster.config import DataConfig
from cluster.plan import PLANNER_FAULT, build_plan
from tests.helpers.bad_images import damaged_dds, png_claiming
from tests.helpers.prompts import write_jsonl

FAULT = PLANNER_FAULT.split("(")[0]
QWEN3 = str(Path(__file__).resolve().parents[2] / "chat_templates" / "qwen3.jinja")
FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((28, 28, 3), 200, np.uint8)).save(out, "PNG")
    return out.getvalue()


PNG = _png()
READABLE = ["red.png", "data:image/png;base64," + base64.b64encode(PNG).decode()]
SOURCES = [
    *READABLE,
    "pipe.png",
    "notes.txt",
    "missing.png",
    "../outside.png",
    "/dev/zero",
    "file:///etc/hostname",
    "file://[::1/a.png",
    "http://[::1/a.png",
    "s3://[::1/a.png",
    "http://127.0.0.1:9/a.png",  # the discard port: nobody listens
    "data:image/png;base64,@@@@",
    "data:image/png;base64," + base64.b64encode(png_claiming(10**5, 10**5)).decode(),
    "data:image/dds;base64," + base64.b64encode(damaged_dds()).decode(),
    "data:image/png,raw",
    "",
]
ODD = ["\ud800", "\udfff", "<image>", "<|im_start|>", "<|image_pad|>", "{", "[]", " ", ""]
DEEP, HUGE = "[" * 5000 + "]" * 5000, '{"n": ' + "9" * 5000 + "}"
WORDS = ["hi", "what is it?", "red", "look it up", "a draft model", "18C", "ok"]
strings = st.one_of(st.text(max_size=12), st.sampled_from(ODD + SOURCES))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), strings)
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(strings, inner, max_size=3),
    max_leaves=8,
)
odd = st.one_of(
    junk,
    st.sampled_from([*ODD, *SOURCES, DEEP, HUGE, '{"a":']),
    st.integers(60, 80).map(lambda depth: functools.reduce(lambda v, _: [v], range(depth), 0)),
)

# Plausible rows of every shape: they reach the tokenizer, the template and the image reader.
text = st.sampled_from(WORDS)
source = st.sampled_from(READABLE * 4 + SOURCES)  # a third of them readable
image_part = source.flatmap(
    lambda s: st.sampled_from(
        [
            {"type": "image_url", "image_url": {"url": s}},
            {"type": "image", "image": s},
            {"type": "input_image", "image_url": s},
        ]
    )
)
text_part = st.builds(
    lambda t, kind: {"type": kind, "text": t}, text, st.sampled_from(["text", "input_text"])
)
parts = st.lists(st.sampled_from([text_part, image_part]).flatmap(lambda p: p), max_size=3)
content = st.sampled_from([text, parts.filter(bool), image_part.map(lambda p: [p])]).flatmap(
    lambda c: c
)
call = st.builds(
    lambda word, as_text: {
        "type": "function",
        "function": {
            "name": "lookup",
            "arguments": json.dumps({"q": word}) if as_text else {"q": word},
        },
    },
    text,
    st.booleans(),
)
tool = st.sampled_from(
    [
        {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
        {"name": "lookup", "parameters": {"type": "object"}},  # LLaMA-Factory's bare form
    ]
)
user = st.builds(lambda c: {"role": "user", "content": c}, content)
answer = st.builds(lambda t: {"role": "assistant", "content": t}, text)
calling = st.builds(
    lambda calls: {"role": "assistant", "content": None, "tool_calls": calls},
    st.lists(call, min_size=1, max_size=2),
)
result = st.builds(lambda t: {"role": "tool", "content": t}, text)
openai = st.fixed_dictionaries(
    {
        "messages": st.one_of(
            st.tuples(user, answer), st.tuples(user, calling, result, answer)
        ).map(list)
    },
    optional={
        "tools": st.lists(tool, min_size=1, max_size=2) | st.lists(tool, max_size=1).map(json.dumps)
    },
)
turn = st.builds(lambda who, t: {"from": who, "value": t}, st.sampled_from(["human", "gpt"]), text)
sharegpt = st.fixed_dictionaries(
    {"conversations": st.lists(turn, min_size=1, max_size=4)}, optional={"system": text}
)
# LLaMA-Factory's: tags in the first turn, an image each
tagged = st.lists(source, max_size=2).map(
    lambda images: {
        "conversations": [
            {"from": "human", "value": "<image>" * len(images) + " what?"},
            {"from": "gpt", "value": "red"},
        ],
        "images": images,
    }
)
# sampled, not one_of: each shape as often (one_of leans to its first)
plausible = st.sampled_from(
    [st.builds(lambda t: {"text": t}, text), openai, openai, sharegpt, tagged, tagged]
).flatmap(lambda shape: shape)


def locations(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of every member of `value`, itself included."""
    found = [path]
    if isinstance(value, dict):
        for key, member in value.items():
            found += locations(member, (*path, key))
    elif isinstance(value, list):
        for k, member in enumerate(value):
            found += locations(member, (*path, k))
    return found


# A string cut as a writer that split an emoji's UTF-16 leaves it, or holding markup.
odd_text = st.tuples(text, st.sampled_from(["\ud83d", "\udfff", "<image>", "<|image_pad|>"]))


@st.composite
def rows(draw: st.DrawFn) -> Any:
    """A plausible row with an id; most with one value somewhere replaced by an odd one (a
    string, often, by an odd string: the tokenizer's and the template's inputs)."""
    # A copy: the strategies' constants (a sampled tool) must not change under a mutation.
    row = copy.deepcopy({"id": draw(st.text(min_size=1, max_size=6)), **draw(plausible)})
    mutation = draw(st.sampled_from(["none", "any", "string", "string"]))
    if mutation == "none":
        return row
    paths = locations(row)
    if mutation == "string":
        paths = [p for p in paths if isinstance(at(row, p), str)] or paths
        word, tail = draw(odd_text)
        value = word + tail
    else:
        value = draw(odd)
    path = draw(st.sampled_from(paths))
    if not path:
        return value
    at(row, path[:-1])[path[-1]] = value
    return row


def at(value: Any, path: tuple[Any, ...]) -> Any:
    return functools.reduce(lambda v, k: v[k], path, value)


line = rows().map(lambda r: json.dumps(r).encode())
lines = st.lists(
    st.sampled_from([line] * 9 + [st.binary(max_size=16)]).flatmap(lambda x: x), max_size=4
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The inputs' folder, its images beside them; a FIFO among them."""
    inputs = tmp_path_factory.mktemp("fuzz")
    (inputs / "red.png").write_bytes(PNG)
    (inputs / "notes.txt").write_text("not an image")
    (inputs.parent / "outside.png").write_bytes(PNG)
    os.mkfifo(inputs / "pipe.png")
    return inputs


def check_plan(path: Path, model: Path, rows: int, **data: Any) -> None:
    """Each of the `rows` accepted or rejected with a reason of its own."""
    plan = build_plan(DataConfig(paths=[str(path)], **data), model)
    assert len(plan.sample_ids) + len(plan.rejected) == rows
    for reject in plan.rejected:
        assert reject["reason"] and FAULT not in reject["reason"], reject


def jsonl_rows(path: Path) -> int:
    """Its lines that are not blank (a generated byte string may hold a newline)."""
    return sum(1 for line in path.read_bytes().split(b"\n") if line.strip())


# The same file each example: the planner's tokenizer, cached by the job's settings, is reused.
@settings(FUZZ, max_examples=250)
@given(rows=lines)
def test_no_jsonl_row_raises_out_of_the_plan_on_a_text_model(
    folder: Path, llama_path: Path, rows: list[bytes]
) -> None:
    path = write_jsonl(folder / "text-model.jsonl", rows)
    check_plan(path, llama_path, jsonl_rows(path), chat_template=QWEN3)  # renders tools


@settings(FUZZ, max_examples=300)
@given(rows=lines)
def test_no_jsonl_row_raises_out_of_the_plan_on_an_image_model(
    folder: Path, qwen25_vl_path: Path, rows: list[bytes]
) -> None:
    path = write_jsonl(folder / "image-model.jsonl", rows)
    check_plan(path, qwen25_vl_path, jsonl_rows(path), image_fetch_timeout_s=2)


valid_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)  # Parquet: UTF-8
parquet_rows = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.none() | valid_text,
            "text": st.none() | valid_text,
            "tools": st.none() | valid_text | st.sampled_from([DEEP, HUGE, "[]", '[{"name": 1}]']),
            "messages": st.none()
            | st.lists(
                st.fixed_dictionaries({"role": st.none() | valid_text, "content": valid_text}),
                max_size=3,
            ),
        }
    ),
    min_size=1,
    max_size=4,
)
PARQUET_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("tools", pa.string()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ]
)


@settings(FUZZ, max_examples=80)
@given(rows=parquet_rows)
def test_no_parquet_row_raises_out_of_the_plan(
    folder: Path, llama_path: Path, rows: list[dict[str, Any]]
) -> None:
    path = folder / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=PARQUET_SCHEMA), path)
    check_plan(path, llama_path, len(rows))
