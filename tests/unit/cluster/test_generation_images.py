"""`generate:` on rows with images, the planner's side, on the tiny Qwen2.5-VL: a prompt keeps one
image token per image (as requests carry it) and its images' runs and grids; a sample made of
it and its written turns is, token for token and position for position, what HF's processor
and model give the same conversation with the same images. The worker's side (the images sent
with each turn) is tests/integration/test_image_job.py's generate job."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from actors.config import GenerateConfig
from cluster.config import DataConfig, parse_config
from cluster.generation_feed import ResponsePlanner
from cluster.images import expand_images
from cluster.plan import PlanStream, Reject, Sample
from tests.helpers.prompts import write_jsonl
from tests.helpers.vl_reference import reference

IMAGE_TOKEN = 12  # <|image_pad|>
IM_END = "<|im_end|>"


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


SMALL, WIDE = png(56, 56, 1), png(112, 84, 2)  # 4 and 12 image tokens


def image(name: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": name}}


def user(*parts: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"role": "user", "content": content}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


ONE_TURN = [user("What is it?", image("small.png")), assistant("noise")]
TWO_TURNS = [
    user(image("small.png"), "first?"),
    assistant("a square"),
    user("and this one", image("wide.png")),
    assistant("wider"),
]


def hf_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """As transformers' processor takes them: `{"type": "image"}` per image part."""
    return [
        {
            **m,
            "content": [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]
            if isinstance(m["content"], list)
            else m["content"],
        }
        for m in messages
    ]


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gen-images")
    (root / "small.png").write_bytes(SMALL)
    (root / "wide.png").write_bytes(WIDE)
    return write_jsonl(
        root / "rows.jsonl",
        [
            {"id": "one", "messages": ONE_TURN},
            {"id": "two", "messages": TWO_TURNS},
            {"id": "gone", "messages": [user(image("missing.png"), "?"), assistant("x")]},
            {"id": "text", "messages": [user("hi"), assistant("hello")]},
        ],
    )


def plan(path: Path, qwen25_vl_path: Path, **settings: Any) -> dict[str, Sample | Reject]:
    turns = settings.pop("turns", "all")
    stream = PlanStream(
        DataConfig(paths=[str(path)], **settings),
        qwen25_vl_path,
        generate=GenerateConfig(max_new_tokens=4, turns=turns),
    )
    return {item.sample_id: item for item in stream if isinstance(item, Sample | Reject)}


def planner(vision: Any) -> ResponsePlanner:
    raw = {"model": {"path": "m"}, "data": {"paths": ["p"]}, "store": {"url": "s"}}
    return ResponsePlanner(parse_config({**raw, "generate": {}}), True, vision)


def written(sample: Sample, answers: list[str], tokenizer: Any) -> dict[str, Any]:
    """The generation record of `sample`'s prompt with `answers` written, each closed by the
    turn end (as the server returns a response it stopped at its stop token)."""
    assert sample.prompt is not None
    cuts = np.cumsum(sample.prompt["segments"])[:-1]
    end = tokenizer.convert_tokens_to_ids(IM_END)
    return {
        "sample_id": sample.sample_id,
        "segments": [seg.tolist() for seg in np.split(sample.input_ids, cuts)],
        "turn_end": [end],
        "images": sample.prompt["images"],
        "turns": [
            {"output_ids": [*tokenizer(a)["input_ids"], end], "finish_reason": "stop", "text": a}
            for a in answers
        ],
    }


def test_a_prompts_images_are_planned_collapsed_with_their_runs_and_grids(
    rows: Path, qwen25_vl_path: Path
) -> None:
    planned = plan(rows, qwen25_vl_path, turns="last")
    one = planned["one"]
    assert isinstance(one, Sample) and one.prompt is not None
    # One image token in the prompt's tokens, as the request carries it.
    assert one.input_ids.tolist().count(IMAGE_TOKEN) == 1
    assert one.prompt["images"] == [
        {"digest": hashlib.sha256(SMALL).hexdigest(), "length": 4, "grid_thw": [1, 4, 4]}
    ]
    # Expanded, the prompt is the processor's rendering of the conversation before the turn.
    spans = [(im["digest"], im["length"], im["grid_thw"]) for im in one.prompt["images"]]
    mask = np.zeros(len(one.input_ids), np.uint8)
    expanded = expand_images(one.input_ids, mask, spans, IMAGE_TOKEN)
    ref = reference(qwen25_vl_path, hf_messages(ONE_TURN), [SMALL])
    prompt_len = len(expanded.input_ids)
    assert expanded.input_ids.tolist() == ref.input_ids[:prompt_len]
    assert expanded.images[0].start == ref.input_ids.index(IMAGE_TOKEN)
    # An image that cannot be read: the row's reject, naming its part; a text row: no images.
    gone = planned["gone"]
    assert isinstance(gone, Reject)
    assert gone.reason.startswith("messages[0].content[0]: cannot read image file missing.png")
    text = planned["text"]
    assert isinstance(text, Sample) and text.prompt is not None and "images" not in text.prompt


def test_no_room_counts_the_expanded_prompt(rows: Path, qwen25_vl_path: Path) -> None:
    fits = plan(rows, qwen25_vl_path, turns="last")["one"]
    assert isinstance(fits, Sample) and fits.prompt is not None
    collapsed = len(fits.input_ids)
    expanded = collapsed + 3  # its image: 4 rows for its one token
    room = 4 + 1  # max_new_tokens + the turn end
    # Room for the collapsed prompt, not for the expanded one.
    cut = plan(rows, qwen25_vl_path, turns="last", max_length=expanded + room - 1)["one"]
    assert cut == Reject(
        "one",
        f"no room to generate: {expanded} prompt tokens + 1 x (max_new_tokens 4 + 1 "
        f"end-of-turn) > max_length {expanded + room - 1}",
    )
    assert isinstance(
        plan(rows, qwen25_vl_path, turns="last", max_length=expanded + room)["one"], Sample
    )


def test_a_sample_of_written_turns_is_hfs_conversation_with_its_images(
    rows: Path, qwen25_vl_path: Path
) -> None:
    """Two turns written anew, an image in each user turn: the sample is HF's processor's
    tokens of the whole conversation (the answers as written), its positions HF's model's,
    the images' spans and grids where the processor puts them, loss on the answers only."""
    stream = PlanStream(
        DataConfig(paths=[str(rows)]),
        qwen25_vl_path,
        generate=GenerateConfig(max_new_tokens=4, turns="all"),
    )
    two = next(i for i in stream if isinstance(i, Sample) and i.sample_id == "two")
    assert two.prompt is not None and len(two.prompt["segments"]) == 2
    tokenizer = stream.encoder.tok
    record = written(two, ["a square", "wider"], tokenizer)
    sample = planner(stream.encoder.vision).sample(record)
    assert isinstance(sample, Sample)
    ref = reference(qwen25_vl_path, hf_messages(TWO_TURNS), [SMALL, WIDE])
    n = len(sample.input_ids)
    # HF's rendering ends with the last turn's newline after <|im_end|>; the sample at it.
    assert sample.input_ids.tolist() == ref.input_ids[:n] and len(ref.input_ids) == n + 1
    assert sample.position_ids is not None
    assert np.array_equal(sample.position_ids, ref.position_ids.numpy()[:n])
    runs = [(im.start, im.length, list(im.grid_thw)) for im in sample.images]
    starts = [
        k
        for k in range(n)
        if sample.input_ids[k] == IMAGE_TOKEN and (k == 0 or sample.input_ids[k - 1] != IMAGE_TOKEN)
    ]
    assert [start for start, _, _ in runs] == starts
    assert [grid for _, _, grid in runs] == ref.image_grid_thw
    assert [im.digest for im in sample.images] == [
        hashlib.sha256(SMALL).hexdigest(),
        hashlib.sha256(WIDE).hexdigest(),
    ]
    # Loss on the written answers and their turn ends, nothing else.
    answers = [tokenizer(a)["input_ids"] for a in ("a square", "wider")]
    assert int(sample.loss_mask.sum()) == sum(len(a) + 1 for a in answers)
    assert not sample.loss_mask[sample.input_ids == IMAGE_TOKEN].any()
    # A first turn cut at max_new_tokens ends the conversation: the first image only.
    cut = {**record, "turns": [{**record["turns"][0], "finish_reason": "length"}]}
    early = planner(stream.encoder.vision).sample(cut)
    assert isinstance(early, Sample) and len(early.images) == 1
    m = len(early.input_ids)
    assert early.images == sample.images[:1] and early.input_ids.tolist() == ref.input_ids[:m]
    # The check can fail: a wrong grid moves every position after the second image.
    wrong = {
        **record,
        "images": [record["images"][0], {**record["images"][1], "grid_thw": [1, 4, 12]}],
    }
    moved = planner(stream.encoder.vision).sample(wrong)
    assert isinstance(moved, Sample) and moved.position_ids is not None
    assert not np.array_equal(moved.position_ids, ref.position_ids.numpy()[:n])


def test_a_prompt_names_its_images_by_digest_and_rows_are_judged_as_prompted(
    rows: Path, qwen25_vl_path: Path, llama_path: Path, tmp_path: Path
) -> None:
    """The prompt record's image parts name the store's image, never a data URL's bytes
    again; an image (or the image token) only in a turn written anew is gone with it."""
    planned = plan(rows, qwen25_vl_path, turns="last")
    one = planned["one"]
    assert isinstance(one, Sample) and one.prompt is not None
    (part,) = [p for p in one.prompt["prompt"][0]["content"] if p["type"] == "image"]
    assert part == {"type": "image", "digest": hashlib.sha256(SMALL).hexdigest()}
    in_answer = [user("hi"), {"role": "assistant", "content": [image("small.png")]}]
    token_in_answer = [user("hi"), assistant("<|image_pad|>")]
    path = write_jsonl(
        tmp_path / "rows.jsonl",
        [{"id": "img", "messages": in_answer}, {"id": "tok", "messages": token_in_answer}],
    )
    for model in (qwen25_vl_path, llama_path):  # a text model: no image left to refuse
        for turns in ("last", "all"):
            got = plan(path, model, turns=turns, content_format="string")
            assert all(isinstance(s, Sample) for s in got.values()), (model, turns, got)
    # Kept where the prompt keeps it: refused, naming it.
    kept = plan(path, qwen25_vl_path, turns="last", content_format="string")
    assert isinstance(kept["img"], Sample) and "images" not in (kept["img"].prompt or {})
    asked = write_jsonl(
        tmp_path / "asked.jsonl",
        [{"id": "img", "messages": [user(image("small.png")), assistant("x")]}],
    )
    refused = plan(asked, qwen25_vl_path, turns="last", content_format="string")["img"]
    assert isinstance(refused, Reject) and refused.reason.startswith(
        "messages[0].content[0] is an image, but the chat template takes text content"
    )
