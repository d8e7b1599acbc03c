"""`python -m cluster export` (its parser: cluster/cli.py): an export, its errors printed, as
an exit status."""

from __future__ import annotations

import sys

from hsx_store.export.base import ExportError
from hsx_store.export.run import export
from hsx_store.format import StoreFormatError
from hsx_store.location import StoreAccessError
from hsx_store.reader import COMPLETE


def export_command(
    url: str, fmt: str, out: str, *, allow_post_norm: bool, follow: bool, poll_s: float
) -> int:
    """Exit 0 once every committed sample is exported, 2 when the store cannot be opened, 1 on
    any other error (printed). Following: exit 0 once the job is complete and every sample
    exported, 1 when following ended short of that (said)."""
    try:
        summary = export(
            url,
            out,
            fmt,
            allow_post_norm=allow_post_norm,
            say=lambda text: print(text, flush=True),
            follow=follow,
            poll_s=poll_s,
        )
    except (StoreFormatError, StoreAccessError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (ExportError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 1 if follow and summary["ended"] != COMPLETE else 0
