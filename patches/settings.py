"""The plugin's configuration, read from the environment of the SGLang server.

SGLang starts its scheduler and detokenizer as separate processes and loads plugins in
each, so environment variables are the one channel that reaches all of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ENV_DUMP_DIR = "HIDDEN_CAPTURE_DIR"
ENV_RID_PREFIX = "HIDDEN_CAPTURE_RID_PREFIX"
ENV_MAX_PENDING_BYTES = "HIDDEN_CAPTURE_MAX_PENDING_BYTES"
ENV_MLA_CPU_FIX = "HIDDEN_CAPTURE_MLA_CPU_FIX"
ENV_MAX_TOKENS = "HIDDEN_CAPTURE_MAX_TOKENS"
ENV_QUANTIZE = "HIDDEN_CAPTURE_QUANTIZE"
# "1": the server serves an EAGLE-3 draft on SGLang's CPU engine (patches/cpu_eagle3/); our
# launcher sets it for a draft on CPU, a user starting SGLang by hand sets it too.
ENV_CPU_EAGLE3 = "HIDDEN_CAPTURE_CPU_EAGLE3"
ENV_CPU_ENGINE = "SGLANG_USE_CPU_ENGINE"  # SGLang's own: "1" runs its CPU engine

QUANTIZE_FORMATS = ("fp8_e4m3",)  # hsx_store/fp8.py: the store's FP8 rows

DEFAULT_RID_PREFIX = "hsx-"
DEFAULT_MAX_PENDING_BYTES = 2 << 30

# The response's meta_info key that carries a captured request's dump path.
META_INFO_KEY = "hidden_capture_dump"


@dataclass(frozen=True)
class CaptureSettings:
    dump_dir: Path | None  # None: capture is off
    rid_prefix: str
    max_pending_bytes: int
    mla_cpu_fix: bool
    # The longest prompt expected: dump regions are sized for it at the first capture (the
    # calibration probe) instead of growing on real requests. None: grow as needed.
    max_tokens: int | None = None
    # "fp8_e4m3": dumps hold the hidden states quantized as an FP8 store keeps them (on a GPU,
    # on the side stream that copies them out). None: as served.
    quantize: str | None = None
    cpu_eagle3: bool = False

    def __post_init__(self) -> None:
        if self.quantize is not None and self.quantize not in QUANTIZE_FORMATS:
            raise ValueError(
                f"{ENV_QUANTIZE}={self.quantize!r}: expected one of {', '.join(QUANTIZE_FORMATS)}"
            )

    @property
    def capture_enabled(self) -> bool:
        return self.dump_dir is not None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> CaptureSettings:
        env = os.environ if env is None else env
        dump_dir = env.get(ENV_DUMP_DIR, "").strip()
        prefix = env.get(ENV_RID_PREFIX, DEFAULT_RID_PREFIX)
        if not prefix:
            raise ValueError(f"{ENV_RID_PREFIX} must not be empty: it keeps foreign traffic out")
        return cls(
            dump_dir=Path(dump_dir) if dump_dir else None,
            rid_prefix=prefix,
            max_pending_bytes=int(env.get(ENV_MAX_PENDING_BYTES, DEFAULT_MAX_PENDING_BYTES)),
            mla_cpu_fix=env.get(ENV_MLA_CPU_FIX, "1") != "0",
            max_tokens=int(env[ENV_MAX_TOKENS]) if env.get(ENV_MAX_TOKENS) else None,
            quantize=env.get(ENV_QUANTIZE) or None,
            cpu_eagle3=env.get(ENV_CPU_EAGLE3) == "1",
        )

    def to_env(self) -> dict[str, str]:
        """The environment that reproduces these settings in a server process."""
        env = {
            ENV_RID_PREFIX: self.rid_prefix,
            ENV_MAX_PENDING_BYTES: str(self.max_pending_bytes),
            ENV_MLA_CPU_FIX: "1" if self.mla_cpu_fix else "0",
        }
        if self.dump_dir is not None:
            env[ENV_DUMP_DIR] = str(self.dump_dir)
        if self.max_tokens is not None:
            env[ENV_MAX_TOKENS] = str(self.max_tokens)
        if self.quantize is not None:
            env[ENV_QUANTIZE] = self.quantize
        if self.cpu_eagle3:
            env[ENV_CPU_EAGLE3] = "1"
        return env
