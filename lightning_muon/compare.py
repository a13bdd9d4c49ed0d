"""``lightning-muon compare``: fit several configs and compare their validation loss by step and by wall-clock time.

    lightning-muon compare configs/gpt_muon.yaml configs/gpt_adamw.yaml --out benchmarks/results/compare
    lightning-muon compare --from-logs OUT/lightning_logs/gpt_muon OUT/lightning_logs/gpt_adamw   # no training

Each config is fitted by the real command (``python -m lightning_muon fit
--config CONFIG ...``, one subprocess per config, so DDP configs work as they
do on their own), with:

- a CSVLogger writing to ``OUT/lightning_logs/<config name>/`` (emptied first);
- the `lightning_muon.clock.WallClock` callback added to the config's own
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
import csv
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from lightning_muon.cli import config_chain

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
    "merged_config",
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

#: The callback ``compare`` adds to every fit.
CLOCK = "lightning_muon.clock.WallClock"
VAL_LOSS, VAL_BPB = "val_loss", "val_bpb"
ELAPSED, TRAIN_TIME, SAMPLES, TOKENS = "time/elapsed_s", "time/train_s", "time/samples", "time/tokens"
_VERSION_DIR = re.compile(r"^version_(\d+)$")


# ----------------------------------------------------------------------------------------------- reading logs


def read_metrics(path: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Every metric of a CSVLogger ``metrics.csv`` as ``(logger step, value)`` pairs, in the order logged.

    Empty cells (a row holds only the metrics logged together) are skipped.
    """
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            step = row.get("step")
            if step in (None, ""):
                continue
            for key, value in row.items():
                if key in ("step", "epoch") or value in (None, ""):
                    continue
                series.setdefault(key, []).append((int(float(step)), float(value)))
    return series


@dataclass(frozen=True)
class Run:
    """One run's validation curve and clock, as read from its logs.

    Steps are optimizer updates done (the logger's 0-based step + 1), so a
    validation after the 100th update is at step 100.

    Attributes:
        name: label in the table and the legend.
        val_steps: the step of every validation.
        val_loss: the validation loss at each of them.
        val_bpb: bits per byte at each of them (``None`` where not logged).
        val_time_s: training seconds (validation excluded) at each of them;
            ``None`` when the run was not timed by `WallClock`.
        train_s: training seconds at the end (validation excluded).
        elapsed_s: seconds from the start of training to its end, validation included.
        samples: training samples seen, over all ranks.
        tokens: training tokens seen, over all ranks (``None`` when batches are not token ids).
        muon: from the saved config: ``False`` when the model has ``muon: null``
            (the AdamW baseline), ``True`` when it has a Muon factory, ``None`` when unknown.
        source: the log directory.
    """

    name: str
    val_steps: tuple[int, ...]
    val_loss: tuple[float, ...]
    val_bpb: tuple[float | None, ...] = ()
    val_time_s: tuple[float, ...] | None = None
    train_s: float | None = None
    elapsed_s: float | None = None
    samples: float | None = None
    tokens: float | None = None
    muon: bool | None = None
    source: str | None = None


def find_metrics(log_dir: str | os.PathLike) -> Path:
    """``log_dir/metrics.csv``, or that of the newest ``version_N`` directory under ``log_dir``."""
    log_dir = Path(log_dir)
    if (log_dir / "metrics.csv").is_file():
        return log_dir / "metrics.csv"
    versions = sorted(
        (int(m.group(1)), d) for d in log_dir.glob("version_*") if (m := _VERSION_DIR.match(d.name)) and d.is_dir()
    )
    for _, version in reversed(versions):
        if (version / "metrics.csv").is_file():
            return version / "metrics.csv"
    raise FileNotFoundError(
        f"no metrics.csv in {str(log_dir)!r} (nor in a version_N directory under it): give the directory a "
        "CSVLogger wrote, e.g. lightning_logs/gpt_muon/version_0"
    )


def _run_name(metrics_dir: Path) -> str:
    return metrics_dir.parent.name if _VERSION_DIR.match(metrics_dir.name) else metrics_dir.name


def uses_muon(config: dict[str, Any]) -> bool | None:
    """From a LightningCLI config: ``False`` for ``model.init_args.muon: null``, ``True`` for a factory, else None."""
    init_args = ((config or {}).get("model") or {}).get("init_args") or {}
    if "muon" not in init_args:
        return None
    return init_args["muon"] is not None


def _last(series: list[tuple[int, float]] | None) -> float | None:
    return series[-1][1] if series else None


def load_run(log_dir: str | os.PathLike, name: str | None = None) -> Run:
    """Read a run from the directory a CSVLogger wrote (see `find_metrics`) and the ``config.yaml`` next to it."""
    path = find_metrics(log_dir)
    series = read_metrics(path)
    val = series.get(VAL_LOSS, [])
    bpb = dict(series.get(VAL_BPB, []))
    val_time = None
    clock = series.get(TRAIN_TIME)
    if clock and val:
        by_step = dict(clock)  # the last value logged at each step
        steps = sorted(by_step)
        val_time = tuple(float(t) for t in np.interp([s for s, _ in val], steps, [by_step[s] for s in steps]))
    muon = None
    config = path.parent / "config.yaml"
    if config.is_file():
        muon = uses_muon(yaml.safe_load(config.read_text()))
    return Run(
        name=name or _run_name(path.parent),
        val_steps=tuple(s + 1 for s, _ in val),
        val_loss=tuple(v for _, v in val),
        val_bpb=tuple(bpb.get(s) for s, _ in val),
        val_time_s=val_time,
        train_s=_last(clock),
        elapsed_s=_last(series.get(ELAPSED)),
        samples=_last(series.get(SAMPLES)),
        tokens=_last(series.get(TOKENS)),
        muon=muon,
        source=str(path.parent),
    )


# ------------------------------------------------------------------------------------------------- the table


def steps_to_reach(steps: Sequence[int], losses: Sequence[float], target: float) -> int | None:
    """The first step whose loss is at or below ``target``; ``None`` if none is."""
    for step, loss in zip(steps, losses):
        if loss <= target:
            return step
    return None


def baseline_index(runs: Sequence[Run], name: str | None = None) -> int:
    """The baseline: the run called ``name``; else the (last) run with ``muon: null``; else the last run."""
    if name is not None:
        names = [r.name for r in runs]
        if name not in names:
            raise ValueError(f"--baseline {name!r} is none of the runs: {', '.join(names)}")
        return names.index(name)
    adamw = [i for i, r in enumerate(runs) if r.muon is False]
    return adamw[-1] if adamw else len(runs) - 1


@dataclass(frozen=True)
class Row:
    """One line of the comparison table (``None``: not known; ``steps_to_target`` None: not reached)."""

    run: str
    baseline: bool
    steps: int | None
    final_val_loss: float | None
    final_val_bpb: float | None
    steps_to_target: int | None
    time_to_target_s: float | None
    train_s: float | None
    elapsed_s: float | None
    throughput: float | None
    throughput_unit: str


def summarize(runs: Sequence[Run], baseline: int) -> tuple[list[Row], float | None]:
    """The table's rows, and the target: the baseline's final validation loss."""
    target = runs[baseline].val_loss[-1] if runs[baseline].val_loss else None
    rows = []
    for i, run in enumerate(runs):
        reached = None if target is None else steps_to_reach(run.val_steps, run.val_loss, target)
        time_to = None
        if reached is not None and run.val_time_s is not None:
            time_to = run.val_time_s[run.val_steps.index(reached)]
        count, unit = (run.tokens, "tokens/s") if run.tokens is not None else (run.samples, "samples/s")
        throughput = count / run.train_s if count is not None and run.train_s else None
        rows.append(
            Row(
                run=run.name,
                baseline=i == baseline,
                steps=run.val_steps[-1] if run.val_steps else None,
                final_val_loss=run.val_loss[-1] if run.val_loss else None,
                final_val_bpb=run.val_bpb[-1] if run.val_bpb else None,
                steps_to_target=reached,
                time_to_target_s=time_to,
                train_s=run.train_s,
                elapsed_s=run.elapsed_s,
                throughput=throughput,
                throughput_unit=unit,
            )
        )
    return rows, target


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def table_cells(rows: Sequence[Row], target: float | None) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the table, as text (shared by the markdown file and the terminal)."""
    goal = _fmt(target, ".4f")
    header = [
        "run", "steps", "final val loss", "final val bpb", f"steps to {goal}", f"train time to {goal} (s)",
        "train time (s)", "wall time (s)", "tokens/s",
    ]
    cells = []
    for row in rows:
        if row.throughput is None:
            throughput = "n/a"
        else:
            throughput = f"{row.throughput:,.0f}" + ("" if row.throughput_unit == "tokens/s" else " samples/s")
        cells.append([
            row.run + (" (baseline)" if row.baseline else ""),
            _fmt(row.steps, "d"),
            _fmt(row.final_val_loss, ".4f"),
            _fmt(row.final_val_bpb, ".4f"),
            "n/a" if target is None else "not reached" if row.steps_to_target is None else str(row.steps_to_target),
            "n/a" if row.steps_to_target is None else _fmt(row.time_to_target_s, ".1f"),
            _fmt(row.train_s, ".1f"),
            _fmt(row.elapsed_s, ".1f"),
            throughput,
        ])
    return header, cells


def markdown_table(rows: Sequence[Row], target: float | None) -> str:
    """The table in GitHub markdown, numbers right-aligned."""
    header, cells = table_cells(rows, target)
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in cells]
    return "\n".join(lines)


def markdown_report(
    runs: Sequence[Run],
    baseline: int,
    command: str,
    notes: Sequence[str] = (),
    image: str | None = "comparison.png",
    baseline_reason: str | None = None,
) -> str:
    """``comparison.md``: the table, what its columns mean, the notes (machine, fits), the command line."""
    rows, target = summarize(runs, baseline)
    base = runs[baseline]
    why = baseline_reason or ("its model has muon: null" if base.muon is False else "the last run")
    parts = [
        f"# Validation loss: {' vs '.join(r.name for r in runs)}",
        "",
        markdown_table(rows, target),
        "",
        f"Baseline: **{base.name}** ({why}); its final validation loss"
        + (f" {target:.4f} is the target of the \"steps to\" column: the first validation at or below it"
           " (\"not reached\": none)." if target is not None else " is unknown (it logged no val_loss)."),
        "Steps are optimizer updates. Train time is the wall-clock time of training with validation left out "
        "(`time/train_s` of `lightning_muon.clock.WallClock`); wall time is from the start of training to its "
        "end, validation included. tokens/s is the tokens seen (all ranks) over the train time.",
    ]
    if notes:
        parts += ["", *[f"- {n}" for n in notes]]
    if image:
        parts += ["", f"![validation loss by step and by training time]({image})"]
    parts += ["", "Produced by:", "", "```bash", command, "```", ""]
    return "\n".join(parts)


def rich_table(rows: Sequence[Row], target: float | None) -> Table:
    """The table for the terminal."""
    header, cells = table_cells(rows, target)
    table = Table(title="lightning-muon compare")
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right")
    for line in cells:
        table.add_row(*line)
    return table


# --------------------------------------------------------------------------------------------------- the plot


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


# ---------------------------------------------------------------------------------------------- running fits


def merged_config(path: str | os.PathLike) -> dict[str, Any]:
    """A config merged with the files it ``# extends:``, key by key (later files win), as plain YAML data."""

    def merge(base: dict, top: dict) -> dict:
        out = dict(base)
        for key, value in top.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    merged: dict[str, Any] = {}
    for file in config_chain(path):
        merged = merge(merged, yaml.safe_load(Path(file).read_text()) or {})
    return merged


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
    text = "\n".join(Path(f).read_text() for f in config_chain(config) if Path(f).is_file())
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
    if _given(overrides, "trainer.enable_checkpointing") is None and "ModelCheckpoint" not in text:
        args += ["--trainer.enable_checkpointing", "false"]
    if "WallClock" not in text and not any("WallClock" in a for a in overrides):
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
        epilog="example: lightning-muon compare configs/gpt_muon.yaml configs/gpt_adamw.yaml --out results/compare",
    )
    parser.add_argument("configs", nargs="*", metavar="CONFIG", help="LightningCLI config files to fit")
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
    parser = _parser()
    args = parser.parse_args(own)
    if not args.configs and not args.from_logs:
        parser.error("give at least one CONFIG to fit, or --from-logs DIR")
    if args.val_points < 1 or (args.max_steps is not None and args.max_steps < 1):
        parser.error("--val_points and --max_steps must be >= 1")
    console = Console(width=None if sys.stdout.isatty() else 160)  # the whole table when piped
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_root = out / "lightning_logs"  # a name .gitignore files usually ignore
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None

    runs: list[Run] = []
    fit_lines: list[str] = []
    for config, name in zip(args.configs, _unique_names(args.configs)):
        fit_args = fit_arguments(config, log_root, name, overrides, args.max_steps, args.val_points)
        fit_lines.append(f"{name}: `{shlex.join(['lightning-muon', 'fit', *fit_args])}`")
        shutil.rmtree(log_root / name, ignore_errors=True)
        command = [sys.executable, "-m", "lightning_muon", "fit", *fit_args]
        console.rule(f"compare: fitting {name}")
        console.print(shlex.join(["lightning-muon", "fit", *fit_args]), soft_wrap=True, markup=False)
        result = subprocess.run(command)
        if result.returncode != 0:
            raise SystemExit(
                f"lightning-muon compare: the fit of {config} failed (exit code {result.returncode}); "
                f"run it alone to see why: {shlex.join(['lightning-muon', 'fit', *fit_args])}"
            )
        runs.append(load_run(log_root / name, name))
    for log_dir in args.from_logs:
        runs.append(load_run(log_dir))
    names = [r.name for r in runs]
    for i, run in enumerate(runs):
        if names.count(run.name) > 1:
            runs[i] = replace(run, name=f"{run.name}-{names[: i + 1].count(run.name)}")
    for run in runs:
        if not run.val_loss:
            console.print(f"[yellow]compare: {run.name} logged no {VAL_LOSS} ({run.source})[/yellow]")

    baseline = baseline_index(runs, args.baseline)
    if args.baseline is not None:
        reason = "chosen with --baseline"
    elif runs[baseline].muon is False:
        reason = "its model has muon: null"
    else:
        reason = "the last run: no run's model has muon: null"
    notes = [
        f"Machine: {os.cpu_count()} CPU cores, {platform.platform(terse=True)}, Python {platform.python_version()}"
        + _versions()
        + (f"; load average (1/5/15 min) {_load(load_before)} before, {_load(os.getloadavg())} after"
           if load_before else "")
        + ". Times are noisy when other work shares the machine.",
    ]
    notes += [f"Fitted {line}" for line in fit_lines]
    for run in runs[len(args.configs):]:
        notes.append(f"{run.name}: read from {run.source}.")
    png = plot_comparison(runs, baseline, out / "comparison.png")
    command = shlex.join(["lightning-muon", "compare", *argv])
    report = markdown_report(runs, baseline, command, notes, image=png.name, baseline_reason=reason)
    (out / "comparison.md").write_text(report)
    rows, target = summarize(runs, baseline)
    console.print(rich_table(rows, target))
    console.print(f"Wrote {png} and {out / 'comparison.md'}")
    return rows


def _load(load: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def _versions() -> str:
    import lightning
    import torch

    return f", torch {torch.__version__}, lightning {lightning.__version__}"
