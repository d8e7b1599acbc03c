"""The fault campaign's `bad_rows` job: an input that mixes every kind of row the planner rejects
with good ones (`write_input`; tools/fault_campaign.py runs the job), and what is checked of it
beyond every job's checks: each bad row rejected once, in the store and in the report alike,
with a reason matching the pattern its row expects, and no other row rejected (`check_rejects`,
on plain data); each sample with images as HF computes it with its stored images
(`check_image_sample`).

The bad rows: a lone UTF-16 surrogate in a text, a user turn, a call's arguments and a tool;
JSON nested deeper than Python's parser (a line, a tools string, a ShareGPT function_call) or
deeper than 64 levels (a tool's schema); an integer of more than 4300 digits (a line, a call's
arguments); four tools SGLang's server refuses; image sources that must not be read (a FIFO,
/dev/zero, a path outside data.image_roots, a file beyond data.image_max_bytes, one beyond
data.image_max_pixels, a 45-byte PNG claiming 100000x100000, a damaged DDS, a bad IPv6 URL, an
http server dripping a byte at a time: `dripping_server`); a LLaMA-Factory row with more
`<image>` tags than images. The good rows: the campaign's usual prompts and, for a model that
takes images, rows with images (a data URL, a path, a LLaMA-Factory ShareGPT row and an OpenAI
one). A model without images rejects every image row for that (`images=False`).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

DEEP = 5000  # levels: beyond Python's parser (its recursion limit, 1000)
NESTED = 100  # levels: parseable, beyond the planner's 64
HUGE = "9" * 5000  # digits: beyond sys.get_int_max_str_digits() (4300)
FETCH_DEADLINE_S = 3.0  # data.image_fetch_timeout_s: what the dripping source costs the plan
DRIP_EVERY_S = 0.5  # below the deadline: each read arrives in time, the whole never does
DRIP_FOR_S = 4 * FETCH_DEADLINE_S  # then the answer ends short: a given-up fetch ends soon after
# The limits the image rows meet; the good images are at most 84x56 of noise (< 16 KiB).
DATA_OPTIONS = {
    "image_max_bytes": 64 << 10,
    "image_max_pixels": 112 * 112,
    "image_fetch_timeout_s": FETCH_DEADLINE_S,
}
NO_IMAGES = r"the model takes no images \(its config\.json names no image token\)"
REFUSED_TOOL = r"^tools\[0\]: SGLang refuses this tool \("
SURROGATE = "cut \ud83d in half"  # an emoji's first half, as a writer that cut it leaves it
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
TOLERANCE = 1e-5  # float32 both sides, relative per row (tests/integration/test_image_job.py)

Line = dict[str, Any] | bytes  # a row, or a line as written (json.dumps makes no such line)


@dataclass(frozen=True)
class Expected:
    """A bad row: its sample id (of a line that is no JSON object, `<file>:<line>`) and a
    pattern its reject reason must match (re.search)."""

    sample_id: str
    reason: str


@dataclass(frozen=True)
class MixedInput:
    good: list[dict[str, Any]]  # in input order: the store's samples
    bad: list[Expected]
    data: dict[str, Any]  # the `data:` options the rows are meant for


# -- rows ---------------------------------------------------------------------------------------


def chat(id_: str, user: Any, **row: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": "noise."}]
    return {"id": id_, "messages": messages, **row}


def sharegpt(id_: str, *turns: dict[str, str], **row: Any) -> dict[str, Any]:
    return {"id": id_, "conversations": [*turns, {"from": "gpt", "value": "noise."}], **row}


def with_image(id_: str, source: str) -> dict[str, Any]:
    image = {"type": "image_url", "image_url": {"url": source}}
    return chat(id_, [{"type": "text", "text": "what is it?"}, image])


def with_tool(id_: str, tool: Any) -> dict[str, Any]:
    return chat(id_, "which tool?", tools=tool if isinstance(tool, str) else [tool])


def with_call(id_: str, arguments: Any) -> dict[str, Any]:
    call = {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0", "content": "found"},
        {"role": "assistant", "content": "found."},
    ]
    return {"id": id_, "tools": [TOOL], "messages": messages}


def function(**fields: Any) -> dict[str, Any]:
    return {"type": "function", "function": fields}


def nested_list(levels: int) -> str:
    return "[" * levels + "]" * levels


def nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def text_rows() -> list[tuple[Line, str]]:
    """Rows of bad text, JSON or tools, each with the pattern its reason must match."""
    human = {"from": "human", "value": "call it"}
    return [
        ({"id": "surrogate-text", "text": SURROGATE}, r"^text holds a lone UTF-16 surrogate"),
        (
            chat("surrogate-user", SURROGATE),
            r"^messages\[0\]\.content holds a lone UTF-16 surrogate",
        ),
        (
            with_call("surrogate-arguments", {"q": SURROGATE}),
            r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments\.q holds a lone UTF-16",
        ),
        (
            with_tool("surrogate-tool", function(name="f", description=SURROGATE)),
            r"^tools\[0\]\.function\.description holds a lone UTF-16 surrogate",
        ),
        (
            f'{{"id": "deep-line", "text": "x", "n": {nested_list(DEEP)}}}'.encode(),
            r"^malformed JSON: nested too deep for Python's parser",
        ),
        (
            with_tool("deep-schema", function(name="f", parameters=nested_schema(NESTED))),
            r"is nested deeper than 64 levels",
        ),
        (
            f'{{"id": "huge-line", "text": "x", "n": {HUGE}}}'.encode(),
            r"^malformed JSON: an integer of more than 4300 digits",
        ),
        (
            with_call("huge-arguments", f'{{"q": {HUGE}}}'),
            r"function\.arguments is not valid JSON: an integer of more than 4300 digits",
        ),
        (
            with_tool("deep-tools-string", nested_list(DEEP)),
            r"tools is a string but not JSON: nested too deep",
        ),
        (
            sharegpt(
                "deep-function-call", human, {"from": "function_call", "value": nested_list(DEEP)}
            ),
            r"a function_call value must be JSON \(nested too deep",
        ),
        (with_tool("tool-empty", {}), REFUSED_TOOL),
        (with_tool("tool-no-function", {"type": "function"}), REFUSED_TOOL),
        (with_tool("tool-function-list", {"type": "function", "function": [TOOL]}), REFUSED_TOOL),
        (with_tool("tool-name-integer", function(name=7)), REFUSED_TOOL),
    ]


def image_rows(folder: Path, outside: Path, drip_url: str) -> list[tuple[Line, str]]:
    """Rows of image sources that must not be read (their files made in `folder`, the input's,
    and `outside`, a real image outside it), each with the pattern its reason must match."""
    from tests.helpers.bad_images import damaged_dds, png_claiming

    os.mkfifo(folder / "fifo.png")  # opened without O_NONBLOCK, a read would wait for a writer
    (folder / "large.png").write_bytes(png(224, 224, seed=1))  # ~150 KiB of noise
    (folder / "wide.png").write_bytes(png(1000, 1000, noise=False))  # a few KiB, 1e6 pixels
    outside.write_bytes(png(56, 56, seed=2))
    return [
        (with_image("image-fifo", "fifo.png"), r"image file fifo\.png .*is not a regular file"),
        (with_image("image-dev-zero", "/dev/zero"), r"image file /dev/zero is not a regular file"),
        (with_image("image-outside", str(outside)), r"lies outside data\.image_roots"),
        (with_image("image-bytes", "large.png"), r"beyond data\.image_max_bytes 65536"),
        (
            with_image("image-pixels", "wide.png"),
            r"1000x1000 pixels, beyond data\.image_max_pixels",
        ),
        (
            with_image("image-bomb", data_url(png_claiming(100_000, 100_000))),
            r"is too large an image",
        ),
        (
            with_image("image-dds", data_url(damaged_dds(), "vnd-ms.dds")),
            r"is not an image \(PIL cannot identify its format: NotImplementedError\)",
        ),
        (with_image("image-bad-ipv6", "http://[::1/a.png"), r"cannot fetch image http://\["),
        (with_image("image-drip", drip_url), r"not done within data\.image_fetch_timeout_s"),
    ]


def image_tags_row() -> tuple[Line, str]:
    """A LLaMA-Factory row whose `<image>` tags outnumber its images: refused before any image
    is read, whether the model takes images or not."""
    human = {"from": "human", "value": "<image> and <image>?"}
    row = sharegpt("image-tags", human, images=["small.png"])
    return row, r"holds 2 <image> tags for the 1 images of images"


def good_image_rows(folder: Path) -> list[dict[str, Any]]:
    """Rows with images given every way a row gives them (paths relative to `folder`)."""
    (folder / "small.png").write_bytes(png(56, 56, seed=3))
    tagged = [
        {"role": "user", "content": "<image> then <image>: which is wider?"},
        {"role": "assistant", "content": "the second."},
    ]
    return [
        with_image("image-data-url", data_url(png(56, 56, seed=4))),
        with_image("image-path", "small.png"),
        sharegpt(
            "image-sharegpt", {"from": "human", "value": "<image>what is it?"}, images=["small.png"]
        ),
        {
            "id": "image-openai",
            "messages": tagged,
            "images": ["small.png", data_url(png(84, 56, 5))],
        },
    ]


def mixed(good: list[dict[str, Any]], bad: list[tuple[Line, str]]) -> list[tuple[Line, str | None]]:
    """The good rows with a bad one after every few of them (the rest at the end): each line
    with the pattern its reason must match, None for a good row."""
    every, rest = max(1, len(good) // len(bad)), list(bad)
    out: list[tuple[Line, str | None]] = []
    for k, row in enumerate(good, 1):
        out.append((row, None))
        if k % every == 0 and rest:
            out.append(rest.pop(0))
    return out + rest


def write_input(
    path: Path, good: list[dict[str, Any]], outside: Path, drip_url: str, images: bool
) -> MixedInput:
    """`good` rows (and, for a model that takes images, rows with images) with every bad row
    among them, written to `path` (JSONL); the image rows' files beside it and at `outside`."""
    folder = path.parent
    imaged = image_rows(folder, outside, drip_url)
    bad = [*text_rows(), image_tags_row()]
    bad += imaged if images else [(row, NO_IMAGES) for row, _ in imaged]
    good = (good + good_image_rows(folder)) if images else good
    expected = []
    with path.open("wb") as f:
        for number, (line, reason) in enumerate(mixed(good, bad), 1):
            f.write((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n")
            if reason is not None:
                own = f"{path.name}:{number}" if isinstance(line, bytes) else line["id"]
                expected.append(Expected(own, reason))
    roots = [str(folder), "/dev"]  # /dev: so /dev/zero is judged as what it is, not where
    return MixedInput(good, expected, {**DATA_OPTIONS, "image_roots": roots})


# -- image bytes --------------------------------------------------------------------------------


def png(width: int, height: int, seed: int = 0, noise: bool = True) -> bytes:
    """A PNG of noise (incompressible: its bytes grow with its pixels) or of black."""
    shape = (height, width, 3)
    pixels = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels if noise else np.zeros(shape, np.uint8)).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


@contextlib.contextmanager
def dripping_server() -> Iterator[str]:
    """An http server on loopback that answers a GET with an image's headers, then a byte every
    DRIP_EVERY_S for DRIP_FOR_S: a fetch no read timeout ends. Its URL; stopped, its answers
    too, on exit."""
    stop = threading.Event()

    class Drip(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", "4096")  # within data.image_max_bytes
            self.end_headers()
            end = time.monotonic() + DRIP_FOR_S
            with contextlib.suppress(OSError):  # the fetch given up: its connection closed
                while time.monotonic() < end and not stop.wait(DRIP_EVERY_S):
                    self.wfile.write(b"\0")
                    self.wfile.flush()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="drip", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/drip.png"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        thread.join()


# -- the checks ---------------------------------------------------------------------------------


def check_rejects(
    rejected: list[dict[str, str]], report: dict[str, Any], bad: list[Expected]
) -> list[str]:
    """Each bad row rejected once with a reason matching its pattern, no other row rejected,
    and the report's rejects the store's (`rejected`)."""
    reasons: dict[str, list[str]] = {}
    for reject in rejected:
        reasons.setdefault(reject["sample_id"], []).append(reject["reason"])
    problems = []
    for row in bad:
        got = reasons.pop(row.sample_id, [])
        if len(got) != 1:
            problems.append(f"bad row {row.sample_id}: rejected {len(got)} times, not once")
        elif not re.search(row.reason, got[0]):
            problems.append(f"bad row {row.sample_id}: rejected for {got[0]!r}, not /{row.reason}/")
    problems += [f"row {k} rejected, a good one: {v}" for k, v in reasons.items()]
    counted = report.get("samples", {}).get("rejected_at_plan")
    if report.get("rejected") != rejected or counted != len(rejected):
        problems.append(f"the report's rejects ({counted}) are not the store's ({len(rejected)})")
    return problems


def check_image_sample(model: Path, store: Any, i: int) -> None:
    """Sample `i` of a vision model's store: its stored positions and hidden states those of
    HF transformers' forward of its stored tokens with its stored images (AssertionError)."""
    import torch

    from hsx_store.images import ImageBlobs
    from tests.helpers.vl_reference import assert_matches_reference, reference_of_ids

    rows, g = store.sample_rows(i), store.group
    blobs = ImageBlobs(store)
    images = [blobs.get(image.digest) for image in store.sample_images(i, i + 1).get(i, [])]
    ref = reference_of_ids(model, g["input_ids"][rows].tolist(), images)
    positions = np.asarray(g["position_ids"][rows])
    assert np.array_equal(positions, ref.position_ids.numpy()), f"sample {i}: positions differ"
    stored = {a: torch.from_numpy(np.asarray(g[a][rows])) for a in store.manifest.hidden_arrays}
    try:
        assert_matches_reference(ref, store.manifest.layer_ids, stored, TOLERANCE)
    except AssertionError as exc:
        raise AssertionError(f"sample {i} ({len(images)} images): {exc}") from None
