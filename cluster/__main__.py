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
import importlib
import json
import logging
import sys
from pathlib import Path

from cluster.config import ConfigError, load_config
from cluster.job_store import ResumeConflict
from cluster.plan import PlanError
from hsx_store.builder import PlanDiverged
from hsx_store.format import StoreFormatError
from hsx_store.location import StoreAccessError

DELEGATED = {  # own argument parsers
    "verify": "cluster.verify",
    "export": "hsx_store.export",
    "status": "cluster.status",
}
SHORTCUTS = {  # --model X is --set model.path=X, and so on
    "model": "model.path",
    "data": "data.paths",
    "store": "store.url",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    prog = "hsx" if Path(sys.argv[0]).name == "hsx" else "python -m cluster"
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name in DELEGATED:
        commands.add_parser(name, help=f"see python -m cluster {name} --help", add_help=False)
    run = commands.add_parser("run", help="plan (or resume) and run an extraction job")
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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:  # commands with their own argument parsers
        return importlib.import_module(DELEGATED[argv[0]]).main(argv[1:])
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    overrides = list(args.overrides)
    for name, key in SHORTCUTS.items():
        value = getattr(args, name)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")  # JSON is YAML, quoted
    try:
        config = load_config(args.config, overrides)
        if args.dry_run:
            from cluster.dry_run import dry_run

            return dry_run(config, say=lambda text: print(text, flush=True))
        from cluster.driver import run_job  # Ray and SGLang load only for a valid config

        return run_job(config, say=lambda text: print(text, flush=True))
    except (
        ConfigError,
        ResumeConflict,
        PlanError,
        PlanDiverged,
        StoreFormatError,
        StoreAccessError,
    ) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
