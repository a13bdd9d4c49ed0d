"""``lightning-muon compare``: fit configs, then plot and tabulate their validation loss by step and by time; with
``--sweep`` / ``--seeds``, each config's lr tuned and seeded first.

`runs` reads logs back, `report` builds the one-run-per-config table, `plot` draws the figures, `fit` runs one fit,
`sweep` says what a side sweeps, `aggregate` turns a side's runs into the tuned tables and verdict, `tuning` runs
the sweep and seeds, `tuned` and `run` are the command.
"""

from lightning_muon.commands.compare.aggregate import (
    Curve,
    Outcome,
    Side,
    edge_notes,
    mean_curve,
    outcomes,
    resolution_note,
    seeds_table,
    spread,
    sweep_table,
    verdict,
)
from lightning_muon.commands.compare.fit import CLOCK, fit_arguments, fit_in_subprocess, val_check_interval
from lightning_muon.commands.compare.plot import plot_comparison, plot_tuned
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
from lightning_muon.commands.compare.run import main, split_overrides
from lightning_muon.commands.compare.runs import Run, find_metrics, load_run, read_metrics, uses_muon
from lightning_muon.commands.compare.sweep import MULTIPLIERS, SweptLr, best_lr, edge, lr_grid, swept_lr
from lightning_muon.commands.compare.tuning import (
    Progress,
    SideSpec,
    fit_count,
    load_side,
    side_spec,
    subprocess_fit,
    tune,
)

__all__ = [
    "CLOCK",
    "MULTIPLIERS",
    "Curve",
    "Outcome",
    "Progress",
    "Row",
    "Run",
    "Side",
    "SideSpec",
    "SweptLr",
    "baseline_index",
    "best_lr",
    "edge",
    "edge_notes",
    "find_metrics",
    "fit_arguments",
    "fit_count",
    "fit_in_subprocess",
    "load_run",
    "load_side",
    "lr_grid",
    "main",
    "markdown_report",
    "markdown_table",
    "mean_curve",
    "outcomes",
    "plot_comparison",
    "plot_tuned",
    "read_metrics",
    "resolution_note",
    "rich_table",
    "seeds_table",
    "side_spec",
    "split_overrides",
    "spread",
    "steps_to_reach",
    "subprocess_fit",
    "summarize",
    "sweep_table",
    "swept_lr",
    "table_cells",
    "tune",
    "uses_muon",
    "val_check_interval",
    "verdict",
]
