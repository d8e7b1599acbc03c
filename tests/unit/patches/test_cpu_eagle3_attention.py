"""patches/cpu_eagle3/attention.py: torch_native's extend and decode paths, as the hooks steer
them in target verify and multi-step draft decode, against attention computed directly over
each request's whole sequence (the tokens laid out in the KV pool in a shuffled order)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from patches.cpu_eagle3 import attention

HEADS, KV_HEADS, DIM = 4, 2, 8
PREFIX = [5, 9]  # two requests' committed tokens
DRAFTS = 4  # draft_token_num: the verified chain per request


def pool(seed: int = 0):
    """A KV pool with both requests' prefix + draft tokens in shuffled slots, its req_to_token
    table, and each request's keys and values in sequence order."""
    g = torch.Generator().manual_seed(seed)
    lengths = [p + DRAFTS for p in PREFIX]
    slots = torch.randperm(sum(lengths) + 3, generator=g)
    k_cache = torch.randn(len(slots), KV_HEADS, DIM, generator=g)
    v_cache = torch.randn(len(slots), KV_HEADS, DIM, generator=g)
    req_to_token = torch.zeros(len(PREFIX), 32, dtype=torch.int64)
    start = 0
    for r, n in enumerate(lengths):
        req_to_token[r, :n] = slots[start : start + n]
        start += n
    seqs = [
        (k_cache[req_to_token[r, :n]], v_cache[req_to_token[r, :n]]) for r, n in enumerate(lengths)
    ]
    return k_cache, v_cache, req_to_token, seqs


def direct(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Each query row at its sequence position attends to keys 0..position (GQA by repeat)."""
    out = []
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    for row, pos in zip(q, positions, strict=True):
        scores = torch.einsum("hd,thd->ht", row, k[: pos + 1]) / DIM**0.5
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v[: pos + 1]))
    return torch.stack(out)


def backend() -> TorchNativeAttnBackend:
    return object.__new__(TorchNativeAttnBackend)  # the paths used need no model runner


def verify_batch(topk: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        forward_mode=SimpleNamespace(is_target_verify=lambda: True),
        spec_info=SimpleNamespace(tree_topk=topk, draft_token_num=DRAFTS),
        seq_lens=torch.tensor(PREFIX),
    )


def test_target_verify_attends_over_prefix_and_the_draft_chain_causally() -> None:
    k_cache, v_cache, req_to_token, seqs = pool()
    self = backend()
    attention._init_forward_metadata(lambda *_: None, self, verify_batch())
    query = torch.randn(
        len(PREFIX) * DRAFTS, HEADS, DIM, generator=torch.Generator().manual_seed(1)
    )
    out = torch.empty_like(query)
    lens = torch.tensor(PREFIX)
    args = (k_cache, v_cache, req_to_token, torch.arange(len(PREFIX)), lens, None, None)
    attention._sdpa_extend(
        TorchNativeAttnBackend._run_sdpa_forward_extend, self, query, out, *args,
        scaling=DIM**-0.5, enable_gqa=True, causal=True,
    )  # fmt: skip
    for r, (k, v) in enumerate(seqs):
        rows = slice(r * DRAFTS, (r + 1) * DRAFTS)
        positions = list(range(PREFIX[r], PREFIX[r] + DRAFTS))
        torch.testing.assert_close(out[rows], direct(query[rows], k, v, positions))
    # The check can fail: the chain attending to the prefix alone (the batch's own seq_lens,
    # what torch_native would use unhooked) is another result.
    wrong = torch.empty_like(query)
    self.verify_lens = (lens, lens - DRAFTS, torch.full_like(lens, DRAFTS))
    attention._sdpa_extend(
        TorchNativeAttnBackend._run_sdpa_forward_extend, self, query, wrong, *args,
        scaling=DIM**-0.5, enable_gqa=True, causal=True,
    )  # fmt: skip
    assert not torch.allclose(wrong, out)


def test_a_token_tree_is_refused() -> None:
    with pytest.raises(attention.TreeDraftsUnsupported, match="topk 1"):
        attention._init_forward_metadata(lambda *_: None, backend(), verify_batch(topk=2))


def test_outside_target_verify_the_batch_fields_stand() -> None:
    self = backend()
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: False))
    attention._init_forward_metadata(lambda *_: None, self, batch)
    assert self.verify_lens is None


@pytest.mark.parametrize("step", [0, 1, 2])
def test_draft_decode_step_attends_to_the_prefix_and_drafts_so_far(step: int) -> None:
    k_cache, v_cache, req_to_token, seqs = pool(seed=step)
    drafter = attention.TorchNativeMultiStepDraftBackend.__new__(
        attention.TorchNativeMultiStepDraftBackend
    )
    drafter.attn_backends = [backend() for _ in range(3)]
    for b in drafter.attn_backends:  # the per-step init the container runs, SWA off
        b.use_sliding_window_kv_pool = False
    drafter.init_forward_metadata(
        SimpleNamespace(seq_lens=torch.tensor(PREFIX), out_cache_loc=None)
    )
    self = drafter.attn_backends[step]
    query = torch.randn(len(PREFIX), HEADS, DIM, generator=torch.Generator().manual_seed(2))
    out = torch.empty_like(query)
    attention._sdpa_decode(
        TorchNativeAttnBackend._run_sdpa_forward_decode, self, query, out, k_cache, v_cache,
        req_to_token, torch.arange(len(PREFIX)), torch.tensor(PREFIX),
        scaling=DIM**-0.5, enable_gqa=True,
    )  # fmt: skip
    for r, (k, v) in enumerate(seqs):
        expected = direct(query[r : r + 1], k, v, [PREFIX[r] + step])
        torch.testing.assert_close(out[r : r + 1], expected)
    # Unhooked (the batch's seq_lens: the prefix alone) the step would not see its drafts.
    self.draft_seq_lens = None
    attention._sdpa_decode(
        TorchNativeAttnBackend._run_sdpa_forward_decode, self, query, out, k_cache, v_cache,
        req_to_token, torch.arange(len(PREFIX)), torch.tensor(PREFIX),
        scaling=DIM**-0.5, enable_gqa=True,
    )  # fmt: skip
    assert not torch.allclose(out[:1], direct(query[:1], *seqs[0], [PREFIX[0] + step]))
