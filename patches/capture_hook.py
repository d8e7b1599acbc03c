"""Per-request capture of aux + final hidden states from SGLang's prefill forwards.

Three hooks, all installed through SGLang's HookRegistry:
- AFTER `ForwardBatch.init_new`: each request's prompt length, and whether it was retracted;
- AROUND `residual.batch.final_norm`: keep the norm's input (the pre-norm final state) through
  its `capture` callback, per process, for the forward hook;
- AFTER `ModelRunner.forward` (eager after every forward, CUDA-graph replays included): cut the
  aux, post-norm and pre-norm states per request, copy our requests' rows into their dumps,
  publish each dump once its prompt is complete, and return its location through
  `logits_output.customized_info` (SGLang's `meta_info`).

The first rank of each attention-TP group writes; under `--dp-size` or DP attention every DP
rank publishes into `<dump_dir>/dp<rank>/`.

Design: docs/design/capture-plugin.md.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsx_store.fp8 import scale_name
from hsx_store.fp8_fast import quantize_rows_fast
from hsx_store.layers import LAYER_CONVENTION
from patches.dump_files import DUMP_FORMAT, DUMP_FORMAT_VERSION, TensorSpecs
from patches.dump_writer import DumpWriter, PendingDump
from patches.settings import META_INFO_KEY, CaptureSettings

logger = logging.getLogger(__name__)


FORWARD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
INIT_BATCH_TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
FINAL_NORM_TARGET = "sglang.srt.layers.layer_boundary.residual.batch.final_norm"
_REQUESTS_ATTR = "_hidden_capture_requests"
FINAL_STATES = ["post_norm", "pre_norm"]  # what every dump holds, in this order


@dataclass(frozen=True)
class _RequestInfo:
    prompt_len: int
    retracted: bool  # prefilled again after a retraction: its prompt may be captured already


@dataclass
class _OpenDump:
    pending: PendingDump
    index: int
    prompt_len: int
    covered: torch.Tensor  # bool [prompt_len]: rows filled so far


class CaptureSession:
    """The capture state of one server (one scheduler process, TP rank 0)."""

    def __init__(self, settings: CaptureSettings, rank: CaptureRank, prenorm: PrenormSlot) -> None:
        assert settings.dump_dir is not None
        self.settings = settings
        self.rank = rank
        self.prenorm = prenorm
        self.writer: DumpWriter | None = None  # made at the first capture, sized by its layout
        self._counter = itertools.count()
        self._open: dict[str, _OpenDump] = {}
        self._layout: dict[str, Any] | None = None

    # -- hooks -------------------------------------------------------------------------

    def on_forward(self, output: Any, runner: Any, forward_batch: Any) -> None:
        prenorm = self.prenorm.take()  # this forward's, never a later one's
        if getattr(runner, "is_draft_worker", False) or not self.rank.writes:
            return
        if not forward_batch.forward_mode.is_extend_without_speculative():
            return
        rids = forward_batch.rids or []
        ours = [i for i, rid in enumerate(rids) if rid.startswith(self.settings.rid_prefix)]
        if not ours:
            return
        logits_output = output.logits_output
        infos: list[dict[str, Any] | None] = [None] * len(rids)
        for i in ours:
            try:
                infos[i] = self._capture_request(i, logits_output, prenorm, runner, forward_batch)
            except Exception as exc:  # never take the server down; report it per request
                logger.exception("hidden capture failed for rid %s", rids[i])
                self._discard(rids[i])
                infos[i] = {"error": f"{type(exc).__name__}: {exc}"}
        if any(info is not None for info in infos):
            if logits_output.customized_info is None:
                logits_output.customized_info = {}
            logits_output.customized_info[META_INFO_KEY] = infos

    # -- per request -------------------------------------------------------------------

    def _capture_request(
        self,
        i: int,
        logits_output: Any,
        prenorm: torch.Tensor | None,
        runner: Any,
        forward_batch: Any,
    ) -> dict[str, Any] | None:
        rid = forward_batch.rids[i]
        requests = getattr(forward_batch, _REQUESTS_ATTR, None)
        if requests is None:
            raise RuntimeError("request info missing: the ForwardBatch.init_new hook is not active")
        request = requests[i]
        if request.retracted and rid not in self._open:
            # Only decoding requests are retracted, so their prompt was captured already.
            return None
        aux, final = logits_output.hidden_states, logits_output.last_hidden_states
        if aux is None or final is None:
            raise RuntimeError(
                "the forward returned no aux/final hidden states: start the server with "
                "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3"
            )
        if prenorm is None or prenorm.shape != final.shape:
            raise RuntimeError(
                f"no pre-norm final state for this forward ({type(runner.model).__name__} "
                f"did not pass its final norm through {FINAL_NORM_TARGET})"
            )
        layout = self._layout_for(runner, aux, final, forward_batch)
        prompt_len = request.prompt_len

        row0 = sum(forward_batch.extend_seq_lens_cpu[:i])
        start = forward_batch.extend_prefix_lens_cpu[i]
        if start == 0 and rid in self._open:
            # Prefilled again from scratch (retraction): overwrite, never append.
            logger.info("rid %s is prefilled again; its fragments are overwritten", rid)
        dump = self._open.get(rid) or self._open_dump(rid, prompt_len, layout)
        n = min(forward_batch.extend_seq_lens_cpu[i], prompt_len - start)
        if n <= 0:
            return None
        rows = slice(row0, row0 + n)
        n_aux, hidden = layout["num_aux"], layout["hidden_size"]
        states = {
            "aux_hidden_states": aux[rows].view(n, n_aux, hidden),
            "final_hidden_states": final[rows],
            "prenorm_hidden_states": prenorm[rows],
        }
        for name, state in states.items():
            if self.settings.quantize:
                keys = (name, scale_name(name))
                dump.pending.fill_converted(keys, start, state, quantize_rows_fast)
            else:
                dump.pending.fill(name, start, state)
        dump.pending.fill("input_ids", start, forward_batch.input_ids[rows].to(torch.int64))
        dump.pending.fill("positions", start, forward_batch.positions[rows].to(torch.int64))
        if layout.get("mrope"):
            mrope = forward_batch.mrope_positions
            if mrope is None:
                raise RuntimeError("an M-RoPE model's forward carries no mrope_positions")
            dump.pending.fill("mrope_positions", start, mrope[:, rows].T.to(torch.int64))
        dump.covered[start : start + n] = True
        if not bool(dump.covered.all()):
            return None
        dump.pending.publish()
        del self._open[rid]
        return {"path": str(dump.pending.path), "index": dump.index, "dp_rank": self.rank.dp_rank}

    def _open_dump(self, rid: str, prompt_len: int, layout: dict[str, Any]) -> _OpenDump:
        if self.writer is None:
            self.writer = self._make_writer(layout)
        index = next(self._counter)
        meta = {
            "format": DUMP_FORMAT,
            "version": DUMP_FORMAT_VERSION,
            "rid": rid,
            "index": index,  # this DP rank's counter
            "dp_rank": self.rank.dp_rank,
            "num_tokens": prompt_len,
            "quantized": self.settings.quantize,  # None: the hidden states as served
            **{k: v for k, v in layout.items() if k != "torch_dtype"},
        }
        dump = _OpenDump(
            pending=self.writer.open(f"req_{index}", self._tensors(prompt_len, layout), meta),
            index=index,
            prompt_len=prompt_len,
            covered=torch.zeros(prompt_len, dtype=torch.bool),
        )
        self._open[rid] = dump
        return dump

    def _tensors(self, prompt_len: int, layout: dict[str, Any]) -> TensorSpecs:
        """A dump's tensors, widest dtype first: every tensor then starts aligned to its
        itemsize. Quantized: e4m3 values and a float32 scale per row (hsx_store/fp8.py)."""
        hidden, dtype = layout["hidden_size"], layout["torch_dtype"]
        states = {
            "aux_hidden_states": (prompt_len, layout["num_aux"]),
            "final_hidden_states": (prompt_len,),
            "prenorm_hidden_states": (prompt_len,),
        }
        ids = {name: ((prompt_len,), torch.int64) for name in ("input_ids", "positions")}
        if layout.get("mrope"):  # row r: the (t, h, w) positions the model used for row r
            ids["mrope_positions"] = ((prompt_len, 3), torch.int64)
        if not self.settings.quantize:
            return ids | {name: ((*rows, hidden), dtype) for name, rows in states.items()}
        scales = {scale_name(name): (rows, torch.float32) for name, rows in states.items()}
        values = {name: ((*rows, hidden), torch.float8_e4m3fn) for name, rows in states.items()}
        return ids | scales | values

    def _make_writer(self, layout: dict[str, Any]) -> DumpWriter:
        assert self.settings.dump_dir is not None
        region_bytes = 0
        if self.settings.max_tokens:  # the regions hold the longest prompt's dump
            tensors = self._tensors(self.settings.max_tokens, layout)
            region_bytes = sum(math.prod(shape) * d.itemsize for shape, d in tensors.values())
        return DumpWriter(
            self.rank.dump_root(self.settings.dump_dir),
            self.settings.max_pending_bytes,
            region_bytes=region_bytes,
        )

    def _discard(self, rid: str) -> None:
        dump = self._open.pop(rid, None)
        if dump is not None:
            dump.pending.abort()

    def _layout_for(
        self, runner: Any, aux: torch.Tensor, final: torch.Tensor, forward_batch: Any
    ) -> dict[str, Any]:
        """What every dump of this server shares; resolved once, from the model itself."""
        if self._layout is None:
            from sglang.srt.runtime_context import get_exec

            layer_ids = sorted(_layers_to_capture(runner.model))
            hidden = int(final.shape[-1])
            if aux.shape[-1] != len(layer_ids) * hidden:
                raise RuntimeError(
                    f"aux hidden states have {aux.shape[-1]} features, expected "
                    f"{len(layer_ids)} layers x {hidden}"
                )
            self._layout = {
                "layer_ids": layer_ids,
                "requested_layer_ids": get_exec().features.return_aux_hidden_state_layer_ids,
                "layer_convention": LAYER_CONVENTION,
                "num_aux": len(layer_ids),
                "hidden_size": hidden,
                "dtype": str(final.dtype).removeprefix("torch."),
                "torch_dtype": final.dtype,
                "final_states": FINAL_STATES,
                "architecture": type(runner.model).__name__,
            }
            # An M-RoPE model (Qwen-VL) gets positions per forward for all its extends, 3 a
            # row; text models' dumps keep their tensors and meta unchanged.
            if getattr(forward_batch, "mrope_positions", None) is not None:
                self._layout["mrope"] = True
        return self._layout


def _layers_to_capture(model: Any) -> list[int]:
    """SGLang's resolved capture layers; multimodal wrappers (Kimi-K2.5) hold the decoder in
    `language_model`."""
    for owner in (model, getattr(model, "language_model", None)):
        layers = getattr(getattr(owner, "model", None), "layers_to_capture", None)
        if layers:
            return list(layers)
    raise RuntimeError(f"cannot find the capture layers of {type(model).__name__}")


@dataclass(frozen=True)
class CaptureRank:
    """Where this scheduler process stands in the server's parallel layout."""

    writes: bool  # the first rank of its attention-TP group: the one that publishes
    dp_rank: int | None  # None: the server has a single DP rank

    def dump_root(self, dump_dir: Path) -> Path:
        """One folder per DP rank: each rank numbers its dumps from 0 and owns a DumpWriter,
        whose private files (.ring, .pool-*) must not meet another writer's."""
        return dump_dir if self.dp_rank is None else dump_dir / f"dp{self.dp_rank}"


def _this_rank() -> CaptureRank:
    """Read from SGLang's published parallel context (scheduler processes only). `dp_rank` is
    the replica under `--dp-size` and the attention-DP group under DP attention (the DP
    controller passes that as the scheduler's dp_rank); `num_dp_ranks` counts both."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    dp_rank = None
    if p.num_dp_ranks > 1:
        dp_rank = p.dp_rank if p.dp_rank is not None else p.attn_dp_rank
    return CaptureRank(writes=p.attn_tp_rank == 0 and p.attn_cp_rank == 0, dp_rank=dp_rank)


def _record_requests(forward_batch: Any, cls: type, batch: Any, *args: Any, **kwargs: Any) -> None:
    requests = [
        _RequestInfo(len(req.origin_input_ids), bool(getattr(req, "retracted_stain", False)))
        for req in batch.reqs
    ]
    setattr(forward_batch, _REQUESTS_ATTR, requests)


class PrenormSlot:
    """The pre-norm final state of the forward running in this process, from the final-norm
    hook to the forward hook."""

    def __init__(self) -> None:
        self._state: torch.Tensor | None = None

    def put(self, state: torch.Tensor) -> None:
        self._state = state

    def take(self) -> torch.Tensor | None:
        state, self._state = self._state, None
        return state


def _prenorm_keeper(rid_prefix: str, slot: PrenormSlot) -> Any:
    """An AROUND hook for the terminal norm that keeps its input in `slot` when the batch is an
    extend holding a request of ours. The input comes through final_norm's own `capture`
    callback (the updated residual of the fused add + norm, so the very tensor the norm reads;
    borrowed, so copied), and a capture the model passed still gets it."""

    def keep_prenorm(
        original: Any,
        hidden_states: Any,
        forward_batch: Any,
        layernorm: Any,
        capture: Any = None,
        **kwargs: Any,
    ) -> Any:
        mode = forward_batch.forward_mode
        rids = forward_batch.rids or []
        if not mode.is_extend_without_speculative() or not any(
            rid.startswith(rid_prefix) for rid in rids
        ):
            return original(hidden_states, forward_batch, layernorm, capture, **kwargs)

        def keep(state: torch.Tensor) -> None:
            slot.put(state.clone())
            if capture is not None:
                capture(state)

        return original(hidden_states, forward_batch, layernorm, keep, **kwargs)

    return keep_prenorm


def register(settings: CaptureSettings) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    session: CaptureSession | None = None
    prenorm = PrenormSlot()

    def after_forward(
        output: Any, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any
    ) -> None:
        # Created lazily: the hook is registered in every SGLang process, but only the
        # scheduler runs forwards, and only it should own a writer thread.
        nonlocal session
        if session is None:
            session = CaptureSession(settings, _this_rank(), prenorm)
        session.on_forward(output, runner, forward_batch)

    HookRegistry.register(INIT_BATCH_TARGET, _record_requests, HookType.AFTER)
    keeper = _prenorm_keeper(settings.rid_prefix, prenorm)
    HookRegistry.register(FINAL_NORM_TARGET, keeper, HookType.AROUND)
    HookRegistry.register(FORWARD_TARGET, after_forward, HookType.AFTER)
