"""Generate, then capture, without a server: prompts and their segments (the tiny model's real
tokenizer and template), responses made samples, seeds, the kept records, resume checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
import zarr
from transformers import AutoTokenizer

from actors.config import GenerateConfig
from cluster.__main__ import main as cli_main
from cluster.config import ConfigError, DataConfig, parse_config
from cluster.generation_feed import (
    ResponsePlanner,
    _check_answers,
    _Part,
    response_seed,
    sample_ids,
)
from cluster.job_store import open_or_create, plan_into
from cluster.plan import PlanError, PlanStream, Reject, Sample
from cluster.plan_encode import UNRENDERED
from hsx_store.generated import GeneratedParts, closed_turn, conversation
from tests.helpers.jobs import job_config
from tests.helpers.prompts import TOOLS, write_jsonl, write_prompts
from tests.helpers.sglang_chat import served_template_inputs
from tools.tiny_models import CHAT_TEMPLATE

END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok(llama_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(llama_path)


def prompts(
    path: Path,
    model: Path,
    rows: list[Any],
    chat_template: str = "model",
    max_length: int = 128,
    **generate: Any,
) -> list[Sample | Reject]:
    data = DataConfig(
        paths=[str(write_jsonl(path, rows))], max_length=max_length, chat_template=chat_template
    )
    stream = PlanStream(data, model, generate=GenerateConfig(**generate))
    return [item for item in stream if isinstance(item, Sample | Reject)]


def rendered(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    out = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def test_the_last_turn_is_written_anew_from_the_templates_own_generation_prompt(
    tmp_path: Path, llama_path: Path, tok: Any
) -> None:
    u1, a1 = {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}
    u2 = {"role": "user", "content": "and then?"}
    rows = [
        {"id": "ends-with-assistant", "messages": [u1, a1, u2, a1]},
        {"id": "no-assistant", "messages": [u1]},
        {"id": "text", "text": "once upon a time"},
    ]
    a, b, c = prompts(tmp_path / "p.jsonl", llama_path, rows, max_new_tokens=8)
    assert isinstance(a, Sample) and isinstance(b, Sample) and isinstance(c, Sample)
    assert a.input_ids.tolist() == rendered(tok, [u1, a1, u2])  # the earlier turn as written
    assert a.prompt == {
        "prompt": [u1, a1, u2, {"role": "assistant", "content": None}],
        "segments": [len(a.input_ids)],
    }
    assert b.input_ids.tolist() == rendered(tok, [u1])
    assert c.input_ids.tolist() == tok("once upon a time")["input_ids"]
    assert c.prompt == {"prompt": "once upon a time", "segments": [len(c.input_ids)]}
    assert not any(x.loss_mask.any() for x in (a, b, c))  # nothing of a prompt is trained on


def test_every_turn_written_anew_has_the_text_between_turns_as_its_segments(
    tmp_path: Path, llama_path: Path, tok: Any
) -> None:
    system = {"role": "system", "content": "be nice"}
    u1, u2 = {"role": "user", "content": "why?"}, {"role": "user", "content": "and?"}
    a = {"role": "assistant", "content": "because"}
    rows = [{"id": "c", "messages": [system, u1, a, u2, a]}, {"id": "d", "messages": [u1, a, u2]}]
    c, d = prompts(tmp_path / "p.jsonl", llama_path, rows, turns="all", max_new_tokens=8)
    assert isinstance(c, Sample) and isinstance(d, Sample)
    assert len(c.prompt["segments"]) == 2 and len(d.prompt["segments"]) == 2  # d: one after u2
    first = c.prompt["segments"][0]
    assert c.input_ids[:first].tolist() == rendered(tok, [system, u1])
    # Then, after a written turn and its end: the next user turn and the assistant's header
    # (no newline after a turn end: the template renders with trim_blocks).
    between = tok(
        "<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert c.input_ids[first:].tolist() == between["input_ids"]
    nones = [m for m in c.prompt["prompt"] if m["content"] is None]
    assert len(nones) == 2 and c.prompt["prompt"][0] == system


GENERATION_PROMPT = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
assert GENERATION_PROMPT in CHAT_TEMPLATE
NO_GENERATION_PROMPT = CHAT_TEMPLATE.replace(GENERATION_PROMPT, "")
# ChatML that prints every message's content and nothing else: no tools, no calls.
NO_TOOLS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
    "template",
    [NO_GENERATION_PROMPT, NO_GENERATION_PROMPT + "{{ eos_token }}"],
    ids=["plain", "closed-with-eos"],  # the latter: a header appended to its text would follow eos
)
def test_a_template_without_a_generation_prompt_prompts_with_the_header_it_writes_turns_with(
    tmp_path: Path, llama_path: Path, tok: Any, template: str
) -> None:
    """The tiny model's template without its `add_generation_prompt` branch gives the prompts
    the template with it gives, token for token. Before: they ended at the user turn's end,
    without `<|im_start|>assistant\\n` (turns: last and all)."""
    (tmp_path / "t.jinja").write_text(template)
    u1, a1 = {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}
    u2 = {"role": "user", "content": "and then?"}
    rows = [
        {"id": "one-turn", "messages": [u1]},
        {"id": "ends-with-assistant", "messages": [u1, a1, u2, a1]},
        {"id": "two-turns", "messages": [u1, a1, u2]},
    ]
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for turns in ("last", "all"):
        theirs = prompts(tmp_path / "p.jsonl", llama_path, rows, turns=turns, max_new_tokens=8)
        ours = prompts(
            tmp_path / "p.jsonl", llama_path, rows, str(tmp_path / "t.jinja"), turns=turns,
            max_new_tokens=8,
        )  # fmt: skip
        assert all(isinstance(x, Sample) for x in (*theirs, *ours))
        got = [(x.input_ids.tolist(), x.prompt["segments"]) for x in ours]
        assert got == [(x.input_ids.tolist(), x.prompt["segments"]) for x in theirs], turns
        assert all(ids[-len(header) :] == header for ids, _ in got)


def test_a_generation_prompt_of_the_templates_own_is_the_one_prompts_end_with(
    tmp_path: Path, llama_path: Path, tok: Any
) -> None:
    """Where add_generation_prompt changes the rendering, the template says how a response
    starts (here an opened think block), not the header its written turns have."""
    thinking = CHAT_TEMPLATE.replace(
        GENERATION_PROMPT, "{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
    )
    (tmp_path / "t.jinja").write_text(thinking)
    u1 = {"role": "user", "content": "hello"}
    (got,) = prompts(
        tmp_path / "p.jsonl", llama_path, [{"messages": [u1]}], str(tmp_path / "t.jinja"),
        max_new_tokens=8,
    )  # fmt: skip
    assert isinstance(got, Sample)
    expected = tok.apply_chat_template(
        [u1], chat_template=thinking, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert got.input_ids.tolist() == list(expected)
    assert tok.decode(got.input_ids).endswith("<|im_start|>assistant\n<think>")


def test_prompts_without_room_or_a_turn_to_answer_are_rejected_naming_why(
    tmp_path: Path, llama_path: Path
) -> None:
    rows = [
        {"id": "long", "text": "word " * 100},
        {"id": "system-only", "messages": [{"role": "system", "content": "be nice"}]},
        {"id": "only-assistant", "messages": [{"role": "assistant", "content": "hi"}]},
        {"id": "fits", "text": "word " * 20},
    ]
    got = prompts(tmp_path / "p.jsonl", llama_path, rows, max_new_tokens=64)
    reasons = {x.sample_id: x.reason for x in got if isinstance(x, Reject)}
    assert set(reasons) == {"long", "system-only", "only-assistant"}
    assert "no room to generate" in reasons["long"] and "max_new_tokens 64" in reasons["long"]
    assert "the turn before it is the system's" in reasons["system-only"]
    assert "no turn before the assistant's" in reasons["only-assistant"]


CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"word": "draft"}}}
AGENT = [
    {"role": "user", "content": "what is a draft?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "a model"},
    {"role": "assistant", "content": "a small model."},
]


def test_an_agents_prompt_holds_its_tools_and_the_calls_its_results_answer(
    tmp_path: Path, llama_path: Path, tok: Any
) -> None:
    """`last`: everything before the last turn as the row has it, tools included. `all`: a
    recorded call that a tool result answers stays as recorded (a call written anew would
    not be the one it answers), every other assistant turn is written anew: the text turns,
    and a call that ends the row."""
    rows = [
        {"id": "agent", "messages": AGENT, "tools": TOOLS},
        {"id": "ends-in-a-call", "messages": AGENT[:2], "tools": TOOLS},
    ]
    agent, ends = prompts(tmp_path / "p.jsonl", llama_path, rows, max_length=512, max_new_tokens=8)
    assert isinstance(agent, Sample) and isinstance(ends, Sample)
    # As SGLang's server hands them to the template (its own code): the served prompt.
    served, tools = served_template_inputs(AGENT, TOOLS)
    reference = tok.apply_chat_template(
        served[:3], tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert agent.input_ids.tolist() == list(reference["input_ids"])
    assert agent.prompt["tools"] == tools and agent.prompt["prompt"][:3] == served[:3]
    assert ends.prompt["prompt"] == [served[0], {"role": "assistant", "content": None}]

    written = {"role": "assistant", "content": None}
    two = [*AGENT[:1], {"role": "assistant", "content": "let me see"}, *AGENT]
    rows = [{"id": "two", "messages": two, "tools": TOOLS}, *rows[1:]]
    got, ends = prompts(
        tmp_path / "p.jsonl", llama_path, rows, max_length=512, turns="all", max_new_tokens=8
    )
    assert isinstance(got, Sample) and isinstance(ends, Sample)
    assert got.prompt["prompt"] == [served[0], written, served[0], served[1], served[2], written]
    assert ends.prompt["prompt"] == [served[0], written]
    # The second segment holds the kept call and its result, up to the header written after.
    first, second = np.split(got.input_ids, [got.prompt["segments"][0]])
    reference = tok.apply_chat_template(
        [served[0]], tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert first.tolist() == list(reference["input_ids"])
    call = '<tool_call>\n{"name": "lookup", "arguments": {"word": "draft"}}\n</tool_call>'
    assert tok.decode(second.tolist()) == (
        "<|im_start|>user\nwhat is a draft?<|im_end|>\n<|im_start|>assistant\n"
        f"{call}<|im_end|><|im_start|>tool\na model<|im_end|>\n<|im_start|>assistant\n"
    )


def test_an_agents_row_on_a_template_without_tool_support_is_rejected_naming_why(
    tmp_path: Path, llama_path: Path
) -> None:
    (tmp_path / "plain.jinja").write_text(NO_TOOLS_TEMPLATE)
    rows = [
        {"id": "agent", "messages": AGENT, "tools": TOOLS},
        {"id": "chat", "messages": AGENT[:1]},
    ]
    for turns in ("last", "all"):
        agent, chat = prompts(
            tmp_path / "p.jsonl", llama_path, rows, str(tmp_path / "plain.jinja"), 512,
            turns=turns, max_new_tokens=8,
        )  # fmt: skip
        assert isinstance(agent, Reject) and isinstance(chat, Sample)
        assert agent.reason == UNRENDERED.format(what="the row's tools")


def record(*turns: tuple[list[int], str], segments: list[list[int]] | None = None) -> dict:
    return {
        "sample_id": "s",
        "segments": segments or [[1, 2, 3]] * len(turns),
        "turn_end": [9],
        "turns": [{"output_ids": ids, "finish_reason": why, "text": ""} for ids, why in turns],
    }


def planner(**generate: Any) -> ResponsePlanner:
    config = parse_config(
        {
            "model": {"path": "m"},
            "data": {"paths": ["p"]},
            "store": {"url": "s"},
            "generate": generate,
        }
    )
    return ResponsePlanner(config, mrope=False)


def test_responses_become_samples_with_their_turn_end_and_a_mask_on_what_was_written() -> None:
    keep = planner(on_length="keep")
    stopped = keep.sample(record(([5, 6], "stop")))  # stopped by a stop string: end appended
    assert isinstance(stopped, Sample)
    assert stopped.input_ids.tolist() == [1, 2, 3, 5, 6, 9]
    assert stopped.loss_mask.tolist() == [0, 0, 0, 1, 1, 1]
    ended = keep.sample(record(([5, 9], "stop")))  # the model ended its turn: as returned
    assert ended.input_ids.tolist() == [1, 2, 3, 5, 9]
    cut = keep.sample(record(([5, 6, 7], "length")))  # cut: kept, no turn end
    assert cut.input_ids.tolist() == [1, 2, 3, 5, 6, 7]
    two = keep.sample(record(([5], "stop"), ([7, 9], "stop"), segments=[[1], [2, 3]]))
    assert two.input_ids.tolist() == [1, 5, 9, 2, 3, 7, 9]
    assert two.loss_mask.tolist() == [0, 1, 1, 0, 0, 1, 1]
    early = keep.sample(record(([5, 6], "length"), segments=[[1], [2, 3]]))  # ended at the cut
    assert early.input_ids.tolist() == [1, 5, 6]


def test_cut_empty_and_failed_responses_are_rejected_with_their_reason() -> None:
    reject = planner(on_length="reject", max_new_tokens=3)
    cut = reject.sample(record(([5, 6, 7], "length")))
    assert isinstance(cut, Reject) and "cut at max_new_tokens 3" in cut.reason
    assert isinstance(reject.sample(record(([5], "stop"))), Sample)
    empty = reject.sample(record(([9], "stop")))
    assert isinstance(empty, Reject) and empty.reason == "empty response (turn 0)"
    assert isinstance(reject.sample(record(([], "stop"))), Reject)
    failed = reject.sample({"sample_id": "s", "error": "after 3 attempts: HTTP 500"})
    assert (
        isinstance(failed, Reject)
        and failed.reason == "generation failed: after 3 attempts: HTTP 500"
    )


def test_seeds_and_ids_depend_on_the_job_seed_and_the_sample_alone() -> None:
    assert sample_ids("p", 1) == ["p"] and sample_ids("p", 3) == ["p#0", "p#1", "p#2"]
    assert response_seed(0, "p#0") == response_seed(0, "p#0")
    seeds = {response_seed(s, i) for s in (0, 1) for i in ("p#0", "p#1")}
    assert len(seeds) == 4 and all(0 <= x < 2**31 for x in seeds)


def test_kept_parts_read_back_and_conversations_take_the_written_turns(tmp_path: Path) -> None:
    group = zarr.open_group(tmp_path / "s.zarr", mode="w", zarr_format=3)
    keep = GeneratedParts(group.store)
    assert keep.responses(3) is None and keep.parts() == []
    keep.put_prompts(3, [{"prompt_id": "p"}])
    keep.put_responses(3, {"samples": []})
    keep.put_responses(12, {"samples": []})
    assert keep.prompts(3) == [{"prompt_id": "p"}]
    assert keep.responses(3) == {"part": 3, "samples": []}
    assert keep.parts() == [3, 12]
    assert list(zarr.open_group(tmp_path / "s.zarr", mode="r").members()) == []
    with pytest.raises(FileNotFoundError, match="no prompts stored"):
        keep.prompts(12)
    assert closed_turn([5], "stop", [9]) == [5, 9] and closed_turn([5], "length", [9]) == [5]
    u, a = {"role": "user", "content": "q"}, {"role": "assistant", "content": None}
    assert conversation([u, a, u, a], ["x"]) == {
        "messages": [u, {"role": "assistant", "content": "x"}, u]
    }
    assert conversation("once", [" upon"]) == {"text": "once upon"}


def test_a_store_generated_with_other_settings_is_not_resumed_with_these(
    deepseek_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    write_prompts(tmp_path / "prompts.jsonl", 5)
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", tmp_path / "s.zarr", tmp_path)
    config = parse_config(raw)
    _, _, builder = open_or_create(config, say=lambda _: None)
    plan_into(builder, config, 0, lambda shards: None)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    argv = ["run", "--config", str(tmp_path / "job.yaml"), "--set", "generate.n=2"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "refusing to resume" in err and "generate: store None != config" in err


def test_generate_settings_are_checked_field_by_field() -> None:
    raw = {"model": {"path": "m"}, "data": {"paths": ["p"]}, "store": {"url": "s"}}
    assert parse_config(raw).generate is None  # absent: the rows are captured as written
    config = parse_config({**raw, "generate": {"n": 2, "stop": ["\n\n"], "temperature": 0.7}})
    assert config.generate is not None
    assert config.generate.sampling_params() == {
        "max_new_tokens": 512,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "stop": ["\n\n"],
    }
    for bad, field in (({"n": 0}, "generate.n"), ({"on_length": "cut"}, "generate.on_length")):
        with pytest.raises(ConfigError, match=field):
            parse_config({**raw, "generate": bad})


def test_a_kept_part_answering_other_samples_stops_the_resume() -> None:
    """A resume whose plan changed (another release accepting other rows): part 1's kept
    responses answer other prompts than this plan puts there."""
    prompts = [{"samples": [{"sample_id": "a"}, {"sample_id": "b"}]}]
    part = _Part(1, prompts, kept=True)
    _check_answers(part, {"samples": [{"sample_id": "a"}, {"sample_id": "b"}]})  # the same
    with pytest.raises(
        PlanError,
        match=r"part 1 kept responses for other samples .*at its "
        r"sample 1: kept \['c'\], planned \['b'\]\).*write to a new store",
    ):
        _check_answers(part, {"samples": [{"sample_id": "a"}, {"sample_id": "c"}]})
    with pytest.raises(PlanError, match=r"at its sample 1: kept \[\], planned \['b'\]"):
        _check_answers(part, {"samples": [{"sample_id": "a"}]})
