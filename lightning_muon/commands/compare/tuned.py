"""``compare --sweep`` / ``--seeds N``: the tuned comparison, from the command's arguments to the files.

For each config (a side): fit its lr grid at seed 0, take the lr with the lowest final validation loss, fit
seeds ``1..N-1`` there (`tuning.tune`); then write ``OUT/comparison.md`` (the sweep table, the seeds table against
the tuned baseline's final loss, the verdict, notes) and ``OUT/comparison.png`` (`plot.plot_tuned`), and print
the tables and the verdict. Sides read with ``--from-logs`` join without training.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from lightning_muon.commands.compare.aggregate import (
    Outcome,
    Side,
    edge_notes,
    outcomes,
    resolution_note,
    seeds_table,
    sweep_table,
    verdict,
)
from lightning_muon.commands.compare.console import Console, machine_note
from lightning_muon.commands.compare.fit import override_value
from lightning_muon.commands.compare.plot import plot_tuned
from lightning_muon.commands.compare.report import baseline_index, baseline_reason, report_end, uniquely_named
from lightning_muon.commands.compare.sweep import MULTIPLIERS, SweptLr, side_grid
from lightning_muon.commands.compare.tuning import (
    Progress,
    SideSpec,
    fit_count,
    load_side,
    side_spec,
    subprocess_fit,
    tune,
)

#: What the seeds set, for the report.
SEEDS_NOTE = ("Seed N sets `--seed_everything N` (the initialisation) and, where the config's data module takes "
              "a `seed`, `--data.init_args.seed N` (its training batches). Train time leaves validation out "
              "(`WallClock`'s `time/train_s`); tokens/s is training tokens over it.")


def plan(args: argparse.Namespace, names: Sequence[str], overrides: Sequence[str]) -> list[SideSpec]:
    """Each config's side: what it sweeps and its grid. A config without a readable lr, or a seed given among the
    overrides, stops here, before any fit, with the fix."""
    if override_value(overrides, "seed_everything") is not None:
        raise SystemExit("lightning-muon compare: --seeds/--sweep set the seeds themselves (0..N-1): "
                         "drop --seed_everything")
    multipliers = args.multipliers if args.multipliers is not None else MULTIPLIERS if args.sweep else None

    def grid_of(name: str) -> Callable[[SweptLr], list[float]]:
        return lambda swept: side_grid(name, swept, multipliers, args.lrs.get(name))

    try:
        return [side_spec(name, config, overrides, grid_of(name))
                for config, name in zip(args.configs, names, strict=True)]
    except ValueError as error:
        raise SystemExit(f"lightning-muon compare: {error}") from None


def _plan_line(specs: Sequence[SideSpec], seeds: int, log_root: Path) -> str:
    sides = "; ".join(f"{s.name}: {s.swept.optimizer} lr {', '.join(f'{lr:g}' for lr in s.grid)}" for s in specs)
    more = "" if seeds == 1 else f", then seed{' 1' if seeds == 2 else f's 1-{seeds - 1}'} at each side's best lr"
    return (f"compare: {fit_count(specs, seeds)} fits ({sides}; at seed 0{more}); each fit's output in "
            f"{log_root}/<side>/<run>.out")


def run_tuned(args: argparse.Namespace, names: Sequence[str], overrides: Sequence[str], argv: Sequence[str],
              console: Console) -> tuple[float, list[Outcome]]:
    """Plan, fit, read the ``--from-logs`` sides, write ``comparison.md`` and ``.png``, print the tables and the
    verdict. Returns the target and each side's outcome."""
    out = Path(args.out)
    log_root = out / "lightning_logs"
    specs = plan(args, names, overrides)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    seeds = args.seeds or 1
    if specs:
        console.print(_plan_line(specs, seeds, log_root))
    fit = subprocess_fit(log_root, overrides, args.max_steps, args.val_points)
    started = time.perf_counter()
    sides = tune(specs, seeds, fit, Progress(fit_count(specs, seeds), console.print))
    fitted_s = time.perf_counter() - started
    try:
        sides = uniquely_named([*sides, *(load_side(d) for d in args.from_logs)])
        baseline = baseline_index(sides, args.baseline)
        target, results = outcomes(sides, baseline)
    except (ValueError, FileNotFoundError) as error:  # a run without val_loss, logs without their config, ...
        raise SystemExit(f"lightning-muon compare: {error}") from None
    notes = [machine_note(load_before)]
    notes += [f"{s.name}: read from {d}." for s, d in zip(sides[len(specs):], args.from_logs, strict=True)]
    if specs:
        dirs = " ".join(shlex.quote(str(log_root / s.name)) for s in sides[: len(specs)])
        notes.append(f"{fit_count(specs, seeds)} fits took {fitted_s / 60:.1f} min in all. Each fit's command is at "
                     f"the top of its output, `{log_root}/<side>/<run>.out`; to tabulate again without training: "
                     f"`lightning-muon compare --from-logs {dirs}`.")
    command = shlex.join(["lightning-muon", "compare", *argv])
    png = plot_tuned(sides, baseline, out / "comparison.png")
    reason = baseline_reason(sides, args.baseline, baseline)
    (out / "comparison.md").write_text(tuned_markdown(sides, results, target, reason, notes, command, png.name))
    for part in (sweep_table(sides), *edge_notes(sides), seeds_table(target, results), *verdict(target, results,
                                                                                               sides)):
        console.print(part)
    console.print(f"Wrote {png} and {out / 'comparison.md'}")
    return target, results


def tuned_markdown(sides: Sequence[Side], results: Sequence[Outcome], target: float, reason: str,
                   notes: Sequence[str], command: str, image: str | None) -> str:
    """``comparison.md`` of a tuned comparison: both tables, the edge notes, the verdict, what the numbers mean,
    the notes, the plot and the command."""
    base = next(o for o in results if o.baseline)
    parts = [
        f"# Tuned comparison: {' vs '.join(s.name for s in sides)}", "",
        "## lr sweep (seed 0)", "", sweep_table(sides), "",
        *[f"- {n}." for n in edge_notes(sides)], *([""] if edge_notes(sides) else []),
        "## Each side at its best lr", "", seeds_table(target, results), "",
        *verdict(target, results, sides), "",
        f"Baseline: **{base.side}** ({reason}); its mean final validation loss {target:.4f} is the target.",
        resolution_note(results), SEEDS_NOTE,
    ]
    caption = "validation loss by step, by training time, and the lr sweeps"
    return "\n".join([*parts, *report_end(notes, image, caption, command)])

