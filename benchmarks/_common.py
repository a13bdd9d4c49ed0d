"""What several benchmarks share: the repository root on ``sys.path``, the GPT-style hidden matrix shapes, the
machine-and-versions line of every report, and the console they print to.

Benchmarks run as ``python benchmarks/NAME.py`` from the repository root, which puts ``benchmarks/`` (so this
module and ``_report``) on ``sys.path``. Importing this module also puts the repository root there: ``examples/``
is not an installed package yet, and the benchmarks that train the examples import them (``from examples...``) or
name them in configs (``examples.char_gpt.CharGPT``). Import ``_common`` before ``examples``.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch
from rich.console import Console

#: The repository root (``configs/``, ``examples/``, ``benchmarks/``).
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the one place: `examples` is not installed, so it is imported from the checkout
    sys.path.insert(0, str(ROOT))


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
