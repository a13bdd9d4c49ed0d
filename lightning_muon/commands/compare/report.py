"""The comparison table: rows from runs, as markdown and for the terminal."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from lightning_muon.commands.compare.runs import Run

if TYPE_CHECKING:
    from rich.table import Table


def steps_to_reach(steps: Sequence[int], losses: Sequence[float], target: float) -> int | None:
    """The first step whose loss is at or below ``target``; ``None`` if none is."""
    for step, loss in zip(steps, losses, strict=True):
        if loss <= target:
            return step
    return None


class _Named(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def muon(self) -> bool | None: ...


def baseline_index(runs: Sequence[_Named], name: str | None = None) -> int:
    """The baseline among runs (or sides): the one called ``name``; else the (last) one with ``muon: null``; else
    the last."""
    if name is not None:
        names = [r.name for r in runs]
        if name not in names:
            raise ValueError(f"--baseline {name!r} is none of the runs: {', '.join(names)}")
        return names.index(name)
    adamw = [i for i, r in enumerate(runs) if r.muon is False]
    return adamw[-1] if adamw else len(runs) - 1


def baseline_reason(runs: Sequence[_Named], chosen: str | None, baseline: int) -> str:
    """Why ``runs[baseline]`` is the baseline, for the report."""
    if chosen is not None:
        return "chosen with --baseline"
    if runs[baseline].muon is False:
        return "its model has muon: null"
    return "the last run: no run's model has muon: null"


_T = TypeVar("_T", bound=Any)


def uniquely_named(items: Sequence[_T]) -> list[_T]:
    """Runs (or sides: dataclasses with a ``name``), with ``-2``, ``-3``... after each repeated name."""
    names = [item.name for item in items]
    return [replace(item, name=f"{item.name}-{names[: i + 1].count(item.name)}") if names.count(item.name) > 1
            else item for i, item in enumerate(items)]


@dataclass(frozen=True)
class Row:
    """One line of the comparison table (``None``: not known; ``steps_to_target`` None: not reached)."""

    run: str
    baseline: bool
    steps: int | None
    final_val_loss: float | None
    final_val_bpb: float | None
    steps_to_target: int | None
    time_to_target_s: float | None
    train_s: float | None
    elapsed_s: float | None
    throughput: float | None
    throughput_unit: str


def summarize(runs: Sequence[Run], baseline: int, target: float | None = None) -> tuple[list[Row], float | None]:
    """The table's rows, and the target: ``target`` when given, else the baseline's final validation loss."""
    if target is None:
        target = runs[baseline].val_loss[-1] if runs[baseline].val_loss else None
    rows = []
    for i, run in enumerate(runs):
        reached = None if target is None else steps_to_reach(run.val_steps, run.val_loss, target)
        time_to = None
        if reached is not None and run.val_time_s is not None:
            time_to = run.val_time_s[run.val_steps.index(reached)]
        count, unit = (run.tokens, "tokens/s") if run.tokens is not None else (run.samples, "samples/s")
        throughput = count / run.train_s if count is not None and run.train_s else None
        rows.append(
            Row(
                run=run.name,
                baseline=i == baseline,
                steps=run.val_steps[-1] if run.val_steps else None,
                final_val_loss=run.val_loss[-1] if run.val_loss else None,
                final_val_bpb=run.val_bpb[-1] if run.val_bpb else None,
                steps_to_target=reached,
                time_to_target_s=time_to,
                train_s=run.train_s,
                elapsed_s=run.elapsed_s,
                throughput=throughput,
                throughput_unit=unit,
            )
        )
    return rows, target


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def table_cells(rows: Sequence[Row], target: float | None) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the table, as text (shared by the markdown file and the terminal)."""
    goal = _fmt(target, ".4f")
    header = [
        "run", "steps", "final val loss", "final val bpb", f"steps to {goal}", f"train time to {goal} (s)",
        "train time (s)", "wall time (s)", "tokens/s",
    ]
    cells = []
    for row in rows:
        if row.throughput is None:
            throughput = "n/a"
        else:
            throughput = f"{row.throughput:,.0f}" + ("" if row.throughput_unit == "tokens/s" else " samples/s")
        cells.append([
            row.run + (" (baseline)" if row.baseline else ""),
            _fmt(row.steps, "d"),
            _fmt(row.final_val_loss, ".4f"),
            _fmt(row.final_val_bpb, ".4f"),
            "n/a" if target is None else "not reached" if row.steps_to_target is None else str(row.steps_to_target),
            "n/a" if row.steps_to_target is None else _fmt(row.time_to_target_s, ".1f"),
            _fmt(row.train_s, ".1f"),
            _fmt(row.elapsed_s, ".1f"),
            throughput,
        ])
    return header, cells


def markdown_table(rows: Sequence[Row], target: float | None) -> str:
    """The table in GitHub markdown, numbers right-aligned."""
    header, cells = table_cells(rows, target)
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in cells]
    return "\n".join(lines)


def markdown_report(
    runs: Sequence[Run],
    baseline: int,
    command: str,
    notes: Sequence[str] = (),
    image: str | None = "comparison.png",
    baseline_reason: str | None = None,
    target: float | None = None,
) -> str:
    """``comparison.md``: the table, what its columns mean, the notes (machine, fits), the command line. The
    "steps to" column is against ``target`` when given, else against the baseline's final validation loss."""
    given = target is not None
    rows, target = summarize(runs, baseline, target)
    base = runs[baseline]
    why = baseline_reason or ("its model has muon: null" if base.muon is False else "the last run")
    if given:
        goal = f"; the target of the \"steps to\" column is {target:.4f}: the first validation at or below it"
    elif target is not None:
        goal = (f"; its final validation loss {target:.4f} is the target of the \"steps to\" column: the first "
                "validation at or below it")
    else:
        goal = "; its final validation loss is unknown (it logged no val_loss)"
    parts = [
        f"# Validation loss: {' vs '.join(r.name for r in runs)}",
        "",
        markdown_table(rows, target),
        "",
        f"Baseline: **{base.name}** ({why}){goal}" + (" (\"not reached\": none)." if target is not None else "."),
        "Steps are optimizer updates. Train time is the wall-clock time of training with validation left out "
        "(`time/train_s` of `lightning_muon.WallClock`); wall time is from the start of training to its "
        "end, validation included. tokens/s is the tokens seen (all ranks) over the train time.",
    ]
    return "\n".join([*parts, *report_end(notes, image, "validation loss by step and by training time", command)])


def report_end(notes: Sequence[str], image: str | None, caption: str, command: str) -> list[str]:
    """The end of a ``comparison.md``: the notes as a list, the plot, and the command that produced it."""
    parts = ["", *[f"- {n}" for n in notes]] if notes else []
    if image:
        parts += ["", f"![{caption}]({image})"]
    return [*parts, "", "Produced by:", "", "```bash", command, "```", ""]


def rich_table(rows: Sequence[Row], target: float | None) -> Table:
    """The table for the terminal (rich: ``compare`` checks it is installed before any fit)."""
    from rich.table import Table

    header, cells = table_cells(rows, target)
    table = Table(title="lightning-muon compare")
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right")
    for line in cells:
        table.add_row(*line)
    return table
