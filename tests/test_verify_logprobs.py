"""`verify --logprobs` (cluster/verify/logprobs.py): the output head found in small safetensors
checkpoints by each of its names, the blocked log-softmax against a whole one, and on
llama-tiny in bf16 a store captured by a real server passes while one sample's final rows
replaced by another's, or shifted by one token, fail naming that sample (slow). The float32
case (deepseek-v3-tiny, sharing the recompute's server) is test_verify.py's real job."""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from actors.capture_client import generate_and_capture, wait_for_dump
from actors.shard_writer import ShardWriter
from cluster.verify import main
from cluster.verify.logprobs import (
    Reference,
    RowLogprobs,
    check_logprobs,
    compare,
    reference_logprobs,
    unsupported_head,
)
from cluster.verify.server import VerifyServer
from hsx_store.format import Store, create_store, make_manifest
from hsx_store.integrity import VerifyReport, verify_store
from hsx_store.layers import expected_capture
from hsx_store.lm_head import LMHeadError, find_lm_head, load_lm_head
from patches.dump_files import read_dump, release_dump

# -- the head, read alone ------------------------------------------------------------------------

V, H = 12, 4


def checkpoint(path: Path, names: list[str], config: dict, index: bool) -> dict[str, torch.Tensor]:
    """A checkpoint of two safetensors files holding `names` (and a decoy), with or without
    model.safetensors.index.json."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": V, **config}))
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(V, H, generator=g).to(torch.bfloat16) for n in names}
    files = {"model-00001-of-00002.safetensors": {"model.norm.weight": torch.ones(H)}}
    files["model-00002-of-00002.safetensors"] = tensors
    for file, part in files.items():
        save_file(part, path / file)
    if index:
        weight_map = {n: file for file, part in files.items() for n in part}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors


@pytest.mark.parametrize("index", [True, False], ids=["index", "headers"])
@pytest.mark.parametrize(
    "names,config,expected",
    [
        (["lm_head.weight", "model.embed_tokens.weight"], {}, "lm_head.weight"),
        (
            ["language_model.lm_head.weight", "language_model.model.embed_tokens.weight"],
            {"text_config": {"vocab_size": V, "tie_word_embeddings": False}},
            "language_model.lm_head.weight",
        ),
        (["model.embed_tokens.weight"], {"tie_word_embeddings": True}, "model.embed_tokens.weight"),
        (
            ["model.language_model.embed_tokens.weight"],
            {"text_config": {"tie_word_embeddings": True}},
            "model.language_model.embed_tokens.weight",
        ),
    ],
    ids=["llama", "kimi-k2.5", "tied", "tied-multimodal"],
)
def test_the_head_is_found_by_its_name_and_loaded_alone(
    tmp_path: Path, names: list[str], config: dict, expected: str, index: bool
) -> None:
    tensors = checkpoint(tmp_path / "m", names, config, index)
    name, file = find_lm_head(tmp_path / "m")
    assert (name, file.name) == (expected, "model-00002-of-00002.safetensors")
    assert torch.equal(load_lm_head(tmp_path / "m", H), tensors[expected])


def test_a_missing_misshapen_or_quantized_head_is_named(tmp_path: Path) -> None:
    checkpoint(tmp_path / "tied", ["lm_head.weight"], {"tie_word_embeddings": True}, index=False)
    with pytest.raises(LMHeadError, match=r"no output head .* none of \['model.embed_tokens"):
        load_lm_head(tmp_path / "tied", H)
    checkpoint(tmp_path / "m", ["lm_head.weight"], {}, index=True)
    with pytest.raises(LMHeadError, match=r"lm_head.weight has shape \(12, 4\), not .* hidden 8"):
        load_lm_head(tmp_path / "m", 8)
    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "config.json").write_text(json.dumps({"vocab_size": V}))
    fp8 = torch.zeros(V, H).to(torch.float8_e4m3fn)
    save_file({"lm_head.weight": fp8}, tmp_path / "fp8" / "model.safetensors")
    with pytest.raises(LMHeadError, match=r"is torch\.float8_e4m3fn"):
        load_lm_head(tmp_path / "fp8", H)


def test_a_padded_head_is_cut_to_the_vocabulary(tmp_path: Path) -> None:
    tensors = checkpoint(tmp_path / "m", ["lm_head.weight"], {}, index=False)
    (tmp_path / "m" / "config.json").write_text(json.dumps({"vocab_size": V - 2}))
    assert torch.equal(load_lm_head(tmp_path / "m", H), tensors["lm_head.weight"][: V - 2])


def test_logits_the_check_does_not_model_are_refused(tmp_path: Path, capsys) -> None:
    checkpoint(tmp_path / "m", ["lm_head.weight"], {"final_logit_softcapping": 30.0}, index=False)
    assert "['final_logit_softcapping']" in str(unsupported_head(tmp_path / "m"))
    assert main(["--store", str(tmp_path / "s.zarr"), "--logprobs", "2"]) == 2
    assert "--logprobs need --model" in capsys.readouterr().err


@pytest.mark.parametrize("block_bytes", [1, 3 * 16 * 4, 1 << 20])  # 1: one row and column each
def test_the_blocked_log_softmax_is_the_whole_one(block_bytes: int) -> None:
    g = torch.Generator().manual_seed(0)
    final = (3 * torch.randn(9, 16, generator=g)).to(torch.bfloat16)
    head = torch.randn(40, 16, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 40, (9, 2), generator=g)
    whole = torch.log_softmax(final.float() @ head.float().T, dim=-1)

    got = reference_logprobs(final, head, ids, block_bytes)
    torch.testing.assert_close(got.at, whole.gather(1, ids))
    assert torch.equal(got.top1_id, whole.argmax(dim=-1))
    torch.testing.assert_close(got.top1, whole.max(dim=-1).values)


def test_a_top1_flip_between_near_ties_is_noise_and_a_clear_one_is_not() -> None:
    # Three rows; the server's top-1 differs on rows 1 (a tie within 0.05) and 2 (0.5 apart).
    ours = Reference(
        at=torch.tensor([[-1.0, -0.5], [-2.0, -0.52], [-3.0, -1.0]]),
        top1_id=torch.tensor([7, 8, 9]),
        top1=torch.tensor([-0.5, -0.5, -0.5]),
    )
    server = RowLogprobs(
        next_token=torch.tensor([-1.01, -2.03]),
        top1_id=torch.tensor([7, 1, 2]),
        top1=torch.tensor([-0.5, -0.52, -0.6]),
    )
    r = compare(4, "s4", ours, server, tie=0.05)
    assert (r.tokens, r.worst_token) == (3, 2)  # the last row: its top-1 logprob, 0.1 off
    assert r.top1_agreement == pytest.approx(1 / 3)
    assert r.top1_agreement_ties == pytest.approx(2 / 3)
    assert (r.mean_error, r.max_error) == pytest.approx((0.14 / 3, 0.1), abs=1e-6)


# -- on real servers ---------------------------------------------------------------------------

WORDS = "a draft model learns what the target model would say next at every token".split()
LAYERS = [0, 1, 2]  # as asked of SGLang
SAMPLES = 8


def captured_store(model: Path, url: Path, dtype: str, server: VerifyServer) -> Store:
    """A store of SAMPLES prompts whose rows `server` captured, all requests at once (batched
    as a job's are), written and committed as a worker does."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [" ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(2 + i * 6)) for i in range(8)]
    ids = [np.array(tokenizer(t)["input_ids"], np.int32) for t in texts]
    capture = expected_capture(model, LAYERS, dtype)
    manifest = make_manifest(str(model), model, capture, max_length=256, samples_per_shard=4)
    names = [f"p{i}" for i in range(SAMPLES)]
    store = create_store(url, manifest, names, ids, [np.ones(len(x), np.uint8) for x in ids])
    running, _ = server.get(store)

    def capture_one(i: int) -> tuple[torch.Tensor, ...]:
        response = generate_and_capture(running, f"hsx-test-{i}", input_ids=ids[i].tolist())
        tensors, _ = read_dump(wait_for_dump(response.dump_path))
        rows = tuple(tensors[name].clone() for name in manifest.hidden_arrays)
        release_dump(response.dump_path)
        return rows

    with ThreadPoolExecutor(SAMPLES) as pool:
        rows = list(pool.map(capture_one, range(SAMPLES)))
    for shard in store.shards:
        writer = ShardWriter(store, shard)
        for i in range(shard.sample_begin, shard.sample_end):
            writer.write_sample(i, *rows[i])
        writer.commit({"worker": "test"})
    return store


def check(url: Path, server: VerifyServer) -> VerifyReport:
    say = functools.partial(print, flush=True)
    logprobs = functools.partial(check_logprobs, server=server, count=SAMPLES, seed=0, say=say)
    report = verify_store(url, logprobs=logprobs, say=say)
    print(report.format())
    return report


@pytest.mark.slow
def test_logprobs_pass_a_captured_store_and_name_rows_swapped_or_shifted(
    llama_path: Path, tmp_path: Path
) -> None:
    """bf16, the dtype with batch noise; float32 (deepseek-v3-tiny) is checked, with the
    recompute on the same server, in test_verify.py's real job."""
    path, dtype = llama_path, "bfloat16"
    url = tmp_path / "s.zarr"
    with VerifyServer(path, tmp_path, ["--dtype", dtype], print) as server:
        store = captured_store(path, url, dtype, server)
        report = check(url, server)
        assert report.ok and report.checks["logprobs"] == "ran", report.format()
        assert [r["ok"] for r in report.checked["logprobs"]] == [True] * SAMPLES

        # Sample 3's final rows replaced by sample 7's first ones; sample 5's shifted by a token.
        final = store.group["final_hidden_states"]
        r3, r5, r7 = (store.sample_rows(i) for i in (3, 5, 7))
        final[r3] = np.asarray(final[r7])[: r3.stop - r3.start]
        final[r5] = np.roll(np.asarray(final[r5]), 1, axis=0)
        report = check(url, server)
    failed = [m.split(": stored final")[0] for m in (f.message for f in report.findings)]
    assert failed == ["sample 3 (p3)", "sample 5 (p5)"], report.format()
    assert [r["sample"] for r in report.checked["logprobs"] if not r["ok"]] == [3, 5]
