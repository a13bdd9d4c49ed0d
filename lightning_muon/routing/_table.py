"""The routing table: every parameter's shape, optimizer, group, reason and the rule that decided (and effective
lr), then where output heads and input layers came from and the totals; drawn by rich when it is installed, else
in plain aligned columns."""

from __future__ import annotations

import io
import textwrap
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lightning_muon.routing._vocabulary import Algorithm

if TYPE_CHECKING:
    from lightning_muon.routing._route import Route

__all__ = ["plain_table", "render", "rich_table"]

TITLE = "lightning_muon routing"

EffectiveLr = Callable[["Route"], "float | None"]


def _settings_lines(settings: dict[str, dict[str, Any]] | None) -> list[str]:
    """The closing lines that give each group's own settings (`route_parameters`' ``group_settings``), if any."""
    if not settings:
        return []
    return ["Settings per group (over the optimizer's own):",
            *(f"  {name}: " + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
              for name, values in settings.items())]


def _cells(routes: Sequence[Route], roles_from: str, effective_lr: EffectiveLr | None,
           settings: dict[str, dict[str, Any]] | None = None) -> tuple[list[str], list[list[str]], str]:
    """The table's header, rows and closing lines (where the roles came from, the totals, each group's own
    settings), as text."""
    header = ["parameter", "shape", "optimizer", "group", "reason", "rule"]
    if effective_lr is not None:
        header.append("effective lr")
    rows = []
    for r in routes:
        row = [r.name, "x".join(map(str, r.shape)) or "scalar", str(r.optimizer), r.group, r.reason, str(r.rule)]
        if effective_lr is not None:
            lr = effective_lr(r)
            row.append("" if lr is None else f"{lr:.3g}")
        rows.append(row)
    counts = {opt: (sum(r.optimizer == opt for r in routes), sum(r.numel for r in routes if r.optimizer == opt))
              for opt in Algorithm}
    totals = "; ".join(
        f"{opt}: {tensors} tensor{'' if tensors == 1 else 's'}, {numel:,} parameter{'' if numel == 1 else 's'}"
        for opt, (tensors, numel) in counts.items()
    )
    return header, rows, "\n".join([f"Output heads and input layers: from {roles_from}.", totals,
                                    *_settings_lines(settings)])


def rich_table(routes: Sequence[Route], roles_from: str, effective_lr: EffectiveLr | None = None,
               settings: dict[str, dict[str, Any]] | None = None) -> Any:
    """A ``rich.table.Table`` (rich installed)."""
    from rich.table import Table

    header, rows, totals = _cells(routes, roles_from, effective_lr, settings)
    table = Table(title=TITLE, show_lines=False)
    for column in header:
        table.add_column(column, justify="right" if column == "effective lr" else "left")
    for row in rows:
        table.add_row(*row)
    table.caption = totals
    return table


def plain_table(routes: Sequence[Route], roles_from: str, effective_lr: EffectiveLr | None = None,
                width: int | None = None, settings: dict[str, dict[str, Any]] | None = None) -> str:
    """The table in aligned plain-text columns; with ``width``, the ``reason`` column is wrapped onto more lines
    so that the rows fit that many columns (where the other columns leave it room)."""
    header, rows, totals = _cells(routes, roles_from, effective_lr, settings)
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    reason = header.index("reason")
    if width is not None:
        others = sum(widths) - widths[reason] + 2 * (len(widths) - 1)
        widths[reason] = max(len("reason"), min(widths[reason], width - others))

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if h == "effective lr" else c.ljust(w)
                         for c, w, h in zip(cells, widths, header, strict=True)).rstrip()

    def lines(cells: list[str]) -> list[str]:
        first, *more = textwrap.wrap(cells[reason], widths[reason], break_long_words=False) or [""]
        blank = [""] * len(cells)
        return [line([*cells[:reason], first, *cells[reason + 1:]]),
                *(line([*blank[:reason], part, *blank[reason + 1:]]) for part in more)]

    rule = "  ".join("-" * w for w in widths)
    body = [text for row in rows for text in lines(row)]
    return "\n".join([TITLE, line(header), rule, *body, rule, totals]) + "\n"


def render(routes: Sequence[Route], roles_from: str, effective_lr: EffectiveLr | None = None,
           width: int = 140, settings: dict[str, dict[str, Any]] | None = None) -> str:
    """The table as plain text in ``width`` columns: drawn by rich when it is installed, else `plain_table` (its
    reasons wrapped)."""
    try:
        from rich.console import Console
    except ImportError:
        return plain_table(routes, roles_from, effective_lr, width, settings)

    buffer = io.StringIO()
    console = Console(file=buffer, width=width, no_color=True, force_terminal=False)
    console.print(rich_table(routes, roles_from, effective_lr, settings))
    return buffer.getvalue()
