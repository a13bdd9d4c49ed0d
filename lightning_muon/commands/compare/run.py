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
        "--from-logs", "--from_logs", "--baseline"}


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
    runs, fit_lines = fit_all(args, overrides, out / "lightning_logs", console)  # a name .gitignore usually ignores
    try:
        runs = uniquely_named([*runs, *(load_run(log_dir) for log_dir in args.from_logs)])
        baseline_index(runs, args.baseline)  # a --baseline that names none of them stops here, not in the report
    except (ValueError, FileNotFoundError) as error:  # logs without metrics.csv, ...
        raise SystemExit(f"lightning-muon compare: {error}") from None
    for run in runs:
        if not run.val_loss:
            console.print(f"compare: {run.name} logged no {VAL_LOSS} ({run.source})")
    notes = [machine_note(load_before), *(f"Fitted {line}" for line in fit_lines)]
    notes += [f"{run.name}: read from {run.source}." for run in runs[len(args.configs):]]
    rows, target, png = write_report(runs, args.baseline, out, shlex.join(["lightning-muon", "compare", *argv]), notes)
    console.table(rows, target)
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
    except ValueError as error:
        parser.error(str(error))
    if importlib.util.find_spec("matplotlib") is None:  # found out now, not after every fit has run
        parser.error("compare draws its plot with matplotlib: pip install matplotlib (or 'lightning-muon[compare]')")
    return args


def _tuned(args: argparse.Namespace) -> bool:
    """Whether to tune: a sweep or seeds asked for, or a --from-logs directory holding a side's several runs."""
    asked = args.sweep or args.multipliers is not None or args.lrs or args.seeds is not None
    return bool(asked) or any(is_side_directory(d) for d in args.from_logs)


def fit_all(
    args: argparse.Namespace, overrides: list[str], log_root: Path, console: _Console
) -> tuple[list[Run], list[str]]:
    """Fit every config in a subprocess of its own (``lightning-muon fit``), logging under ``log_root``; the
    runs read back, and one line per fit with its command."""
    runs: list[Run] = []
    fit_lines: list[str] = []
    for config, name in zip(args.configs, _unique_names(args.configs), strict=True):
        fit_args = fit_arguments(config, log_root, name, overrides, args.max_steps, args.val_points)
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
        runs.append(load_run(log_root / name, name))
    return runs, fit_lines


def write_report(runs: list[Run], chosen: str | None, out: Path, command: str,
                 notes: list[str]) -> tuple[list[Row], float | None, Path]:
    """``comparison.png`` and ``comparison.md`` in ``out``, against the baseline (``chosen`` with --baseline,
    else the run whose model has ``muon: null``, else the last); the table's rows and target loss, the plot."""
    baseline = baseline_index(runs, chosen)
    reason = baseline_reason(runs, chosen, baseline)
    png = plot_comparison(runs, baseline, out / "comparison.png")
    report = markdown_report(runs, baseline, command, notes, image=png.name, baseline_reason=reason)
    (out / "comparison.md").write_text(report)
    rows, target = summarize(runs, baseline)
    return rows, target, png
