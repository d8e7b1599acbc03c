"""The job config: every field validated, errors naming the field, before anything starts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from actors.config import MAX_AUX_LAYERS, WorkerJobConfig
from cluster.__main__ import main as cli_main
from cluster.config import ConfigError, parse_config
from cluster.job_store import manifest_for
from cluster.model_limits import context_length
from hsx_store.layers import resolve_layer_ids


def job(model: Path, tmp_path: Path, aux_layer_ids: list[int] | None) -> dict:
    (tmp_path / "prompts.jsonl").write_text('{"text": "hello"}\n')
    return {
        "model": {"path": str(model), "aux_layer_ids": aux_layer_ids},
        "data": {"paths": [str(tmp_path / "prompts.jsonl")], "max_length": 256},
        "store": {"url": str(tmp_path / "s.zarr")},
    }


@pytest.mark.parametrize("ids", [[4], [0, 2, 3, 5, 6], list(range(MAX_AUX_LAYERS))])
def test_config_takes_1_to_8_distinct_layer_ids(tmp_path: Path, ids: list[int]) -> None:
    assert parse_config(job(tmp_path, tmp_path, ids)).model.aux_layer_ids == ids


@pytest.mark.parametrize(
    "ids,reason",
    [
        ([], r"must name 1 to 8 layers, got 0"),
        (list(range(9)), r"must name 1 to 8 layers, got 9"),
        ([3, 1, 5, 1, 3], r"distinct, \[1, 3\] repeated"),
        ([2, -1, 4], r"non-negative"),
    ],
)
def test_config_refuses_bad_layer_ids_naming_the_field(
    tmp_path: Path, ids: list[int], reason: str
) -> None:
    with pytest.raises(ConfigError, match=rf"model\.aux_layer_ids: Value error, .*{reason}"):
        parse_config(job(tmp_path, tmp_path, ids))


def test_ids_the_model_lacks_are_a_config_error_before_anything_starts(
    llama_path: Path, deepseek_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """SGLang 0.5.23 checks only id < num_hidden_layers: Llama's id L-1 (index L, after the
    last layer) would pass its startup check and crash the first forward."""
    ok = {
        (llama_path, (0, 2, 3, 5, 6)): [1, 3, 4, 6, 7],  # Llama adds 1: 0..L-2 -> 1..L-1
        (deepseek_path, (3, 0, 2, 1)): [0, 1, 2, 3],  # as given: 0..L-1, in any order
    }
    for (model, ids), layers in ok.items():
        assert manifest_for(parse_config(job(model, tmp_path, list(ids))), None).layer_ids == layers
    bad = {
        (llama_path, (0, 2, 3, 5, 7)): r"\[1, 3, 4, 6, 8\] \(Llama-style: each \+ 1, so ask "
        r"for 0\.\.6\); \[8\] cannot be captured from this 8-layer model",
        (deepseek_path, (0, 2, 4)): r"\[4\] cannot be captured from this 4-layer model",
        (deepseek_path, (1, 2, 3)): r"indices \[2, 3, 4\] \(DeepSeek-style: as given, each \+ 1 "
        r"if the first is 1\); \[4\]",
    }
    for (model, ids), message in bad.items():
        with pytest.raises(ConfigError, match=rf"model\.aux_layer_ids: .*{message}"):
            manifest_for(parse_config(job(model, tmp_path, list(ids))), None)

    # The command line: exit 2 with the field named, before a store (or Ray) is made.
    given = job(llama_path, tmp_path, None)
    args = ["run", "--model", str(llama_path), "--data", given["data"]["paths"][0]]
    args += ["--store", given["store"]["url"], "--set", "model.aux_layer_ids=[0,2,3,5,7]"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "error: invalid job config:\n  model.aux_layer_ids: aux layer ids [0, 2, 3, 5, 7]" in err
    assert not (tmp_path / "s.zarr").exists()


def test_placement_flags_belong_in_their_fields_not_in_extra_args() -> None:
    raw = {"model": {"path": "m"}, "data": {"paths": ["d"]}, "store": {"url": "s"}}
    for flag, field in (("--tp-size", "tp_size"), ("--dp-size=2", "dp_size")):
        with pytest.raises(ConfigError, match=rf"server\.extra_args: .*set server\.{field}"):
            parse_config({**raw, "server": {"extra_args": [flag, "2"]}})
    with pytest.raises(ConfigError, match=r"worker\.servers_per_node"):
        parse_config({**raw, "worker": {"servers_per_node": 0}})
    config = parse_config({**raw, "server": {"dp_size": 2, "extra_args": ["--attn-dp-size", "2"]}})
    assert config.server.dp_size == 2


def test_the_job_config_takes_fp8_from_a_bf16_model_only(llama_path: Path) -> None:
    from cluster.config import ConfigError, parse_config
    from cluster.job_store import manifest_for, storage_estimate

    raw = {"model": {"path": str(llama_path)}, "data": {"paths": ["x.jsonl"], "max_length": 256}}
    config = parse_config({**raw, "store": {"url": "s.zarr", "dtype": "fp8_e4m3"}})
    manifest = manifest_for(config, None)
    assert manifest.dtype == "fp8_e4m3" and manifest.served_dtype == "bfloat16"
    h, n = manifest.hidden_size, manifest.num_aux
    assert storage_estimate(manifest, 10) == {
        "aux_hidden_states": 10 * n * (h + 4),
        "final_hidden_states": 10 * (h + 4),
        "prenorm_hidden_states": 10 * (h + 4),
        "input_ids_and_loss_mask": 50,
    }
    with pytest.raises(ConfigError, match="fp8_e4m3 quantizes a bfloat16 capture"):
        parse_config(
            {
                "model": {"path": str(llama_path), "dtype": "float32"},
                "data": {"paths": ["x.jsonl"]},
                "store": {"url": "s.zarr", "dtype": "fp8_e4m3"},
            }
        )


def test_a_worker_is_handed_the_job_config_itself(tmp_path: Path) -> None:
    """One description of a worker: the driver passes JobConfig, a WorkerJobConfig, as it is."""
    raw = job(tmp_path, tmp_path, None)
    raw["model"].update(dtype="float32", trust_remote_code=True)
    raw["server"] = {"extra_args": ["--chunked-prefill-size", "16"], "start_timeout_s": 60}
    config = parse_config(raw)
    assert isinstance(config, WorkerJobConfig)
    assert config.server_args() == [
        *("--dtype", "float32", "--trust-remote-code"),
        *("--chunked-prefill-size", "16"),
    ]
    sections = config.model_dump(include={"model", "store", "server", "worker"})
    assert WorkerJobConfig.model_validate(sections) == WorkerJobConfig(
        model=config.model, store=config.store, server=config.server, worker=config.worker
    )
    assert config.server.start_timeout_s == 60 and config.worker.idle_poll_s == 1.0


S3 = "s3://bucket/store.zarr"


@pytest.mark.parametrize(
    "options,named",
    [
        ({"client_options": 60}, r"client_options: expected a mapping of options, got int"),
        ({"retry_config": {"backoff": 2}}, r"retry_config\.backoff: expected a mapping"),
        ({"retry_config": {"retry_timeout": "soon"}}, r"retry_config\.retry_timeout: cannot read"),
        ({"client_options": {"timeout": "30 parsecs"}}, r"client_options\.timeout: cannot read"),
        ({"retry_config": {"max_retries": "4"}}, r"retry_config\.max_retries: expected a count"),
    ],
)
def test_storage_options_obstore_would_refuse_are_named_when_the_config_is_read(
    tmp_path: Path, options: dict, named: str
) -> None:
    """Before: a TypeError or AttributeError from the margin's computation, or obstore's own
    refusal once the store was opened, naming no field."""
    raw = job(tmp_path, tmp_path, None)
    raw["store"] = {"url": S3, "storage_options": options}
    with pytest.raises(ConfigError, match=rf"store\.storage_options: Value error, {named}"):
        parse_config(raw)


def test_durations_can_be_written_in_yaml_as_seconds_or_with_units(tmp_path: Path) -> None:
    """obstore wants timedeltas in retry_config, which YAML cannot hold: "30s" and 30 both
    work, and drive the time fence's margin."""
    from hsx_store.location import obstore_options, open_location

    raw = job(tmp_path, tmp_path, None)
    options = {
        "client_options": {"timeout": 30, "connect_timeout": "1m 30s"},
        "retry_config": {"retry_timeout": "30s", "backoff": {"max_backoff": 0.5}},
        "endpoint": "http://127.0.0.1:1",
    }
    raw["store"] = {"url": S3, "storage_options": options}
    config = parse_config(raw)
    assert config.margin_s == 30 + 0.5 + 30 + 15  # retry_timeout + max_backoff + timeout + 15
    client, retry, _ = obstore_options(options)
    assert client["timeout"] == "30000ms" and client["connect_timeout"] == "90000ms"
    assert retry["retry_timeout"].total_seconds() == 30
    assert retry["backoff"]["max_backoff"].total_seconds() == 0.5
    open_location(S3, options)  # obstore takes them (it connects on first use only)


def test_a_model_directory_that_cannot_size_the_capture_is_exit_2_before_a_store_exists(
    llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Before: a KeyError traceback (a config.json without num_hidden_layers) and a
    FileNotFoundError (a model.path that is not there)."""
    import json
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(llama_path, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((broken / "config.json").read_text())
    del config["num_hidden_layers"]
    (broken / "config.json").write_text(json.dumps(config))
    given = job(llama_path, tmp_path, None)
    for model, message in (
        (broken, "model.path: the model's config.json has no num_hidden_layers"),
        (tmp_path / "missing", f"model.path: {tmp_path / 'missing'} is not a directory"),
    ):
        args = ["run", "--model", str(model), "--data", given["data"]["paths"][0]]
        args += ["--set", "data.max_length=256"]
        assert cli_main([*args, "--store", given["store"]["url"]]) == 2
        assert f"error: invalid job config:\n  {message}" in capsys.readouterr().err
    assert not (tmp_path / "s.zarr").exists()


def test_relative_paths_resolve_against_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    raw = {
        "model": {"path": "models/m"},
        "data": {"paths": ["a.jsonl", str(tmp_path / "b.jsonl")], "chat_template": "model"},
        "store": {"url": "out/s.zarr"},
        "worker": {"dump_root": "shm", "log_root": None},
    }
    config = parse_config(raw)
    assert config.model.path == str(tmp_path / "models/m")
    assert config.data.paths == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    assert config.store.url == str(tmp_path / "out/s.zarr")
    assert (config.worker.dump_root, config.worker.log_root) == (str(tmp_path / "shm"), None)
    assert config.data.chat_template == "model" and raw["store"]["url"] == "out/s.zarr"
    remote = parse_config({**raw, "store": {"url": "s3://bucket/s.zarr"}})
    assert remote.store.url == "s3://bucket/s.zarr"


def test_a_submitted_job_refuses_relative_outputs_and_inputs_it_did_not_bring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under `ray job submit` the current directory is Ray's copy of the job's package."""
    package = tmp_path / "_ray_pkg_0123"
    (package / "ray_configs").mkdir(parents=True)
    (package / "ray_configs" / "prompts.jsonl").write_text('{"text": "hello"}\n')
    monkeypatch.chdir(package)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {}}')
    args = ["run", "--model", ".cache/models/m", "--data", "ray_configs/prompts.jsonl"]
    assert cli_main([*args, "--store", "relative-demo.zarr"]) == 2
    err = capsys.readouterr().err
    assert f"Ray's temporary copy of its working_dir ({package})" in err
    assert "model.path: '.cache/models/m' is relative, and not in the job's package" in err
    assert "store.url: 'relative-demo.zarr' is relative, and would be written into" in err
    assert "data.paths" not in err  # it came with the job
    assert not (package / "relative-demo.zarr").exists()

    raw = {
        "model": {"path": str(tmp_path)},
        "data": {"paths": ["ray_configs/prompts.jsonl"]},
        "store": {"url": str(tmp_path / "s.zarr")},
    }
    config = parse_config(raw)
    assert config.data.paths == [str(package / "ray_configs" / "prompts.jsonl")]


def model_dir(path: Path, **config: Any) -> Path:
    """A model directory of a config.json alone: what the config check reads."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("layers", [4, 5, 6])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM"])
def test_a_default_layer_choice_that_repeats_a_layer_is_refused_naming_ids_that_fit(
    tmp_path: Path, arch: str, layers: int
) -> None:
    """SGLang's EAGLE-3 default [2, L//2, L-3] repeats a layer on 4 to 6 layers, and SGLang
    captures a listed layer once: fewer states than the drafter's 3. Before: a ValueError
    traceback from the manifest. The default itself stays SGLang's (what it serves the drafter
    with), where it fits."""
    model = model_dir(
        tmp_path / "model", architectures=[arch], num_hidden_layers=layers, hidden_size=64
    )
    with pytest.raises(
        ConfigError, match=r"model\.aux_layer_ids: null means SGLang's EAGLE-3 "
    ) as e:
        parse_config(job(model, tmp_path, None))
    default = [2, layers // 2, layers - 3]
    assert f"{layers}-layer model hidden_states indices {default}: it repeats" in str(e.value)
    named = re.search(r"name distinct layers, e\.g\. (\[[\d, ]+\])", str(e.value))
    assert named is not None
    ids = json.loads(named.group(1))
    config = parse_config(job(model, tmp_path, ids))  # what it names is taken
    assert len(set(resolve_layer_ids(json.loads((model / "config.json").read_text()), ids))) == 3
    assert config.model.aux_layer_ids == ids


def test_the_default_layers_are_kept_where_they_fit_and_the_cli_names_the_field(
    tmp_path: Path, deepseek_path: Path, capsys: pytest.CaptureFixture
) -> None:
    for layers in (3, 7):
        arch = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers}
        model = model_dir(tmp_path / f"m{layers}", **arch, hidden_size=64)
        assert parse_config(job(model, tmp_path, None)).model.aux_layer_ids is None
    # The tiny DeepseekV3 has 4 layers: `run` and `run --dry-run` exit 2, before a store.
    for err in run_and_dry_run_errors(deepseek_path, tmp_path, "data.max_length=256", capsys):
        assert "error: invalid job config:\n  model.aux_layer_ids: null means SGLang's" in err
        assert "e.g. [0, 1, 3] (indices [0, 1, 3])" in err
    assert not (tmp_path / "s.zarr").exists()


def test_empty_stop_strings_are_refused_naming_the_field(tmp_path: Path) -> None:
    """Before: `stop: [""]` was taken, and SGLang ended every response after its first token
    (every text holds ""). Whitespace is text like any other: "\\n" ends a response at its
    first line break, as asked."""
    raw = job(tmp_path, tmp_path, None)
    for stop, at in (([""], 0), (["\n\n", ""], 1)):
        with pytest.raises(ConfigError, match=rf"generate\.stop: Value error, entry {at} is empty"):
            parse_config({**raw, "generate": {"stop": stop}})
    config = parse_config({**raw, "generate": {"stop": ["\n", " ."]}})
    assert config.generate is not None and config.generate.stop == ["\n", " ."]


def test_max_length_and_max_new_tokens_are_held_to_what_the_models_server_takes(
    llama_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: never checked, and with max_length over the context every request got HTTP 400
    and every sample was rejected. One request to SGLang holds at most the context length less
    7 tokens (measured: cluster/model_limits.py): 4089 for the tiny model's 4096."""

    def config(max_length: int, **sections: dict) -> Any:
        raw = job(llama_path, tmp_path, [0, 2, 4])
        raw["data"]["max_length"] = max_length
        return parse_config({**raw, **sections})

    assert config(4089).data.max_length == 4089
    # Left at its default (4096), it is lowered to the model's limit; given, it is refused.
    unset = job(llama_path, tmp_path, [0, 2, 4])
    del unset["data"]["max_length"]
    assert parse_config(unset).data.max_length == 4089
    assert parse_config({**unset, "server": {"max_total_tokens": 512}}).data.max_length == 505
    with pytest.raises(
        ConfigError,
        match=r"data\.max_length: 4090 tokens is more than the model's server takes in one "
        r"request, 4089 \(context length 4096, config\.json max_position_embeddings, less the 7",
    ):
        config(4090)
    for args in (["--context-length", "512"], ["--context-length=512"]):
        assert config(505, server={"extra_args": args}).data.max_length == 505
        with pytest.raises(
            ConfigError, match=r"506 tokens .*, 505 \(context length 512, --context-length in "
        ):
            config(506, server={"extra_args": args})
    with pytest.raises(ConfigError, match=r", 505 \(KV cache of server\.max_total_tokens 512,"):
        config(4089, server={"max_total_tokens": 512})
    # Above the model's own: SGLang would refuse to start, unless told to allow it.
    longer = {"extra_args": ["--context-length", "8192"]}
    with pytest.raises(ConfigError, match=r"--context-length 8192 is more than the model's 4096"):
        config(256, server=longer)
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    assert config(8185, server=longer).data.max_length == 8185
    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN")
    with pytest.raises(ConfigError, match=r"server\.extra_args: --context-length 'lots' is not"):
        config(256, server={"extra_args": ["--context-length", "lots"]})
    assert config(4089, generate={"max_new_tokens": 4088}).generate.max_new_tokens == 4088
    with pytest.raises(
        ConfigError, match=r"generate\.max_new_tokens: 4089 leaves no room for a prompt in the 4089"
    ):
        config(4089, generate={"max_new_tokens": 4089})

    # The command line, run and dry-run alike: exit 2 naming the field, before a store exists.
    for err in run_and_dry_run_errors(llama_path, tmp_path, "data.max_length=8192", capsys):
        assert "error: invalid job config:\n  data.max_length: 8192 tokens is more than" in err
    assert not (tmp_path / "s.zarr").exists()


LLAMA_ROPE = {"rope_theta": 10000.0}


@pytest.mark.parametrize(
    "changes,expected",
    [
        ({}, 4096),
        ({"rope_parameters": {**LLAMA_ROPE, "rope_type": "linear", "factor": 4.0}}, 16384),
        ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, 8192),
        (
            {
                "rope_parameters": {
                    **LLAMA_ROPE,
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 1024,
                }
            },
            4096,
        ),
        ({"seq_length": 1000}, 1000),  # before max_position_embeddings in SGLang's order
        ({"max_position_embeddings": None}, 2048),  # none of the keys: SGLang's default
    ],
)
def test_the_context_length_is_the_one_sglang_derives(
    llama_path: Path, deepseek_path: Path, tmp_path: Path, changes: dict, expected: int
) -> None:
    """Against SGLang's own get_context_length on transformers' reading of the same config.json
    (the tiny DeepseekV3's YaRN keeps its original length: 4096, not 32 x)."""
    from sglang.srt.utils.hf_transformers.common import get_context_length, get_hf_text_config
    from transformers import AutoConfig

    llama = json.loads((llama_path / "config.json").read_text())
    configs = {"llama": {k: v for k, v in {**llama, **changes}.items() if v is not None}}
    configs["deepseek"] = json.loads((deepseek_path / "config.json").read_text())
    configs["vlm"] = {  # a multimodal model: its text config holds the length
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": configs["llama"],
    }
    for name, config in configs.items():
        model = model_dir(tmp_path / name, **config)
        sglang = get_context_length(get_hf_text_config(AutoConfig.from_pretrained(model)))
        assert context_length(config)[0] == sglang, name
        assert sglang == (4096 if name == "deepseek" else expected), name


def run_and_dry_run_errors(
    model: Path, tmp_path: Path, setting: str, capsys: pytest.CaptureFixture
) -> list[str]:
    """What `run` and `run --dry-run` print on the model's job with `setting`, each exiting 2."""
    given = job(model, tmp_path, None)
    args = ["run", "--model", str(model), "--data", given["data"]["paths"][0]]
    args += ["--store", given["store"]["url"], "--set", setting]
    errors = []
    for dry in ([], ["--dry-run"]):
        assert cli_main([*args, *dry]) == 2
        errors.append(capsys.readouterr().err)
    return errors
