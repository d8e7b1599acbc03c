"""Patched SGLang servers on CPU for tests: a session's shared pool, and private ones.

A server takes ~20 s to start on 2 cores and, idle, next to no CPU (`--sleep-on-idle`), so
tests that only send it requests share one per configuration for the whole session. A test
that kills, freezes or misconfigures its server starts its own (`start_server`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from actors.sglang_server import ServerSpec, SGLangServer
from patches.settings import CaptureSettings

RID_PREFIX = "hsx-"

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

    def close(self) -> None:
        while self._running:
            _, served = self._running.popitem()
            served.server.stop()
