"""``lightning-muon configs``: the configs that ship with the package, one line each, and a copy to edit.

    lightning-muon configs                        # name, what it runs, what it extends
    lightning-muon configs --copy gpt_muon.yaml   # into the working directory, to edit and run from there
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path

from lightning_muon.commands.config_files import (
    SHIPPED,
    extends,
    first_comment,
    requires,
    shipped_config,
    shipped_configs,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-muon configs",
        description="List the configs shipped with lightning_muon (any command takes one by name: "
        "lightning-muon fit --config gpt_muon.yaml), or copy one into a directory to edit it.",
    )
    parser.add_argument("--copy", nargs="+", default=[], metavar="NAME", help="shipped configs to copy")
    parser.add_argument("--to", default=".", metavar="DIR", help="where --copy writes (default: the working directory)")
    parser.add_argument("--force", action="store_true", help="let --copy overwrite an existing file")
    return parser


def listing() -> list[str]:
    """One line per shipped config: its name, what it extends, what it needs beyond the core dependencies (and
    the extra that installs it), its summary."""
    files = shipped_configs()
    width = max(len(p.name) for p in files)
    lines = []
    for path in files:
        bases = extends(path)
        summary = first_comment(path)
        needs = ", ".join(f"{distribution}, in [{extra}]" for distribution, extra in requires(path))
        if needs:
            summary = f"[needs {needs}] {summary}"
        if bases:
            summary = f"[extends {', '.join(bases)}] {summary}"
        lines.append(f"{path.name:<{width}}  {summary}")
    return lines


def copy(names: Sequence[str], directory: str | Path, force: bool = False) -> list[Path]:
    """Copy shipped configs into ``directory``; a name that is not shipped, or a file already there (unless
    ``force``), is an error before anything is copied."""
    directory = Path(directory)
    sources = []
    for name in names:
        source = shipped_config(name)
        if source is None:
            raise SystemExit(f"lightning-muon configs: no shipped config {name!r}; lightning-muon configs lists them")
        target = directory / source.name
        if target.exists() and not force:
            raise SystemExit(f"lightning-muon configs: {target} exists (--force overwrites it)")
        sources.append((source, target))
    directory.mkdir(parents=True, exist_ok=True)
    for source, target in sources:
        shutil.copyfile(source, target)
        print(f"wrote {target}")
        for base in extends(source):
            if not (directory / base).exists():
                print(f"  it extends {base}: the shipped one is used until a {base} sits next to it "
                      f"(lightning-muon configs --copy {base} to edit that too)")
    return [target for _, target in sources]


def main(argv: Sequence[str]) -> None:
    """List the shipped configs, or copy some."""
    args = _parser().parse_args(list(argv))
    if args.copy:
        written = copy(args.copy, args.to, args.force)
        print(f"run it: lightning-muon fit --config {written[0]}")
        return
    print("\n".join(listing()))
    print(f"\n(in {SHIPPED})")
    print("run one by name from any directory: lightning-muon fit --config gpt_muon.yaml")
    print("copy one here to edit it:          lightning-muon configs --copy gpt_muon.yaml")
