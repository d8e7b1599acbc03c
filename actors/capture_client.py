"""Send one prompt to a patched server and locate the dump it produced.

The response's `meta_info["hidden_capture_dump"]` names the dump directory: the one way to
find it (a server under `--dp-size` numbers dumps per DP rank, in a folder per rank, so no
name can be derived from a counter). The plugin publishes it from a background thread with an
atomic rename, so the response may arrive first: `wait_for_dump` polls until the directory
exists.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.sglang_server import SGLangServer
from patches.settings import META_INFO_KEY


class CaptureError(RuntimeError):
    pass


@dataclass(frozen=True)
class CaptureResponse:
    rid: str
    dump_path: Path
    dump_index: int  # the counter of the DP rank that served it
    dp_rank: int | None  # None: the server has one DP rank
    meta_info: dict[str, Any]


def generate_and_capture(
    server: SGLangServer,
    rid: str,
    *,
    input_ids: list[int] | None = None,
    text: str | None = None,
    image_data: list[str] | None = None,
    timeout: float = 600.0,
) -> CaptureResponse:
    """Prefill one prompt (token ids or text, with one image token per image of
    `image_data`) on `server` (with its key), generating a single token, and return where its
    dump is. Raises CaptureError when the server reports no dump or a capture error."""
    if (input_ids is None) == (text is None):
        raise ValueError("give exactly one of input_ids and text")
    payload: dict[str, Any] = {"rid": rid, "sampling_params": {"max_new_tokens": 1}}
    payload["input_ids" if input_ids is not None else "text"] = (
        input_ids if input_ids is not None else text
    )
    if image_data:
        payload["image_data"] = image_data
    return _captured(rid, _post(server, payload, timeout, f"rid {rid}")["meta_info"])


def generate_and_capture_batch(
    server: SGLangServer, prompts: dict[str, dict[str, Any]], timeout: float = 600.0
) -> dict[str, CaptureResponse | CaptureError]:
    """Prefill several prompts (rid -> `input_ids`, and `image_data` where it has images) in
    one request: SGLang hands a batch of token ids to its scheduler at once, so they are
    prefilled together rather than as separate requests happen to arrive. Each rid's dump,
    or why it has none; an HTTP error is every prompt's (raised)."""
    rids = list(prompts)
    payload: dict[str, Any] = {
        "rid": rids,
        "input_ids": [prompts[rid]["input_ids"] for rid in rids],
        "sampling_params": {"max_new_tokens": 1},
    }
    if any(prompts[rid].get("image_data") for rid in rids):
        payload["image_data"] = [prompts[rid].get("image_data") for rid in rids]
    answers = _post(server, payload, timeout, f"{len(rids)} rids")
    out: dict[str, CaptureResponse | CaptureError] = {}
    for rid, answer in zip(rids, answers, strict=True):
        try:
            out[rid] = _captured(rid, answer["meta_info"])
        except CaptureError as exc:
            out[rid] = exc
    return out


def _post(server: SGLangServer, payload: dict[str, Any], timeout: float, what: str) -> Any:
    response = server.session.post(server.url + "/generate", json=payload, timeout=timeout)
    if response.status_code != 200:
        raise CaptureError(f"{what}: HTTP {response.status_code}: {response.text[:500]}")
    return response.json()


def _captured(rid: str, meta_info: dict[str, Any]) -> CaptureResponse:
    """Where the server says `rid`'s dump is."""
    # One entry per forward that reported on this request; the last one is the final word.
    entries = [e for e in meta_info.get(META_INFO_KEY) or [] if e is not None]
    if not entries:
        raise CaptureError(f"rid {rid}: the server reported no dump (is capture enabled?)")
    last = entries[-1]
    if "error" in last:
        raise CaptureError(f"rid {rid}: capture failed in the server: {last['error']}")
    return CaptureResponse(
        rid, Path(last["path"]), int(last["index"]), last.get("dp_rank"), meta_info
    )


def wait_for_dump(path: Path, timeout: float = 60.0) -> Path:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise CaptureError(f"dump {path} not published within {timeout:.0f}s")
        time.sleep(0.005)
    return path
