"""Running a tuned comparison: each side's lr sweep at seed 0, then more seeds at its best lr, with a progress
line per fit and an estimate of the time left; and the same sides read back from their logs (``--from-logs``).

The fitting itself is a function handed in (`tune` takes ``fit(spec, lr, seed) -> Run``), so the order of the
fits and the choice of the best lr are tested without training; `subprocess_fit` is the real one.
"""

from __future__ import annotations

import os
import shlex
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lightning_muon.commands.compare.aggregate import Side
from lightning_muon.commands.compare.fit import fit_arguments, fit_in_subprocess
from lightning_muon.commands.compare.runs import Run, find_metrics, load_run
from lightning_muon.commands.compare.sweep import SweptLr, swept_lr
from lightning_muon.commands.config_files import merged_config


@dataclass(frozen=True)
class SideSpec:
    """What to fit for one side: its config, the lr it sweeps, the lrs of its grid, and whether its data module
    takes a ``seed`` (then each seed sets it too, so seeds differ in their training batches as well)."""

    name: str
    config: str
    swept: SweptLr
    grid: tuple[float, ...]
    data_seed: bool = False


def side_spec(name: str, config: str, overrides: Sequence[str], grid: Callable[[SweptLr], list[float]]) -> SideSpec:
    """The spec of ``config`` (read with the overrides every fit gets); ``grid`` turns its swept lr into lrs."""
    merged = merged_config(config)
    swept = swept_lr(merged, overrides)
    data_args = ((merged.get("data") or {}).get("init_args") or {}) if isinstance(merged.get("data"), dict) else {}
    return SideSpec(name, config, swept, tuple(grid(swept)), "seed" in data_args)


def run_name(lr: float, seed: int) -> str:
    """The log directory of one fit of a side: ``lr0.02_seed0``."""
    return f"lr{lr:g}_seed{seed}"


def seed_arguments(spec: SideSpec, lr: float, seed: int) -> list[str]:
    """The overrides that set one fit's lr and seed."""
    args = [f"--{spec.swept.key}", repr(lr), "--seed_everything", str(seed)]
    return args + (["--data.init_args.seed", str(seed)] if spec.data_seed else [])


def fit_count(specs: Sequence[SideSpec], seeds: int) -> int:
    """How many fits `tune` makes: every lr of every grid, then ``seeds - 1`` more per side."""
    return sum(len(spec.grid) for spec in specs) + len(specs) * (seeds - 1)


class Progress:
    """One line per fit: its count, what it was, its result and time, and the time left at the mean time a fit."""

    def __init__(self, total: int, say: Callable[[str], None], clock: Callable[[], float] = time.perf_counter):
        self.total, self.say, self.clock = total, say, clock
        self.done = 0
        self.started = clock()

    def __call__(self, spec: SideSpec, lr: float, seed: int, run: Run, seconds: float) -> str:
        self.done += 1
        mean = (self.clock() - self.started) / self.done
        left = self.total - self.done
        loss = f"{run.val_loss[-1]:.4f}" if run.val_loss else "none logged"
        train = "" if run.train_s is None else f", train {run.train_s:.1f} s"
        line = (f"[{self.done}/{self.total}] {spec.name} {spec.swept.optimizer} lr {lr:g} seed {seed}: final val "
                f"loss {loss}{train}, fit {seconds:.0f} s"
                + (f"; about {_minutes(left * mean)} left, {_minutes(self.total * mean)} in all" if left else ""))
        self.say(line)
        return line


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def tune(specs: Sequence[SideSpec], seeds: int, fit: Callable[[SideSpec, float, int], Run],
         progress: Callable[[SideSpec, float, int, Run, float], Any] | None = None) -> list[Side]:
    """Fit every side's grid at seed 0, pick each side's best lr (lowest final val loss), then fit seeds
    ``1..seeds-1`` there. ``fit(spec, lr, seed)`` makes one run; ``progress`` hears of each."""

    def timed(spec: SideSpec, lr: float, seed: int) -> Run:
        start = time.perf_counter()
        run = fit(spec, lr, seed)
        if progress is not None:
            progress(spec, lr, seed, run, time.perf_counter() - start)
        return run

    sides = [Side(spec.name, spec.swept) for spec in specs]
    for spec, side in zip(specs, sides, strict=True):
        for lr in spec.grid:
            side.sweep[lr] = timed(spec, lr, 0)
        side.seeds = [side.sweep[side.best]]
    for spec, side in zip(specs, sides, strict=True):
        side.seeds += [timed(spec, side.best, seed) for seed in range(1, seeds)]
    return sides


def subprocess_fit(log_root: Path, overrides: Sequence[str], max_steps: int | None, val_points: int,
                   env: Mapping[str, str] | None = None, target: float | None = None,
                   resolution: float = 0.02) -> Callable[[SideSpec, float, int], Run]:
    """The real ``fit`` of `tune`: ``lightning-muon fit`` in a subprocess, its logs in
    ``log_root/<side>/lr<lr>_seed<seed>/`` and its output in the ``.out`` file beside them; with a ``target``,
    validating densely near it (`lightning_muon.commands.compare.fit.fit_arguments`)."""

    def fit(spec: SideSpec, lr: float, seed: int) -> Run:
        name = run_name(lr, seed)
        args = fit_arguments(spec.config, log_root / spec.name, name, [*overrides, *seed_arguments(spec, lr, seed)],
                             max_steps, val_points, target, resolution)
        shutil.rmtree(log_root / spec.name / name, ignore_errors=True)
        output = log_root / spec.name / f"{name}.out"
        returncode = fit_in_subprocess(args, output, env)
        if returncode != 0:
            raise SystemExit(
                f"lightning-muon compare: the fit of {spec.config} at lr {lr:g}, seed {seed} failed (exit code "
                f"{returncode}); its output is in {output}; the command: "
                + shlex.join(["lightning-muon", "fit", *args])
            )
        return load_run(log_root / spec.name / name, f"{spec.name} lr {lr:g} seed {seed}")

    return fit


# ------------------------------------------------------------------------------------------------ from the logs


def is_side_directory(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds several runs of one side (as ``compare --sweep`` writes) rather than one run."""
    try:
        find_metrics(directory)
    except FileNotFoundError:
        return any(_run_directories(Path(directory)))
    return False


def _run_directories(directory: Path) -> list[Path]:
    return sorted(d for d in directory.iterdir() if d.is_dir() and (d / "metrics.csv").is_file()) \
        if directory.is_dir() else []


def _saved_config(run: Run) -> dict[str, Any]:
    path = Path(run.source or ".") / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{run.source}: no config.yaml beside metrics.csv, so its lr and seed are unknown: give "
                         "directories a LightningCLI fit wrote (lightning-muon fit, or compare)")
    return yaml.safe_load(path.read_text()) or {}


def load_side(directory: str | os.PathLike, name: str | None = None) -> Side:
    """A side read back from its logs: one run's directory, or a directory of runs (``compare --sweep``'s
    ``OUT/lightning_logs/<side>``). Each run's lr and seed come from the ``config.yaml`` LightningCLI saved with
    it; the sweep is the runs at the lowest seed, the seeds the runs at the best lr."""
    directory = Path(directory)
    name = name or directory.name
    dirs = _run_directories(directory) if is_side_directory(directory) else [directory]
    runs: dict[tuple[float, int], Run] = {}
    swept = None
    for run_dir in dirs:
        run = load_run(run_dir, f"{name} {run_dir.name}")
        config = _saved_config(run)
        swept = swept_lr(config)
        seed = config.get("seed_everything")
        if swept.lr is None:
            raise ValueError(f"{run_dir}: its config.yaml has no {swept.key}, so the lr it ran at is unknown")
        key = (swept.lr, int(seed) if isinstance(seed, (int, float)) else 0)
        if key in runs:
            raise ValueError(f"{directory}: two runs at lr {key[0]:g}, seed {key[1]}: {runs[key].source} and {run_dir}")
        runs[key] = run
    assert swept is not None
    first = min(seed for _, seed in runs)
    side = Side(name, swept, sweep={lr: run for (lr, seed), run in runs.items() if seed == first})
    side.seeds = [run for (lr, _), run in sorted(runs.items(), key=lambda kv: kv[0][1]) if lr == side.best]
    return side
