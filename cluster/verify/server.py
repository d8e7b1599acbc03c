"""The patched SGLang server that `verify`'s model checks (recompute, logprobs) share.

Started at the first check that asks for it and stopped when `verify` ends, so `--recompute`
and `--logprobs` together start one server. It is started like a worker's: the store's served dtype
unless `--server-arg=--dtype` says otherwise, its aux layers, capture into a private folder
under `dump_root` (held and reclaimed like a worker's: actors/private_folders.py) and its log in
a private folder on disk, sized (on CPU) for the store's longest sample, then calibrated against
the store's manifest (actors/calibration.py) before any check uses it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.private_folders import HeldFolder, reclaim_abandoned
from actors.process_group import reclaim_orphan_segments
from hsx_store.format import Store

if TYPE_CHECKING:
    from actors.sglang_server import SGLangServer

DUMPS_PREFIX = "hsx-verify-dumps-"


@dataclass
class VerifyServer:
    model_path: Path
    dump_root: Path
    server_args: list[str]
    say: Callable[[str], None]
    _server: SGLangServer | None = field(default=None, init=False)
    _dumps: HeldFolder | None = field(default=None, init=False)
    _logs: Path | None = field(default=None, init=False)
    _failed: Exception | None = field(default=None, init=False)  # a failed start is not retried

    def get(self, store: Store) -> tuple[SGLangServer, Path]:
        """The running server and its dump folder; started and calibrated at the first call."""
        if self._failed is not None:
            raise self._failed
        if self._server is None:
            try:
                self._start(store)
            except Exception as exc:
                self.close()
                self._failed = exc
                raise
        assert self._server is not None and self._dumps is not None
        return self._server, self._dumps.path

    def _start(self, store: Store) -> None:
        import torch

        from actors.calibration import PROBE_TEXT, calibrate
        from actors.sglang_server import ServerSpec, SGLangServer
        from hsx_store.layers import model_config, requested_layer_ids
        from patches.settings import CaptureSettings

        m = store.manifest
        on_gpu = torch.cuda.is_available()
        longest = int(store.sample_length.max(initial=0))
        args = list(self.server_args)
        if not any(a == "--dtype" or a.startswith("--dtype=") for a in args):
            args += ["--dtype", m.served_dtype]  # an FP8 store's model serves bf16
        reclaim_abandoned(self.dump_root, DUMPS_PREFIX)
        reclaim_orphan_segments()
        self._dumps = HeldFolder.claim(self.dump_root, DUMPS_PREFIX)
        self._logs = Path(tempfile.mkdtemp(prefix="hsx-verify-log-"))  # on disk, 0700
        spec = ServerSpec(
            model_path=self.model_path,
            capture=CaptureSettings(
                self._dumps.path, "hsx-", 2 << 30, mla_cpu_fix=True, max_tokens=m.max_length
            ),
            aux_layer_ids=requested_layer_ids(model_config(self.model_path), m.layer_ids),
            tp_size=torch.cuda.device_count() if on_gpu else 1,
            max_total_tokens=None if on_gpu else max(8192, longest + 64),
            extra_args=args,
        )
        self._server = server = SGLangServer(spec, self._logs / "server.log")
        self.say(f"verify: starting SGLang on {self.model_path} ({' '.join(args)})")
        server.start(timeout=900)
        self._dumps.list_shm_files(server.shm_files)
        probe = self.tokenizer()(PROBE_TEXT)["input_ids"]
        calibrate(server, m, probe, "hsx-")  # same fields as a worker

    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        trust = "--trust-remote-code" in self.server_args
        return AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=trust)

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._dumps is not None:
            self._dumps.release()
            self._dumps = None
        if self._logs is not None:
            shutil.rmtree(self._logs, ignore_errors=True)
            self._logs = None

    def __enter__(self) -> VerifyServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
