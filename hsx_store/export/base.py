"""What a trainer format implements: the hooks `export` (run.py) calls as it walks a store's
committed samples. A format is one subclass in a module of its own, named in registry.py."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, ClassVar

from hsx_store.format import Manifest, Store


class ExportError(RuntimeError):
    """An export that cannot proceed (a concurrent export, a directory of unknown origin)."""


class ExportConflict(ExportError):
    """The output directory holds an export of another store, manifest or format."""


class TrainerFormat(ABC):
    """One trainer's offline format, as one export into `out` writes it: the store's
    `manifest`, and `last_slot`, the final state the format's last slot gets (what
    `check_store` returned)."""

    name: ClassVar[str]  # --format
    # How the reader hands over an FP8 store's states: "raw" (FP8 bits and their scales) or
    # "dequantize" (to bf16, exactly).
    fp8: ClassVar[str]

    def __init__(self, out: Path, manifest: Manifest, last_slot: str | None) -> None:
        self.out = out
        self.manifest = manifest
        self.last_slot = last_slot

    @staticmethod
    @abstractmethod
    def sample_path(out: Path, index: int) -> Path:
        """Where sample `index` (the store's global sample index) lives."""

    @classmethod
    @abstractmethod
    def check_store(cls, url: str, manifest: Manifest, allow_post_norm: bool) -> str | None:
        """Refuses (ExportError) what the trainer cannot train on correctly, before anything
        is written. Returns the final state the last slot gets ("pre_norm" / "post_norm"),
        None where the format has no choice to record."""

    @abstractmethod
    def hidden_dtype(self) -> str:
        """The dtype of the hidden states the files hold (export.json's hidden_dtype)."""

    @abstractmethod
    def layout(self) -> dict[str, str]:
        """export.json's description of the files (names, keys, shapes)."""

    @abstractmethod
    def notes(self) -> list[str]:
        """What the user is told before the samples (how to train on it; what was changed)."""

    def record_fields(self) -> dict[str, Any]:
        """Keys of its own export.json adds after the common ones (the trainer's command)."""
        return {}

    def plan_grew(self) -> None:
        """This directory was exported before the store's plan was complete (allowed once):
        what covers the whole plan is to be made again."""
        return None  # a format without such files: nothing

    def prepare(self, store: Store, say: Callable[[str], Any]) -> None:
        """Writes what the format holds beside the sample files, before them."""
        return None  # a format of sample files only: nothing

    @abstractmethod
    def encoder(self, sample: dict[str, Any]) -> Callable[[IO[bytes]], Any]:
        """The writer of one sample's file, from the reader's sample. The reader's tensors may
        view a whole read block: the file holds a copy of its own sample only."""

    @classmethod
    @abstractmethod
    def read_sample(cls, out: Path, index: int, last_slot: str | None) -> dict[str, Any]:
        """An exported sample read back in the reader's layout (but its sample_id): input_ids
        int64 [T], loss_mask int64 [T], aux_hidden_states [T, num_aux * H] and the final state
        [T, H] under the reader's name for it."""
