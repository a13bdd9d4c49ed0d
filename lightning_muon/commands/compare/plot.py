"""The comparison plots: validation loss against step and against training time (one run per config, or each
side of a tuned comparison over its seeds, with its lr sweep)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from lightning_muon.commands.compare.aggregate import Side, mean_curve
from lightning_muon.commands.compare.runs import Run


def plot_comparison(runs: Sequence[Run], baseline: int, path: str | os.PathLike, target: float | None = None) -> Path:
    """Write a PNG: validation loss against step (left) and against training time (right), one line per run.

    Drawn with matplotlib's Agg canvas directly (no pyplot, no display, no
    global backend change). A dotted line marks ``target``, else the baseline's final loss.
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
    if target is not None or runs[baseline].val_loss:
        label = "the target" if target is not None else "baseline's final val loss"
        line_at = target if target is not None else runs[baseline].val_loss[-1]
        for ax in (by_step, by_time):
            ax.axhline(line_at, color="gray", linestyle=":", linewidth=1, label=label)
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


def plot_tuned(sides: Sequence[Side], baseline: int, path: str | os.PathLike, title: str = "",
               target: tuple[float, str] | None = None) -> Path:
    """Write a PNG of a tuned comparison: validation loss by step and by train time (each side's mean over its
    seeds at its best lr, with a min-max band), and the sweeps' final loss by lr (when some side swept). A dotted
    line marks ``target`` (its loss and label), else the baseline's mean final loss."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    swept = [side for side in sides if len(side.grid) > 1]
    fig = Figure(figsize=(16 if swept else 12, 4.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3 if swept else 2)
    by_step, by_time = axes[0], axes[1]
    by_time.sharey(by_step)
    line_at, label = target or (float(mean_curve(sides[baseline].seeds).loss_mean[-1]),
                                f"{sides[baseline].name}'s mean final val loss (the target)")
    for i, side in enumerate(sides):
        c = mean_curve(side.seeds)
        n = len(side.seeds)
        label = f"{side.name} lr {side.best:g}" + (f" (mean of {n} seeds, band min–max)" if n > 1 else "")
        line, = by_step.plot(c.steps, c.loss_mean, marker="o", markersize=3,
                             linestyle="--" if i == baseline else "-", label=label)
        by_step.fill_between(c.steps, c.loss_min, c.loss_max, color=line.get_color(), alpha=0.25, linewidth=0)
        if c.time_mean is not None:
            by_time.plot(c.time_mean, c.loss_mean, color=line.get_color(), marker="o", markersize=3,
                         linestyle=line.get_linestyle(), label=label)
            by_time.fill_between(c.time_mean, c.loss_min, c.loss_max, color=line.get_color(), alpha=0.25,
                                 linewidth=0)
        if swept:
            axes[2].plot(side.grid, [side.sweep[lr].val_loss[-1] for lr in side.grid], color=line.get_color(),
                         marker="o", label=f"{side.name}: {side.swept.optimizer} lr, seed 0")
    for ax in (by_step, by_time):
        ax.axhline(line_at, color="gray", linestyle=":", linewidth=1, label=label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_ylabel("validation loss")
    by_step.set_xlabel("step (optimizer updates)")
    by_step.set_title(f"{title + ': ' if title else ''}validation loss by step")
    by_time.set_xlabel("training time (s, validation excluded)")
    by_time.set_title("by training time")
    if swept:
        by_lr = axes[2]
        by_lr.set_xscale("log")
        by_lr.set_xticks(sorted({lr for side in sides for lr in side.grid}))
        by_lr.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        by_lr.xaxis.set_minor_formatter(NullFormatter())
        by_lr.tick_params(axis="x", labelrotation=45, labelsize=8)
        by_lr.set_xlabel("learning rate swept")
        by_lr.set_ylabel("final validation loss")
        by_lr.set_title("lr sweep (seed 0)")
        by_lr.grid(True, alpha=0.3)
        by_lr.legend(fontsize=8)
    path = Path(path)
    fig.savefig(path)
    return path
