"""Every dump is checked against the request it belongs to before a row of it is stored.

The dump counter alone is never trusted: the rid, the token ids, the row count, the cache
report and the values themselves must all agree with the planned sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from actors.calibration_result import Calibration
from actors.planned_sample import PlannedSample
from hsx_store.format import Manifest
from hsx_store.fp8 import invalid_rows, scale_name


class DumpMismatch(ValueError):
    """The dump does not belong to, or does not fully describe, the planned sample."""


def check_dump(
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    *,
    rid: str,
    sample: PlannedSample,
    cached_tokens: int,
    manifest: Manifest,
    calibration: Calibration,
) -> None:
    if meta.get("rid") != rid:
        raise DumpMismatch(f"dump belongs to rid {meta.get('rid')!r}, not {rid!r}")
    if calibration.precedes_probe(meta):
        raise DumpMismatch(
            f"dump index {meta.get('index')} is not after this server's calibration "
            f"({calibration.describe()}): a stale dump"
        )
    if cached_tokens != 0:
        raise DumpMismatch(f"{cached_tokens} prompt tokens came from the prefix cache")
    check_tokens(tensors, sample)
    if meta.get("layer_ids") != manifest.layer_ids:
        raise DumpMismatch(f"layers {meta.get('layer_ids')} != manifest {manifest.layer_ids}")
    check_states(tensors, meta, manifest, len(sample.input_ids))


def check_tokens(tensors: dict[str, torch.Tensor], sample: PlannedSample) -> None:
    """The dump's rows are the planned sample's: its token ids (SGLang's pad values in image
    spans) and, for an M-RoPE store, the positions the model used."""
    p = len(sample.input_ids)
    if "input_ids" not in tensors or tuple(tensors["input_ids"].shape) != (p,):
        got = tuple(tensors["input_ids"].shape) if "input_ids" in tensors else "no input_ids"
        raise DumpMismatch(f"input_ids: {got}, expected shape {(p,)}")
    _check_ids(tensors["input_ids"].numpy(), sample)
    if sample.position_ids is not None:
        _check_positions(tensors, sample.position_ids)


def _check_ids(dumped: np.ndarray, sample: PlannedSample) -> None:
    """The planned ids outside image spans; inside one, SGLang's pad values (derived from the
    image's content, never the image token): the image's embeddings sat exactly there."""
    planned = sample.input_ids
    in_image = np.zeros(len(planned), bool)
    for image in sample.images:
        span = slice(image.start, image.start + image.length)
        in_image[span] = True
        if (dumped[span] == planned[span]).any():
            row = image.start + int(np.flatnonzero(dumped[span] == planned[span])[0])
            raise DumpMismatch(
                f"row {row} holds the image token itself, not an image's embedding (image "
                f"{image.digest[:12]} planned at rows {span.start}..{span.stop - 1})"
            )
    differ = (dumped != planned) & ~in_image
    if differ.any():
        raise DumpMismatch(f"token ids differ from the plan from position {np.argmax(differ)}")


def _check_positions(tensors: dict[str, torch.Tensor], planned: np.ndarray) -> None:
    """The M-RoPE positions the model used are the planned ones."""
    got = tensors.get("mrope_positions")
    if got is None:
        raise DumpMismatch("the dump has no mrope_positions (the store keeps M-RoPE positions)")
    if tuple(got.shape) != planned.shape:
        raise DumpMismatch(f"mrope_positions: shape {tuple(got.shape)}, expected {planned.shape}")
    differ = (got.numpy() != planned).any(axis=1)
    if differ.any():
        raise DumpMismatch(f"M-RoPE positions differ from the plan from row {np.argmax(differ)}")


def check_states(
    tensors: dict[str, torch.Tensor], meta: dict[str, Any], manifest: Manifest, p: int
) -> None:
    """Every hidden array the store keeps is in the dump, for p tokens, in the served dtype
    and finite; or, quantized by the server for an FP8 store, as e4m3 values without NaN and
    float32 scales that are powers of two (hsx_store/fp8.py)."""
    quantized = meta.get("quantized")
    if quantized and quantized != manifest.dtype:
        raise DumpMismatch(
            f"the dump's rows are quantized as {quantized}, the store keeps {manifest.dtype}"
        )
    for name in manifest.hidden_arrays:
        rows = (p, manifest.num_aux) if name == "aux_hidden_states" else (p,)
        dtype = torch.float8_e4m3fn if quantized else getattr(torch, manifest.served_dtype)
        _expect(tensors, name, (*rows, manifest.hidden_size), dtype)
        if not quantized:
            row = _first_non_finite_row(tensors[name])
            if row is not None:
                raise DumpMismatch(f"{name} has non-finite values from token {row}")
            continue
        scale = scale_name(name)
        _expect(tensors, scale, rows, torch.float32)
        bad_values, bad_scales = invalid_rows(
            tensors[name].view(torch.uint8).numpy(), tensors[scale].numpy()
        )
        if bad_scales.any():
            row = int(np.flatnonzero(bad_scales)[0])
            raise DumpMismatch(f"{scale} at token {row} is not 0 or a finite power of two")
        if bad_values.any():
            row = int(np.flatnonzero(bad_values)[0])
            raise DumpMismatch(f"{name} has NaN (or non-finite once scaled) from token {row}")


def _expect(
    tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    if name not in tensors:
        raise DumpMismatch(f"the dump has no {name} (the store keeps it)")
    if tuple(tensors[name].shape) != shape:
        raise DumpMismatch(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    if tensors[name].dtype != dtype:
        raise DumpMismatch(f"{name} is {tensors[name].dtype}, expected {dtype} for this store")


# Float dtypes by their bits: (integer view, |x| mask, bits of +inf). Exponent all ones (inf or
# NaN) is exactly |bits| >= inf's bits.
_BITS = {
    torch.bfloat16: (np.int16, 0x7FFF, 0x7F80),
    torch.float32: (np.int32, 0x7FFFFFFF, 0x7F800000),
}
SCAN_BLOCK_BYTES = 1 << 20  # a block and its temporary stay in cache


def _first_non_finite_row(x: torch.Tensor) -> int | None:
    """The first row (dim 0) of `x` holding an inf or NaN, or None. Scans the bits in row blocks
    with numpy into one small reused temporary: ~1 MB extra instead of 1.5x the tensor (a
    whole-tensor mask), and ~20x faster on 2 cores than the torch mask (numpy runs each block
    on this thread: no intra-op barrier per block, which stalls on a busy machine)."""
    if x.numel() == 0:
        return None
    if x.dtype not in _BITS:
        finite = torch.isfinite(x).reshape(len(x), -1).all(dim=1)
        return None if bool(finite.all()) else int((~finite).nonzero()[0])
    int_type, mask, inf = _BITS[x.dtype]
    bits = x.contiguous().view(torch.int16 if int_type is np.int16 else torch.int32).numpy()
    bits = bits.reshape(len(x), -1)
    rows = max(1, SCAN_BLOCK_BYTES // max(1, bits.shape[1] * bits.itemsize))
    tmp = np.empty((min(rows, len(bits)), bits.shape[1]), int_type)
    for lo in range(0, len(bits), rows):
        block = tmp[: len(bits[lo : lo + rows])]
        np.bitwise_and(bits[lo : lo + rows], mask, out=block)
        if block.max() >= inf:
            return lo + int(np.flatnonzero((block >= inf).any(axis=1))[0])
    return None
