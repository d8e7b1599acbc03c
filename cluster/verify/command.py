"""`python -m cluster verify`: the store's integrity checks, plus the model checks with --model.

    python -m cluster verify --store URL [--model PATH --recompute N --logprobs N]

Exit status: 0 no errors, 1 errors, 2 the store cannot be read (or a bad command line).
"""

from __future__ import annotations

import argparse
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
from hsx_store.integrity import VerifyReport, verify_store


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


# -- command line ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster verify",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--store", required=True, help="the store's path or URL")
    parser.add_argument("--model", help="the model directory (for --recompute, --logprobs)")
    parser.add_argument(
        "--recompute", type=int, default=0, metavar="N", help="recompute N random written samples"
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        default=0,
        metavar="N",
        help="check the final states of N random written samples against the server's logprobs",
    )
    parser.add_argument("--seed", type=int, default=0, help="picks the checked samples")
    parser.add_argument("--dump-root", help="where the server's dumps go (default /dev/shm)")
    parser.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=[],
        metavar="ARG",
        help="extra SGLang argument, once per word: --server-arg=--dtype --server-arg=float32 "
        "(--dtype defaults to the store's)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if (args.recompute > 0 or args.logprobs > 0) and not args.model:
        print("error: --recompute and --logprobs need --model", file=sys.stderr)
        return 2
    report = verify(
        args.store,
        model_path=args.model,
        recompute=args.recompute,
        logprobs=args.logprobs,
        seed=args.seed,
        dump_root=args.dump_root,
        server_args=args.server_args,
        say=lambda text: print(text, flush=True),
    )
    print(report.format(), flush=True)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
