"""Quality: Muon + AdamW against AdamW alone, each at its own best learning rate, over seeds.

Two examples, both through the real configs:

- ``char_gpt`` (the shipped ``gpt_muon.yaml`` / ``gpt_adamw.yaml``, the default
  4-layer width-128 byte-level GPT): a learning-rate sweep of each side at seed 0
  (AdamW-only: the AdamW lr; Muon + AdamW: the Muon lr, AdamW's lr on the
  embeddings, norms and head left at the config's), then more seeds at each side's
  best lr, all for the same number of steps: the machinery of ``lightning-muon
  compare --sweep --seeds N`` (`lightning_muon.commands.compare.tuning.tune`: every fit a
  subprocess of ``lightning-muon fit --config ... --seed_everything N
  --data.init_args.seed N ...`` with `lightning_muon.WallClock`), with this
  benchmark's explicit lr grids, and its tables (`sweep_table`, `seeds_table`) and
  plot (`plot_tuned`). Reported: final val loss (mean, std, min-max over seeds), the
  step and the train time at which the Muon side's mean curve first reaches the
  AdamW side's mean final val loss, and tokens/s, against the issue's targets.
- ``digits_cnn`` (``cnn_muon.yaml``, its 5 epochs): test accuracy of Muon +
  AdamW against AdamW alone (a small AdamW lr sweep, best by mean accuracy) at
  equal epochs over seeds, fitted and tested in process through `MuonCLI`.

Prints the report; writes files only when asked: ``--write`` writes
``benchmarks/results/quality[_quick].md`` and ``.png`` and the matching section of
``benchmarks/RESULTS.md``; ``--out DIR`` writes the ``.md`` and ``.png`` to ``DIR`` instead (a trial run).

    python benchmarks/quality.py --quick             # under 10 minutes on 2 CPU cores, printed only
    python benchmarks/quality.py --write             # the full sweep (about 4x the steps and runs), recorded
    python benchmarks/quality.py --steps 30 --seeds 1 --no-cnn --out /tmp/q   # a small trial
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
from rich.console import Console

from lightning_muon.commands.compare.aggregate import (
    Side,
    edge_notes,
    outcomes,
    resolution_note,
    seeds_table,
    spread,
    sweep_table,
)
from lightning_muon.commands.compare.plot import plot_tuned
from lightning_muon.commands.compare.tuning import Progress, fit_count, side_spec, subprocess_fit, tune

import _common
import _report

ROOT = _common.ROOT
RESULTS = ROOT / "benchmarks" / "results"
GPT_MUON, GPT_ADAMW, CNN = "gpt_muon.yaml", "gpt_adamw.yaml", "cnn_muon.yaml"  # the shipped configs, by name
ADAMW_LR = "--model.init_args.adamw.init_args.lr"

#: Settings of each mode: steps per GPT run, lrs swept per side, seeds at the best lr, CNN lrs and seeds.
MODES = {
    "quick": dict(steps=150, val_points=10, val_batches=10, muon_lrs=[0.02, 0.04],
                  adamw_lrs=[0.0004, 0.00075, 0.0015], seeds=2,
                  cnn_adamw_lrs=[0.003, 0.01, 0.03], cnn_seeds=3),
    "full": dict(steps=300, val_points=12, val_batches=20, muon_lrs=[0.01, 0.02, 0.04, 0.08],
                 adamw_lrs=[0.0002, 0.0004, 0.00075, 0.0015, 0.003], seeds=3,
                 cnn_adamw_lrs=[0.003, 0.01, 0.03], cnn_seeds=3),
}
#: The issue's targets: Muon reaches the tuned AdamW's final val loss within these fractions of its steps and time.
TARGET_STEPS, TARGET_TIME = 0.5, 0.6
#: torch threads of every fit (``--threads``); None: torch's default (one per core).
THREADS: int | None = None


# ------------------------------------------------------------------------------------------------- char_gpt


def gpt_sides(console: Console, lrs: dict[str, list[float]], seeds: int, steps: int, val_points: int,
              val_batches: int, log_root: Path) -> list[Side]:
    """Both sides (AdamW-only, then Muon + AdamW) swept and seeded by
    `lightning_muon.commands.compare.tuning.tune`, each fit a subprocess with its output in a file beside its logs."""
    overrides = ["--trainer.limit_val_batches", str(val_batches), "--trainer.enable_progress_bar", "false"]
    specs = [side_spec(name, config, overrides, lambda _swept, name=name: lrs[name])
             for name, config in (("adamw", GPT_ADAMW), ("muon", GPT_MUON))]
    env = dict(os.environ)
    if THREADS is not None:
        env["OMP_NUM_THREADS"] = str(THREADS)
    fit = subprocess_fit(log_root, overrides, steps, val_points, env)
    total = fit_count(specs, seeds)
    console.rule(f"quality: char_gpt, {steps} steps a run, {total} runs (output in {log_root}/<side>/<run>.out)")
    return tune(specs, seeds, fit, Progress(total, lambda line: console.print(line, highlight=False)))


def gpt_tables(sides: list[Side], steps: int) -> tuple[str, list[str], dict]:
    """The sweep table, the seeds table and the verdict lines against the issue's targets, and the numbers.
    ``sides``: AdamW-only (the baseline) first, then Muon + AdamW."""
    target, (a, m) = outcomes(sides, baseline=0)
    ok_steps = m.steps_to is not None and m.steps_to / a.last_step <= TARGET_STEPS
    ok_time = m.time_to is not None and a.last_time is not None and m.time_to / a.last_time <= TARGET_TIME
    verdict = [
        f"Target ({steps} steps): Muon + AdamW reaches the tuned AdamW's final val loss ({target:.4f}, mean of "
        f"{len(a.curve.final)} seeds) in <= {TARGET_STEPS}x its steps: "
        + ("**met**" if ok_steps else "**missed**")
        + ("" if m.steps_to is None else f" ({m.steps_to} of {a.last_step} steps = {m.steps_to / a.last_step:.2f}x; "
           "per seed: " + ", ".join("not reached" if s is None else str(s) for s in m.per_seed_steps_to) + ")")
        + f"; in <= {TARGET_TIME}x its train time: " + ("**met**" if ok_time else "**missed**")
        + ("" if m.time_to is None or a.last_time is None
           else f" ({m.time_to:.1f} of {a.last_time:.1f} s = {m.time_to / a.last_time:.2f}x)") + ".",
        resolution_note([a, m]),
    ]
    numbers = dict(target=target, reached=m.steps_to, m_time=m.time_to, a_time=a.last_time, a_steps=a.last_step,
                   muon_final=m.curve.final, adamw_final=a.curve.final)
    return sweep_table(sides), [seeds_table(target, [a, m]), *verdict], numbers


# ------------------------------------------------------------------------------------------------ digits_cnn


def cnn_test_accuracy(seed: int, adamw_lr: float | None, log_dir: Path) -> float:
    """Fit ``cnn_muon.yaml`` (AdamW-only at ``adamw_lr`` when given) and test it, in process."""
    import lightning as L  # noqa: F401  (imported before the CLI, as the command does)

    from lightning_muon.commands.config_files import resolve_config
    from lightning_muon.commands.lightning_cli import MuonCLI

    args = ["--config", str(resolve_config(CNN)), "--seed_everything", str(seed), "--data.init_args.seed", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false",
            "--trainer.logger.init_args.save_dir", str(log_dir)]
    if adamw_lr is not None:
        args += ["--model.init_args.muon", "null", ADAMW_LR, f"{adamw_lr:g}"]
    with _silenced():
        cli = MuonCLI(args=args, run=False)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        (result,) = cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)
    return float(result["test_acc"])


@contextmanager
def _silenced():
    """stdout and stderr to /dev/null, at the file-descriptor level (the fits' tables and tips included)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(os.devnull, "w") as null, redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            os.dup2(null.fileno(), 1)
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def cnn_benchmark(console: Console, adamw_lrs: Sequence[float], seeds: int) -> tuple[str, list[str]]:
    """Muon (the config) against AdamW alone at each lr, ``seeds`` seeds each: the table and a verdict."""
    results: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, lr in [("muon (config: Muon 0.02, AdamW 3e-4 on stem, norms, classifier)", None),
                          *((f"adamw lr {lr:g} (all params)", lr) for lr in adamw_lrs)]:
            accs = []
            for seed in range(seeds):
                start = time.perf_counter()
                accs.append(cnn_test_accuracy(seed, lr, Path(tmp)))
                console.print(f"[cnn] {label.split(' (')[0]:14s} seed {seed}: test acc {accs[-1]:.4f} "
                              f"({time.perf_counter() - start:.0f} s)", highlight=False)
            results[label] = np.array(accs)
    best_adamw = max((k for k in results if k.startswith("adamw")), key=lambda k: results[k].mean())
    lines = ["| run | seeds | test accuracy (mean ± std, min–max) | per seed |", "|---|---:|---:|---|"]
    for label, accs in results.items():
        mark = " **best AdamW**" if label == best_adamw else ""
        lines.append(f"| {label}{mark} | {len(accs)} | {spread(accs)} | {', '.join(f'{a:.4f}' for a in accs)} |")
    muon = next(v for k, v in results.items() if k.startswith("muon"))
    ok = muon.mean() >= results[best_adamw].mean()
    verdict = ("Target (5 epochs): Muon's test accuracy at least the best AdamW's: "
               f"{'**met**' if ok else '**missed**'} "
               f"({muon.mean():.4f} against {results[best_adamw].mean():.4f}, means over {seeds} seeds). The best "
               "AdamW lr is chosen on these same test numbers, which favours the baseline. The test set is the "
               "data module's held-out 20% (its validation split, seed 0).")
    return "\n".join(lines), [verdict]


# -------------------------------------------------------------------------------------------------- reporting


def machine_line(load_before: tuple[float, float, float] | None) -> str:
    """`_common.machine` (with each fit's torch threads), the load average before and after, and the date."""
    load = ""
    if load_before is not None:
        after = os.getloadavg()
        load = (f"; load average (1/5/15 min) {' '.join(f'{x:.2f}' for x in load_before)} before, "
                f"{' '.join(f'{x:.2f}' for x in after)} after (other work shared the machine: times are noisy)")
    return f"{_common.machine(THREADS)} a run{load}; {datetime.date.today().isoformat()}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, lrs and seeds: under 10 min on 2 cores")
    parser.add_argument("--steps", type=int, help="steps per char_gpt run (default: the mode's)")
    parser.add_argument("--seeds", type=int, help="seeds at each side's best lr (default: the mode's)")
    parser.add_argument("--muon-lrs", type=float, nargs="+", help="Muon lrs to sweep (default: the mode's)")
    parser.add_argument("--adamw-lrs", type=float, nargs="+", help="AdamW-only lrs to sweep (default: the mode's)")
    parser.add_argument("--no-cnn", action="store_true", help="skip digits_cnn")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per fit (OMP_NUM_THREADS; default: torch's, one per core). 1 keeps runs "
                             "steady when other work shares the cores")
    parser.add_argument("--logs", default=None, help="where the runs' logs go (default: a lightning_logs dir)")
    parser.add_argument("--write", action="store_true",
                        help="write benchmarks/results/quality[_quick].md, .png and the RESULTS.md section")
    parser.add_argument("--out", default=None, metavar="DIR", help="write the .md and .png to DIR instead")
    args = parser.parse_args(argv)
    if args.write and args.out:
        parser.error("--write records into benchmarks/results; --out writes elsewhere: give one of them")
    global THREADS
    THREADS = args.threads
    if THREADS is not None:
        import torch

        torch.set_num_threads(THREADS)  # the in-process digits_cnn fits
    mode = "quick" if args.quick else "full"
    cfg = dict(MODES[mode])
    for key in ("steps", "seeds", "muon_lrs", "adamw_lrs"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    suffix = "_quick" if args.quick else ""
    log_root = Path(args.logs) if args.logs else RESULTS / "quality_logs" / "lightning_logs" / mode
    console = _common.console(140)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    started = time.perf_counter()
    command = shlex.join(["python", "benchmarks/quality.py", *(sys.argv[1:] if argv is None else argv)])

    sides = gpt_sides(console, {"muon": list(cfg["muon_lrs"]), "adamw": list(cfg["adamw_lrs"])}, cfg["seeds"],
                      cfg["steps"], cfg["val_points"], cfg["val_batches"], log_root)
    gpt_s = time.perf_counter() - started
    sweep, seeds_lines, _numbers = gpt_tables(sides, cfg["steps"])
    target = RESULTS if args.write else Path(args.out) if args.out else None
    png = (target or RESULTS) / f"quality{suffix}.png"
    if target is not None:
        target.mkdir(parents=True, exist_ok=True)
        plot_tuned(sides[::-1], 1, png, title="char_gpt")
    edges = edge_notes(sides)

    cnn_parts: list[str] = []
    if not args.no_cnn:
        cnn_start = time.perf_counter()
        console.rule("quality: digits_cnn")
        cnn_table, cnn_verdict = cnn_benchmark(console, cfg["cnn_adamw_lrs"], cfg["cnn_seeds"])
        cnn_parts = ["### digits_cnn: test accuracy at equal epochs", "", cnn_table, "", *cnn_verdict,
                     f"(digits_cnn took {time.perf_counter() - cnn_start:.0f} s.)", ""]

    elapsed = time.perf_counter() - started
    body = [
        f"Machine: {machine_line(load_before)}. The whole run took {elapsed / 60:.1f} min "
        f"(char_gpt {gpt_s / 60:.1f} min).",
        "",
        f"### char_gpt: {cfg['steps']} steps a run (validation on {cfg['val_batches']} fixed batches of 32 x 128 "
        "bytes); lr sweep at seed 0",
        "",
        sweep,
        "",
        *[f"- {e}." for e in edges],
        *([""] if edges else []),
        f"### char_gpt: each side at its best lr, seeds 0–{cfg['seeds'] - 1}",
        "",
        seeds_lines[0],
        "",
        *seeds_lines[1:],
        "Seeds set both `seed_everything` (the initialisation) and the data module's seed (the training "
        "windows); the validation windows are fixed. Train time leaves validation out "
        "(`WallClock`'s `time/train_s`); tokens/s is training tokens over it.",
        "",
        *cnn_parts,
        f"![char_gpt validation loss by step, by train time, and the lr sweeps](results/{png.name})",
        "",
        "Produced by:",
        "",
        "```bash",
        command,
        "```",
    ]
    title = f"## Quality{' (quick)' if args.quick else ''}: Muon + AdamW against AdamW alone, each tuned"
    section = "\n".join([title, "", *body])
    console.print(section, markup=False, highlight=False, soft_wrap=True)
    if target is None:
        console.print(f"Printed only (--write records it, --out DIR writes it elsewhere); {elapsed / 60:.1f} min")
        return
    md = target / f"quality{suffix}.md"
    md.write_text(section.replace("## ", "# ", 1).replace("](results/", "](") + "\n")
    if args.write:
        _report.update_section(f"quality{suffix}", section)
    console.print(f"Wrote {md}, {png}{f' and {_report.RESULTS_MD}' if args.write else ''} in {elapsed / 60:.1f} min")


if __name__ == "__main__":
    main()
