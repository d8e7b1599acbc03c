"""What identifies the model a store was made from: the sha256 of its config.json and
tokenizer.json, and a fingerprint of its weights (a fine-tune keeps the base model's config,
tokenizer and file sizes). A store is never resumed, extended by a worker, or recomputed with a
model whose identity differs from its manifest's.

The weights fingerprint reads a fixed amount per weight file whatever its size: the first MiB
(for safetensors: the header, every tensor's name, dtype, shape and offsets) and 16 blocks of
64 KiB evenly spaced through the rest, 2 MiB per file (128 MiB for a checkpoint in 64 files). A
fine-tune or a re-quantisation changes essentially every weight, so every block differs. It is
an identity, not an integrity check: an edit confined to bytes between the blocks goes unseen.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
HEAD_BYTES = 1 << 20
BLOCKS = 16
BLOCK_BYTES = 64 << 10
VERSION = b"hsx-weights-fingerprint-1"  # bump if what is read changes


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files a server loads: those at the top of the model directory."""
    return sorted(p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def weights_fingerprint(model_dir: str | Path) -> str:
    """sha256 over each weight file's name, size, head and evenly spaced blocks."""
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    if not files:
        raise FileNotFoundError(
            f"{model_dir}: no weight files ({', '.join('*' + s for s in WEIGHT_SUFFIXES)})"
        )
    digest = hashlib.sha256(VERSION)
    for path in files:
        size = path.stat().st_size
        digest.update(f"\0{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            digest.update(f.read(HEAD_BYTES))
            rest = size - HEAD_BYTES
            if rest <= BLOCKS * BLOCK_BYTES:
                digest.update(f.read())  # small file: all of it
                continue
            for k in range(BLOCKS):
                f.seek(HEAD_BYTES + (rest - BLOCK_BYTES) * k // (BLOCKS - 1))
                digest.update(f.read(BLOCK_BYTES))
    return digest.hexdigest()


def sha256_file(path: str | Path) -> str:
    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def model_identity(model_dir: str | Path) -> dict[str, str]:
    """The manifest's identity fields for the model at `model_dir`."""
    model_dir = Path(model_dir)
    return {
        "model_config_hash": sha256_file(model_dir / "config.json"),
        "tokenizer_hash": sha256_file(model_dir / "tokenizer.json"),
        "weights_fingerprint": weights_fingerprint(model_dir),
    }


class RecordedIdentity(Protocol):
    """The identity a store recorded of its model: `model_identity`'s fields, as a manifest
    (hsx_store/format.py `Manifest`) holds them."""

    @property
    def model_config_hash(self) -> str: ...
    @property
    def tokenizer_hash(self) -> str: ...
    @property
    def weights_fingerprint(self) -> str | None: ...


def model_mismatches(model_dir: str | Path, manifest: RecordedIdentity) -> list[str]:
    """How the model at `model_dir` differs from the one that made the store, each naming the
    field; empty when it is the same model. A schema-2 store recorded no weights fingerprint:
    its weights cannot be told apart."""
    try:
        found = model_identity(model_dir)
    except OSError as exc:
        return [f"{model_dir}: cannot identify the model: {exc}"]
    return [
        f"{model_dir}: {key} {value[:12]} != the store's {stored[:12]}"
        for key, value in found.items()
        if (stored := getattr(manifest, key)) is not None and value != stored
    ]
