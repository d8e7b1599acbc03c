"""The planning step: turn the prompt data named by `DataConfig` into tokenized samples and rejects.

    plan = build_plan(config.data, config.model.path)

`source_hashes(data)` and `chat_template_text(data, model_path)` give the sources' sha256 and
`plan.chat_template` without planning, for resume checks.

Nothing here raises for a bad row: every row is either accepted (`plan.sample_ids`,
`plan.input_ids`, `plan.loss_masks`, in input order) or rejected with a reason (`plan.rejected`,
in input order). `PlanError` is only for an unusable input as a whole: a missing path, a format
that cannot be told or read, a missing chat template file, a model without tokenizer/config.json.

## Inputs

`data.paths` are read in order. `data.format: auto` tells each path's format by its name:
`.jsonl` / `.json` (JSON Lines, one object per line, not a JSON array), `.parquet`, or a directory
written by `datasets` `save_to_disk` (`hf`: a Dataset, or a DatasetDict from which `data.split` is
taken). JSONL is read as bytes line by line (blank lines are not rows); Parquet in record batches
with only the id/text/messages columns; HF datasets memory-mapped through `load_from_disk`, so
memory stays bounded by the tokenized output. `plan.sources` records each path with its format,
row count and SHA-256 (of the file; of a dataset directory: of every file in it, by relative path)
so a resumed job can tell that its input changed.

## Rows and sample ids

A row holds exactly one of
- `text_field` (default `text`): a string, tokenized with the model's tokenizer and its special
  tokens (`add_special_tokens=True`); or
- `messages_field` (default `messages`): a non-empty list of `{"role": str, "content": str}`,
  rendered with the chat template (`add_generation_prompt=False`) and tokenized without adding
  special tokens (the template writes them). Other message keys are passed to the template;
  keys whose value is null are dropped, since Parquet / HF datasets give every message every key
  of the column's struct.

A null field counts as absent (columnar formats have every column in every row).

The sample id is `row[id_field]` (default `id`; a string or an integer, written as a string) or,
when the row has none, `"<file name>:<row>"` where row is the 1-based line number for JSONL and
the 0-based row index for Parquet and HF datasets (the dataset directory's name stands for the
file name). Rejected rows are reported under the same id, or under `"<file name>:<row>"` when the
id itself is unusable. An id belongs to the first row that carries it, accepted or not: a later
row with the same id is rejected, so ids are unique across accepted and rejected rows.

## Loss masks

One uint8 per token. `loss_mask: all`: every token is 1. `loss_mask: assistant` (default): text
rows are all 1; chat rows have 1 on the assistant turns only, found one of two ways:
- the template has `{% generation %}` markers (and the tokenizer is a fast one): transformers'
  `apply_chat_template(..., return_assistant_tokens_mask=True)`, i.e. every token that overlaps
  a generation block (typically the content and the end-of-turn token);
- otherwise by prefix differences: for each assistant turn k, the tokens between the rendering of
  `messages[:k]` with the generation prompt and the rendering of `messages[:k+1]` (typically the
  content and the end-of-turn token, not the role header). This is only sound when each of these
  renderings is a token prefix of the full conversation's; templates that render earlier turns
  differently once later turns follow (e.g. ones that drop the reasoning of earlier assistant
  turns) fail that check and the row is rejected (see below): the fix is `loss_mask: all` or a
  template file (`data.chat_template`) with `{% generation %}` markers.

## Reject reasons

Field names below are the configured ones (`id`, `text`, `messages` by default); `<type>` is
`null`, `bool`, `int`, `float`, `string`, `list` or `object`.

| reason | when |
|---|---|
| `not valid UTF-8` | a JSONL line is not UTF-8 |
| `malformed JSON: <json error>` | a JSONL line is not JSON |
| `row must be a JSON object, got <type>` | a JSONL line holds e.g. a list |
| `id must be a string or an integer, got <type>` | |
| `id is an empty string` | |
| `duplicate sample id (first seen at <file>:<row>)` | an earlier row has the same id |
| `row has both text and messages` | |
| `row has neither text nor messages` | |
| `text must be a string, got <type>` | |
| `empty text` | |
| `text is only whitespace` | |
| `messages must be a list, got <type>` | |
| `empty messages` | |
| `messages[i] must be an object, got <type>` | |
| `messages[i].role must be a string, got <type>` | (checked before content) |
| `messages[i].content must be a string, got <type>` | e.g. a list of content parts |
| `messages[i].role <role> is not one of data.roles [...]` | a role the job does not allow |
| `the model has no chat template; set data.chat_template` | a chat row, no template |
| `chat template error: <error>` | the template raised (e.g. roles must alternate) |
| `no assistant turn to train on` | `loss_mask: assistant`, no role `assistant` |
| `the chat template does not render assistant turns as a prefix-stable suffix; ...` (*) | |
| `the chat template marks no assistant tokens` | `loss_mask: assistant`, an all-0 mask |
| `zero tokens` | the tokenizer produced no token |
| `<n> tokens > max_length <m>` | too long; prompts are never truncated |
| `token id <i> is outside the model's vocabulary [0, <v>)` | a token the embedding lacks |

(*) in full: `the chat template does not render assistant turns as a prefix-stable suffix; cannot
mark assistant tokens (use loss_mask: all or a template with {% generation %} markers)`; see
"Loss masks" above.

The vocabulary size is `text_config.vocab_size` of the model's config.json if present, else
`vocab_size`: a tokenizer's added tokens can lie beyond the embedding.

Rows are tokenized in batches of `BATCH_ROWS` with the fast tokenizer's batch call.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from cluster.config import DataConfig
from store.model_identity import sha256_file

log = logging.getLogger("cluster.plan")

BATCH_ROWS = 1000  # rows per tokenizer batch call
_PARQUET_BATCH = 1024  # rows per Parquet record batch

NO_TEMPLATE = "the model has no chat template; set data.chat_template"
NO_ASSISTANT = "no assistant turn to train on"
NO_MASKED_TOKENS = "the chat template marks no assistant tokens"
PREFIX_UNSTABLE = (
    "the chat template does not render assistant turns as a prefix-stable suffix; cannot mark "
    "assistant tokens (use loss_mask: all or a template with {% generation %} markers)"
)
# The same test transformers uses to decide whether a template can return an assistant mask.
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class Plan:
    sample_ids: list[str]
    input_ids: list[np.ndarray]  # int32, one per accepted sample, in input order
    loss_masks: list[np.ndarray]  # uint8, same lengths
    rejected: list[dict[str, str]]  # {"sample_id", "reason"} per rejected row, in input order
    sources: list[dict[str, Any]]  # per input path: path, format, sha256, rows
    chat_template: str | None  # the template text used for chat rows; None: none available

    @property
    def total_tokens(self) -> int:
        return sum(len(ids) for ids in self.input_ids)


class PlanError(ValueError):
    """The input as a whole is unusable (a bad path, format, template file or model)."""


@dataclass
class _Row:
    """One input row after parsing: a reject reason, or text, or messages."""

    sample_id: str
    reason: str | None = None
    text: str | None = None
    messages: list[dict[str, Any]] | None = None


# (location "<file name>:<row>", the row, a reason when the row could not even be parsed)
_RawRow = tuple[str, Any, str | None]
_Encoded = tuple[list[int], list[int] | None]  # token ids, loss mask (None: all ones)


def build_plan(data: DataConfig, model_path: str | Path, trust_remote_code: bool = False) -> Plan:
    sources = [_resolve_source(p, data.format) for p in data.paths]
    tokenizer = _load_tokenizer(model_path, trust_remote_code)
    template = _chat_template(data.chat_template, tokenizer)
    encoder = _Encoder(tokenizer, template, data, _vocab_size(Path(model_path)))

    source_info: list[dict[str, Any]] = []
    rows = _parse_rows(_read_sources(sources, data, source_info), data)
    sample_ids: list[str] = []
    input_ids: list[np.ndarray] = []
    loss_masks: list[np.ndarray] = []
    rejected: list[dict[str, str]] = []
    while chunk := list(islice(rows, BATCH_ROWS)):
        for row, result in zip(chunk, encoder.encode(chunk), strict=True):
            if isinstance(result, str):
                rejected.append({"sample_id": row.sample_id, "reason": result})
            else:
                sample_ids.append(row.sample_id)
                input_ids.append(result[0])
                loss_masks.append(result[1])
    plan = Plan(sample_ids, input_ids, loss_masks, rejected, source_info, template)
    log.info(
        "plan: %d samples accepted, %d rejected, %d tokens",
        len(sample_ids),
        len(rejected),
        plan.total_tokens,
    )
    return plan


# ---------------------------------------------------------------------------------------------
# Inputs


def _resolve_source(path_str: str, fmt: str) -> tuple[Path, str]:
    path = Path(path_str).resolve()
    if not path.exists():
        raise PlanError(f"input path {path_str} does not exist")
    if fmt == "auto":
        if path.is_dir():
            fmt = "hf"
        elif path.suffix.lower() in (".jsonl", ".json"):
            fmt = "jsonl"
        elif path.suffix.lower() == ".parquet":
            fmt = "parquet"
        else:
            raise PlanError(
                f"input path {path_str}: cannot tell its format from the name "
                "(.jsonl, .json, .parquet or a datasets directory); set data.format"
            )
    if (fmt == "hf") != path.is_dir():
        kind = "a directory" if path.is_dir() else "a file"
        raise PlanError(f"input path {path_str} is {kind}, which format {fmt} cannot read")
    return path, fmt


def _read_sources(
    sources: list[tuple[Path, str]], data: DataConfig, info: list[dict[str, Any]]
) -> Iterator[_RawRow]:
    """All rows of all sources in order; appends each source's record to `info` when read."""
    readers: dict[str, Callable[[Path, DataConfig], Iterator[_RawRow]]] = {
        "jsonl": _read_jsonl,
        "parquet": _read_parquet,
        "hf": _read_hf,
    }
    for path, fmt in sources:
        count = 0
        try:
            for item in readers[fmt](path, data):
                count += 1
                yield item
            info.append(_source_record(path, fmt, count))
        except (OSError, pa.ArrowException) as exc:  # e.g. a truncated or corrupt file
            raise PlanError(f"cannot read {path}: {exc}") from exc


def _source_record(path: Path, fmt: str, rows: int) -> dict[str, Any]:
    return {"path": str(path), "format": fmt, "sha256": _sha256(path), "rows": rows}


def source_hashes(data: DataConfig) -> list[str]:
    """The sha256 of each input (`plan.sources`' `sha256`) without planning: what a resume
    compares with the job that made the store."""
    hashes = []
    for path, _ in (_resolve_source(p, data.format) for p in data.paths):
        try:
            hashes.append(_sha256(path))
        except OSError as exc:
            raise PlanError(f"cannot read {path}: {exc}") from exc
    return hashes


def _read_jsonl(path: Path, data: DataConfig) -> Iterator[_RawRow]:
    # Bytes, so that one bad line is one reject rather than a decode error for the whole file.
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            loc = f"{path.name}:{line_no}"
            try:
                text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError:
                yield loc, None, "not valid UTF-8"
                continue
            try:
                yield loc, json.loads(text), None
            except json.JSONDecodeError as exc:
                yield loc, None, f"malformed JSON: {exc}"


def _wanted_columns(names: Iterable[str], data: DataConfig) -> list[str]:
    wanted = (data.id_field, data.text_field, data.messages_field)
    return [n for n in names if n in wanted]


def _read_parquet(path: Path, data: DataConfig) -> Iterator[_RawRow]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:  # ArrowInvalid: not a Parquet file
        raise PlanError(f"cannot read {path} as Parquet: {exc}") from exc
    columns = _wanted_columns(pf.schema_arrow.names, data)
    index = 0
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, columns=columns):
        for row in batch.to_pylist():
            yield f"{path.name}:{index}", row, None
            index += 1


def _load_hf(path: Path, data: DataConfig) -> Any:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise PlanError(f"cannot load {path} as a saved datasets directory: {exc}") from exc
    if isinstance(ds, datasets.DatasetDict):
        if data.split not in ds:
            raise PlanError(f"{path}: no split {data.split!r} (splits: {', '.join(ds)})")
        ds = ds[data.split]
    return ds


def _read_hf(path: Path, data: DataConfig) -> Iterator[_RawRow]:
    ds = _load_hf(path, data)
    ds = ds.select_columns(_wanted_columns(ds.column_names, data))
    index = 0
    # Arrow batches straight from the memory-mapped table (indices mapping respected).
    for batch in ds.with_format("arrow").iter(batch_size=BATCH_ROWS):
        for row in batch.to_pylist():
            yield f"{path.name}:{index}", row, None
            index += 1


def _sha256(path: Path) -> str:
    """Of a file's bytes; of a dataset directory, of every file in it by relative path."""
    return _sha256_dir(path) if path.is_dir() else sha256_file(path)


def _sha256_dir(path: Path) -> str:
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(file.relative_to(path).as_posix().encode() + b"\0")
        h.update(bytes.fromhex(sha256_file(file)))
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Rows


def _type_name(value: Any) -> str:
    names = {type(None): "null", dict: "object", str: "string"}
    return names.get(type(value), type(value).__name__)


def _parse_rows(raw_rows: Iterable[_RawRow], data: DataConfig) -> Iterator[_Row]:
    """Ids, duplicates and field checks; `first_seen` maps an id to its first row's location."""
    first_seen: dict[str, str] = {}
    for loc, value, reason in raw_rows:
        if reason is None and not isinstance(value, dict):
            reason = f"row must be a JSON object, got {_type_name(value)}"
        sample_id = loc
        if reason is None:
            sample_id, reason = _sample_id(value, data.id_field, loc)
        if sample_id in first_seen:
            yield _Row(sample_id, f"duplicate sample id (first seen at {first_seen[sample_id]})")
            continue
        first_seen[sample_id] = loc
        yield _Row(sample_id, reason) if reason else _parse_content(sample_id, value, data)


def _sample_id(row: dict[str, Any], id_field: str, loc: str) -> tuple[str, str | None]:
    value = row.get(id_field)
    if value is None:
        return loc, None
    if isinstance(value, bool) or not isinstance(value, str | int):
        return loc, f"{id_field} must be a string or an integer, got {_type_name(value)}"
    if value == "":
        return loc, f"{id_field} is an empty string"
    return str(value), None


def _parse_content(sample_id: str, row: dict[str, Any], data: DataConfig) -> _Row:
    tf, mf = data.text_field, data.messages_field
    text, messages = row.get(tf), row.get(mf)
    if text is not None and messages is not None:
        return _Row(sample_id, f"row has both {tf} and {mf}")
    if text is None and messages is None:
        return _Row(sample_id, f"row has neither {tf} nor {mf}")
    if text is not None:
        if not isinstance(text, str):
            return _Row(sample_id, f"{tf} must be a string, got {_type_name(text)}")
        if not text or text.isspace():
            return _Row(sample_id, "text is only whitespace" if text else "empty text")
        return _Row(sample_id, text=text)
    reason = _check_messages(messages, mf, data.roles)
    if reason:
        return _Row(sample_id, reason)
    return _Row(
        sample_id, messages=[{k: v for k, v in m.items() if v is not None} for m in messages]
    )


def _check_messages(messages: Any, mf: str, roles: list[str]) -> str | None:
    if not isinstance(messages, list):
        return f"{mf} must be a list, got {_type_name(messages)}"
    if not messages:
        return "empty messages"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"{mf}[{i}] must be an object, got {_type_name(message)}"
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return f"{mf}[{i}].{key} must be a string, got {_type_name(message.get(key))}"
        if message["role"] not in roles:
            return f"{mf}[{i}].role {message['role']!r} is not one of data.roles {roles}"
    return None


# ---------------------------------------------------------------------------------------------
# Model


def _load_tokenizer(model_path: str | Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot load the tokenizer of {model_path}: {exc}") from exc


def _vocab_size(model_path: Path) -> int:
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
        return _chat_template(data.chat_template, None)
    return _chat_template("model", _load_tokenizer(model_path, trust_remote_code))


def _chat_template(setting: str, tokenizer: Any) -> str | None:
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


# ---------------------------------------------------------------------------------------------
# Tokenization and checks


class _Encoder:
    """Tokenizes a chunk of parsed rows; each result is (ids, mask) arrays or a reject reason."""

    def __init__(self, tokenizer: Any, template: str | None, data: DataConfig, vocab: int):
        self.tok = tokenizer
        self.template = template
        self.assistant_only = data.loss_mask == "assistant"
        self.max_length = data.max_length
        self.vocab = vocab
        # char_to_token, which the transformers mask relies on, needs a fast tokenizer.
        self.use_markers = bool(
            template and _GENERATION_TAG.search(template) and getattr(tokenizer, "is_fast", False)
        )

    def encode(self, rows: list[_Row]) -> list[tuple[np.ndarray, np.ndarray] | str]:
        results: list[_Encoded | str] = [r.reason or "" for r in rows]  # "": filled in below
        texts = [i for i, r in enumerate(rows) if r.text is not None]
        chats = [i for i, r in enumerate(rows) if r.messages is not None]
        if texts:
            ids = self.tok([rows[i].text for i in texts], add_special_tokens=True)["input_ids"]
            for i, row_ids in zip(texts, ids, strict=True):
                results[i] = (row_ids, None)
        for i, result in zip(
            chats, self._encode_chats([rows[i].messages for i in chats]), strict=True
        ):
            results[i] = result
        return [r if isinstance(r, str) else self._check(*r) for r in results]

    def _check(self, ids: list[int], mask: list[int] | None) -> tuple[np.ndarray, np.ndarray] | str:
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

    def _encode_chats(self, convs: list[list[dict[str, Any]]]) -> list[_Encoded | str]:
        if self.template is None:
            return [NO_TEMPLATE] * len(convs)
        if not self.assistant_only:
            return self._encode_whole(convs)
        results: list[_Encoded | str] = [NO_ASSISTANT] * len(convs)
        todo = [i for i, c in enumerate(convs) if any(m["role"] == "assistant" for m in c)]
        encode = self._encode_marked if self.use_markers else self._encode_by_prefix
        for i, result in zip(todo, encode([convs[i] for i in todo]), strict=True):
            results[i] = result
        return results

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        if not messages:
            # apply_chat_template refuses an empty conversation, yet the generation prompt of one
            # is what precedes an opening assistant turn; render it exactly as it would.
            from transformers.utils.chat_template_utils import render_jinja_template

            rendered, _ = render_jinja_template(
                conversations=[messages],
                chat_template=self.template,
                add_generation_prompt=generation_prompt,
                **self.tok.special_tokens_map,
            )
            return rendered[0]
        return self.tok.apply_chat_template(
            messages,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        # apply_chat_template(tokenize=True) also adds no special tokens: the template writes them.
        return self.tok(texts, add_special_tokens=False)["input_ids"] if texts else []

    def _encode_whole(self, convs: list[list[dict[str, Any]]]) -> list[_Encoded | str]:
        rendered: list[str | None] = []
        results: list[_Encoded | str] = []
        for conv in convs:
            try:
                rendered.append(self._render(conv, False))
                results.append("")
            except Exception as exc:  # a template is user code; its errors are the row's
                rendered.append(None)
                results.append(f"chat template error: {exc}")
        ok = [i for i, text in enumerate(rendered) if text is not None]
        for i, ids in zip(ok, self._tokenize([rendered[i] for i in ok]), strict=True):
            results[i] = (ids, None)
        return results

    def _encode_marked(self, convs: list[list[dict[str, Any]]]) -> list[_Encoded | str]:
        try:
            return list(self._apply_marked(convs))
        except Exception:  # one row's template error fails the batch: find it row by row
            pass
        results: list[_Encoded | str] = []
        for conv in convs:
            try:
                results.extend(self._apply_marked([conv]))
            except Exception as exc:  # a template is user code; its errors are the row's
                results.append(f"chat template error: {exc}")
        return results

    def _apply_marked(self, convs: list[list[dict[str, Any]]]) -> list[_Encoded]:
        out = self.tok.apply_chat_template(
            convs,
            chat_template=self.template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            add_generation_prompt=False,
        )
        return list(zip(out["input_ids"], out["assistant_masks"], strict=True))

    def _encode_by_prefix(self, convs: list[list[dict[str, Any]]]) -> list[_Encoded | str]:
        # Per conversation: the full rendering, then (before, after) per assistant turn.
        renders: list[list[str] | str] = []
        for conv in convs:
            try:
                texts = [self._render(conv, False)]
                for k, message in enumerate(conv):
                    if message["role"] == "assistant":
                        texts += [self._render(conv[:k], True), self._render(conv[: k + 1], False)]
                renders.append(texts)
            except Exception as exc:  # a template is user code; its errors are the row's
                renders.append(f"chat template error: {exc}")
        flat = [t for r in renders if not isinstance(r, str) for t in r]
        tokens = iter(self._tokenize(flat))
        results: list[_Encoded | str] = []
        for r in renders:
            if isinstance(r, str):
                results.append(r)
            else:
                results.append(_prefix_mask([next(tokens) for _ in r]))
        return results


def _prefix_mask(tokenized: list[list[int]]) -> _Encoded | str:
    """tokenized: the full conversation, then (before, after) token ids per assistant turn."""
    full = tokenized[0]
    mask = [0] * len(full)
    for before, after in zip(tokenized[1::2], tokenized[2::2], strict=True):
        stable = full[: len(before)] == before and full[: len(after)] == after
        if not stable or len(after) < len(before):
            return PREFIX_UNSTABLE
        mask[len(before) : len(after)] = [1] * (len(after) - len(before))
    return full, mask
