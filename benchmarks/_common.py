"""What several benchmarks share: the repository root, the GPT-style hidden matrix shapes, the
machine-and-versions line of every report, and the console they print to.

Benchmarks run as ``python benchmarks/NAME.py``, which puts ``benchmarks/`` (so this module and ``_report``) on
``sys.path``; the examples they train are the installed package's (``lightning_muon.examples``).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch
from rich.console import Console

#: The repository root (``benchmarks/``, where the results go).
ROOT = Path(__file__).resolve().parent.parent


def hidden_shapes(layers: int, width: int) -> list[tuple[int, int]]:
    """``nn.Linear`` weight shapes (``out x in``) of ``layers`` GPT blocks of ``width``: attention qkv and
    projection, MLP in and out."""
    return [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * layers


def machine(threads: int | None = None) -> str:
    """One line: the machine, its OS and CPU count, the Python, torch (with its CPU capability) and lightning
    versions, and last the torch threads (this process's unless given; callers may go on: "... per rank")."""
    import lightning

    threads = threads if threads is not None else torch.get_num_threads()
    return (
        f"{platform.machine()}, {platform.platform(terse=True)}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, torch {torch.__version__} "
        f"(CPU capability {torch.backends.cpu.get_cpu_capability()}), lightning {lightning.__version__}, "
        f"{threads} torch thread{'s' if threads != 1 else ''}"
    )


def console(width: int = 140) -> Console:
    """A rich console: the terminal's width on a terminal, ``width`` columns when the output goes to a file or pipe
    (rich would otherwise wrap tables at 80)."""
    return Console(width=None if sys.stdout.isatty() else width)
