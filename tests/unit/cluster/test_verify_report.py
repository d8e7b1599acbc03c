"""The model checks' per-sample lines: each said as it is found and listed in the report, under
the check's title, in the words the report has always used."""

from __future__ import annotations

from cluster.verify.logprobs import LogprobCheck, LogprobResult
from cluster.verify.recompute import RecomputeCheck, describe_recompute
from hsx_store.integrity_report import CHECKS, VerifyReport

RECOMPUTED = {
    "sample": 3,
    "sample_id": "p3",
    "ok": False,
    "arrays": {
        "aux_hidden_states": {
            "distance": 0.0123,
            "token": 4,
            "noise": 0.0,
            "pooled_noise": 0.004,
            "bound": 0.04,
            "nearest_other": 5,
            "other_distance": 1.5,
        },
        "final_hidden_states": {
            "distance": 2e-6,
            "token": 1,
            "noise": 3e-7,
            "pooled_noise": 6e-7,
            "bound": 4e-5,
        },
    },
}
LOGPROBS = LogprobResult(
    sample=5,
    sample_id="p5",
    tokens=17,
    top1_agreement=0.9412,
    top1_agreement_ties=1.0,
    mean_error=0.0031,
    max_error=0.0072,
    worst_token=9,
    ok=True,
)
RECOMPUTED_LINE = (
    "sample 3 (p3): aux 1.230% (noise 0.00e+00, all 0.400%, bound 4.000%) sample 5's 150.000%, "
    "final 2.00e-06 (noise 3.00e-07, all 6.00e-07, bound 4.00e-05): FAIL"
)
LOGPROBS_LINE = (
    "sample 5 (p5): 17 tokens, top-1 94.1% (100.0% with near-ties), mean |error| 3.10e-03, max "
    "7.20e-03 at token 9: ok"
)


def test_each_checked_sample_is_said_and_listed_in_the_report() -> None:
    report, said = VerifyReport(url="mem://s.zarr"), []
    report.checks.update(dict.fromkeys(CHECKS, "ran"))
    report.error("recompute", "x")
    # tell() needs neither the store nor the server
    RecomputeCheck(None, report, None, said.append).tell(describe_recompute(RECOMPUTED))
    LogprobCheck(None, report, None, said.append).tell(LOGPROBS.describe())

    assert said == [f"recompute {RECOMPUTED_LINE}", f"logprobs {LOGPROBS_LINE}"]
    assert report.format().splitlines()[-6:] == [
        "  ERROR [recompute] x",
        "recomputed samples (1):",
        f"  {RECOMPUTED_LINE}",
        "logprob samples (1):",
        f"  {LOGPROBS_LINE}",
        "result: FAIL (1 errors, 0 warnings)",
    ]
