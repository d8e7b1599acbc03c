"""The trainer formats by --format name. A new format: a TrainerFormat subclass in a module of
its own (base.py names its hooks), added here."""

from __future__ import annotations

from hsx_store.export.base import TrainerFormat
from hsx_store.export.specforge import SpecForge
from hsx_store.export.speculators import Speculators

TRAINER_FORMATS: dict[str, type[TrainerFormat]] = {f.name: f for f in (SpecForge, Speculators)}
FORMATS: tuple[str, ...] = tuple(TRAINER_FORMATS)


def trainer_format(name: str) -> type[TrainerFormat]:
    try:
        return TRAINER_FORMATS[name]
    except KeyError:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {name!r}") from None
