"""Image parts of chat rows: their sources read, and the model's processor expanding them.

    image_token_id, position_ids = vision_settings(model_path)      # (12, "mrope") or (None, None)
    sources = ImageSources(base_dir, data.image_storage_options, ImageLimits(...),
                           keep_in=ImageBlobs(location))           # None: keep nothing
    image = sources.read("pics/cat.png")                           # ReadImage, or a reason
    vision = Vision(model_path, trust_remote_code, image_token_id, position_ids)
    row = vision.expand(text, ids, mask, [image], [image.picture()])  # ExpandedRow, or a reason
    sources.keep([image])                                          # an accepted row's, once

The chat template renders one image token per image; the row's tokens and loss mask are
computed from that rendering as for any row, then expanded here with the model's own HF
processor: each image token becomes the processor's run of them (loss mask 0), and an M-RoPE
model gets HF's own position ids for the expanded row (docs/design/planning.md). An image is
kept as the bytes it was read as, named by their sha256 (hsx_store/images.py): the planning
process puts each accepted row's images into the store itself, so no image travels to the
driver, and it keeps only the last CACHED_SOURCES sources read.
"""

from __future__ import annotations

import base64
import binascii
import functools
import inspect
import io
import json
import os
import queue
import re
import stat
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse, urlsplit, urlunsplit

import numpy as np

from cluster.config import DataConfig
from hsx_store.images import ImageBlobs, SampleImage, image_digest
from hsx_store.location import mask_secrets, open_location

MROPE = "mrope"
NO_IMAGE_TOKEN = "the model takes no images (its config.json names no image token)"
# Sources whose reads are kept (by count, the least recently used dropped): a conversation's
# rows often share images, a whole part rarely needs them all at once.
CACHED_SOURCES = 32
# Where a config keeps its rotary settings; an `mrope_section` there means M-RoPE positions.
_ROPE_KEYS = ("rope_scaling", "rope_parameters")


def vision_settings(model_path: str | Path, tokenizer: Any = None) -> tuple[int | None, str | None]:
    """(the model's image token id, "mrope" or None) from its config.json: `image_token_id`
    (or LLaVA's `image_token_index`), else, for a model with a `vision_config`, its tokenizer's
    image token (`tokenizer`, or loaded; a text model's never is)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return _image_token_id(config, model_path, tokenizer), _position_ids(config)


def _image_token_id(config: dict[str, Any], model_path: str | Path, tokenizer: Any) -> int | None:
    for key in ("image_token_id", "image_token_index"):
        if isinstance(config.get(key), int):
            return config[key]
    if "vision_config" not in config:
        return None
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    token_id = getattr(tokenizer, "image_token_id", None)
    if token_id is None and getattr(tokenizer, "image_token", None):
        token_id = tokenizer.convert_tokens_to_ids(tokenizer.image_token)
    return token_id if isinstance(token_id, int) else None


def _position_ids(config: dict[str, Any]) -> str | None:
    for section in (config, config.get("text_config") or {}):
        for key in _ROPE_KEYS:
            rope = section.get(key)
            if isinstance(rope, dict) and rope.get("mrope_section"):
                return MROPE
    return None


# ---------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class ReadImage:
    """An image part's encoded bytes, as read, and their sha256."""

    digest: str
    data: bytes

    def picture(self) -> Any:
        """The decoded PIL image (fresh each time: a part's pictures are not all kept)."""
        from PIL import Image

        picture = Image.open(io.BytesIO(self.data))
        picture.load()
        return picture


_DATA = DataConfig.model_fields  # the limits' defaults, where the settings are documented


@dataclass(frozen=True)
class ImageLimits:
    """What one image source may be: bytes read, pixels claimed, the seconds its fetch may
    take in all (data.image_max_bytes, image_max_pixels, image_fetch_timeout_s), and the
    folders a local path must lie in (resolved, links followed)."""

    max_bytes: int = _DATA["image_max_bytes"].default
    max_pixels: int = _DATA["image_max_pixels"].default
    deadline_s: float = _DATA["image_fetch_timeout_s"].default
    roots: tuple[Path, ...] | None = None  # None: any path


class ImageSources:
    """Reads image parts' sources: a data URL (`data:image/...;base64,...`), a path (relative
    to `base_dir`, the input file's folder, or absolute, or `file://`; a regular file within
    `limits.roots`), an object-storage URL (`s3://bucket/key`; `gs://`, `az://`) through
    obstore, an http(s) URL; each within `limits`. The last CACHED_SOURCES sources read are
    not read again; a failure is a reason (without the part's name: the caller adds it; a URL
    named without its query string or userinfo).

    `keep_in`: where `keep` puts the images of accepted rows (the store's; None: nowhere, as
    a dry run plans), each digest once per reader."""

    def __init__(
        self,
        base_dir: Path,
        storage_options: dict[str, Any] | None = None,
        limits: ImageLimits = ImageLimits(),
        keep_in: ImageBlobs | None = None,
    ) -> None:
        self.base_dir, self.storage_options, self.limits = base_dir, storage_options, limits
        self.keep_in = keep_in
        self._roots = None if limits.roots is None else [r.resolve() for r in limits.roots]
        self._read: OrderedDict[str, ReadImage | str] = OrderedDict()
        self._kept: set[str] = set()  # digests put into keep_in by this reader

    def read(self, source: str) -> ReadImage | str:
        if source.startswith("data:"):  # no fetch to save; the URL is as large as its bytes
            return self._fetch(source)
        if source in self._read:
            self._read.move_to_end(source)
            return self._read[source]
        read = self._read[source] = self._fetch(source)
        if len(self._read) > CACHED_SOURCES:
            self._read.popitem(last=False)
        return read

    def keep(self, images: Sequence[ReadImage]) -> None:
        """Put an accepted row's images into `keep_in` (each digest once: a put of one already
        there is a HEAD); nothing without it."""
        if self.keep_in is None:
            return
        for image in images:
            if image.digest not in self._kept:
                self.keep_in.put(image.digest, image.data)
                self._kept.add(image.digest)

    def _fetch(self, source: str) -> ReadImage | str:
        scheme = _scheme(source)
        try:
            if scheme == "data":
                data = _data_url_bytes(source, self.limits.max_bytes)
            elif scheme in ("http", "https"):
                data = _within(self.limits.deadline_s, source, lambda: self._http(source))
            elif scheme and scheme != "file":
                data = _within(self.limits.deadline_s, source, lambda: self._object(source))
            else:
                data = _file_bytes(self._path(source), source, self.limits.max_bytes)
        except _Unreadable as exc:
            return str(exc)
        except Exception as exc:  # a fetch's failure is the row's (obstore, requests)
            text = mask_secrets(f"{type(exc).__name__}: {exc}", self.storage_options)
            return f"cannot fetch image {_shown(source)}: {_without_queries(text, source)}"
        return _checked(source, data, self.limits.max_pixels)

    def _path(self, source: str) -> Path:
        """A local source's path; refused, without looking at what is there, outside the
        roots (no reason tells a missing file outside them from any other)."""
        if source.startswith("file://"):
            try:
                path = Path(unquote(urlparse(source).path))
            except ValueError as exc:
                raise _Unreadable(f"{source} is not a file URL: {exc}") from None
        else:
            path = self.base_dir / source  # an absolute path stays itself
        if self._roots is None:
            return path
        real = path.resolve()  # read as checked: a link changed since cannot lead elsewhere
        if not any(real.is_relative_to(root) for root in self._roots):
            shown = ", ".join(str(r) for r in self._roots)
            raise _Unreadable(
                f"image path {source} lies outside data.image_roots ({shown}); "
                "list its folder there to read it"
            )
        return real

    def _http(self, url: str) -> bytes:
        import requests

        limit = self.limits.max_bytes
        with requests.get(url, timeout=self.limits.deadline_s, stream=True) as response:
            if response.status_code != 200:
                raise _Unreadable(f"cannot fetch image {_shown(url)}: HTTP {response.status_code}")
            declared = response.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > limit:
                raise _too_large(url, int(declared), limit)
            body, end = bytearray(), time.monotonic() + self.limits.deadline_s
            while chunk := response.raw.read1(1 << 16, decode_content=True):
                body += chunk
                if len(body) > limit:
                    raise _too_large(url, len(body), limit)
                if time.monotonic() > end:  # given up by now (`_within`): stop reading too
                    raise _Unreadable(f"cannot fetch image {_shown(url)}: past its deadline")
        return bytes(body)

    def _object(self, url: str) -> bytes:
        import obstore

        parsed = urlparse(url)
        store = _object_store(
            f"{parsed.scheme}://{parsed.netloc}",
            json.dumps(self.storage_options or {}, sort_keys=True, default=str),
            self.limits.deadline_s,
        )
        result = obstore.get(store, parsed.path.lstrip("/"))
        if (size := int(result.meta["size"])) > self.limits.max_bytes:
            raise _too_large(url, size, self.limits.max_bytes)
        return bytes(result.bytes())


class _Unreadable(Exception):
    """A source that cannot be read, with the reason to give."""


def _too_large(source: str, size: int, limit: int) -> _Unreadable:
    return _Unreadable(
        f"image {_shown(source)} is {size} bytes or more, beyond data.image_max_bytes {limit}"
    )


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def _scheme(source: str) -> str:
    """A source's URL scheme, lowercase ("" for a path), without parsing the rest of it."""
    if source.startswith("data:"):
        return "data"
    match = _SCHEME.match(source)
    return match[1].lower() if match else ""


def _within(deadline_s: float, source: str, fetch: Callable[[], bytes]) -> bytes:
    """`fetch()`'s bytes, or a reason once `deadline_s` has passed: a client's timeouts bound
    each read, not the whole (a server dripping a byte a second never trips them). The fetch
    goes on in its daemon thread until it sees its deadline pass, or a read times out (http),
    or its client's request timeout ends it (obstore); its result is dropped."""
    done: queue.SimpleQueue[tuple[bytes | None, BaseException | None]] = queue.SimpleQueue()

    def run() -> None:
        try:
            done.put((fetch(), None))
        except BaseException as exc:  # handed to the caller, raised there
            done.put((None, exc))

    threading.Thread(target=run, name="image-fetch", daemon=True).start()
    try:
        data, error = done.get(timeout=deadline_s)
    except queue.Empty:
        raise _Unreadable(
            f"cannot fetch image {_shown(source)}: not done within data.image_fetch_timeout_s "
            f"({deadline_s:g} s)"
        ) from None
    if error is not None:
        raise error
    assert data is not None
    return data


def _file_bytes(path: Path, source: str, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` of them (a FIFO would block, /dev/zero never
    end); a reason names it as the row does, and where that led."""
    where = "" if str(path) == source else f" (at {path})"
    try:  # O_NONBLOCK: opening a FIFO returns at once, to be refused below
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise _Unreadable(f"cannot read image file {source}{where}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Unreadable(f"image file {source}{where} is not a regular file")
        if info.st_size > limit:
            raise _too_large(source, info.st_size, limit)
        try:
            data = file.read(limit + 1)
        except OSError as exc:
            raise _Unreadable(f"cannot read image file {source}{where}: {exc.strerror}") from None
    if len(data) > limit:  # grew since fstat
        raise _too_large(source, len(data), limit)
    return data


def _shown(source: str) -> str:
    """A source as a reason names it: a data URL by its head only; a URL without its query
    string, fragment and userinfo (a presigned URL's signature and credential, a password),
    "?..." saying a query was cut."""
    if source.startswith("data:"):
        return source[:40] + "..." if len(source) > 40 else source
    if "://" not in source or source.startswith("file://"):
        return source
    try:
        parts = urlsplit(source)
    except ValueError:  # not a URL (a bad IPv6 bracket): its scheme and host only
        return source.split("://", 1)[0] + "://" + _HOST.match(source.split("://", 1)[1])[0]
    host = parts.netloc.rpartition("@")[2]
    cut = "?..." if parts.query else ""
    return urlunsplit((parts.scheme, host, parts.path, "", "")) + cut


_HOST = re.compile(r"[^/?#@]*(?=[/?#]|$)|")  # up to the path; nothing where userinfo follows
# A query string in an error's text (requests names the URL it failed on): up to a space,
# quote or closing bracket.
_QUERY = re.compile(r"\?[^\s'\")\]>]+")


def _without_queries(text: str, source: str) -> str:
    """An error's text about `source` without any query string or the URL's userinfo."""
    try:
        parts = urlsplit(source) if "://" in source else None
    except ValueError:  # not a URL: its userinfo, if any, is not findable; cut every query
        return _QUERY.sub("?...", text)
    if parts is None or parts.scheme not in ("http", "https"):
        return text
    if (userinfo := parts.netloc.rpartition("@")[0]) and len(userinfo) >= 4:
        text = text.replace(userinfo, "***")
    return _QUERY.sub("?...", text)


def _data_url_bytes(url: str, limit: int) -> bytes:
    head, comma, payload = url.partition(",")
    if not comma or not head.endswith(";base64"):
        raise _Unreadable("a data URL must be base64: data:image/<type>;base64,<data>")
    if (size := len(payload) // 4 * 3) > limit:
        raise _too_large(url, size, limit)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _Unreadable(f"a data URL's base64 is not valid: {exc}") from None


def _checked(source: str, data: bytes, max_pixels: int) -> ReadImage | str:
    """The bytes if PIL recognizes an image format in them, of at most `max_pixels` by its
    header (decoding comes later, per row)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # judged below
            with Image.open(io.BytesIO(data)) as picture:
                width, height = picture.size
    except Image.DecompressionBombError as exc:  # PIL's own hard limit: 2x its warning's
        return f"{_shown(source)} is too large an image ({exc})"
    except Exception as exc:  # PIL's format plugins raise what they meet
        return (
            f"{_shown(source)} is not an image (PIL cannot identify its format: "
            f"{type(exc).__name__})"
        )
    if width * height > max_pixels:
        return (
            f"{_shown(source)} is {width}x{height} pixels, beyond data.image_max_pixels "
            f"{max_pixels}"
        )
    return ReadImage(image_digest(data), data)


@functools.lru_cache(maxsize=16)
def _object_store(bucket_url: str, options_json: str, timeout_s: float) -> Any:
    """One obstore client per bucket and settings, in each planning process: opened as the
    store's location is (hsx_store/location.py: endpoint, plain HTTP, retries)."""
    options = json.loads(options_json)
    options["client_options"] = {"timeout": timeout_s, **options.get("client_options", {})}
    return open_location(bucket_url, options, read_only=True).store


# ---------------------------------------------------------------------------------------------
# The processor's expansion and positions


@dataclass(frozen=True)
class ExpandedRow:
    """A row with images, as planned: the processor's tokens, the loss mask (0 on image
    tokens), M-RoPE positions [P, 3] (None: not an M-RoPE model), its images in prompt order
    (their bytes stay with the reader: ImageSources.keep)."""

    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8
    position_ids: np.ndarray | None  # int32 [P, 3]
    images: tuple[SampleImage, ...]


def expand_images(
    ids: np.ndarray,
    mask: np.ndarray,
    images: Sequence[tuple[str, int, tuple[int, int, int]]],
    image_token_id: int,
) -> ExpandedRow:
    """A collapsed row (one image token per image) expanded: the k-th image token becomes
    images[k]'s run (its digest, length, grid) of them, loss mask 0 there; no positions."""
    is_image = ids == image_token_id
    assert int(is_image.sum()) == len(images), "one image token per image"
    counts = np.ones(len(ids), np.int64)
    counts[is_image] = [length for _, length, _ in images]
    starts = (np.cumsum(counts) - counts)[is_image]
    return ExpandedRow(
        np.repeat(ids, counts).astype(np.int32),
        np.repeat(np.where(is_image, 0, mask), counts).astype(np.uint8),
        None,
        tuple(
            SampleImage(digest, int(start), int(length), tuple(thw))
            for (digest, length, thw), start in zip(images, starts, strict=True)
        ),
    )


def text_positions(count: int) -> np.ndarray:
    """M-RoPE positions of a row without images: three aranges, [count, 3] int32."""
    return np.repeat(np.arange(count, dtype=np.int32)[:, None], 3, axis=1)


class Vision:
    """The model's HF processor and, for an M-RoPE model, its own `get_rope_index` (on an
    instance made on the meta device: no weights), each loaded on the first row with images;
    a failure to load is every such row's reject reason."""

    def __init__(
        self,
        model_path: str | Path,
        trust_remote_code: bool,
        image_token_id: int,
        position_ids: str | None,
    ) -> None:
        self.model_path, self.trust_remote_code = str(model_path), trust_remote_code
        self.image_token_id, self.mrope = image_token_id, position_ids == MROPE

    @functools.cached_property
    def processor(self) -> Any:
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(
                self.model_path, trust_remote_code=self.trust_remote_code
            )
        except Exception as exc:  # any failure: the model has no usable one
            return f"the model has no image processor ({type(exc).__name__}: {exc})"
        if getattr(processor, "image_processor", None) is None:
            return "the model has no image processor (AutoProcessor gives a tokenizer only)"
        return processor

    @functools.cached_property
    def rope_index(self) -> Any:
        import torch
        from transformers import AutoConfig, AutoModel

        try:
            config = AutoConfig.from_pretrained(
                self.model_path, trust_remote_code=self.trust_remote_code
            )
            with torch.device("meta"):
                model = AutoModel.from_config(config, trust_remote_code=self.trust_remote_code)
        except Exception as exc:  # model code; its errors are the row's
            return f"cannot make the model class for its M-RoPE positions ({exc})"
        for holder in (model, getattr(model, "model", None)):
            if callable(getattr(holder, "get_rope_index", None)):
                return holder.get_rope_index
        return f"the model class {type(model).__name__} has no get_rope_index for its positions"

    def expand(
        self,
        text: str,
        ids: np.ndarray,
        mask: np.ndarray,
        images: list[ReadImage],
        pictures: list[Any],
    ) -> ExpandedRow | str:
        """The row rendered as `text`, tokenized to `ids` (one image token per image) with
        loss mask `mask`, expanded as the processor expands `text` with `images` (decoded:
        `pictures`)."""
        processor = self.processor
        if isinstance(processor, str):
            return processor
        placeholders = int(np.count_nonzero(ids == self.image_token_id))
        if placeholders != len(images):
            return (
                f"the chat template renders {placeholders} image placeholders for "
                f"{len(images)} image parts"
            )
        try:
            out = processor(
                text=[text],
                images=pictures,
                return_tensors="pt",
                return_mm_token_type_ids=True,
                add_special_tokens=False,  # as the template's rendering is tokenized
            )
        except Exception as exc:  # a processor is model code; its errors are the row's
            return f"the image processor failed: {type(exc).__name__}: {exc}"
        theirs = out["input_ids"][0].numpy()
        grid = out.get("image_grid_thw")
        if grid is None or len(grid) != len(images):
            return "the image processor gives no image_grid_thw for each image"
        grid_rows = [tuple(int(v) for v in row) for row in grid.tolist()]
        lengths = self._span_lengths(ids, theirs, grid_rows)
        if isinstance(lengths, str):
            return lengths
        spans = list(zip([image.digest for image in images], lengths, grid_rows, strict=True))
        row = expand_images(ids, mask, spans, self.image_token_id)
        assert np.array_equal(row.input_ids, theirs)  # what _span_lengths established
        positions = self._positions(out) if self.mrope else None
        if isinstance(positions, str):
            return positions
        return ExpandedRow(row.input_ids, row.loss_mask, positions, row.images)

    def positions(self, ids: np.ndarray, images: Sequence[SampleImage]) -> np.ndarray | str:
        """HF's own M-RoPE positions of an expanded row (`ids`, its image spans `images`), as
        the processor's output would give them: a generated sample's, whose rows no processor
        made (a response after its prompt's images)."""
        import torch

        tensor = torch.from_numpy(np.asarray(ids, np.int64))[None]
        out = {
            "input_ids": tensor,
            "attention_mask": torch.ones_like(tensor),
            "image_grid_thw": torch.tensor([list(image.grid_thw) for image in images]),
            "mm_token_type_ids": (tensor == self.image_token_id).int(),  # 1: image, 0: text
        }
        return self._positions(out)

    def _span_lengths(
        self, ours: np.ndarray, theirs: np.ndarray, grid: list[tuple[int, int, int]]
    ) -> list[int] | str:
        """Each image's run length in the processor's tokens, where its other tokens are ours
        in order: the image tokens between two of them are the images' between those two of
        ours (several adjacent images share that run in proportion to their grids)."""
        mine, its = ours != self.image_token_id, theirs != self.image_token_id
        ours_text, theirs_text = ours[mine], theirs[its]
        if not np.array_equal(ours_text, theirs_text):
            n = min(len(ours_text), len(theirs_text))
            first = next((k for k in range(n) if ours_text[k] != theirs_text[k]), n)
            return (
                "the image processor tokenizes the rendered text differently from the tokenizer "
                f"(first difference at non-image token {first})"
            )
        # Image tokens before each text token (and after the last), ours and the processor's.
        ours_gaps = np.diff(np.flatnonzero(np.append(mine, True)), prepend=-1) - 1
        theirs_gaps = np.diff(np.flatnonzero(np.append(its, True)), prepend=-1) - 1
        lengths: list[int] = []
        gaps = zip(ours_gaps.tolist(), theirs_gaps.tolist(), strict=True)
        for before, (placed, run) in enumerate(gaps):
            if not placed and not run:
                continue
            if not placed or not run:
                return (
                    f"the image processor puts {run} image tokens where the template has "
                    f"{placed} (before non-image token {before})"
                )
            sizes = [t * h * w for t, h, w in grid[len(lengths) : len(lengths) + placed]]
            shares = [run * size // sum(sizes) for size in sizes]
            if sum(shares) != run or not all(shares):
                return (
                    f"cannot share the image processor's {run} image tokens among {placed} "
                    "adjacent images by their grids"
                )
            lengths += shares
        return lengths

    def _positions(self, out: Any) -> np.ndarray | str:
        """HF's own M-RoPE positions of the processor's output, [P, 3] int32."""
        rope_index = self.rope_index
        if isinstance(rope_index, str):
            return rope_index
        wanted = inspect.signature(rope_index).parameters
        kwargs = {k: v for k, v in out.items() if k in wanted and k != "input_ids"}
        try:
            positions, _ = rope_index(out["input_ids"], **kwargs)
        except Exception as exc:  # model code; its errors are the row's
            return f"the model's get_rope_index failed: {type(exc).__name__}: {exc}"
        if positions.ndim != 3 or positions.shape[0] != 3:
            return f"the model's get_rope_index gives positions of shape {tuple(positions.shape)}"
        return positions[:, 0, :].T.numpy().astype(np.int32)
