"""Generate, then capture, on the two simulated GPU nodes with the store on S3, written
through an endpoint that throttles (503 SlowDown, tools/throttling_proxy.py): the servers
write every assistant turn anew (greedy, two responses a prompt, each turn fed into the next),
then capture them; the worker that kept the first part is killed at once. Each stored sample is
checked against an independent client that writes the same turns on a server of its own, its
rows against the HF reference, its loss mask against the written turns."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from cluster.config import parse_config
from cluster.driver import Driver
from cluster.generation_feed import generate_into
from cluster.generation_stats import GenerationStats
from cluster.job_store import open_or_create
from cluster.shard_queue import ShardQueueActor
from cluster.verify import verify
from hsx_store.export.registry import FORMATS
from hsx_store.export.run import export
from hsx_store.format import Store
from hsx_store.generated import GeneratedParts, read_conversations
from hsx_store.reader import HiddenStatesDataset, HiddenStatesIterable
from tests.helpers.jobs import (
    assert_store_matches_reference,
    job_config,
    tokenizer_of,
)
from tests.helpers.prompts import TOOLS, agentic_row, write_prompts
from tests.helpers.ray_cluster import SimulatedCluster
from tests.helpers.servers import DEEPSEEK_FLOAT32, ServerPool
from tests.helpers.sglang_chat import served_template_inputs
from tests.helpers.throttling import WRITE_RATE, through
from tools.s3_server import S3Server
from tools.throttling_proxy import ThrottlingProxy

MAX_NEW_TOKENS = 6


@dataclass(frozen=True)
class GeneratedJob:
    url: str
    storage_options: dict[str, Any]
    config: dict[str, Any]
    rows: list[dict[str, Any]]  # the good input rows, in order
    stop: list[str]  # the job's stop strings
    kept: dict[int, Any]  # the parts kept when a worker was killed
    killed: str  # that worker
    log: list[str]  # what the drivers said
    secret: str  # the S3 secret key, which no log may hold
    followed: list[str]  # the sample ids a follow reader yielded while the job ran
    follow_ended: str | None  # and why it ended
    throttled_puts: int  # the PUTs the throttling endpoint answered 503 SlowDown

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
    """9 prompts (chat rows with one or two assistant turns, text rows), an agent's (tools, a
    recorded call and its result, then the turn written anew) and one with no room for
    max_new_tokens; two greedy responses each, 4 samples a shard (a part: 2 prompts). The
    worker that kept the first part is killed at once; the driver replaces it. A follow
    reader, on S3, follows the store from then on, as its plan grows with the responses."""
    root = tmp_path_factory.mktemp("generate-job")
    rows = [*write_prompts(root / "prompts.jsonl", 9), agentic_row(9, "what is a drafter")]
    with (root / "prompts.jsonl").open("a") as f:
        f.write(json.dumps(rows[-1]) + "\n")
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
    log: list[str] = []
    ray_cluster.acquire()
    # The job writes through an endpoint that answers 503 SlowDown above WRITE_RATE PUTs a
    # second (the config kept for the tests below reaches S3 directly).
    with ThrottlingProxy(s3.endpoint, write_rate=WRITE_RATE) as proxy:
        throttled = {**raw, "store": {**raw["store"], "storage_options": through(proxy, s3)}}
        driver = Driver(parse_config(throttled), say=log.append)
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(driver.run()))
        thread.start()
        try:
            keep, deadline = None, time.monotonic() + 400
            while keep is None or not keep.parts():
                assert time.monotonic() < deadline and thread.is_alive(), "nothing was generated"
                with contextlib.suppress(Exception):  # not created yet
                    keep = GeneratedParts(Store.open(url, storage_options=s3.options).group.store)
                time.sleep(0.1)
            kept = {k: keep.responses(k) for k in keep.parts()}
            killed = kept[min(kept)]["worker"]
            victim = next(r for r in driver.workers.values() if r.worker_id == killed)
            ray.kill(victim.handle, no_restart=True)
            reader = HiddenStatesIterable(url, storage_options=s3.options, follow=True, poll_s=0.2)
            followed: list[str] = []
            follower = threading.Thread(
                target=lambda: followed.extend(s["sample_id"] for s in reader)
            )
            follower.start()
        finally:
            thread.join(600)
    assert result == [0], "\n".join(log)[-6000:]
    follower.join(120)
    ray_cluster.release()
    return GeneratedJob(
        url, s3.options, raw, rows, stop, kept, killed, log, s3.secret_access_key, followed,
        reader.ended, proxy.throttled["PUT"],
    )  # fmt: skip


def chatml_turns(
    server: Any,
    model: Path,
    messages: list[dict[str, Any]],
    stop: list[str],
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[int]]:
    """A conversation's every assistant turn written anew, turn by turn, by a client of its
    own: the tiny model's ChatML built by hand (with its tools first, a recorded call kept as
    it is where a tool result answers it), each turn's prompt the tokens so far. Returns the
    tokens and the mask of the written turns."""
    tokenizer = tokenizer_of(model)

    def tokens(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    end = tokens("<|im_end|>")
    ids, mask, text = [], [], "<|bos|>"
    if tools:
        listed = "".join("\n" + json.dumps(tool) for tool in tools)
        text += f"<|im_start|>system\n# Tools\n<tools>{listed}\n</tools><|im_end|>\n"
    for m in messages:
        if "tool_calls" in m:  # kept: the tool result after it answers it
            (call,) = m["tool_calls"]
            written = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
            text += (
                f"<|im_start|>assistant\n<think>\n{m['reasoning_content']}\n</think>\n\n"
                f"<tool_call>\n{json.dumps(written)}\n</tool_call><|im_end|>"
            )
            continue
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
            # The tools as SGLang's server hands them to the template (its own code).
            tools = served_template_inputs(row["messages"], row.get("tools"))[1]
            expected, mask = chatml_turns(
                server, deepseek_path, row["messages"], generated_job.stop, tools
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


def test_a_killed_worker_does_not_make_a_part_it_kept_generate_again(
    generated_job: GeneratedJob,
) -> None:
    store = generated_job.store()
    keep = GeneratedParts(store.group.store)
    kept = generated_job.kept
    assert len(kept) < len(keep.parts()), "the worker was killed before the job's end"
    assert {k: keep.responses(k) for k in kept} == kept, "a kept part was generated again"
    report = store.group.attrs["report"]
    assert [w["worker"] for w in report["run"]["workers_lost"]] == [generated_job.killed]
    workers = {keep.responses(k)["worker"] for k in keep.parts()}
    assert len(workers) >= 2, "several workers generated parts"
    summaries = [store.summary(k) for k in range(len(store.shards))]
    assert sum(s["written"] for s in summaries) == store.num_samples  # every sample once


def test_a_resumed_plan_takes_the_kept_parts_and_queues_none_again(
    generated_job: GeneratedJob, ray_nodes: Any, s3: S3Server, tmp_path: Path
) -> None:
    """What a resumed driver does with parts kept before it was killed: plans their samples as
    they are, never queues them (here the job's kept parts, in a store of their own)."""
    raw = {**generated_job.config, "store": {**generated_job.config["store"]}}
    raw["store"]["url"] = s3.url(f"{tmp_path.name}/again.zarr")
    config = parse_config(raw)
    store, resumed, builder = open_or_create(config, say=lambda _: None)
    assert not resumed and builder is not None
    job = generated_job.store()
    done, here = GeneratedParts(job.group.store), GeneratedParts(store.group.store)
    for k in done.parts():
        here.put_prompts(k, done.prompts(k))
        here.put_responses(k, done.responses(k))
    gen_queue = ShardQueueActor.remote([], lease_seconds=60, more_coming=True)
    stats = GenerationStats()
    generate_into(builder, config, gen_queue, here, 0, lambda shards: None, stats, lambda _: None)
    assert ray.get(gen_queue.status.remote()).total == 0, "a kept part was queued again"
    assert stats.reused_parts == stats.parts == len(done.parts())
    store = Store.open(raw["store"]["url"], storage_options=s3.options)
    for name in ("sample_id", "sample_start", "sample_length", "input_ids", "loss_mask"):
        assert np.array_equal(store.group[name][:], job.group[name][:]), name
    assert store.rejected == job.rejected


def test_a_generated_store_is_verified_read_and_exported_as_any_store(
    generated_job: GeneratedJob, tmp_path: Path
) -> None:
    url, options, log = generated_job.url, generated_job.storage_options, [*generated_job.log]
    report = verify(url, storage_options=options, say=log.append)
    samples = 2 * len(generated_job.rows)
    assert report.ok and report.checked["samples_written"] == samples, report.format()
    reader = HiddenStatesDataset(url, storage_options=options)
    assert len(reader) == samples and reader[0]["loss_mask"].any()
    for fmt in FORMATS:
        result = export(url, tmp_path / fmt, fmt, storage_options=options, say=log.append)
        assert result["files"] == samples
    assert generated_job.secret not in "\n".join(log) + report.format()


def test_a_follow_reader_on_s3_saw_each_sample_once_as_the_plan_grew(
    generated_job: GeneratedJob,
) -> None:
    store = generated_job.store()
    assert sorted(generated_job.followed) == sorted(str(x) for x in store.group["sample_id"][:])
    assert generated_job.follow_ended == "the job is complete: every planned shard is committed"


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
        if "messages" in c:  # the written turns in place of the originals, a kept call as it was
            written = [m for m in c["messages"] if m["role"] == "assistant"]
            assert [m["content"] for m in written if "tool_calls" not in m] == [
                t["text"] for t in c["turns"]
            ]
    agents = [c for c in conversations if c["id"].startswith("agent-")]
    # The row's tools and its kept call as SGLang serves them (a null description, index).
    served, tools = served_template_inputs(agentic_row(9, "")["messages"], TOOLS)
    assert len(agents) == 2 and all(c["tools"] == tools for c in agents)
    kept_call = agents[0]["messages"][1]
    assert kept_call["tool_calls"] == served[1]["tool_calls"]
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


def test_the_job_wrote_through_a_throttling_endpoint_and_its_report_counts_the_throttled_puts(
    generated_job: GeneratedJob,
) -> None:
    """Two workers and the driver wrote through S3's 503 SlowDown above WRITE_RATE PUTs a
    second: every sample stored once (the tests above), each throttled PUT retried, and the
    report counts those of the committed shards (a shard's own summary and commit PUTs, and the
    driver's, are throttled too, but not counted there)."""
    store = generated_job.store()
    shards = [store.summary(k)["throttled_requests"] for k in range(len(store.shards))]
    report = store.group.attrs["report"]
    assert report["throttled_requests"] == sum(shards) > 0
    assert sum(shards) <= generated_job.throttled_puts
    line = f"throttled requests     {sum(shards)} (503 SlowDown, retried)"
    assert line in "\n".join(generated_job.log)
