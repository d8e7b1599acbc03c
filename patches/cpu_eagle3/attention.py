"""SGLang's CPU `torch_native` attention taught the three forwards EAGLE-3 serving runs (topk 1).

SGLang 0.5.23 wires CPU speculative decoding only for `intel_amx` (compiled AMX kernels);
with `torch_native` the draft worker refuses to start ("EAGLE is not supported in decode
attention backend torch_native"). What the modes need, as `intel_amx_backend.py` does them:
- target verify (the target scores the draft chain): the batch carries no extend fields, so
  each request extends its committed prefix by `draft_token_num` tokens, causally (topk 1:
  a chain; a tree would need the custom mask, refused);
- draft extend (the draft over the verified window): an ordinary extend, the batch's own
  fields are right;
- multi-step draft decode: step i of `speculative_num_steps - 1` attends to the prefix plus
  draft tokens 0..i, whose KV slots `assign_draft_cache_locs` put in `req_to_token` right
  after the prefix, so the plain decode path with `seq_lens + i + 1` reads them.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

BACKEND = "torch_native"
TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
FACTORY = "sglang.srt.speculative.draft_utils.DraftBackendFactory"


class TreeDraftsUnsupported(NotImplementedError):
    """A token tree (topk > 1) needs a custom verify mask this backend does not build."""


def _require_chain(topk: int) -> None:
    if topk != 1:
        raise TreeDraftsUnsupported(
            f"CPU EAGLE-3 serving (torch_native attention) drafts a chain: "
            f"--speculative-eagle-topk 1, got {topk}"
        )


def _init_forward_metadata(original: Any, self: Any, forward_batch: Any) -> None:
    """The verify extend's lengths, derived once per forward: (kv lens, prefix lens, extend
    lens) per request, or None outside target verify."""
    original(self, forward_batch)
    self.verify_lens = None
    if forward_batch.forward_mode.is_target_verify():
        spec_info = forward_batch.spec_info
        _require_chain(spec_info.tree_topk)
        prefix = forward_batch.seq_lens
        extend = torch.full_like(prefix, spec_info.draft_token_num)
        self.verify_lens = (prefix + extend, prefix, extend)


def _sdpa_extend(
    original: Any,
    self: Any,
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    if getattr(self, "verify_lens", None) is not None:
        seq_lens, extend_prefix_lens, extend_seq_lens = self.verify_lens
    return original(
        self,
        query,
        output,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_prefix_lens,
        extend_seq_lens,
        *args,
        **kwargs,
    )


def _sdpa_decode(
    original: Any,
    self: Any,
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    draft_seq_lens = getattr(self, "draft_seq_lens", None)
    if draft_seq_lens is not None:
        seq_lens = draft_seq_lens
    return original(
        self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
        *args, **kwargs,
    )  # fmt: skip


class TorchNativeMultiStepDraftBackend:
    """One torch_native backend per draft decode step (the `*MultiStepDraftBackend` shape the
    EAGLE worker drives: `attn_backends[i]` runs step i)."""

    def __init__(self, model_runner: Any, topk: int, speculative_num_steps: int) -> None:
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        _require_chain(topk)
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [
            TorchNativeAttnBackend(model_runner) for _ in range(speculative_num_steps - 1)
        ]

    def init_forward_metadata(self, forward_batch: Any) -> None:
        for step, backend in enumerate(self.attn_backends):
            backend.init_forward_metadata(forward_batch)
            backend.draft_seq_lens = forward_batch.seq_lens + step + 1


def _configured_backend(factory: Any, decode: bool) -> str:
    """The backend DraftBackendFactory._create_backend would look up."""
    from sglang.srt.runtime_context import attention_backends

    prefill_backend, decode_backend = attention_backends()
    return factory.draft_attn_backend or (decode_backend if decode else prefill_backend)


def _stamp(backend: Any) -> Any:
    backend.prefill_attention_backend_str = BACKEND
    backend.decode_attention_backend_str = BACKEND
    return backend


def _create_decode_backend(original: Any, factory: Any) -> Any:
    if factory.speculative_num_steps <= 1 or _configured_backend(factory, decode=True) != BACKEND:
        return original(factory)
    backend = TorchNativeMultiStepDraftBackend(
        factory.draft_model_runner, factory.topk, factory.speculative_num_steps
    )
    for child in backend.attn_backends:
        _stamp(child)
    return _stamp(backend)


def _create_draft_extend_backend(original: Any, factory: Any) -> Any:
    from sglang.srt.runtime_context import get_spec

    decode = get_spec().speculative_attention_mode == "decode"
    if _configured_backend(factory, decode=decode) != BACKEND:
        return original(factory)
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return _stamp(TorchNativeAttnBackend(factory.draft_model_runner))


def register() -> list[str]:
    """Hook the torch_native backend and the draft backend factory; returns the targets."""
    hooks = {
        f"{TORCH_NATIVE}.init_forward_metadata": _init_forward_metadata,
        f"{TORCH_NATIVE}._run_sdpa_forward_extend": _sdpa_extend,
        f"{TORCH_NATIVE}._run_sdpa_forward_decode": _sdpa_decode,
        f"{FACTORY}.create_decode_backend": _create_decode_backend,
        f"{FACTORY}.create_draft_extend_backend": _create_draft_extend_backend,
    }
    for target, hook in hooks.items():
        HookRegistry.register(target, hook, HookType.AROUND)
    return list(hooks)
