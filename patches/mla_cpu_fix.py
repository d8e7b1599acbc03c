"""Work around SGLang 0.5.23's wrong DeepSeek MLA prefill on CPU (`torch_native` attention).

`AttentionBackendRegistry.get_handler("torch_native")` finds no handler and falls back to the
triton one, which picks the non-absorbed MHA path for prefill. That path calls attention with
`save_kv_cache=False`, and `TorchNativeAttnBackend.forward_extend` then ignores the K/V it is
given and reads the KV pool, which for MLA holds the compressed latent: every layer after the
first attends to garbage (or crashes when kv_lora_rank != v_head_dim). Routing `torch_native`
to the absorbed-MLA path, through the module's own MLA-subtype dispatch, fixes it; GPU
backends are untouched. Only DeepSeek-family attention consults this registry.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

TARGET = (
    "sglang.srt.models.deepseek_common.attention_backend_handler."
    "AttentionBackendRegistry.get_handler"
)


def _handle_attention_torch_native(attn: Any, forward_batch: Any) -> Any:
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        _dispatch_mla_subtype,
    )

    return _dispatch_mla_subtype(attn, forward_batch)


def _route_torch_native(handler: Any, cls: type, backend_name: str) -> Any:
    if backend_name == "torch_native":
        return _handle_attention_torch_native
    return handler


def register() -> None:
    HookRegistry.register(TARGET, _route_torch_native, HookType.AFTER)
