"""HF transformers' own forward of a vision-language model, as the reference for image samples:
the processor's tokens and M-RoPE positions, every hidden state, the final norm's input."""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image


@dataclass(frozen=True)
class VLReference:
    input_ids: list[int]
    image_grid_thw: list[list[int]]
    position_ids: torch.Tensor  # [P, 3], what the language model was given
    hidden_states: tuple[torch.Tensor, ...]  # HF hidden_states[k]: [P, H]; [-1] post-norm
    prenorm: torch.Tensor  # [P, H]


@functools.cache
def _model(path: Path) -> tuple[Any, Any, dict[str, Any]]:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    seen: dict[str, Any] = {}
    language = model.model.language_model
    language.norm.register_forward_hook(lambda m, args, out: seen.update(prenorm=args[0]))
    language.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(position_ids=kwargs.get("position_ids")),
        with_kwargs=True,
    )
    return processor, model, seen


def reference(path: Path, messages: list[dict[str, Any]], images: list[bytes]) -> VLReference:
    """`messages` with transformers' `{"type": "image"}` parts, one per image of `images`
    (encoded bytes, in order), rendered by the model's own chat template."""
    processor, _, _ = _model(path)
    text = processor.apply_chat_template(messages, tokenize=False)
    encoded = processor(text=[text], images=_pictures(images) or None, return_tensors="pt")
    return _forward(path, encoded)


def reference_of_ids(path: Path, input_ids: list[int], images: list[bytes]) -> VLReference:
    """The forward of expanded tokens `input_ids` (each image's run of image tokens in place)
    with `images`: a generated sample's, whose text no template rendered."""
    return _forward(path, _inputs(path, input_ids, images))


def greedy(path: Path, input_ids: list[int], images: list[bytes], max_new_tokens: int) -> list[int]:
    """HF's greedy continuation of expanded tokens `input_ids` with `images`."""
    _, model, _ = _model(path)
    inputs = _inputs(path, input_ids, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(input_ids) :].tolist()


def _pictures(images: list[bytes]) -> list[Any]:
    return [Image.open(io.BytesIO(data)).convert("RGB") for data in images]


def _inputs(path: Path, input_ids: list[int], images: list[bytes]) -> dict[str, Any]:
    """The model's inputs for expanded tokens, as its processor would give them."""
    processor, model, _ = _model(path)
    ids = torch.tensor([input_ids])
    inputs: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == model.config.image_token_id).int(),
    }
    if images:
        inputs |= processor.image_processor(images=_pictures(images), return_tensors="pt")
    return inputs


def _forward(path: Path, encoded: Any) -> VLReference:
    _, model, seen = _model(path)
    with torch.no_grad():
        out = model(**encoded, output_hidden_states=True, use_cache=False)
    ids = encoded["input_ids"][0]
    positions = seen["position_ids"]
    if positions is None:  # no image: the language model makes its own, three aranges
        positions = torch.arange(len(ids)).expand(3, 1, -1)
    grid = encoded.get("image_grid_thw")
    return VLReference(
        ids.tolist(),
        [] if grid is None else grid.tolist(),
        positions[-3:, 0].T.contiguous(),  # [3 (or 4: a text row first), 1, P] -> [P, 3]
        tuple(h[0] for h in out.hidden_states),
        seen["prenorm"][0],
    )


def row_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest per-row relative difference ||a - e|| / ||e|| (an image row is judged
    alone, not averaged away among text rows)."""
    a, e = actual.double(), expected.double()
    return float(((a - e).norm(dim=-1) / e.norm(dim=-1).clamp_min(1e-30)).max())


def assert_matches_reference(
    ref: VLReference, layer_ids: list[int], stored: dict[str, torch.Tensor], tolerance: float
) -> None:
    """Stored aux slot j == HF hidden_states[layer_ids[j]], final == hidden_states[-1],
    pre-norm == the final norm's input, each row within `tolerance` (relative)."""
    aux = stored["aux_hidden_states"].float().reshape(len(ref.prenorm), len(layer_ids), -1)
    pairs = [(f"aux[{j}]", aux[:, j], ref.hidden_states[k]) for j, k in enumerate(layer_ids)]
    pairs += [
        ("final", stored["final_hidden_states"].float(), ref.hidden_states[-1]),
        ("prenorm", stored["prenorm_hidden_states"].float(), ref.prenorm),
    ]
    for name, actual, expected in pairs:
        error = row_error(actual, expected)
        assert error <= tolerance, f"{name} differs from HF by {error:.2e} > {tolerance:.0e}"
