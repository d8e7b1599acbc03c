"""`python -m cluster run --config JOB.yaml [--set section.field=value ...]`: the job's driver
(the entrypoint of `ray job submit`). Exit status: 0 every planned sample written, 1 some
failed or not committed, 2 a bad config or a store made by another job."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from cluster.config import ConfigError, load_config
from cluster.job_store import ResumeConflict
from cluster.plan import PlanError

SHORTCUTS = {  # --model X is --set model.path=X, and so on
    "model": "model.path",
    "data": "data.paths",
    "store": "store.url",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cluster", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
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
    run.add_argument("--model", help="model.path")
    run.add_argument("--data", nargs="+", help="data.paths")
    run.add_argument("--store", help="store.url")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    overrides = list(args.overrides)
    for name, key in SHORTCUTS.items():
        value = getattr(args, name)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")  # JSON is YAML, quoted
    try:
        config = load_config(args.config, overrides)
        from cluster.driver import run_job  # Ray and SGLang load only for a valid config

        return run_job(config, say=lambda text: print(text, flush=True))
    except (ConfigError, ResumeConflict, PlanError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
