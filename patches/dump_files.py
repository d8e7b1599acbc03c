"""A dump on disk, and the consumer's side of it: how it is laid out, read and given back.

A dump is a directory ``root/<name>`` holding ``tensors.safetensors`` (stock safetensors, data
page-aligned) and ``meta.json``. Every dot-prefixed entry under ``root`` is private to the writer,
which publishes a dump with one ``os.rename`` so a reader never sees a partial one. A ring dump's
file spans a whole pinned region: one trailing ``__pad__`` (uint8) tensor covers what the real
tensors leave, and ``read_dump`` hides it.

Consumers (node worker, tests, demo) import only this module: not the writer's machinery, and
not sglang (it is loaded inside the server and by offline readers alike).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import uuid
import weakref
from pathlib import Path
from typing import Protocol

import torch

TensorSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype)

# What a dump's meta.json says about itself; the cluster plans and checks against the same words.
DUMP_FORMAT = "hidden-capture-dump"
# 2: meta "quantized" ("fp8_e4m3": hidden states as e4m3 values plus `<name>_scale` tensors)
DUMP_FORMAT_VERSION = 2

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
# Data starts page-aligned (the header is padded with spaces, which safetensors allows), so every
# tensor is as aligned as its offset within the data allows.
ALIGN = 4096
PAD_KEY = "__pad__"  # ring dumps: uint8 tensor filling the region after the real tensors
RING_DIR = ".ring"  # under root: the ring's free regions, where release_dump returns files
TMP_PREFIX = ".tmp-"  # a dump being written; renamed to its name once published
POOL_PREFIX = ".pool-"  # a writer's preallocated files, not yet a dump


class _ReleaseListener(Protocol):
    root: Path

    def poke(self) -> None: ...


# Live ring writers of this process. release_dump pokes the one on the dump's root so that it
# reuses the region at once instead of at its next scan; the writer adds itself here, which keeps
# this module free of the writer's machinery.
RING_WRITERS: weakref.WeakSet[_ReleaseListener] = weakref.WeakSet()


def layout(
    tensors: TensorSpecs, pad_to: int | None = None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Safetensors header (length prefix included) and each tensor's (start, end) in the file.

    With ``pad_to``, a uint8 ``__pad__`` tensor follows the real ones so that the file is exactly
    ``pad_to`` bytes long (``ValueError`` if they do not fit)."""
    entries: dict[str, dict] = {}
    spans: dict[str, tuple[int, int]] = {}
    off = 0
    for key, (shape, dtype) in tensors.items():
        if key == PAD_KEY:
            raise ValueError(f"{PAD_KEY} is reserved")
        n = math.prod(shape) * dtype.itemsize
        if off % dtype.itemsize:  # typed views need it; safetensors' own writer sorts for it
            raise ValueError(
                f"{key} starts at data offset {off}, not a multiple of its itemsize; "
                "order tensors by decreasing itemsize"
            )
        entries[key] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [off, off + n],
        }
        spans[key] = (off, off + n)
        off += n

    def encode(pad: int | None) -> bytes:
        e = entries
        if pad is not None:
            e = entries | {
                PAD_KEY: {"dtype": "U8", "shape": [pad], "data_offsets": [off, off + pad]}
            }
        h = json.dumps(e, separators=(",", ":")).encode()
        return h + b" " * ((-(8 + len(h))) % ALIGN)

    if pad_to is None:
        hdr = encode(None)
    else:
        pad = pad_to  # as many digits as any real pad: the header can only shrink from here
        for _ in range(4):
            hdr = encode(pad)
            new = pad_to - 8 - len(hdr) - off
            if new < 0:
                raise ValueError(f"dump needs {8 + len(hdr) + off} bytes, region has {pad_to}")
            if new == pad:
                break
            pad = new
        else:  # pragma: no cover - the padded header length converges in two steps
            raise AssertionError("header length did not converge")
    base = 8 + len(hdr)
    spans = {k: (s + base, e + base) for k, (s, e) in spans.items()}
    return len(hdr).to_bytes(8, "little") + hdr, spans


def ring_file_size(tensors: TensorSpecs) -> int:
    """Smallest region that holds these tensors plus a ``__pad__`` entry of any length."""
    header, spans = layout(tensors, 1 << 62)  # 19-digit pad: the longest header
    return max([len(header), *(e for _, e in spans.values())])


def read_dump(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Load a published dump: its tensors (stock safetensors, no pickle) and its meta.

    The tensors map the file (no copy): with a ring writer they are valid until
    ``release_dump(path)``, after which the writer reuses the memory; clone what you keep."""
    from safetensors import safe_open

    path = Path(path)
    with safe_open(path / "tensors.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != PAD_KEY}  # noqa: SIM118
    return tensors, json.loads((path / "meta.json").read_text())


def release_dump(path: Path) -> None:
    """Done with a published dump: give its memory back to the writer and remove it.

    With a ring writer alive on the dump's root, the tensors file is renamed into ``.ring/``
    (same inode: the writer reuses its registered mapping); otherwise the dump is deleted. The dump
    directory is gone afterwards; tensors read from it must not be used any more. Safe to call
    from any process; a dump already gone is a no-op."""
    path = Path(path)
    root = path.parent
    ring = root / RING_DIR
    if ring.is_dir():
        # FileNotFoundError: dump gone, or the writer closed (its ring removed) meanwhile
        with contextlib.suppress(FileNotFoundError):
            os.rename(path / "tensors.safetensors", ring / f"free-{uuid.uuid4().hex}")
    shutil.rmtree(path, ignore_errors=True)
    if RING_WRITERS:
        try:
            key = os.stat(root)
        except FileNotFoundError:
            return
        for w in list(RING_WRITERS):
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.stat(w.root), key):
                    w.poke()


def clear_unpublished(root: Path) -> int:
    """Remove what dump writers that are gone left on `root` besides published dumps: dumps
    they never finished (``.tmp-*``), their preallocated files (``.pool-*``) and their free
    regions (``.ring``). Only while no writer is alive on `root`. Published dumps stay: their
    reader releases them. Returns how many entries were removed."""
    stale = [p for p in root.iterdir() if p.name.startswith((TMP_PREFIX, POOL_PREFIX, RING_DIR))]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return len(stale)
