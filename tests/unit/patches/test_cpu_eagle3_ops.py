"""patches/cpu_eagle3/ops.py: each op against its Triton kernel, restated per program id over
flat lists (the `ref_*` below), and through SGLang's own CPU branches once hooked."""

from __future__ import annotations

import inspect
import itertools
from collections import defaultdict
from types import ModuleType

import pytest
import sgl_kernel
import torch
from sglang.srt.plugins.hook_registry import HookRegistry

from patches.cpu_eagle3 import ops

FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2


def rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randint(low: int, high: int, *shape: int, seed: int, dtype=torch.int64) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=rng(seed)).to(dtype)


# --- references: the Triton kernels, one loop iteration per program id -----------------------


def ref_copy_all_layer_kv_cache(
    buffers: list[torch.Tensor], tgt: list[int], src: list[int], bytes_per_tile: int = 16
) -> None:
    """copy_all_layer_kv_cache_tiled: program (bid, tid) loads tile tid of every source slot of
    buffer bid, then stores them all."""
    for buf in buffers:  # bid
        slots = buf.view(buf.shape[0], -1).view(torch.uint8)
        stride = slots.shape[1]
        for tile in range(-(-stride // bytes_per_tile)):  # tid
            cols = slice(tile * bytes_per_tile, min((tile + 1) * bytes_per_tile, stride))
            vals = [slots[s, cols].clone() for s in src]
            for t, v in zip(tgt, vals, strict=True):
                slots[t, cols] = v


def ref_fill_bonus_tokens(
    accept_tokens: list[int], accept_lens: list[int], bonus: list[int], stride: int
) -> None:
    for pid, accept_len in enumerate(accept_lens):
        bonus[pid] = accept_tokens[stride * pid + accept_len - 1]


def ref_fill_accept_out_cache_loc(
    accept_index: list[int], out_cache_loc: list[int], accept_out: list[int]
) -> None:
    for pid in range(len(accept_index)):  # size = bs * accept_index.shape[1]
        dst = sum(1 for k in range(pid) if accept_index[k] != -1)
        src = accept_index[pid]
        if src > -1:
            accept_out[dst] = out_cache_loc[src]


def ref_assign_draft_cache_locs_contiguous(
    req_pool_indices: list[int],
    req_to_token: list[int],
    seq_lens: list[int],
    out: list[int],
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    copy_len = topk * num_steps
    for pid, kv_start in enumerate(seq_lens):
        pool = req_pool_indices[pid] * pool_len
        for o in range(copy_len):
            out[pid * copy_len + o] = req_to_token[pool + kv_start + o]


def ref_assign_extend_cache_locs(
    req_pool_indices: list[int],
    req_to_token: list[int],
    start: list[int],
    end: list[int],
    out: list[int],
    pool_len: int,
) -> None:
    for pid in range(len(req_pool_indices)):
        out_offset = sum(end[j] - start[j] for j in range(pid))
        pool = req_pool_indices[pid] * pool_len
        for o, slot in enumerate(range(start[pid], end[pid])):
            out[out_offset + o] = req_to_token[pool + slot]


def ref_assign_req_to_token_pool(
    req_pool_indices: list[int],
    req_to_token: list[int],
    start: list[int],
    end: list[int],
    out_cache_loc: list[int],
    pool_len: int,
) -> None:
    for pid in range(len(req_pool_indices)):
        out_offset = sum(end[j] - start[j] for j in range(pid))
        pool = req_pool_indices[pid] * pool_len
        for o, slot in enumerate(range(start[pid], end[pid])):
            req_to_token[pool + slot] = out_cache_loc[out_offset + o]


def ref_build_tree(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    n: int,
    mode: int,
) -> None:
    """sgl_build_tree_kernel_efficient_triton, on flat lists, written back at the end."""
    par, ps = parent_list.reshape(-1).tolist(), parent_list.shape[1]
    sel, ss = selected_index.reshape(-1).tolist(), selected_index.shape[1]
    seq = verified_seq_len.tolist()
    mask = [int(x) for x in tree_mask.tolist()]
    pos, ri = positions.tolist(), retrieve_index.reshape(-1).tolist()
    rnt, rns = retrieve_next_token.reshape(-1).tolist(), retrieve_next_sibling.reshape(-1).tolist()
    prefix = [sum(seq[:b]) for b in range(len(seq))]
    for b in range(len(seq)):
        seq_len = seq[b]
        seq_tree_idx = n * n * b + prefix[b] * n
        pos[b * n] = seq_len
        for i in range(n - 1, 0, -1):
            ri[b * n + i] = b * n + i
            parent_tb_idx = sel[b * ss + (i - 1)] // topk
            parent_position, found = 0, 0
            if parent_tb_idx == 0:
                found = 1
            else:
                parent_token_idx = par[b * ps + parent_tb_idx]
                for pp in range(n - 1):
                    if found == 0 and sel[b * ss + pp] == parent_token_idx:
                        parent_position, found = pp + 1, 1
            if found == 1:
                addr = b * n + parent_position
                next_tok = rnt[addr]
                rnt[addr] = i
                if next_tok != -1:
                    rns[b * n + i] = next_tok
        ri[b * n] = b * n
        for x in range(n):
            if mode == FULL_MASK:
                tti = seq_tree_idx + (seq_len + n) * x + seq_len + 1
            else:
                tti = n * n * b + n * x + 1
            mask[tti - 1] = 1
            for i in range(n - 1):
                mask[tti + i] = 0
            if x > 0:
                cur, position, cont = x - 1, 0, 1
                for _ in range(depth):
                    if cont:
                        position += 1
                        mask[tti + cur] = 1
                        parent_tb_idx = sel[b * ss + cur] // topk
                        if parent_tb_idx == 0:
                            cont = 0
                        else:
                            parent_token_idx = par[b * ps + parent_tb_idx]
                            found = 0
                            for cp in range(n - 1):
                                if found == 0 and sel[b * ss + cp] == parent_token_idx:
                                    cur, found = cp, 1
                            if found == 0:
                                cont = 0
                pos[b * n + x] = position + seq_len
    tree_mask.copy_(torch.tensor(mask).to(tree_mask.dtype))
    positions.copy_(torch.tensor(pos))
    retrieve_index.copy_(torch.tensor(ri).view_as(retrieve_index))
    retrieve_next_token.copy_(torch.tensor(rnt).view_as(retrieve_next_token))
    retrieve_next_sibling.copy_(torch.tensor(rns).view_as(retrieve_next_sibling))


def ref_verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """verify_tree_greedy_kernel_triton, masked loads and all, written back at the end."""
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    pred, ai, atn = predicts.tolist(), accept_index.reshape(-1).tolist(), accept_token_num.tolist()
    cand, ri = candidates.reshape(-1).tolist(), retrieve_index.reshape(-1).tolist()
    rnt, rns = retrieve_next_token.reshape(-1).tolist(), retrieve_next_sibling.reshape(-1).tolist()
    tp = target_predict.reshape(-1).tolist()
    for bx in range(bs):
        last = ri[bx * n]
        ai[bx * steps] = last
        num, cur, cont = 0, 0, 1
        for _ in range(1, steps):
            if cont:
                cur = rnt[bx * n + cur]
                target_token = tp[(last // n) * n + last % n]
                found = 0
                for _ in range(n):
                    if found == 0:
                        valid = cur != -1
                        safe = bx * n + (cur if valid else 0)
                        draft_index, draft_token = ri[safe], cand[safe]
                        match = valid and draft_token == target_token
                        if match:
                            pred[last] = target_token
                            ai[bx * steps + num + 1] = draft_index
                        num += int(match)
                        last = draft_index if match else last
                        found = int(match) - int(not valid)
                        if valid and not match:
                            cur = rns[safe]
                if found != 1:
                    cont = 0
        atn[bx] = num
        pred[last] = tp[last]
    predicts.copy_(torch.tensor(pred))
    accept_index.copy_(torch.tensor(ai).view_as(accept_index))
    accept_token_num.copy_(torch.tensor(atn))


# --- the KV copy ---------------------------------------------------------------------------


def kv_buffers(seed: int, slots: int = 9) -> list[torch.Tensor]:
    """A K and a V buffer of different widths and dtypes, and a uint8 scale buffer."""
    g = rng(seed)
    return [
        torch.randn(slots, 2, 8, generator=g).to(torch.bfloat16),
        torch.randn(slots, 2, 5, generator=g),
        torch.randint(0, 255, (slots, 3), generator=g).to(torch.uint8),
    ]


def pointers(buffers: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """As memory_pool.py's _init_data_ptrs_and_strides builds them."""
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in buffers])
    return data_ptrs, strides


@pytest.mark.parametrize(
    ("tgt", "src"),
    [
        ([1, 2, 3, 8], [0, 1, 2, 4]),  # a shift by one: each target is the next one's source
        ([0, 1, 2], [2, 1, 0]),  # a swap through the middle
        ([5], [5]),  # onto itself, as the pool's warmup does with slot 0
    ],
)
def test_copy_all_layer_kv_cache_reads_every_source_before_writing(
    tgt: list[int], src: list[int]
) -> None:
    buffers = kv_buffers(seed=1)
    before = [b.clone() for b in buffers]
    expected = [b.clone() for b in buffers]
    ref_copy_all_layer_kv_cache(expected, tgt, src)
    ops.copy_all_layer_kv_cache_cpu(*pointers(buffers), torch.tensor(tgt), torch.tensor(src))
    for got, want in zip(buffers, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if tgt != src:
        assert all(not torch.equal(b, o) for b, o in zip(buffers, before, strict=True))
        # Row by row (each target written before later sources are read) differs:
        rowwise = [b.clone() for b in before]
        for b in rowwise:
            for t, s in zip(tgt, src, strict=True):
                b[t] = b[s]
        assert any(not torch.equal(b, r) for b, r in zip(buffers, rowwise, strict=True))


def test_copy_all_layer_kv_cache_with_no_slots_touches_nothing() -> None:
    buffers = kv_buffers(seed=2)
    before = [b.clone() for b in buffers]
    empty = torch.zeros(0, dtype=torch.int64)
    ops.copy_all_layer_kv_cache_cpu(*pointers(buffers), empty, empty)
    assert all(torch.equal(b, o) for b, o in zip(buffers, before, strict=True))


# --- the eagle.py ops ------------------------------------------------------------------------


def test_fill_bonus_tokens_takes_each_rows_last_accepted_token() -> None:
    bs, width = 5, 4
    accept_tokens = randint(0, 1000, bs, width, seed=3, dtype=torch.int32)
    accept_lens = torch.tensor([1, 4, 2, 3, 1], dtype=torch.int32)  # 1: only the bonus
    bonus = torch.full((bs,), -7, dtype=torch.int32)
    expected = bonus.tolist()
    ref_fill_bonus_tokens(accept_tokens.view(-1).tolist(), accept_lens.tolist(), expected, width)
    ops.fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus, width)
    assert bonus.tolist() == expected
    assert -7 not in expected


@pytest.mark.parametrize("seed", range(4))
def test_fill_accept_out_cache_loc_packs_the_accepted_slots(seed: int) -> None:
    bs, width = 4, 5
    accept_lens = randint(1, width + 1, bs, seed=seed).tolist()
    accept_lens[0] = 1  # an accept_len of 1: the root only
    rows = [
        [b * width + k for k in range(n)] + [-1] * (width - n) for b, n in enumerate(accept_lens)
    ]
    if seed % 2:  # a -1 within a row too, which the kernel skips wherever it is
        rows[-1][0] = -1
    if seed == 3:  # below -1: the kernel counts it as taking a place, yet writes nothing there
        rows[1][0] = -2
    accept_index = torch.tensor(rows, dtype=torch.int32)
    out_cache_loc = torch.randperm(bs * width, generator=rng(seed)) + 100
    accept_out = torch.zeros(bs * width, dtype=torch.int64)
    expected = accept_out.tolist()
    ref_fill_accept_out_cache_loc(accept_index.view(-1).tolist(), out_cache_loc.tolist(), expected)
    ops.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out)
    assert accept_out.tolist() == expected
    written = [x for x in expected if x]
    assert len(written) == int((accept_index > -1).sum()) and min(written) >= 100


# --- the req_to_token ops --------------------------------------------------------------------


def req_to_token_table(seed: int, rows: int = 6, pool_len: int = 16) -> torch.Tensor:
    return randint(1000, 9999, rows, pool_len, seed=seed, dtype=torch.int32)


@pytest.mark.parametrize(("topk", "num_cols"), [(1, 3), (2, 2), (3, 1)])
def test_assign_draft_cache_locs_contiguous_copies_each_requests_slots(
    topk: int, num_cols: int
) -> None:
    table = req_to_token_table(seed=4)
    req_pool_indices = torch.tensor([4, 0, 2])
    seq_lens = torch.tensor([0, 5, 16 - topk * num_cols])  # the last run ends at the row's end
    out = torch.full((3 * topk * num_cols,), -1, dtype=torch.int64)
    expected = out.tolist()
    ref_assign_draft_cache_locs_contiguous(
        req_pool_indices.tolist(),
        table.view(-1).tolist(),
        seq_lens.tolist(),
        expected,
        table.shape[1],
        topk,
        num_cols,
    )
    ops.assign_draft_cache_locs_contiguous_cpu(
        req_pool_indices, table, seq_lens, out, table.shape[1], topk, num_cols
    )
    assert out.tolist() == expected and -1 not in expected


def span_total(start: list[int], end: list[int]) -> int:
    return sum(e - s for s, e in zip(start, end, strict=True))


SPANS = [  # (start, end) per request: lengths differ, one is empty
    ([3, 0, 7, 2], [6, 4, 7, 3]),
    ([0, 10], [16, 11]),
]


@pytest.mark.parametrize(("start", "end"), SPANS)
def test_assign_extend_cache_locs_packs_each_requests_span(
    start: list[int], end: list[int]
) -> None:
    table = req_to_token_table(seed=5)
    req_pool_indices = torch.tensor([5, 1, 3, 0][: len(start)])
    out = torch.full((span_total(start, end) + 2,), -1, dtype=torch.int64)
    expected = out.tolist()
    ref_assign_extend_cache_locs(
        req_pool_indices.tolist(), table.view(-1).tolist(), start, end, expected, table.shape[1]
    )
    ops.assign_extend_cache_locs_cpu(
        req_pool_indices,
        table,
        torch.tensor(start, dtype=torch.int32),
        torch.tensor(end, dtype=torch.int32),
        out,
        table.shape[1],
    )
    assert out.tolist() == expected
    assert -1 not in expected[:-2] and expected[-2:] == [-1, -1]  # past the spans: untouched


@pytest.mark.parametrize(("start", "end"), SPANS)
def test_assign_req_to_token_pool_writes_each_requests_span(
    start: list[int], end: list[int]
) -> None:
    table = req_to_token_table(seed=6)
    before = table.clone()
    req_pool_indices = torch.tensor([5, 1, 3, 0][: len(start)])
    out_cache_loc = torch.arange(span_total(start, end)) + 100
    expected = table.view(-1).tolist()
    ref_assign_req_to_token_pool(
        req_pool_indices.tolist(), expected, start, end, out_cache_loc.tolist(), table.shape[1]
    )
    ops.assign_req_to_token_pool_cpu(
        req_pool_indices,
        table,
        torch.tensor(start),
        torch.tensor(end),
        out_cache_loc,
        table.shape[1],
    )
    assert table.view(-1).tolist() == expected
    changed = int((table != before).sum())
    assert changed == out_cache_loc.numel()  # each slot of each span, nothing else


# --- the tree ops ----------------------------------------------------------------------------


def tree_buffers(
    bs: int, n: int, seq_lens: list[int], mode: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """As eagle_utils.build_tree_kernel_efficient allocates them (mask filled True)."""
    size = n * n * bs if mode == QLEN_ONLY else sum(seq_lens) * n + n * n * bs
    retrieve = torch.full((3, bs, n), -1, dtype=torch.long)
    return (
        torch.ones(size, dtype=torch.bool),
        torch.full((bs * n,), -5, dtype=torch.long),
        retrieve[0],
        retrieve[1],
        retrieve[2],
    )


def build_tree(
    fn, parent_list, selected_index, seq_lens, topk, depth, n, mode
) -> tuple[torch.Tensor, ...]:
    bufs = tree_buffers(len(seq_lens), n, seq_lens, mode)
    fn(parent_list, selected_index, torch.tensor(seq_lens), *bufs, topk, depth, n, mode)
    return bufs


def chain_inputs(bs: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk = 1, as organize_draft_results lays it out: parents [-1, 0, .., steps - 2], every
    step's token selected."""
    parent_list = torch.arange(-1, steps - 1).repeat(bs, 1)
    return parent_list, torch.arange(steps).repeat(bs, 1)


@pytest.mark.parametrize("mode", [QLEN_ONLY, FULL_MASK])
def test_build_tree_of_a_chain(mode: int) -> None:
    steps, seq_lens = 3, [5, 2]
    n = steps + 1
    mask, positions, index, next_token, next_sibling = build_tree(
        ops.build_tree_kernel_efficient_cpu, *chain_inputs(2, steps), seq_lens, 1, steps, n, mode
    )
    assert index.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert next_token.tolist() == [[1, 2, 3, -1]] * 2
    assert next_sibling.tolist() == [[-1] * n] * 2
    assert positions.tolist() == [5, 6, 7, 8, 2, 3, 4, 5]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if mode == QLEN_ONLY:
        assert torch.equal(mask.view(2, n, n), causal.expand(2, n, n))
    else:
        first, second = mask[: n * (5 + n)].view(n, 5 + n), mask[n * (5 + n) :].view(n, 2 + n)
        for block, seq_len in ((first, 5), (second, 2)):
            assert block[:, :seq_len].all()  # the prefix, as the caller filled it
            assert torch.equal(block[:, seq_len:], causal)


def test_build_tree_of_two_branches() -> None:
    """topk 2, 2 steps: score entries 0, 1 are the root's children, 2..5 their children (entry
    e's parent: parent_list[e // 2], a score index). Selected: 0, 1 and 4, a child of 1."""
    parent_list, selected = torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 4]])
    mask, positions, _, next_token, next_sibling = build_tree(
        ops.build_tree_kernel_efficient_cpu, parent_list, selected, [7], 2, 2, 4, QLEN_ONLY
    )
    assert next_token.tolist() == [[1, -1, 3, -1]]
    assert next_sibling.tolist() == [[-1, 2, -1, -1]]
    assert positions.tolist() == [7, 8, 8, 9]
    assert mask.view(4, 4).int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 0, 1, 1],
    ]


def random_tree_inputs(
    seed: int, bs: int, topk: int, steps: int, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected: sorted distinct score indices, as organize_draft_results picks them (odd seeds:
    with repeats, which it never makes, to pin the kernel's first-match search); parents: any
    score index, so some parents are not among the selected and some walks loop."""
    g = rng(seed)
    num_scores = topk + (steps - 1) * topk * topk
    if seed % 2:
        selected = torch.randint(0, num_scores, (bs, n - 1), generator=g).sort().values
    else:
        selected = torch.stack(
            [torch.randperm(num_scores, generator=g)[: n - 1].sort().values for _ in range(bs)]
        )
    parent_list = torch.randint(0, num_scores, (bs, topk * (steps - 1) + 1), generator=g)
    parent_list[:, 0] = -1
    return parent_list, selected


@pytest.mark.parametrize("mode", [QLEN_ONLY, FULL_MASK])
@pytest.mark.parametrize(("topk", "steps", "n"), [(1, 4, 5), (2, 3, 6), (3, 3, 8), (4, 1, 5)])
def test_build_tree_matches_the_kernel_on_random_trees(
    mode: int, topk: int, steps: int, n: int
) -> None:
    for seed in range(5):
        parent_list, selected = random_tree_inputs(seed, 3, topk, steps, n)
        if steps == 1:
            parent_list = parent_list[:, :0]  # no parents: every token is the root's child
        seq_lens = randint(1, 9, 3, seed=seed).tolist()
        args = (parent_list, selected, seq_lens, topk, steps, n, mode)
        got = build_tree(ops.build_tree_kernel_efficient_cpu, *args)
        want = build_tree(ref_build_tree, *args)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), (seed, g, w)


def test_build_tree_refuses_a_bit_packed_mask() -> None:
    with pytest.raises(NotImplementedError, match="QLEN_ONLY_BITPACKING"):
        build_tree(
            ops.build_tree_kernel_efficient_cpu,
            *chain_inputs(1, 2),
            [3],
            1,
            2,
            3,
            QLEN_ONLY_BITPACKING,
        )


def verify_buffers(bs: int, n: int, steps: int) -> tuple[torch.Tensor, ...]:
    """As eagle_utils.eagle_sample allocates them."""
    return (
        torch.zeros(bs * n, dtype=torch.int32),
        torch.full((bs, steps), -1, dtype=torch.int32),
        torch.full((bs,), -9, dtype=torch.int32),
    )


def verify(fn, candidates, index, next_token, next_sibling, target, steps) -> tuple:
    predicts, accept_index, accept_num = verify_buffers(*candidates.shape, steps)
    fn(predicts, accept_index, accept_num, candidates, index, next_token, next_sibling, target)
    return predicts, accept_index, accept_num


def test_verify_a_chain_accepts_up_to_the_first_mismatch() -> None:
    steps, n = 3, 4
    _, _, index, next_token, next_sibling = build_tree(
        ops.build_tree_kernel_efficient_cpu,
        *chain_inputs(3, steps),
        [4, 4, 4],
        1,
        steps,
        n,
        QLEN_ONLY,
    )
    candidates = torch.tensor([[50, 11, 12, 13], [60, 21, 22, 23], [70, 31, 32, 33]])
    target = torch.tensor(  # what the target predicts after each node
        [[11, 12, 13, 14], [21, 99, 23, 24], [98, 32, 33, 34]]
    )
    predicts, accept_index, accept_num = verify(
        ops.verify_tree_greedy_cpu, candidates, index, next_token, next_sibling, target, n
    )
    assert accept_num.tolist() == [3, 1, 0]  # all drafts; one; none (accept_len 1)
    assert accept_index.tolist() == [[0, 1, 2, 3], [4, 5, -1, -1], [8, -1, -1, -1]]
    assert predicts.tolist() == [11, 12, 13, 14, 21, 99, 0, 0, 98, 0, 0, 0]


def test_verify_a_tree_tries_siblings_in_order() -> None:
    _, _, index, next_token, next_sibling = build_tree(
        ops.build_tree_kernel_efficient_cpu,
        torch.tensor([[-1, 0, 1]]),
        torch.tensor([[0, 1, 4]]),
        [7],
        2,
        2,
        4,
        QLEN_ONLY,
    )  # the two-branch tree above: 1 and 2 under the root, 3 under 2
    candidates, target = torch.tensor([[5, 8, 9, 6]]), torch.tensor([[9, 0, 6, 4]])
    predicts, accept_index, accept_num = verify(
        ops.verify_tree_greedy_cpu, candidates, index, next_token, next_sibling, target, 3
    )
    assert accept_index.tolist() == [[0, 2, 3]] and accept_num.tolist() == [2]
    assert predicts.tolist() == [9, 0, 6, 4]


def random_verify_inputs(
    seed: int, bs: int, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random trees (each node's parent an earlier node), children linked as the build kernel
    links them, over a vocabulary of 3 so that drafts often match."""
    g = rng(seed)
    next_token = torch.full((bs, n), -1)
    next_sibling = torch.full((bs, n), -1)
    for b in range(bs):
        children: dict[int, list[int]] = defaultdict(list)
        for k in range(1, n):
            children[int(torch.randint(0, k, (1,), generator=g))].append(k)
        for parent, kids in children.items():
            next_token[b, parent] = kids[0]
            for a, c in itertools.pairwise(kids):
                next_sibling[b, a] = c
    index = torch.arange(bs * n).view(bs, n)
    candidates = torch.randint(0, 3, (bs, n), generator=g)
    target = torch.randint(0, 3, (bs, n), generator=g)
    return candidates, index, next_token, next_sibling, target


@pytest.mark.parametrize(("n", "steps"), [(2, 2), (5, 3), (8, 4), (8, 8)])
def test_verify_matches_the_kernel_on_random_trees(n: int, steps: int) -> None:
    lengths = set()
    for seed in range(12):
        inputs = random_verify_inputs(seed, 4, n)
        got = verify(ops.verify_tree_greedy_cpu, *inputs, steps)
        want = verify(ref_verify_tree_greedy, *inputs, steps)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), (seed, g, w)
        lengths.update(got[2].tolist())
    assert len(lengths) > 1  # the draws accept different numbers of drafts


# --- installed through SGLang's plugin registry ------------------------------------------------


MODULES = {
    "cache_move": "sglang.kernels.ops.kvcache.cache_move",
    "eagle": "sglang.kernels.ops.speculative.eagle",
    "cache_locs": "sglang.kernels.ops.speculative.cache_locs",
    "spec_tree": "sglang.kernels.ops.speculative.spec_tree",
    "allocation": "sglang.srt.mem_cache.allocation",
}


@pytest.fixture
def cpu_branches(monkeypatch: pytest.MonkeyPatch) -> dict[str, ModuleType]:
    """SGLang's five modules as SGLANG_USE_CPU_ENGINE=1 imports them (the `_is_cpu` branch
    taken, each name bound to the shim's stand-in), our hooks applied to them, in a registry of
    this test's own; all undone afterwards."""
    import importlib

    modules = {key: importlib.import_module(path) for key, path in MODULES.items()}
    for module in modules.values():
        for flag in [f for f in vars(module) if f.startswith("_is_")]:
            monkeypatch.setattr(module, flag, flag == "_is_cpu")
    for target in ops.TARGETS:
        path, name = target.rsplit(".", 1)
        kernel = name.removeprefix("sgl_")  # spec_tree imports them `as sgl_...`
        monkeypatch.setattr(
            importlib.import_module(path), name, getattr(sgl_kernel, kernel), raising=False
        )
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    return modules


def test_register_replaces_each_name_the_cpu_branches_call(
    cpu_branches: dict[str, ModuleType],
) -> None:
    import importlib

    shims = {}
    for target in ops.TARGETS:
        path, name = target.rsplit(".", 1)
        shims[target] = getattr(importlib.import_module(path), name)
    installed = ops.register()
    assert installed == list(ops.TARGETS) and len(installed) == 8
    HookRegistry.apply_hooks()
    for target, op in ops.TARGETS.items():
        path, name = target.rsplit(".", 1)
        hooked = getattr(importlib.import_module(path), name)
        # A REPLACE hook on a function installs a wrapper that calls ours.
        assert hooked.__wrapped__ is shims[target]
        assert inspect.getclosurevars(hooked).nonlocals["hook"] is op
    with pytest.raises(NotImplementedError):
        shims[installed[0]]()


def test_sglangs_cpu_branches_run_on_our_ops(cpu_branches: dict[str, ModuleType]) -> None:
    """Each CPU call site as SGLang writes it (argument order, keywords), on small inputs."""
    m = cpu_branches
    ops.register()
    HookRegistry.apply_hooks()

    # memory_pool.py's warmup (slot 0 onto itself, num_locs 1 of a dummy loc), then a move.
    buffers = kv_buffers(seed=7)
    expected = [b.clone() for b in buffers]
    data_ptrs, strides = pointers(buffers)
    dummy = torch.zeros(128, dtype=torch.int64)
    m["cache_move"].copy_all_layer_kv_cache_func(data_ptrs, strides, dummy, dummy, 1, 128, {})
    tgt, src = torch.tensor([3, 4, 0, 0]), torch.tensor([4, 5, 0, 0])
    m["cache_move"].copy_all_layer_kv_cache_func(data_ptrs, strides, tgt, src, 2, 2, {})
    ref_copy_all_layer_kv_cache(expected, [3, 4], [4, 5])
    assert all(torch.equal(g, w) for g, w in zip(buffers, expected, strict=True))

    # eagle_worker_common: the bonus tokens; spec_utils.move_accept_tokens: the KV move plan.
    accept_index = torch.tensor([[0, 1, -1], [3, -1, -1]], dtype=torch.int32)
    accept_lens = torch.tensor([2, 1], dtype=torch.int32)
    accept_tokens = torch.tensor([[7, 8, 9], [4, 5, 6]], dtype=torch.int32)
    bonus = torch.empty_like(accept_lens, dtype=torch.int32)
    m["eagle"].fill_bonus_tokens_func(accept_tokens, accept_lens, bonus, 3, 2)
    assert bonus.tolist() == [8, 4]
    out_cache_loc = torch.tensor([40, 41, 42, 43, 44, 45])
    accept_out = torch.zeros(6, dtype=torch.int64)
    m["eagle"].fill_accept_out_cache_loc_func(accept_index, out_cache_loc, accept_out, 6)
    assert accept_out.tolist() == [40, 41, 43, 0, 0, 0]
    front = torch.zeros(6, dtype=torch.int64)
    m["cache_locs"].fill_front_out_cache_loc_func(accept_lens, out_cache_loc, front)
    assert front.tolist() == [40, 41, 43, 0, 0, 0]

    # The req_to_token ops.
    table = req_to_token_table(seed=8)
    rpi, seq_lens = torch.tensor([2, 0]), torch.tensor([3, 9])
    draft = torch.empty(2 * 3, dtype=torch.int64)
    m["cache_locs"].assign_draft_cache_locs_contiguous_func(rpi, table, seq_lens, draft, 1, 3)
    assert draft.tolist() == table[2, 3:6].tolist() + table[0, 9:12].tolist()
    locs = m["cache_locs"].assign_extend_cache_locs_func(
        rpi, table, seq_lens, seq_lens + 4, 2, 4, "cpu"
    )
    assert locs.tolist() == table[2, 3:7].tolist() + table[0, 9:13].tolist()
    m["allocation"].assign_req_to_token_pool_func(
        rpi, table, seq_lens, seq_lens + 2, torch.tensor([1, 2, 3, 4]), 2
    )
    assert table[2, 3:5].tolist() == [1, 2] and table[0, 9:11].tolist() == [3, 4]

    # eagle_utils: the tree and its greedy verification (keywords, `retrieve_*` spelled right).
    bufs = tree_buffers(1, 4, [7], QLEN_ONLY)
    m["spec_tree"].build_tree_kernel_efficient_func(
        torch.tensor([[-1, 0, 1]]),
        torch.tensor([[0, 1, 4]]),
        torch.tensor([7]),
        *bufs,
        2,
        2,
        4,
        m["spec_tree"].TreeMaskMode.QLEN_ONLY,
    )
    _, positions, index, next_token, next_sibling = bufs
    assert positions.tolist() == [7, 8, 8, 9]
    predicts, accept, accept_num = verify_buffers(1, 4, 3)
    result = m["spec_tree"].verify_tree_greedy_func(
        predicts=predicts,
        accept_index=accept,
        accept_token_num=accept_num,
        candidates=torch.tensor([[5, 8, 9, 6]]),
        retrieve_index=index,
        retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling,
        target_predict=torch.tensor([[9, 0, 6, 4]]),
        topk=2,
    )
    assert result[1].tolist() == [[0, 2, 3]] and result[2].tolist() == [2]
