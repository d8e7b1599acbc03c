"""The proof by serving (`make proof`, a step of .ci/run): a draft trained on our data is accepted
by SGLang, and one served with the wrong layers is not.

    python -m tools.draft_proof [--out out/draft-proof] [--steps N] [--no-check]

1. the target: a tiny Llama trained here on a corpus of rules (tools/trained_target.py, made
   once into .cache/models), whose greedy answers a draft can learn;
2. conversations from the generator of its corpus with other seeds: training conversations
   for the job, held-out prompts for the benchmark (none in the other, or in its corpus);
3. the job (ray_configs/draft_proof_job.yaml, `ray job submit` to a local Ray head) captures
   the training conversations into a store (capture only: a generating job gives the target's
   own answers, which for this target are these up to its few errors, at ~20x the CPU time);
4. `hsx export --format speculators`;
5. speculators' own data pipeline, draft model and loss train a draft on the export on CPU for
   `--steps` steps (examples/train_draft.py, in .venv-trainers), and save one as initialized:
   the random draft, the same architecture and seed;
6. `hsx draft-convert` makes each one SGLang's, and the trained one once more with
   `--layer-shift 1`: trained on the store's layers [a, b, c], served [a+1, b+1, c+1];
7. `hsx draft-bench` (float32, greedy) serves the target alone once and with each draft.

It checks that the trained draft's accept length beats the random one's by MARGIN, that the
shifted one's falls short of the trained one's by SHIFT_MARGIN (so the check fails wrong data),
and that every float32 speculative output equals the target's own (lossless). Prints the table
and writes OUT/proof.json; exit 1 when a check fails (unless --no-check), 2 when a stage fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.draft_bench import DraftBenchConfig, bench_drafts
from hsx_store.format import Store
from tools.ray_head import BIN, local_head
from tools.tiny_models import ensure_models
from tools.trained_target import TRAIN_PROMPTS_SEED, conversations, write_prompts

REPO = Path(__file__).resolve().parent.parent
TARGET = "llama-trained"
TRAINERS_PYTHON = REPO / ".venv-trainers/bin/python"
JOB_CONFIG = REPO / "ray_configs/draft_proof_job.yaml"
HSX = [sys.executable, "-m", "cluster"]

TRAIN_PROMPTS = 400
HELD_OUT_PROMPTS = 48
MAX_NEW_TOKENS = 96
# The draft's training: measured on this target (docs/benchmarks.md, "Draft acceptance"), 300
# steps of 1024 tokens at speculators-like lr 1e-3 fit it in about a minute; a higher lr fits
# faster but learns features a one-layer shift barely moves.
STEPS = 300
TOKENS_PER_STEP = 1024
# Measured (docs/train-and-serve-a-draft.md; benchmarks/draft_accept.py over seeds 0-4): the
# trained draft's accept length 2.62-2.71, the random one's 1.02-1.04, so MARGIN sits 0.5 under
# the smallest gap. Served one layer off, the same draft lost 0.065-0.182 (0.132 on seed 0;
# paired: the outputs are the same tokens); a shift costing less than SHIFT_MARGIN fails it.
MARGIN = 1.0
SHIFT_MARGIN = 0.04


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "out/draft-proof")
    parser.add_argument("--models", type=Path, default=REPO / ".cache/models")
    parser.add_argument("--target", type=Path, help=f"another target (default: {TARGET})")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps of the draft")
    parser.add_argument("--seed", type=int, default=0, help="the draft's initialization and order")
    parser.add_argument("--no-check", action="store_true", help="measure only (benchmarks)")
    args = parser.parse_args(argv)
    try:
        target = args.target or ensure_models(args.models, [TARGET])[TARGET]
        results = prove(args.out.resolve(), target.resolve(), args.steps, args.seed)
    except StageFailed as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    failures = [] if args.no_check else check(results)
    for failure in failures:
        print(f"FAILED: {failure}", flush=True)
    return 1 if failures else 0


class StageFailed(RuntimeError):
    pass


def stage(name: str, cmd: list[str], log: Path, **kwargs: Any) -> None:
    """One command of the pipeline, its output in `log`; a failure names the stage and log."""
    start = time.monotonic()
    print(f"[{name}] $ {' '.join(cmd)}", flush=True)
    with log.open("w") as out:
        code = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, **kwargs)
    print(f"[{name}] exit {code.returncode} in {time.monotonic() - start:.0f} s", flush=True)
    if code.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise StageFailed(f"{name} exited {code.returncode} (log: {log}):\n{tail}")


@dataclass(frozen=True)
class Captured:
    """What the job made: the store, its speculators export, the held-out prompts."""

    store: Path
    export: Path
    held_out: Path


def prove(out: Path, target: Path, steps: int, seed: int) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)  # everything but the target is made again
    captured = capture(out, target)
    return train_and_serve(out, target, captured, steps, seed)


def capture(out: Path, target: Path) -> Captured:
    """The prompts, the job (through `ray job submit`) and the export."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    prompts = write_prompts(out / "prompts", train=TRAIN_PROMPTS, held_out=HELD_OUT_PROMPTS)
    train_rows = out / "train_conversations.jsonl"
    with train_rows.open("w") as f:  # the training prompts (same seed) with their answers
        for k, (task, messages) in enumerate(conversations(TRAIN_PROMPTS_SEED, TRAIN_PROMPTS)):
            f.write(json.dumps({"id": f"train-{k:05d}", "task": task, "messages": messages}) + "\n")
    store = out / "store.zarr"
    with local_head({"sglang_node": 1}, num_cpus=2, log_path=logs / "ray-head.log") as head:
        address, env = head
        job = [
            str(BIN / "ray"), "job", "submit", "--address", address,
            "--runtime-env", "ray_configs/runtime_env.yaml",
            "--", "python", "-m", "cluster", "run", "--config", str(JOB_CONFIG),
            "--set", f"model.path={target}",
            "--set", f"data.paths={json.dumps([str(train_rows)])}",
            "--set", f"store.url={store}",
        ]  # fmt: skip
        stage("job", job, logs / "job.log", env=env)
    export = out / "export"
    stage("export", [*HSX, "export", "--store", str(store), "--format", "speculators",
                     "--out", str(export)], logs / "export.log")  # fmt: skip
    return Captured(store, export, prompts.held_out)


def train_and_serve(
    out: Path, target: Path, captured: Captured, steps: int, seed: int
) -> dict[str, Any]:
    """Train (and initialize) a draft on the export, convert it three ways, serve each."""
    logs = out / "logs"
    trained, random = out / "speculators/trained", out / "speculators/random"
    for name, path, n in (("train", trained, steps), ("random", random, 0)):
        stage(name, [
            str(TRAINERS_PYTHON), "examples/train_draft.py", "--data-path", str(captured.export),
            "--max-steps", str(n), "--total-seq-len", str(TOKENS_PER_STEP), "--lr", "1e-3",
            "--seed", str(seed), "--save-path", str(path),
        ], logs / f"{name}.log")  # fmt: skip
    served = {"trained": (trained, 0), "random": (random, 0), "shifted": (trained, 1)}
    drafts = {}
    for name, (source, shift) in served.items():
        drafts[name] = out / "sglang" / name
        stage(f"convert {name}", [
            *HSX, "draft-convert", "--draft", str(source), "--store", str(captured.store),
            "--model", str(target), "--out", str(drafts[name]), "--layer-shift", str(shift),
        ], logs / f"convert-{name}.log")  # fmt: skip
    config = DraftBenchConfig(
        target=target,
        draft=drafts["trained"],
        data=[str(captured.held_out)],
        max_new_tokens=MAX_NEW_TOKENS,
        concurrency=4,
        log_dir=logs,
    )
    reports = bench_drafts(config, drafts, say=lambda text: print(f"[bench] {text}", flush=True))
    log = json.loads((trained / "train_log.json").read_text())
    store = Store.open(str(captured.store))
    results = {
        "target": str(target),
        "layer_ids": store.manifest.layer_ids,
        "samples": store.num_samples,
        "steps": steps,
        "seed": seed,
        "training": log[-1] if log else None,  # the last step's loss, the validation metrics
        "reports": reports,
    }
    (out / "proof.json").write_text(json.dumps(results, indent=1) + "\n")
    print_table(results)
    return results


def print_table(results: dict[str, Any]) -> None:
    reports = results["reports"]
    steps = len(reports["trained"]["per_position"])
    head = "draft     accept length  " + "  ".join(f"pos {k}" for k in range(1, steps + 1))
    print(head + "  identical", flush=True)
    for name, report in reports.items():
        positions = "  ".join(f"{rate:5.3f}" for rate in report["per_position"])
        n = len(report["requests"])
        print(
            f"{name:<9} {report['accept_length']:13.3f}  {positions}  "
            f"{report['identical_requests']}/{n}",
            flush=True,
        )


def check(results: dict[str, Any]) -> list[str]:
    reports = results["reports"]
    trained, random, shifted = (
        reports[k]["accept_length"] for k in ("trained", "random", "shifted")
    )
    failures = []
    if trained < random + MARGIN:
        failures.append(
            f"the trained draft's accept length {trained:.3f} is not {MARGIN} above the random "
            f"draft's {random:.3f}"
        )
    if shifted > trained - SHIFT_MARGIN:
        failures.append(
            f"served on layers shifted by one, the draft still reaches {shifted:.3f} (on its "
            f"own layers: {trained:.3f}): the check cannot see wrong layers"
        )
    for name, report in reports.items():
        if not report["identical"]:
            failures.append(
                f"{name}: {len(report['requests']) - report['identical_requests']} float32 "
                "speculative outputs differ from the target's own (lossless broken)"
            )
    return failures


if __name__ == "__main__":
    sys.exit(main())
