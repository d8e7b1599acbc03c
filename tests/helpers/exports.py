"""Exports in tests: what a trainer's own scan picks up, and bit-for-bit comparison with the
reader's samples."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import torch

from hsx_store.export.run import export as export_as_asked

FORMATS = ["specforge", "speculators"]


def export(url: str, out: Path, fmt: str, **kw) -> dict:
    """An export of these layout tests' stores, which hold no pre-norm state (speculators'
    refusal of such a store has its own test)."""
    return export_as_asked(url, out, fmt, allow_post_norm=fmt == "speculators", **kw)


def bits(t: torch.Tensor) -> np.ndarray:
    """Raw bits of a hidden-state tensor (bf16 viewed as int16), for bit-exact comparison."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def as_exported(fmt: str | None, t: torch.Tensor) -> torch.Tensor:
    """What the export holds of a reader tensor: SpecForge's is bf16, by an independent
    round-to-nearest-even cast (ml_dtypes) of a float32 store."""
    if fmt != "specforge" or t.dtype == torch.bfloat16:
        return t
    return torch.from_numpy(t.numpy().astype(ml_dtypes.bfloat16).view(np.int16)).view(
        torch.bfloat16
    )


def assert_same(got: dict, want: dict, fmt: str | None = None) -> None:
    """Every hidden state `got` holds (a reader's sample, or an export's: the aux state and
    one final state, under the reader's name for it) as `want` has it, as `fmt` exports it."""
    assert got["sample_id"] == want["sample_id"]
    for key in ("input_ids", "loss_mask"):
        assert got[key].dtype == torch.int64 and torch.equal(got[key], want[key]), key
    hidden = [k for k in got if k.endswith("hidden_states")]
    assert "aux_hidden_states" in hidden and len(hidden) >= 2, hidden
    for key in hidden:
        expected = as_exported(fmt, want[key])
        assert got[key].dtype == expected.dtype and got[key].shape == expected.shape, key
        np.testing.assert_array_equal(bits(got[key]), bits(expected), err_msg=key)


def exported_files(out: Path, fmt: str) -> list[Path]:
    """The files each trainer's own scan picks up: SpecForge walks for *.ckpt (and .ckpt.gz),
    speculators looks up hs_<i>.safetensors (and its offline.py lists hs_*.safetensors)."""
    if fmt == "specforge":
        return sorted(p for p in out.rglob("*") if p.name.endswith((".ckpt", ".ckpt.gz")))
    return sorted(p for p in (out / "hidden_states").iterdir() if p.name.startswith("hs_"))
