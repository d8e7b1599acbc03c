"""The command line: `python -m cluster COMMAND`, or `hsx COMMAND` once installed.

run --config JOB.yaml [--set section.field=value ...] [--dry-run]
    the job's driver (the entrypoint of `ray job submit`); exit 0: every planned sample
    written, 1: some failed or were not committed, 2: a bad config, a store of another job,
    a store location that cannot be used, or every row rejected; --dry-run checks the config,
    model files, inputs and store location and plans the first parts, starting and writing
    nothing (exit 2: a problem, named)
verify --store URL [--model PATH --recompute N --logprobs N]
    check a store; exit 0: no problems, 1: problems, 2: not a readable store
export --store URL --format {specforge,speculators} --out DIR [--allow-post-norm] [--follow]
    write the committed samples in a trainer's offline format; exit 0: every committed
    sample exported, 1: an error (printed), 2: the store cannot be opened; --follow exports
    a running job's shards as they commit (exit 1 unless the job ended complete)
status --store URL [--follow] [--json]
    what the store says about its job, while it runs or after; exit 0: complete, 1: not
    (yet), 2: not a readable store
draft-convert --draft DIR --store URL --out DIR [--model PATH] [--layer-shift K]
    a draft speculators trained on the store's export, made into the EAGLE-3 draft SGLang
    serves; exit 0: written, 1: the draft refused (SGLang would run another forward, or it
    was made for other data; each reason printed), 2: the store cannot be read, or an input
    cannot be used
draft-bench --model PATH --draft DIR --data FILE... [--max-new-tokens N] [--limit N] [--json F]
    serve the target with and without the draft and measure how many draft tokens it accepts;
    exit 0: measured, 2: a bad input (no prompt, a model or draft that cannot be served)
"""

from __future__ import annotations

import argparse

from hsx_store.export.registry import FORMATS
from hsx_store.export.sglang_draft import LAYER_SHIFT_FLAG
from hsx_store.export.speculators import ALLOW_POST_NORM_FLAG

VERIFY = """\
The store's integrity checks, plus the model checks with --model.

    python -m cluster verify --store URL [--model PATH --recompute N --logprobs N]

Exit status: 0 no errors, 1 errors, 2 the store cannot be read (or a bad command line).
"""
EXPORT = """\
Export a store's committed samples to SpecForge or vLLM speculators offline training files
(resumable; see hsx_store/export/).
"""
STATUS = """\
What a store says about its job, from any machine that can read it (on S3 too: credentials
from the AWS_* environment), while the job runs or after it.

It reads the store alone (the plan, the commit markers and the shard summaries), never the
hidden states; rates come from the shards' commit times, so they are the job's, whichever
machine asks.

exit 0: the job is complete; 1: not (yet); 2: not a readable store, or a bad command line
"""
DRAFT_CONVERT = """\
Make a draft that vLLM speculators 0.9.0 trained on the store's export (its save_pretrained
directory) into the EAGLE-3 draft SGLang serves (LlamaForCausalLMEagle3): DIR/config.json and
DIR/model.safetensors, for --speculative-draft-model-path DIR.

The draft's aux layer ids come from the store's manifest, as SGLang asks the target for them
(Llama-family targets add 1 to each, DeepSeek-style ones take them as given unless the first
is 1): the target's config is read from --model, else from the manifest's model path, and must
be the model that made the store. A draft SGLang would run with another forward than the one
trained (norm_before_residual, sliding-window layers, its own embeddings, ...) is refused with
the reason and how to train one it runs as trained (see hsx_store/export/sglang_draft.py).

exit 0: written; 1: the draft refused; 2: the store cannot be read, an input cannot be used
(the draft's files, the target model, the output directory), or a bad command line
"""


DRAFT_BENCH = """\
Serve the target greedily twice through this project's launcher, alone and with the EAGLE-3
draft (SGLang's format: hsx draft-convert), on the prompts the way a generating job plans them
(any input format, the chat template applied), and print the accept length (tokens per verify
step, the bonus token included; per request too), the per-position acceptance (the share of
verify steps whose first k drafts were all accepted), tokens/s both ways and whether the
outputs were identical (greedy speculative decoding is lossless: float32 must be, bf16 may
differ at near-ties). On a GPU where there is one, else on CPU (patches/cpu_eagle3/).

exit 0: measured; 2: no prompt to benchmark, or a server that would not start
"""


def build_parser(prog: str) -> argparse.ArgumentParser:
    """Every command's arguments; `command` names the one given."""
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_run(commands)
    _add_verify(commands)
    _add_export(commands)
    _add_status(commands)
    _add_draft_convert(commands)
    _add_draft_bench(commands)
    return parser


def _command(
    commands: argparse._SubParsersAction,
    name: str,
    summary: str,
    description: str,
    *,
    store: bool = True,
) -> argparse.ArgumentParser:
    """What every command's parser shares: its line in `--help`, its own `--help` (the
    description's line breaks kept) and, but for run's (a config field there), --store."""
    parser = commands.add_parser(
        name,
        help=summary,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if store:
        parser.add_argument("--store", required=True, metavar="URL", help="the store's path or URL")
    return parser


def _add_run(commands: argparse._SubParsersAction) -> None:
    summary = "plan (or resume) and run an extraction job"
    run = _command(commands, "run", summary, summary, store=False)
    run.add_argument("--config", help="job YAML (see ray_configs/demo_job.yaml)")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one config field; VALUE is YAML (e.g. --set model.aux_layer_ids=[2,30,58])",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config, model files, inputs and store location and plan the first "
        "parts; start nothing",
    )
    run.add_argument("--model", help="model.path")
    run.add_argument("--data", nargs="+", help="data.paths")
    run.add_argument("--store", help="store.url")


def _add_verify(commands: argparse._SubParsersAction) -> None:
    verify = _command(commands, "verify", "check a store", VERIFY)
    verify.add_argument("--model", help="the model directory (for --recompute, --logprobs)")
    verify.add_argument(
        "--recompute", type=int, default=0, metavar="N", help="recompute N random written samples"
    )
    verify.add_argument(
        "--logprobs",
        type=int,
        default=0,
        metavar="N",
        help="check the final states of N random written samples against the server's logprobs",
    )
    verify.add_argument("--seed", type=int, default=0, help="picks the checked samples")
    verify.add_argument("--dump-root", help="where the server's dumps go (default /dev/shm)")
    verify.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=[],
        metavar="ARG",
        help="extra SGLang argument, once per word: --server-arg=--dtype --server-arg=float32 "
        "(--dtype defaults to the store's)",
    )


def _add_export(commands: argparse._SubParsersAction) -> None:
    export = _command(commands, "export", "write a trainer's offline format", EXPORT)
    export.add_argument("--format", required=True, choices=FORMATS, help="target format")
    export.add_argument("--out", required=True, metavar="DIR", help="output directory")
    export.add_argument(
        ALLOW_POST_NORM_FLAG,
        action="store_true",
        help="speculators, a store without the pre-norm final state: write the post-norm one "
        "in the last slot (speculators normalizes it again: a wrong teacher)",
    )
    export.add_argument(
        "--follow",
        action="store_true",
        help="a running job: export its shards as they commit, until it ends "
        "(exit 1 unless it ended complete)",
    )
    export.add_argument(
        "--poll-s", type=positive_seconds, default=2.0, help="seconds between looks (with --follow)"
    )


def _add_status(commands: argparse._SubParsersAction) -> None:
    status = _command(commands, "status", "what the store says about its job", STATUS)
    status.add_argument(
        "--follow", action="store_true", help="print it again every --interval s until it ends"
    )
    status.add_argument(
        "--interval", type=positive_seconds, default=10.0, help="seconds (with --follow)"
    )
    status.add_argument("--json", action="store_true", help="print JSON, one object a look")


def _add_draft_convert(commands: argparse._SubParsersAction) -> None:
    summary = "make a speculators draft into the EAGLE-3 draft SGLang serves"
    convert = _command(commands, "draft-convert", summary, DRAFT_CONVERT)
    convert.add_argument(
        "--draft",
        required=True,
        metavar="DIR",
        help="the draft speculators saved (save_pretrained)",
    )
    convert.add_argument("--out", required=True, metavar="DIR", help="SGLang's draft directory")
    convert.add_argument(
        "--model",
        metavar="PATH",
        help="the target model's directory (default: the manifest's model path)",
    )
    convert.add_argument(
        LAYER_SHIFT_FLAG,
        type=int,
        default=0,
        metavar="K",
        help="a diagnostic: serve the draft with every aux layer id shifted by K, so it reads "
        "other layers than it was trained on (acceptance should drop); default 0",
    )


def _add_draft_bench(commands: argparse._SubParsersAction) -> None:
    summary = "how many of a draft's tokens SGLang accepts, served beside its target"
    bench = _command(commands, "draft-bench", summary, DRAFT_BENCH, store=False)
    bench.add_argument("--model", required=True, metavar="PATH", help="the target's directory")
    bench.add_argument("--draft", required=True, metavar="DIR", help="SGLang's draft directory")
    bench.add_argument("--data", required=True, nargs="+", metavar="FILE", help="held-out prompts")
    bench.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    bench.add_argument("--limit", type=int, metavar="N", help="the first N prompts only")
    bench.add_argument("--num-steps", type=int, default=3, help="draft tokens per verify step")
    bench.add_argument(
        "--concurrency",
        type=int,
        default=1,
        metavar="N",
        help="requests in flight (1: the latency a draft is for)",
    )
    bench.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=[],
        metavar="ARG",
        help="extra SGLang argument, once per word: --server-arg=--dtype --server-arg=float32",
    )
    bench.add_argument(
        "--dtype", help="both servers' dtype (default: the draft's, which is the store's)"
    )
    bench.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda where there is one")
    bench.add_argument("--log-dir", metavar="DIR", help="the servers' logs (default: a temp dir)")
    bench.add_argument("--json", metavar="FILE", help="also write the report as one JSON object")


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0 (argparse exits 2 naming the
    option otherwise)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds above 0, got {text}")
    return seconds
