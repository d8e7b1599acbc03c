"""Floors that only go down (pyproject.toml [tool.importlinter]): each package imports only the
ones below it, and no modules import one another in a circle. A lazy import inside a function
or a TYPE_CHECKING one counts: it hides a circle, it does not break it.

The contracts run as a contributor runs them (`lint-imports`, the venv's); a throwaway package
with one circle and one upward import shows that the same contract types catch both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def lint_imports(config: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` on `config`, run where it lies (its packages import from there)."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(config), "--no-cache", "--no-logo"],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},  # rich wraps its report to the terminal's width
    )


def circles(packages: list[str]) -> list[str]:
    """Every import `a -> b` of these packages' modules through which b leads back to a. Also
    the circles the contracts leave out: between a package's __init__ and its own modules."""
    graph = grimp.build_graph(*packages, cache_dir=None)
    return sorted(
        f"{a} -> {b}"
        for a in graph.modules
        for b in graph.find_modules_directly_imported_by(a)
        if graph.chain_exists(importer=b, imported=a)
    )


def test_the_packages_keep_their_import_contracts() -> None:
    result = lint_imports(ROOT / "pyproject.toml")
    broken = result.stdout[result.stdout.find("Broken contracts") :]
    assert result.returncode == 0, f"lint-imports: {broken or result.stdout + result.stderr}"
    assert circles(CONFIG["root_packages"]) == []


TOY = {  # a floor above (top) and one below (bottom)
    "top/__init__.py": "",
    "top/app.py": "import bottom.a\n",  # downward: allowed
    "bottom/__init__.py": "",
    "bottom/a.py": "from bottom import b\n",
    "bottom/b.py": "def later():\n    from bottom import a  # lazy: still a circle\n    return a\n",
    "bottom/c.py": "from top import app  # upward\n",
}


def toy_config(root: Path) -> Path:
    """The repository's contracts, of the same types, over the toy's two packages."""
    floors = ["top", "bottom"]
    per_type = {"layers": ("layers", floors), "acyclic_siblings": ("ancestors", floors)}
    lines = ["[tool.importlinter]", f"root_packages = {json.dumps(floors)}"]
    for contract in CONFIG["contracts"]:
        key, value = per_type[contract["type"]]  # a new contract type needs a case here
        lines += [
            "",
            "[[tool.importlinter.contracts]]",
            f"name = {json.dumps(contract['name'])}",
            f"type = {json.dumps(contract['type'])}",
            f"{key} = {json.dumps(value)}",
        ]
    config = root / "pyproject.toml"
    config.write_text("\n".join(lines) + "\n")
    return config


def test_a_circle_and_an_upward_import_are_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, text in TOY.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    result = lint_imports(toy_config(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    for contract in CONFIG["contracts"]:
        assert f"{contract['name']} BROKEN" in result.stdout
    assert "bottom is not allowed to import top" in result.stdout
    assert "bottom.c -> top.app" in result.stdout
    assert "No cycles are allowed in bottom" in result.stdout
    monkeypatch.syspath_prepend(tmp_path)
    assert circles(["top", "bottom"]) == ["bottom.a -> bottom.b", "bottom.b -> bottom.a"]
