"""Generate, then capture, on the two simulated GPU nodes with the store on S3: the servers
write every assistant turn anew (greedy, two responses a prompt, each turn fed into the next),
then capture them; the driver is killed once the first part is kept, and the job resumed. Each
stored sample is checked against an independent client that writes the same turns on a server
of its own, its rows against the HF reference, its loss mask against the written turns."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from dataclasses import dataclass
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
    assert_store_matches_reference,
    job_config,
    start_driver,
    tokenizer_of,
)
from tests.helpers.prompts import write_prompts
from tests.helpers.ray_cluster import SimulatedCluster
from tests.helpers.servers import DEEPSEEK_FLOAT32, ServerPool
from tools.s3_server import S3Server

MAX_NEW_TOKENS = 6


@dataclass(frozen=True)
class GeneratedJob:
    url: str
    storage_options: dict[str, Any]
    rows: list[dict[str, Any]]  # the good input rows, in order
    stop: list[str]  # the job's stop strings
    kept: dict[int, Any]  # the parts kept when the first driver was killed
    log: list[str]  # what the drivers said
    secret: str  # the S3 secret key, which no log may hold

    def store(self) -> Store:
        return Store.open(self.url, storage_options=self.storage_options)

    def conversations(self) -> list[dict[str, Any]]:
        return list(read_conversations(self.url, self.storage_options))


@pytest.fixture(scope="module")
def generated_job(
    ray_cluster: SimulatedCluster,
    deepseek_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    s3: S3Server,
    sglang_servers: ServerPool,
) -> GeneratedJob:
    """9 prompts (chat rows with one or two assistant turns, text rows) and one with no room for
    max_new_tokens; two greedy responses each, 4 samples a shard (a part: 2 prompts). The
    driver is killed as soon as a part is kept, then the job is submitted again."""
    root = tmp_path_factory.mktemp("generate-job")
    rows = write_prompts(root / "prompts.jsonl", 9)
    with (root / "prompts.jsonl").open("a") as f:
        f.write(json.dumps({"id": "too-long", "text": "word " * 250}) + "\n")
    # The random model never ends a turn by itself: a stop string taken from what it writes
    # in the first turn of a two-turn conversation ends that turn early, so the second is
    # written after it.
    server = sglang_servers.get(DEEPSEEK_FLOAT32).server
    first_turn, _ = chatml_turns(server, deepseek_path, rows[1]["messages"][:2], [])
    stop = [tokenizer_of(deepseek_path).decode(first_turn[-MAX_NEW_TOKENS + 2 :][:1])]
    url = s3.url(f"{root.name}/g.zarr")
    raw = job_config(deepseek_path, root / "prompts.jsonl", url, root)
    raw["store"] |= {"storage_options": s3.options, "samples_per_shard": 4}
    raw["queue"]["lease_s"] = 300  # beyond the margin object storage needs (its write bound)
    raw["generate"] = {"turns": "all", "n": 2, "max_new_tokens": MAX_NEW_TOKENS, "stop": stop}
    (root / "job.yaml").write_text(yaml.safe_dump(raw))
    cluster = ray_cluster.acquire()
    first = start_driver(root / "job.yaml", cluster.address, root / "driver.log")
    keep, deadline = None, time.monotonic() + 400
    while keep is None or not keep.parts():
        assert time.monotonic() < deadline and first.poll() is None, "nothing was generated"
        with contextlib.suppress(Exception):  # not created yet
            keep = GeneratedParts(Store.open(url, storage_options=s3.options).group.store)
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    kept = {k: keep.responses(k) for k in keep.parts()}
    log = [(root / "driver.log").read_text()]
    assert run_job(parse_config(raw), say=log.append) == 0, "\n".join(log)[-6000:]
    ray_cluster.release()
    return GeneratedJob(url, s3.options, rows, stop, kept, log, s3.secret_access_key)


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


def test_each_sample_is_its_prompt_and_the_turns_an_independent_client_writes(
    generated_job: GeneratedJob, deepseek_path: Path, sglang_servers: ServerPool
) -> None:
    store = generated_job.store()
    server = sglang_servers.get(DEEPSEEK_FLOAT32).server
    tokenizer = tokenizer_of(deepseek_path)
    eos = [tokenizer.eos_token_id]
    ids_of = {str(x): i for i, x in enumerate(store.group["sample_id"][:])}
    assert list(ids_of) == [f"{r['id']}#{k}" for r in generated_job.rows for k in (0, 1)]
    assert store.committed().all() and (np.asarray(store.group["sample_status"][:]) == 1).all()
    for row in generated_job.rows:
        if "messages" in row:
            expected, mask = chatml_turns(
                server, deepseek_path, row["messages"], generated_job.stop
            )
        else:  # a text row: the model continues it
            prompt = tokenizer(row["text"])["input_ids"]
            sampling = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}
            sampling |= {"stop_token_ids": eos, "stop": generated_job.stop}
            reply = server.session.post(
                server.url + "/generate",
                json={"input_ids": prompt, "sampling_params": sampling},
                timeout=120,
            ).json()
            turn = list(reply["output_ids"])
            if reply["meta_info"]["finish_reason"]["type"] == "stop" and turn[-1:] != eos:
                turn += eos
            expected, mask = prompt + turn, [0] * len(prompt) + [1] * len(turn)
        for k in (0, 1):  # greedy: both responses are the same tokens
            rows = store.sample_rows(ids_of[f"{row['id']}#{k}"])
            assert store.group["input_ids"][rows].tolist() == expected, row["id"]
            assert store.group["loss_mask"][rows].tolist() == mask, row["id"]
    assert_store_matches_reference(store, deepseek_path, list(range(len(store.shards))))


def test_a_killed_driver_does_not_make_a_kept_part_generate_again(
    generated_job: GeneratedJob,
) -> None:
    store = generated_job.store()
    keep = GeneratedParts(store.group.store)
    workers = {keep.responses(k)["worker"] for k in keep.parts()}
    assert len(workers) >= 2, "the parts were generated by several workers"
    kept = generated_job.kept
    assert 1 <= len(kept) < len(keep.parts()), "the driver was killed before the job's end"
    assert {k: keep.responses(k) for k in kept} == kept, "a kept part was generated again"
    report = store.group.attrs["report"]
    assert report["run"]["resumed"] and report["ok"]
    assert report["run"]["planning"]["generation"]["reused_parts"] >= len(kept)
    summaries = [store.summary(k) for k in range(len(store.shards))]
    assert sum(s["written"] for s in summaries) == store.num_samples  # every sample once
    assert generated_job.secret not in "\n".join(generated_job.log)


def test_a_response_tokenized_again_from_its_text_is_not_what_the_model_wrote(
    generated_job: GeneratedJob, deepseek_path: Path
) -> None:
    """Why a sample is never retokenized: for some turns the text the server returns, tokenized
    again (as a pipeline that writes JSONL, then renders and tokenizes it, does), gives other
    tokens than the server generated. The store keeps the server's."""
    store = generated_job.store()
    tokenizer = tokenizer_of(deepseek_path)
    ids_of = {str(x): i for i, x in enumerate(store.group["sample_id"][:])}
    differ = 0
    for c in generated_job.conversations():
        stored = store.group["input_ids"][store.sample_rows(ids_of[c["id"]])].tolist()
        for turn in c["turns"]:
            again = tokenizer(turn["text"], add_special_tokens=False)["input_ids"]
            differ += again != turn["output_ids"]
            n = len(turn["output_ids"])  # the server's tokens are in the sample as it gave them
            assert any(stored[i : i + n] == turn["output_ids"] for i in range(len(stored))), c["id"]
    assert differ, "every turn retokenized to its tokens: this shows nothing"


def test_the_responses_are_readable_on_their_own_and_the_report_counts_them(
    generated_job: GeneratedJob,
) -> None:
    store = generated_job.store()
    conversations = generated_job.conversations()
    assert [c["id"] for c in conversations] == [str(x) for x in store.group["sample_id"][:]]
    two_turns = [c for c in conversations if len(c["turns"]) == 2]
    assert two_turns, "some conversation had both its turns written"
    for c in conversations:
        assert all(t["finish_reason"] in ("stop", "length") for t in c["turns"])
        assert c["sampling"]["max_new_tokens"] == MAX_NEW_TOKENS
        assert c["model"]["weights_fingerprint"] == store.manifest.weights_fingerprint
        if "messages" in c:  # the written turns in place of the originals
            written = [m["content"] for m in c["messages"] if m["role"] == "assistant"]
            assert written == [t["text"] for t in c["turns"]]
    rejected = {r["sample_id"]: r["reason"] for r in store.rejected}
    assert set(rejected) == {"too-long"}
    assert "no room to generate" in rejected["too-long"]
    generation = store.group.attrs["report"]["run"]["planning"]["generation"]
    assert generation["prompts"] == len(generated_job.rows)
    assert generation["responses"] == sum(len(c["turns"]) for c in conversations)
    assert sum(generation["finish_reasons"].values()) == generation["responses"]
    generated = sum(len(t["output_ids"]) for c in conversations for t in c["turns"])
    assert generation["generated_tokens"] == generated
    assert "generated tok/s" in "\n".join(generated_job.log)
