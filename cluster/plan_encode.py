"""Rows to samples: field checks, chat template, tokenization, loss mask and limits.

    encoder = Encoder.load(data, model_path, trust_remote_code)
    rows = [parse_row(row, reason, data) for row, reason in raw]
    results = encoder.encode(rows, encoder.image_sources(base_dir, keep_in))  # paths: base_dir's
    # each (ids, mask), or an ExpandedRow for a row with images (cluster/images.py), or a reason;
    # an accepted row's images put into `keep_in` (an ImageBlobs, or None) as it is encoded

The rules and every reject reason: docs/design/planning.md. Nothing here raises for a bad
row; PlanError is only for the model or the template file as a whole.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from actors.config import GenerateConfig
from cluster.config import DataConfig
from cluster.content_format import content_format, for_template, unrendered_image
from cluster.conversation import (
    SHAREGPT_SYSTEM_FIELD,
    image_sources,
    parse_openai,
    parse_sharegpt,
    place_row_images,
    type_name,
)
from cluster.images import (
    NO_IMAGE_TOKEN,
    ExpandedRow,
    ImageLimits,
    ImageSources,
    ReadImage,
    Vision,
    vision_settings,
)
from cluster.loss_mask import (
    Render,
    TemplateShapeError,
    TurnShape,
    token_mask,
    token_mask_by_prefix,
)
from cluster.plan_sources import PlanError
from cluster.row_values import bad_value
from cluster.served_form import served_form
from hsx_store.images import ImageBlobs, SampleImage

NO_TEMPLATE = "the model has no chat template; set data.chat_template"
NO_ASSISTANT = "no assistant turn to train on"
NO_MASKED_TOKENS = "the chat template marks no assistant tokens"
NOTHING_TO_ANSWER = "nothing for the model to answer: {what}"
UNRENDERED = "the chat template does not render {what} (it has no tool support)"
# A row's own text holding the image token would give the model an image token without an
# image: its forward fails on the count of image tokens and image features.
IMAGE_TOKEN_AS_TEXT = "{where} holds the image token {token} as text (only an image part may)"
STRAY_IMAGE_TOKEN = "the rendered row holds the image token {token} (id {id}) without an image"
_TO_WRITE = {"role": "assistant", "content": None}  # a turn the model writes, all of it anew
# The same test transformers uses to decide whether a template can return an assistant mask.
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class _Expanded:
    """A row expanded with its images, and the images as read (kept once it is accepted)."""

    row: ExpandedRow
    read: tuple[ReadImage, ...]


@dataclass
class Row:
    """One input row after its field checks: a reject reason, or text, or a conversation."""

    own_id: str | None  # the row's id field; None: the row is named by its location
    reason: str | None = None
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # the row's tool definitions, for the template
    messages_field: str | None = None  # as reasons name it
    images: tuple[tuple[str, str], ...] = ()  # each image part's (where, source), in order


Encoded = tuple[np.ndarray, np.ndarray]  # int32 token ids, uint8 loss mask
# generating: a prompt's token ids (one image token per image), a mask of zeros, its segments'
# lengths, and its images in prompt order (their spans in the expanded prompt)
PromptEncoded = tuple[np.ndarray, np.ndarray, list[int], tuple[SampleImage, ...]]


def parse_row(value: Any, reason: str | None, data: DataConfig) -> Row:
    """The id and field checks of one raw row (`reason`: it could not even be parsed)."""
    if reason is None and not isinstance(value, dict):
        reason = f"row must be a JSON object, got {type_name(value)}"
    if reason is not None:
        return Row(None, reason)
    own_id = value.get(data.id_field)
    if own_id is not None:
        if isinstance(own_id, bool) or not isinstance(own_id, str | int):
            return Row(
                None, f"{data.id_field} must be a string or an integer, got {type_name(own_id)}"
            )
        if own_id == "":
            return Row(None, f"{data.id_field} is an empty string")
        if reason := bad_value(own_id, data.id_field):
            return Row(None, reason)
        own_id = str(own_id)
        if "\0" in own_id:  # the store's fixed-width strings drop trailing NULs: ids would merge
            return Row(None, f"{data.id_field} contains a NUL character")
    for name in _content_fields(data):
        if name in value and (reason := bad_value(value[name], name)):
            return Row(own_id, reason)
    return _parse_content(own_id, value, data)


def _content_fields(data: DataConfig) -> tuple[str, ...]:
    """The fields of a row the plan reads, besides its id."""
    return (
        data.text_field,
        data.messages_field,
        data.conversations_field,
        data.tools_field,
        data.images_field,
        SHAREGPT_SYSTEM_FIELD,
    )


def _parse_content(own_id: str | None, row: dict[str, Any], data: DataConfig) -> Row:
    if data.row_schema == "auto":
        detected = _detect_schema(row, data)
        if isinstance(detected, str):
            return Row(own_id, detected)
        schema, field = detected
    else:
        schema = data.row_schema
        field = {
            "text": data.text_field,
            "openai": data.messages_field,
            "sharegpt": data.conversations_field,
        }[schema]
    if schema == "text":
        if row.get(data.images_field):
            return Row(own_id, f"a text row cannot carry images ({data.images_field})")
        return _parse_text(own_id, row.get(field), field)
    tools = row.get(data.tools_field)
    if schema == "openai":
        conv = parse_openai(row.get(field), tools, field, data.tools_field, data.roles)
    else:
        system = row.get(SHAREGPT_SYSTEM_FIELD)
        conv = parse_sharegpt(row.get(field), tools, system, field, data.tools_field, data.roles)
    if isinstance(conv, str):
        return Row(own_id, conv)
    messages = conv.messages
    if (listed := row.get(data.images_field)) is not None:
        messages = place_row_images(messages, listed, data.image_tag, field, data.images_field)
        if isinstance(messages, str):
            return Row(own_id, messages)
    served = served_form(messages, conv.tools, field, data.tools_field)
    if isinstance(served, str):
        return Row(own_id, served)
    messages, tools = served
    images = tuple(image_sources(messages, field))
    if listed:  # placed from the row's list: named as the row names them
        images = tuple((f"{data.images_field}[{i}]", src) for i, (_, src) in enumerate(images))
    return Row(own_id, messages=messages, tools=tools, messages_field=field, images=images)


def _detect_schema(row: dict[str, Any], data: DataConfig) -> tuple[str, str] | str:
    """The row's shape and its field, from the one field it holds (a null field counts as
    absent: columnar formats have every column in every row), or a reject reason. A chat
    field's turns tell its shape: `{from, value}` is ShareGPT, `{role, content}` OpenAI."""
    fields = (data.text_field, data.messages_field, data.conversations_field)
    held = [f for f in fields if row.get(f) is not None]
    if len(held) > 1:
        return f"row has both {held[0]} and {held[1]}"
    if not held:
        return f"row has none of {', '.join(fields)}"
    (field,) = held
    if field == data.text_field:
        return "text", field
    shape = _turn_shape_of(row[field])
    if shape is None:
        shape = "sharegpt" if field == data.conversations_field else "openai"
    return shape, field


def _turn_shape_of(turns: Any) -> str | None:
    """ "sharegpt" or "openai" by the first turn's keys (a key null: a columnar file whose
    other rows hold the other shape in the same column); None: cannot tell."""
    first = turns[0] if isinstance(turns, list) and turns else None
    if not isinstance(first, dict):
        return None
    if first.get("from") is not None and first.get("role") is None:
        return "sharegpt"
    if first.get("role") is not None and first.get("from") is None:
        return "openai"
    return None


def _parse_text(own_id: str | None, text: Any, field: str) -> Row:
    if text is None:
        return Row(own_id, f"row has no {field}")
    if not isinstance(text, str):
        return Row(own_id, f"{field} must be a string, got {type_name(text)}")
    if not text or text.isspace():
        return Row(own_id, "text is only whitespace" if text else "empty text")
    return Row(own_id, text=text)


# ---------------------------------------------------------------------------------------------
# Model


def load_tokenizer(model_path: str | Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot load the tokenizer of {model_path}: {exc}") from exc


def vocab_size(model_path: Path) -> int:
    """`text_config.vocab_size` if present, else `vocab_size`: a tokenizer's added tokens can
    lie beyond the embedding."""
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read {model_path / 'config.json'}: {exc}") from exc
    text_config = config.get("text_config") or {}
    size = text_config.get("vocab_size", config.get("vocab_size"))
    if not isinstance(size, int) or size < 1:
        raise PlanError(f"{model_path / 'config.json'} has no usable vocab_size")
    return size


def chat_template_text(
    data: DataConfig, model_path: str | Path, trust_remote_code: bool = False
) -> str | None:
    """`plan.chat_template` without planning: what a resume compares with the store's."""
    if data.chat_template != "model":
        return resolve_chat_template(data.chat_template, None)
    return resolve_chat_template("model", load_tokenizer(model_path, trust_remote_code))


def resolve_chat_template(setting: str, tokenizer: Any) -> str | None:
    if setting != "model":
        try:
            return Path(setting).read_text()
        except OSError as exc:
            raise PlanError(f"cannot read the chat template file {setting}: {exc}") from exc
    if tokenizer.chat_template is None:
        return None
    try:  # a dict of named templates resolves to its "default" one, as transformers does
        return tokenizer.get_chat_template()
    except ValueError:
        return None


def _special_tokens(tokenizer: Any) -> list[str]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return sorted(
        {*tokenizer.all_special_tokens, *(t.content for t in added.values() if t.special)}
    )


# ---------------------------------------------------------------------------------------------
# Tokenization and checks


class Encoder:
    """Tokenizes a chunk of parsed rows; each result is (ids, mask) arrays or a reject reason."""

    def __init__(
        self,
        tokenizer: Any,
        template: str | None,
        data: DataConfig,
        vocab: int,
        generate: GenerateConfig | None = None,
        vision: Vision | None = None,
        position_ids: str | None = None,
    ):
        self.tok = tokenizer
        self.generate = generate
        self.template = template
        self.content_format = content_format(template, data.content_format)
        self.assistant_only = data.loss_mask == "assistant"
        self.max_length = data.max_length
        self.vocab = vocab
        fast = bool(getattr(tokenizer, "is_fast", False))
        # char_to_token, which the transformers mask relies on, needs a fast tokenizer.
        self.use_markers = bool(template and _GENERATION_TAG.search(template) and fast)
        self.use_offsets = fast
        backend = getattr(tokenizer, "backend_tokenizer", None) if fast else None
        plain = backend is not None and backend.truncation is None and backend.padding is None
        self._backend = backend if plain else None
        self._shape: TurnShape | str | None = None  # learned on the first chat row that needs it
        self._renders: dict[str, bool] = {}  # whether the template renders tools, calls
        # Images: None without an image token (no processor is ever loaded then); the
        # positions every sample gets ("mrope": [P, 3], cluster/images.py; None: none).
        self.vision, self.position_ids = vision, position_ids
        self._image_options = data.image_storage_options
        self._image_limits = ImageLimits(
            data.image_max_bytes, data.image_max_pixels, data.image_fetch_timeout_s
        )
        self._image_roots = None if data.image_roots is None else tuple(map(Path, data.image_roots))

    @classmethod
    def load(
        cls,
        data: DataConfig,
        model_path: str | Path,
        trust_remote_code: bool,
        generate: GenerateConfig | None = None,
    ) -> Encoder:
        tokenizer = load_tokenizer(model_path, trust_remote_code)
        template = resolve_chat_template(data.chat_template, tokenizer)
        vocab = vocab_size(Path(model_path))
        image_token_id, position_ids = vision_settings(model_path, tokenizer)
        vision = None
        if image_token_id is not None:
            vision = Vision(model_path, trust_remote_code, image_token_id, position_ids)
        return cls(tokenizer, template, data, vocab, generate, vision, position_ids)

    def image_sources(self, base_dir: Path, keep_in: ImageBlobs | None = None) -> ImageSources:
        """Where image parts are read from: paths relative to `base_dir` (the input's
        folder), within data.image_roots (default: `base_dir`), object storage with
        data.image_storage_options; each within data's limits; and where an accepted row's
        images are put (`keep_in`: the store's; None: nowhere)."""
        roots = (base_dir,) if self._image_roots is None else self._image_roots
        limits = replace(self._image_limits, roots=roots)
        return ImageSources(base_dir, self._image_options, limits, keep_in=keep_in)

    @functools.cached_property
    def image_token(self) -> str:
        """The image token as text (`<|image_pad|>`), as reasons name it."""
        assert self.vision is not None
        return str(self.tok.convert_ids_to_tokens(self.vision.image_token_id))

    def encode(
        self, rows: list[Row], images: ImageSources | None = None
    ) -> list[Encoded | PromptEncoded | ExpandedRow | str]:
        """Each row's (ids, loss mask), or why it is rejected; a row with images: its
        ExpandedRow, its images read from `images` (default: paths relative to the current
        directory). Generating (`generate`): each row's prompt instead, the tokens the model
        answers, with a mask of zeros (a PromptEncoded)."""
        if self.generate is not None:
            if images is None and any(r.images for r in rows):
                images = self.image_sources(Path.cwd())
            return [r.reason or self._encode_prompt(r, images) for r in rows]
        # "": filled in below
        results: list[Any] = [
            r.reason
            or (r.images and self._unrendered_image(r))
            or self._image_token_as_text(r)
            or self._unrendered(r.messages, r.tools)
            or ""
            for r in rows
        ]
        texts = [i for i, r in enumerate(rows) if r.text is not None and not results[i]]
        chats = [i for i, r in enumerate(rows) if r.messages is not None and not results[i]]
        if texts:
            ids = self.tok([rows[i].text for i in texts], add_special_tokens=True)["input_ids"]
            for i, row_ids in zip(texts, ids, strict=True):
                results[i] = (row_ids, None)
        encoded = self._encode_chats([rows[i] for i in chats])
        for i, result in zip(chats, encoded, strict=True):
            results[i] = result
        checked = [r if isinstance(r, str) else self._check(*r) for r in results]
        for i, row in enumerate(rows):
            if isinstance(checked[i], str) or self.vision is None:
                continue
            if not row.images:
                checked[i] = self._without_stray_image_token(checked[i])
                continue
            if images is None:
                images = self.image_sources(Path.cwd())
            checked[i] = self._with_images(row, checked[i], images)
        return checked

    # -- images ------------------------------------------------------------------------------

    def _image_token_as_text(self, row: Row) -> str | None:
        """Where a row's own text (a text row's, a message's content or text part) holds the
        image token; None for a model without one."""
        if self.vision is None or row.reason is not None:
            return None
        token = self.image_token
        if row.text is not None:
            return (
                IMAGE_TOKEN_AS_TEXT.format(where="text", token=token) if token in row.text else None
            )
        for k, message in enumerate(row.messages or []):
            content = message.get("content")
            where = f"{row.messages_field}[{k}].content"
            if isinstance(content, str) and token in content:
                return IMAGE_TOKEN_AS_TEXT.format(where=where, token=token)
            for j, part in enumerate(content if isinstance(content, list) else []):
                if isinstance(part.get("text"), str) and token in part["text"]:
                    return IMAGE_TOKEN_AS_TEXT.format(where=f"{where}[{j}]", token=token)
        return None

    def _without_stray_image_token(self, encoded: Any) -> Any:
        """A row without images as encoded, or the reason it is refused where its tokens hold
        the image token (rendered from elsewhere than its text: a tool call, the template)."""
        if self.vision is None or isinstance(encoded, str):
            return encoded
        if (np.asarray(encoded[0]) == self.vision.image_token_id).any():
            return STRAY_IMAGE_TOKEN.format(token=self.image_token, id=self.vision.image_token_id)
        return encoded

    def _unrendered_image(self, row: Row) -> str | None:
        if self.vision is None:
            return NO_IMAGE_TOKEN
        return unrendered_image(row.messages or [], str(row.messages_field), self.content_format)

    def _with_images(self, row: Row, encoded: Encoded, images: ImageSources) -> ExpandedRow | str:
        """A row's collapsed (ids, mask) expanded by the model's processor with its images."""
        assert row.messages is not None
        try:  # the text the row's tokens came from, for the processor to expand
            text = self._render(row.messages, False, row.tools)
        except Exception as exc:  # a template is user code; its errors are the row's
            return f"chat template error: {exc}"
        expanded = self._expand(row.images, text, *encoded, images)
        if isinstance(expanded, str):
            return expanded
        if (length := len(expanded.row.input_ids)) > self.max_length:
            return f"{length} tokens > max_length {self.max_length}"
        if not expanded.row.loss_mask.any():
            return NO_MASKED_TOKENS
        images.keep(expanded.read)  # accepted: into the store now, before the driver adds it
        return expanded.row

    def _expand(
        self,
        parts: tuple[tuple[str, str], ...],
        text: str,
        ids: np.ndarray,
        mask: np.ndarray,
        images: ImageSources,
    ) -> _Expanded | str:
        """`ids` (one image token per image part of `parts`, rendered as `text`) expanded by
        the model's processor with the parts' images, read from `images`."""
        assert self.vision is not None
        read, pictures = [], []
        for where, source in parts:
            image = images.read(source)
            if isinstance(image, str):
                return f"{where}: {image}"
            try:
                pictures.append(image.picture())
            except Exception as exc:  # PIL's decoders raise what they meet
                return f"{where}: cannot decode the image: {type(exc).__name__}: {exc}"
            read.append(image)
        row = self.vision.expand(text, ids, mask, read, pictures)
        return row if isinstance(row, str) else _Expanded(row, tuple(read))

    # -- prompts to generate from ------------------------------------------------------------

    def prompt_of(self, row: Row) -> list[dict[str, Any]] | str:
        """What the model answers: a text row's text, or a chat row's messages with a null
        content where the model writes a turn: the last assistant turn (`generate.turns`
        last) or every one (all), plus one after a conversation that ends with another role.
        With `all`, a recorded tool call that tool results answer stays as recorded: a call
        written anew would not be the one they answer (docs/design/generation.md)."""
        assert self.generate is not None
        if row.messages is None:
            return str(row.text)
        messages = list(row.messages)
        if self.generate.turns == "last":
            if messages[-1]["role"] == "assistant":
                messages = messages[:-1]
        else:
            answered = [
                "tool_calls" in m and k + 1 < len(messages) and messages[k + 1]["role"] == "tool"
                for k, m in enumerate(messages)
            ]
            messages = [
                _TO_WRITE if m["role"] == "assistant" and not kept else m
                for m, kept in zip(messages, answered, strict=True)
            ]
        if not messages or messages[-1]["role"] != "assistant":
            messages.append(_TO_WRITE)
        return [dict(m) for m in messages]

    @functools.cache  # noqa: B019 (one per encoder, and an encoder lives as long as its job)
    def turn_end(self, chat: bool) -> list[int] | str:
        """The tokens that close a response: the template's assistant turn end for chat rows
        (ChatML's `<|im_end|>`), the eos token for text rows; a reason where it is unknown."""
        if not chat:
            eos = self.tok.eos_token_id
            return [] if eos is None else [int(eos)]
        shape = self._turn_shape()
        if isinstance(shape, str):
            return shape
        return self._tokenize([shape.end])[0] if shape.end else []

    def _encode_prompt(self, row: Row, images: ImageSources | None) -> PromptEncoded | str:
        """(the prompt's tokens, a mask of zeros, its segments' lengths, its images): the
        tokens before each turn the model writes, after the one before it (one segment: the
        last turn). The prompt's images (read from `images`) are expanded as a captured row's
        are; the tokens keep one image token each, as requests carry them."""
        assert self.generate is not None
        prompt = self.prompt_of(row)
        texts: list[str] = []  # the chat segments' texts
        # Judged as prompted: an image (or the image token) in a turn written anew is gone.
        prompted = row
        if not isinstance(prompt, str):
            parts = tuple(image_sources(prompt, str(row.messages_field)))
            prompted = replace(row, messages=prompt, images=parts)
        unrendered = prompted.images and self._unrendered_image(prompted)
        if reason := unrendered or self._image_token_as_text(prompted):
            return reason
        if isinstance(prompt, str):
            segments = [self.tok(prompt, add_special_tokens=True)["input_ids"]]
        else:
            if self.template is None:
                return NO_TEMPLATE
            if len(prompt) < 2:
                return NOTHING_TO_ANSWER.format(what="no turn before the assistant's")
            if (before := prompt[-2]["role"]) in ("assistant", "system"):
                return NOTHING_TO_ANSWER.format(what=f"the turn before it is the {before}'s")
            # The turns to write as empty: templates concatenate or search a content.
            written = [{**m, "content": ""} if m["content"] is None else m for m in prompt]
            if reason := self._unrendered(written, row.tools):
                return reason
            try:
                pieces = self._segment_texts(prompt, row.tools)
            except Exception as exc:  # a template is user code; its errors are the row's
                return f"chat template error: {exc}"
            if isinstance(pieces, str):
                return pieces
            texts, segments = pieces, self._tokenize(pieces)
        end = self.turn_end(chat=not isinstance(prompt, str))
        if isinstance(end, str):
            return end
        lengths = [len(seg) for seg in segments]
        if reason := self._no_room(sum(lengths), lengths, end):
            return reason
        checked = self._check([t for seg in segments for t in seg], None)
        if isinstance(checked, str):
            return checked
        ids, zeros = checked[0], np.zeros(len(checked[0]), np.uint8)
        if not (parts := prompted.images):
            stray = self._without_stray_image_token((ids, zeros))
            return stray if isinstance(stray, str) else (ids, zeros, lengths, ())
        assert images is not None and texts  # a chat prompt: its segments' texts are there
        expanded = self._expand(parts, "".join(texts), ids, zeros, images)
        if isinstance(expanded, str):
            return expanded
        if reason := self._no_room(len(expanded.row.input_ids), lengths, end):
            return reason
        images.keep(expanded.read)  # accepted: into the store now, as a captured row's
        return ids, zeros, lengths, expanded.row.images

    def _no_room(self, prompt_tokens: int, segments: list[int], end: list[int]) -> str | None:
        """Why a prompt of `prompt_tokens` (expanded) leaves no room for its turns."""
        assert self.generate is not None
        room = len(segments) * (self.generate.max_new_tokens + len(end))
        if prompt_tokens + room <= self.max_length:
            return None
        return (
            f"no room to generate: {prompt_tokens} prompt tokens + {len(segments)} x "
            f"(max_new_tokens {self.generate.max_new_tokens} + {len(end)} end-of-turn) > "
            f"max_length {self.max_length}"
        )

    def _segment_texts(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[str] | str:
        """The text before each turn to write, tokenized piece by piece. With one turn: the
        rendering of the messages before it with the template's generation prompt. With
        several, or with a template that has none (add_generation_prompt changes nothing: that
        rendering ends before the assistant's header): one rendering with a probe text in every
        turn to write, the text before and between those turns, headers included (each piece
        starts after a special token: the pieces' tokens are the whole's)."""
        shape = self._turn_shape()
        if isinstance(shape, str):
            return shape
        render = self._renderer(tools)
        if shape.generation_prompt and sum(m["content"] is None for m in messages) == 1:
            return [render(messages[:-1], True)]
        probe = "HSXPROBEASSISTANT"
        filled = [{**m, "content": probe} if m["content"] is None else m for m in messages]
        text = render(filled, False)
        spans = shape.assistant_spans(text, filled, render)
        if isinstance(spans, str):
            return spans
        to_write = [m["content"] is None for m in messages if m["role"] == "assistant"]
        turns = [span for span, written in zip(spans, to_write, strict=True) if written]
        after = [0, *(end for _, end in turns)]  # where each piece starts
        return [text[after[t] : start] for t, (start, _) in enumerate(turns)]

    def _check(self, ids: list[int], mask: list[int] | None) -> Encoded | str:
        if not ids:
            return "zero tokens"
        if len(ids) > self.max_length:
            return f"{len(ids)} tokens > max_length {self.max_length}"
        arr = np.asarray(ids, dtype=np.int64)
        bad = (arr < 0) | (arr >= self.vocab)
        if bad.any():
            return f"token id {arr[bad][0]} is outside the model's vocabulary [0, {self.vocab})"
        if mask is None:
            return arr.astype(np.int32), np.ones(len(arr), dtype=np.uint8)
        mask_arr = np.asarray(mask, dtype=np.uint8)
        if not mask_arr.any():
            return NO_MASKED_TOKENS
        return arr.astype(np.int32), mask_arr

    def _encode_chats(self, rows: list[Row]) -> list[Any]:
        if not rows:
            return []
        if self.template is None:
            return [NO_TEMPLATE] * len(rows)
        if not self.assistant_only:
            return self._encode_rendered(rows, masked=False)
        results: list[Any] = [NO_ASSISTANT] * len(rows)
        todo = [i for i, r in enumerate(rows) if any(m["role"] == "assistant" for m in r.messages)]
        if self.use_markers:
            encoded = self._encode_marked([rows[i] for i in todo])
        else:
            encoded = self._encode_rendered([rows[i] for i in todo], masked=True)
        for i, result in zip(todo, encoded, strict=True):
            results[i] = result
        return results

    def _unrendered(
        self, messages: list[dict[str, Any]] | None, tools: list[dict[str, Any]] | None
    ) -> str | None:
        """Why the template cannot render a conversation's tools or tool calls: its rendering
        is the same without them (a template without tool support). Learned once per kind,
        on the first conversation that renders with them; asked again while one raises."""
        if not (messages and self.template):
            return None
        calls = next((k for k, m in enumerate(messages) if "tool_calls" in m), None)
        kinds = {"tools": bool(tools), "calls": calls is not None}
        todo = [kind for kind, held in kinds.items() if held and kind not in self._renders]
        try:
            if todo:
                text = self._render(messages, False, tools)
            if "tools" in todo:
                self._renders["tools"] = text != self._render(messages, False, None)
            if "calls" in todo:
                without = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
                self._renders["calls"] = text != self._render(without, False, tools)
        except Exception as exc:  # a template is user code; its errors are the row's
            return f"chat template error: {exc}"
        if kinds["tools"] and not self._renders["tools"]:
            return UNRENDERED.format(what="the row's tools")
        if kinds["calls"] and not self._renders["calls"]:
            return UNRENDERED.format(what=f"the tool calls of messages[{calls}]")
        return None

    def _render(
        self,
        messages: list[dict[str, Any]],
        generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return self.tok.apply_chat_template(
            for_template(messages, self.content_format),
            tools=tools,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def _renderer(self, tools: list[dict[str, Any]] | None) -> Render:
        """`_render` for one row: with its tools."""
        return lambda messages, generation_prompt: self._render(messages, generation_prompt, tools)

    def _turn_shape(self) -> TurnShape | str:
        if self._shape is None:
            try:
                self._shape = TurnShape.learn(self._render, _special_tokens(self.tok))
            except TemplateShapeError as exc:
                self._shape = (
                    f"cannot tell how the chat template renders assistant turns ({exc}); use "
                    "loss_mask: all or a template with {% generation %} markers"
                )
        return self._shape

    def _encode_rendered(self, rows: list[Row], masked: bool) -> list[Any]:
        """One rendering per conversation, one batch tokenizer call; masks from the assistant
        turns' character spans (cluster/loss_mask.py)."""
        shape = self._turn_shape() if masked else None
        if isinstance(shape, str):
            return [shape] * len(rows)
        results: list[Any] = []
        texts: list[str] = []
        spans: list[Any] = []
        for row in rows:
            assert row.messages is not None
            render = self._renderer(row.tools)
            try:
                text = render(row.messages, False)
            except Exception as exc:  # a template is user code; its errors are the row's
                results.append(f"chat template error: {exc}")
                continue
            span = shape.assistant_spans(text, row.messages, render) if shape else []
            results.append(span if isinstance(span, str) else "")
            if not isinstance(span, str):
                texts.append(text)
                spans.append(span)
        if not texts:
            return results
        offsets = masked and self.use_offsets
        all_ids, all_offsets = self._tokenize_rendered(texts, offsets)
        todo = iter(range(len(texts)))
        for i, result in enumerate(results):
            if result:
                continue
            k = next(todo)
            ids = all_ids[k]
            if not masked:
                results[i] = (ids, None)
            elif offsets:
                results[i] = (ids, token_mask(spans[k], all_offsets[k], len(ids)))
            else:
                mask = token_mask_by_prefix(spans[k], texts[k], ids, self._tokenize)
                results[i] = mask if isinstance(mask, str) else (ids, mask)
        return results

    def _tokenize_rendered(self, texts: list[str], offsets: bool) -> tuple[list[Any], list[Any]]:
        """Token ids (and character offsets, or the encodings that give them) of rendered
        conversations, without special tokens
        added (as apply_chat_template(tokenize=True): the template writes them). Straight from
        the fast tokenizer's backend where that is the same call transformers makes (no
        truncation or padding set on it): transformers' per-row conversion of the result cost
        a third of the tokenization here."""
        if self._backend is not None:
            encodings = self._backend.encode_batch(texts, add_special_tokens=False)
            return [e.ids for e in encodings], encodings if offsets else []
        out = self.tok(texts, add_special_tokens=False, return_offsets_mapping=offsets)
        return out["input_ids"], out["offset_mapping"] if offsets else []

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"] if texts else []

    def _encode_marked(self, rows: list[Row]) -> list[Any]:
        """transformers' assistant masks; rows without tools in one call (its batch takes one
        `tools` for every conversation), each row with tools on its own."""
        results: list[Any] = [""] * len(rows)
        plain = [i for i, r in enumerate(rows) if r.tools is None]
        try:
            for i, result in zip(plain, self._apply_marked([rows[i] for i in plain]), strict=True):
                results[i] = result
            done = set(plain)
        except Exception:  # one row's template error fails the batch: find it row by row
            done = set()
        for i, row in enumerate(rows):
            if i in done:
                continue
            try:
                results[i] = self._apply_marked([row], row.tools)[0]
            except Exception as exc:  # a template is user code; its errors are the row's
                results[i] = f"chat template error: {exc}"
        return results

    def _apply_marked(
        self, rows: list[Row], tools: list[dict[str, Any]] | None = None
    ) -> list[tuple[list[int], list[int]]]:
        if not rows:
            return []
        out = self.tok.apply_chat_template(
            [for_template(r.messages or [], self.content_format) for r in rows],
            tools=tools,
            chat_template=self.template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            add_generation_prompt=False,
        )
        return list(zip(out["input_ids"], out["assistant_masks"], strict=True))
