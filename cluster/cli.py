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
"""

from __future__ import annotations

import argparse

from hsx_store.export.registry import FORMATS
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
