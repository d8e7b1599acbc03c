"""`verify --logprobs N`: do the stored final states give the model's own next-token logprobs?

For N seeded random written samples (the recompute's choice), the server shared with
`--recompute` (cluster/verify/server.py) prefills the stored `input_ids` with `return_logprob`;
the check computes log_softmax(stored post-norm final state @ lm_head.T) itself, in float32, in
bounded blocks, with the head read alone from the checkpoint (hsx_store/lm_head.py). Per sample:
the top-1 agreement (near-ties within `tie` count as agreeing) and the mean / max absolute
logprob error, within `TOLERANCE`, whose measurements are next to it. Models whose logits
SGLang scales or caps are refused.

Design: docs/design/verify.md.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from cluster.verify.model_check import ModelCheck
from hsx_store.format import Store
from hsx_store.lm_head import load_lm_head, text_config

if TYPE_CHECKING:
    from actors.sglang_server import SGLangServer

BLOCK_BYTES = 64 << 20  # float32 logits (and head rows) computed at once
UNSUPPORTED_CONFIG = ("logit_scale", "final_logit_softcapping")


class Bounds(NamedTuple):
    min_top1: float  # share of rows whose top-1 token agrees, near-ties counted as agreeing
    max_mean: float  # of |logprob error|, nats
    max_error: float
    tie: float  # a server top-1 within this of the stored row's own top-1 logprob is a tie


# Per sample, of stored final states against the server's logprobs of the same prompt,
# prefilled alone (the rows were captured in a batch). Measured on the tiny models on CPU
# (tests/integration/test_verify_model_checks.py, 8 samples of 2..95 tokens captured at once),
# worst sample:
#                          exact top-1   mean |error|   max |error|   (nats)
#   llama-tiny bf16        100%          3.3e-3         6.5e-3
#   deepseek-v3-tiny bf16  93.3%         3.0e-3         7.2e-3   (100% counting ties <= 0.05)
#   deepseek-v3-tiny fp32  100%          2.6e-6         2.9e-6
#   another sample's rows  0%            0.72 / 0.85    2.6 / 2.5     (bf16 / fp32)
#   shifted by one token   32% / 0%      0.15 / 0.89    1.2 / 3.0
# The bounds sit far above that noise (bf16: 15x on the mean, 150x on the max) because a real
# model's logits are ~10x the tiny random ones' (their bf16 rounding and batch noise grow with
# them); wrong rows of a real model miss by whole nats. A top-1 flip between tokens within
# `tie` of each other (under the stored row) is noise, not a disagreement.
TOLERANCE = {
    "bfloat16": Bounds(min_top1=0.9, max_mean=0.05, max_error=1.0, tie=0.05),
    "float32": Bounds(min_top1=0.98, max_mean=1e-3, max_error=1e-2, tie=1e-3),
}


@dataclass(frozen=True)
class RowLogprobs:
    """The server's, per row t of a sample: the logprob of token t+1 (every row but the last),
    the top-1 token and its logprob."""

    next_token: torch.Tensor  # float32 [T-1]
    top1_id: torch.Tensor  # int64 [T]
    top1: torch.Tensor  # float32 [T]


@dataclass(frozen=True)
class Reference:
    """The stored rows', per row: the logprobs of the asked token ids, the top-1 token and its
    logprob."""

    at: torch.Tensor  # float32 [T, k]
    top1_id: torch.Tensor  # int64 [T]
    top1: torch.Tensor  # float32 [T]


@dataclass(frozen=True)
class LogprobResult:
    sample: int
    sample_id: str
    tokens: int
    top1_agreement: float  # exact
    top1_agreement_ties: float  # near-ties counted as agreeing: what is judged
    mean_error: float
    max_error: float
    worst_token: int  # the row of the max error
    ok: bool = False

    def describe(self) -> str:
        """Top-1 agreement (exact, and near-ties counted as agreeing), mean and max absolute
        error (nats)."""
        verdict = "ok" if self.ok else "FAIL"
        return (
            f"sample {self.sample} ({self.sample_id}): {self.tokens} tokens, top-1 "
            f"{self.top1_agreement:.1%} ({self.top1_agreement_ties:.1%} with near-ties), "
            f"mean |error| {self.mean_error:.2e}, max "
            f"{self.max_error:.2e} at token {self.worst_token}: {verdict}"
        )


def reference_logprobs(
    final: torch.Tensor, head: torch.Tensor, ids: torch.Tensor, block_bytes: int = BLOCK_BYTES
) -> Reference:
    """log_softmax(final @ head.T) in float32 at `ids` [T, k] (k token ids per row), with each
    row's top-1, one block of head rows and one block of sample rows at a time (a running max
    and sum of exponentials per row: the softmax over blocks of the vocabulary)."""
    t, h = final.shape
    vocab = head.shape[0]
    vocab_block = max(1, block_bytes // (h * 4))
    row_block = max(1, block_bytes // (min(vocab, vocab_block) * 4))
    best = torch.full((t,), -torch.inf)
    best_id = torch.zeros(t, dtype=torch.int64)
    sum_exp = torch.zeros(t)  # of logits - best
    at_logit = torch.full(ids.shape, torch.nan)
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
            local = ids[r0:r1] - v0
            inside = (local >= 0) & (local < w.shape[0])
            picked = logits.gather(1, local.clamp(0, w.shape[0] - 1))
            at_logit[r0:r1] = torch.where(inside, picked, at_logit[r0:r1])
    log_norm = best + torch.log(sum_exp)
    return Reference(at_logit - log_norm[:, None], best_id, best - log_norm)


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


def compare(
    sample: int, sample_id: str, ours: Reference, server: RowLogprobs, tie: float
) -> LogprobResult:
    """`ours.at` holds, per row, the logprobs of token t+1 (any id on the last row) and of the
    server's top-1. Row t's error: its token t+1 logprob; the last row's, its top-1 logprob."""
    errors = torch.cat([ours.at[:-1, 0] - server.next_token, ours.top1[-1:] - server.top1[-1:]])
    errors = errors.abs()
    worst = int(torch.nan_to_num(errors, nan=torch.inf).argmax())
    same = ours.top1_id == server.top1_id
    near_tie = ours.top1 - ours.at[:, 1] <= tie
    return LogprobResult(
        sample=sample,
        sample_id=sample_id,
        tokens=len(errors),
        top1_agreement=float(same.double().mean()),
        top1_agreement_ties=float((same | near_tie).double().mean()),
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


class LogprobCheck(ModelCheck):
    """The stored post-norm final states through the lm_head against the server's logprobs."""

    name = "logprobs"
    cannot = "cannot check logprobs"
    listing = "logprob samples"

    def skip_reason(self) -> str | None:
        if self.store.manifest.dtype not in TOLERANCE:
            measured = " and ".join(TOLERANCE)
            return f"its bounds are measured for {measured} stores, not {self.store.manifest.dtype}"
        if self.store.holds_images:
            # An image's rows carry SGLang's pad values as token ids: no prompt logprob there.
            return "it is not defined at image rows, and the store holds images (use --recompute)"
        return None

    def model_problems(self) -> list[str]:
        assert self.server is not None
        path = self.server.model_path
        unsupported = unsupported_head(path)
        return [f"{path}: {unsupported}, the check computes plain ones"] if unsupported else []

    def run_on(self, samples: list[int]) -> None:
        assert self.server is not None
        head = load_lm_head(self.server.model_path, self.store.manifest.hidden_size)
        server, _ = self.server.get(self.store)
        results: list[dict[str, Any]] = []
        self.report.checked["logprobs"] = results
        for i in samples:
            try:
                results.append(asdict(self.one(server, head, i)))
            except Exception as exc:
                self.report.error(
                    "logprobs",
                    f"sample {self.label(i)}: logprob check failed: {type(exc).__name__}: {exc}",
                )
                if not server.alive():
                    self.report.error("logprobs", "the SGLang server died; stopping")
                    break

    def one(self, server: SGLangServer, head: torch.Tensor, i: int) -> LogprobResult:
        ids = self.input_ids(i)
        rid = f"verify-logprobs-s{i}-{uuid.uuid4().hex[:8]}"  # no "hsx-": not captured
        theirs = server_logprobs(server, rid, ids.tolist())
        # Per row: token t+1 (the last row has none: its top-1 stands in) and the server's top-1.
        asked = torch.stack(
            [torch.cat([torch.from_numpy(ids[1:]), theirs.top1_id[-1:]]), theirs.top1_id], dim=1
        )
        ours = reference_logprobs(stored_final(self.store, i), head, asked)
        bounds = TOLERANCE[self.store.manifest.dtype]
        result = compare(i, str(self.store.group["sample_id"][i]), ours, theirs, bounds.tie)
        return self.judge(result, bounds)

    def judge(self, r: LogprobResult, b: Bounds) -> LogprobResult:
        agree = r.top1_agreement_ties
        ok = agree >= b.min_top1 and r.mean_error <= b.max_mean and r.max_error <= b.max_error
        if not ok:  # NaN fails too
            self.report.error(
                "logprobs",
                f"sample {self.label(r.sample)}: stored final states do not give the server's "
                f"logprobs: top-1 agreement {agree:.1%} with ties within {b.tie:g} (needs >= "
                f"{b.min_top1:.0%}), mean |error| {r.mean_error:.4g} (needs <= {b.max_mean:g}), "
                f"max {r.max_error:.4g} at token {r.worst_token} (needs <= {b.max_error:g})",
            )
        r = replace(r, ok=ok)
        self.tell(r.describe())
        return r
