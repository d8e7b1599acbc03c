"""`make demo`: the patched SGLang server on a tiny DeepseekV3, on CPU, capturing a few prompts.

Makes the tiny models (once, into .cache/models), starts the server with the capture plugin
on, sends a few prompts concurrently as text (so SGLang batches them), and prints where
each dump is and what it holds. The full Ray job replaces this once the driver exists.
"""

from __future__ import annotations

import argparse
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from actors.capture_client import generate_and_capture, wait_for_dump
from actors.sglang_server import ServerSpec, SGLangServer
from patches.dump_files import read_dump
from patches.settings import CaptureSettings
from tools.tiny_models import ensure_models

PROMPTS = [
    "What is the capital city of France?",
    "Explain speculative decoding with a draft model in two sentences.",
    "Write a short poem about a river at night.",
    "Why does a target model keep hidden states for every prompt token?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path(".cache/models"))
    parser.add_argument("--out", type=Path, default=Path("out/demo"))
    args = parser.parse_args()

    model = ensure_models(args.models, ["deepseek-v3-tiny"])["deepseek-v3-tiny"]
    shutil.rmtree(args.out, ignore_errors=True)
    spec = ServerSpec(
        model_path=model,
        capture=CaptureSettings.from_env({"HIDDEN_CAPTURE_DIR": str(args.out / "dumps")}),
        aux_layer_ids=[0, 1, 3],
    )
    log = args.out / "server.log"
    print(f"starting SGLang on {model} (log: {log}) ...", flush=True)
    started = time.monotonic()
    with SGLangServer(spec, log) as server:
        print(f"server up at {server.url} in {time.monotonic() - started:.0f}s", flush=True)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            responses = list(
                pool.map(
                    lambda i: generate_and_capture(server.url, f"hsx-demo-{i}", text=PROMPTS[i]),
                    range(len(PROMPTS)),
                )
            )
        for prompt, response in zip(PROMPTS, responses, strict=True):
            tensors, meta = read_dump(wait_for_dump(response.dump_path))
            shapes = ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in tensors.items())
            print(f"\n{response.rid}: {prompt!r}\n  dump {response.dump_path}\n  {shapes}")
        print(f"\nlayers {meta['layer_ids']}: {meta['layer_convention']}")
    print(f"\n{len(responses)} dumps under {spec.capture.dump_dir}")


if __name__ == "__main__":
    main()
