"""A generate-then-capture job's samples/s vs a plain client's generate, then prefill.

Raw: a plain concurrent client (K in flight) has a patched server, started with the worker's
flags, generate a response to every prompt (greedy, max_new_tokens, stopping at eos), then
prefills each prompt + response (rids the plugin does not capture); samples/s from its first
request to its last. Job: `python -m cluster run`'s driver on a local Ray with one node, the
same prompts as text rows and `generate:` with the same settings and K (generate.inflight and
worker.inflight): planning, the parts kept in the store's location, the driver planning the
responses, capture (dumps read and verified, rows written, commits); samples/s from its first
part's generation to its last shard's commit (server start-up excluded, as the raw side's).
Each side starts its own server every round; rounds alternate (benchmarks/rounds.py), the value
is the median of the per-round ratios. Also printed per side: where the time went.

    make bench BENCH=generate_capture_vs_raw
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from actors.sglang_server import ServerSpec, SGLangServer
from benchmarks.rounds import alternate
from cluster.config import parse_config
from cluster.driver import run_job
from hsx_store.format import Store
from hsx_store.generated import GeneratedParts
from patches.settings import CaptureSettings
from tools.ray_head import local_ray
from tools.tiny_models import ensure_models

TARGET = 0.9
WORDS = "a draft model learns what the target model would say next at every token".split()


def raw_samples_per_s(
    model: Path, prompts: list[list[int]], args: argparse.Namespace, work: Path, tag: str
) -> tuple[float, str]:
    capture = CaptureSettings(work / "raw-dumps", "hsx-", 1 << 30, mla_cpu_fix=True)
    spec = ServerSpec(
        model_path=model, capture=capture, max_total_tokens=8192, extra_args=["--dtype", "bfloat16"]
    )
    eos = AutoTokenizer.from_pretrained(model).eos_token_id
    sampling = {"max_new_tokens": args.new_tokens, "temperature": 0, "stop_token_ids": [eos]}

    def generate(i: int) -> list[int]:
        payload = {"rid": f"raw-g-{tag}-{i}", "input_ids": prompts[i], "sampling_params": sampling}
        response = server.session.post(server.url + "/generate", json=payload, timeout=600)
        response.raise_for_status()
        return prompts[i] + response.json()["output_ids"]

    def prefill(ids: list[int]) -> None:
        payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
        server.session.post(server.url + "/generate", json=payload, timeout=600).raise_for_status()

    with (
        SGLangServer(spec, work / f"raw-{tag}.log") as server,
        ThreadPoolExecutor(args.inflight) as pool,
    ):
        list(pool.map(prefill, prompts[: args.inflight]))  # warm up
        start = time.perf_counter()
        samples = list(pool.map(generate, range(len(prompts))))
        generated = time.perf_counter()
        list(pool.map(prefill, samples))
        seconds = time.perf_counter() - start
    where = f"generate {generated - start:.1f} s, prefill {seconds - (generated - start):.1f} s"
    return len(prompts) / seconds, where


def job_samples_per_s(
    model: Path, data: Path, args: argparse.Namespace, work: Path, tag: str
) -> tuple[float, str]:
    store_url = work / f"store-{tag}.zarr"
    config = parse_config(
        {
            "model": {"path": str(model)},
            "data": {"paths": [str(data)], "max_length": 2048},
            "store": {"url": str(store_url), "samples_per_shard": args.per_shard},
            "server": {"max_total_tokens": 8192},
            "worker": {"inflight": args.inflight, "dump_root": str(work), "log_root": str(work)},
            "generate": {"max_new_tokens": args.new_tokens, "inflight": args.inflight},
            "driver": {"progress_interval_s": 5, "planners": 1},
        }
    )
    log: list[str] = []
    try:
        if run_job(config, say=log.append) != 0:
            raise RuntimeError("the job failed:\n" + "\n".join(log[-40:]))
        store = Store.open(store_url)
        keep = GeneratedParts(store.group.store)
        records = [keep.responses(k) or {} for k in keep.parts()]
        summaries = [store.summary(k) or {} for k in range(len(store.shards))]
    finally:
        shutil.rmtree(store_url, ignore_errors=True)
    start = min(r["started_at"] for r in records)
    seconds = max(s["finished_at"] for s in summaries) - start
    generating = sum(r["seconds"] for r in records)
    capturing = sum(s["seconds"] for s in summaries)
    where = (
        f"generating {generating:.1f} s, capturing {capturing:.1f} s (writes "
        f"{sum(s['bytes_written'] for s in summaries) / 1e6:.0f} MB), overlapped in {seconds:.1f} s"
    )
    return store.num_samples / seconds, where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--inflight", type=int, default=8)
    parser.add_argument("--per-shard", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", type=Path, default=Path(".cache/models"))
    args = parser.parse_args()

    model = ensure_models(args.models, ["llama-bench"])["llama-bench"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [
        " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(40 + (i * 37) % 160))
        for i in range(args.prompts)
    ]
    prompts = [tokenizer(t)["input_ids"] for t in texts]  # the job's text rows' prompts
    work = Path(tempfile.mkdtemp(prefix="generate_capture_vs_raw-", dir="/dev/shm"))
    data = work / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"p{i}", "text": t}) + "\n" for i, t in enumerate(texts))
    )
    tags = iter(range(2 * args.rounds))
    where: dict[str, list[str]] = {"raw": [], "job": []}

    def side(name: str, run: Any) -> float:
        rate, said = run()
        where[name].append(said)
        return rate

    try:
        with local_ray(2, resources={"sglang_node": 1}):  # own ports, own files
            rounds = alternate(
                baseline=lambda: side(
                    "raw", lambda: raw_samples_per_s(model, prompts, args, work, f"r{next(tags)}")
                ),
                measured=lambda: side(
                    "job", lambda: job_samples_per_s(model, data, args, work, f"r{next(tags)}")
                ),
                rounds=args.rounds,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"{args.prompts} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"max_new_tokens {args.new_tokens}, K={args.inflight} in flight"
    )
    for name, said in where.items():
        for k, line in enumerate(said):
            print(f"  {name} round {k}: {line}")
    rounds.show("samples/s", baseline="raw generate, then prefill", measured="generate-capture job")
    print(rounds.result_line("generate_capture_vs_raw", TARGET))


if __name__ == "__main__":
    main()
