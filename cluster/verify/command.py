"""`python -m cluster verify` (its parser: cluster/cli.py): the store's integrity checks, plus
the model checks with a model."""

from __future__ import annotations

import contextlib
import functools
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cluster.verify.logprobs import LogprobCheck
from cluster.verify.recompute import RecomputeCheck
from cluster.verify.server import VerifyServer
from hsx_store.integrity import verify_store
from hsx_store.integrity_report import VerifyReport


def verify(
    url: str | Path,
    *,
    model_path: str | None = None,
    recompute: int = 0,
    logprobs: int = 0,
    seed: int = 0,
    dump_root: str | None = None,
    server_args: Sequence[str] = (),
    storage_options: Mapping[str, Any] | None = None,
    say: Callable[[str], None] = print,
) -> VerifyReport:
    """Every check of hsx_store.integrity, and with a model the recompute of `recompute` samples and
    the logprob check of `logprobs` samples (one server for both)."""
    if (recompute > 0 or logprobs > 0) and model_path is None:
        raise ValueError("recompute and logprobs need model_path (--model)")
    with contextlib.ExitStack() as stack:
        server = None
        if model_path is not None:
            shm = Path("/dev/shm")
            default_root = shm if shm.is_dir() else Path(tempfile.gettempdir())
            root = Path(dump_root) if dump_root else default_root
            server = stack.enter_context(
                VerifyServer(Path(model_path), root, list(server_args), say)
            )
        checks = dict(server=server, seed=seed, say=say)
        return verify_store(
            url,
            recompute=functools.partial(RecomputeCheck.run_check, count=recompute, **checks),
            logprobs=functools.partial(LogprobCheck.run_check, count=logprobs, **checks),
            storage_options=storage_options,
            say=say,
        )


def verify_command(
    url: str,
    *,
    model_path: str | None,
    recompute: int,
    logprobs: int,
    seed: int,
    dump_root: str | None,
    server_args: Sequence[str],
) -> int:
    """`verify`, its report printed. Exit status: 0 no errors, 1 errors, 2 the store cannot be
    read (or the model checks were asked for without a model)."""
    if (recompute > 0 or logprobs > 0) and not model_path:
        print("error: --recompute and --logprobs need --model", file=sys.stderr)
        return 2
    report = verify(
        url,
        model_path=model_path,
        recompute=recompute,
        logprobs=logprobs,
        seed=seed,
        dump_root=dump_root,
        server_args=server_args,
        say=lambda text: print(text, flush=True),
    )
    print(report.format(), flush=True)
    return report.exit_code
