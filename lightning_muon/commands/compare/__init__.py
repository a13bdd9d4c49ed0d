"""``lightning-muon compare``: fit configs, then plot and tabulate their validation loss by step and by time.

`runs` reads logs back, `report` builds the table, `plot` draws the figure, `run` fits and ties them together.
"""

from lightning_muon.commands.compare.plot import plot_comparison
from lightning_muon.commands.compare.report import (
    Row,
    baseline_index,
    markdown_report,
    markdown_table,
    rich_table,
    steps_to_reach,
    summarize,
    table_cells,
)
from lightning_muon.commands.compare.run import CLOCK, fit_arguments, main, split_overrides, val_check_interval
from lightning_muon.commands.compare.runs import Run, find_metrics, load_run, read_metrics, uses_muon

__all__ = [
    "CLOCK",
    "Row",
    "Run",
    "baseline_index",
    "find_metrics",
    "fit_arguments",
    "load_run",
    "main",
    "markdown_report",
    "markdown_table",
    "plot_comparison",
    "read_metrics",
    "rich_table",
    "split_overrides",
    "steps_to_reach",
    "summarize",
    "table_cells",
    "uses_muon",
    "val_check_interval",
]
