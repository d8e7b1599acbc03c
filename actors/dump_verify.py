"""Every dump is checked against the request it belongs to before a row of it is stored.

The dump counter alone is never trusted: the rid, the token ids, the row count, the cache
report and the values themselves must all agree with the planned sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from actors.calibration import Calibration
from store.format import Manifest


class DumpMismatch(ValueError):
    """The dump does not belong to, or does not fully describe, the planned sample."""


def verify_dump(
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    *,
    rid: str,
    input_ids: np.ndarray,
    cached_tokens: int,
    manifest: Manifest,
    calibration: Calibration,
) -> None:
    if meta.get("rid") != rid:
        raise DumpMismatch(f"dump belongs to rid {meta.get('rid')!r}, not {rid!r}")
    if int(meta.get("index", -1)) <= calibration.offset:
        raise DumpMismatch(
            f"dump index {meta.get('index')} is not after this server's calibration "
            f"({calibration.offset}): a stale dump"
        )
    if cached_tokens != 0:
        raise DumpMismatch(f"{cached_tokens} prompt tokens came from the prefix cache")
    p = len(input_ids)
    shapes = {
        "input_ids": (p,),
        "aux_hidden_states": (p, manifest.num_aux, manifest.hidden_size),
        "final_hidden_states": (p, manifest.hidden_size),
    }
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise DumpMismatch(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    if not np.array_equal(tensors["input_ids"].numpy(), input_ids):
        first = int(np.flatnonzero(tensors["input_ids"].numpy() != input_ids)[0])
        raise DumpMismatch(f"token ids differ from the plan from position {first}")
    if meta.get("layer_ids") != manifest.layer_ids:
        raise DumpMismatch(f"layers {meta.get('layer_ids')} != manifest {manifest.layer_ids}")
    for name in ("aux_hidden_states", "final_hidden_states"):
        if str(tensors[name].dtype).removeprefix("torch.") != manifest.dtype:
            raise DumpMismatch(f"{name} is {tensors[name].dtype}, the store holds {manifest.dtype}")
        finite = _finite(tensors[name])
        if not bool(finite.all()):
            row = int((~finite).reshape(p, -1).any(dim=1).nonzero()[0])
            raise DumpMismatch(f"{name} has non-finite values from token {row}")


def _finite(x: torch.Tensor) -> torch.Tensor:
    """isfinite; for bf16 read off the exponent bits: twice as fast as torch's bf16 path on CPU."""
    if x.dtype == torch.bfloat16:
        return (x.view(torch.int16) & 0x7F80) != 0x7F80
    return torch.isfinite(x)
