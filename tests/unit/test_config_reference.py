"""docs/configuration.md is generated from the config models' field docstrings: keep it current."""

import difflib

import pytest

from tools.config_reference import COMMAND, OUTPUT, render


def test_configuration_reference_is_current() -> None:
    expected = render()
    committed = OUTPUT.read_text() if OUTPUT.exists() else ""
    if committed != expected:
        diff = difflib.unified_diff(
            committed.splitlines(),
            expected.splitlines(),
            "docs/configuration.md (committed)",
            "docs/configuration.md (from the config models)",
            lineterm="",
            n=1,
        )
        shown = "\n".join(list(diff)[:40])
        pytest.fail(
            f"docs/configuration.md is stale: run `{COMMAND}` (or `make docs`) and commit it\n"
            f"{shown}",
            pytrace=False,
        )
