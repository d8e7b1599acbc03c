"""An image job on the tiny Kimi-K2.5 (the project's target architecture: a DeepseekV3 language
model with MLA and MoE, a MoonViT vision tower; its processor remote code, as the hub's is):
rows with images and a text row captured through SGLang's Kimi path on CPU, every stored sample
held to HF transformers' forward of its row with its images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster.config import parse_config
from cluster.driver import run_job
from hsx_store.format import Store
from tests.helpers.jobs import job_config
from tests.helpers.ray_cluster import SOLO_NODE, SimulatedCluster
from tests.helpers.vl_reference import assert_matches_reference, reference
from tests.integration.test_image_job import data_url, hf_messages, png, stored_sample

MEDIA_PAD = 11  # <|media_pad|>, the tiny model's image token
TOLERANCE = 1e-5  # float32 on both sides: measured here <= 1e-6 per row


def test_every_kimi_image_sample_is_what_hf_computes_for_its_row(
    kimi_k25_path: Path, ray_cluster: SimulatedCluster, tmp_path: Path
) -> None:
    wide, square = png(100, 80, 0), png(56, 56, 1)
    (tmp_path / "square.png").write_bytes(square)

    def row(id_: str, content: Any) -> dict[str, Any]:
        answer = {"role": "assistant", "content": "noise, it seems"}
        return {"id": id_, "messages": [{"role": "user", "content": content}, answer]}

    rows = [
        row(
            "data-url",
            [
                {"type": "text", "text": "What is it?"},
                {"type": "image_url", "image_url": {"url": data_url(wide)}},
            ],
        ),
        row("path", [{"type": "image", "image": "square.png"}, {"type": "text", "text": "And?"}]),
        row("text-only", "No picture here."),
    ]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = job_config(kimi_k25_path, tmp_path / "prompts.jsonl", tmp_path / "s.zarr", tmp_path)
    raw["model"].update(trust_remote_code=True, aux_layer_ids=[0, 1, 3])
    raw["worker"]["node_resource"] = SOLO_NODE
    said: list[str] = []
    ray_cluster.acquire()
    assert run_job(parse_config(raw), say=said.append) == 0, "\n".join(said)[-4000:]
    ray_cluster.release()

    store = Store.open(tmp_path / "s.zarr")
    assert store.manifest.image_token_id == MEDIA_PAD and store.manifest.position_ids is None
    assert [str(x) for x in store.group["sample_id"][:]] == ["data-url", "path", "text-only"]
    planned = store.sample_images(0, store.num_samples)
    for i, (r, images) in enumerate(zip(rows, ([wide], [square], []), strict=True)):
        ref = reference(kimi_k25_path, hf_messages(r), images)
        got = stored_sample(store, i)
        assert got["input_ids"].tolist() == ref.input_ids, r["id"]
        assert [list(im.grid_thw) for im in planned.get(i, [])] == ref.image_grid_thw, r["id"]
        assert_matches_reference(ref, store.manifest.layer_ids, got, TOLERANCE)
        assert not got["loss_mask"][got["input_ids"] == MEDIA_PAD].any(), r["id"]
        assert np.count_nonzero(got["input_ids"] == MEDIA_PAD) == sum(
            im.length for im in planned.get(i, [])
        )
    # The reference tells images apart: another image of the same size fails it.
    other = reference(kimi_k25_path, hf_messages(rows[0]), [png(100, 80, 9)])
    assert other.input_ids == stored_sample(store, 0)["input_ids"].tolist()
    with pytest.raises(AssertionError, match="differs from HF"):
        assert_matches_reference(
            other, store.manifest.layer_ids, stored_sample(store, 0), TOLERANCE
        )
