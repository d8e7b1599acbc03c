"""The logprob check's arithmetic: the blocked log-softmax, near-tie top-1 flips, refused heads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.__main__ import main
from cluster.verify.logprobs import (
    Reference,
    RowLogprobs,
    compare,
    reference_logprobs,
    unsupported_head,
)
from tests.helpers.models import head_checkpoint


def test_logits_the_check_does_not_model_are_refused(tmp_path: Path, capsys) -> None:
    head_checkpoint(
        tmp_path / "m", ["lm_head.weight"], {"final_logit_softcapping": 30.0}, index=False
    )
    assert "['final_logit_softcapping']" in str(unsupported_head(tmp_path / "m"))
    assert main(["verify", "--store", str(tmp_path / "s.zarr"), "--logprobs", "2"]) == 2
    assert "--logprobs need --model" in capsys.readouterr().err


@pytest.mark.parametrize("block_bytes", [1, 3 * 16 * 4, 1 << 20])  # 1: one row and column each
def test_the_blocked_log_softmax_is_the_whole_one(block_bytes: int) -> None:
    g = torch.Generator().manual_seed(0)
    final = (3 * torch.randn(9, 16, generator=g)).to(torch.bfloat16)
    head = torch.randn(40, 16, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 40, (9, 2), generator=g)
    whole = torch.log_softmax(final.float() @ head.float().T, dim=-1)

    got = reference_logprobs(final, head, ids, block_bytes)
    torch.testing.assert_close(got.at, whole.gather(1, ids))
    assert torch.equal(got.top1_id, whole.argmax(dim=-1))
    torch.testing.assert_close(got.top1, whole.max(dim=-1).values)


def test_a_top1_flip_between_near_ties_is_noise_and_a_clear_one_is_not() -> None:
    # Three rows; the server's top-1 differs on rows 1 (a tie within 0.05) and 2 (0.5 apart).
    ours = Reference(
        at=torch.tensor([[-1.0, -0.5], [-2.0, -0.52], [-3.0, -1.0]]),
        top1_id=torch.tensor([7, 8, 9]),
        top1=torch.tensor([-0.5, -0.5, -0.5]),
    )
    server = RowLogprobs(
        next_token=torch.tensor([-1.01, -2.03]),
        top1_id=torch.tensor([7, 1, 2]),
        top1=torch.tensor([-0.5, -0.52, -0.6]),
    )
    r = compare(4, "s4", ours, server, tie=0.05)
    assert (r.tokens, r.worst_token) == (3, 2)  # the last row: its top-1 logprob, 0.1 off
    assert r.top1_agreement == pytest.approx(1 / 3)
    assert r.top1_agreement_ties == pytest.approx(2 / 3)
    assert (r.mean_error, r.max_error) == pytest.approx((0.14 / 3, 0.1), abs=1e-6)
