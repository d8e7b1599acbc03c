"""`python -m cluster` (cluster/cli.py): one parser for every command; each command's --help
says what it does and takes, and a bad command line exits 2 naming what is wrong. What each
command does: its own tests (test_dry_run.py, test_status.py, test_integrity.py,
test_export.py)."""

from __future__ import annotations

import pytest

from cluster.__main__ import main

OPTIONS = {
    "run": ["--config", "--set", "--dry-run", "--model", "--data", "--store"],
    "verify": ["--store URL", "--model", "--recompute N", "--logprobs N", "--server-arg ARG"],
    "export": ["--store URL", "--format {specforge,speculators}", "--out DIR", "--follow"],
    "status": ["--store URL", "--follow", "--interval", "--json"],
    "draft-convert": ["--draft DIR", "--store URL", "--out DIR", "--model PATH", "--layer-shift K"],
}


def test_the_top_level_help_lists_every_command_with_its_exit_statuses(
    capsys: pytest.CaptureFixture,
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit.value.code == 0 and out.startswith("usage: python -m cluster ")
    for command in OPTIONS:
        assert f"\n{command} --" in out  # its line in the command list, then what it exits with


@pytest.mark.parametrize("command", OPTIONS)
def test_every_command_has_its_own_help(command: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exit.value.code == 0 and out.startswith(f"usage: python -m cluster {command} ")
    assert all(option in out for option in OPTIONS[command]), out


@pytest.mark.parametrize(
    "argv,says",
    [
        ([], "the following arguments are required: command"),
        (["status"], "the following arguments are required: --store"),
        (["export", "--store", "s.zarr", "--format", "eagle"], "argument --format: invalid choice"),
        (["verify", "--store", "s.zarr", "--recompute", "some"], "argument --recompute"),
        (
            ["export", "--store", "s.zarr", "--format", "specforge", "--out", "o", "--poll-s", "0"],
            "argument --poll-s: expected seconds above 0, got 0",
        ),
    ],
)
def test_a_bad_command_line_exits_2_naming_it(
    argv: list[str], says: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and says in capsys.readouterr().err
