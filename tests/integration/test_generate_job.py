"""Generate, then capture, on the two simulated GPU nodes: the servers write the responses
(greedy, two per prompt), then capture them. Each stored sample is checked against an
independent client's /generate call on a server of its own, its rows against the HF reference,
its loss mask against the response's place."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from cluster.config import parse_config
from cluster.driver import run_job
from hsx_store.format import Store
from hsx_store.generated import GeneratedParts, read_conversations
from tests.helpers.jobs import (
    FinishedJob,
    assert_store_matches_reference,
    job_config,
    start_driver,
    tokenizer_of,
)
from tests.helpers.prompts import write_prompts
from tests.helpers.ray_cluster import SOLO_NODE, SimulatedCluster
from tests.helpers.servers import DEEPSEEK_FLOAT32, ServerPool
from tools.s3_server import S3Server

MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def generated_job(
    ray_cluster: SimulatedCluster, deepseek_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> FinishedJob:
    """6 prompts (chat rows, some ending with an assistant turn, and text rows) and one with
    no room for max_new_tokens; two greedy responses each; 4 samples a shard."""
    root = tmp_path_factory.mktemp("generate-job")
    rows = write_prompts(root / "prompts.jsonl", 6)
    with (root / "prompts.jsonl").open("a") as f:
        f.write(json.dumps({"id": "too-long", "text": "word " * 250}) + "\n")
    config = job_config(deepseek_path, root / "prompts.jsonl", root / "g.zarr", root)
    config["store"]["samples_per_shard"] = 4
    config["generate"] = {"n": 2, "max_new_tokens": MAX_NEW_TOKENS}
    log: list[str] = []
    ray_cluster.acquire()
    assert run_job(parse_config(config), say=log.append) == 0, "\n".join(log)[-6000:]
    ray_cluster.release()
    return FinishedJob(root / "g.zarr", rows, log, config)


def independent_prompt(model: Path, row: dict[str, Any]) -> tuple[list[int], bool]:
    """The prompt's tokens (rendered here, not by the plan) and whether it is a chat."""
    tokenizer = tokenizer_of(model)
    if "text" in row:
        return tokenizer(row["text"])["input_ids"], False
    messages = row["messages"]
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    rendered = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(rendered["input_ids"]), True


def test_each_sample_is_its_prompt_then_what_the_server_generates_and_matches_the_reference(
    generated_job: FinishedJob, deepseek_path: Path, sglang_servers: ServerPool
) -> None:
    store = Store.open(generated_job.url)
    tokenizer = tokenizer_of(deepseek_path)
    turn_end = tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]
    server = sglang_servers.get(DEEPSEEK_FLOAT32).server
    ids_of = {str(x): i for i, x in enumerate(store.group["sample_id"][:])}
    assert set(ids_of) == {f"{r['id']}#{k}" for r in generated_job.rows for k in (0, 1)}
    assert store.committed().all()
    for row in generated_job.rows:
        prompt, chat = independent_prompt(deepseek_path, row)
        end = turn_end if chat else [tokenizer.eos_token_id]
        sampling = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "stop_token_ids": end}
        reply = server.session.post(
            server.url + "/generate",
            json={"input_ids": prompt, "sampling_params": sampling},
            timeout=120,
        ).json()
        assert "output_ids" in reply, reply
        generated = list(reply["output_ids"])
        if reply["meta_info"]["finish_reason"]["type"] == "stop" and generated[-len(end) :] != end:
            generated += end
        for k in (0, 1):  # greedy: both responses are the same tokens
            i = ids_of[f"{row['id']}#{k}"]
            rows = store.sample_rows(i)
            assert store.group["input_ids"][rows].tolist() == prompt + generated, row["id"]
            mask = np.asarray(store.group["loss_mask"][rows])
            assert mask.tolist() == [0] * len(prompt) + [1] * len(generated), row["id"]
    assert_store_matches_reference(store, deepseek_path, list(range(len(store.shards))))


def test_a_response_tokenized_again_from_its_text_is_not_what_the_model_wrote(
    generated_job: FinishedJob, deepseek_path: Path
) -> None:
    """Why a sample is never retokenized: for some responses the text the server returns,
    tokenized again (as a pipeline that writes JSONL, then renders and tokenizes it, does), gives
    other tokens than the server generated. The store keeps the server's."""
    store = Store.open(generated_job.url)
    tokenizer = tokenizer_of(deepseek_path)
    ids_of = {str(x): i for i, x in enumerate(store.group["sample_id"][:])}
    differ = 0
    for c in read_conversations(generated_job.url):
        (turn,) = c["turns"]
        again = tokenizer(turn["text"], add_special_tokens=False)["input_ids"]
        differ += again != turn["output_ids"]
        stored = store.group["input_ids"][store.sample_rows(ids_of[c["id"]])].tolist()
        # no stop strings here: a turn ends with its end token, or is cut
        assert stored[-len(turn["output_ids"]) :] == turn["output_ids"], c["id"]
    assert differ, "every response retokenized to its tokens: this shows nothing"


def test_the_responses_are_readable_on_their_own_and_the_report_counts_them(
    generated_job: FinishedJob,
) -> None:
    store = Store.open(generated_job.url)
    conversations = list(read_conversations(generated_job.url))
    assert [c["id"] for c in conversations] == [str(x) for x in store.group["sample_id"][:]]
    for c in conversations:
        assert [t["finish_reason"] in ("stop", "length") for t in c["turns"]] == [True]
        assert c["sampling"]["max_new_tokens"] == MAX_NEW_TOKENS
        assert c["model"]["weights_fingerprint"] == store.manifest.weights_fingerprint
        if "messages" in c:
            assert c["messages"][-1]["role"] == "assistant"
            assert c["messages"][-2]["role"] == "user"
    rejected = {r["sample_id"]: r["reason"] for r in store.rejected}
    assert set(rejected) == {"too-long"}
    assert "no room to generate" in rejected["too-long"]
    generation = store.group.attrs["report"]["run"]["planning"]["generation"]
    assert generation["prompts"] == len(generated_job.rows)
    assert generation["responses"] == 2 * len(generated_job.rows)
    assert sum(generation["finish_reasons"].values()) == generation["responses"]
    generated = sum(len(t["output_ids"]) for c in conversations for t in c["turns"])
    assert generation["generated_tokens"] == generated
    assert "generated tok/s" in "\n".join(generated_job.log)


def chatml_turns(
    server: Any, model: Path, messages: list[dict[str, str]], stop: list[str]
) -> tuple[list[int], list[int]]:
    """A conversation's every assistant turn written anew, turn by turn, by a client of its
    own: the tiny model's ChatML built by hand, each turn's prompt the tokens so far. Returns
    the tokens and the mask of the written turns."""
    tokenizer = tokenizer_of(model)

    def tokens(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    end = tokens("<|im_end|>")
    ids, mask, text = [], [], "<|bos|>"
    for m in messages:
        if m["role"] != "assistant":
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
            continue
        piece = tokens(text + "<|im_start|>assistant\n")
        ids, mask = ids + piece, mask + [0] * len(piece)
        sampling = {
            "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": 0,
            "stop_token_ids": end,
            "stop": stop,
        }
        reply = server.session.post(
            server.url + "/generate",
            json={"input_ids": ids, "sampling_params": sampling},
            timeout=120,
        ).json()
        turn = list(reply["output_ids"])
        if reply["meta_info"]["finish_reason"]["type"] == "stop" and turn[-1:] != end:
            turn += end
        # No newline after an assistant turn: transformers renders templates with trim_blocks,
        # which drops the one after `{% endgeneration %}`.
        ids, mask, text = ids + turn, mask + [1] * len(turn), ""
        if reply["meta_info"]["finish_reason"]["type"] == "length":
            break
    return ids, mask


def test_every_turn_written_anew_on_s3_survives_a_killed_driver_without_generating_again(
    ray_nodes: Any,
    deepseek_path: Path,
    tmp_path: Path,
    s3: S3Server,
    sglang_servers: ServerPool,
) -> None:
    rows = write_prompts(tmp_path / "prompts.jsonl", 12)
    server = sglang_servers.get(DEEPSEEK_FLOAT32).server
    # The random model never ends a turn by itself: a stop string taken from what it writes
    # in the first turn of a two-turn conversation ends that turn early, so the second is
    # written after it.
    first_turn, _ = chatml_turns(server, deepseek_path, rows[1]["messages"][:2], [])
    stop = [tokenizer_of(deepseek_path).decode(first_turn[-MAX_NEW_TOKENS + 2 :][:1])]
    url = s3.url(f"{tmp_path.name}/g.zarr")
    raw = job_config(deepseek_path, tmp_path / "prompts.jsonl", url, tmp_path)
    raw["store"] |= {"storage_options": s3.options, "samples_per_shard": 2}
    raw["queue"]["lease_s"] = 300  # beyond the margin object storage needs (its write bound)
    raw["worker"]["node_resource"] = SOLO_NODE
    raw["generate"] = {"turns": "all", "max_new_tokens": MAX_NEW_TOKENS, "stop": stop}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    first = start_driver(tmp_path / "job.yaml", ray_nodes.address, tmp_path / "driver.log")
    keep = None
    deadline = time.monotonic() + 400
    while keep is None or not keep.parts():
        assert time.monotonic() < deadline and first.poll() is None, "nothing was generated"
        with contextlib.suppress(Exception):  # not created yet
            keep = GeneratedParts(Store.open(url, storage_options=s3.options).group.store)
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    kept = {k: keep.responses(k) for k in keep.parts()}
    assert 1 <= len(kept) < len(rows) / 2, "the driver was killed before the job's end"
    log = [(tmp_path / "driver.log").read_text()]

    assert run_job(parse_config(raw), say=log.append) == 0, "\n".join(log)[-6000:]

    store = Store.open(url, storage_options=s3.options)
    assert {k: keep.responses(k) for k in kept} == kept, "a kept part was generated again"
    generation = store.group.attrs["report"]["run"]["planning"]["generation"]
    assert generation["reused_parts"] >= len(kept)
    assert [str(x) for x in store.group["sample_id"][:]] == [r["id"] for r in rows]
    assert store.committed().all() and (np.asarray(store.group["sample_status"][:]) == 1).all()
    tokenizer = tokenizer_of(deepseek_path)
    for i, row in enumerate(rows):
        if "messages" in row:
            expected, mask = chatml_turns(server, deepseek_path, row["messages"], stop)
        else:
            prompt = tokenizer(row["text"])["input_ids"]
            turn = next(
                c["turns"][0] for c in read_conversations(url, s3.options) if c["id"] == row["id"]
            )["output_ids"]
            expected, mask = prompt + turn, [0] * len(prompt) + [1] * len(turn)
        got = store.group["input_ids"][store.sample_rows(i)].tolist()
        assert got == expected, row["id"]
        assert store.group["loss_mask"][store.sample_rows(i)].tolist() == mask, row["id"]
    two_turns = [c for c in read_conversations(url, s3.options) if len(c["turns"]) == 2]
    assert two_turns, "some conversation had both its turns written"
    for c in two_turns:  # the written turns in place of the originals
        assert [m["content"] for m in c["messages"] if m["role"] == "assistant"] == [
            t["text"] for t in c["turns"]
        ]
    assert_store_matches_reference(store, deepseek_path, [0, len(store.shards) - 1])
    assert s3.secret_access_key not in "\n".join(log)
