"""`hsx draft-bench`: how many of a draft's tokens its target accepts, served by SGLang.

    report = draft_bench(DraftBenchConfig(target=..., draft=..., data=[...]))

The prompts are planned as a generating job plans them (cluster/plan.py: any input format,
the chat template applied, the last assistant turn left to write), then the target answers
each greedily twice through our own launcher: plain, and with the draft (EAGLE-3, a chain of
`num_steps` drafts, on CPU through patches/cpu_eagle3/). From SGLang's per-request meta_info:
- accept length: tokens written per verify step (the bonus token included), over all requests
  and per request; 1.0 is a draft nothing of which is accepted;
- per position: the share of verify steps whose first k drafts were all accepted, from the
  correct-drafts histogram (`histogram[j]`: steps with exactly j correct drafts);
- tokens/s both ways (requests one at a time, the latency a draft is for), and whether the
  outputs were identical (greedy speculative decoding is lossless up to float ties: bf16 near-
  ties may differ, float32 must not).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.config import GenerateConfig
from actors.sglang_server import DraftSpec, ServerSpec, SGLangServer
from cluster.config import DataConfig
from cluster.plan import PlanStream, Reject, Sample
from hsx_store.layers import ModelConfigError, model_config
from patches.settings import CaptureSettings

REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class DraftBenchConfig:
    target: Path
    draft: Path
    data: list[str]
    max_new_tokens: int = 128
    limit: int | None = None  # the first N prompts the plan accepts; None: all
    num_steps: int = 3
    num_draft_tokens: int = 4
    # Both servers' dtype; None: the draft's own (hsx draft-convert writes the store's capture
    # dtype), since SGLang's `--dtype auto` serves a float32 config in float16.
    dtype: str | None = None
    server_args: list[str] = field(default_factory=list)  # more SGLang arguments, word by word
    # Requests in flight: 1 measures the latency a draft is for; more fill batches (faster,
    # the same greedy tokens up to float ties in the batch's sums).
    concurrency: int = 1
    device: str | None = None  # None: the GPU where there is one
    log_dir: Path | None = None  # the servers' logs; None: a temporary folder


@dataclass(frozen=True)
class Prompt:
    sample_id: str
    input_ids: list[int]


def plan_prompts(
    target: Path, data_paths: Sequence[str], max_new_tokens: int, limit: int | None
) -> tuple[list[Prompt], list[dict[str, str]]]:
    """The prompts as a generating job plans them, and the rows it rejected (with reasons)."""
    data = DataConfig(paths=list(data_paths))
    stream = PlanStream(
        data, target, planners=0, generate=GenerateConfig(max_new_tokens=max_new_tokens)
    )
    prompts: list[Prompt] = []
    rejected: list[dict[str, str]] = []
    for item in stream:
        if isinstance(item, Reject):
            rejected.append(item.to_json())
        elif isinstance(item, Sample):
            assert item.prompt is not None  # planned for generation
            if item.images:
                rejected.append({"sample_id": item.sample_id, "reason": "has images: text only"})
                continue
            end = item.prompt["segments"][0]  # the tokens before the turn to write
            prompts.append(Prompt(item.sample_id, item.input_ids[:end].tolist()))
            if limit is not None and len(prompts) == limit:
                break
    return prompts, rejected


def answer(server: SGLangServer, prompt: Prompt, max_new_tokens: int) -> dict[str, Any]:
    """One greedy response: its token ids, meta_info and seconds."""
    payload = {
        "input_ids": prompt.input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
    }
    start = time.perf_counter()
    response = server.session.post(
        server.url + "/generate", json=payload, timeout=REQUEST_TIMEOUT_S
    )
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(
            f"{prompt.sample_id}: HTTP {response.status_code}: {response.text[:500]}"
        )
    body = response.json()
    return {"output_ids": body["output_ids"], "meta": body["meta_info"], "seconds": seconds}


def serve_and_answer(
    spec: ServerSpec, log_path: Path, prompts: list[Prompt], max_new_tokens: int, concurrency: int
) -> tuple[list[dict[str, Any]], float]:
    """Every prompt's answer, in order, and the seconds they took together."""
    with SGLangServer(spec, log_path) as server:
        answer(server, prompts[0], 8)  # warm up: the first request pays one-time costs
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            answers = list(pool.map(lambda p: answer(server, p, max_new_tokens), prompts))
        return answers, time.perf_counter() - start


def per_position(histogram: Sequence[int], num_steps: int) -> list[float]:
    """P(the first k drafts of a verify step are all accepted), k = 1..num_steps."""
    steps = sum(histogram)
    if steps == 0:
        return [0.0] * num_steps
    return [sum(histogram[k:]) / steps for k in range(1, num_steps + 1)]


def summarize(
    baseline: tuple[list[dict[str, Any]], float],
    drafted: tuple[list[dict[str, Any]], float],
    prompts: list[Prompt],
    num_steps: int,
) -> dict[str, Any]:
    (baseline, baseline_s), (drafted, drafted_s) = baseline, drafted
    histogram = [0] * (num_steps + 1)
    requests = []
    for prompt, plain, spec in zip(prompts, baseline, drafted, strict=True):
        meta = spec["meta"]
        for j, count in enumerate(meta.get("spec_correct_drafts_histogram") or []):
            histogram[j] += count
        requests.append(
            {
                "sample_id": prompt.sample_id,
                "accept_length": meta.get("spec_accept_length", 1.0),
                "verify_steps": meta.get("spec_verify_ct", 0),
                "completion_tokens": meta["completion_tokens"],
                "identical": plain["output_ids"] == spec["output_ids"],
            }
        )
    tokens = sum(r["completion_tokens"] for r in requests)
    verify_steps = sum(r["verify_steps"] for r in requests)
    lengths = [r["accept_length"] for r in requests]
    return {
        "accept_length": tokens / verify_steps if verify_steps else 1.0,
        "accept_length_per_request": {
            "mean": statistics.fmean(lengths),
            "min": min(lengths),
            "max": max(lengths),
        },
        "per_position": per_position(histogram, num_steps),
        "correct_drafts_histogram": histogram,
        "tokens_per_s": tokens / drafted_s,
        "tokens_per_s_baseline": sum(r["meta"]["completion_tokens"] for r in baseline) / baseline_s,
        "identical": all(r["identical"] for r in requests),
        "identical_requests": sum(r["identical"] for r in requests),
        "requests": requests,
    }


def draft_dtype(draft: Path) -> str:
    """The dtype a draft's config names (`dtype`; older configs: `torch_dtype`)."""
    try:
        config = model_config(draft)
    except ModelConfigError as exc:
        raise ValueError(f"{draft} is not a draft directory: {exc}") from None
    dtype = config.get("dtype") or config.get("torch_dtype")
    if not isinstance(dtype, str):
        raise ValueError(f"{draft}/config.json names no dtype: pass one (--dtype)")
    return dtype


def draft_bench(config: DraftBenchConfig, say: Callable[[str], None] = print) -> dict[str, Any]:
    """The report of `config.draft` against the target alone."""
    return bench_drafts(config, {"draft": config.draft}, say)["draft"]


def bench_drafts(
    config: DraftBenchConfig, drafts: Mapping[str, Path], say: Callable[[str], None] = print
) -> dict[str, dict[str, Any]]:
    """A report per draft (by name), each against the one run of the target alone."""
    prompts, rejected = plan_prompts(
        config.target, config.data, config.max_new_tokens, config.limit
    )
    for row in rejected:
        say(f"skipped {row['sample_id']}: {row['reason']}")
    if not prompts:
        raise ValueError(f"no prompt to benchmark in {', '.join(config.data)}")
    log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="hsx-draft-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    dtype = config.dtype or draft_dtype(next(iter(drafts.values())))

    def run(log_name: str, **kind: Any) -> tuple[list[dict[str, Any]], float]:
        spec = ServerSpec(
            config.target,
            CaptureSettings.from_env({}),  # capture off
            extra_args=["--dtype", dtype, *config.server_args],
            device=config.device,
            **kind,
        )
        logs = log_dir / f"{log_name}.log"
        return serve_and_answer(spec, logs, prompts, config.max_new_tokens, config.concurrency)

    say(f"{len(prompts)} prompts, up to {config.max_new_tokens} new tokens each: the target alone")
    baseline = run("baseline", plain=True)
    reports = {}
    for name, path in drafts.items():
        say(f"the target with {name} ({path})")
        draft = DraftSpec(path, config.num_steps, 1, config.num_draft_tokens)
        report = summarize(baseline, run(name, draft=draft), prompts, config.num_steps)
        report["rejected"] = rejected
        report["config"] = {
            "target": str(config.target),
            "draft": str(path),
            "num_steps": config.num_steps,
            "num_draft_tokens": config.num_draft_tokens,
            "max_new_tokens": config.max_new_tokens,
            "concurrency": config.concurrency,
            "dtype": dtype,
            "server_args": list(config.server_args),
        }
        reports[name] = report
    return reports


def print_report(report: dict[str, Any], say: Callable[[str], None] = print) -> None:
    """The report as a user reads it: the totals, the per-position table, each request."""
    per_request = report["accept_length_per_request"]
    say(
        f"accept length {report['accept_length']:.3f} (per request: mean "
        f"{per_request['mean']:.3f}, {per_request['min']:.3f} to {per_request['max']:.3f})"
    )
    say("draft position  accepted")
    for k, rate in enumerate(report["per_position"], start=1):
        say(f"{k:>14}  {rate:.3f}")
    say(
        f"tokens/s {report['tokens_per_s']:.1f} with the draft, "
        f"{report['tokens_per_s_baseline']:.1f} without"
    )
    n = len(report["requests"])
    say(f"identical outputs: {report['identical_requests']} of {n} requests")
    for r in report["requests"]:
        say(
            f"  {r['sample_id']}: accept length {r['accept_length']:.3f} over "
            f"{r['verify_steps']} verify steps, {r['completion_tokens']} tokens"
            + ("" if r["identical"] else " (output differs)")
        )
