"""The planner's inputs: paths resolved to formats, split into parts, and each part's raw rows.

A part is a slice of one input that a planning task reads on its own: a byte range of a JSONL
file (the lines that start in it), a range of Parquet row groups, or a range of rows of a saved
datasets directory. Parts depend only on the input (never on how many planners run), so the
plan is the same whatever the parallelism. A part's rows are numbered within it; the caller,
which sees the parts in order, turns those numbers into the input's row numbers.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from cluster.config import DataConfig
from cluster.conversation import SHAREGPT_SYSTEM_FIELD
from cluster.row_values import RowValueError, load_json
from hsx_store.model_identity import sha256_file

PART_BYTES = 4 << 20  # of a JSONL file per part
PART_ROWS = 4096  # of Parquet (at least, in whole row groups) or of a datasets directory
_BATCH = 1024  # rows per Arrow record batch


class PlanError(ValueError):
    """The input as a whole is unusable (a bad path, format, template file or model)."""


@dataclass(frozen=True)
class Source:
    path: Path
    format: str  # jsonl | parquet | hf


@dataclass(frozen=True)
class Part:
    source: int  # index into data.paths
    path: Path
    format: str
    begin: int  # JSONL: byte offset; else: row (Parquet: row group) index
    end: int


# (row number within the part: 1-based line for JSONL, 0-based row otherwise; the row; a reason
# when the row could not even be parsed)
RawRow = tuple[int, Any, str | None]


def resolve_source(path_str: str, fmt: str) -> Source:
    path = Path(path_str).resolve()
    if not path.exists():
        raise PlanError(f"input path {path_str} does not exist")
    if fmt == "auto":
        suffix = Path(path_str).suffix.lower()  # as named: a hub snapshot's link has one
        if path.is_dir():
            fmt = "hf"
        elif suffix in (".jsonl", ".json"):
            fmt = "jsonl"
        elif suffix == ".parquet":
            fmt = "parquet"
        else:
            raise PlanError(
                f"input path {path_str}: cannot tell its format from the name "
                "(.jsonl, .json, .parquet or a datasets directory); set data.format"
            )
    if (fmt == "hf") != path.is_dir():
        kind = "a directory" if path.is_dir() else "a file"
        raise PlanError(f"input path {path_str} is {kind}, which format {fmt} cannot read")
    return Source(path, fmt)


def split_parts(sources: list[Source], data: DataConfig) -> Iterator[Part]:
    for index, src in enumerate(sources):
        try:
            if src.format == "jsonl":
                size = src.path.stat().st_size
                bounds = [*range(0, size, PART_BYTES), size]
            elif src.format == "parquet":
                bounds = _row_group_bounds(src.path)
            else:
                rows = len(load_hf(src.path, data))
                bounds = [*range(0, rows, PART_ROWS), rows]
        except (OSError, pa.ArrowException) as exc:
            raise PlanError(f"cannot read {src.path}: {exc}") from exc
        for begin, end in itertools.pairwise(bounds):
            yield Part(index, src.path, src.format, begin, end)


def _row_group_bounds(path: Path) -> list[int]:
    """Row group indices cutting the file into parts of at least PART_ROWS rows."""
    meta = _parquet(path).metadata
    bounds, rows = [0], 0
    for group in range(meta.num_row_groups):
        rows += meta.row_group(group).num_rows
        if rows >= PART_ROWS:
            bounds.append(group + 1)
            rows = 0
    if bounds[-1] != meta.num_row_groups:
        bounds.append(meta.num_row_groups)
    return bounds


def read_part(part: Part, data: DataConfig) -> tuple[Iterator[RawRow], int]:
    """The part's rows, and how many row numbers it spans (JSONL: its lines, blank ones too)."""
    try:
        if part.format == "jsonl":
            return _read_jsonl(part)
        if part.format == "parquet":
            return _read_parquet(part, data)
        return _read_hf(part, data)
    except (OSError, pa.ArrowException) as exc:  # e.g. a truncated or corrupt file
        raise PlanError(f"cannot read {part.path}: {exc}") from exc


def _read_jsonl(part: Part) -> tuple[Iterator[RawRow], int]:
    # Bytes, so that one bad line is one reject rather than a decode error for the whole file.
    lines: list[bytes] = []
    with part.path.open("rb") as f:
        if part.begin > 0:
            f.seek(part.begin - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line that started before the part is the previous part's
        while f.tell() < part.end and (raw := f.readline()):
            lines.append(raw)

    def rows() -> Iterator[RawRow]:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                first_line = part.begin == 0 and number == 1
                text = raw.decode("utf-8-sig" if first_line else "utf-8")
            except UnicodeDecodeError:
                yield number, None, "not valid UTF-8"
                continue
            try:
                value, reason = load_json(text), None
            except RowValueError as exc:
                value, reason = None, f"malformed JSON: {exc}"
            yield number, value, reason

    return rows(), len(lines)


def _wanted_columns(names: Iterable[str], data: DataConfig) -> list[str]:
    wanted = (
        data.id_field,
        data.text_field,
        data.messages_field,
        data.conversations_field,
        data.tools_field,
        SHAREGPT_SYSTEM_FIELD,
    )
    return [n for n in names if n in wanted]


def _parquet(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:  # ArrowInvalid: not a Parquet file
        raise PlanError(f"cannot read {path} as Parquet: {exc}") from exc


def _read_parquet(part: Part, data: DataConfig) -> tuple[Iterator[RawRow], int]:
    pf = _parquet(part.path)
    groups = list(range(part.begin, part.end))
    count = sum(pf.metadata.row_group(g).num_rows for g in groups)
    columns = _wanted_columns(pf.schema_arrow.names, data)
    batches = pf.iter_batches(batch_size=_BATCH, row_groups=groups, columns=columns)
    return _numbered(batches), count


def load_hf(path: Path, data: DataConfig) -> Any:
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


def _read_hf(part: Part, data: DataConfig) -> tuple[Iterator[RawRow], int]:
    ds = load_hf(part.path, data)
    ds = ds.select_columns(_wanted_columns(ds.column_names, data))
    # Arrow slices straight from the memory-mapped table (indices mapping respected).
    table = ds.with_format("arrow")[part.begin : part.end]
    return _numbered(table.to_batches(_BATCH)), part.end - part.begin


def _numbered(batches: Iterable[pa.RecordBatch]) -> Iterator[RawRow]:
    """Columnar rows as a JSON line would hold them: Arrow gives every struct every key of its
    column, null where a row has none (a tool's schema would gain null properties)."""
    index = 0
    for batch in batches:
        for row in batch.to_pylist():
            try:
                value, reason = without_nulls(row), None
            except RecursionError:  # a column nested deeper than the stack
                value, reason = None, "row nested too deep to read"
            yield index, value, reason
            index += 1


def without_nulls(value: Any) -> Any:
    """`value` with null object members dropped, at every depth."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def sha256_source(path: Path) -> str:
    """Of a file's bytes; of a dataset directory, of every file in it by relative path."""
    if not path.is_dir():
        return sha256_file(path)
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(file.relative_to(path).as_posix().encode() + b"\0")
        h.update(bytes.fromhex(sha256_file(file)))
    return h.hexdigest()


def source_hashes(data: DataConfig) -> list[str]:
    """The sha256 of each input (`plan.sources`' `sha256`) without planning: what a resume
    compares with the job that made the store."""
    hashes = []
    for src in (resolve_source(p, data.format) for p in data.paths):
        try:
            hashes.append(sha256_source(src.path))
        except OSError as exc:
            raise PlanError(f"cannot read {src.path}: {exc}") from exc
    return hashes
