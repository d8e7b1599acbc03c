"""Creating and resuming a store without Ray: an interrupted plan or creation, a changed prompt
file, another checkpoint, another job's config."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
import zarr

from cluster import plan_sources
from cluster.__main__ import main as cli_main
from cluster.config import parse_config
from cluster.job_store import ResumeConflict, no_usable_samples, open_or_create, plan_into
from hsx_store.format import Store
from tests.helpers.jobs import expected_ids, job_config
from tests.helpers.locked import locked_folder
from tests.helpers.models import fine_tuned_copy
from tests.helpers.prompts import write_prompts


class DriverKilled(Exception):
    pass


def test_an_interrupted_plan_is_planned_again_and_an_interrupted_creation_made_anew(
    deepseek_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = write_prompts(tmp_path / "prompts.jsonl", 7)
    monkeypatch.setattr(plan_sources, "PART_BYTES", 300)
    url = tmp_path / "s.zarr"
    config = parse_config(job_config(deepseek_path, tmp_path / "prompts.jsonl", url, tmp_path))
    _, _, builder = open_or_create(config, say=lambda _: None)

    def killed(shards: list) -> None:  # the driver dies once the first shards are out
        raise DriverKilled

    with pytest.raises(DriverKilled):
        plan_into(builder, config, 0, killed)
    assert 0 < len(Store.open(url).shards) < 3 and not Store.open(url).planned

    said: list[str] = []
    store, resumed, builder = open_or_create(config, say=said.append)
    assert resumed and builder is not None and "was being planned" in said[0]
    fed: list[int] = []
    plan_into(builder, config, 0, lambda shards: fed.extend(sh.index for sh in shards))
    assert fed and fed[0] == 1 and fed == list(range(fed[0], 3))  # only what was missing
    assert Store.open(url).planned
    for i, row in enumerate(rows):
        assert store.group["input_ids"][store.sample_rows(i)].tolist() == expected_ids(
            deepseek_path, row
        )

    # Killed while making the arrays: no `created` marker, nothing any worker could have used.
    store.group.attrs.put({k: v for k, v in store.group.attrs.items() if k != "created"})
    store, resumed, builder = open_or_create(config, say=said.append)
    assert not resumed and builder is not None and "an earlier creation was interrupted" in said[-2]
    plan_into(builder, config, 0, lambda shards: None)
    assert Store.open(url).num_samples == len(rows)


def test_a_prompt_file_changed_since_the_store_was_planned_is_refused_naming_it(
    deepseek_path: Path, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 5)
    config = parse_config(job_config(deepseek_path, prompts, tmp_path / "s.zarr", tmp_path))
    open_or_create(config, say=lambda _: None)
    prompts.write_text(prompts.read_text().replace("#1", "#one"))  # one sample edited

    with pytest.raises(ResumeConflict, match=f"{prompts}: changed since the store was planned"):
        open_or_create(config, say=lambda _: None)


def test_a_store_made_before_a_data_field_existed_resumes_with_its_default(
    deepseek_path: Path, tmp_path: Path
) -> None:
    """A store's job spec holds the data fields of the release that made it: one added since
    (`tools_field`, `row_schema`, ...) is taken as its default, which is how that job ran;
    set otherwise, it is another job."""
    write_prompts(tmp_path / "prompts.jsonl", 3)
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", tmp_path / "s.zarr", tmp_path)
    _, _, builder = open_or_create(parse_config(raw), say=lambda _: None)
    plan_into(builder, parse_config(raw), 0, lambda shards: None)
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="r+")
    job = dict(group.attrs["job"])
    for added in ("conversations_field", "tools_field", "row_schema", "content_format"):
        del job[added]
    group.attrs["job"] = job
    _, resumed, _ = open_or_create(parse_config(raw), say=lambda _: None)
    assert resumed
    raw["data"]["row_schema"] = "openai"
    with pytest.raises(ResumeConflict, match=r"data\.row_schema: store 'auto' != config 'openai'"):
        open_or_create(parse_config(raw), say=lambda _: None)


def test_a_store_is_resumed_only_with_the_checkpoint_that_planned_it(
    deepseek_path: Path, tmp_path: Path
) -> None:
    """The same weights moved elsewhere resume; a fine-tune at the same path (config, tokenizer
    and file sizes unchanged) is refused naming its weights; so is a store of schema 2, which
    recorded no weights to compare."""
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 5)
    model = Path(shutil.copytree(deepseek_path, tmp_path / "model"))
    raw = job_config(model, prompts, tmp_path / "s.zarr", tmp_path)
    open_or_create(parse_config(raw), say=lambda _: None)

    moved = model.rename(tmp_path / "moved")
    raw["model"]["path"] = str(moved)
    store, resumed, _ = open_or_create(parse_config(raw), say=lambda _: None)
    assert resumed and store.manifest.model == str(model)

    fine_tuned_copy(moved, model)
    raw["model"]["path"] = str(model)
    with pytest.raises(ResumeConflict, match=r"weights_fingerprint: store '\w+' != config '\w+'"):
        open_or_create(parse_config(raw), say=lambda _: None)

    store = Store.open(tmp_path / "s.zarr", mode="r+")
    manifest = store.manifest.to_json()
    for newer in ("weights_fingerprint", "image_token_id", "position_ids"):
        del manifest[newer]
    manifest["final_state"] = manifest.pop("final_states")[0]  # as schema 2 kept it
    store.group.attrs["manifest"] = {**manifest, "schema_version": 2}
    raw["model"]["path"] = str(moved)
    with pytest.raises(ResumeConflict, match="has store schema 2, made by an earlier release"):
        open_or_create(parse_config(raw), say=lambda _: None)


def test_another_jobs_config_is_refused_naming_every_field_before_ray_starts(
    deepseek_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The same store with other layers or shard size is another job: `run` exits 2 naming the
    fields (Ray is never started: this tier refuses it)."""
    write_prompts(tmp_path / "prompts.jsonl", 5)
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", tmp_path / "s.zarr", tmp_path)
    config = parse_config(raw)
    _, _, builder = open_or_create(config, say=lambda _: None)
    plan_into(builder, config, 0, lambda shards: None)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))

    argv = ["run", "--config", str(tmp_path / "job.yaml"), "--set", "model.aux_layer_ids=[0,2]"]
    assert cli_main([*argv, "--set", "store.samples_per_shard=5"]) == 2
    err = capsys.readouterr().err
    assert "refusing to resume" in err
    assert "layer_ids" in err and "samples_per_shard" in err


def test_run_refuses_a_file_or_a_folder_no_one_may_write_in_at_store_url_with_exit_2(
    deepseek_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    write_prompts(tmp_path / "prompts.jsonl", 3)
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", tmp_path / "s.zarr", tmp_path)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    run = ["run", "--config", str(tmp_path / "job.yaml"), "--store"]
    file = tmp_path / "file.zarr"
    file.write_text("not a store")
    assert cli_main([*run, str(file)]) == 2
    assert f"error: {file}: it is a file; a store is a directory" in capsys.readouterr().err
    assert file.read_text() == "not a store"
    with locked_folder(tmp_path / "locked") as locked:
        assert cli_main([*run, str(locked / "s.zarr")]) == 2
        assert f"{locked / 's.zarr'}: {locked} is not writable" in capsys.readouterr().err


def test_a_job_whose_every_row_is_rejected_makes_no_store_and_says_why(
    deepseek_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """No prompt leaves room for max_new_tokens: `run` exits 2 naming each kind of reason, with
    no store made (Ray is never started: this tier refuses it), so the corrected config is not
    refused as another job's."""
    write_prompts(tmp_path / "prompts.jsonl", 5)
    url = tmp_path / "s.zarr"
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", url, tmp_path)
    raw["generate"] = {"max_new_tokens": 250}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    assert cli_main(["run", "--config", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert "error: no usable samples: all 5 rows were rejected\n  5 x, first chat-0: no room" in err
    assert "(max_new_tokens 250 + 1 end-of-turn) > max_length 256" in err
    assert not url.exists()

    raw["generate"]["max_new_tokens"] = 16
    store, resumed, builder = open_or_create(parse_config(raw), say=lambda _: None)
    assert not resumed and builder is not None and store.num_samples == 0


def test_no_usable_samples_lists_each_kind_of_reason_commonest_first() -> None:
    lengths = (300, 412, 999)
    rejected = [
        {"sample_id": f"long-{n}", "reason": f"{n} tokens > max_length 256"} for n in lengths
    ]
    rejected.insert(1, {"sample_id": "empty", "reason": "empty text"})
    assert str(no_usable_samples(rejected, "rows")) == (
        "no usable samples: all 4 rows were rejected\n"
        "  3 x, first long-300: 300 tokens > max_length 256\n"
        "  1 x, first empty: empty text"
    )
    many = [{"sample_id": str(k), "reason": f"reason {'x' * k}"} for k in range(12)]
    assert str(no_usable_samples(many, "rows")).endswith(
        "\n  1 x, first 9: reason xxxxxxxxx\n  ... and 2 more, of 2 other kinds"
    )


def test_a_store_made_before_images_is_not_extended_on_an_image_model(
    qwen25_vl_path: Path, tmp_path: Path
) -> None:
    """A schema-5 store of a Qwen-VL model keeps no image table and no M-RoPE positions: a
    resume is refused, saying so (a fresh store of the same job resumes)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "no image here"}\n')
    raw = job_config(qwen25_vl_path, prompts, tmp_path / "s.zarr", tmp_path)
    raw["model"]["aux_layer_ids"] = [0, 1, 2]
    open_or_create(parse_config(raw), say=lambda _: None)
    _, resumed, _ = open_or_create(parse_config(raw), say=lambda _: None)
    assert resumed

    store = Store.open(tmp_path / "s.zarr", mode="r+")
    manifest = store.manifest.to_json()
    assert manifest["image_token_id"] == 12 and manifest["position_ids"] == "mrope"
    for newer in ("image_token_id", "position_ids"):
        del manifest[newer]
    store.group.attrs["manifest"] = {**manifest, "schema_version": 5}
    with pytest.raises(ResumeConflict, match="has store schema 5, made before images"):
        open_or_create(parse_config(raw), say=lambda _: None)
