"""Quality: Muon + AdamW against AdamW alone, each at its own best learning rate, over seeds.

Two examples, both through the real configs:

- ``char_gpt`` (the shipped ``gpt_muon.yaml`` / ``gpt_adamw.yaml``, the default
  4-layer width-128 byte-level GPT): a learning-rate sweep of each side at seed 0
  (AdamW-only: the AdamW lr; Muon + AdamW: the Muon lr, AdamW's lr on the
  embeddings, norms and head left at the config's), then more seeds at each side's
  best lr, all for the same number of steps. Every fit is a subprocess of
  ``python -m lightning_muon fit --config ... --seed_everything N
  --data.init_args.seed N ...`` with `lightning_muon.WallClock` for time and
  tokens (the arguments `lightning_muon.commands.compare.fit_arguments` gives), and the logs
  are read with `lightning_muon.commands.compare.load_run`.
  Reported: final val loss (mean, std, min-max over seeds), the step and the train
  time at which the Muon side's mean curve first reaches the AdamW side's mean final
  val loss, and tokens/s.
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
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console

from lightning_muon.commands.compare import Run, fit_arguments, load_run, steps_to_reach

import _common
import _report

ROOT = _common.ROOT
RESULTS = ROOT / "benchmarks" / "results"
GPT_MUON, GPT_ADAMW, CNN = "gpt_muon.yaml", "gpt_adamw.yaml", "cnn_muon.yaml"  # the shipped configs, by name
MUON_LR = "--model.init_args.muon.init_args.lr"
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


@dataclass
class Side:
    """One side of the comparison: its config, the lr it sweeps and the runs it made."""

    name: str
    config: str
    lr_flag: str
    lrs: list[float]
    sweep: dict[float, Run]
    seeds: list[Run]
    best: float | None = None


def _run_name(side: str, lr: float, seed: int) -> str:
    return f"{side}_lr{lr:g}_s{seed}"


def fit_gpt(console: Console, side: Side, lr: float, seed: int, steps: int, val_points: int, val_batches: int,
            log_root: Path, count: str) -> Run:
    """One fit of ``side``'s config at ``lr`` and ``seed``, as a subprocess; its output goes to a log file."""
    name = _run_name(side.name, lr, seed)
    overrides = [side.lr_flag, f"{lr:g}", "--seed_everything", str(seed), "--data.init_args.seed", str(seed),
                 "--trainer.limit_val_batches", str(val_batches), "--trainer.enable_progress_bar", "false"]
    args = fit_arguments(side.config, log_root, name, overrides, steps, val_points)
    shutil.rmtree(log_root / name, ignore_errors=True)
    log_root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    env = dict(os.environ)
    if THREADS is not None:
        env["OMP_NUM_THREADS"] = str(THREADS)
    with open(log_root / f"{name}.out", "w") as out:
        result = subprocess.run([sys.executable, "-m", "lightning_muon", "fit", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        raise SystemExit(f"quality: {name} failed (exit {result.returncode}); see {log_root / f'{name}.out'}; "
                         f"command: lightning-muon fit {shlex.join(args)}")
    run = load_run(log_root / name, name)
    console.print(f"[{count}] {side.name:5s} lr {lr:<6g} seed {seed}: final val loss {run.val_loss[-1]:.4f}, "
                  f"train {run.train_s:.1f} s, {time.perf_counter() - start:.0f} s in all", highlight=False)
    return run


@dataclass(frozen=True)
class Curve:
    """Mean (and spread) over seeds of one side's runs at its best lr."""

    steps: np.ndarray
    loss_mean: np.ndarray
    loss_min: np.ndarray
    loss_max: np.ndarray
    time_mean: np.ndarray
    final: np.ndarray  # final val loss of each seed
    tokens_per_s: np.ndarray  # of each seed
    train_s: np.ndarray  # of each seed


def mean_curve(runs: Sequence[Run]) -> Curve:
    """The seeds' curves on their common validation steps."""
    steps = sorted(set.intersection(*(set(r.val_steps) for r in runs)))
    loss = np.array([[r.val_loss[r.val_steps.index(s)] for s in steps] for r in runs])
    times = np.array([[r.val_time_s[r.val_steps.index(s)] for s in steps] for r in runs])
    return Curve(
        steps=np.array(steps), loss_mean=loss.mean(0), loss_min=loss.min(0), loss_max=loss.max(0),
        time_mean=times.mean(0), final=loss[:, -1],
        tokens_per_s=np.array([r.tokens / r.train_s for r in runs]), train_s=np.array([r.train_s for r in runs]),
    )


def _spread(values: np.ndarray, spec: str = ".4f") -> str:
    if len(values) == 1:
        return format(values[0], spec)
    return (f"{values.mean():{spec}} ± {values.std(ddof=1):{spec}} "
            f"({values.min():{spec}}–{values.max():{spec}})")


def gpt_tables(muon: Side, adamw: Side, steps: int) -> tuple[str, list[str], dict]:
    """The sweep table, the seeds table, the verdict lines, and the numbers (for the caller)."""
    lines = ["| side | lr swept | lr | final val loss (seed 0) | train time (s) | tokens/s |",
             "|---|---|---:|---:|---:|---:|"]
    for side, what in ((adamw, "AdamW lr (all params)"), (muon, "Muon lr (AdamW 0.003 on the rest)")):
        for lr in side.lrs:
            run = side.sweep[lr]
            mark = " **best**" if lr == side.best else ""
            lines.append(f"| {side.name} | {what} | {lr:g}{mark} | {run.val_loss[-1]:.4f} | {run.train_s:.1f} | "
                         f"{run.tokens / run.train_s:,.0f} |")
    sweep = "\n".join(lines)

    m, a = mean_curve(muon.seeds), mean_curve(adamw.seeds)
    target = float(a.loss_mean[-1])
    a_steps, a_time = int(a.steps[-1]), float(a.time_mean[-1])
    reached = steps_to_reach(m.steps.tolist(), m.loss_mean.tolist(), target)
    m_time = None if reached is None else float(m.time_mean[m.steps.tolist().index(reached)])
    per_seed = [steps_to_reach(r.val_steps, r.val_loss, target) for r in muon.seeds]
    seeds_n = len(muon.seeds)
    lines = [
        f"| side | lr | seeds | final val loss (mean ± std, min–max) | steps to {target:.4f} | "
        f"train time to {target:.4f} (s) | train time (s) | tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| adamw (baseline) | {adamw.best:g} | {len(adamw.seeds)} | {_spread(a.final)} | {a_steps} | {a_time:.1f} | "
        f"{a.train_s.mean():.1f} | {a.tokens_per_s.mean():,.0f} |",
        f"| muon | {muon.best:g} | {seeds_n} | {_spread(m.final)} | "
        + ("not reached" if reached is None else f"{reached} ({reached / a_steps:.2f}x)")
        + " | " + ("n/a" if m_time is None else f"{m_time:.1f} ({m_time / a_time:.2f}x)")
        + f" | {m.train_s.mean():.1f} | {m.tokens_per_s.mean():,.0f} |",
    ]
    seeds_table = "\n".join(lines)
    ok_steps = reached is not None and reached / a_steps <= TARGET_STEPS
    ok_time = m_time is not None and m_time / a_time <= TARGET_TIME
    verdict = [
        f"Target ({steps} steps): Muon + AdamW reaches the tuned AdamW's final val loss ({target:.4f}, mean of "
        f"{len(adamw.seeds)} seeds) in <= {TARGET_STEPS}x its steps: "
        + ("**met**" if ok_steps else "**missed**")
        + ("" if reached is None else f" ({reached} of {a_steps} steps = {reached / a_steps:.2f}x; per seed: "
           + ", ".join("not reached" if s is None else str(s) for s in per_seed) + ")")
        + f"; in <= {TARGET_TIME}x its train time: " + ("**met**" if ok_time else "**missed**")
        + ("" if m_time is None else f" ({m_time:.1f} of {a_time:.1f} s = {m_time / a_time:.2f}x)") + ".",
        "\"Steps to\" is the first validation of the Muon side's mean curve at or below the target, so it is an "
        f"upper bound at the resolution of the validations (every {int(m.steps[1] - m.steps[0])} steps).",
    ]
    numbers = dict(target=target, reached=reached, m_time=m_time, a_time=a_time, a_steps=a_steps,
                   muon_final=m.final, adamw_final=a.final)
    return sweep, [seeds_table, *verdict], numbers


def plot_quality(muon: Side, adamw: Side, path: Path) -> None:
    """val loss by step and by train time (mean over seeds, min-max band) and the sweeps' final loss by lr."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 4.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    by_step, by_time, by_lr = fig.subplots(1, 3)
    by_time.sharey(by_step)
    a = mean_curve(adamw.seeds)
    target = float(a.loss_mean[-1])
    for side, color in ((muon, "tab:blue"), (adamw, "tab:orange")):
        c = mean_curve(side.seeds)
        label = f"{side.name} lr {side.best:g} (mean of {len(side.seeds)} seeds, band min–max)"
        for ax, x in ((by_step, c.steps), (by_time, c.time_mean)):
            ax.plot(x, c.loss_mean, color=color, marker="o", markersize=3, label=label)
            ax.fill_between(x, c.loss_min, c.loss_max, color=color, alpha=0.25, linewidth=0)
        lrs = side.lrs
        by_lr.plot(lrs, [side.sweep[lr].val_loss[-1] for lr in lrs], color=color, marker="o",
                   label=f"{side.name}: {'Muon' if side is muon else 'AdamW'} lr, seed 0")
    for ax in (by_step, by_time):
        ax.axhline(target, color="gray", linestyle=":", linewidth=1, label="AdamW's mean final val loss")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_ylabel("validation loss (nats)")
    by_step.set_xlabel("step (optimizer updates)")
    by_step.set_title("char_gpt: validation loss by step")
    by_time.set_xlabel("training time (s, validation excluded)")
    by_time.set_title("by training time")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    by_lr.set_xscale("log")
    by_lr.set_xticks(sorted({*muon.lrs, *adamw.lrs}))
    by_lr.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    by_lr.xaxis.set_minor_formatter(NullFormatter())
    by_lr.tick_params(axis="x", labelrotation=45, labelsize=8)
    by_lr.set_xlabel("learning rate swept")
    by_lr.set_ylabel("final validation loss")
    by_lr.set_title("lr sweep (seed 0)")
    by_lr.grid(True, alpha=0.3)
    by_lr.legend(fontsize=8)
    fig.savefig(path)


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
        lines.append(f"| {label}{mark} | {len(accs)} | {_spread(accs)} | {', '.join(f'{a:.4f}' for a in accs)} |")
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

    muon = Side("muon", GPT_MUON, MUON_LR, list(cfg["muon_lrs"]), {}, [])
    adamw = Side("adamw", GPT_ADAMW, ADAMW_LR, list(cfg["adamw_lrs"]), {}, [])
    total = len(muon.lrs) + len(adamw.lrs) + 2 * (cfg["seeds"] - 1)
    done = 0
    console.rule(f"quality ({mode}): char_gpt, {cfg['steps']} steps a run, {total} runs")
    for side in (adamw, muon):
        for lr in side.lrs:
            done += 1
            side.sweep[lr] = fit_gpt(console, side, lr, 0, cfg["steps"], cfg["val_points"], cfg["val_batches"],
                                     log_root, f"{done}/{total}")
        side.best = min(side.lrs, key=lambda lr: side.sweep[lr].val_loss[-1])
        side.seeds = [side.sweep[side.best]]
    for side in (adamw, muon):
        for seed in range(1, cfg["seeds"]):
            done += 1
            side.seeds.append(fit_gpt(console, side, side.best, seed, cfg["steps"], cfg["val_points"],
                                      cfg["val_batches"], log_root,
                                      f"{done}/{total}"))
    gpt_s = time.perf_counter() - started
    sweep, seeds_lines, _numbers = gpt_tables(muon, adamw, cfg["steps"])
    target = RESULTS if args.write else Path(args.out) if args.out else None
    png = (target or RESULTS) / f"quality{suffix}.png"
    if target is not None:
        target.mkdir(parents=True, exist_ok=True)
        plot_quality(muon, adamw, png)
    edges = [f"{s.name}'s best lr {s.best:g} is at the edge of its sweep: a wider sweep may find better"
             for s in (muon, adamw) if s.best in (min(s.lrs), max(s.lrs)) and len(s.lrs) > 1]

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
