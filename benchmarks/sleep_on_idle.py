"""Prefill throughput of a server that sleeps when idle (`--sleep-on-idle`, how the launcher
starts every server) vs one that spins, same prompts, K in flight; and each one's idle CPU.

The flag frees the core an idle scheduler would spin on; this measures that it costs the busy
server nothing. Each round starts both servers in turn (a spinning server left running would
steal a core from the other's round), warms it, times one pass over the prompts with capture
on (a request is done once its dump is published), then reads its CPU time over 5 idle
seconds. Rounds alternate (benchmarks/rounds.py); the value is the median per-round ratio of
tokens/s. Model: llama-bench (hidden 512, 8 layers).

    make bench BENCH=sleep_on_idle
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from actors import sglang_server
from actors.sglang_server import ServerSpec, SGLangServer
from benchmarks.capture_overhead import RID_PREFIX, make_prompts, prefill_tokens_per_s
from benchmarks.rounds import alternate
from patches.settings import CaptureSettings
from tools.tiny_models import ensure_models

TARGET = 0.97
FLAG = "--sleep-on-idle"
IDLE_SECONDS = 5.0


@contextmanager
def spinning():
    """Servers started meanwhile go without the flag."""
    build = sglang_server.build_command
    sglang_server.build_command = lambda *a, **k: [x for x in build(*a, **k) if x != FLAG]
    try:
        yield
    finally:
        sglang_server.build_command = build


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU time of every live process of the group."""
    ticks = 0
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


class Side:
    def __init__(self, name: str, sleeps: bool, args: argparse.Namespace, work: Path) -> None:
        self.name, self.sleeps, self.args, self.work = name, sleeps, args, work
        self.idle_cores: list[float] = []

    def run(self, model: Path, prompts: list[list[int]]) -> float:
        capture = CaptureSettings.from_env(
            {
                "HIDDEN_CAPTURE_DIR": str(self.work / f"{self.name}-dumps"),
                "HIDDEN_CAPTURE_RID_PREFIX": RID_PREFIX,
            }
        )
        spec = ServerSpec(model_path=model, capture=capture)
        with (
            contextlib.nullcontext() if self.sleeps else spinning(),
            SGLangServer(spec, self.work / f"{self.name}.log") as server,
        ):
            prefill_tokens_per_s(
                server, prompts[: self.args.inflight], self.args.inflight, RID_PREFIX
            )
            rate = prefill_tokens_per_s(server, prompts, self.args.inflight, RID_PREFIX)
            assert server.process is not None
            before = group_cpu_seconds(server.process.pid)
            time.sleep(IDLE_SECONDS)
            self.idle_cores.append((group_cpu_seconds(server.process.pid) - before) / IDLE_SECONDS)
        return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--inflight", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", type=Path, default=Path(".cache/models"))
    args = parser.parse_args()

    model = ensure_models(args.models, ["llama-bench"])["llama-bench"]
    prompts = make_prompts(args.prompts, args.length, vocab=1024)
    work = Path(tempfile.mkdtemp(prefix="sleep_on_idle-", dir="/dev/shm"))
    spins, sleeps = Side("spinning", False, args, work), Side("sleeping", True, args, work)
    try:
        rounds = alternate(
            baseline=lambda: spins.run(model, prompts),
            measured=lambda: sleeps.run(model, prompts),
            rounds=args.rounds,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"{args.prompts} prompts x {args.length} tokens, {args.inflight} in flight")
    rounds.show("tokens/s", baseline="without the flag", measured=f"with {FLAG}")
    for side in (spins, sleeps):
        cores = " ".join(f"{c:.2f}" for c in side.idle_cores)
        print(
            f"  idle CPU {side.name}: {statistics.median(side.idle_cores):.2f} cores "
            f"(rounds: {cores})"
        )
    print(rounds.result_line("sleep_on_idle", TARGET))


if __name__ == "__main__":
    main()
