"""Config files: the ``# extends: base.yaml`` chain, expanded into the repeated ``--config`` LightningCLI merges."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

_EXTENDS = re.compile(r"^#\s*extends:\s*(\S+)\s*$", re.MULTILINE)


def config_chain(path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> list[Path]:
    """``path`` preceded by the files it extends (a ``# extends: base.yaml`` comment line, relative to it).

    LightningCLI merges repeated ``--config`` files key by key, so a config can
    hold only what differs from its base; the comment keeps the file plain YAML.
    """
    path = Path(path)
    if path.resolve() in _seen:
        raise ValueError(f"config {path} extends itself through {' -> '.join(map(str, _seen))}")
    try:
        text = path.read_text()
    except OSError:
        return [path]  # LightningCLI reports a missing file in its own words
    chain: list[Path] = []
    for base in _EXTENDS.findall(text):
        chain += config_chain(path.parent / base, (*_seen, path.resolve()))
    return [*chain, path]


def expand_configs(argv: list[str]) -> list[str]:
    """Every ``--config FILE`` (or ``-c FILE``, ``--config=FILE``) preceded by the configs it extends."""
    expanded: list[str] = []
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
            expanded += [f"--config={p}" for p in config_chain(path)]
    return expanded


def merged_config(path: str | os.PathLike) -> dict[str, Any]:
    """A config merged with the files it ``# extends:``, key by key (later files win), as plain YAML data.

    LightningCLI merges the same way, but only inside a parser that imports and checks every ``class_path``
    of the config; ``compare`` needs two keys of it before any fit starts.
    """

    def merge(base: dict, top: dict) -> dict:
        out = dict(base)
        for key, value in top.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    merged: dict[str, Any] = {}
    for file in config_chain(path):
        merged = merge(merged, yaml.safe_load(Path(file).read_text()) or {})
    return merged
