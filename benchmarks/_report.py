"""What every benchmark writes: ``benchmarks/results/<name>.md`` with the command that produced it, the
date, the machine, and its tables as plain text, and the same as a section of ``benchmarks/RESULTS.md``."""

from __future__ import annotations

import datetime
import io
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results"
RESULTS_MD = Path(__file__).parent / "RESULTS.md"


def command(script: str, argv: Sequence[str] | None) -> str:
    """The command line that ran ``script`` (``argv`` as passed to ``main``, else ``sys.argv``)."""
    return " ".join([f"python benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])


def as_text(table: Table, width: int = 140) -> str:
    """A rich table rendered as plain text (no colours)."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, no_color=True, force_terminal=False).print(table)
    return buffer.getvalue()


def write(name: str, title: str, command_line: str, details: str, tables: Sequence[Table], notes: str = "") -> Path:
    """Write ``results/<name>.md`` and the ``name`` section of ``RESULTS.md``: title, command, date,
    ``details`` (the machine and settings), the tables in code blocks, then ``notes``. Returns the path."""
    path = RESULTS / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    blocks = "".join(f"```\n{as_text(table)}```\n\n" for table in tables)
    body = f"`{command_line}` on {datetime.date.today()}: {details}.\n\n{blocks}{notes}".rstrip() + "\n"
    path.write_text(f"# {title}\n\n{body}")
    update_section(name, f"## {title}\n\n{body}")
    return path


def write_markdown(name: str, report: str) -> None:
    """Write a report already in markdown (its title a ``# `` line) to ``results/<name>.md`` and as the ``name``
    section of ``RESULTS.md``."""
    (RESULTS / f"{name}.md").write_text(report)
    update_section(name, report.replace("# ", "## ", 1))


def update_section(key: str, section: str) -> None:
    """Replace (or append) the ``key`` section of ``RESULTS.md``, kept between its HTML-comment markers."""
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    text = RESULTS_MD.read_text() if RESULTS_MD.is_file() else (
        "# Benchmark results\n\nOne section per benchmark, each written by the script named in it.\n"
    )
    block = f"{start}\n{section.strip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    RESULTS_MD.write_text(text)
