"""The comparison plot: validation loss against step and against training time."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from lightning_muon.commands.compare.runs import Run


def plot_comparison(runs: Sequence[Run], baseline: int, path: str | os.PathLike) -> Path:
    """Write a PNG: validation loss against step (left) and against training time (right), one line per run.

    Drawn with matplotlib's Agg canvas directly (no pyplot, no display, no
    global backend change). A dotted line marks the baseline's final loss.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    by_step, by_time = fig.subplots(1, 2, sharey=True)
    untimed = []
    for i, run in enumerate(runs):
        style = {"marker": "o", "markersize": 3.5, "linewidth": 1.8, "label": run.name}
        if i == baseline:
            style.update(linestyle="--", label=f"{run.name} (baseline)")
        line, = by_step.plot(run.val_steps, run.val_loss, **style)
        if run.val_time_s is not None:
            by_time.plot(run.val_time_s, run.val_loss, color=line.get_color(), **style)
        else:
            untimed.append(run.name)
    if runs[baseline].val_loss:
        target = runs[baseline].val_loss[-1]
        for ax in (by_step, by_time):
            ax.axhline(target, color="gray", linestyle=":", linewidth=1, label="baseline's final val loss")
    by_step.set_title("Validation loss by step")
    by_step.set_xlabel("step (optimizer updates)")
    by_step.set_ylabel("validation loss")
    by_time.set_title("Validation loss by training time")
    by_time.set_xlabel("training wall-clock time (s, validation excluded)")
    if untimed:
        by_time.text(0.02, 0.02, "no time logged: " + ", ".join(untimed), transform=by_time.transAxes, fontsize=8)
    for ax in (by_step, by_time):
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper right", fontsize=9)
    fig.suptitle("lightning-muon compare: " + " vs ".join(r.name for r in runs))
    path = Path(path)
    fig.savefig(path)
    return path
