"""Our SGLang plugin: per-request hidden-state capture for EAGLE-3 training data.

Loaded by SGLang through the `sglang.srt.plugins` entry point (see pyproject.toml) in every
server process. It does nothing unless its environment asks for it (patches/settings.py):
- HIDDEN_CAPTURE_DIR set: capture prefill hidden states of requests whose rid starts with
  HIDDEN_CAPTURE_RID_PREFIX into dumps under that directory (patches/capture_hook.py),
  quantized to FP8 when HIDDEN_CAPTURE_QUANTIZE=fp8_e4m3;
- on by default, HIDDEN_CAPTURE_MLA_CPU_FIX=0 turns it off: repair DeepSeek MLA prefill on
  SGLang's CPU `torch_native` attention (patches/mla_cpu_fix.py).

Design: docs/design/capture-plugin.md.
"""

from __future__ import annotations

import logging
import os

from patches.settings import CaptureSettings

logger = logging.getLogger(__name__)


def register() -> None:
    """Entry point: register our hooks; SGLang applies them after every plugin has run."""
    settings = CaptureSettings.from_env()
    if settings.mla_cpu_fix:
        from patches import mla_cpu_fix

        mla_cpu_fix.register()
    if settings.capture_enabled:
        from patches import capture_hook

        capture_hook.register(settings)
    # Loud on purpose: a plugin that silently fails to load looks exactly like no capture.
    logger.warning(
        "hidden-capture plugin ACTIVE in pid %d: capture=%s dump_dir=%s rid_prefix=%r "
        "max_pending_bytes=%d quantize=%s mla_cpu_fix=%s",
        os.getpid(),
        settings.capture_enabled,
        settings.dump_dir,
        settings.rid_prefix,
        settings.max_pending_bytes,
        settings.quantize,
        settings.mla_cpu_fix,
    )
