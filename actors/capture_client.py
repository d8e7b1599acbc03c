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
    response = server.session.post(server.url + "/generate", json=payload, timeout=timeout)
    if response.status_code != 200:
        raise CaptureError(f"rid {rid}: HTTP {response.status_code}: {response.text[:500]}")
    meta_info = response.json()["meta_info"]
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
