"""Pure-torch CPU versions of the eight `sgl_kernel` ops SGLang 0.5.23's EAGLE path calls on CPU.

With `SGLANG_USE_CPU_ENGINE=1` SGLang's speculative kernels take an `if _is_cpu:` branch that
calls `sgl_kernel.*_cpu` ops, bound at import (`from sgl_kernel import ...`). Only a compiled
sgl-kernel CPU build has them; with our import-only shim every call raises NotImplementedError,
so an EAGLE-3 server fails at the KV pool's warmup copy and then at every draft and verify
step. Each function here translates the Triton kernel of the same name, which sits beside its
CPU call site, and takes the arguments that call site passes; `register` installs them as
REPLACE hooks on the names those branches call.

The Triton kernels index raw memory (`req_to_token + row * pool_len`, `accept_tokens + i`), so
these read and write through flat views: buffers must be contiguous, as the kernels assume.
The tree ops take any topk; only QLEN_ONLY_BITPACKING masks are refused, as the Triton kernel
refuses them (the CPU engine builds QLEN_ONLY masks).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

FULL_MASK, QLEN_ONLY = 0, 1  # sglang.kernels.ops.speculative.spec_tree.TreeMaskMode


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """In place: in every KV buffer (base address data_ptrs[i], slot size strides[i] bytes),
    slot tgt_loc[j] <- slot src_loc[j]. All sources are read before any target is written,
    so overlapping moves are safe, as in the Triton kernel."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    if min(int(tgt.min()), int(src.min())) < 0:
        raise ValueError("copy_all_layer_kv_cache_cpu: negative KV slot")
    num_slots = max(int(tgt.max()), int(src.max())) + 1  # only the slots this move touches
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (num_slots * stride)).from_address(base)
        slots = torch.frombuffer(raw, dtype=torch.uint8).view(num_slots, stride)
        slots[tgt] = slots[src]  # the gather copies the sources out first


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """In place: bonus_tokens[i] = accept_tokens' row i (width accept_stride) at accept_lens[i] - 1,
    the last accepted slot (accept_lens counts the bonus token)."""
    bs = accept_lens.numel()
    last = torch.arange(bs) * accept_stride + accept_lens.long() - 1
    bonus_tokens.view(-1)[:bs] = accept_tokens.reshape(-1)[last].to(bonus_tokens.dtype)


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """In place: pack out_cache_loc[i] for every accepted i in accept_index (flattened, -1 for
    none) into accept_out_cache_loc, in order; the rest of it is left as it was."""
    index = accept_index.reshape(-1).long()
    counted = (index != -1).long()
    dst = torch.cumsum(counted, 0) - counted  # how many entries before this one are not -1
    kept = index > -1
    out = accept_out_cache_loc.view(-1)
    out[dst[kept]] = out_cache_loc.view(-1)[index[kept]].to(out.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_cols: int,
) -> None:
    """In place: out_cache_loc's i-th run of topk * num_cols slots <- request i's req_to_token
    row (of pool_len) from seq_lens[i] on."""
    bs, width = seq_lens.numel(), topk * num_cols
    starts = req_pool_indices.long() * pool_len + seq_lens.long()
    flat = (starts.unsqueeze(1) + torch.arange(width)).view(-1)
    out = out_cache_loc.view(-1)
    out[: bs * width] = req_to_token.view(-1)[flat].to(out.dtype)


def _ragged_spans(
    req_pool_indices: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    pool_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every slot of [start, end) of each request's req_to_token row: its flat index there,
    and its index in the packed buffer, which holds the requests back to back in batch order
    (each request's run starts at the sum of the earlier ones' end - start, as in the kernels)."""
    bs = req_pool_indices.numel()
    start, end = start_offset[:bs].long(), end_offset[:bs].long()
    lens = end - start
    packed_start = torch.cumsum(lens, 0) - lens
    counts = lens.clamp(min=0)
    row = torch.repeat_interleave(torch.arange(bs), counts)
    within = torch.arange(row.numel()) - (torch.cumsum(counts, 0) - counts)[row]
    pool = req_pool_indices.long()[row] * pool_len + start[row] + within
    return pool, packed_start[row] + within


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """In place: out_cache_loc <- req_to_token[req_pool_indices[i], start[i]:end[i]] for each
    request, packed back to back."""
    pool, packed = _ragged_spans(req_pool_indices, start_offset, end_offset, pool_len)
    out = out_cache_loc.view(-1)
    out[packed] = req_to_token.view(-1)[pool].to(out.dtype)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """In place, assign_extend_cache_locs_cpu reversed: req_to_token[req_pool_indices[i],
    start[i]:end[i]] <- each request's run of the packed out_cache_loc."""
    pool, packed = _ragged_spans(req_pool_indices, start_offset, end_offset, pool_len)
    table = req_to_token.view(-1)
    table[pool] = out_cache_loc.view(-1)[packed].to(table.dtype)


def _parent_nodes(selected: list[int], parents: list[int], topk: int) -> list[int | None]:
    """Each tree node's parent: node k > 0 is draft token selected[k - 1] (an index into the
    draft's score list), node 0 the root. The parent is the root when selected // topk is 0,
    else the first node holding token parents[selected // topk]; None when none holds it."""
    first_node: dict[int, int] = {}
    for k, token in enumerate(selected, start=1):
        first_node.setdefault(token, k)
    nodes: list[int | None] = [None]
    for token in selected:
        expanded = token // topk
        nodes.append(0 if expanded == 0 else first_node.get(parents[expanded]))
    return nodes


def build_tree_kernel_efficient_cpu(
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
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """In place: build each request's draft tree of draft_token_num nodes (root first).

    - retrieve_index [bs, n]: b * n + k;
    - retrieve_next_token / retrieve_next_sibling [bs, n] (the caller fills them with -1): a
      node's first child, and its next sibling, children in ascending order;
    - positions [bs * n]: seq_len + the node's depth;
    - tree_mask: row k of request b is True at the root, at k and at k's ancestors (a walk of
      at most `depth` steps), False at the other nodes. QLEN_ONLY: an n x n block per
      request; FULL_MASK: n rows of seq_len + n, whose first seq_len columns are left as the
      caller filled them.
    """
    mode = int(tree_mask_mode)
    if mode not in (FULL_MASK, QLEN_ONLY):
        raise NotImplementedError(
            f"build_tree_kernel_efficient_cpu: tree_mask_mode {mode} (QLEN_ONLY_BITPACKING) is "
            "not supported, as in SGLang's Triton kernel; the CPU engine uses QLEN_ONLY"
        )
    n = draft_token_num
    bs = verified_seq_len.shape[0]
    seq_lens = verified_seq_len.tolist()
    flat_mask, flat_positions = tree_mask.view(-1), positions.view(-1)
    retrieve_index.view(-1)[: bs * n] = torch.arange(bs * n)
    mask_start = 0
    for b, seq_len in enumerate(seq_lens):
        parent = _parent_nodes(selected_index[b, : n - 1].tolist(), parent_list[b].tolist(), topk)
        first_child = retrieve_next_token[b].tolist()
        next_sibling = retrieve_next_sibling[b].tolist()
        for k in range(n - 1, 0, -1):  # push front, last node first: children end up ascending
            p = parent[k]
            if p is None:
                continue
            if first_child[p] != -1:
                next_sibling[k] = first_child[p]
            first_child[p] = k
        retrieve_next_token[b] = torch.tensor(first_child)
        retrieve_next_sibling[b] = torch.tensor(next_sibling)

        rows = [[True] + [False] * (n - 1) for _ in range(n)]
        node_depth = [0] * n
        for k in range(1, n):
            node = k
            for _ in range(depth):
                node_depth[k] += 1
                rows[k][node] = True
                node = parent[node]
                if not node:  # the root, or a parent not found
                    break
        flat_positions[b * n : (b + 1) * n] = torch.tensor(node_depth) + seq_len

        block = torch.tensor(rows)
        if mode == QLEN_ONLY:
            flat_mask[b * n * n : (b + 1) * n * n] = block.view(-1)
        else:
            width = seq_len + n
            flat_mask[mask_start : mask_start + n * width].view(n, width)[:, seq_len:] = block
            mask_start += n * width


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """In place: walk each request's draft tree from the root, at each level accepting the first
    child (by sibling order) whose token is the target's prediction at the last accepted node.

    accept_index [bs, steps] gets the accepted nodes' retrieve indices (root first, the rest
    left as they were), accept_token_num [bs] how many drafts were accepted (at most
    steps - 1), and predicts [bs * n] at each accepted node the target's token there (the
    next node's token, and after the last one the bonus token). The `retrive_*` spelling is
    the sgl-kernel schema's, which SGLang's CPU call site passes by keyword.
    """
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    tokens = candidates.tolist()
    index = retrive_index.tolist()
    first_child, next_sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    predicted: dict[int, int] = {}
    for b in range(bs):
        last = index[b][0]
        accepted = [last]
        node = 0
        for _ in range(steps - 1):
            want = target[last]
            child = first_child[b][node]
            for _ in range(n):  # the kernel's bound on the sibling walk
                if child == -1 or tokens[b][child] == want:
                    break
                child = next_sibling[b][child]
            else:
                child = -1  # n siblings and no match: the kernel gives up too
            if child == -1:
                break
            predicted[last] = want
            last, node = index[b][child], child
            accepted.append(last)
        predicted[last] = target[last]
        accept_index[b, : len(accepted)] = torch.tensor(accepted)
        accept_token_num[b] = len(accepted) - 1
    flat_predicts = predicts.view(-1)
    for i, token in predicted.items():
        flat_predicts[i] = token


# The names SGLang's CPU branches call, each bound there by `from sgl_kernel import ...`.
TARGETS: dict[str, Callable[..., None]] = {
    "sglang.kernels.ops.kvcache.cache_move.copy_all_layer_kv_cache_cpu": (
        copy_all_layer_kv_cache_cpu
    ),
    "sglang.kernels.ops.speculative.eagle.fill_bonus_tokens_cpu": fill_bonus_tokens_cpu,
    "sglang.kernels.ops.speculative.eagle.fill_accept_out_cache_loc_cpu": (
        fill_accept_out_cache_loc_cpu
    ),
    "sglang.kernels.ops.speculative.cache_locs.assign_draft_cache_locs_contiguous_cpu": (
        assign_draft_cache_locs_contiguous_cpu
    ),
    "sglang.kernels.ops.speculative.cache_locs.assign_extend_cache_locs_cpu": (
        assign_extend_cache_locs_cpu
    ),
    "sglang.kernels.ops.speculative.spec_tree.sgl_build_tree_kernel_efficient_cpu": (
        build_tree_kernel_efficient_cpu
    ),
    "sglang.kernels.ops.speculative.spec_tree.sgl_verify_tree_greedy_cpu": (verify_tree_greedy_cpu),
    "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
}


def shim_installed() -> bool:
    """Whether `sgl_kernel` is our import-only shim (shims/sgl_kernel), not a compiled build
    whose own CPU ops these must not displace."""
    import sgl_kernel

    return str(getattr(sgl_kernel, "__version__", "")).endswith("+cpushim")


def register() -> list[str]:
    """Register the REPLACE hooks, where sgl_kernel is the shim; SGLang applies them after
    every plugin has run. The names exist only where SGLang imported these modules with
    SGLANG_USE_CPU_ENGINE=1."""
    if not shim_installed():
        return []
    for target, op in TARGETS.items():
        HookRegistry.register(target, op, HookType.REPLACE)
    return list(TARGETS)
