"""Image rows through the planner on the tiny Qwen2.5-VL, held to HF's own processor and model.

Every source kind reads the same bytes (digest = their sha256); the expanded tokens equal
`processor(text, images)["input_ids"]` and the M-RoPE positions equal those HF's forward gives
its language model (tests/helpers/vl_reference.py), both markerless and {% generation %}
masks; every reject reason, each from a wrong input. Object storage here is obstore's
in-memory store (the path through a real S3 server is the integration tests').
"""

from __future__ import annotations

import base64
import copy
import functools
import hashlib
import http.server
import io
import os
import pickle
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import obstore
import obstore.store
import pytest
import transformers
import zarr
from PIL import Image
from pydantic import ValidationError

from actors.config import GenerateConfig
from cluster import images as images_mod
from cluster import plan as plan_mod
from cluster.config import DataConfig, parse_config
from cluster.generation_feed import ResponsePlanner
from cluster.images import MROPE, NO_IMAGE_TOKEN, ExpandedRow, Vision, vision_settings
from cluster.job_store import open_or_create, plan_into
from cluster.plan import PlanStream, Reject, Sample, build_plan, plan_part
from cluster.plan_encode import STRAY_IMAGE_TOKEN, Encoder, parse_row
from cluster.plan_sources import PlanError, resolve_source, split_parts
from hsx_store.images import ImageBlobs, SampleImage
from hsx_store.integrity import verify_store
from tests.helpers.jobs import job_config
from tests.helpers.prompts import write_jsonl
from tests.helpers.vl_reference import reference

IMAGE_TOKEN = "<|image_pad|>"
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# A ChatML template that loops over parts, with {% generation %} markers (no system default).
MARKED_TEMPLATE = (
    "{% macro parts(content) %}{% if content is string %}{{ content }}{% else %}"
    "{% for p in content %}{% if p['type'] == 'image' %}IMAGE{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ parts(message['content']) }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ parts(message['content']) }}<|im_end|>{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


RED, WIDE = png(56, 56, 1), png(112, 84, 2)  # 4 and 12 image tokens


@pytest.fixture(scope="module")
def pics(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pics")
    (root / "red.png").write_bytes(RED)
    (root / "sub").mkdir()
    (root / "sub" / "wide.png").write_bytes(WIDE)
    (root / "notes.txt").write_text("not an image")
    (root / "cut.png").write_bytes(RED[:120])  # a PNG header, then nothing to decode
    return root


@pytest.fixture(scope="module")
def http_root(pics: Path) -> Iterator[str]:
    """`pics` served over loopback HTTP."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(pics))
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


@pytest.fixture(scope="module")
def bucket() -> Iterator[Any]:
    """obstore's in-memory store holding red.png at pics/red.png, as `s3://bucket` opens."""
    store = obstore.store.MemoryStore()
    obstore.put(store, "pics/red.png", RED)
    real = images_mod._object_store

    def opened(url: str, *args: Any) -> Any:
        return store if url == "s3://bucket" else real(url, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(images_mod, "_object_store", opened)
        yield store


DATA = DataConfig(paths=["unused.jsonl"])


@pytest.fixture(scope="module")
def encoder(qwen25_vl_path: Path) -> Encoder:
    return Encoder.load(DATA, qwen25_vl_path, False)


def encode(encoder: Encoder, base: Path, *rows: dict[str, Any], data: DataConfig = DATA) -> list:
    return encoder.encode([parse_row(r, None, data) for r in rows], encoder.image_sources(base))


def image_row(*parts: Any, answer: str = "it is red") -> dict[str, Any]:
    """A user turn of `parts` (a string: a text part; else an image part as given)."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": answer},
        ]
    }


def url_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def hf_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row as transformers' processor takes it: `{"type": "image"}` per image part."""
    return [
        {
            **m,
            "content": [{"type": "image"} if p["type"] != "text" else p for p in m["content"]]
            if isinstance(m["content"], list)
            else m["content"],
        }
        for m in row["messages"]
    ]


def image_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t == token:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- settings ----------------------------------------------------------------------------------


def test_vision_settings_from_the_models_config(
    qwen25_vl_path: Path, llama_path: Path, tmp_path: Path
) -> None:
    vl_token = transformers.AutoTokenizer.from_pretrained(qwen25_vl_path).convert_tokens_to_ids(
        IMAGE_TOKEN
    )
    assert vision_settings(qwen25_vl_path) == (vl_token, MROPE)
    assert vision_settings(llama_path) == (None, None)
    # Qwen2-VL's older form (rope_scaling), LLaVA's key; a text config loads no tokenizer
    # (there is none in tmp_path to load).
    (tmp_path / "config.json").write_text(
        '{"image_token_index": 5, "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}}'
    )
    assert vision_settings(tmp_path) == (5, MROPE)
    (tmp_path / "config.json").write_text('{"vocab_size": 8, "rope_scaling": {"type": "linear"}}')
    assert vision_settings(tmp_path) == (None, None)


def test_image_data_settings_are_checked() -> None:
    with pytest.raises(ValidationError, match="image_storage_options"):
        DataConfig(paths=["x"], image_storage_options={"client_options": {"timeout": "soon"}})
    with pytest.raises(ValidationError, match="image_fetch_timeout_s"):
        DataConfig(paths=["x"], image_fetch_timeout_s=0)
    assert DataConfig(paths=["x"]).image_fetch_timeout_s == 30.0


# -- sources -----------------------------------------------------------------------------------


SOURCES = {
    "data URL": lambda pics, http: data_url(RED),
    "relative path": lambda pics, http: "red.png",
    "absolute path": lambda pics, http: str(pics / "red.png"),
    "file URL": lambda pics, http: (pics / "red.png").as_uri(),
    "http": lambda pics, http: f"{http}/red.png",
    "object storage": lambda pics, http: "s3://bucket/pics/red.png",
}


@pytest.mark.parametrize("kind", list(SOURCES))
@pytest.mark.parametrize("shape", ["image_url", "image_url string", "image", "input_image"])
def test_every_source_kind_and_part_shape_reads_the_same_image(
    encoder: Encoder,
    pics: Path,
    http_root: str,
    bucket: Any,
    qwen25_vl_path: Path,
    kind: str,
    shape: str,
) -> None:
    source = SOURCES[kind](pics, http_root)
    part = {
        "image_url": url_part(source),
        "image_url string": {"type": "image_url", "image_url": source},
        "image": {"type": "image", "path" if kind.endswith("path") else "url": source},
        "input_image": {"type": "input_image", "image_url": source},
    }[shape]
    row = image_row("what is it?", part)
    (result,) = encode(encoder, pics, row)
    assert isinstance(result, ExpandedRow), result
    ref = reference(qwen25_vl_path, hf_messages(row), [RED])
    assert result.input_ids.tolist() == ref.input_ids
    assert result.images == (SampleImage(sha(RED), *image_runs(ref.input_ids, 12)[0], (1, 4, 4)),)


def test_the_planning_task_puts_each_distinct_image_once_and_ships_only_rows(
    qwen25_vl_path: Path, pics: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_jsonl(
        tmp_path / "rows.jsonl",
        [
            {"id": "a", **image_row(url_part(str(pics / "red.png")), "one")},
            {"id": "b", **image_row(url_part(data_url(RED)), "two")},  # same bytes, other source
            {"id": "c", **image_row(url_part(str(pics / "sub" / "wide.png")), "three")},
            {"id": "d", "messages": [{"role": "user", "content": "no image"}]},
        ],
    )
    data = DataConfig(paths=[str(path)], loss_mask="all", image_roots=[str(pics)])
    (part,) = split_parts([resolve_source(str(path), "auto")], data)
    puts: list[str] = []
    original = ImageBlobs.put
    monkeypatch.setattr(
        ImageBlobs, "put", lambda self, d, b: (puts.append(d), original(self, d, b))
    )
    store = tmp_path / "s.zarr"
    args = (part, data.model_dump_json(), str(qwen25_vl_path), False, None)
    with pytest.raises(PlanError, match=r"s\.zarr: no store there as .* sees it"):
        plan_part(*args, (str(store), {}))  # a store this node cannot see: never made here
    assert not store.exists()
    zarr.create_group(store=str(store))  # the job's store, as the driver made it
    result = plan_part(*args, (str(store), {}))
    assert [reason for _, _, reason in result.rows] == [None] * 4
    assert sorted(puts) == sorted([sha(RED), sha(WIDE)])  # in the store before it returned
    assert sorted(os.listdir(store / "images")) == sorted(puts)
    assert ImageBlobs(str(store)).get(sha(RED)) == RED and ImageBlobs(store).get(sha(WIDE)) == WIDE
    assert sorted(result.images) == [0, 1, 2] and sorted(result.positions) == [0, 1, 2]
    shipped = pickle.dumps(result)  # what Ray carries to the driver: rows, not images
    assert RED not in shipped and WIDE not in shipped

    # Streamed: every image is in the store when the Sample naming it arrives.
    other = tmp_path / "t.zarr"
    zarr.create_group(store=str(other))
    samples = []
    for item in PlanStream(data, qwen25_vl_path, images_to=(str(other), {})):
        if isinstance(item, Sample):
            assert all((other / "images" / im.digest).exists() for im in item.images)
            samples.append(item)
    assert [s.images[0].digest if s.images else None for s in samples] == [
        sha(RED),
        sha(RED),
        sha(WIDE),
        None,
    ]
    assert samples[3].position_ids.tolist() == [[i] * 3 for i in range(len(samples[3].input_ids))]
    # Without a store (a dry run, build_plan): nothing written anywhere.
    puts.clear()
    assert len(build_plan(data, qwen25_vl_path).images) == 4 and puts == []


def test_image_sources_keep_a_bounded_number_of_reads(
    pics: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in range(images_mod.CACHED_SOURCES + 8):
        shutil.copy(pics / "red.png", tmp_path / f"{k}.png")
    sources = images_mod.ImageSources(tmp_path)
    fetched: list[str] = []
    fetch = sources._fetch
    monkeypatch.setattr(
        sources, "_fetch", lambda source: (fetched.append(source), fetch(source))[1]
    )
    for k in range(images_mod.CACHED_SOURCES + 8):
        assert isinstance(sources.read(f"{k}.png"), images_mod.ReadImage)
    assert len(sources._read) == images_mod.CACHED_SOURCES  # not the whole part's
    last = f"{images_mod.CACHED_SOURCES + 7}.png"
    sources.read(last)  # recent: not read again
    sources.read("0.png")  # dropped long ago: read again
    assert fetched[-1] == "0.png" and fetched.count(last) == 1 and fetched.count("0.png") == 2
    # keep without a store writes nothing; with one, each digest once.
    image = sources.read("1.png")
    sources.keep([image])
    assert not list(tmp_path.glob("**/images"))
    kept = images_mod.ImageSources(tmp_path, keep_in=ImageBlobs(str(tmp_path / "s.zarr")))
    kept.keep([image, image])
    assert os.listdir(tmp_path / "s.zarr" / "images") == [image.digest]


def test_relative_image_paths_are_the_folder_of_the_input_as_named_not_its_link_target(
    qwen25_vl_path: Path, pics: Path, tmp_path: Path
) -> None:
    """A hub snapshot: snapshots/<rev>/rows.jsonl links to blobs/<hash>, its images beside the
    link only."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    write_jsonl(blobs / "0123abcd", [{"id": "a", **image_row(url_part("red.png"))}])
    (snapshot / "rows.jsonl").symlink_to(blobs / "0123abcd")
    shutil.copy(pics / "red.png", snapshot / "red.png")
    data = DataConfig(paths=[str(snapshot / "rows.jsonl")], format="jsonl")  # (see below)
    (item, _) = list(PlanStream(data, qwen25_vl_path))
    assert isinstance(item, Sample), item
    assert item.images[0].digest == sha(RED)
    # plan_part on its own (its default folder) reads the same; beside the target is nothing.
    (part,) = split_parts([resolve_source(str(snapshot / "rows.jsonl"), "jsonl")], data)
    assert part.path.parent == blobs  # the source is resolved: the folder must not be its
    result = plan_part(part, data.model_dump_json(), str(qwen25_vl_path), False)
    assert [reason for _, _, reason in result.rows] == [None]
    wrong = plan_part(
        part, data.model_dump_json(), str(qwen25_vl_path), False, image_dir=str(blobs)
    )
    assert "cannot read image file red.png" in str(wrong.rows[0][2])


# -- the processor's expansion and HF's positions ------------------------------------------------


CASES = {
    "one image": image_row("what is it?", url_part("red.png")),
    "two images": image_row(url_part("red.png"), "and", url_part("sub/wide.png")),
    "the same twice": image_row(url_part("sub/wide.png"), url_part("sub/wide.png"), "twice?"),
    "text only": image_row("nothing to see"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_expansion_and_positions_are_hfs(
    encoder: Encoder, pics: Path, qwen25_vl_path: Path, case: str
) -> None:
    row = CASES[case]
    (result,) = encode(encoder, pics, row)
    files = [
        pics / p["image_url"]["url"] for p in row["messages"][0]["content"] if "image_url" in p
    ]
    if not files:  # a text row of an M-RoPE model: its positions come with the Sample
        ids, _ = result
        processor = transformers.AutoProcessor.from_pretrained(qwen25_vl_path)
        text = processor.apply_chat_template(hf_messages(row), tokenize=False)
        assert ids.tolist() == processor(text=[text])["input_ids"][0]
        positions = images_mod.text_positions(len(ids))
        assert positions.tolist() == hf_text_positions(qwen25_vl_path, ids).tolist()
        return
    ref = reference(qwen25_vl_path, hf_messages(row), [f.read_bytes() for f in files])
    assert result.input_ids.tolist() == ref.input_ids
    assert result.position_ids.dtype == np.int32
    assert result.position_ids.tolist() == ref.position_ids.tolist()
    assert [(im.start, im.length) for im in result.images] == image_runs(ref.input_ids, 12)
    assert [list(im.grid_thw) for im in result.images] == ref.image_grid_thw
    assert [im.digest for im in result.images] == [sha(f.read_bytes()) for f in files]
    # The positions are not three aranges: a check that passed them would prove nothing.
    assert result.position_ids.tolist() != images_mod.text_positions(len(ref.input_ids)).tolist()


def hf_text_positions(path: Path, ids: np.ndarray) -> Any:
    """The positions HF's language model gives its rotary embedding for a text-only prompt
    (it gets none from the model: `get_rope_index` is for prompts with images), [P, 3]."""
    import torch

    model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    seen: dict[str, Any] = {}
    model.model.language_model.rotary_emb.register_forward_pre_hook(
        lambda module, args: seen.update(positions=args[1])
    )
    with torch.no_grad():
        model(input_ids=torch.as_tensor(ids[None], dtype=torch.long), use_cache=False)
    return seen["positions"][:, 0].T


def twin(row: dict[str, Any], placeholder: str = PLACEHOLDER) -> dict[str, Any]:
    """The row with each image part written as the text its template renders for it."""
    return {
        "messages": [
            {
                **m,
                "content": [
                    {"type": "text", "text": placeholder} if p["type"] != "text" else p
                    for p in m["content"]
                ]
                if isinstance(m["content"], list)
                else m["content"],
            }
            for m in row["messages"]
        ]
    }


def encode_twin(encoder: Encoder, twin_row: dict[str, Any], data: DataConfig = DATA) -> Any:
    """A twin's (ids, mask), encoded as if the model took no images: its text holds the image
    token, which a vision model's planner refuses (test_the_image_token_as_text_is_refused)."""
    text_only = copy.copy(encoder)
    text_only.vision = None
    (result,) = encode(text_only, Path("."), twin_row, data=data)
    assert not isinstance(result, str), result
    return result


def assert_mask_is_the_twins(result: ExpandedRow, twin_result: Any, token: int) -> None:
    """0 on every image token; elsewhere the text twin's mask, token for token."""
    ids, mask = result.input_ids, result.loss_mask
    twin_ids, twin_mask = twin_result
    assert not mask[ids == token].any()
    assert ids[ids != token].tolist() == twin_ids[twin_ids != token].tolist()
    assert mask[ids != token].tolist() == twin_mask[twin_ids != token].tolist()
    assert mask.any()


def test_loss_mask_zero_on_image_tokens_also_in_an_assistant_turn(
    encoder: Encoder, pics: Path
) -> None:
    row = image_row(url_part("red.png"), "what is it?")
    row["messages"][1]["content"] = [{"type": "text", "text": "this:"}, url_part("sub/wide.png")]
    (result,), twin_result = encode(encoder, pics, row), encode_twin(encoder, twin(row))
    assert_mask_is_the_twins(result, twin_result, 12)
    start, length = result.images[1].start, result.images[1].length
    assert result.loss_mask[start - 1] == 1 and result.loss_mask[start + length] == 1  # its turn's
    # A mask that kept the twin's 1 on the assistant's image token fails the check.
    wrong = ExpandedRow(result.input_ids, result.loss_mask.copy(), None, ())
    wrong.loss_mask[start] = 1
    with pytest.raises(AssertionError):
        assert_mask_is_the_twins(wrong, twin_result, 12)


@pytest.mark.parametrize("placeholder", [PLACEHOLDER, IMAGE_TOKEN])  # wrapped, or adjacent runs
def test_generation_markers_and_adjacent_images(
    qwen25_vl_path: Path, pics: Path, tmp_path: Path, placeholder: str
) -> None:
    template = tmp_path / "marked.jinja"
    template.write_text(MARKED_TEMPLATE.replace("IMAGE", placeholder))
    data = DataConfig(paths=["x"], chat_template=str(template))
    encoder = Encoder.load(data, qwen25_vl_path, False)
    assert encoder.use_markers
    row = image_row("look:", url_part("sub/wide.png"), url_part("red.png"))
    if placeholder == IMAGE_TOKEN:
        # HF's get_rope_index takes adjacent images for one (a shape error): refused there...
        (result,) = encode(encoder, pics, row, data=data)
        assert result.startswith("the model's get_rope_index failed: RuntimeError: shape")
        # ... and expanded where no positions are needed.
        encoder.vision = Vision(qwen25_vl_path, False, 12, None)
    (result,) = encode(encoder, pics, row, data=data)
    twin_result = encode_twin(encoder, twin(row, placeholder), data)
    processor = transformers.AutoProcessor.from_pretrained(qwen25_vl_path)
    text = encoder.tok.apply_chat_template(
        hf_messages(row), chat_template=template.read_text(), tokenize=False
    )
    pictures = [Image.open(io.BytesIO(b)) for b in (WIDE, RED)]
    expected = processor(text=[text], images=pictures)["input_ids"][0]
    assert result.input_ids.tolist() == expected
    # Adjacent images share one run of the processor's: split 12 + 4 by their grids.
    assert [(im.length, im.grid_thw) for im in result.images] == [(12, (1, 6, 8)), (4, (1, 4, 4))]
    assert result.images[1].start == result.images[0].start + 12 + (placeholder == PLACEHOLDER) * 2
    assert_mask_is_the_twins(result, twin_result, 12)


# -- text rows ---------------------------------------------------------------------------------


def test_text_jobs_load_no_processor_and_plan_as_before(
    llama_path: Path, qwen25_vl_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a processor was loaded")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", refused)
    rows = [
        {"id": "t", "text": "the answer is 42."},
        {
            "id": "c",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        },
    ]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    data = DataConfig(paths=[str(path)])
    monkeypatch.setattr(plan_mod, "_image_blobs", refused)  # no store is ever opened
    stream = PlanStream(data, llama_path, images_to=(str(tmp_path / "s.zarr"), {}))
    samples = [s for s in stream if isinstance(s, Sample)]
    assert stream.encoder.vision is None and stream.encoder.position_ids is None
    assert [(s.position_ids, s.images) for s in samples] == [(None, ())] * 2
    assert not (tmp_path / "s.zarr").exists()
    tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    assert samples[0].input_ids.tolist() == tok("the answer is 42.")["input_ids"]
    chat = tok.apply_chat_template(rows[1]["messages"], tokenize=True, return_dict=True)
    assert samples[1].input_ids.tolist() == chat["input_ids"]
    # The VL model's text rows: no processor either, and three aranges as positions.
    vl = build_plan(data, qwen25_vl_path)
    assert [p.tolist() for p in vl.position_ids] == [
        [[i] * 3 for i in range(len(ids))] for ids in vl.input_ids
    ]


# -- reject reasons ----------------------------------------------------------------------------


def rejects(http: str) -> list[tuple[Any, str]]:
    return [
        (
            url_part("data:image/png;base64,@@@@"),
            "a data URL's base64 is not valid: Only base64 data is allowed",
        ),
        (
            url_part("data:image/png,abc"),
            "a data URL must be base64: data:image/<type>;base64,<data>",
        ),
        (
            url_part("gone.png"),
            "cannot read image file gone.png (at {pics}/gone.png): No such file or directory",
        ),
        (
            url_part("notes.txt"),
            "notes.txt is not an image (PIL cannot identify its format: UnidentifiedImageError)",
        ),
        (url_part("cut.png"), "cannot decode the image: "),
        (url_part(f"{http}/gone.png"), f"cannot fetch image {http}/gone.png: HTTP 404"),
        (url_part("s3://bucket/pics/gone.png"), "cannot fetch image s3://bucket/pics/gone.png: "),
    ]


def test_every_unreadable_image_names_its_part(
    encoder: Encoder, pics: Path, http_root: str, bucket: Any
) -> None:
    cases = rejects(http_root)
    rows = [image_row("first", url_part("red.png"), "then", part) for part, _ in cases]
    results = encode(encoder, pics, *rows)
    for result, (_, reason) in zip(results, cases, strict=True):
        assert isinstance(result, str) and result.startswith("messages[0].content[3]: ")
        assert result.removeprefix("messages[0].content[3]: ").startswith(
            reason.format(pics=pics)
        ), result


def test_a_refused_fetch_is_the_rows_and_hides_secrets(encoder: Encoder, pics: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = "s3cr3t-key-value"
    data = DataConfig(
        paths=["x"],
        image_fetch_timeout_s=2,
        image_storage_options={
            "endpoint": f"http://127.0.0.1:{port}",
            "region": "us-east-1",
            "aws_access_key_id": "AKIDEXAMPLE",
            "aws_secret_access_key": secret,
            "retry_config": {"max_retries": 0},
        },
    )
    sources = images_mod.ImageSources(
        pics, data.image_storage_options, images_mod.ImageLimits(deadline_s=2.0)
    )
    for url in (f"http://127.0.0.1:{port}/red.png", "s3://other-bucket/red.png"):
        reason = sources.read(url)
        assert isinstance(reason, str) and reason.startswith(f"cannot fetch image {url}: "), reason
        assert secret not in reason


def test_model_and_template_rejects(
    qwen25_vl_path: Path, llama_path: Path, pics: Path, tmp_path: Path
) -> None:
    row = image_row("what?", url_part("red.png"))
    tool_row = {
        "messages": [
            {"role": "user", "content": "look it up"},
            {"role": "assistant", "content": "ok"},
            {"role": "tool", "content": [url_part("red.png")]},
            {"role": "assistant", "content": "red"},
        ]
    }
    silent = tmp_path / "silent.jinja"  # loops over parts, renders only the text ones
    silent.write_text(MARKED_TEMPLATE.replace("IMAGE", ""))
    bare = tmp_path / "bare"  # the VL model without its processor
    shutil.copytree(qwen25_vl_path, bare)
    for name in (
        "processor_config.json",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
    ):
        (bare / name).unlink(missing_ok=True)
    cases = [
        (llama_path, {}, row, NO_IMAGE_TOKEN),
        (
            qwen25_vl_path,
            {"content_format": "string"},
            row,
            "messages[0].content[1] is an image, but the chat template takes text content and "
            "renders no images (data.content_format)",
        ),
        (
            qwen25_vl_path,
            {},
            tool_row,
            "messages[2].content[0] is an image in a tool turn, whose content the template gets "
            "as text",
        ),
        (
            qwen25_vl_path,
            {"chat_template": str(silent)},
            row,
            "the chat template renders 0 image placeholders for 1 image parts",
        ),
        (qwen25_vl_path, {"max_length": 45}, row, "46 tokens > max_length 45"),  # 43 collapsed
        (bare, {}, row, "the model has no image processor ("),
    ]
    for model, settings, case_row, reason in cases:
        data = DataConfig(paths=["x"], **settings)
        (result,) = encode(Encoder.load(data, model, False), pics, case_row, data=data)
        assert isinstance(result, str) and result.startswith(reason), (settings, result)
    # The same rows where nothing is wrong: accepted.
    for settings in ({"max_length": 46}, {}):
        data = DataConfig(paths=["x"], **settings)
        (result,) = encode(Encoder.load(data, qwen25_vl_path, False), pics, row, data=data)
        assert isinstance(result, ExpandedRow)


def test_a_processor_that_tokenizes_otherwise_is_refused(
    encoder: Encoder, pics: Path, qwen25_vl_path: Path
) -> None:
    row = image_row("what is it?", url_part("red.png"))
    (good,) = encode(encoder, pics, row)
    vision = encoder.vision
    assert isinstance(vision, Vision)
    text = encoder.tok.apply_chat_template(hf_messages(row), tokenize=False)
    start = good.images[0].start
    collapsed = np.concatenate([good.input_ids[: start + 1], good.input_ids[start + 4 :]])
    mask = np.ones(len(collapsed), np.uint8)
    image = images_mod.ReadImage(sha(RED), RED)

    def expand(ids: np.ndarray) -> Any:
        return vision.expand(text, ids, mask[: len(ids)], [image], [image.picture()])

    assert expand(collapsed).input_ids.tolist() == good.input_ids.tolist()
    changed = collapsed.copy()
    changed[3] += 1
    assert expand(changed) == (
        "the image processor tokenizes the rendered text differently from the tokenizer "
        "(first difference at non-image token 3)"
    )
    at = int(np.flatnonzero(collapsed == 12)[0])
    moved = np.concatenate([collapsed[: at - 1], [12], collapsed[at - 1 : at], collapsed[at + 1 :]])
    assert expand(moved) == (
        f"the image processor puts 0 image tokens where the template has 1 (before non-image "
        f"token {at - 1})"
    )
    doubled = np.concatenate([collapsed[: at + 1], [12], collapsed[at + 1 :]])
    assert expand(doubled) == "the chat template renders 2 image placeholders for 1 image parts"
    # Without M-RoPE there are no positions to give.
    flat = Vision(qwen25_vl_path, False, 12, None)
    assert flat.expand(text, collapsed, mask, [image], [image.picture()]).position_ids is None


def test_a_linked_input_gets_its_format_from_the_name_it_was_given(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "0123abcd", [{"text": "hi"}])
    (tmp_path / "rows.jsonl").symlink_to(tmp_path / "0123abcd")
    assert resolve_source(str(tmp_path / "rows.jsonl"), "auto").format == "jsonl"


# -- the image token as text -------------------------------------------------------------------


def chat(content: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]
    }


def test_the_image_token_as_text_is_refused(
    encoder: Encoder, qwen25_vl_path: Path, llama_path: Path, pics: Path, tmp_path: Path
) -> None:
    as_text = f"holds the image token {IMAGE_TOKEN} as text (only an image part may)"
    cases = [
        ({"text": f"a {IMAGE_TOKEN} b"}, f"text {as_text}"),
        (chat(f"look {IMAGE_TOKEN}"), f"messages[0].content {as_text}"),
        (chat([{"type": "text", "text": PLACEHOLDER}]), f"messages[0].content[0] {as_text}"),
        # Beside a real image: its count would still fit a template that renders none.
        (image_row(url_part("red.png"), f"and {IMAGE_TOKEN}"), f"messages[0].content[1] {as_text}"),
    ]
    results = encode(encoder, pics, *(row for row, _ in cases))
    assert results == [reason for _, reason in cases]
    # The same rows without the token: accepted.
    fine = encode(
        encoder, pics, {"text": "a b"}, chat("look"), image_row(url_part("red.png"), "and")
    )
    assert not any(isinstance(result, str) for result in fine), fine
    # A text model has no image token: the same text is only text.
    (plain,) = encode(Encoder.load(DATA, llama_path, False), pics, cases[0][0])
    assert not isinstance(plain, str)
    # Rendered from elsewhere than the row's text: a template that writes the token itself.
    template = tmp_path / "stray.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}" + IMAGE_TOKEN)
    data = DataConfig(paths=["x"], chat_template=str(template), loss_mask="all")
    (stray,) = encode(Encoder.load(data, qwen25_vl_path, False), pics, chat("hi"), data=data)
    assert stray == STRAY_IMAGE_TOKEN.format(token=IMAGE_TOKEN, id=12)
    # A prompt to generate from: refused alike.
    generating = Encoder.load(DATA, qwen25_vl_path, False, GenerateConfig(max_new_tokens=4))
    assert encode(generating, pics, cases[0][0], {"text": "a b"})[0] == f"text {as_text}"


def test_a_generated_response_holding_the_image_token_is_rejected(qwen25_vl_path: Path) -> None:
    raw = {"model": {"path": "m"}, "data": {"paths": ["p"]}, "store": {"url": "s"}}
    vision = Vision(qwen25_vl_path, False, 12, MROPE)
    planner = ResponsePlanner(parse_config({**raw, "generate": {}}), True, vision)
    record = {
        "sample_id": "s",
        "segments": [[1, 2]],
        "turn_end": [9],
        "turns": [{"output_ids": [5, 12, 9], "finish_reason": "stop", "text": ""}],
    }
    rejected = planner.sample(record)
    assert rejected == Reject(
        "s", "the response holds the image token (12) (turn 0), without an image"
    )
    record["turns"][0]["output_ids"] = [5, 6, 9]
    assert isinstance(planner.sample(record), Sample)


# -- URLs in reasons -----------------------------------------------------------------------------


def test_a_url_is_named_without_its_query_string_or_userinfo(
    encoder: Encoder, pics: Path, http_root: str
) -> None:
    import socket

    secrets = ("AKIDSECRETCRED", "deadbeefsignature", "hunter22")
    query = (
        "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIDSECRETCRED%2F20260101"
        "&X-Amz-Signature=deadbeefsignature"
    )
    host = http_root.removeprefix("http://")
    sources = images_mod.ImageSources(pics, None, images_mod.ImageLimits(deadline_s=2.0))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cases = {
        f"http://user:hunter22@{host}/gone.png?{query}": (
            f"cannot fetch image {http_root}/gone.png?...: HTTP 404"
        ),
        f"{http_root}/notes.txt?{query}#frag": (
            f"{http_root}/notes.txt?... is not an image (PIL cannot identify its format: "
            "UnidentifiedImageError)"
        ),
        f"http://127.0.0.1:{port}/red.png?{query}": (
            f"cannot fetch image http://127.0.0.1:{port}/red.png?...: ConnectionError: "
        ),
    }
    for url, reason in cases.items():
        got = sources.read(url)
        assert isinstance(got, str) and got.startswith(reason), got
        assert not any(secret in got for secret in secrets), got
    # As the plan's reject reason (the store's `rejected`, the logs) names it.
    (result,) = encode(encoder, pics, image_row(url_part(next(iter(cases)))))
    assert (
        result == f"messages[0].content[0]: cannot fetch image {http_root}/gone.png?...: HTTP 404"
    )
    # A URL without a query is named whole.
    assert (
        sources.read(f"{http_root}/gone.png")
        == f"cannot fetch image {http_root}/gone.png: HTTP 404"
    )


# -- into a job's store --------------------------------------------------------------------------


def test_plan_into_a_jobs_store_puts_its_images_before_their_rows(
    qwen25_vl_path: Path, pics: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [
        {"id": "a", **image_row(url_part("red.png"), "one")},
        {"id": "b", **image_row(url_part("sub/wide.png"), url_part("red.png"), "two")},
        {"id": "c", "text": "plain text"},
    ]
    path = write_jsonl(pics / "job_rows.jsonl", rows)
    raw = job_config(qwen25_vl_path, path, tmp_path / "s.zarr", tmp_path)
    raw["model"]["aux_layer_ids"] = [0, 1, 2]  # 4 layers
    config = parse_config(raw)
    _, _, builder = open_or_create(config, say=lambda *_: None)
    assert builder is not None
    added = builder.add

    def add(sample_id: str, *args: Any) -> Any:  # each image is there before its row is added
        images = args[3] if len(args) > 3 else ()
        assert all(ImageBlobs(builder.store).get(im.digest) for im in images)
        return added(sample_id, *args)

    monkeypatch.setattr(builder, "add", add)
    plan_into(builder, config, 0, on_shards=lambda shards: None, say=lambda *_: None)
    report = verify_store(tmp_path / "s.zarr", say=lambda _: None)
    assert report.checks["images"] == "ran" and not [
        f for f in report.findings if f.check in ("images", "plan")
    ], report.format()
    assert report.checked["image_blobs_checked"] == 2
    assert sorted(os.listdir(tmp_path / "s.zarr" / "images")) == sorted([sha(RED), sha(WIDE)])
