"""Our exports through the released trainers' own code (SpecForge 0.2.0, speculators 0.9.0, in
.venv-trainers, `make setup`): a store from a real capture (a job on the tiny Llama, served in
float32) is exported, loaded by each trainer's loaders in a subprocess
(tests/helpers/trainer_probe.py), and must come back as the store holds it, give a teacher that
agrees with the HF reference, and train (one step of the trainer's own model code, on CPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import yaml
import zarr
from safetensors.torch import load_file

from cluster.config import parse_config
from cluster.driver import run_job
from hsx_store.export.run import export
from hsx_store.format import Store
from hsx_store.reader import HiddenStatesDataset
from tests.helpers.hf_reference import reference_model
from tests.helpers.jobs import job_config
from tests.helpers.models import indexed_copy
from tests.helpers.ray_cluster import SOLO_NODE, SimulatedCluster

PROBE = Path(__file__).resolve().parents[1] / "helpers" / "trainer_probe.py"

WORDS = "a draft model learns what the target model would say next at every token".split()

# Top-1 agreement of the teacher with the HF float32 model, over every token of the store: the
# teachers run in bf16 (SpecForge's bf16 lm_head on the bf16-cast state, speculators under bf16
# autocast), which flips near-tied logits of this random tiny model now and then. Measured
# here over the 459 tokens: SpecForge 0.991; speculators' teacher on HF's own pre-norm state
# 0.991, on the post-norm state normalized twice 0.817 (the issue saw 0.81-0.83 on a real
# model).
MIN_TOP1_AGREEMENT = 0.97

FINAL, PRENORM = "final_hidden_states", "prenorm_hidden_states"


@pytest.fixture(scope="module")
def job(
    llama_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    ray_cluster: SimulatedCluster,
    trainers_python: Path,
) -> dict:
    """One real job: 8 chat prompts answered by the model itself (`generate:`), then captured by
    the same patched SGLang server into a local store. Exports do not depend on how a store's
    rows came to be; a generated store goes through every step an as-written one does, and
    more."""
    root = tmp_path_factory.mktemp("trainers")
    model = indexed_copy(llama_path, root / "llama-tiny")
    data = root / "prompts.jsonl"
    rows = []
    for i in range(8):
        text = " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(3 + i * 4))
        answer = " ".join(WORDS[: 3 + i])
        messages = [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        rows.append({"id": f"c{i}", "messages": messages})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = job_config(model, data, root / "s.zarr", root)
    config["model"] = {"path": str(model), "dtype": "float32"}  # SGLang's default layers
    config["store"]["samples_per_shard"] = 4
    config["worker"]["node_resource"] = SOLO_NODE
    config["generate"] = {"max_new_tokens": 8}
    ray_cluster.acquire()
    assert run_job(parse_config(config), say=lambda _: None) == 0
    ray_cluster.release()
    return {"root": root, "model": model, "url": str(root / "s.zarr"), "python": trainers_python}


def without_prenorm(url: str, to: Path) -> str:
    """A copy of the store as one captured without the pre-norm state."""
    shutil.copytree(url, to)
    group = zarr.open_group(to, mode="r+")
    manifest = dict(group.attrs["manifest"])
    if "final_states" in manifest:
        manifest["final_states"] = ["post_norm"]
        group.attrs["manifest"] = manifest
        shutil.rmtree(to / "prenorm_hidden_states")
    return str(to)


def probe(python: Path, *args: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """tests/helpers/trainer_probe.py in the trainers' venv; what it loaded and measured."""
    first = Path(str(args[1]).split(",")[0])
    out = first.parent / f"probe-{first.name}"
    argv = [str(python), str(PROBE), *map(str, args[:2]), str(args[2]), str(out)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # none of our code there
    # The trainers' torch.compile'd helpers run as plain PyTorch: the same code, minus ~30 s of
    # compiling on CPU.
    env["TORCHDYNAMO_DISABLE"] = "1"
    done = subprocess.run([*argv, *map(str, args[3:])], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return load_file(f"{out}.safetensors"), json.loads(Path(f"{out}.json").read_text())


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy()


def rne_bf16_bits(t: torch.Tensor) -> np.ndarray:
    """An independent float32 -> bf16 cast, round to nearest even (ml_dtypes)."""
    return t.numpy().astype(ml_dtypes.bfloat16).view(np.int16)


def hf_top1(model: Path, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference_model(model)(input_ids[None]).logits[0].argmax(-1)


def agreement(loaded: dict[str, torch.Tensor], model: Path, indices: list[int]) -> float:
    """The fraction of tokens whose teacher top-1 is the HF float32 model's."""
    same = total = 0
    for i in indices:
        want = hf_top1(model, loaded[f"{i}.input_ids"])
        same += int((loaded[f"{i}.teacher_top1"] == want).sum())
        total += len(want)
    return same / total


def test_specforge_loads_its_export_bit_for_bit_and_trains_on_it(job: dict) -> None:
    out = job["root"] / "specforge"
    export(job["url"], out, "specforge", say=lambda _: None)
    doc = json.loads((out / "export.json").read_text())
    run_yaml = job["root"] / "run.yaml"
    # The exact config the note prints, as a user would save it.
    run_yaml.write_text(yaml.safe_dump(doc["specforge_run_config"]))
    assert doc["specforge_run_config"]["model"]["aux_hidden_state_layer_ids"] == [1, 3, 4]
    loaded, facts = probe(job["python"], "specforge", out, run_yaml)

    ds = HiddenStatesDataset(job["url"])
    assert facts["files"] == len(ds) == 8
    for k in range(len(ds)):
        want, i = ds[k], ds.sample_indices[k]
        assert torch.equal(loaded[f"{i}.input_ids"], want["input_ids"])
        mask = loaded[f"{i}.loss_mask"]  # SpecForge zeroes the last position itself
        assert torch.equal(mask[:-1], want["loss_mask"][:-1]) and mask[-1] == 0
        # float32 store: the bf16 SpecForge reads is the nearest-even rounding of every value.
        assert want["aux_hidden_states"].dtype == torch.float32
        for key, stored in (
            ("draft_input", "aux_hidden_states"),
            ("target", "final_hidden_states"),
        ):
            assert loaded[f"{i}.{key}"].dtype == torch.bfloat16
            np.testing.assert_array_equal(
                bf16_bits(loaded[f"{i}.{key}"]), rne_bf16_bits(want[stored]), err_msg=key
            )
    assert agreement(loaded, job["model"], ds.sample_indices) >= MIN_TOP1_AGREEMENT
    assert np.isfinite(facts["loss"]) and facts["loss"] > 0 and facts["weights_moved"] > 0


def test_speculators_loads_its_export_bit_for_bit_and_trains_on_the_pre_norm_teacher(
    job: dict,
) -> None:
    """Needs the pre-norm state in the store (store.prenorm, on by default)."""
    store = Store.open(job["url"])
    out, wrong = job["root"] / "speculators", job["root"] / "speculators-post-norm"
    export(job["url"], out, "speculators", say=lambda _: None)
    # The control: the post-norm state in the last slot, which speculators normalizes again.
    post = without_prenorm(job["url"], job["root"] / "post-norm.zarr")
    export(post, wrong, "speculators", allow_post_norm=True, say=lambda _: None)
    doc = json.loads((out / "export.json").read_text())
    layers = store.manifest.layer_ids
    assert doc[
        "last_slot"
    ] == "pre_norm" and f"--target-layer-ids {' '.join(map(str, layers))} " in (
        doc["speculators_command"] + " "
    )
    loaded, facts = probe(job["python"], "speculators", f"{out},{wrong}", job["model"], *layers)
    control = {k.removeprefix("0/"): v for k, v in loaded.items() if k.startswith("0/")}

    ds = HiddenStatesDataset(job["url"])
    assert facts["files"] == len(ds) == 8
    for k in range(len(ds)):
        want, i = ds[k], ds.sample_indices[k]
        assert torch.equal(loaded[f"{i}.input_ids"], want["input_ids"])
        assert torch.equal(loaded[f"{i}.loss_mask"], want["loss_mask"])
        for key, stored in (
            ("draft_input", "aux_hidden_states"),
            ("target", "prenorm_hidden_states"),
        ):
            assert loaded[f"{i}.{key}"].dtype == want[stored].dtype == torch.float32
            np.testing.assert_array_equal(loaded[f"{i}.{key}"], want[stored], err_msg=key)
    assert agreement(loaded, job["model"], ds.sample_indices) >= MIN_TOP1_AGREEMENT
    assert agreement(control, job["model"], ds.sample_indices) < MIN_TOP1_AGREEMENT
    assert facts["token_freq_as_speculators_counts"] and facts["d2t_size"] == 64
    assert np.isfinite(facts["loss"]) and facts["loss"] > 0 and facts["weights_moved"] > 0
