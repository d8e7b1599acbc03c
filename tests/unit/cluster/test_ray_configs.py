"""The files under ray_configs/: job configs validate, demo prompts parse, cluster files hold up.

Fast: no Ray cluster, no server. The launcher file goes through the same config bootstrap as
`ray up --no-config-cache` (defaults, local-provider preparation, schema validation), which
contacts no machine.
"""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import JobConfig, load_config

REPO = Path(__file__).resolve().parents[3]
RAY_CONFIGS = REPO / "ray_configs"

JOB_FILES = sorted(RAY_CONFIGS.glob("*_job.yaml"))


def load_yaml(name: str) -> Any:
    return yaml.safe_load((RAY_CONFIGS / name).read_text())


def test_the_expected_job_files_exist() -> None:
    assert {p.name for p in JOB_FILES} >= {"demo_job.yaml", "kimi_k25_job.yaml"}


@pytest.mark.parametrize("path", JOB_FILES, ids=lambda p: p.name)
def test_job_config_validates(path: Path) -> None:
    config = load_config(path)
    assert isinstance(config, JobConfig)
    assert config.worker.node_resource == "sglang_node"
    assert config.worker.dump_root == "/dev/shm"


def test_demo_job() -> None:
    config = load_config(RAY_CONFIGS / "demo_job.yaml")  # relative paths: against the cwd
    assert config.model.path == str(Path.cwd() / ".cache/models/deepseek-v3-tiny")
    assert config.model.dtype == "float32"
    assert config.model.aux_layer_ids == [0, 1, 3]
    assert config.data.paths == [str(Path.cwd() / "ray_configs/demo_prompts.jsonl")]
    assert config.store.url == str(Path.cwd() / "out/demo.zarr")
    assert (config.store.samples_per_shard, config.store.chunk_tokens) == (4, 64)
    assert config.worker.inflight == 4
    assert config.server.max_total_tokens == 8192
    # The demo tool's overrides apply on top.
    moved = load_config(RAY_CONFIGS / "demo_job.yaml", ["model.path=/abs/m", "store.url=/abs/s"])
    assert (moved.model.path, moved.store.url) == ("/abs/m", "/abs/s")
    # `tools.demo --s3` runs it on object storage: its lease outlasts that store's write margin.
    on_s3 = load_config(RAY_CONFIGS / "demo_job.yaml", ["store.url=s3://bucket/demo.zarr"])
    assert on_s3.queue.lease_s > on_s3.margin_s == 210


def _flag_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from server.extra_args"
    return args[args.index(flag) + 1]


def test_kimi_job() -> None:
    config = load_config(RAY_CONFIGS / "kimi_k25_job.yaml")
    assert config.model.dtype == "bfloat16"
    assert config.model.aux_layer_ids is None  # SGLang's EAGLE-3 default [2, 30, 58]
    assert config.server.tp_size == 8
    assert config.store.codec == "none"
    assert config.worker.inflight == 16
    args = config.server.extra_args
    assert config.model.trust_remote_code  # Kimi's tokenizer is remote code
    # SGLang rejects a prompt of >= context-length tokens, and we generate one token.
    assert int(_flag_value(args, "--context-length")) > config.data.max_length
    assert int(_flag_value(args, "--chunked-prefill-size")) >= config.data.max_length
    assert int(_flag_value(args, "--max-running-requests")) >= config.worker.inflight
    assert 0 < float(_flag_value(args, "--mem-fraction-static")) < 1
    # The launcher and the driver set these; passing them again would conflict.
    for owned in ("--model-path", "--tp-size", "--dtype", "--return-aux-hidden-state-layer-ids"):
        assert owned not in args
    # ~1 GB of hidden states per shard at ~1,000 tokens per sample.
    bytes_per_token = (3 + 1) * 7168 * 2
    assert 0.5e9 < config.store.samples_per_shard * 1024 * bytes_per_token < 2e9


def test_demo_prompts() -> None:
    """Text rows, chat rows (a system turn, two assistant turns), an agent's row (tools,
    parallel calls, reasoning) and a ShareGPT row; planned in the test below."""
    rows = [json.loads(line) for line in (RAY_CONFIGS / "demo_prompts.jsonl").open()]
    assert 20 <= len(rows) <= 30
    assert len({row["id"] for row in rows}) == len(rows)
    chats = [row["messages"] for row in rows if "messages" in row]
    assert sum("text" in row for row in rows) >= 5 and len(chats) >= 5
    assert any(sum(m["role"] == "assistant" for m in chat) == 2 for chat in chats)
    assert any(chat[0]["role"] == "system" for chat in chats)
    agent = next(row for row in rows if "tools" in row)
    assert any(len(m.get("tool_calls", [])) == 2 for m in agent["messages"])
    assert any("reasoning_content" in m for m in agent["messages"])
    assert any("conversations" in row for row in rows)


def test_runtime_env() -> None:
    """The job's package holds its code and ray_configs/ only: not a log, a store or a venv a
    user keeps in the checkout (Ray's own matcher decides, as when it packages the directory)."""
    from ray._private.runtime_env.packaging import _get_excludes

    env = load_yaml("runtime_env.yaml")
    assert env["working_dir"] == "."
    left_out = _get_excludes(REPO, env["excludes"])
    kept = [".", "actors", "cluster/driver.py", "hsx_store", "patches", "ray_configs/demo_job.yaml"]
    # hsx_kernels: compiled at install; each node imports its own build
    dropped = [
        *("demo.log", "out", ".venv", ".cache", ".git", "tests", "tools", "README.md"),
        "hsx_kernels",
    ]
    assert not [p for p in kept if left_out(REPO / p)]
    assert [p for p in dropped if left_out(REPO / p)] == dropped
    assert left_out(REPO / "cluster" / "__pycache__")
    assert env["env_vars"] == {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    runtime_env = pytest.importorskip("ray.runtime_env")
    runtime_env.RuntimeEnv(**env)  # Ray's own validation of the fields


def test_cluster_launcher() -> None:
    config = load_yaml("cluster.yaml")
    assert config["provider"]["type"] == "local"
    assert config["provider"]["head_ip"] and config["provider"]["worker_ips"]
    assert {"ssh_user", "ssh_private_key"} <= set(config["auth"])

    head = " ".join(config["head_start_ray_commands"])
    assert "ray start --head --port=6379" in head
    assert "--dashboard-host=0.0.0.0" in head and "--num-gpus=0" in head
    assert "--resources='{}'" in head and "sglang_node" not in head
    # `ray up` starts the worker_ips through the head's monitor, which needs this.
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head

    worker = " ".join(config["worker_start_ray_commands"])
    assert "ray start --address=$RAY_HEAD_IP:6379" in worker
    start = worker.index("--resources='") + len("--resources='")
    resources = json.loads(worker[start : worker.index("'", start)])
    assert resources == {"sglang_node": 1}

    # /dev/shm is sized on the GPU nodes.
    assert any("/dev/shm" in cmd and "size=64G" in cmd for cmd in config["worker_setup_commands"])
    # The CPU environment (lock + sgl_kernel shim) only on the head.
    assert any("make setup" in cmd for cmd in config["head_setup_commands"])
    assert not any("make setup" in cmd for cmd in config["worker_setup_commands"])
    assert any(remote.startswith("/models/") for remote in config["file_mounts"])

    commands = pytest.importorskip("ray.autoscaler._private.commands")
    # What `ray up --no-config-cache` does to a config before touching any machine.
    resolved = commands._bootstrap_config(copy.deepcopy(config), no_config_cache=True)
    assert resolved["max_workers"] == len(config["provider"]["worker_ips"])


def test_kuberay_rayjob() -> None:
    job = load_yaml("kuberay_rayjob.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert "python -m cluster run --config ray_configs/kimi_k25_job.yaml" in spec["entrypoint"]
    assert spec["shutdownAfterJobFinishes"] is True
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert env["env_vars"]["HF_HUB_OFFLINE"] == "1"
    cluster = spec["rayClusterSpec"]

    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert "sglang_node" not in json.dumps(head)
    for container in head["template"]["spec"]["containers"]:
        assert "nvidia.com/gpu" not in json.dumps(container.get("resources", {}))

    (group,) = cluster["workerGroupSpecs"]
    # KubeRay wants the JSON object as a quoted string: '"{\"sglang_node\": 1}"'.
    param = group["rayStartParams"]["resources"]
    assert param.startswith('"') and param.endswith('"')
    assert json.loads(json.loads(param)) == {"sglang_node": 1}
    pod = group["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]
    model_mounts = [path for path in mounts if path.startswith("/models/")]
    assert model_mounts
    assert "persistentVolumeClaim" in volumes[mounts[model_mounts[0]]]
    kimi = load_config(RAY_CONFIGS / "kimi_k25_job.yaml")
    assert kimi.model.path in model_mounts  # model.path is where every pod mounts the PVC


def test_demo_prompts_through_the_planner(deepseek_path: Path) -> None:
    """The real planner with the demo's tokenizer: one reject (the designed one), and every
    other row within max_length with something to train on."""
    from cluster.plan import build_plan

    config = load_config(RAY_CONFIGS / "demo_job.yaml")
    data = config.data.model_copy(update={"paths": [str(RAY_CONFIGS / "demo_prompts.jsonl")]})
    plan = build_plan(data, deepseek_path)
    assert plan.rejected == [{"sample_id": "bad-empty", "reason": "empty text"}]
    assert len(plan.sample_ids) == 25
    lengths = [len(ids) for ids in plan.input_ids]
    assert min(lengths) >= 10 and max(lengths) <= config.data.max_length
    assert all(mask.sum() > 0 for mask in plan.loss_masks)


def test_kimi_server_args_parse_with_the_installed_sglang() -> None:
    """Every extra flag exists in this SGLang (argparse only: no model is resolved)."""
    import argparse

    server_args = pytest.importorskip("sglang.srt.server_args")
    parser = argparse.ArgumentParser(exit_on_error=False)
    server_args.ServerArgs.add_cli_args(parser)
    config = load_config(RAY_CONFIGS / "kimi_k25_job.yaml")
    argv = ["--model-path", config.model.path, "--tp-size", "8"]
    parsed, unknown = parser.parse_known_args(argv + config.server_args())
    assert unknown == []
    assert parsed.trust_remote_code is True
    assert parsed.context_length == 8448 and parsed.chunked_prefill_size == 8192


def _exports_before_ray_start(command: str) -> dict[str, str]:
    """The variables a shell command exports before it runs `ray start`."""
    steps = [step.strip() for step in command.split("&&")]
    start = next(k for k, step in enumerate(steps) if step.startswith("ray start"))
    exported = {}
    for step in steps[:start]:
        words = shlex.split(step)
        if words and words[0] == "export":
            exported.update(word.split("=", 1) for word in words[1:])
    return exported


def test_every_ray_node_of_the_launcher_file_starts_with_token_auth() -> None:
    config = load_yaml("cluster.yaml")
    starts = [
        command
        for command in config["head_start_ray_commands"] + config["worker_start_ray_commands"]
        if "ray start" in command
    ]
    assert len(starts) == 2  # the head and the GPU nodes
    for command in starts:
        env = _exports_before_ray_start(command)
        assert env.get("RAY_AUTH_MODE") == "token", command
        token = env.get("RAY_AUTH_TOKEN_PATH")
        # Ray aborts on an unreadable token path: the file is shipped to every node and checked.
        assert token in config["file_mounts"], f"{token} is not shipped to the nodes"
        assert any(f"test -s {token}" in c for c in config["setup_commands"])
        assert any(f"chmod 600 {token}" in c for c in config["setup_commands"])
        assert "RAY_AUTH_TOKEN=" not in command  # never the secret itself in the file


def test_every_ray_container_of_the_rayjob_requires_the_token_from_a_secret() -> None:
    spec = load_yaml("kuberay_rayjob.yaml")["spec"]
    cluster = spec["rayClusterSpec"]
    pods = {
        "head": cluster["headGroupSpec"]["template"],
        **{g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]},
        "submitter": spec["submitterPodTemplate"],  # runs `ray job submit` against the head
    }
    for name, pod in pods.items():
        ray_container = pod["spec"]["containers"][0]
        env = {e["name"]: e for e in ray_container.get("env", [])}
        assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", name
        token = env.get("RAY_AUTH_TOKEN", {})
        assert "value" not in token, f"{name}: a literal token in the file"
        assert token.get("valueFrom", {}).get("secretKeyRef", {}).get("name"), name
