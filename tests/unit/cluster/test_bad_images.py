"""One bad image never stops, hangs or exhausts a plan, and a plan reads only the images the user
meant to give it: each bad source rejects its row with a reason naming the part, good rows
planned beside it. LLaMA-Factory's row-level images are planned as the same row with image
parts is (which test_images.py holds to HF's processor).

On the tiny Qwen2.5-VL's real tokenizer and processor, through `build_plan`; http sources from
loopback servers of the test's own (one drips its bytes, one sends too many).
"""

from __future__ import annotations

import base64
import http.server
import io
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from cluster.config import DataConfig
from cluster.images import NO_IMAGE_TOKEN
from cluster.plan import Plan, build_plan
from tests.helpers.bad_images import damaged_dds, png_claiming
from tests.helpers.prompts import write_jsonl


def png(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


RED = png(56, 56)


def image_row(row_id: str, source: str) -> dict[str, Any]:
    part = {"type": "image_url", "image_url": {"url": source}}
    return {
        "id": row_id,
        "messages": [
            {"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]},
            {"role": "assistant", "content": "red"},
        ],
    }


GOOD = image_row("good", "red.png")


def plan_rows(folder: Path, model: Path, rows: list[Any], **data: Any) -> Plan:
    path = write_jsonl(folder / f"rows{len(list(folder.glob('rows*')))}.jsonl", rows)
    return build_plan(DataConfig(paths=[str(path)], loss_mask="all", **data), model)


def reasons(plan: Plan) -> dict[str, str]:
    return {r["sample_id"]: r["reason"] for r in plan.rejected}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The input's folder, with a good image and a FIFO."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "red.png").write_bytes(RED)
    os.mkfifo(inputs / "pipe.png")  # opening it for reading blocks until a writer comes
    return inputs


class _Handler(http.server.BaseHTTPRequestHandler):
    """/drip: a PNG's length declared, then a byte every 0.2 s; /huge: a length beyond any cap;
    /endless: chunked, no length, 64 KiB chunks without end."""

    def do_GET(self) -> None:
        self.send_response(200)
        if self.path == "/endless":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"\0" * 65536
            try:
                for _ in range(1000):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:  # the client gave up, as it should
                return
            return
        self.send_header("Content-Length", str(len(RED) if self.path == "/drip" else 1 << 40))
        self.end_headers()
        if self.path == "/drip":
            try:
                for byte in RED:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                return

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def http_root() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


# -- 2, 3: images PIL refuses, URLs that do not parse --------------------------------------------


def test_a_bomb_a_damaged_image_and_a_bad_url_reject_only_their_rows(
    folder: Path, qwen25_vl_path: Path
) -> None:
    rows = [
        image_row("bomb", data_url(png_claiming(100_000, 100_000))),
        image_row("dds", data_url(damaged_dds(), "dds")),
        image_row("http-bracket", "http://[::1/a.png"),
        image_row("file-bracket", "file://[::1/a.png"),
        image_row("s3-bracket", "s3://[::1/a.png"),
        GOOD,
    ]
    plan = plan_rows(folder, qwen25_vl_path, rows)
    assert plan.sample_ids == ["good"] and len(plan.images[0]) == 1
    got = reasons(plan)
    part = "messages[0].content[0]: "
    assert got["bomb"].startswith(f"{part}data:image/png;base64,iVBORw0KGgoAAAAN")
    assert "is too large an image (Image size (10000000000 pixels) exceeds limit" in got["bomb"]
    assert got["dds"].endswith(
        "is not an image (PIL cannot identify its format: NotImplementedError)"
    )
    assert got["http-bracket"].startswith(f"{part}cannot fetch image http://[::1: InvalidURL: ")
    assert got["file-bracket"] == f"{part}file://[::1/a.png is not a file URL: Invalid IPv6 URL"
    assert got["s3-bracket"] == f"{part}cannot fetch image s3://[::1: ValueError: Invalid IPv6 URL"


# -- 4: bounds: what a source is, how large, how long --------------------------------------------


def test_a_source_that_is_not_a_regular_file_is_refused_without_blocking(
    folder: Path, qwen25_vl_path: Path
) -> None:
    rows = [image_row("fifo", "pipe.png"), image_row("zero", "/dev/zero"), GOOD]
    started = time.monotonic()
    plan = plan_rows(folder, qwen25_vl_path, rows, image_roots=[str(folder), "/dev"])
    assert time.monotonic() - started < 60  # a FIFO read would block for ever
    assert plan.sample_ids == ["good"]
    assert reasons(plan) == {
        "fifo": "messages[0].content[0]: image file pipe.png (at "
        f"{folder}/pipe.png) is not a regular file",
        "zero": "messages[0].content[0]: image file /dev/zero is not a regular file",
    }


def test_sizes_and_pixels_beyond_the_limits_are_refused_before_decoding(
    folder: Path, qwen25_vl_path: Path, http_root: str
) -> None:
    (folder / "big.png").write_bytes(png(300, 300))
    small = png(28, 28)
    rows = [
        image_row("big-file", "big.png"),
        image_row("big-data-url", data_url(png(300, 300))),
        image_row("huge-declared", f"{http_root}/huge"),
        image_row("endless", f"{http_root}/endless"),
        image_row("many-pixels", data_url(png(100, 100))),
        image_row("good", data_url(small)),
    ]
    plan = plan_rows(
        folder, qwen25_vl_path, rows, image_max_bytes=len(RED) * 4, image_max_pixels=4000
    )
    assert plan.sample_ids == ["good"]
    got = reasons(plan)
    beyond = f"beyond data.image_max_bytes {len(RED) * 4}"
    for row_id in ("big-file", "big-data-url", "huge-declared", "endless"):
        assert got[row_id].startswith("messages[0].content[0]: image "), got[row_id]
        assert got[row_id].endswith(beyond), got[row_id]
    assert f"image {http_root}/huge is {1 << 40} bytes or more" in got["huge-declared"]
    assert got["many-pixels"].endswith("is 100x100 pixels, beyond data.image_max_pixels 4000")


def test_an_http_source_that_drips_is_cut_at_its_deadline(
    folder: Path, qwen25_vl_path: Path, http_root: str
) -> None:
    # Each byte comes well within any read timeout; the whole would take len(RED) * 0.2 s.
    started = time.monotonic()
    plan = plan_rows(
        folder,
        qwen25_vl_path,
        [image_row("drip", f"{http_root}/drip"), GOOD],
        image_fetch_timeout_s=1.5,
    )
    took = time.monotonic() - started
    assert plan.sample_ids == ["good"]
    assert reasons(plan) == {
        "drip": f"messages[0].content[0]: cannot fetch image {http_root}/drip: not done within "
        "data.image_fetch_timeout_s (1.5 s)"
    }
    assert took < 1.5 + 20  # the deadline, and the plan's own work (the processor's load)


# -- 6: LLaMA-Factory's row-level images ---------------------------------------------------------


def test_row_level_images_are_placed_at_their_tags(folder: Path, qwen25_vl_path: Path) -> None:
    wide = png(112, 84)
    (folder / "wide.png").write_bytes(wide)
    question = [{"type": "text", "text": "first "}, {"type": "image", "image": "red.png"}]
    question += [{"type": "text", "text": " then "}, {"type": "image", "image": "wide.png"}]
    parts = {
        "id": "parts",
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "red, then wide"},
        ],
    }
    sharegpt = {
        "id": "sharegpt",
        "conversations": [
            {"from": "human", "value": "first <image> then <image>"},
            {"from": "gpt", "value": "red, then wide"},
        ],
        "images": ["red.png", "wide.png"],
    }
    openai = {
        "id": "openai",
        "messages": [
            {"role": "user", "content": "first <image> then <image>"},
            {"role": "assistant", "content": "red, then wide"},
        ],
        "images": ["red.png", "wide.png"],
    }
    plan = plan_rows(folder, qwen25_vl_path, [parts, sharegpt, openai])
    assert plan.rejected == [] and plan.sample_ids == ["parts", "sharegpt", "openai"]
    for k in (1, 2):
        assert plan.input_ids[k].tolist() == plan.input_ids[0].tolist()
        assert plan.loss_masks[k].tolist() == plan.loss_masks[0].tolist()
        assert plan.images[k] == plan.images[0] and len(plan.images[k]) == 2
        assert np.array_equal(plan.position_ids[k], plan.position_ids[0])
    # The check tells: the tags left as text are other tokens, and no image.
    as_text = plan_rows(folder, qwen25_vl_path, [{**sharegpt, "images": None}])
    assert as_text.images[0] == () and as_text.input_ids[0].tolist() != plan.input_ids[0].tolist()


def test_row_level_images_that_do_not_fit_their_tags_are_refused(
    folder: Path, qwen25_vl_path: Path, llama_path: Path
) -> None:
    def sharegpt(row_id: str, value: str, images: Any) -> dict[str, Any]:
        turns = [{"from": "human", "value": value}, {"from": "gpt", "value": "red"}]
        return {"id": row_id, "conversations": turns, "images": images}

    both = {**image_row("both", "red.png"), "images": ["red.png"]}
    rows = [
        sharegpt("more-tags", "<image><image> what?", ["red.png"]),
        sharegpt("fewer-tags", "what?", ["red.png"]),
        sharegpt("not-a-list", "<image> what?", "red.png"),
        sharegpt("not-a-source", "<image> what?", [{"bytes": "..."}]),
        both,
        {"id": "text", "text": "no place for it", "images": ["red.png"]},
        sharegpt("good", "<image> what?", ["red.png"]),
    ]
    plan = plan_rows(folder, qwen25_vl_path, rows)
    assert plan.sample_ids == ["good"]
    assert reasons(plan) == {
        "more-tags": "conversations holds 2 <image> tags for the 1 images of images",
        "fewer-tags": "conversations holds 0 <image> tags for the 1 images of images",
        "not-a-list": "images must be a list of image sources, got string",
        "not-a-source": "images[0] must be a non-empty string (a path or URL)",
        "both": "row has both image parts in messages and a row-level images list",
        "text": "a text row cannot carry images (images)",
    }
    # A model without images refuses the row rather than train on the tag as text.
    text_model = plan_rows(folder, llama_path, [sharegpt("on-text", "<image> what?", ["red.png"])])
    assert reasons(text_model) == {"on-text": NO_IMAGE_TOKEN}


# -- 8: local paths confined to the input's folder (or data.image_roots) -------------------------


def test_local_image_paths_are_confined_to_the_roots(folder: Path, qwen25_vl_path: Path) -> None:
    outside = folder.parent / "outside"
    outside.mkdir()
    (outside / "red.png").write_bytes(RED)
    (outside / "notes.txt").write_text("not an image")
    (folder / "link.png").symlink_to(outside / "red.png")
    rows = [
        image_row("absolute", str(outside / "red.png")),
        image_row("dotdot", "../outside/red.png"),
        image_row("file-url", f"file://{outside}/red.png"),
        image_row("link", "link.png"),
        image_row("missing", str(outside / "gone.png")),
        image_row("not-an-image", str(outside / "notes.txt")),
        GOOD,
    ]
    plan = plan_rows(folder, qwen25_vl_path, rows)
    assert plan.sample_ids == ["good"]
    got = reasons(plan)

    def refused(source: str) -> str:
        return (
            f"messages[0].content[0]: image path {source} lies outside data.image_roots "
            f"({folder.resolve()}); list its folder there to read it"
        )

    sources = {
        "absolute": str(outside / "red.png"),
        "dotdot": "../outside/red.png",
        "file-url": f"file://{outside}/red.png",
        "link": "link.png",
        "missing": str(outside / "gone.png"),
        "not-an-image": str(outside / "notes.txt"),
    }
    assert got == {row_id: refused(source) for row_id, source in sources.items()}  # no oracle
    # Listed, the same folder is read; the input's own is then not, unless listed too.
    roots = [str(folder), str(outside)]
    allowed = plan_rows(folder, qwen25_vl_path, rows, image_roots=roots)
    assert allowed.sample_ids == ["absolute", "dotdot", "file-url", "link", "good"]
    assert reasons(allowed)["missing"].endswith("No such file or directory")
    only_outside = plan_rows(folder, qwen25_vl_path, [GOOD], image_roots=[str(outside)])
    assert reasons(only_outside)["good"].startswith(
        "messages[0].content[0]: image path red.png lies outside data.image_roots"
    )
