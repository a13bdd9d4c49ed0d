"""A tuned comparison from its runs: each side's best lr, its seeds' mean curve, the outcome against the tuned
baseline, the tables and the verdict. Pure functions on `Run`s (no training, no files).

The target is the baseline's final validation loss, the mean over its seeds at its best lr. "Steps to" it is the
first validation of a side's mean curve (over its seeds, on the validation steps they share) at or below it; the
train time to it is the seeds' mean train time at that validation.

With a target given (``compare --target``: a loss, or a named side's mean final val loss), each seed's own steps
to it are reported instead (`target_table`, `target_verdict`): their mean and spread, how many seeds reached it,
and how finely each was resolved (`lightning_muon.commands.compare.target`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_muon.commands.compare.report import steps_to_reach
from lightning_muon.commands.compare.runs import Run
from lightning_muon.commands.compare.sweep import SweptLr, best_lr, edge
from lightning_muon.commands.compare.target import StepsTo, steps_to


@dataclass
class Side:
    """One side of a tuned comparison: a config, the lr it sweeps, and its runs.

    Attributes:
        name: label in the tables and the plot.
        swept: which lr the side sweeps, and its config's value.
        sweep: the run at each lr of the grid, all at the first seed.
        seeds: the runs at the best lr, the first seed's (the sweep's) first.
    """

    name: str
    swept: SweptLr
    sweep: dict[float, Run] = field(default_factory=dict)
    seeds: list[Run] = field(default_factory=list)

    @property
    def muon(self) -> bool:
        """False for the AdamW-only side (the baseline by default)."""
        return self.swept.muon

    @property
    def grid(self) -> list[float]:
        """The lrs swept, ascending."""
        return sorted(self.sweep)

    @property
    def best(self) -> float:
        """The lr of the grid with the lowest final validation loss at the first seed."""
        return best_lr({lr: _final(run) for lr, run in self.sweep.items()})


def _final(run: Run) -> float:
    if not run.val_loss:
        raise ValueError(f"{run.name} logged no val_loss ({run.source}): it cannot be compared")
    return run.val_loss[-1]


@dataclass(frozen=True)
class Curve:
    """Mean (and spread) over seeds of one side's runs at its best lr, on the validation steps they share.

    ``time_mean`` is None when a run was not timed; ``throughput`` holds each seed's tokens (else samples) per
    second of training, ``unit`` says which.
    """

    steps: np.ndarray
    loss_mean: np.ndarray
    loss_min: np.ndarray
    loss_max: np.ndarray
    time_mean: np.ndarray | None
    final: np.ndarray
    train_s: np.ndarray
    throughput: np.ndarray
    unit: str


def mean_curve(runs: Sequence[Run]) -> Curve:
    """The seeds' curves on their common validation steps (an error when they share none)."""
    for run in runs:
        _final(run)
    steps = sorted(set.intersection(*(set(r.val_steps) for r in runs)))
    if not steps:
        raise ValueError("the runs " + ", ".join(r.name for r in runs) + " share no validation step")
    loss = np.array([[r.val_loss[r.val_steps.index(s)] for s in steps] for r in runs])
    times = None
    if all(r.val_time_s is not None for r in runs):
        times = np.array([[r.val_time_s[r.val_steps.index(s)] for s in steps] for r in runs])  # type: ignore[index]
    tokens = all(r.tokens is not None for r in runs)
    counts = [r.tokens if tokens else r.samples for r in runs]
    rates = [c / r.train_s if c is not None and r.train_s else math.nan for c, r in zip(counts, runs, strict=True)]
    return Curve(
        steps=np.array(steps), loss_mean=loss.mean(0), loss_min=loss.min(0), loss_max=loss.max(0),
        time_mean=None if times is None else times.mean(0), final=loss[:, -1],
        train_s=np.array([math.nan if r.train_s is None else r.train_s for r in runs]),
        throughput=np.array(rates),
        unit="tokens/s" if tokens else "samples/s",
    )


@dataclass(frozen=True)
class Outcome:
    """One side against the target: its best lr, its mean curve, the first step of that curve at or below the
    target and the mean train time there (``None``: not reached, or not timed), each seed's own first step, and
    each seed's crossing of the target with its train time there (``steps``); ``validations`` and
    ``validation_share``: the mean number of validations per fit of the side (sweep and seeds) and the mean share
    of their wall time spent validating (``None``: not timed)."""

    side: str
    lr: float
    baseline: bool
    curve: Curve
    steps_to: int | None
    time_to: float | None
    per_seed_steps_to: tuple[int | None, ...]
    steps: StepsTo
    validations: float
    validation_share: float | None

    @property
    def last_step(self) -> int:
        """The last validation step the side's seeds share."""
        return int(self.curve.steps[-1])

    @property
    def last_time(self) -> float | None:
        """The seeds' mean train time at that step (None: not timed)."""
        return None if self.curve.time_mean is None else float(self.curve.time_mean[-1])


def mean_final(side: Side) -> float:
    """A side's mean final validation loss over its seeds at its best lr (what a named target is)."""
    return float(mean_curve(side.seeds).loss_mean[-1])


def validation_cost(runs: Sequence[Run]) -> tuple[float, float | None]:
    """The mean validations per run, and the mean share of the runs' wall time spent validating (elapsed minus
    train time, over elapsed; ``None`` when a run was not timed)."""
    shares = [(r.elapsed_s - r.train_s) / r.elapsed_s for r in runs
              if r.elapsed_s and r.train_s is not None]
    share = float(np.mean(shares)) if len(shares) == len(runs) and shares else None
    return float(np.mean([len(r.val_steps) for r in runs])), share


def outcomes(sides: Sequence[Side], baseline: int, target: float | None = None) -> tuple[float, list[Outcome]]:
    """The target (``target`` when given, else the baseline's mean final val loss at its best lr) and every
    side's outcome against it."""
    curves = [mean_curve(side.seeds) for side in sides]
    target = float(curves[baseline].loss_mean[-1]) if target is None else float(target)
    result = []
    for i, (side, curve) in enumerate(zip(sides, curves, strict=True)):
        reached = steps_to_reach(curve.steps.tolist(), curve.loss_mean.tolist(), target)
        time_to = None
        if reached is not None and curve.time_mean is not None:
            time_to = float(curve.time_mean[curve.steps.tolist().index(reached)])
        per_seed = tuple(steps_to_reach(r.val_steps, r.val_loss, target) for r in side.seeds)
        seeds = steps_to([r.val_steps for r in side.seeds], [r.val_loss for r in side.seeds],
                         [r.val_time_s for r in side.seeds], target)
        swept = {id(r) for r in side.sweep.values()}
        runs = [*side.sweep.values(), *(r for r in side.seeds if id(r) not in swept)]
        result.append(Outcome(side.name, side.best, i == baseline, curve, reached, time_to, per_seed, seeds,
                              *validation_cost(runs)))
    return target, result


# ---------------------------------------------------------------------------------------------------- text


def spread(values: np.ndarray, spec: str = ".4f") -> str:
    """``mean ± std (min–max)`` over seeds (std with ddof=1); one value as it is."""
    if len(values) == 1:
        return format(values[0], spec)
    return f"{values.mean():{spec}} ± {values.std(ddof=1):{spec}} ({values.min():{spec}}–{values.max():{spec}})"


def _rate(value: float, unit: str) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:,.0f}" + ("" if unit == "tokens/s" else " samples/s")


def _seconds(values: np.ndarray) -> str:
    return "n/a" if np.isnan(values).any() else f"{values.mean():.1f}"


def sweep_table(sides: Sequence[Side]) -> str:
    """Markdown: every lr each side fitted at the first seed, its final val loss, train time and throughput; the
    best marked."""
    lines = ["| side | lr swept | lr | final val loss (seed 0) | train time (s) | tokens/s |",
             "|---|---|---:|---:|---:|---:|"]
    for side in sides:
        best = side.best
        for lr in side.grid:
            run = side.sweep[lr]
            curve = mean_curve([run])
            mark = " **best**" if lr == best and len(side.grid) > 1 else ""
            lines.append(f"| {side.name} | {side.swept.describe()} | {lr:g}{mark} | {_final(run):.4f} | "
                         f"{_seconds(curve.train_s)} | {_rate(curve.throughput[0], curve.unit)} |")
    return "\n".join(lines)


def _ratio(value: float | None, of: float | None, spec: str) -> str:
    if value is None:
        return "n/a"
    return format(value, spec) + (f" ({value / of:.2f}x)" if of else "")


def seeds_table(target: float, results: Sequence[Outcome]) -> str:
    """Markdown: each side at its best lr over its seeds, against the target; ratios to the baseline's steps and
    train time."""
    base = next(o for o in results if o.baseline)
    lines = [
        f"| side | lr | seeds | final val loss (mean ± std, min–max) | steps to {target:.4f} | "
        f"train time to {target:.4f} (s) | train time (s) | tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for o in results:
        c = o.curve
        if o.baseline:
            steps, time = str(o.steps_to), "n/a" if o.time_to is None else f"{o.time_to:.1f}"
        else:
            steps = "not reached" if o.steps_to is None else _ratio(o.steps_to, base.last_step, "d")
            time = "n/a" if o.steps_to is None else _ratio(o.time_to, base.last_time, ".1f")
        rate = "n/a" if np.isnan(c.throughput).all() else _rate(float(np.nanmean(c.throughput)), c.unit)
        lines.append(f"| {o.side}{' (baseline)' if o.baseline else ''} | {o.lr:g} | {len(c.final)} | "
                     f"{spread(c.final)} | {steps} | {time} | {_seconds(c.train_s)} | {rate} |")
    return "\n".join(lines)


def verdict(target: float, results: Sequence[Outcome], sides: Sequence[Side]) -> list[str]:
    """One line per side against the baseline: does it reach the tuned baseline's final val loss, in what
    fraction of the steps and train time, and the final losses over seeds."""
    base = next(o for o in results if o.baseline)
    tuned = {s.name: ("tuned " if len(s.grid) > 1 else "") for s in sides}
    lines = []
    for o in results:
        if o.baseline:
            continue
        c, b = o.curve, base.curve
        finals = (f"final val loss {c.final.mean():.4f} against {b.final.mean():.4f}"
                  + (f" (means over {len(c.final)} and {len(b.final)} seeds)" if max(len(c.final), len(b.final)) > 1
                     else ""))
        who = f"{o.side} (lr {o.lr:g})"
        goal = f"the {tuned[base.side]}{base.side}'s final val loss {target:.4f} (lr {base.lr:g})"
        if o.steps_to is None:
            lines.append(f"Verdict: {who} does not reach {goal} in {o.last_step} steps: {finals}.")
            continue
        time = "" if o.time_to is None or not base.last_time else (
            f" and {o.time_to / base.last_time:.2f}x its train time ({o.time_to:.1f} of {base.last_time:.1f} s)")
        lines.append(f"Verdict: {who} reaches {goal} in {o.steps_to / base.last_step:.2f}x its steps "
                     f"({o.steps_to} of {base.last_step}){time}; {finals}.")
    return lines


def edge_notes(sides: Sequence[Side]) -> list[str]:
    """A line for each side whose best lr is at an end of its grid: the best may lie beyond it."""
    notes = []
    for side in sides:
        at = edge(side.best, side.grid)
        if at is not None:
            notes.append(f"{side.name}'s best lr {side.best:g} is at the edge of its sweep (the {at} of "
                         f"{', '.join(f'{lr:g}' for lr in side.grid)}): a wider sweep may find better")
    return notes


def resolution_note(results: Sequence[Outcome]) -> str:
    """What "steps to" means, with the validation interval it is measured at."""
    gaps = {int(gap) for o in results for gap in np.diff(o.curve.steps)}
    every = "" if len(gaps) != 1 else " (every step)" if gaps == {1} else f" (every {min(gaps)} steps)"
    return ("\"Steps to\" is the first validation of a side's mean curve at or below the target, so it is an upper "
            f"bound at the resolution of the validations{every}.")
