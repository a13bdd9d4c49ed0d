"""Config files: the shipped ones, and the ``# extends: base.yaml`` chain expanded into the repeated ``--config``
LightningCLI merges.

A config path that exists is used as is; otherwise a bare name (``gpt_muon.yaml``, or ``gpt_muon``) is the config
of that name shipped with the package, and the command says so in one line on stderr. A ``# extends:`` base
resolves the same way, relative to the file that names it first. A config that is neither is one short error
listing the shipped names.

The shipped configs are the repository's top-level ``configs/``: installed from a wheel they are
``lightning_muon/configs/`` (the package data), in a source checkout ``configs/`` beside ``lightning_muon/``.

A config may name what it needs beyond the core dependencies in a comment line, ``# requires: scikit-learn
[examples]`` (a distribution and the extra that installs it): the command stops before training when one is
missing, with one line saying what to install. Likewise ``# needs: --model.init_from the checkpoint of the
pretraining step (lightning-muon fit --config gpt_adamw.yaml)``: an argument the config cannot run without; the
command stops in one line when neither the command line nor a config of the chain gives it a value.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

_EXTENDS = re.compile(r"^#\s*extends:\s*(\S+)\s*$", re.MULTILINE)
_REQUIRES = re.compile(r"^#\s*requires:\s*(\S+)\s*\[(\S+)\]\s*$", re.MULTILINE)
_NEEDS = re.compile(r"^#\s*needs:\s*--(\S+)\s+(.+?)\s*$", re.MULTILINE)


def _shipped_directory() -> Path:
    package = Path(__file__).resolve().parents[1]
    installed = package / "configs"  # a wheel's package data
    return installed if installed.is_dir() else package.parent / "configs"  # a checkout (editable install)


#: The configs that ship with the package (``lightning-muon configs`` lists them).
SHIPPED = _shipped_directory()


def shipped_configs() -> list[Path]:
    """The shipped config files, by name."""
    return sorted(SHIPPED.glob("*.yaml"))


def shipped_config(name: str | os.PathLike) -> Path | None:
    """The shipped config called ``name`` (``gpt_muon.yaml`` or ``gpt_muon``); None for a path with a directory
    part, or a name that is not shipped."""
    name = str(name)
    if not name or Path(name).name != name:
        return None
    for candidate in (name, f"{name}.yaml"):
        if (SHIPPED / candidate).is_file():
            return SHIPPED / candidate
    return None


def resolve_config(path: str | os.PathLike, notes: list[str] | None = None) -> Path:
    """``path`` if it exists, else the shipped config of that name (with a line for ``notes``), else ``path``
    unchanged (LightningCLI then reports the missing file in its own words)."""
    given = Path(path)
    if given.exists():
        return given
    shipped = shipped_config(path)
    if shipped is None:
        return given
    if notes is not None:
        notes.append(f"lightning-muon: {path} is the shipped config {shipped}")
    return shipped


def first_comment(path: Path) -> str:
    """The first ``#`` line of a config that is not ``# extends:`` or ``# requires:``, without the ``#`` (its
    one-line summary)."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not _EXTENDS.match(line) and not _REQUIRES.match(line) and not _NEEDS.match(line):
            return line.lstrip("#").strip()
    return ""


def requires(path: Path) -> list[tuple[str, str]]:
    """What a config names in its ``# requires: DISTRIBUTION [EXTRA]`` lines, as (distribution, extra) pairs."""
    return _REQUIRES.findall(path.read_text())


def missing_requirements(chain: list[Path]) -> list[str]:
    """One line for each distribution that a config of ``chain`` requires and that is not installed."""
    lines = []
    for path in chain:
        for distribution, extra in requires(path) if path.is_file() else []:
            try:
                importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                lines.append(f"lightning-muon: {path.name} needs {distribution}, which is not installed: "
                             f'pip install "lightning-muon[{extra}]" (or pip install {distribution})')
    return lines


def _given(key: str, configs: dict[str, Any]) -> bool:
    """Whether the merged ``configs`` hold a value other than null for the dotted ``key`` (``model.init_from``,
    read as ``model.init_from`` or ``model.init_args.init_from``)."""
    node: Any = configs
    for part in key.split("."):
        if isinstance(node, dict) and part not in node:
            node = node.get("init_args", {})
        if not isinstance(node, dict) or node.get(part) is None:
            return False
        node = node[part]
    return True


def missing_arguments(chains: list[list[Path]], argv: list[str]) -> list[str]:
    """One line for each ``# needs: --KEY WHAT`` of a config in ``chains`` (each a ``--config`` and the files it
    extends) that neither ``argv`` (``--KEY``, or with ``init_args.`` in it, with or without ``=``) nor any of
    the configs give a value; the line names the ``--config`` as given."""
    merged = _merge_files([path for chain in chains for path in chain])
    lines = []
    for chain in chains:
        for key, what in (need for path in chain if path.is_file() for need in _NEEDS.findall(path.read_text())):
            spellings = {f"--{key}", f"--{key.replace('.', '.init_args.', 1)}"}
            if not any(arg.split("=", 1)[0] in spellings for arg in argv) and not _given(key, merged):
                lines.append(f"lightning-muon: {chain[-1].name} needs --{key}: {what}")
    return lines


def not_found(path: str | os.PathLike) -> str:
    """The one-line error for a config that is neither a file nor a shipped name."""
    names = ", ".join(p.name for p in shipped_configs())
    return (f"lightning-muon: no config file {str(path)!r} (looked in {Path.cwd()}) and no shipped config of that "
            f"name; the shipped ones: {names} (e.g. --config gpt_muon.yaml; lightning-muon configs lists them)")


def extends(path: Path) -> list[str]:
    """The bases a config names in its ``# extends:`` lines, as written."""
    return _EXTENDS.findall(path.read_text())


def config_chain(path: str | os.PathLike, _seen: tuple[Path, ...] = (), notes: list[str] | None = None) -> list[Path]:
    """``path`` preceded by the files it extends (a ``# extends: base.yaml`` comment line, relative to it, else
    shipped: `resolve_config`).

    LightningCLI merges repeated ``--config`` files key by key, so a config can
    hold only what differs from its base; the comment keeps the file plain YAML.
    """
    path = resolve_config(path, notes) if not _seen else Path(path)
    if path.resolve() in _seen:
        loop = " -> ".join(map(str, (*_seen, path.resolve())))
        raise SystemExit(f"lightning-muon: config {path} extends itself through {loop}: remove the # extends: line "
                         "that closes the loop")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SystemExit(not_found(path)) from None
    except OSError:
        return [path]  # LightningCLI reports an unreadable file in its own words
    chain: list[Path] = []
    for base in _EXTENDS.findall(text):
        relative = path.parent / base
        if not relative.exists() and shipped_config(base) is not None:
            relative = resolve_config(base, None)
            if notes is not None:
                notes.append(f"lightning-muon: {path.name} extends the shipped config {relative}")
        chain += config_chain(relative, (*_seen, path.resolve()), notes)
    return [*chain, path]


def expand_configs(argv: list[str], quiet: bool = False) -> list[str]:
    """Every ``--config FILE`` (or ``-c FILE``, ``--config=FILE``) preceded by the configs it extends, each a
    path that exists or a shipped config's (one line on stderr says which shipped file, unless ``quiet``). A
    missing extra (`missing_requirements`) or needed argument (`missing_arguments`, except for ``--print_config``)
    stops it in one line each."""
    notes: list[str] = []
    expanded: list[str] = []
    chains: list[list[Path]] = []
    args = iter(argv)
    for arg in args:
        if arg in ("-c", "--config"):
            path = next(args, None)
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            expanded.append(arg)
            continue
        if path is None:
            expanded.append(arg)
        else:
            chain = config_chain(path, notes=notes)
            missing = missing_requirements(chain)
            if missing:
                raise SystemExit("\n".join(missing))
            chains.append(chain)
            expanded += [f"--config={p}" for p in chain]
    printing = any(arg.split("=", 1)[0] == "--print_config" for arg in argv)  # no fit: nothing is needed yet
    missing = [] if printing else missing_arguments(chains, argv)
    if missing:
        raise SystemExit("\n".join(missing))
    if notes and not quiet:
        print("\n".join(notes), file=sys.stderr)
    return expanded


def merged_config(path: str | os.PathLike) -> dict[str, Any]:
    """A config merged with the files it ``# extends:``, key by key (later files win), as plain YAML data.

    LightningCLI merges the same way, but only inside a parser that imports and checks every ``class_path``
    of the config; ``compare`` needs two keys of it before any fit starts.
    """

    return _merge_files(config_chain(path))


def _merge_files(chain: list[Path]) -> dict[str, Any]:
    """The YAML files of ``chain`` merged key by key, later files winning."""

    def merge(base: dict, top: dict) -> dict:
        out = dict(base)
        for key, value in top.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    merged: dict[str, Any] = {}
    for file in chain:
        merged = merge(merged, yaml.safe_load(Path(file).read_text()) or {})
    return merged
