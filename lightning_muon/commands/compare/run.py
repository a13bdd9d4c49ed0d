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

The functions that read logs and compute the table are pure and take plain
data, for tests and for use from Python.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_muon.commands.compare.plot import plot_comparison
from lightning_muon.commands.compare.report import (
    Row,
    baseline_index,
    markdown_report,
    markdown_table,
    rich_table,
    summarize,
)
from lightning_muon.commands.compare.runs import VAL_LOSS, Run, load_run
from lightning_muon.commands.config_files import merged_config

#: The callback ``compare`` adds to every fit.
CLOCK = "lightning_muon.WallClock"


def val_check_interval(max_steps: int, points: int) -> int:
    """Validate every this many steps to get about ``points`` validations in ``max_steps``.

    A divisor of ``max_steps`` when one gives between half and twice
    ``points`` validations (so the last one is at the last step); else
    ``round(max_steps / points)``.
    """
    if max_steps < 1 or points < 1:
        raise ValueError(f"max_steps and points must be >= 1, got {max_steps} and {points}")
    ideal = max_steps / points
    divisors = [d for d in range(1, max_steps + 1) if max_steps % d == 0 and points / 2 <= max_steps / d <= 2 * points]
    if divisors:
        return min(divisors, key=lambda d: (abs(d - ideal), d))
    return max(1, round(ideal))


def _given(overrides: Sequence[str], key: str) -> str | None:
    """The value of ``--key value`` or ``--key=value`` among the overrides (the last one), else None."""
    value = None
    for i, arg in enumerate(overrides):
        if arg == f"--{key}" and i + 1 < len(overrides):
            value = overrides[i + 1]
        elif arg.startswith(f"--{key}="):
            value = arg.split("=", 1)[1]
    return value


def _callback_paths(config: dict[str, Any]) -> list[str]:
    """The class paths of the config's ``trainer.callbacks`` (a list, or a single callback)."""
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    if not isinstance(callbacks, list):
        callbacks = [callbacks]
    return [c.get("class_path", "") if isinstance(c, dict) else str(c) for c in callbacks]


def fit_arguments(
    config: str | os.PathLike,
    log_root: str | os.PathLike,
    name: str,
    overrides: Sequence[str] = (),
    max_steps: int | None = None,
    val_points: int = 12,
) -> list[str]:
    """The arguments of ``lightning-muon fit`` for one run of ``compare`` (see the module docstring)."""
    merged = merged_config(config)
    callbacks = _callback_paths(merged)
    args = ["--config", str(config)]
    if max_steps is not None:
        args += ["--trainer.max_steps", str(max_steps)]
    args += list(overrides)
    steps = max_steps or _given(overrides, "trainer.max_steps") or (merged.get("trainer") or {}).get("max_steps")
    steps = int(steps) if steps not in (None, "null") else -1
    if steps > 0 and _given(overrides, "trainer.val_check_interval") is None:
        args += [
            "--trainer.val_check_interval", str(val_check_interval(steps, val_points)),
            "--trainer.check_val_every_n_epoch", "null",  # the interval counts steps across epochs
        ]
    has_checkpoint = any(p.endswith("ModelCheckpoint") for p in callbacks)
    if _given(overrides, "trainer.enable_checkpointing") is None and not has_checkpoint:
        args += ["--trainer.enable_checkpointing", "false"]
    if not any(p.endswith("WallClock") for p in callbacks) and not any("WallClock" in a for a in overrides):
        args += [f"--trainer.callbacks+={CLOCK}"]
    args += [  # last: compare reads the logs from here
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.init_args.save_dir", str(log_root),
        "--trainer.logger.init_args.name=",
        "--trainer.logger.init_args.version", name,
    ]
    return args


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
        epilog="example: lightning-muon compare gpt_muon.yaml gpt_adamw.yaml --out results/compare",
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
                        help="also compare these CSVLogger directories, without training")
    parser.add_argument("--baseline", default=None, metavar="NAME", help="the run to measure against, by name")
    return parser


def main(argv: Sequence[str] | None = None) -> list[Row]:
    """``lightning-muon compare``: fit, read the logs, write ``comparison.png`` and ``.md``, print the table."""
    argv = list(sys.argv[2:] if argv is None else argv)
    own, overrides = split_overrides(argv)
    args = _checked_arguments(own)
    console = _Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    runs, fit_lines = fit_all(args, overrides, out / "lightning_logs", console)  # a name .gitignore usually ignores
    runs = _uniquely_named([*runs, *(load_run(log_dir) for log_dir in args.from_logs)])
    for run in runs:
        if not run.val_loss:
            console.print(f"compare: {run.name} logged no {VAL_LOSS} ({run.source})")
    notes = [_machine_note(load_before), *(f"Fitted {line}" for line in fit_lines)]
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
    if args.val_points < 1 or (args.max_steps is not None and args.max_steps < 1):
        parser.error("--val_points and --max_steps must be >= 1")
    if importlib.util.find_spec("matplotlib") is None:  # found out now, not after every fit has run
        parser.error("compare draws its plot with matplotlib: pip install matplotlib (or 'lightning-muon[compare]')")
    return args


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
        result = subprocess.run([sys.executable, "-m", "lightning_muon", "fit", *fit_args])
        if result.returncode != 0:
            raise SystemExit(
                f"lightning-muon compare: the fit of {config} failed (exit code {result.returncode}); "
                f"run it alone to see why: {shown}"
            )
        runs.append(load_run(log_root / name, name))
    return runs, fit_lines


def _uniquely_named(runs: list[Run]) -> list[Run]:
    """``runs`` with a ``-2``, ``-3``... after each repeated name."""
    names = [r.name for r in runs]
    return [replace(run, name=f"{run.name}-{names[: i + 1].count(run.name)}") if names.count(run.name) > 1 else run
            for i, run in enumerate(runs)]


def _machine_note(load_before: tuple[float, float, float] | None) -> str:
    return (
        f"Machine: {os.cpu_count()} CPU cores, {platform.platform(terse=True)}, Python {platform.python_version()}"
        + _versions()
        + (f"; load average (1/5/15 min) {_load(load_before)} before, {_load(os.getloadavg())} after"
           if load_before else "")
        + ". Times are noisy when other work shares the machine."
    )


def write_report(runs: list[Run], chosen: str | None, out: Path, command: str,
                 notes: list[str]) -> tuple[list[Row], float | None, Path]:
    """``comparison.png`` and ``comparison.md`` in ``out``, against the baseline (``chosen`` with --baseline,
    else the run whose model has ``muon: null``, else the last); the table's rows and target loss, the plot."""
    baseline = baseline_index(runs, chosen)
    if chosen is not None:
        reason = "chosen with --baseline"
    elif runs[baseline].muon is False:
        reason = "its model has muon: null"
    else:
        reason = "the last run: no run's model has muon: null"
    png = plot_comparison(runs, baseline, out / "comparison.png")
    report = markdown_report(runs, baseline, command, notes, image=png.name, baseline_reason=reason)
    (out / "comparison.md").write_text(report)
    rows, target = summarize(runs, baseline)
    return rows, target, png


class _Console:
    """The terminal: rich's console and table when rich is installed, else plain lines and the markdown table."""

    def __init__(self) -> None:
        try:
            from rich.console import Console
        except ImportError:
            self.rich: Any = None
        else:
            self.rich = Console(width=None if sys.stdout.isatty() else 160)  # the whole table when piped

    def rule(self, title: str) -> None:
        if self.rich is not None:
            self.rich.rule(title)
        else:
            print(f"---- {title} ----", flush=True)

    def print(self, text: str) -> None:
        if self.rich is not None:
            self.rich.print(text, soft_wrap=True, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def table(self, rows: Sequence[Row], target: float | None) -> None:
        if self.rich is not None:
            self.rich.print(rich_table(rows, target))
        else:
            print(markdown_table(rows, target))


def _load(load: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def _versions() -> str:
    import lightning
    import torch

    return f", torch {torch.__version__}, lightning {lightning.__version__}"
