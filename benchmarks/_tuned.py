"""What the tuned studies share (``finetune.py``, ``third_party.py``): config files written from plain data,
``lightning-muon compare`` run as the real command, and its sides read back from the logs.

Every fit runs through ``lightning-muon compare`` (a subprocess of ``lightning-muon fit`` per fit), so the
numbers are the command's own; these helpers only write its configs and read its logs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_muon.commands.compare.aggregate import Outcome, Side, outcomes
from lightning_muon.commands.compare.sweep import edge
from lightning_muon.commands.compare.tuning import load_side

#: Every tuned study's Muon settings beyond its lr: the shipped configs' momentum and weight decay, and fp32
#: Newton-Schulz (``third_party.py``, ``finetune.py``: measured on an AVX2 machine, where bf16 matmuls are emulated
#: and a Muon step of GPT-2's 128-wide matrices took 421 ms in bf16 against 22 ms in fp32, one thread; kept so their
#: tables stay comparable). ``muon_variants.py`` overrides it with the library's default (``ns_dtype=None``).
MUON_ARGS = {"momentum": 0.95, "weight_decay": 0.01, "ns_dtype": "float32"}
ADAMW_ARGS = {"betas": [0.9, 0.95], "weight_decay": 0.0}
#: How many lrs `extend_edges` may add past an end of a side's grid where its best lr sits.
EXTEND = 2


def add_study_options(parser: argparse.ArgumentParser, steps: int, multipliers_help: str) -> None:
    """The options every tuned study of third-party models takes: steps, seeds, the lr sweep, validation batches,
    and how many compare commands (and torch threads a fit) run at a time."""
    parser.add_argument("--steps", type=int, default=steps, help=f"training steps of every fit (default {steps})")
    parser.add_argument("--seeds", type=int, default=2, help="seeds at each side's best lr (default 2)")
    parser.add_argument("--multipliers", default="0.5,1,2", help=multipliers_help)
    parser.add_argument("--val-batches", type=int, default=10, help="validation batches (default 10)")
    parser.add_argument("--jobs", type=int, default=2, help="compare commands at a time (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per fit (default 1)")


def optimizers(muon_lr: float | None, adamw_lr: float, **muon_args: Any) -> dict[str, Any]:
    """A model's ``muon`` and ``adamw`` init args: Muon + AdamW, or AdamW alone where ``muon_lr`` is None."""
    muon = None if muon_lr is None else {
        "class_path": "lightning_muon.Muon", "init_args": {"lr": muon_lr, **MUON_ARGS, **muon_args}}
    return {"muon": muon, "adamw": {"class_path": "torch.optim.AdamW", "init_args": {"lr": adamw_lr, **ADAMW_ARGS}}}


def write_config(path: Path, config: dict[str, Any], comment: str) -> Path:
    """``config`` as a LightningCLI YAML file under a comment line (what it is and who wrote it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = "".join(f"# {line}\n" for line in comment.splitlines())
    path.write_text(head + yaml.safe_dump(config, sort_keys=False))
    return path


def compare(configs: Sequence[Path], out: Path, options: Sequence[str], threads: int | None = None) -> list[str]:
    """Run ``lightning-muon compare CONFIGS OPTIONS --out OUT`` (its output in ``OUT/compare.out``, every fit
    with ``OMP_NUM_THREADS=threads`` when given); an error if it fails. Returns the command line, as a user
    would type it (config paths relative to the working directory where they are inside it)."""
    out.mkdir(parents=True, exist_ok=True)
    shown = [relative(c) for c in configs]
    argv = ["compare", *map(str, configs), *options, "--out", str(out)]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    started = time.perf_counter()
    with open(out / "compare.out", "w") as log:
        code = subprocess.run([sys.executable, "-m", "lightning_muon", *argv], stdout=log, stderr=subprocess.STDOUT,
                              env=env).returncode
    if code:
        raise RuntimeError(f"lightning-muon compare failed (exit {code}): see {out / 'compare.out'}")
    before = seconds(out) if (out / "seconds").is_file() else 0.0
    (out / "seconds").write_text(f"{before + time.perf_counter() - started:.1f}\n")
    return ["lightning-muon", "compare", *shown, *options, "--out", relative(out)]


def relative(path: Path) -> str:
    """``path`` relative to the working directory where it is inside it, else as it is."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)



def read_sides(out: Path, names: Sequence[str]) -> list[Side]:
    """The sides ``compare`` fitted into ``OUT/lightning_logs/<name>``, read back from their logs."""
    return [load_side(out / "lightning_logs" / name, name) for name in names]


def tuned(out: Path, names: Sequence[str], baseline: str) -> tuple[float, list[Outcome], list[Side]]:
    """The target (the baseline's mean final val loss at its best lr) and each side's outcome and runs."""
    sides = read_sides(out, names)
    target, results = outcomes(sides, baseline=list(names).index(baseline))
    return target, results, sides


def seconds(out: Path) -> float:
    """How long the ``compare`` commands into ``out`` took, all together (written by `compare`)."""
    return float((out / "seconds").read_text())


def extend_edges(configs: Sequence[Path], out: Path, seeds: int, common: Sequence[str], threads: int | None,
                 label: str = "") -> int:
    """Where a side's best lr is at an end of its grid, fit the next lr past it (x2 or x1/2), up to `EXTEND`
    times, through ``compare --lrs SIDE=LR`` into the same logs; when one becomes the best, its other seeds too.
    Returns how many lrs were added."""
    added = 0
    for config in configs:
        for _ in range(EXTEND):
            (side,) = read_sides(out, [config.stem])
            at = edge(side.best, side.grid)
            if at is None:
                break
            lr = side.best * (2 if at == "highest" else 0.5)
            print(f"  {label or out.name}: {config.stem}'s best lr {side.best:g} is the {at} of its grid: "
                  f"fitting lr {lr:g}", flush=True)
            compare([config], out, ["--lrs", f"{config.stem}={lr:g}", "--seeds", "1", *common], threads)
            added += 1
            (side,) = read_sides(out, [config.stem])
            if side.best == lr and seeds > 1:  # the new best: its other seeds (seed 0 is fitted again, the same)
                compare([config], out, ["--lrs", f"{config.stem}={lr:g}", "--seeds", str(seeds), *common], threads)
    return added


def produced_by(script: str, argv: Sequence[str] | None, commands: Mapping[str, Sequence[str]]) -> list[str]:
    """A report's closing command block: ``python benchmarks/<script>.py`` with its arguments (``argv``, or the
    process's), then each compare command it ran, one ``# label: command`` line each."""
    return ["```bash", shlex.join(["python", f"benchmarks/{script}.py", *(sys.argv[1:] if argv is None else argv)]),
            *[f"# {label}: {shlex.join(command)}" for label, command in commands.items()], "```"]


def publish(out: Path, name: str, directories: Sequence[str], report: str, write: bool) -> None:
    """Print a study's ``report`` and write it as ``out/<name>.md``; with ``write``, keep it in
    ``benchmarks/results`` (`keep`)."""
    print(report, flush=True)
    (out / f"{name}.md").write_text(report + "\n")
    if write:
        keep(out, name, directories, report)


def keep(out: Path, name: str, directories: Sequence[str], report: str) -> None:
    """Keep a study in ``benchmarks/results``: each of its compare ``directories``' ``comparison.md`` and plot in
    ``results/<name>/<directory>/``, its configs in ``results/<name>/configs/``, and ``report`` as
    ``results/<name>.md`` and its section of ``RESULTS.md``."""
    import _report

    kept = _report.RESULTS / name
    for directory in directories:
        (kept / directory).mkdir(parents=True, exist_ok=True)
        for file in ("comparison.md", "comparison.png"):
            shutil.copy(out / directory / file, kept / directory / file)
    shutil.copytree(out / "configs", kept / "configs", dirs_exist_ok=True)
    _report.write_markdown(name, report + "\n")
    print(f"Wrote {_report.RESULTS / f'{name}.md'} and its section of {_report.RESULTS_MD}")


def markdown_table(header: Sequence[str], groups: Sequence[Sequence[Sequence[str]]]) -> str:
    """A markdown table: ``header``, then the rows of every group in order."""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(row) + " |" for rows in groups for row in rows])


def run_line(threads: int, jobs: int, load_before: Sequence[float], elapsed: float, shared: str = "") -> str:
    """A study report's machine line: the machine and torch threads a fit, the compare commands at a time, the load
    average before and now (``shared``: a note after it), the date and how long the whole run took."""
    import datetime

    import _common

    load = " ".join(f"{x:.2f}" for x in load_before), " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"Machine: {_common.machine(threads)} a fit, {jobs} compare commands at a time; load average {load[0]} "
            f"before, {load[1]} after{shared}; {datetime.date.today()}. The whole run took {elapsed / 60:.1f} min.")
