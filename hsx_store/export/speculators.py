"""vLLM speculators 0.9.0's offline format: a HF dataset of the plan's rows, `token_freq.pt`,
and a safetensors file per sample whose last slot is the pre-norm final state (a store without
it is refused unless `allow_post_norm`); an FP8 store in its FP8 format
(docs/using-the-data.md)."""

from __future__ import annotations

import functools
import os
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from hsx_store.export.base import ExportError, TrainerFormat
from hsx_store.export.files import tmp_name, write_atomic
from hsx_store.format import FINAL_STATE_ARRAYS, Manifest, Store
from hsx_store.fp8 import FP8_DTYPE, scale_name

SPECULATORS_SEQ_LEN = 8192  # speculators 0.9.0's --total-seq-len default
TOKEN_FREQ = "token_freq.pt"
TOKEN_COLUMNS = ("input_ids", "loss_mask")
ALLOW_POST_NORM_FLAG = "--allow-post-norm"


class Speculators(TrainerFormat):
    name = "speculators"
    fp8 = "raw"  # it has an FP8 format: the bits and their scales go as they are

    @staticmethod
    def sample_path(out: Path, index: int) -> Path:
        return out / "hidden_states" / f"hs_{index}.safetensors"

    @classmethod
    def check_store(cls, url: str, manifest: Manifest, allow_post_norm: bool) -> str | None:
        if "pre_norm" in manifest.final_states:
            return "pre_norm"
        if not allow_post_norm:
            raise ExportError(
                f"{url}: the store holds no pre-norm final state (final states "
                f"{manifest.final_states}); speculators builds its teacher as "
                f"lm_head(norm(last slot)), so the post-norm state would be normalized twice. "
                f"Capture again with store.prenorm: true, or pass {ALLOW_POST_NORM_FLAG} to "
                f"export the post-norm state anyway"
            )
        return "post_norm"

    def hidden_dtype(self) -> str:
        return self.manifest.dtype

    def layout(self) -> dict[str, str]:
        keys = "hidden_states [T,num_aux+1,H] (aux layers, then the final state of last_slot), "
        keys += "token_ids int64 [T]"
        if self.manifest.dtype == FP8_DTYPE:
            keys += ", hidden_states_scales float32 [T,num_aux+1,1] (hidden_states float8_e4m3fn)"
        return {
            "files": "hidden_states/hs_{index}.safetensors",
            "index": "the store's global sample index = the row of the dataset in this directory",
            "keys": keys,
            "dataset": "datasets.load_from_disk(DIR): input_ids, loss_mask, seq_len per planned "
            "sample",
            "token_freq": f"{TOKEN_FREQ}: {{token id: count}} over loss-masked tokens of every row",
        }

    def notes(self) -> list[str]:
        notes = [
            f"train with `{speculators_command(self.out, self.manifest)}` (speculators 0.9.0; "
            f"add --draft-vocab-size N to prune the draft vocabulary with {TOKEN_FREQ}; rows "
            f"without a file are failed or uncommitted samples)"
        ]
        if self.last_slot != "pre_norm":
            notes.append(
                f"{ALLOW_POST_NORM_FLAG}: hidden_states[:, -1] holds the post-norm final state; "
                f"speculators applies the verifier's final norm to it again before the lm_head, "
                f"so its teacher is wrong"
            )
        return notes

    def record_fields(self) -> dict[str, Any]:
        return {"speculators_command": speculators_command(self.out, self.manifest)}

    def plan_grew(self) -> None:
        # The dataset and token counts cover the samples planned then: made again (prepare).
        (self.out / "state.json").unlink(missing_ok=True)

    def prepare(self, store: Store, say: Callable[[str], Any]) -> None:
        _write_dataset(self.out, store, say)  # with token_freq.pt

    def encoder(self, sample: dict[str, Any]) -> Callable[[IO[bytes]], Any]:
        """Bit for bit; an FP8 store's raw values with their scales alongside."""
        from safetensors.torch import save

        m = self.manifest
        ids = sample["input_ids"].clone()
        final_name = FINAL_STATE_ARRAYS[self.last_slot]
        aux = sample["aux_hidden_states"].reshape(len(ids), m.num_aux, m.hidden_size)
        final = sample[final_name].reshape(len(ids), 1, m.hidden_size)
        tensors = {"hidden_states": torch.cat([aux, final], dim=1), "token_ids": ids}
        if m.dtype == FP8_DTYPE:
            names = ("aux_hidden_states", final_name)  # the slots above
            scales = [sample[scale_name(n)].reshape(len(ids), -1) for n in names]
            tensors["hidden_states_scales"] = torch.cat(scales, dim=1).unsqueeze(-1)
        blob = save(tensors)
        return lambda f: f.write(blob)

    @classmethod
    def read_sample(cls, out: Path, index: int, last_slot: str | None) -> dict[str, Any]:
        """Read with safetensors; the loss_mask from the export's dataset row (this format
        keeps it there); the final state named for `last_slot`."""
        from safetensors.torch import load_file

        data = load_file(cls.sample_path(out, index))
        hidden = data["hidden_states"]
        if "hidden_states_scales" in data:  # the FP8 format, as speculators' FP8Transfer reads it
            hidden = hidden.to(torch.bfloat16) * data["hidden_states_scales"].to(torch.bfloat16)
        row = _load_dataset(out)[index]
        return {
            "input_ids": data["token_ids"],
            "loss_mask": row["loss_mask"],
            "aux_hidden_states": hidden[:, :-1].reshape(len(hidden), -1),
            FINAL_STATE_ARRAYS[last_slot]: hidden[:, -1],
        }


def speculators_command(out: Path, manifest: Manifest) -> str:
    """`speculators train` (0.9.0) on this export: the aux layer ids only (the last slot is
    not one), rows without a file skipped rather than generated by a vLLM server."""
    words = [
        "speculators train",
        f"--verifier-name-or-path {manifest.model}",
        f"--data-path {out.resolve()}",
        "--on-missing skip",
        *(["--hidden-states-backend fp8"] if manifest.dtype == FP8_DTYPE else []),
        f"--target-layer-ids {' '.join(map(str, manifest.layer_ids))}",
    ]
    if manifest.max_length > SPECULATORS_SEQ_LEN:  # it truncates packed batches to this
        words.append(f"--total-seq-len {manifest.max_length}")
    return " ".join(words)


def _write_dataset(out: Path, store: Store, say: Callable[[str], Any]) -> None:
    """The speculators dataset: one row per planned sample (row = global sample index), from
    the plan's own rows, a shard at a time, and token_freq.pt counted from the same rows.
    state.json is moved in last: its presence marks a complete dataset (and token_freq.pt)."""
    if (out / "state.json").exists():
        return
    import datasets
    import pyarrow as pa

    say(f"export: writing the {store.num_samples}-row dataset speculators reads (input_ids, ...)")
    tmp = tmp_name(out / "dataset")
    tmp.mkdir()
    was_enabled = datasets.is_progress_bar_enabled()
    try:
        schema = pa.schema(
            [
                ("input_ids", pa.list_(pa.int64())),
                ("loss_mask", pa.list_(pa.int64())),
                ("seq_len", pa.int64()),
            ]
        )
        rows = tmp / "rows.arrow"
        freq: Counter[int] = Counter()
        with pa.OSFile(str(rows), "wb") as f, pa.ipc.new_stream(f, schema) as writer:
            for sh in store.shards:  # samples lie back to back from token_begin
                lengths = store.sample_length[sh.sample_begin : sh.sample_end].astype(np.int64)
                offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32())
                span = slice(sh.token_begin, sh.token_end)
                ids, mask = (np.asarray(store.group[n][span], np.int64) for n in TOKEN_COLUMNS)
                columns = [pa.ListArray.from_arrays(offsets, pa.array(a)) for a in (ids, mask)]
                writer.write_batch(pa.record_batch([*columns, pa.array(lengths)], schema=schema))
                freq.update(_token_counts(ids, mask))
        # speculators' save_token_frequency_distribution: {token id: count} over loss_mask 1.
        write_atomic(out / TOKEN_FREQ, functools.partial(torch.save, dict(freq)))
        datasets.disable_progress_bars()
        dataset = datasets.Dataset.from_file(str(rows)).with_format("torch")
        dataset.save_to_disk(str(tmp / "saved"))
        del dataset
        names = sorted(os.listdir(tmp / "saved"))
        for name in [n for n in names if n != "state.json"] + ["state.json"]:
            with open(tmp / "saved" / name, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp / "saved" / name, out / name)
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
        shutil.rmtree(tmp, ignore_errors=True)


def _token_counts(ids: np.ndarray, mask: np.ndarray) -> dict[int, int]:
    """Occurrences of each loss-masked token (the rows between samples are zero: unmasked)."""
    tokens, counts = np.unique(ids[mask.astype(bool)], return_counts=True)
    return dict(zip(tokens.tolist(), counts.tolist(), strict=True))


@functools.lru_cache(maxsize=4)
def _cached_dataset(path: str, mtime_ns: int) -> Any:
    import datasets

    return datasets.load_from_disk(path)


def _load_dataset(out: Path) -> Any:
    return _cached_dataset(str(out), (out / "state.json").stat().st_mtime_ns)
