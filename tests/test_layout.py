"""The repository's layout (DESIGN.md): top-level `samplers/` and `rewards/` folders installed as `flowrl.samplers` and
`flowrl.rewards`, the two leaves every other layer builds on, and `flowrl` the only import name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parent.parent
LEAVES = {"samplers": "flowrl.samplers", "rewards": "flowrl.rewards"}


def _setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_installed_under_flowrl():
    setuptools = _setuptools()
    assert setuptools["package-dir"] == {name: folder for folder, name in LEAVES.items()}
    found = set()
    for root, name in [("flowrl", "flowrl"), *LEAVES.items()]:
        for init in (REPO / root).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / root).parts
            found.add(".".join((name, *parts)))
    assert set(setuptools["packages"]) == found  # a new sub-package is listed, or it would not install


def _flowrl_imports(file: Path, package: str) -> list[str]:
    """The modules of flowrl that `file` (a module of `package`, e.g. ``flowrl.samplers``) imports, anywhere in it."""
    parts = file.relative_to(REPO / package.split(".")[1]).with_suffix("").parts
    here = [*package.split("."), *parts[:-1]]  # the package the module is in (an __init__.py: its own)
    names = []
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:  # relative: resolved against the module's package
            base = here[: len(here) - node.level + 1]
            names.append(".".join(base + ([node.module] if node.module else [])))
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return [n for n in names if n.split(".")[0] in ("flowrl", "samplers", "rewards")]


@pytest.mark.parametrize("folder", sorted(LEAVES))
def test_the_leaves_import_nothing_else_of_flowrl(folder):
    package = LEAVES[folder]
    outside = {
        f"{file.relative_to(REPO)}: {name}"
        for file in sorted((REPO / folder).rglob("*.py"))
        for name in _flowrl_imports(file, package)
        if not name.startswith(package)
    }
    assert not outside  # not even inside a function: a leaf stands on its own


def test_no_top_level_samplers_or_rewards_import_name(tmp_path):
    code = (
        "import importlib.util, flowrl.samplers, flowrl.rewards; "
        "print(importlib.util.find_spec('samplers'), importlib.util.find_spec('rewards')); "
        "print(flowrl.samplers.__path__[0]); print(flowrl.rewards.__path__[0])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == "None None"
    assert [Path(p).resolve() for p in lines[1:]] == [REPO / "samplers", REPO / "rewards"]


def test_install_hints_never_name_a_registry_package_called_flowrl():
    """flowrl installs from its clone (`pip install -e ".[EXTRA]"`, README): a package named `flowrl` on PyPI is
    another project, so no doc page or error message may tell a user to `pip install flowrl` or `'flowrl[EXTRA]'`."""
    import re

    files = [REPO / "README.md", *(REPO / "docs").glob("*.md")]
    files += [p for d in ("flowrl", "rewards", "samplers") for p in (REPO / d).rglob("*.py")]
    bad = re.compile(r"pip install\s+['\"]?flowrl\b")
    hits = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in files for m in bad.finditer(p.read_text())]
    assert not hits
    assert re.search(r"pip install -e \"\.\[deepspeed\]\"", (REPO / "docs" / "distributed.md").read_text())
