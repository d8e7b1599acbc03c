"""SpecForge 0.2.0's offline format: one torch-saved dict per sample, bf16, exactly 3 aux
layers (docs/using-the-data.md)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from hsx_store.export.base import ExportError, TrainerFormat
from hsx_store.format import Manifest
from hsx_store.layers import model_config, requested_layer_ids

SPECFORGE_GROUP = 2000  # files per rows_* directory, as SpecForge's own generator groups them
SPECFORGE_NUM_AUX = 3  # SpecForge 0.2.0's EAGLE-3 draft: fc over 3 x hidden_size


class SpecForge(TrainerFormat):
    name = "specforge"
    fp8 = "dequantize"  # its target head is bf16

    @staticmethod
    def sample_path(out: Path, index: int) -> Path:
        group = index // SPECFORGE_GROUP * SPECFORGE_GROUP
        return out / f"rows_{group}-{group + SPECFORGE_GROUP}" / f"data_{index}.ckpt"

    @classmethod
    def check_store(cls, url: str, manifest: Manifest, allow_post_norm: bool) -> str | None:
        if manifest.num_aux != SPECFORGE_NUM_AUX:
            raise ExportError(
                f"{url}: {manifest.num_aux} aux layers (layer_ids {manifest.layer_ids}); "
                f"SpecForge 0.2.0 trains EAGLE-3 on exactly {SPECFORGE_NUM_AUX} (its draft's fc "
                f"takes {SPECFORGE_NUM_AUX} x hidden_size and model.aux_hidden_state_layer_ids "
                f"must hold three ids): export this store with --format speculators"
            )
        return None

    def hidden_dtype(self) -> str:
        return "bfloat16"

    def layout(self) -> dict[str, str]:
        return {
            "files": f"rows_{{g}}-{{g+{SPECFORGE_GROUP}}}/data_{{index}}.ckpt",
            "index": "the store's global sample index",
            "keys": "input_ids int64 [T], loss_mask int64 [T], hidden_state bf16 [1,T,H] "
            "(post-norm), aux_hidden_state bf16 [1,T,3*H]",
        }

    def notes(self) -> list[str]:
        m = self.manifest
        config = specforge_run_config(self.out, m)
        notes = [
            "train with `specforge train -c run.yaml` (SpecForge 0.2.0), run.yaml holding "
            + json.dumps(config)
            + " (export.json: specforge_run_config)"
        ]
        if "aux_hidden_state_layer_ids" not in config["model"]:
            notes.append(
                f"add model.aux_hidden_state_layer_ids: the ids SGLang is asked for, HF "
                f"indices {m.layer_ids} minus 1 for Llama-style models, as given for "
                f"DeepSeek-style ones ({m.model}/config.json is not readable here)"
            )
        if m.dtype == "float32":  # an FP8 store's reader dequantizes to bf16 exactly
            notes.append(
                f"hidden states cast from {m.dtype} to bfloat16 (round to nearest even): "
                f"SpecForge's target head is bf16"
            )
        return notes

    def record_fields(self) -> dict[str, Any]:
        return {
            "specforge_aux_layers": specforge_layers(self.manifest),
            "specforge_run_config": specforge_run_config(self.out, self.manifest),
        }

    def encoder(self, sample: dict[str, Any]) -> Callable[[IO[bytes]], Any]:
        """Bit for bit, but for the float32 -> bf16 cast."""
        data = {  # SpecForge's DataPoint, in its field order
            "input_ids": sample["input_ids"].clone(),
            "loss_mask": sample["loss_mask"].clone(),
            "hidden_state": _bf16(sample["final_hidden_states"]).unsqueeze(0),
            "aux_hidden_state": _bf16(sample["aux_hidden_states"]).unsqueeze(0),
        }
        return functools.partial(torch.save, data)

    @classmethod
    def read_sample(cls, out: Path, index: int, last_slot: str | None) -> dict[str, Any]:
        """Read with `torch.load(weights_only=True)`; the final state is post-norm."""
        data = torch.load(cls.sample_path(out, index), map_location="cpu", weights_only=True)
        return {
            "input_ids": data["input_ids"],
            "loss_mask": data["loss_mask"],
            "aux_hidden_states": data["aux_hidden_state"].squeeze(0),
            "final_hidden_states": data["hidden_state"].squeeze(0),
        }


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """A bf16 copy: bf16 bit for bit, float32 rounded to nearest even (torch's cast)."""
    return t.clone() if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)


def specforge_layers(manifest: Manifest) -> list[int] | None:
    """SpecForge's model.aux_hidden_state_layer_ids for the store's layers: the ids SGLang is
    asked for (Llama-style models add 1 to each, DeepSeek-style take them as given), computed
    from the model's config.json when it is readable here."""
    try:
        return requested_layer_ids(model_config(Path(manifest.model)), manifest.layer_ids)
    except (OSError, ValueError, KeyError):
        return None


def specforge_run_config(out: Path, manifest: Manifest) -> dict[str, Any]:
    """The minimal run.yaml of `specforge train -c run.yaml` (SpecForge 0.2.0's
    config/schema.py) for this export: offline mode through `data.hidden_states_path`."""
    model: dict[str, Any] = {"target_model_path": manifest.model}
    layers = specforge_layers(manifest)
    if layers is not None:
        model["aux_hidden_state_layer_ids"] = layers
    return {
        "model": model,
        # max_length: SpecForge truncates every sample to it (default 2048).
        "data": {"hidden_states_path": str(out.resolve()), "max_length": manifest.max_length},
    }
