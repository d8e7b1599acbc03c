"""Patched SGLang servers on CPU for tests: a session's shared pool, and private ones.

A server takes ~20 s to start on 2 cores and, idle, next to no CPU (`--sleep-on-idle`), so
tests that only send it requests share one per configuration for the whole session. A test
that kills, freezes or misconfigures its server starts its own (`start_server`).
"""

from __future__ import annotations

import importlib.util
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from actors.sglang_server import ServerSpec, SGLangServer
from patches.settings import CaptureSettings

RID_PREFIX = "hsx-"

# The sglang.srt.models modules of the tiny models' architectures (tools/tiny_models.py; the
# noisy model is a Llama too). Only the registry skips the others: a module that one of these
# imports (qwen2_5_vl imports qwen2, the Qwen-VL processors import qwen3_5 ...) still loads.
SERVED_MODEL_MODULES = {
    "LlamaForCausalLM": "llama",
    "DeepseekV3ForCausalLM": "deepseek_v2",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "KimiK25ForConditionalGeneration": "kimi_k25",
    "LlamaForCausalLMEagle3": "llama_eagle3",  # the drafts hsx draft-convert writes
}


def unserved_model_modules() -> str:
    """SGLANG_DISABLED_MODEL_ARCHS for the tests' servers: every model module of SGLang's but
    the tiny models'. A scheduler imports all of them at start (255: 2.5 of a server start's
    31 CPU-seconds, measured on 2 cores), though it loads one; a test server of another
    architecture fails to start, naming it. Listed from the files, without importing SGLang."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang is not installed"
    models = Path(next(iter(spec.submodule_search_locations))) / "srt" / "models"
    served = set(SERVED_MODEL_MODULES.values())
    return ",".join(sorted(p.stem for p in models.glob("*.py") if p.stem not in served))


StartServer = Callable[..., SGLangServer]  # the start_server fixture: (spec, log_path[, timeout])


@dataclass(frozen=True)
class ServerConfig:
    """What a pooled server is started with: its key in the pool."""

    model: str  # a tiny model's name (tools/tiny_models.py)
    dtype: str
    layer_ids: tuple[int, ...] | None = None  # as asked of SGLang; None: its EAGLE-3 default
    chunked_prefill_size: int | None = None

    @property
    def name(self) -> str:
        ids = "default" if self.layer_ids is None else "-".join(map(str, self.layer_ids))
        return f"{self.model}-{self.dtype}-{ids}-cp{self.chunked_prefill_size}"


# The tiny DeepseekV3 as test_capture_server and the calibration tests serve it: float32 (in
# bf16 its sigmoid top-k routing flips an expert on near-ties), prompts in fragments of 48.
DEEPSEEK_FLOAT32 = ServerConfig("deepseek-v3-tiny", "float32", (0, 1, 3), chunked_prefill_size=48)


@dataclass
class Served:
    server: SGLangServer
    model_path: Path
    dump_dir: Path
    entries_after_startup: list[str] = field(default_factory=list)  # what startup left there


def spec_for(model_path: Path, dump_dir: Path | None, config: ServerConfig) -> ServerSpec:
    return ServerSpec(
        model_path=model_path,
        capture=CaptureSettings(dump_dir, RID_PREFIX, 1 << 28, mla_cpu_fix=True),
        aux_layer_ids=None if config.layer_ids is None else list(config.layer_ids),
        chunked_prefill_size=config.chunked_prefill_size,
        extra_args=["--dtype", config.dtype],
    )


class ServerPool:
    """One running server per ServerConfig, started at its first use; at most `capacity`
    at once (the least recently used one is stopped to make room: ~2.4 GB each)."""

    def __init__(self, models_dir: Path, root: Path, capacity: int = 3) -> None:
        self.models_dir, self.root, self.capacity = models_dir, root, capacity
        self._running: OrderedDict[ServerConfig, Served] = OrderedDict()
        self._starts = itertools.count()  # each start's own folder

    def get(self, config: ServerConfig) -> Served:
        if config in self._running:
            self._running.move_to_end(config)
            served = self._running[config]
            if served.server.alive():
                return served
            del self._running[config]  # a test broke the rule and killed it: start anew
        while len(self._running) >= self.capacity:
            _, oldest = self._running.popitem(last=False)
            oldest.server.stop()
        work = self.root / f"{config.name}-{next(self._starts)}"
        model_path = self.models_dir / config.model
        spec = spec_for(model_path, work / "dumps", config)
        server = SGLangServer(spec, work / "server.log").start()
        dumps = spec.capture.dump_dir
        assert dumps is not None
        entries = sorted(p.name for p in dumps.iterdir()) if dumps.exists() else []
        self._running[config] = Served(server, model_path, dumps, entries)
        return self._running[config]

    def release(self, config: ServerConfig) -> None:
        """Stop its server, if running: no test left asks for it (idle, a server still takes
        ~2% of a core and ~2.4 GB)."""
        served = self._running.pop(config, None)
        if served is not None:
            served.server.stop()

    def close(self) -> None:
        while self._running:
            _, served = self._running.popitem()
            served.server.stop()
