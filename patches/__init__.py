"""Our SGLang plugin: per-request hidden-state capture for EAGLE-3 training data.

Loaded by SGLang through the `sglang.srt.plugins` entry point (see pyproject.toml) in every
server process. It does nothing unless its environment asks for it (patches/settings.py):
- HIDDEN_CAPTURE_DIR set: capture prefill hidden states of requests whose rid starts with
  HIDDEN_CAPTURE_RID_PREFIX into dumps under that directory (patches/capture_hook.py),
  quantized to FP8 when HIDDEN_CAPTURE_QUANTIZE=fp8_e4m3;
- on by default, HIDDEN_CAPTURE_MLA_CPU_FIX=0 turns it off: repair DeepSeek MLA prefill on
  SGLang's CPU `torch_native` attention (patches/mla_cpu_fix.py);
- on SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1): define the sgl_kernel CPU ops SGLang's
  Qwen-VL multimodal processors need to import, where missing (patches/cpu_vl_ops.py);
- on SGLang's CPU engine with HIDDEN_CAPTURE_CPU_EAGLE3=1 (our launcher sets it when it serves
  a draft on CPU): the ops and attention modes EAGLE-3 serving needs (patches/cpu_eagle3/).

Design: docs/design/capture-plugin.md.
"""

from __future__ import annotations

import logging
import os

from patches.settings import ENV_CPU_ENGINE, CaptureSettings

logger = logging.getLogger(__name__)


def register() -> None:
    """Entry point: register our hooks; SGLang applies them after every plugin has run."""
    settings = CaptureSettings.from_env()
    cpu_vl_ops_defined: list[str] = []
    cpu_eagle3_hooks: list[str] = []
    # Read as SGLang reads it (sglang/srt/platforms); the ops must exist before any process
    # imports sglang.srt.models.qwen3_5, and plugins run first in each.
    if os.environ.get(ENV_CPU_ENGINE) == "1":
        from patches import cpu_vl_ops

        cpu_vl_ops_defined = cpu_vl_ops.register()
        if settings.cpu_eagle3:
            from patches import cpu_eagle3

            cpu_eagle3_hooks = cpu_eagle3.register()
    if settings.mla_cpu_fix:
        from patches import mla_cpu_fix

        mla_cpu_fix.register()
    if settings.capture_enabled:
        from patches import capture_hook

        capture_hook.register(settings)
    # Loud on purpose: a plugin that silently fails to load looks exactly like no capture.
    logger.warning(
        "hidden-capture plugin ACTIVE in pid %d: capture=%s dump_dir=%s rid_prefix=%r "
        "max_pending_bytes=%d quantize=%s mla_cpu_fix=%s cpu_vl_ops=%s cpu_eagle3=%d hooks",
        os.getpid(),
        settings.capture_enabled,
        settings.dump_dir,
        settings.rid_prefix,
        settings.max_pending_bytes,
        settings.quantize,
        settings.mla_cpu_fix,
        cpu_vl_ops_defined,
        len(cpu_eagle3_hooks),
    )
