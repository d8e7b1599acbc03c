"""Text-probe calibration: run when a server comes up, and again after every restart.

A real text prompt goes through the server's own tokenizer and the whole capture path (raw
token ids such as [1] can be invalid for a tokenizer). Its dump tells the server's capture
counter (whatever was captured before it: warmup is not, foreign traffic may be) and proves
that the server captures what the store's manifest promises. A mismatch stops the worker.
"""

from __future__ import annotations

import logging
import time
import uuid

from actors.calibration_result import Calibration
from actors.capture_client import generate_and_capture, wait_for_dump
from actors.dump_checks import DumpMismatch, check_states
from actors.sglang_server import SGLangServer
from hsx_store.format import Manifest
from patches.dump_files import read_dump, release_dump

PROBE_TEXT = "Calibration probe: the capital city of France is Paris, and 2 + 2 = 4."
# Dump meta fields that must equal the manifest's fields of the same name; and its dtype, the
# manifest's served dtype (an FP8 store's is bfloat16).
CAPTURE_FIELDS = ("layer_ids", "layer_convention", "hidden_size", "num_aux")

log = logging.getLogger(__name__)


class CalibrationError(RuntimeError):
    pass


def calibrate(
    server: SGLangServer,
    manifest: Manifest,
    expected_ids: list[int],
    rid_prefix: str,
) -> Calibration:
    """`expected_ids`: PROBE_TEXT as the plan's tokenizer encodes it."""
    started = time.monotonic()
    rid = f"{rid_prefix}calibrate-{uuid.uuid4().hex[:12]}"
    response = generate_and_capture(server, rid, text=PROBE_TEXT)
    tensors, meta = read_dump(wait_for_dump(response.dump_path))
    try:
        problems = [
            f"{key}: server {meta.get(key)!r} != manifest {getattr(manifest, key)!r}"
            for key in CAPTURE_FIELDS
            if meta.get(key) != getattr(manifest, key)
        ]
        missing = [s for s in manifest.final_states if s not in (meta.get("final_states") or [])]
        if missing:
            problems.append(
                f"final_states: the store keeps {manifest.final_states}, the server captures "
                f"{meta.get('final_states')!r} (no {', '.join(missing)})"
            )
        if meta.get("dtype") != manifest.served_dtype:
            problems.append(
                f"dtype: server {meta.get('dtype')!r} != manifest's served dtype "
                f"{manifest.served_dtype!r} (store dtype {manifest.dtype!r})"
            )
        if bool(meta.get("mrope")) != (manifest.position_ids == "mrope"):
            problems.append(
                f"positions: the store keeps {manifest.position_ids or '1-D'} positions, the "
                f"server's model uses {'M-RoPE' if meta.get('mrope') else '1-D'} ones"
            )
        if meta.get("rid") != rid:
            problems.append(f"rid: the dump is {meta.get('rid')!r}'s, not the probe's {rid!r}")
        server_ids = tensors["input_ids"].tolist()
        if server_ids != expected_ids:
            problems.append(
                f"token ids: the server tokenized the probe as {server_ids[:16]}..., the plan's "
                f"tokenizer as {expected_ids[:16]}... (different tokenizer?)"
            )
        problems += _quantization_problems(server.spec.capture.quantize, meta.get("quantized"))
        try:
            check_states(tensors, meta, manifest, len(server_ids))
        except DumpMismatch as e:
            problems.append(f"the probe's capture: {e}")
        if problems:
            raise CalibrationError(
                "the server's capture does not match the store's manifest:\n  "
                + "\n  ".join(problems)
            )
    finally:
        release_dump(response.dump_path)
    return Calibration(
        int(meta["index"]),
        len(server_ids),
        time.monotonic() - started,
        meta.get("dp_rank"),
        meta.get("quantized"),
    )


def _quantization_problems(asked: str | None, dumped: str | None) -> list[str]:
    """A server asked to quantize whose plugin dumps rows as served (an older plugin) is fine:
    the shard writer quantizes them. Any other difference is a problem."""
    if asked == dumped:
        return []
    if asked and dumped is None:
        log.warning(
            "the server's capture plugin dumps unquantized rows (asked for %s): the shard "
            "writer quantizes them instead",
            asked,
        )
        return []
    return [f"quantized: the server dumps {dumped!r}, the worker asked for {asked!r}"]
