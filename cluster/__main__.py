"""`python -m cluster COMMAND`, or `hsx COMMAND` once installed: the command line parsed
(cluster/cli.py, where every command's arguments and exit statuses are described), then the
command run."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from cluster.cli import build_parser
from cluster.config import ConfigError, load_config
from cluster.job_store import ResumeConflict
from cluster.plan import PlanError
from cluster.status import show_status
from cluster.verify.command import verify_command
from hsx_store.builder import PlanDiverged
from hsx_store.export.command import export_command
from hsx_store.export.sglang_draft import draft_convert_command
from hsx_store.format import StoreFormatError
from hsx_store.location import StoreAccessError

SHORTCUTS = {  # --model X is --set model.path=X, and so on
    "model": "model.path",
    "data": "data.paths",
    "store": "store.url",
}


def run(args: argparse.Namespace) -> int:
    """The job's driver, or its dry run: exit 2 on a bad config or an unusable store."""
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


def draft_bench(args: argparse.Namespace) -> int:
    from actors.sglang_server import ServerError
    from cluster.draft_bench import DraftBenchConfig, draft_bench, print_report

    config = DraftBenchConfig(
        target=Path(args.model),
        draft=Path(args.draft),
        data=list(args.data),
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        num_steps=args.num_steps,
        num_draft_tokens=args.num_steps + 1,
        concurrency=args.concurrency,
        dtype=args.dtype,
        server_args=list(args.server_args),
        device=args.device,
        log_dir=Path(args.log_dir) if args.log_dir else None,
    )
    try:
        report = draft_bench(config, say=lambda text: print(text, flush=True))
    except (ValueError, PlanError, ServerError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": run,
    "verify": lambda args: verify_command(
        args.store,
        model_path=args.model,
        recompute=args.recompute,
        logprobs=args.logprobs,
        seed=args.seed,
        dump_root=args.dump_root,
        server_args=args.server_args,
    ),
    "export": lambda args: export_command(
        args.store,
        args.format,
        args.out,
        allow_post_norm=args.allow_post_norm,
        follow=args.follow,
        poll_s=args.poll_s,
    ),
    "status": lambda args: show_status(
        args.store, follow=args.follow, interval_s=args.interval, as_json=args.json
    ),
    "draft-bench": draft_bench,
    "draft-convert": lambda args: draft_convert_command(
        args.draft, args.store, args.out, model=args.model, layer_shift=args.layer_shift
    ),
}


def main(argv: list[str] | None = None) -> int:
    prog = "hsx" if Path(sys.argv[0]).name == "hsx" else "python -m cluster"
    args = build_parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
