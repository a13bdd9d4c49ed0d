"""Reading a run back from the logs a CSVLogger (and `lightning_muon.WallClock`) wrote."""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

VAL_LOSS, VAL_BPB = "val_loss", "val_bpb"
ELAPSED, TRAIN_TIME, SAMPLES, TOKENS = "time/elapsed_s", "time/train_s", "time/samples", "time/tokens"
_VERSION_DIR = re.compile(r"^version_(\d+)$")


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
