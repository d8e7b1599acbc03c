"""The planner vs the bare work it has to do: samples/s per core, and the wall time on all cores.

Baseline: the same JSONL rows parsed, each conversation rendered once with
`apply_chat_template(tokenize=False)` and tokenized in batches of 1000 rows. Measured: the
planner (`PlanStream` in this process), which also checks fields and roles, ids and duplicates,
builds the assistant loss mask and checks limits and the vocabulary. Chat rows under a ChatML
template without `{% generation %}` markers; one core each; rounds alternate. Then the planner
on every core through Ray, its wall time printed.

    .venv/bin/python -m benchmarks.plan_vs_raw_tokenize   # or: make bench BENCH=<this name>

Details and figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from benchmarks.rounds import alternate
from cluster.config import DataConfig
from cluster.plan import PlanStream, Sample
from tools.tiny_models import _WORDS, ensure_models

CHATML = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_rows(path: Path, count: int, seed: int = 0) -> None:
    """Chat rows of 1-3 turns, ~380 tokens each with the tiny tokenizer (~1.1 tokens a word)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(count):
            turns = rng.randint(1, 3)
            words = 340 // turns
            messages = []
            for _ in range(turns):
                for role in ("user", "assistant"):
                    n = rng.randint(words // 3, words * 2 // 3)
                    text = " ".join(rng.choice(_WORDS) for _ in range(n))
                    messages.append({"role": role, "content": text})
            f.write(json.dumps({"id": f"r{i}", "messages": messages}) + "\n")


def baseline_rate(path: Path, tokenizer, template: str) -> float:
    """Rows/s: read + parse + render once + batch tokenize."""
    start = time.perf_counter()
    rows = 0
    with path.open("rb") as f:
        batch: list[str] = []
        for line in f:
            messages = json.loads(line)["messages"]
            batch.append(
                tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
            )
            if len(batch) == 1000:
                rows += len(tokenizer(batch, add_special_tokens=False)["input_ids"])
                batch = []
        if batch:
            rows += len(tokenizer(batch, add_special_tokens=False)["input_ids"])
    return rows / (time.perf_counter() - start)


def plan_rate(data: DataConfig, model: Path, planners: int = 0) -> tuple[float, int, int]:
    """Rows/s through the planner, and the samples and tokens it accepted."""
    start = time.perf_counter()
    stream = PlanStream(data, model, planners=planners)
    samples = tokens = 0
    for item in stream:
        if isinstance(item, Sample):
            samples += 1
            tokens += len(item.input_ids)
    seconds = time.perf_counter() - start
    return (stream.accepted + stream.rejected) / seconds, samples, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000, help="rows per round")
    parser.add_argument("--all-cores-rows", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", type=Path, default=Path(".cache/models"))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    model = ensure_models(args.models, ["llama-tiny"])["llama-tiny"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    with tempfile.TemporaryDirectory(prefix="plan_vs_raw_tokenize-") as work:
        work_dir = Path(work)
        rows, template = work_dir / "rows.jsonl", work_dir / "chatml.jinja"
        write_rows(rows, args.rows)
        template.write_text(CHATML)
        data = DataConfig(paths=[str(rows)], chat_template=str(template), max_length=4096)
        _, samples, tokens = plan_rate(data, model)  # warm: tokenizer, template, page cache
        assert samples == args.rows, f"the planner rejected {args.rows - samples} rows"
        print(f"{args.rows} chat rows, {tokens / samples:.0f} tokens per row, one core each side")
        rounds = alternate(
            baseline=lambda: baseline_rate(rows, tokenizer, CHATML),
            measured=lambda: plan_rate(data, model)[0],
            rounds=args.rounds,
        )
        rounds.show("rows/s", baseline="render+tokenize", measured="planner")
        all_cores(work_dir, model, template, args.all_cores_rows)
    print(rounds.result_line("plan_vs_raw_tokenize", target=0.8))


def all_cores(work_dir: Path, model: Path, template: Path, count: int) -> None:
    import ray

    from tools.ray_head import private_temp_dir

    rows = work_dir / "many.jsonl"
    write_rows(rows, count, seed=1)
    cores = os.cpu_count() or 1
    data = DataConfig(paths=[str(rows)], chat_template=str(template), max_length=4096)
    with private_temp_dir() as temp_dir:
        ray.init(address="local", num_cpus=cores, include_dashboard=False, _temp_dir=temp_dir)
        try:
            rate, samples, _ = plan_rate(data, model, planners=cores)
        finally:
            ray.shutdown()
    print(
        f"all {cores} cores (Ray tasks, local Ray): {count} rows planned in {count / rate:.1f} s "
        f"({rate:,.0f} rows/s, {samples} samples, Ray start-up of its workers included)"
    )


if __name__ == "__main__":
    main()
