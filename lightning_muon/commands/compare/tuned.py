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
    mean_final,
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
from lightning_muon.commands.compare.target import check_target
from lightning_muon.commands.compare.target_report import target_label, target_notes, target_table, target_verdict
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
    given: float | str | None = args.target
    try:
        read = [load_side(d) for d in args.from_logs]
    except (ValueError, FileNotFoundError) as error:  # a run without val_loss, logs without their config, ...
        raise SystemExit(f"lightning-muon compare: {error}") from None
    if specs:
        console.print(_plan_line(specs, seeds, log_root))
    started = time.perf_counter()
    sides = _fit_sides(args, specs, seeds, overrides, read, log_root, console)
    fitted_s = time.perf_counter() - started
    try:
        sides = uniquely_named([*sides, *read])
        baseline = baseline_index(sides, args.baseline)
        target_value = _side_target(given, sides)
        target, results = outcomes(sides, baseline, target_value)
    except ValueError as error:  # a run without val_loss, ...
        raise SystemExit(f"lightning-muon compare: {error}") from None
    target_side = given if isinstance(given, str) else None
    notes = [machine_note(load_before)]
    notes += [f"{s.name}: read from {d}." for s, d in zip(sides[len(specs):], args.from_logs, strict=True)]
    if specs:
        dirs = " ".join(shlex.quote(str(log_root / s.name)) for s in sides[: len(specs)])
        notes.append(f"{fit_count(specs, seeds)} fits took {fitted_s / 60:.1f} min in all. Each fit's command is at "
                     f"the top of its output, `{log_root}/<side>/<run>.out`; to tabulate again without training: "
                     f"`lightning-muon compare --from-logs {dirs}`.")
    command = shlex.join(["lightning-muon", "compare", *argv])
    line = None if given is None else (target, target_label(target, target_side, sides))
    png = plot_tuned(sides, baseline, out / "comparison.png", target=line)
    reason = baseline_reason(sides, args.baseline, baseline)
    if given is None:
        tables = [seeds_table(target, results), *verdict(target, results, sides)]
        (out / "comparison.md").write_text(tuned_markdown(sides, results, target, reason, notes, command, png.name))
    else:
        fitted_first = target_side if any(s.name == target_side for s in specs) else None
        tables = [target_table(target, results, target_side), *target_verdict(target, results, target_side, sides),
                  *target_notes(args.resolution, results, fitted_first)]
        (out / "comparison.md").write_text(tuned_markdown(sides, results, target, reason, notes, command, png.name,
                                                          target_side, args.resolution, fitted_first))
    for part in (sweep_table(sides), *edge_notes(sides), *tables):
        console.print(part)
    console.print(f"Wrote {png} and {out / 'comparison.md'}")
    return target, results


def _side_target(given: float | str | None, sides: Sequence[Side]) -> float | None:
    """The target loss: a number as given, a side's name as that side's mean final val loss, else ``None``."""
    if given is None or isinstance(given, float):
        return given
    check_target(given, [s.name for s in sides])
    return mean_final(next(s for s in sides if s.name == given))


def _fit_sides(args: argparse.Namespace, specs: Sequence[SideSpec], seeds: int, overrides: Sequence[str],
               read: Sequence[Side], log_root: Path, console: Console) -> list[Side]:
    """`tune` every side, in the order of ``specs``. With ``--target``, the fits validate densely near it; a
    target named after a side to fit tunes that side first, on the grid of validations alone."""
    given = args.target
    progress = Progress(fit_count(specs, seeds), console.print)
    first = [spec for spec in specs if spec.name == given]
    done: dict[str, Side] = {}
    if first:
        plain = subprocess_fit(log_root, overrides, args.max_steps, args.val_points)
        done = {side.name: side for side in tune(first, seeds, plain, progress)}
    try:
        value = _side_target(given, [*done.values(), *read])
    except ValueError as error:  # a named side read back under another name
        raise SystemExit(f"lightning-muon compare: {error}") from None
    fit = subprocess_fit(log_root, overrides, args.max_steps, args.val_points, target=value,
                         resolution=args.resolution)
    rest = [spec for spec in specs if spec.name not in done]
    done |= {side.name: side for side in tune(rest, seeds, fit, progress)}
    return [done[spec.name] for spec in specs]


def tuned_markdown(sides: Sequence[Side], results: Sequence[Outcome], target: float, reason: str,
                   notes: Sequence[str], command: str, image: str | None, target_side: str | None = None,
                   resolution: float | None = None, fitted_first: str | None = None) -> str:
    """``comparison.md`` of a tuned comparison: both tables, the edge notes, the verdict, what the numbers mean,
    the notes, the plot and the command. With a ``resolution``, the target was given (``--target``: a loss, or
    ``target_side``'s mean final loss) and each seed's steps to it are tabulated."""
    base = next(o for o in results if o.baseline)
    if resolution is None:
        against = [seeds_table(target, results), "", *verdict(target, results, sides), "",
                   f"Baseline: **{base.side}** ({reason}); its mean final validation loss {target:.4f} is the target.",
                   resolution_note(results)]
    else:
        against = [target_table(target, results, target_side), "",
                   *target_verdict(target, results, target_side, sides), "",
                   f"Target: {target_label(target, target_side, sides)}. Baseline: **{base.side}** ({reason}).",
                   *target_notes(resolution, results, fitted_first)]
    parts = [
        f"# Tuned comparison: {' vs '.join(s.name for s in sides)}", "",
        "## lr sweep (seed 0)", "", sweep_table(sides), "",
        *[f"- {n}." for n in edge_notes(sides)], *([""] if edge_notes(sides) else []),
        "## Each side at its best lr", "", *against, SEEDS_NOTE,
    ]
    caption = "validation loss by step, by training time, and the lr sweeps"
    return "\n".join([*parts, *report_end(notes, image, caption, command)])

