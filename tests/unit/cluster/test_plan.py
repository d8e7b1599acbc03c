"""cluster/plan.py on the tiny models' real tokenizer: formats, ids, loss masks, every reject."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster import plan as plan_mod
from cluster import plan_sources
from cluster.config import DataConfig
from cluster.loss_mask import BOUNDARY_MERGED
from cluster.plan import (
    Plan,
    PlanError,
    build_plan,
    chat_template_text,
    source_hashes,
)
from tests.helpers.prompts import write_jsonl

ASSISTANT_END = "<|im_end|>"  # the tiny template's generation blocks end with it

# The tiny template (tools/tiny_models.py) without its {% generation %} markers. Jinja runs with
# trim_blocks, so the tiny template loses the newline after {% endgeneration %}: the assistant
# branch here has none either, so both render the same text.
NO_MARKERS_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}"
    "{{ message['content'] }}<|im_end|>"
    "{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat(*turns: str, first: str = "user") -> list[dict[str, str]]:
    roles = ["user", "assistant"] if first == "user" else ["assistant", "user"]
    return [{"role": roles[i % 2], "content": c} for i, c in enumerate(turns)]


CHAT_ROWS: list[dict[str, Any]] = [
    {"id": "t1", "text": "the answer is 42."},
    {"id": "c1", "messages": chat("hello world", "the answer is 42.")},
    {
        "id": "c2",
        "messages": [
            {"role": "system", "content": "be nice"},
            *chat("why?", "yes it's science", "and?", "the river and the ocean"),
        ],
    },
    {"id": "c3", "messages": chat("hi there", "what is the capital of france?", first="assistant")},
    {"id": 17, "text": "paris is the capital city of france. Why? Yes!"},
]


def columnar(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row with every column (null where absent), as Parquet / datasets store them."""
    return [{k: row.get(k) for k in ("id", "text", "messages")} for row in rows]


def plan_for(path: Path | list[Path], model: Path, **data: Any) -> Plan:
    """The plan, checked against what a resume compares without planning."""
    paths = [str(p) for p in (path if isinstance(path, list) else [path])]
    config = DataConfig(paths=paths, **data)
    plan = build_plan(config, model)
    assert source_hashes(config) == [s["sha256"] for s in plan.sources]
    assert chat_template_text(config, model) == plan.chat_template
    return plan


def as_tuple(plan: Plan) -> tuple:
    return (
        plan.sample_ids,
        [x.tolist() for x in plan.input_ids],
        [m.tolist() for m in plan.loss_masks],
        plan.rejected,
    )


def mask_runs(ids: np.ndarray, mask: np.ndarray, tok: Any) -> list[str]:
    """The decoded text of each run of 1s in the mask."""
    runs, start = [], None
    for i, m in enumerate([*mask.tolist(), 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(tok.decode(ids[start:i].tolist()))
            start = None
    return runs


@pytest.fixture(scope="module")
def tok(llama_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_path)


@pytest.fixture(scope="module")
def model_copy(llama_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """A copy of the tiny model's tokenizer and config (no weights) to edit."""

    def make(name: str) -> Path:
        dst = tmp_path_factory.mktemp("models") / name
        shutil.copytree(llama_path, dst, ignore=shutil.ignore_patterns("*.safetensors"))
        return dst

    return make


def test_jsonl_text_and_chat_rows(
    tmp_path: Path, llama_path: Path, tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    no_id = {"messages": chat("no id here", "fine")}
    path = write_jsonl(tmp_path / "data.jsonl", [CHAT_ROWS[0], b"", b"  ", no_id, *CHAT_ROWS[1:]])
    with caplog.at_level(logging.INFO, logger="cluster.plan"):
        plan = plan_for(path, llama_path)

    assert plan.sample_ids == ["t1", "data.jsonl:4", "c1", "c2", "c3", "17"]  # 1-based line numbers
    assert plan.rejected == []
    rows = [CHAT_ROWS[0], no_id, *CHAT_ROWS[1:]]
    for row, ids, mask in zip(rows, plan.input_ids, plan.loss_masks, strict=True):
        assert ids.dtype == np.int32 and mask.dtype == np.uint8 and len(ids) == len(mask)
        if "text" in row:
            assert ids.tolist() == tok(row["text"], add_special_tokens=True)["input_ids"]
            assert mask.all()
            continue
        ref = tok.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids.tolist() == ref["input_ids"] and mask.tolist() == ref["assistant_masks"]
        assistant = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert mask_runs(ids, mask, tok) == [c + ASSISTANT_END for c in assistant]

    assert plan.total_tokens == sum(len(x) for x in plan.input_ids)
    assert plan.chat_template == tok.chat_template
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert plan.sources == [
        {"path": str(path.resolve()), "format": "jsonl", "sha256": digest, "rows": 6}
    ]
    assert f"6 samples accepted, 0 rejected, {plan.total_tokens} tokens" in caplog.text


def test_loss_mask_all_and_chunking(
    tmp_path: Path, llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_assistant = {"id": "q", "messages": chat("only a question?")}
    path = write_jsonl(tmp_path / "d.jsonl", [*CHAT_ROWS, no_assistant])
    plan = plan_for(path, llama_path, loss_mask="all")
    assert plan.sample_ids == ["t1", "c1", "c2", "c3", "17", "q"] and plan.rejected == []
    assert all(m.all() for m in plan.loss_masks)
    assistant_only = plan_for(path, llama_path)  # the same tokens; only the masks differ
    assert as_tuple(assistant_only)[1] == as_tuple(plan)[1][:5]

    # Chunks of 2 rows give the same plan as one chunk.
    monkeypatch.setattr(plan_mod, "BATCH_ROWS", 2)
    assert as_tuple(plan_for(path, llama_path, loss_mask="all")) == as_tuple(plan)


def test_parquet_and_hf_dirs_match_jsonl(tmp_path: Path, llama_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = columnar(
        [
            *CHAT_ROWS,
            {"id": "both", "text": "x", "messages": chat("a", "b")},
            {"id": "long", "text": "the model layer token " * 40},
            {"id": "c1", "text": "a duplicate id"},
        ]
    )
    rows = [{**r, "id": str(r["id"])} for r in rows]  # one column type for Parquet
    ref = plan_for(write_jsonl(tmp_path / "d.jsonl", rows), llama_path, max_length=64)
    assert ref.sample_ids == ["t1", "c1", "c2", "c3", "17"]
    assert [r["sample_id"] for r in ref.rejected] == ["both", "long", "c1"]

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=3)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    splits = {
        "train": datasets.Dataset.from_list(rows[:2]),
        "test": datasets.Dataset.from_list(rows),
    }
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))

    for path, fmt in [("d.parquet", "parquet"), ("ds", "hf"), ("dd", "hf")]:
        plan = plan_for(tmp_path / path, llama_path, max_length=64, split="test")
        # Same rows, but the first "c1" is line 2 of the JSONL and row 1 of the others.
        dup = {"sample_id": "c1", "reason": f"duplicate sample id (first seen at {path}:1)"}
        assert as_tuple(plan) == (*as_tuple(ref)[:3], [*ref.rejected[:2], dup]), path
        assert plan.sources[0]["format"] == fmt and plan.sources[0]["rows"] == len(rows)

    # Without ids: 0-based row indices, the directory's name for an HF dataset.
    no_ids = [{**r, "id": None} for r in rows[:2]]
    datasets.Dataset.from_list(no_ids).save_to_disk(str(tmp_path / "noid"))
    pq.write_table(pa.Table.from_pylist(no_ids), tmp_path / "noid.parquet")
    plan = plan_for([tmp_path / "noid", tmp_path / "noid.parquet"], llama_path)
    assert plan.sample_ids == ["noid:0", "noid:1", "noid.parquet:0", "noid.parquet:1"]
    assert [s["format"] for s in plan.sources] == ["hf", "parquet"]


def test_rows_without_ids_in_inputs_of_the_same_name_get_distinct_ids(
    tmp_path: Path, llama_path: Path
) -> None:
    """A generated id names its input by as many trailing path parts as tell it from the other
    inputs (a file name alone where that is unique); before, every row of the second
    train.jsonl was rejected as a duplicate of the first's."""
    rows = [{"text": "the answer is 42."}, {"text": "why? yes."}]
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
    inputs = [
        write_jsonl(tmp_path / "a" / "train.jsonl", rows),
        write_jsonl(tmp_path / "b" / "train.jsonl", rows),
        write_jsonl(tmp_path / "b" / "other.jsonl", rows),
    ]
    plan = plan_for(inputs, llama_path)
    assert plan.rejected == []
    assert plan.sample_ids == [
        *("a/train.jsonl:1", "a/train.jsonl:2", "b/train.jsonl:1", "b/train.jsonl:2"),
        *("other.jsonl:1", "other.jsonl:2"),
    ]
    same_file_twice = [Path("/z/u.jsonl"), Path("/z/u.jsonl")]  # its rows are duplicates
    assert plan_mod.source_names(
        [Path("/x/a/t.jsonl"), Path("/y/a/t.jsonl"), *same_file_twice]
    ) == [
        "x/a/t.jsonl",
        "y/a/t.jsonl",
        "u.jsonl",
        "u.jsonl",
    ]


def test_an_id_holding_a_nul_is_refused_rather_than_merged_with_its_neighbour(
    tmp_path: Path, llama_path: Path
) -> None:
    """The store keeps ids as fixed-width strings, which drop trailing NULs: "a" and a NUL
    would be stored as "a", a second sample of that id."""
    rows = [{"id": "a", "text": "the answer is 42."}, {"id": "a\u0000", "text": "why? yes."}]
    plan = plan_for(write_jsonl(tmp_path / "r.jsonl", rows), llama_path)
    assert plan.sample_ids == ["a"]
    assert plan.rejected == [{"sample_id": "r.jsonl:2", "reason": "id contains a NUL character"}]


def test_every_reject_reason(tmp_path: Path, llama_path: Path, tok: Any) -> None:
    long_text = "the model layer token " * 40
    n_long = len(tok(long_text)["input_ids"])
    good = [
        {"id": "t1", "text": "the answer is 42."},
        {"id": "c1", "messages": chat("hello", "world")},
        {"id": "t2", "text": "why? yes."},
    ]
    lines_and_reasons: list[tuple[Any, str, str]] = [
        (b"\xff\xfe{}", "r.jsonl:2", "not valid UTF-8"),
        (
            b"{bad",
            "r.jsonl:3",
            "malformed JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)",
        ),
        ([1, 2], "r.jsonl:4", "row must be a JSON object, got list"),
        ({"id": 1.5, "text": "x"}, "r.jsonl:5", "id must be a string or an integer, got float"),
        ({"id": True, "text": "x"}, "r.jsonl:6", "id must be a string or an integer, got bool"),
        ({"id": "", "text": "x"}, "r.jsonl:7", "id is an empty string"),
        ({"id": "t1", "text": "x"}, "t1", "duplicate sample id (first seen at r.jsonl:1)"),
        (
            {"id": "b", "text": "x", "messages": chat("a", "b")},
            "b",
            "row has both text and messages",
        ),
        ({"id": "n", "other": 1}, "n", "row has none of text, messages, conversations"),
        ({"id": "ti", "text": 5}, "ti", "text must be a string, got int"),
        ({"id": "te", "text": ""}, "te", "empty text"),
        ({"id": "ms", "messages": "hi"}, "ms", "messages must be a list, got string"),
        ({"id": "me", "messages": []}, "me", "empty messages"),
        ({"id": "mi", "messages": ["hi"]}, "mi", "messages[0] must be an object, got string"),
        (
            {"id": "mr", "messages": [{"role": None, "content": "x"}]},
            "mr",
            "messages[0].role must be a string, got null",
        ),
        (
            {"id": "mc", "messages": [*chat("a", "b"), {"role": "user", "content": 3}]},
            "mc",
            "messages[2].content must be a string or a list of parts, got int",
        ),
        (
            {"id": "mp", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "mp",
            "messages[0].content[0].text must be a string, got null",
        ),
        ({"id": "tw", "text": " \n\t "}, "tw", "text is only whitespace"),
        (
            {"id": "mu", "messages": [{"role": "narrator", "content": "x"}, *chat("a", "b")]},
            "mu",
            "messages[0].role 'narrator' is not one of data.roles "
            "['system', 'user', 'assistant', 'tool']",
        ),
        ({"id": "na", "messages": chat("question?")}, "na", "no assistant turn to train on"),
        ({"id": "l", "text": long_text}, "l", f"{n_long} tokens > max_length 64"),
        (
            {"id": "t1", "text": "the answer is 42."},
            "t1",
            "duplicate sample id (first seen at r.jsonl:1)",
        ),
    ]
    lines = [good[0], *[x[0] for x in lines_and_reasons[:10]], good[1]]
    lines += [*[x[0] for x in lines_and_reasons[10:]], good[2]]
    plan = plan_for(write_jsonl(tmp_path / "r.jsonl", lines), llama_path, max_length=64)

    assert plan.sample_ids == ["t1", "c1", "t2"]
    assert plan.rejected == [{"sample_id": i, "reason": r} for _, i, r in lines_and_reasons]
    assert plan.sources[0]["rows"] == len(lines)
    # The same rows read under loss_mask all keep "na" (no assistant turn needed).
    plan_all = plan_for(tmp_path / "r.jsonl", llama_path, max_length=64, loss_mask="all")
    assert plan_all.sample_ids == ["t1", "c1", "na", "t2"]
    # A role the template knows is allowed by naming it.
    roles = ["narrator", "user", "assistant"]
    plan_roles = plan_for(tmp_path / "r.jsonl", llama_path, max_length=64, roles=roles)
    assert plan_roles.sample_ids == ["t1", "c1", "mu", "t2"]


def test_out_of_vocab_tokens(tmp_path: Path, model_copy, tok: Any) -> None:
    model = model_copy("small-vocab")
    low, high = "a b", "the capital city of france"
    vocab = max(tok(low)["input_ids"]) + 1
    bad = next(i for i in tok(high)["input_ids"] if i >= vocab)
    # text_config.vocab_size wins over the top-level one (multimodal configs nest it).
    config = json.loads((model / "config.json").read_text())
    config["text_config"] = {"vocab_size": vocab}
    (model / "config.json").write_text(json.dumps(config))

    path = write_jsonl(tmp_path / "v.jsonl", [{"text": high}, {"text": low}])
    plan = plan_for(path, model)
    assert plan.sample_ids == ["v.jsonl:2"]
    reason = f"token id {bad} is outside the model's vocabulary [0, {vocab})"
    assert plan.rejected == [{"sample_id": "v.jsonl:1", "reason": reason}]


def test_no_chat_template(tmp_path: Path, model_copy) -> None:
    model = model_copy("no-template")
    (model / "chat_template.jinja").unlink()
    path = write_jsonl(tmp_path / "d.jsonl", CHAT_ROWS)
    plan = plan_for(path, model)
    assert plan.chat_template is None
    assert plan.sample_ids == ["t1", "17"]
    reason = "the model has no chat template; set data.chat_template"
    assert plan.rejected == [{"sample_id": i, "reason": reason} for i in ("c1", "c2", "c3")]


def test_prefix_mask_equals_generation_mask(tmp_path: Path, llama_path: Path, tok: Any) -> None:
    template = tmp_path / "no_markers.jinja"
    template.write_text(NO_MARKERS_TEMPLATE)
    path = write_jsonl(tmp_path / "d.jsonl", CHAT_ROWS)
    marked = plan_for(path, llama_path)
    by_prefix = plan_for(path, llama_path, chat_template=str(template))
    assert by_prefix.chat_template == NO_MARKERS_TEMPLATE
    assert as_tuple(by_prefix) == as_tuple(marked)
    assert sum(m.sum() for m in by_prefix.loss_masks) > 0


def test_an_end_of_conversation_token_is_not_part_of_earlier_turns(
    tmp_path: Path, llama_path: Path
) -> None:
    # `<|eos|>` only after the last message: earlier assistant turns render differently once
    # later turns follow (the old per-turn prefix method rejected c2 and c3 for it); the turn end
    # is what follows an assistant's content in both cases, so the masks stay the marked ones.
    template = tmp_path / "eos.jinja"
    template.write_text(
        NO_MARKERS_TEMPLATE + "{% if not add_generation_prompt %}<|eos|>{% endif %}"
    )
    path = write_jsonl(tmp_path / "d.jsonl", CHAT_ROWS)
    plan = plan_for(path, llama_path, chat_template=str(template))
    marked = plan_for(path, llama_path)
    assert plan.rejected == []
    eos = plan.input_ids[1][-1]  # each chat row ends with the extra token, unmasked
    for ids, mask, ref_ids, ref_mask in zip(
        plan.input_ids, plan.loss_masks, marked.input_ids, marked.loss_masks, strict=True
    ):
        if len(ids) == len(ref_ids):  # a text row
            assert ids.tolist() == ref_ids.tolist() and mask.tolist() == ref_mask.tolist()
        else:
            assert ids.tolist() == [*ref_ids.tolist(), eos] and mask.tolist() == [*ref_mask, 0]


# A ChatML template as chat models ship it: no markers, a `\n` after every `<|im_end|>`, and a
# default system prompt when the conversation does not open with one.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chatml_masks_each_turn_and_its_end_token_only(
    tmp_path: Path, llama_path: Path, tok: Any
) -> None:
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    rows = [
        {"id": "two", "messages": chat("hello", "world", "why?", "yes it's science")},
        # Content starting with "\n\n": its first token merges with the header's "\n".
        {"id": "newlines", "messages": chat("hello", "\n\nthe answer is 42.")},
        {"id": "opens", "messages": chat("the answer is 42.", "thanks", first="assistant")},
        {"id": "echo", "messages": chat("yes", "yes")},  # the user's words are not the turn
        {"id": "system", "messages": [{"role": "system", "content": "be nice"}, *chat("a", "b")]},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    plan = plan_for(path, llama_path, chat_template=str(template))
    assert plan.rejected == []
    runs = {
        sid: mask_runs(ids, mask, tok)
        for sid, ids, mask in zip(plan.sample_ids, plan.input_ids, plan.loss_masks, strict=True)
    }
    end = ASSISTANT_END
    assert runs["two"] == ["world" + end, "yes it's science" + end]
    assert runs["opens"] == ["the answer is 42." + end]
    assert runs["echo"] == ["yes" + end]
    assert runs["system"] == ["b" + end]
    # The merged "\n\n\n" token overlaps the content, so it is the turn's (as a generation
    # block's overlapping tokens are in transformers' mask).
    assert runs["newlines"][0].endswith("the answer is 42." + end)
    assert runs["newlines"][0].strip("\n") == "the answer is 42." + end
    for ids, mask in zip(plan.input_ids, plan.loss_masks, strict=True):
        text = tok.decode(ids.tolist())
        assert text.endswith(end + "\n") and mask[-1] == 0  # the "\n" after it: never masked

    # Without character offsets (a slow tokenizer): the same masks.
    data = DataConfig(paths=[str(path)], chat_template=str(template))
    assert slow_encode(rows, data, llama_path) == [
        (ids.tolist(), mask.tolist())
        for ids, mask in zip(plan.input_ids, plan.loss_masks, strict=True)
    ]


def slow_encode(rows: list[dict[str, Any]], data: DataConfig, model: Path) -> list[Any]:
    """The encoder's results for `rows` as a tokenizer without character offsets gets them."""
    encoder = plan_mod.Encoder.load(data, model, False)
    encoder.use_offsets = False
    results = encoder.encode([plan_mod.parse_row(r, None, data) for r in rows])
    return [r if isinstance(r, str) else (r[0].tolist(), r[1].tolist()) for r in results]


def test_a_token_merged_across_the_header_edge_is_the_turns(
    tmp_path: Path, llama_path: Path, tok: Any
) -> None:
    # The header ends with a space and the content starts with a word: the tokenizer makes one
    # token of them (" the"), so no rendering of the header alone is a token prefix of the
    # conversation's (the old per-turn prefix method rejected every such row).
    template = tmp_path / "colon.jinja"
    template.write_text(CHATML.replace("{{ message['role'] }}\n", "{{ message['role'] }}: "))
    rows = [{"id": "c", "messages": chat("hello", "the answer is 42.")}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    plan = plan_for(path, llama_path, chat_template=str(template))
    ids, mask = plan.input_ids[0], plan.loss_masks[0]
    header_end = tok.convert_ids_to_tokens(ids.tolist()).index("Ġthe")
    assert mask_runs(ids, mask, tok) == [" the answer is 42." + ASSISTANT_END]
    assert mask[header_end - 1] == 0  # "assistant:" stays unmasked
    # Without offsets that token cannot be placed: the row is rejected, never mis-masked.
    data = DataConfig(paths=[str(path)], chat_template=str(template))
    assert slow_encode(rows, data, llama_path) == [BOUNDARY_MERGED.format(turn=0)]


def test_a_template_that_rewrites_earlier_turns_gets_each_turn_as_rendered(
    tmp_path: Path, llama_path: Path, tok: Any
) -> None:
    # As reasoning models' templates do: earlier assistant turns lose their "<think>" part.
    # The mask holds what the template renders for each turn in this conversation.
    template = tmp_path / "think.jinja"
    template.write_text(
        CHATML.replace(
            "{{ message['content'] }}",
            "{% if message['role'] == 'assistant' and not loop.last %}"
            "{{ message['content'].split('</think>')[-1] }}"
            "{% else %}{{ message['content'] }}{% endif %}",
        )
    )
    rows = [
        {"id": "one", "messages": chat("q", "<think>hmm</think>the answer")},
        {"id": "two", "messages": chat("q", "<think>hmm</think>first", "and?", "second")},
    ]
    plan = plan_for(
        write_jsonl(tmp_path / "d.jsonl", rows), llama_path, chat_template=str(template)
    )
    assert plan.rejected == []
    runs = [mask_runs(i, m, tok) for i, m in zip(plan.input_ids, plan.loss_masks, strict=True)]
    assert runs == [
        ["<think>hmm</think>the answer<|im_end|>"],
        ["first<|im_end|>", "second<|im_end|>"],
    ]


def test_parts_give_the_same_plan_wherever_they_are_cut(
    tmp_path: Path, llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        *CHAT_ROWS,
        b"",
        {"text": "no id"},
        {"id": "c1", "text": "dup"},
        b"{bad",
        *CHAT_ROWS[:1],
    ]
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    good = [r for r in rows if isinstance(r, dict)]
    pq.write_table(
        pa.Table.from_pylist(columnar([{**r, "id": r.get("id") and str(r["id"])} for r in good])),
        tmp_path / "d.parquet",
        row_group_size=1,
    )
    whole = plan_for([jsonl, tmp_path / "d.parquet"], llama_path)
    monkeypatch.setattr(plan_sources, "PART_BYTES", 7)  # parts cut inside lines, some empty
    monkeypatch.setattr(plan_sources, "PART_ROWS", 2)
    assert len(
        list(
            plan_sources.split_parts(
                [plan_sources.resolve_source(str(jsonl), "auto")], DataConfig(paths=[str(jsonl)])
            )
        )
    ) > len(rows)
    cut = plan_for([jsonl, tmp_path / "d.parquet"], llama_path)
    assert as_tuple(cut) == as_tuple(whole)
    assert cut.sources == whole.sources
    assert "d.jsonl:7" in whole.sample_ids  # numbered across parts: line 7 of the file


@pytest.mark.parametrize("markers", [True, False])
def test_template_errors_zero_tokens_and_unmarked_rows(
    tmp_path: Path, llama_path: Path, tok: Any, markers: bool
) -> None:
    # Roles other than user/assistant raise; role "silent" renders nothing; an assistant's
    # content is its only marked part (no end token), so an empty one marks nothing.
    body = "{{ message['content'] }}"
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for message in messages %}"
        "{% if message['role'] not in ['user', 'assistant', 'silent'] %}"
        "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
        "{% if message['role'] != 'silent' %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['role'] == 'assistant' %}"
        + ("{% generation %}" + body + "{% endgeneration %}" if markers else body)
        + "{% else %}{{ message['content'] }}{% endif %}<|im_end|>{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    rows = [
        {"id": "ok", "messages": chat("hello", "world")},
        {"id": "tool", "messages": [*chat("hello", "world"), {"role": "tool", "content": "x"}]},
        {"id": "empty", "messages": chat("hello", "")},
        {"id": "ok2", "messages": chat("why?", "yes")},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    plan = plan_for(path, llama_path, chat_template=str(template))
    error = {"sample_id": "tool", "reason": "chat template error: unknown role tool"}
    if markers:
        assert plan.sample_ids == ["ok", "ok2"]
        unmarked = {"sample_id": "empty", "reason": "the chat template marks no assistant tokens"}
        assert plan.rejected == [error, unmarked]
    else:  # prefix differences take the end token too, so the empty turn still marks one token
        assert plan.sample_ids == ["ok", "empty", "ok2"]
        assert plan.rejected == [error]
        ids, mask = plan.input_ids[1], plan.loss_masks[1]
        assert mask_runs(ids, mask, tok) == [ASSISTANT_END]
    silent = write_jsonl(tmp_path / "s.jsonl", [{"messages": [{"role": "silent", "content": "x"}]}])
    plan = plan_for(
        silent, llama_path, chat_template=str(template), loss_mask="all", roles=["silent"]
    )
    assert plan.rejected == [{"sample_id": "s.jsonl:1", "reason": "zero tokens"}]


def test_plan_errors(tmp_path: Path, llama_path: Path) -> None:
    good = write_jsonl(tmp_path / "d.jsonl", CHAT_ROWS[:1])
    with pytest.raises(PlanError, match=r"missing\.jsonl"):
        plan_for([good, tmp_path / "missing.jsonl"], llama_path)
    (tmp_path / "d.csv").write_text("id,text\n")
    with pytest.raises(PlanError, match=r"d\.csv.*set data\.format"):
        plan_for(tmp_path / "d.csv", llama_path)
    with pytest.raises(PlanError, match=r"nope\.jinja"):
        plan_for(good, llama_path, chat_template=str(tmp_path / "nope.jinja"))
    with pytest.raises(PlanError, match="is a directory"):
        plan_for(tmp_path, llama_path, format="jsonl")
    with pytest.raises(PlanError, match=r"d\.csv"):
        plan_for(tmp_path / "d.csv", llama_path, format="parquet")
    with pytest.raises(PlanError, match="saved datasets directory"):
        plan_for(tmp_path, llama_path)

    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(CHAT_ROWS[:1])}).save_to_disk(
        str(tmp_path / "dd")
    )
    with pytest.raises(PlanError, match="no split 'validation'"):
        plan_for(tmp_path / "dd", llama_path, split="validation")


def test_token_masks_from_an_encoding_and_from_its_offsets_agree(tok: Any) -> None:
    """Both ways the planner maps character spans to tokens (the fast tokenizer's encoding, asked
    at the spans' edges; a list of every token's offsets) give the same mask, which covers
    exactly the tokens overlapping each span."""
    from cluster.loss_mask import token_mask

    text = "<|im_start|>assistant\n\n\nthe answer is 42.<|im_end|>\n<|im_start|>user: why?"
    encoding = tok.backend_tokenizer.encode(text, add_special_tokens=False)
    n = len(encoding.ids)
    content = text.index("\n\nthe")
    spans = [(content, text.index("\n<|im_start|>user")), (text.index("why"), len(text))]
    for some in ([], spans[:1], spans, [(5, 5)]):
        by_edges = token_mask(some, encoding, n)
        by_offsets = token_mask(some, encoding.offsets, n)
        overlapping = [
            int(any(s < b and e > a and b > a for a, b in some)) for s, e in encoding.offsets
        ]
        assert by_edges.tolist() == by_offsets.tolist() == overlapping, some
