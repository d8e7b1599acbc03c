"""The errors of a store this code cannot read, below every module that raises them
(hsx_store/format.py, which the rest import them from, and hsx_store/images.py)."""

from __future__ import annotations


class StoreFormatError(ValueError):
    """The store is not one this code can read (wrong schema version, not a store, inconsistent)."""


class StoreIncomplete(StoreFormatError):
    """The store's creation was interrupted: its plan rows are not all written."""
