"""`python -m cluster verify --store URL [--model PATH --recompute N --logprobs N]`: the store's
own checks (store/verify.py) plus the two that need the model, which start a server so live here:
the recompute (below) and the logprob check (cluster/verify_logprobs.py).

The recompute check: a random sample of stored rows against a fresh capture.

One patched SGLang server (cluster/verify_server.py, shared with the logprob check) is started
on the model (its config and tokenizer must hash as the store's manifest says), calibrated like
a worker's, and asked for the stored input ids of each chosen sample; the dump is compared with
the stored rows by cosine and relative RMS error (batching differs from the job's, so bit
equality is not expected), within `TOLERANCE`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cluster.verify_logprobs import check_logprobs
from cluster.verify_server import VerifyServer
from store.format import STATUS_WRITTEN, Store
from store.fp8 import FP8_DTYPE, dequantize, scale_name
from store.model_identity import model_mismatches
from store.verify import VerifyReport, describe_recompute, verify_store

if TYPE_CHECKING:
    from actors.sglang_server import SGLangServer

# (min cosine, max relative RMS error) of stored rows against a fresh capture (another batch).
# fp8_e4m3: bf16's plus e4m3 rounding (benchmarks/fp8_fidelity.py on captured rows: min
# cosine 0.99951, relative RMS error 2.66%), the two errors adding in quadrature.
TOLERANCE = {"bfloat16": (0.999, 0.02), "float32": (0.99999, 1e-3), "fp8_e4m3": (0.998, 0.035)}


def recompute_choice(store: Store, count: int, seed: int) -> list[int]:
    """`count` seeded random written samples of committed shards, ascending."""
    status = np.asarray(store.group["sample_status"][:])
    marks = store.committed()
    candidates = [
        i
        for sh in store.shards
        if marks[sh.index]
        for i in range(sh.sample_begin, sh.sample_end)
        if status[i] == STATUS_WRITTEN
    ]
    rng = np.random.default_rng(seed)
    picked = rng.choice(candidates, size=min(count, len(candidates)), replace=False)
    return sorted(int(i) for i in picked)


def compare_rows(
    stored: np.ndarray, fresh: Any, scale: np.ndarray | None = None
) -> tuple[float, float]:
    """(min cosine over rows, relative RMS error) of stored rows (an FP8 store's with their
    `scale`) against a fresh capture."""
    import torch

    if scale is not None:
        actual = dequantize(stored, scale, torch.float32)
    elif stored.dtype == np.uint16:
        actual = torch.from_numpy(stored.view(np.int16).copy()).view(torch.bfloat16).float()
    else:
        actual = torch.from_numpy(np.ascontiguousarray(stored)).float()
    expected = fresh.float()
    h = expected.shape[-1]
    cosine = torch.nn.functional.cosine_similarity(
        actual.reshape(-1, h), expected.reshape(-1, h), dim=-1
    )
    error = (actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()
    return float(cosine.min()), float(error)


@dataclass
class _Recompute:
    """Recompute samples on one patched server and compare them with the stored rows."""

    store: Store
    report: VerifyReport
    model_path: Path
    server: VerifyServer
    say: Callable[[str], None]

    def model_matches(self) -> bool:
        problems = model_mismatches(self.model_path, self.store.manifest)
        for problem in problems:
            self.report.error("recompute", f"{problem}: not the model that made the store")
        return not problems

    def run(self, samples: list[int]) -> None:
        results: list[dict[str, Any]] = []
        self.report.checked["recomputed"] = results
        server, _ = self.server.get(self.store)
        for i in samples:
            try:
                results.append(self.one(server, i))
            except Exception as exc:
                self.report.error(
                    "recompute",
                    f"sample {self.label(i)}: recompute failed: {type(exc).__name__}: {exc}",
                )
                if not server.alive():
                    self.report.error("recompute", "the SGLang server died; stopping")
                    break

    def label(self, i: int) -> str:
        return f"{i} ({self.store.group['sample_id'][i]})"

    def one(self, server: SGLangServer, i: int) -> dict[str, Any]:
        from actors.capture_client import generate_and_capture, wait_for_dump
        from patches.dump_files import read_dump, release_dump

        g, rows = self.store.group, self.store.sample_rows(i)
        ids = np.asarray(g["input_ids"][rows]).astype(np.int64)
        rid = f"hsx-verify-s{i}-{uuid.uuid4().hex[:8]}"
        response = generate_and_capture(server, rid, input_ids=ids.tolist())
        try:
            tensors, meta = read_dump(wait_for_dump(response.dump_path))
            if meta.get("rid") != rid or not np.array_equal(tensors["input_ids"].numpy(), ids):
                raise RuntimeError(f"the dump is not this request's (rid {meta.get('rid')!r})")
            result: dict[str, Any] = {"sample": i, "sample_id": str(g["sample_id"][i])}
            for name in self.store.manifest.hidden_arrays:
                fp8 = self.store.manifest.dtype == FP8_DTYPE
                scale = np.asarray(g[scale_name(name)][rows]) if fp8 else None
                cos, err = compare_rows(np.asarray(g[name][rows]), tensors[name], scale)
                result[name] = {"min_cosine": cos, "relative_error": err}
        finally:
            release_dump(response.dump_path)
        result["ok"] = self.judge(i, result)
        return result

    def judge(self, i: int, result: dict[str, Any]) -> bool:
        min_cos, max_err = TOLERANCE[self.store.manifest.dtype]
        ok = True
        for name in self.store.manifest.hidden_arrays:
            cos, err = result[name]["min_cosine"], result[name]["relative_error"]
            if not (cos >= min_cos and err <= max_err):  # NaN fails too
                ok = False
                self.report.error(
                    "recompute",
                    f"sample {self.label(i)}: {name} differs from a fresh recompute: min cosine "
                    f"{cos:.6f} (needs >= {min_cos}), relative RMS error {err:.3%} "
                    f"(needs <= {max_err:.1%})",
                )
        self.say(f"recompute {describe_recompute({**result, 'ok': ok})}")
        return ok


def check_recompute(
    store: Store,
    report: VerifyReport,
    *,
    server: VerifyServer | None,
    count: int,
    seed: int,
    say: Callable[[str], None],
) -> str | None:
    if count <= 0 or server is None:
        return "no --model / --recompute"
    if report.checks.get("commits") != "ran":
        return "the commit check did not run"
    samples = recompute_choice(store, count, seed)
    if not samples:
        return "no written sample to recompute"
    job = _Recompute(store, report, server.model_path, server, say)
    if not job.model_matches():
        return None
    say(f"recompute: samples {samples} (seed {seed})")
    try:
        job.run(samples)
    except Exception as exc:  # no server, failed calibration, impossible layer ids
        report.error("recompute", f"cannot recompute: {type(exc).__name__}: {exc}")
    return None


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
    """Every check of `store.verify`, and with a model the recompute of `recompute` samples and
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
            recompute=functools.partial(check_recompute, count=recompute, **checks),
            logprobs=functools.partial(check_logprobs, count=logprobs, **checks),
            storage_options=storage_options,
            say=say,
        )


# -- command line ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster verify", description=__doc__)
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
