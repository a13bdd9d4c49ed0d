"""CONTRIBUTING.md's map of the code names every module of the package, read from the tree (so a module added or
moved without its line fails here, not in a later review)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_muon"


def the_map() -> str:
    """The code block under "How the code is laid out"."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text.split("## How the code is laid out", 1)[1]
    return re.search(r"```\n(lightning_muon/\n.*?)```", section, re.S).group(1)


def sections(block: str) -> dict[str, str]:
    """The map's text by package directory (``""`` for ``lightning_muon/`` itself, ``"optim"``, ``"commands"``):
    a directory's section runs from its line to the next line indented as little (the next directory)."""
    found: dict[str, str] = {"": ""}
    current, indent = "", -1
    for line in block.splitlines()[1:]:
        match = re.match(r"^( *)(\w+)/ ", line)
        depth = len(line) - len(line.lstrip())
        if match and depth == 2:
            current, indent = match.group(2), depth
        elif depth <= indent and line.strip():
            current, indent = "", -1
        found[current] = found.get(current, "") + line + "\n"
    return found


def unnamed(block: str, modules: list[Path]) -> list[str]:
    """The modules (paths in the package) whose name the map's section for their top-level directory does not
    hold as a word (``muon.py``, or ``runs`` in ``compare/ (runs, report, ...)``)."""
    by_directory = sections(block)
    missing = []
    for path in modules:
        relative = path.relative_to(PACKAGE)
        directory = relative.parts[0] if len(relative.parts) > 1 else ""
        if relative.name == "__init__.py" and directory:  # a subpackage: its directory's line names it
            named = relative.parent.name in by_directory or re.search(
                rf"\b{re.escape(relative.parent.name)}/", by_directory.get(directory, ""))
        else:
            named = re.search(rf"(?<![\w.]){re.escape(path.stem)}\b", by_directory.get(directory, ""))
        if not named:
            missing.append(relative.as_posix())
    return missing


def package_modules() -> list[Path]:
    """Every module of the package, the shipped examples left out (installed from the top-level examples/, which
    the map has a line for)."""
    return [path for path in sorted(PACKAGE.rglob("*.py")) if "examples" not in path.relative_to(PACKAGE).parts]


def test_the_map_names_every_module_of_the_package():
    modules = package_modules()
    assert len(modules) > 60
    assert unnamed(the_map(), modules) == []


def test_a_module_missing_from_the_map_is_caught():
    block = "lightning_muon/\n  __init__.py  the API\n  optim/   the optimizer\n    muon.py  Muon\n" \
            "  commands/  cli.py, compare/ (runs, plot)\nconfigs/  the configs\n"
    paths = [PACKAGE / name for name in ("__init__.py", "optim/__init__.py", "optim/muon.py", "optim/_plan.py",
                                         "commands/compare/runs.py", "commands/compare/console.py",
                                         "commands/compare/__init__.py", "_main.py")]
    assert unnamed(block, paths) == ["optim/_plan.py", "commands/compare/console.py", "_main.py"]
