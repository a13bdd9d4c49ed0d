"""Where ``compare`` prints: rich's console and table when rich is installed, else plain lines; and the line
about the machine every report ends with."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

from lightning_muon.commands.compare.report import Row, markdown_table, rich_table


class Console:
    """The terminal: rich's console and table when rich is installed, else plain lines and the markdown table."""

    def __init__(self) -> None:
        try:
            from rich.console import Console
        except ImportError:
            self.rich: Any = None
        else:
            self.rich = Console(width=None if sys.stdout.isatty() else 160)  # the whole table when piped

    def rule(self, title: str) -> None:
        if self.rich is not None:
            self.rich.rule(title)
        else:
            print(f"---- {title} ----", flush=True)

    def print(self, text: str) -> None:
        if self.rich is not None:
            self.rich.print(text, soft_wrap=True, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def table(self, rows: Sequence[Row], target: float | None) -> None:
        if self.rich is not None:
            self.rich.print(rich_table(rows, target))
        else:
            print(markdown_table(rows, target))


def _load(load: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def _versions() -> str:
    import lightning
    import torch

    return f", torch {torch.__version__}, lightning {lightning.__version__}"


def machine_note(load_before: tuple[float, float, float] | None) -> str:
    """The machine, its Python, torch and lightning, and the load average before (given) and now."""
    return (
        f"Machine: {os.cpu_count()} CPU cores, {platform.platform(terse=True)}, Python {platform.python_version()}"
        + _versions()
        + (f"; load average (1/5/15 min) {_load(load_before)} before, {_load(os.getloadavg())} after"
           if load_before else "")
        + ". Times are noisy when other work shares the machine."
    )
