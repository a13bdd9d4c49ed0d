"""``lightning-muon compare``: fit several configs and compare their validation loss by step and by wall-clock time.

    lightning-muon compare gpt_muon.yaml gpt_adamw.yaml --out benchmarks/results/compare
    lightning-muon compare --from-logs OUT/lightning_logs/gpt_muon OUT/lightning_logs/gpt_adamw   # no training

Each config is fitted by the real command (``python -m lightning_muon fit
--config CONFIG ...``, one subprocess per config, so DDP configs work as they
do on their own), with:

- a CSVLogger writing to ``OUT/lightning_logs/<config name>/`` (emptied first);
- the `lightning_muon.WallClock` callback added to the config's own
  (``--trainer.callbacks+=``), for the time and tokens seen at every step;
- validation every ``max_steps / --val_points`` steps (12 points by default,
  ``--trainer.check_val_every_n_epoch null``), unless a
  ``--trainer.val_check_interval`` is given;
- no checkpoints (unless the config has a ``ModelCheckpoint`` of its own);
- ``--trainer.max_steps N`` from ``--max_steps N``, and every other
  ``--key value`` argument given to ``compare`` passed on unchanged
  (``--trainer.limit_val_batches 5``, ``--seed_everything 1``, ...).

Then it writes ``OUT/comparison.png`` (validation loss against step and
against training time, one line per run) and ``OUT/comparison.md`` (final
validation loss and bits per byte, the step and time at which each run first
reaches the baseline's final validation loss, training time, wall time,
tokens/s, and the command line), and prints the table. The baseline is the run
whose model has ``muon: null`` (read from the ``config.yaml`` LightningCLI
saves with the logs), else the last run, or the one named by ``--baseline``.

With ``--sweep`` (or ``--multipliers``, ``--lrs``) and/or ``--seeds N`` it
tunes first (`lightning_muon.commands.compare.tuned`): each config's lr swept at
seed 0, seeds ``1..N-1`` at its best lr, the logs of each fit in
``OUT/lightning_logs/<config name>/lr<lr>_seed<seed>/`` and its output in the
``.out`` file beside them; then the tables are against the tuned baseline.

    lightning-muon compare --sweep --seeds 2 gpt_muon.yaml gpt_adamw.yaml
    lightning-muon compare --from-logs OUT/lightning_logs/gpt_muon OUT/lightning_logs/gpt_adamw   # again

With ``--target LOSS`` (or ``--target NAME``: that config's final val loss, the config fitted first) the "steps
to" are to that loss, and the fits made once it is known validate more often near it
(`lightning_muon.commands.compare.target`), so each side's steps are resolved to ``--resolution`` (2%) of
them; with seeds, each seed's steps are reported, their mean and spread, and how many seeds reached it.

The functions that read logs and compute the tables are pure and take plain
data, for tests and for use from Python.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_muon.commands.compare.aggregate import Outcome
from lightning_muon.commands.compare.console import Console as _Console
from lightning_muon.commands.compare.console import machine_note
from lightning_muon.commands.compare.fit import fit_arguments, fit_in_subprocess
from lightning_muon.commands.compare.plot import plot_comparison
from lightning_muon.commands.compare.report import (
    Row,
    baseline_index,
    baseline_reason,
    markdown_report,
    summarize,
    uniquely_named,
)
from lightning_muon.commands.compare.runs import VAL_LOSS, Run, load_run
from lightning_muon.commands.compare.sweep import MULTIPLIERS, check_multipliers, check_seeds, parse_lrs
from lightning_muon.commands.compare.target import RESOLUTION, check_resolution, check_target, crossing, parse_target
from lightning_muon.commands.compare.tuned import run_tuned
from lightning_muon.commands.compare.tuning import is_side_directory


def _unique_names(configs: Sequence[str]) -> list[str]:
    names: list[str] = []
    for config in configs:
        stem = Path(config).stem
        name, n = stem, 1
        while name in names:
            n += 1
            name = f"{stem}-{n}"
        names.append(name)
    return names


# ------------------------------------------------------------------------------------------------ the command

_OWN = {"-h", "--help", "--out", "--max_steps", "--max-steps", "--val_points", "--val-points",
        "--sweep", "--multipliers", "--lrs", "--seeds",
        "--from-logs", "--from_logs", "--baseline", "--target", "--resolution"}


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``compare``'s own arguments, and the ``--key value`` overrides meant for every fit (also all after ``--``)."""
    own: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            overrides += argv[i + 1 :]
            break
        if arg.startswith("--") and arg.split("=", 1)[0] not in _OWN:
            overrides.append(arg)
            if "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                overrides.append(argv[i + 1])
                i += 1
        else:
            own.append(arg)
        i += 1
    return own, overrides


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-muon compare",
        description=(
            "Fit each config (with a wall clock and frequent validation), then plot and tabulate their validation "
            "loss by step and by training time, against a baseline (the config with model.muon: null, else the "
            "last). Any other --key value argument goes to every fit, e.g. --trainer.limit_val_batches 5."
        ),
        epilog="examples: lightning-muon compare gpt_muon.yaml gpt_adamw.yaml --out results/compare; "
               "lightning-muon compare --sweep --seeds 2 gpt_muon.yaml gpt_adamw.yaml (12 fits)",
    )
    parser.add_argument("configs", nargs="*", metavar="CONFIG",
                        help="LightningCLI config files to fit (or shipped configs by name: gpt_muon.yaml)")
    parser.add_argument("--out", default="lightning_logs/compare",
                        help="where comparison.png, comparison.md and the runs' logs go (default: %(default)s)")
    parser.add_argument("--max_steps", "--max-steps", type=int, default=None,
                        help="trainer.max_steps for every fit (default: each config's)")
    parser.add_argument("--val_points", "--val-points", type=int, default=12,
                        help="validations per run, when no --trainer.val_check_interval is given (default: 12)")
    parser.add_argument("--from-logs", "--from_logs", nargs="+", default=[], metavar="DIR", dest="from_logs",
                        help="also compare these CSVLogger directories, without training (a directory of a "
                             "config's runs from --sweep/--seeds is one side)")
    parser.add_argument("--baseline", default=None, metavar="NAME", help="the run to measure against, by name")
    target = parser.add_argument_group(
        "steps to a target", "the steps each side takes to reach a loss, resolved by validating densely near it")
    target.add_argument("--target", default=None, metavar="LOSS|NAME",
                        help="the loss to reach: a number, or a config's (side's) name for its final val loss "
                             "(its mean over seeds at its best lr; that side is fitted first). Default: the "
                             "baseline's final val loss, at the resolution of the validations")
    target.add_argument("--resolution", type=float, default=RESOLUTION, metavar="FRACTION",
                        help="with --target: the fits close in on the target with validations, the last this "
                             "fraction of the steps done apart (default: %(default)s: each side's steps resolved "
                             "to within 2%%)")
    tuned = parser.add_argument_group(
        "tuning", "each config is a side: its lr swept at seed 0 (the Muon lr; an AdamW-only config's AdamW lr), "
        "then more seeds at its best lr; the table is against the tuned baseline's mean final val loss")
    tuned.add_argument("--sweep", action="store_true",
                       help="sweep each config's lr: x" + ", x".join(f"{m:g}" for m in MULTIPLIERS) + " its value")
    tuned.add_argument("--multipliers", type=_numbers, default=None, metavar="M,M,...",
                       help="the sweep's multipliers of each config's lr (implies --sweep)")
    tuned.add_argument("--lrs", action="append", default=[], metavar="NAME=LR,LR,...",
                       help="the lrs of one config (NAME: the config file's stem), instead of multiples of its own; "
                            "may be repeated")
    tuned.add_argument("--seeds", type=int, default=None, metavar="N",
                       help="fit seeds 0..N-1 at each side's best lr (or at its config's lr without a sweep)")
    return parser


def _numbers(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, e.g. 0.5,1,2; got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> list[Row] | list[Outcome]:
    """``lightning-muon compare``: fit, read the logs, write ``comparison.png`` and ``.md``, print the table (with
    ``--sweep`` / ``--seeds``: the tuned comparison, `lightning_muon.commands.compare.tuned`)."""
    argv = list(sys.argv[2:] if argv is None else argv)
    own, overrides = split_overrides(argv)
    args = _checked_arguments(own)
    console = _Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if _tuned(args):
        return run_tuned(args, _unique_names(args.configs), overrides, argv, console)[1]
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    try:
        read = [load_run(log_dir) for log_dir in args.from_logs]
    except (ValueError, FileNotFoundError) as error:  # logs without metrics.csv, ...
        raise SystemExit(f"lightning-muon compare: {error}") from None
    runs, fit_lines, target = fit_all(args, overrides, out / "lightning_logs", console,  # a name .gitignore
                                      _named_target(args.target, [], read))  # usually ignores
    try:
        runs = uniquely_named([*runs, *read])
        baseline_index(runs, args.baseline)  # a --baseline that names none of them stops here, not in the report
    except ValueError as error:
        raise SystemExit(f"lightning-muon compare: {error}") from None
    for run in runs:
        if not run.val_loss:
            console.print(f"compare: {run.name} logged no {VAL_LOSS} ({run.source})")
    notes = [machine_note(load_before), *(f"Fitted {line}" for line in fit_lines)]
    notes += [f"{run.name}: read from {run.source}." for run in runs[len(args.configs):]]
    reached = target_notes(runs, target, args.target, args.resolution) if args.target is not None else []
    rows, target, png = write_report(runs, args.baseline, out, shlex.join(["lightning-muon", "compare", *argv]),
                                     [*notes, *reached], target)
    console.table(rows, target)
    for line in reached:
        console.print(line)
    console.print(f"Wrote {png} and {out / 'comparison.md'}")
    return rows


def _checked_arguments(own: list[str]) -> argparse.Namespace:
    """compare's own arguments, parsed; bad ones (and a missing matplotlib) stop before any fit runs."""
    parser = _parser()
    args = parser.parse_args(own)
    if not args.configs and not args.from_logs:
        parser.error("give at least one CONFIG to fit, or --from-logs DIR")
    missing = [log_dir for log_dir in args.from_logs if not Path(log_dir).is_dir()]
    if missing:  # before any fit runs
        parser.error(f"--from-logs: no directory {', '.join(map(repr, missing))}")
    if args.val_points < 1 or (args.max_steps is not None and args.max_steps < 1):
        parser.error("--val_points and --max_steps must be >= 1")
    try:
        if args.multipliers is not None:
            args.multipliers = check_multipliers(args.multipliers)
        if args.seeds is not None:
            check_seeds(args.seeds)
        args.lrs = parse_lrs(args.lrs, _unique_names(args.configs))
        check_resolution(args.resolution)
        if args.target is not None:
            args.target = parse_target(args.target)
            check_target(args.target, [*_unique_names(args.configs), *(_log_name(d) for d in args.from_logs)])
    except ValueError as error:
        parser.error(str(error))
    if importlib.util.find_spec("matplotlib") is None:  # found out now, not after every fit has run
        parser.error("compare draws its plot with matplotlib: pip install matplotlib (or 'lightning-muon[compare]')")
    return args


def _tuned(args: argparse.Namespace) -> bool:
    """Whether to tune: a sweep or seeds asked for, or a --from-logs directory holding a side's several runs."""
    asked = args.sweep or args.multipliers is not None or args.lrs or args.seeds is not None
    return bool(asked) or any(is_side_directory(d) for d in args.from_logs)


def _log_name(log_dir: str) -> str:
    """The name a ``--from-logs`` directory goes by (a ``version_N`` directory: its parent's)."""
    path = Path(log_dir)
    return path.parent.name if path.name.startswith("version_") else path.name


def _named_target(target: float | str | None, fitted: list[Run], read: list[Run]) -> float | str | None:
    """``target`` as a loss once it is known: a number as it is, a run's name as that run's final val loss (from
    ``fitted`` or ``read``; still the name while that run is not fitted yet)."""
    if not isinstance(target, str):
        return target
    run = next((r for r in [*fitted, *read] if r.name == target), None)
    if run is None:
        return target
    if not run.val_loss:
        raise SystemExit(f"lightning-muon compare: --target {target}: {target} logged no {VAL_LOSS} ({run.source})")
    return run.val_loss[-1]


def fit_all(
    args: argparse.Namespace, overrides: list[str], log_root: Path, console: _Console,
    target: float | str | None = None,
) -> tuple[list[Run], list[str], float | None]:
    """Fit every config in a subprocess of its own (``lightning-muon fit``), logging under ``log_root``; the
    runs read back (in the configs' order), one line per fit with its command, and the target loss. A target
    named after a config fits that config first; the others validate densely near the target."""
    names = _unique_names(args.configs)
    order = sorted(range(len(names)), key=lambda i: names[i] != target)  # the named target's config first
    runs: dict[int, Run] = {}
    fit_lines: list[str] = []
    for i in order:
        config, name = args.configs[i], names[i]
        target = _named_target(target, list(runs.values()), [])
        dense = target if isinstance(target, float) else None
        fit_args = fit_arguments(config, log_root, name, overrides, args.max_steps, args.val_points, dense,
                                 args.resolution)
        shown = shlex.join(["lightning-muon", "fit", *fit_args])
        fit_lines.append(f"{name}: `{shown}`")
        shutil.rmtree(log_root / name, ignore_errors=True)
        console.rule(f"compare: fitting {name}")
        console.print(shown)
        returncode = fit_in_subprocess(fit_args)
        if returncode != 0:
            raise SystemExit(
                f"lightning-muon compare: the fit of {config} failed (exit code {returncode}); "
                f"run it alone to see why: {shown}"
            )
        runs[i] = load_run(log_root / name, name)
    target = _named_target(target, list(runs.values()), [])
    return [runs[i] for i in range(len(names))], fit_lines, None if isinstance(target, str) else target


def target_notes(runs: list[Run], target: float | None, asked: float | str, resolution: float) -> list[str]:
    """What the target is, and one line per run: where it crossed the target, how finely, at what cost."""
    if target is None:
        return []
    what = f"{asked}'s final val loss {target:.4f}" if isinstance(asked, str) else f"{target:.4f}"
    lines = [f"Target: {what}. \"Steps to\" is each run's first validation at or below it, and the run reached "
             "the target between the validation before and that one (below). Fitted with --target, a fit closes in "
             f"on the target with validations, the last {resolution:.0%} of its steps apart."]
    for run in runs:
        found = crossing(run.val_steps, run.val_loss, target)
        where = ("did not reach it" if found is None else
                 f"reached it after step {found.before} and by step {found.step} (within {found.width:.1%})")
        cost = f"{len(run.val_steps)} validations"
        if run.elapsed_s and run.train_s is not None:
            cost += f", {(run.elapsed_s - run.train_s) / run.elapsed_s:.0%} of its wall time"
        lines.append(f"{run.name}: {where}; {cost}.")
    return lines


def write_report(runs: list[Run], chosen: str | None, out: Path, command: str,
                 notes: list[str], target: float | None = None) -> tuple[list[Row], float | None, Path]:
    """``comparison.png`` and ``comparison.md`` in ``out``, against the baseline (``chosen`` with --baseline,
    else the run whose model has ``muon: null``, else the last) and ``target`` (else the baseline's final val
    loss); the table's rows and target loss, the plot."""
    baseline = baseline_index(runs, chosen)
    reason = baseline_reason(runs, chosen, baseline)
    png = plot_comparison(runs, baseline, out / "comparison.png", target)
    report = markdown_report(runs, baseline, command, notes, image=png.name, baseline_reason=reason, target=target)
    (out / "comparison.md").write_text(report)
    rows, target = summarize(runs, baseline, target)
    return rows, target, png
