"""`verify --logprobs N`: do the stored final states give the model's own next-token logprobs?

A check that scales to Kimi-K2.5: it needs the model's output head alone (store/lm_head.py,
~2.3 GB in bf16, not a second copy of a ~600 GB model, no HF transformers) and the patched
server that `verify` starts anyway (cluster/verify_server.py, shared with `--recompute`).

For N seeded random written samples of committed shards (the recompute's choice), the server
prefills the stored `input_ids` once with `return_logprob`, `logprob_start_len=0` and
`top_logprobs_num=1` (greedy, one new token), and the check computes log_softmax(stored
post-norm final state @ lm_head.T) itself, in float32, in blocks of rows and of the vocabulary
(memory stays bounded: never T x V logits at once). Row t of a sample is compared with the
server's logprob of token t+1; the last row, which has no next token, with the server's top-1
logprob of the token it generates. Per sample: the top-1 agreement (the server's top-1 token
against the argmax of the stored row's logits) and the max / mean absolute logprob error, each
within `TOLERANCE`. Rows of another sample, or shifted by one token, fail it by far.

Models whose logits SGLang scales or caps (`logit_scale`, `final_logit_softcapping`) are
refused: the check computes plain logits.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from store.format import Store
from store.lm_head import load_lm_head, text_config
from store.model_identity import model_mismatches
from store.verify import VerifyReport, describe_logprobs

if TYPE_CHECKING:
    from actors.sglang_server import SGLangServer
    from cluster.verify_server import VerifyServer

# (min top-1 agreement, max mean |error|, max |error|) per sample, errors in nats, of stored
# final states against the server's logprobs of the same prompt, prefilled alone (the rows were
# captured in a batch). Measured on the tiny models on CPU (tests/test_verify_logprobs.py, 8
# samples of 2..95 tokens captured at once), worst sample of each figure:
#   llama-tiny bf16         agreement 100%, mean 3.3e-3, max 6.5e-3
#   deepseek-v3-tiny fp32   agreement 100%, mean 2.6e-6, max 2.9e-6
#   rows of another sample  agreement 0%,   mean 0.72 / 0.85, max 2.6 / 2.5   (bf16 / fp32)
#   shifted by one token    agreement 32% / 0%, mean 0.15 / 0.89, max 1.2 / 3.0
# The bounds sit far above that noise (bf16 15x on the mean, 150x on the max) because a real
# model's logits are ~10x the tiny random ones' (their spread, and so their bf16 rounding and
# batch noise, grow with them) and its near-ties flip some top-1 tokens; wrong rows of a real
# model miss by whole nats.
TOLERANCE = {"bfloat16": (0.9, 0.05, 1.0), "float32": (0.98, 1e-3, 1e-2)}
BLOCK_BYTES = 64 << 20  # float32 logits (and head rows) computed at once
UNSUPPORTED_CONFIG = ("logit_scale", "final_logit_softcapping")


@dataclass(frozen=True)
class RowLogprobs:
    """Per row t of a sample: the logprob of token t+1 (all rows but the last), the top-1
    token and its logprob."""

    next_token: torch.Tensor  # float32 [T-1]
    top1_id: torch.Tensor  # int64 [T]
    top1: torch.Tensor  # float32 [T]


@dataclass(frozen=True)
class LogprobResult:
    sample: int
    sample_id: str
    tokens: int
    top1_agreement: float
    mean_error: float
    max_error: float
    worst_token: int  # the row of the max error
    ok: bool = False


def reference_logprobs(
    final: torch.Tensor, head: torch.Tensor, input_ids: torch.Tensor, block_bytes: int = BLOCK_BYTES
) -> RowLogprobs:
    """log_softmax(final @ head.T) in float32, reduced to what the server returns, one block of
    head rows and one block of sample rows at a time (a running max and sum of exponentials
    per row: the softmax over blocks of the vocabulary)."""
    t, h = final.shape
    vocab = head.shape[0]
    vocab_block = max(1, block_bytes // (h * 4))
    row_block = max(1, block_bytes // (min(vocab, vocab_block) * 4))
    best = torch.full((t,), -torch.inf)
    best_id = torch.zeros(t, dtype=torch.int64)
    sum_exp = torch.zeros(t)  # of logits - best
    next_logit = torch.full((t - 1,), torch.nan)
    next_ids = input_ids[1:].long()
    for v0 in range(0, vocab, vocab_block):
        w = head[v0 : v0 + vocab_block].float()
        for r0 in range(0, t, row_block):
            r1 = min(t, r0 + row_block)
            logits = final[r0:r1].float() @ w.T
            block_best, block_arg = logits.max(dim=1)
            old = best[r0:r1]
            new = torch.maximum(old, block_best)
            sum_exp[r0:r1] = sum_exp[r0:r1] * torch.exp(old - new) + torch.exp(
                logits - new[:, None]
            ).sum(dim=1)
            best_id[r0:r1] = torch.where(block_best > old, block_arg + v0, best_id[r0:r1])
            best[r0:r1] = new
            local = next_ids[r0 : min(r1, t - 1)] - v0
            hit = ((local >= 0) & (local < w.shape[0])).nonzero().flatten()
            next_logit[r0 + hit] = logits[hit, local[hit]]
    log_norm = best + torch.log(sum_exp)
    return RowLogprobs(next_logit - log_norm[:-1], best_id, best - log_norm)


def server_logprobs(server: SGLangServer, rid: str, input_ids: list[int]) -> RowLogprobs:
    """The server's prompt logprobs of `input_ids`, prefilled as one request. `rid` must not
    carry the capture prefix: these requests leave no dump."""
    payload = {
        "rid": rid,
        "input_ids": input_ids,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 1,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
    }
    response = server.session.post(server.url + "/generate", json=payload, timeout=600)
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
    meta = response.json()["meta_info"]
    # SGLang 0.5.23 (tokenizer_manager.add_logprob_to_meta_info): one (logprob, token id, text)
    # per prompt token, the first logprob None (nothing predicts token 0); the top-k lists the
    # same way, [None, [(logprob, id, text)], ...]; the generated token's top-k separately.
    tokens, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    last = meta["output_top_logprobs"][0]
    t = len(input_ids)
    if len(tokens) != t or len(tops) != t or not last:
        raise RuntimeError(
            f"the server returned {len(tokens)} token logprobs and {len(tops)} top-1 lists "
            f"for {t} prompt tokens"
        )
    top1 = [entry[0] for entry in tops[1:]] + [last[0]]
    return RowLogprobs(
        torch.tensor([lp for lp, _, _ in tokens[1:]], dtype=torch.float32),
        torch.tensor([tok for _, tok, _ in top1], dtype=torch.int64),
        torch.tensor([lp for lp, _, _ in top1], dtype=torch.float32),
    )


def compare(sample: int, sample_id: str, ours: RowLogprobs, server: RowLogprobs) -> LogprobResult:
    """Row t's error: its token t+1 logprob; the last row's, its top-1 logprob."""
    errors = torch.cat([ours.next_token - server.next_token, ours.top1[-1:] - server.top1[-1:]])
    errors = errors.abs()
    worst = int(torch.nan_to_num(errors, nan=torch.inf).argmax())
    return LogprobResult(
        sample=sample,
        sample_id=sample_id,
        tokens=len(errors),
        top1_agreement=float((ours.top1_id == server.top1_id).double().mean()),
        mean_error=float(errors.mean()),
        max_error=float(errors[worst]),
        worst_token=worst,
    )


def stored_final(store: Store, i: int) -> torch.Tensor:
    x = np.ascontiguousarray(store.group["final_hidden_states"][store.sample_rows(i)])
    if x.dtype == np.uint16:  # bf16 bits
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def unsupported_head(model_path: Path) -> str | None:
    config = text_config(model_path)
    scaled = [k for k in UNSUPPORTED_CONFIG if config.get(k) not in (None, 1, 1.0, 0, 0.0)]
    return f"its config sets {scaled}: logits SGLang scales or caps" if scaled else None


@dataclass
class _LogprobCheck:
    store: Store
    report: VerifyReport
    head: torch.Tensor
    server: SGLangServer
    say: Callable[[str], None]

    def label(self, i: int) -> str:
        return f"{i} ({self.store.group['sample_id'][i]})"

    def one(self, i: int) -> LogprobResult:
        ids = np.asarray(self.store.group["input_ids"][self.store.sample_rows(i)]).astype(np.int64)
        rid = f"verify-logprobs-s{i}-{uuid.uuid4().hex[:8]}"  # no "hsx-": not captured
        theirs = server_logprobs(self.server, rid, ids.tolist())
        ours = reference_logprobs(stored_final(self.store, i), self.head, torch.from_numpy(ids))
        result = compare(i, str(self.store.group["sample_id"][i]), ours, theirs)
        return self.judge(result)

    def judge(self, r: LogprobResult) -> LogprobResult:
        min_agree, max_mean, max_err = TOLERANCE[self.store.manifest.dtype]
        ok = r.top1_agreement >= min_agree and r.mean_error <= max_mean and r.max_error <= max_err
        if not ok:  # NaN fails too
            self.report.error(
                "logprobs",
                f"sample {self.label(r.sample)}: stored final states do not give the server's "
                f"logprobs: top-1 agreement {r.top1_agreement:.1%} (needs >= {min_agree:.0%}), "
                f"mean |error| {r.mean_error:.4g} (needs <= {max_mean:g}), max {r.max_error:.4g} "
                f"at token {r.worst_token} (needs <= {max_err:g})",
            )
        r = LogprobResult(**{**asdict(r), "ok": ok})
        self.say(f"logprobs {describe_logprobs(asdict(r))}")
        return r

    def run(self, samples: list[int]) -> None:
        results: list[dict[str, Any]] = []
        self.report.checked["logprobs"] = results
        for i in samples:
            try:
                results.append(asdict(self.one(i)))
            except Exception as exc:
                self.report.error(
                    "logprobs",
                    f"sample {self.label(i)}: logprob check failed: {type(exc).__name__}: {exc}",
                )
                if not self.server.alive():
                    self.report.error("logprobs", "the SGLang server died; stopping")
                    break


def check_logprobs(
    store: Store,
    report: VerifyReport,
    *,
    server: VerifyServer | None,
    count: int,
    seed: int,
    say: Callable[[str], None],
) -> str | None:
    """The check, as store.verify.verify_store runs it: a skip reason or None."""
    from cluster.verify import recompute_choice  # cluster.verify imports this module

    if count <= 0 or server is None:
        return "no --model / --logprobs"
    if report.checks.get("commits") != "ran":
        return "the commit check did not run"
    samples = recompute_choice(store, count, seed)
    if not samples:
        return "no written sample to check"
    model_path = server.model_path
    problems = model_mismatches(model_path, store.manifest)
    if unsupported := unsupported_head(model_path):
        problems.append(f"{model_path}: {unsupported}")
    for problem in problems:
        report.error("logprobs", f"{problem}: not the model that made the store")
    if problems:
        return None
    say(f"logprobs: samples {samples} (seed {seed})")
    try:
        head = load_lm_head(model_path, store.manifest.hidden_size)
        running, _ = server.get(store)
    except Exception as exc:  # no head, no server, failed calibration
        report.error("logprobs", f"cannot check logprobs: {type(exc).__name__}: {exc}")
        return None
    _LogprobCheck(store, report, head, running, say).run(samples)
    return None
