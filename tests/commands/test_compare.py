"""``lightning-muon compare``: reading logs, the table, fit arguments, one real run of the command."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import yaml

from lightning_muon.commands.cli import main
from lightning_muon.commands.compare.aggregate import Side, edge_notes, outcomes, seeds_table, sweep_table, verdict
from lightning_muon.commands.compare.fit import CLOCK, fit_arguments, val_check_interval
from lightning_muon.commands.compare.report import (
    baseline_index,
    markdown_report,
    steps_to_reach,
    summarize,
    table_cells,
)
from lightning_muon.commands.compare.run import split_overrides
from lightning_muon.commands.compare.runs import Run, load_run, read_metrics
from lightning_muon.commands.compare.sweep import (
    MULTIPLIERS,
    SweptLr,
    best_lr,
    check_multipliers,
    check_seeds,
    edge,
    lr_grid,
    parse_lrs,
    side_grid,
    swept_lr,
)
from lightning_muon.commands.compare.tuning import Progress, SideSpec, load_side, tune
from lightning_muon.commands.config_files import merged_config, shipped_configs

CONFIGS = shipped_configs()
FIELDS = ["epoch", "step", "train_loss", "val_loss", "val_bpb", "time/elapsed_s", "time/train_s", "time/samples",
          "time/tokens"]


def write_log(directory: Path, rows: list[dict], muon: bool | None = True) -> Path:
    """A CSVLogger-like run directory: ``metrics.csv`` (one row per logging call) and ``config.yaml``."""
    directory.mkdir(parents=True)
    with open(directory / "metrics.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    if muon is not None:
        factory = {"class_path": "lightning_muon.Muon", "init_args": {"lr": 0.02}} if muon else None
        config = {"model": {"class_path": "lightning_muon.examples.char_gpt.CharGPT", "init_args": {"muon": factory}}}
        (directory / "config.yaml").write_text(yaml.safe_dump(config))
    return directory


def timed_run(losses: list[float], train_s: list[float], tokens: float | None) -> list[dict]:
    """Validation after 10, 20, ... updates (logger steps 9, 19, ...), each preceded by a WallClock row."""
    rows: list[dict] = []
    for i, (loss, seconds) in enumerate(zip(losses, train_s)):
        step = 10 * i + 9
        rows.append({"step": step, "train_loss": loss + 0.1, "epoch": 0})
        clock = {"step": step, "time/elapsed_s": 1.5 * seconds, "time/train_s": seconds, "time/samples": 8.0 * (i + 1)}
        if tokens is not None:
            clock["time/tokens"] = tokens * (i + 1) / len(losses)
        rows.append(clock)
        rows.append({"step": step, "epoch": 0, "val_loss": loss, "val_bpb": loss / 0.6931471805599453})
    return rows


@pytest.fixture
def logs(tmp_path):
    muon = write_log(tmp_path / "muon", timed_run([3.0, 2.5, 2.0, 1.8], [1.0, 2.0, 3.0, 4.0], tokens=8000))
    slow = write_log(tmp_path / "slow" / "version_3", timed_run([3.5, 3.0, 2.9, 2.5], [1, 2, 3, 4], tokens=None))
    adamw = write_log(tmp_path / "adamw", timed_run([3.2, 2.8, 2.4, 2.1], [0.5, 1.0, 1.5, 2.0], tokens=8000),
                      muon=False)
    return muon, slow, adamw


# ------------------------------------------------------------------------------------------ logs and the table


def test_read_metrics_skips_empty_cells(logs):
    series = read_metrics(logs[0] / "metrics.csv")
    assert series["val_loss"] == [(9, 3.0), (19, 2.5), (29, 2.0), (39, 1.8)]
    assert series["time/train_s"][-1] == (39, 4.0)
    assert "epoch" not in series


def test_load_run_reads_curve_clock_and_baseline_flag(logs):
    muon, slow, adamw = (load_run(d) for d in logs)
    assert muon.name == "muon" and slow.name == "slow"  # a version_N directory is named after its parent
    assert muon.val_steps == (10, 20, 30, 40)  # updates done: logger step + 1
    assert muon.val_loss == (3.0, 2.5, 2.0, 1.8)
    assert muon.val_bpb[-1] == pytest.approx(1.8 / 0.6931471805599453)
    assert muon.val_time_s == (1.0, 2.0, 3.0, 4.0)
    assert (muon.train_s, muon.elapsed_s, muon.samples, muon.tokens) == (4.0, 6.0, 32.0, 8000.0)
    assert slow.tokens is None and slow.samples == 32.0
    assert (muon.muon, adamw.muon) == (True, False)


def test_load_run_finds_the_newest_version_and_interpolates_time(tmp_path):
    write_log(tmp_path / "run" / "version_0", [{"step": 0, "val_loss": 9.0}])
    rows = [{"step": 4, "time/train_s": 1.0, "time/elapsed_s": 1.0, "time/samples": 5},
            {"step": 9, "val_loss": 2.0},
            {"step": 14, "time/train_s": 3.0, "time/elapsed_s": 3.5, "time/samples": 15}]
    write_log(tmp_path / "run" / "version_10", rows, muon=None)
    run = load_run(tmp_path / "run")
    assert run.val_loss == (2.0,) and run.muon is None
    assert run.val_time_s == (pytest.approx(2.0),)  # halfway between the clock rows at steps 4 and 14
    with pytest.raises(FileNotFoundError, match=r"no metrics\.csv"):
        load_run(tmp_path / "nowhere")


def test_steps_to_reach():
    assert steps_to_reach([10, 20, 30], [3.0, 2.0, 1.0], 2.0) == 20  # at or below
    assert steps_to_reach([10, 20, 30], [3.0, 2.0, 1.0], 0.5) is None
    assert steps_to_reach([], [], 1.0) is None


def test_baseline_is_muon_null_else_last_else_named(logs):
    runs = [load_run(d) for d in logs]
    assert baseline_index(runs) == 2
    assert baseline_index(runs[:2]) == 1  # no muon: null: the last run
    assert baseline_index(runs, "muon") == 0
    with pytest.raises(ValueError, match="--baseline 'nope' is none of the runs"):
        baseline_index(runs, "nope")


def test_table_values(logs):
    runs = [load_run(d) for d in logs]
    rows, target = summarize(runs, baseline_index(runs))
    assert target == 2.1
    muon, slow, adamw = rows
    assert (muon.steps_to_target, muon.time_to_target_s) == (30, 3.0)  # 2.0 <= 2.1 at the third validation
    assert (slow.steps_to_target, slow.time_to_target_s) == (None, None)
    assert (adamw.steps_to_target, adamw.time_to_target_s, adamw.baseline) == (40, 2.0, True)
    assert (muon.throughput, muon.throughput_unit) == (2000.0, "tokens/s")  # 8000 tokens in 4 s
    assert adamw.throughput == 4000.0
    assert (slow.throughput, slow.throughput_unit) == (8.0, "samples/s")  # no tokens: 32 samples in 4 s
    header, cells = table_cells(rows, target)
    assert header[4] == "steps to 2.1000"
    assert cells[0] == ["muon", "40", "1.8000", "2.5969", "30", "3.0", "4.0", "6.0", "2,000"]
    assert cells[1][4:6] == ["not reached", "n/a"] and cells[1][-1] == "8 samples/s"
    assert cells[2][0] == "adamw (baseline)" and cells[2][4] == "40"


def test_markdown_report_has_one_row_per_run_and_the_command(logs):
    runs = [load_run(d) for d in logs]
    report = markdown_report(runs, 2, "lightning-muon compare --from-logs a b c", ["Machine: test"])
    rows = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith("| run")]
    assert [r.split("|")[1].strip() for r in rows] == ["muon", "slow", "adamw (baseline)"]
    assert "lightning-muon compare --from-logs a b c" in report
    assert "- Machine: test" in report and "![" in report


def test_a_run_without_validation_gives_n_a():
    runs = [Run("a", (), ()), Run("b", (10,), (2.0,))]
    rows, target = summarize(runs, 0)
    assert target is None and rows[1].steps_to_target is None
    assert table_cells(rows, target)[1][0][2:6] == ["n/a", "n/a", "n/a", "n/a"]


# -------------------------------------------------------------------------------------------- fit arguments


def test_val_check_interval_gives_about_the_points_asked():
    assert val_check_interval(300, 12) == 25
    assert val_check_interval(6, 12) == 1
    assert val_check_interval(1000, 12) == 100  # a divisor: the last validation is at the last step
    assert val_check_interval(997, 12) == 83  # a prime: no divisor fits


def test_split_overrides():
    own, overrides = split_overrides(
        ["a.yaml", "--out", "o", "--trainer.limit_val_batches", "5", "b.yaml", "--seed_everything=1",
         "--from-logs", "x", "--", "--model.init_args.n_layer", "2"]
    )
    assert own == ["a.yaml", "--out", "o", "b.yaml", "--from-logs", "x"]
    assert overrides == ["--trainer.limit_val_batches", "5", "--seed_everything=1", "--model.init_args.n_layer", "2"]


def test_fit_arguments_add_clock_validation_and_logger(tmp_path):
    args = fit_arguments("gpt_adamw.yaml", tmp_path, "gpt_adamw", ["--trainer.limit_val_batches", "5"])
    joined = " ".join(args)
    assert args[:2] == ["--config", "gpt_adamw.yaml"]
    assert "--trainer.val_check_interval 25 --trainer.check_val_every_n_epoch null" in joined  # 300 steps (base)
    assert f"--trainer.callbacks+={CLOCK}" in args
    assert "--trainer.enable_checkpointing false" in joined
    assert f"--trainer.logger.init_args.save_dir {tmp_path}" in joined and args[-1] == "gpt_adamw"
    assert "--trainer.limit_val_batches 5" in joined
    args = fit_arguments("gpt_muon.yaml", tmp_path, "m", max_steps=60, val_points=6)
    assert "--trainer.max_steps 60" in " ".join(args) and "--trainer.val_check_interval 10" in " ".join(args)
    args = fit_arguments("gpt_muon.yaml", tmp_path, "m", ["--trainer.val_check_interval=50"])
    assert args.count("--trainer.val_check_interval") == 0
    args = fit_arguments("cnn_muon.yaml", tmp_path, "cnn")  # epochs, no max_steps: its own validation
    assert "--trainer.val_check_interval" not in args


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_fit_arguments_resolve_with_every_shipped_config(config, tmp_path, monkeypatch, capsys):
    """``--trainer.callbacks+=`` keeps the config's callbacks (MuonMonitor, the recipe's MomentumSchedule and EMA)
    and adds the clock; logs go to compare."""
    monkeypatch.chdir(tmp_path)  # the shipped configs by name, from a directory without them
    monkeypatch.setattr("sys.argv", ["lightning-muon"])  # arguments given explicitly: no LightningCLI warning
    args = fit_arguments(config.name, tmp_path, config.stem)
    with pytest.raises(SystemExit):
        main(["fit", *args, "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    callbacks = [c["class_path"] for c in printed["trainer"]["callbacks"]]
    recipe = ["lightning_muon.MomentumSchedule", "lightning.pytorch.callbacks.EMAWeightAveraging"]
    own = {"gpt_muon_recipe.yaml": recipe}.get(config.name, [])
    assert callbacks == ["lightning_muon.MuonMonitor", *own, CLOCK]
    logger = printed["trainer"]["logger"]
    assert logger["class_path"] == "lightning.pytorch.loggers.CSVLogger"
    assert (logger["init_args"]["save_dir"], logger["init_args"]["version"]) == (str(tmp_path), config.stem)
    assert printed["trainer"]["enable_checkpointing"] is False


# --------------------------------------------------------------------------------------- the real command


def tiny_configs(directory: Path) -> None:
    """``tiny_muon.yaml`` (gpt_muon.yaml at one layer of width 32, 32-byte windows, batches of 4) and
    ``tiny_adamw.yaml`` (the same with ``muon: null``): a fit takes seconds."""
    (directory / "tiny_muon.yaml").write_text(
        "# extends: gpt_muon.yaml\n"  # no such file here: the shipped one
        "trainer: {max_steps: 6, limit_val_batches: 2, log_every_n_steps: 2, enable_progress_bar: false}\n"
        "data:\n  init_args: {block_size: 32, batch_size: 4, max_bytes: 200000, val_batches: 2, "
        f"cache_dir: {directory / 'cache'}}}\n"
        "model:\n  init_args: {n_layer: 1, n_embd: 32, block_size: 32}\n"
    )
    (directory / "tiny_adamw.yaml").write_text("# extends: tiny_muon.yaml\nmodel:\n  init_args:\n    muon: null\n")


@pytest.mark.slow
def test_compare_two_tiny_configs_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    tiny_configs(tmp_path)
    out = tmp_path / "out"
    configs = [str(tmp_path / "tiny_adamw.yaml"), str(tmp_path / "tiny_muon.yaml")]
    main(["compare", *configs, "--out", str(out), "--max_steps", "4", "--trainer.limit_val_batches", "1"])
    printed = capsys.readouterr().out
    assert "tiny_adamw (baseline)" in printed  # muon: null, though not the last config

    png = (out / "comparison.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    report = (out / "comparison.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith("| run")]
    assert [r.split("|")[1].strip() for r in rows] == ["tiny_adamw (baseline)", "tiny_muon"]
    assert all(r.split("|")[2].strip() == "4" for r in rows)  # --max_steps 4: validated after every step
    assert f"lightning-muon compare {configs[0]} {configs[1]} --out {out}" in report
    run = load_run(out / "lightning_logs" / "tiny_muon")
    assert run.val_steps == (1, 2, 3, 4) and run.tokens == 4 * 4 * 32  # 4 steps of 4 windows of 32 bytes
    assert run.val_time_s is not None and run.muon is True

    # the same comparison again from the logs, without training
    again = tmp_path / "again"
    main(["compare", "--from-logs", *(str(out / "lightning_logs" / n) for n in ("tiny_adamw", "tiny_muon")),
          "--out", str(again)])
    assert (again / "comparison.png").is_file()
    assert (again / "comparison.md").read_text().split("\n\n")[1] == report.split("\n\n")[1]  # the same table


def test_compare_needs_configs_or_logs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare"])
    assert exit_info.value.code == 2
    assert "give at least one CONFIG to fit, or --from-logs DIR" in capsys.readouterr().err


def test_compare_stops_on_a_failed_fit_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("# extends: gpt_muon.yaml\nmodel:\n  init_args: {n_layr: 1}\n")
    with pytest.raises(SystemExit, match=r"the fit of .*bad\.yaml failed \(exit code [1-9]"):
        main(["compare", str(bad), "--out", str(tmp_path / "out")])


def test_compare_checks_matplotlib_before_any_fit(monkeypatch, capsys):
    import importlib.util
    import subprocess

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a fit started"))
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "gpt_muon.yaml", "gpt_adamw.yaml"])
    assert exit_info.value.code == 2
    assert "compare draws its plot with matplotlib: pip install matplotlib" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- tuning: the sweep, pure

MUON_KEY, ADAMW_KEY = "model.init_args.muon.init_args.lr", "model.init_args.adamw.init_args.lr"


@pytest.mark.parametrize(
    ("config", "overrides", "expected"),
    [
        ("gpt_muon.yaml", [], SweptLr(MUON_KEY, "Muon", 0.02, 0.003)),
        ("gpt_adamw.yaml", [], SweptLr(ADAMW_KEY, "AdamW", 0.00075)),
        ("gpt_muon.yaml", ["--model.init_args.muon", "null"], SweptLr(ADAMW_KEY, "AdamW", 0.003)),
        ("gpt_muon.yaml", [f"--{MUON_KEY}=0.05", f"--{ADAMW_KEY}", "1e-3"], SweptLr(MUON_KEY, "Muon", 0.05, 0.001)),
        ("gpt_adamw.yaml", ["--model.init_args.muon", "null", f"--{ADAMW_KEY}", "0.002"],
         SweptLr(ADAMW_KEY, "AdamW", 0.002)),
    ],
    ids=["muon", "adamw-only", "muon null given", "lrs given", "adamw lr given"],
)
def test_swept_lr_reads_the_muon_lr_or_the_adamw_only_lr(config, overrides, expected):
    assert swept_lr(merged_config(config), overrides) == expected


def test_swept_lr_of_a_config_that_does_not_say():
    swept = swept_lr({"model": {"init_args": {"n_layer": 2}}})  # no muon written: the mixin's default Muon
    assert (swept.key, swept.lr, swept.rest_lr) == (MUON_KEY, None, None)
    assert swept.describe() == "Muon lr (AdamW the config's on the rest)"
    assert swept_lr(merged_config("gpt_muon.yaml")).describe() == "Muon lr (AdamW 0.003 on the rest)"
    assert swept_lr(merged_config("gpt_adamw.yaml")).describe() == "AdamW lr (all params)"


def test_lr_grid_is_the_config_lr_times_the_multipliers():
    assert MULTIPLIERS == (0.25, 0.5, 1.0, 2.0, 4.0)
    assert lr_grid(0.02) == [0.005, 0.01, 0.02, 0.04, 0.08]
    assert lr_grid(0.00075) == [0.0001875, 0.000375, 0.00075, 0.0015, 0.003]
    assert lr_grid(0.1, [3, 1 / 3, 1, 1]) == [0.0333333, 0.1, 0.3]  # 6 significant digits, sorted, no repeat


def test_side_grid_explicit_multiplied_or_alone():
    swept = SweptLr(MUON_KEY, "Muon", 0.02)
    assert side_grid("m", swept, None, None) == [0.02]  # --seeds without a sweep: the config's lr
    assert side_grid("m", swept, [1, 2], None) == [0.02, 0.04]
    assert side_grid("m", swept, [1, 2], [0.3, 0.1]) == [0.1, 0.3]  # --lrs wins


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: check_multipliers([0.5, -1.0]), r"--multipliers: every multiplier must be a positive number, got -1"),
        (lambda: check_multipliers([0.0]), r"positive number, got 0 \(the default grid is 0.25,0.5,1,2,4\)"),
        (lambda: check_multipliers([float("nan")]), r"got nan"),
        (lambda: check_multipliers([]), r"give at least one multiplier"),
        (lambda: check_seeds(0), r"--seeds must be >= 1 .*got 0"),
        (lambda: parse_lrs(["nope=0.1"], ["a", "b"]),
         r"--lrs 'nope=0.1': expected NAME=LR,LR,\.\.\. with NAME one of a, b"),
        (lambda: parse_lrs(["a=0.1,x"], ["a"]), r"the lrs must be numbers separated by commas"),
        (lambda: parse_lrs(["a=0.1", "a=0.2"], ["a"]), r"--lrs: a is given twice"),
        (lambda: parse_lrs(["a=0.1,-0.2"], ["a"]), r"--lrs a=\.\.\.: every lr must be a positive number, got -0.2"),
        (lambda: side_grid("m", SweptLr(MUON_KEY, "Muon", None), [1, 2], None),
         r"m: no Muon lr to sweep around: the config does not set model\.init_args\.muon\.init_args\.lr\. Write it in "
         r"the config, pass --model\.init_args\.muon\.init_args\.lr LR, or give the lrs: --lrs m=LR,LR"),
        (lambda: side_grid("a", SweptLr(ADAMW_KEY, "AdamW", None), None, None), r"a: no AdamW lr to seed"),
    ],
)
def test_bad_sweep_settings_are_errors_naming_the_value_and_the_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_best_lr_skips_diverged_runs_and_edges_are_named():
    assert best_lr({0.01: 2.0, 0.02: 1.5, 0.04: float("nan")}) == 0.02
    assert best_lr({0.01: float("nan"), 0.02: float("nan")}) == 0.01  # all diverged: still an answer
    assert edge(0.01, [0.01, 0.02]) == "lowest" and edge(0.02, [0.01, 0.02]) == "highest"
    assert edge(0.02, [0.01, 0.02, 0.04]) is None and edge(0.02, [0.02]) is None


# --------------------------------------------------------------------------- tuning: fits in order, aggregates


def curve_run(name: str, losses: list[float], seconds: float = 1.0, tokens: float | None = 1000.0) -> Run:
    """A run validated at steps 10, 20, ... with train time ``seconds`` per 10 steps."""
    steps = tuple(10 * (i + 1) for i in range(len(losses)))
    return Run(name, steps, tuple(losses), val_time_s=tuple(seconds * i / 10 for i in steps),
               train_s=seconds * len(losses), tokens=tokens, samples=8.0 * len(losses))


def test_tune_sweeps_at_seed_0_then_seeds_the_best_lr():
    # final loss by (side, lr): the muon side is best at 0.02, the adamw side at its lowest lr
    finals = {("m", 0.01): 2.0, ("m", 0.02): 1.5, ("m", 0.04): 1.8, ("a", 0.001): 2.2, ("a", 0.002): 2.4}
    specs = [SideSpec("m", "m.yaml", SweptLr(MUON_KEY, "Muon", 0.02), (0.01, 0.02, 0.04)),
             SideSpec("a", "a.yaml", SweptLr(ADAMW_KEY, "AdamW", 0.001), (0.001, 0.002))]
    calls = []

    def fit(spec, lr, seed):
        calls.append((spec.name, lr, seed))
        return curve_run(f"{spec.name} {lr} {seed}", [3.0, finals[spec.name, lr] + 0.01 * seed])

    lines: list[str] = []
    ticks = iter(range(100))
    sides = tune(specs, 3, fit, Progress(9, lines.append, clock=lambda: 60.0 * next(ticks)))
    assert calls == [("m", 0.01, 0), ("m", 0.02, 0), ("m", 0.04, 0), ("a", 0.001, 0), ("a", 0.002, 0),
                     ("m", 0.02, 1), ("m", 0.02, 2), ("a", 0.001, 1), ("a", 0.001, 2)]
    muon, adamw = sides
    assert (muon.best, adamw.best) == (0.02, 0.001) and muon.grid == [0.01, 0.02, 0.04]
    assert [r.name for r in muon.seeds] == ["m 0.02 0", "m 0.02 1", "m 0.02 2"]
    assert muon.seeds[0] is muon.sweep[0.02]  # seed 0 is the sweep's run, not fitted twice
    assert len(lines) == 9 and lines[2].startswith("[3/9] m Muon lr 0.04 seed 0: final val loss 1.8000, train 2.0 s")
    assert lines[2].endswith("about 6.0 min left, 9.0 min in all")  # a minute a fit by the fake clock
    assert "left" not in lines[-1]


def two_sides() -> list[Side]:
    muon = Side("muon", SweptLr(MUON_KEY, "Muon", 0.02, 0.003))
    muon.sweep = {0.01: curve_run("m1", [3.0, 2.6, 2.4, 2.3]), 0.02: curve_run("m2", [2.8, 2.2, 2.0, 1.9], 1.1)}
    muon.seeds = [muon.sweep[0.02], curve_run("m2s1", [2.8, 2.4, 2.1, 2.1], 1.3)]
    adamw = Side("adamw", SweptLr(ADAMW_KEY, "AdamW", 0.001))
    adamw.sweep = {0.001: curve_run("a1", [3.1, 2.7, 2.5, 2.3], 0.9), 0.002: curve_run("a2", [3.0, 2.8, 2.6, 2.5])}
    adamw.seeds = [adamw.sweep[0.001], curve_run("a1s1", [3.1, 2.7, 2.5, 2.5], 0.9)]
    return [muon, adamw]


def test_outcomes_tables_and_verdict_against_the_tuned_baseline():
    sides = two_sides()
    target, (muon, adamw) = outcomes(sides, baseline=1)
    assert target == pytest.approx(2.4)  # the baseline's mean final (2.3 and 2.5)
    assert muon.curve.loss_mean.tolist() == pytest.approx([2.8, 2.3, 2.05, 2.0])
    assert (muon.steps_to, muon.time_to) == (20, pytest.approx(2.4))  # mean of 2.2 and 2.6 s at step 20
    assert muon.per_seed_steps_to == (20, 20)
    assert (adamw.steps_to, adamw.last_step, adamw.last_time) == (40, 40, pytest.approx(3.6))
    table = seeds_table(target, [muon, adamw])
    assert "| muon | 0.02 | 2 | 2.0000 ± 0.1414 (1.9000–2.1000) | 20 (0.50x) | 2.4 (0.67x) | 4.8 | 210 |" in table
    assert "| adamw (baseline) | 0.001 | 2 | 2.4000 ± 0.1414 (2.3000–2.5000) | 40 | 3.6 | 3.6 | 278 |" in table
    (line,) = verdict(target, [muon, adamw], sides)
    assert line == ("Verdict: muon (lr 0.02) reaches the tuned adamw's final val loss 2.4000 (lr 0.001) in 0.50x "
                    "its steps (20 of 40) and 0.67x its train time (2.4 of 3.6 s); final val loss 2.0000 against "
                    "2.4000 (means over 2 and 2 seeds).")
    sweep = sweep_table(sides)
    assert "| muon | Muon lr (AdamW 0.003 on the rest) | 0.02 **best** | 1.9000 | 4.4 | 227 |" in sweep
    assert "| adamw | AdamW lr (all params) | 0.001 **best** | 2.3000 | 3.6 | 278 |" in sweep
    assert edge_notes(sides) == [
        "muon's best lr 0.02 is at the edge of its sweep (the highest of 0.01, 0.02): a wider sweep may find better",
        "adamw's best lr 0.001 is at the edge of its sweep (the lowest of 0.001, 0.002): a wider sweep may find "
        "better",
    ]


def test_a_side_that_does_not_reach_the_target_says_so():
    muon, adamw = two_sides()
    target, results = outcomes([adamw, muon], baseline=1)  # now the muon side is the baseline: 2.0
    assert results[0].steps_to is None
    assert "| adamw | 0.001 | 2 | 2.4000 ± 0.1414 (2.3000–2.5000) | not reached | n/a |" in seeds_table(target, results)
    (line,) = verdict(target, results, [adamw, muon])
    assert line.startswith("Verdict: adamw (lr 0.001) does not reach the tuned muon's final val loss 2.0000 (lr "
                           "0.02) in 40 steps: final val loss 2.4000 against 2.0000")


def test_a_run_without_validation_cannot_be_tuned():
    side = Side("m", SweptLr(MUON_KEY, "Muon", 0.02), sweep={0.02: Run("m", (), (), source="logs/m")})
    with pytest.raises(ValueError, match=r"m logged no val_loss \(logs/m\): it cannot be compared"):
        _ = side.best


def write_seeded_log(directory: Path, lr: float, seed: int, losses: list[float], muon: bool = True) -> Path:
    """A run directory as ``compare --sweep`` leaves it: metrics.csv and the config.yaml LightningCLI saves."""
    write_log(directory, timed_run(losses, [1.0 * (i + 1) for i in range(len(losses))], tokens=4000), muon=None)
    factory = {"class_path": "lightning_muon.Muon", "init_args": {"lr": lr}} if muon else None
    config = {"seed_everything": seed, "model": {"init_args": {
        "muon": factory, "adamw": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.003 if muon else lr}}}}}
    (directory / "config.yaml").write_text(yaml.safe_dump(config))
    return directory


def test_load_side_reads_lr_and_seed_from_each_saved_config(tmp_path):
    side_dir = tmp_path / "gpt_muon"
    write_seeded_log(side_dir / "lr0.01_seed0", 0.01, 0, [3.0, 2.5])
    write_seeded_log(side_dir / "lr0.02_seed0", 0.02, 0, [3.0, 2.2])
    write_seeded_log(side_dir / "lr0.02_seed1", 0.02, 1, [3.0, 2.3])
    (side_dir / "lr0.02_seed0.out").write_text("output")
    side = load_side(side_dir)
    assert (side.name, side.muon, side.grid, side.best) == ("gpt_muon", True, [0.01, 0.02], 0.02)
    assert [r.val_loss[-1] for r in side.seeds] == [2.2, 2.3]
    one = load_side(side_dir / "lr0.01_seed0", "one")  # a single run's directory is a side of one run
    assert (one.grid, len(one.seeds)) == ([0.01], 1)
    write_seeded_log(side_dir / "again", 0.02, 1, [3.0, 2.3])
    with pytest.raises(ValueError, match=r"two runs at lr 0.02, seed 1"):
        load_side(side_dir)
    (side_dir / "again" / "config.yaml").unlink()
    with pytest.raises(ValueError, match=r"again: no config.yaml beside metrics.csv, so its lr and seed are unknown"):
        load_side(side_dir)


# --------------------------------------------------------------------------- tuning: the command, end to end

NO_LR = "model:\n  class_path: lightning_muon.examples.char_gpt.CharGPT\n  init_args: {n_layer: 1}\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seeds", "0", "gpt_muon.yaml"], r"--seeds must be >= 1 \(seeds 0..N-1 at each side's best lr\), got 0"),
        (["--multipliers", "0.5,0,2", "gpt_muon.yaml"], r"every multiplier must be a positive number, got 0"),
        (["--multipliers", "half", "gpt_muon.yaml"], r"expected numbers separated by commas, e.g. 0.5,1,2; got 'half'"),
        (["--lrs", "gpt_adam=0.001", "gpt_muon.yaml", "gpt_adamw.yaml"],
         r"--lrs 'gpt_adam=0.001': expected NAME=LR,LR,... with NAME one of gpt_muon, gpt_adamw"),
        (["--sweep", "no_lr.yaml"], r"no_lr: no Muon lr to sweep around: the config does not set "
                                    r"model.init_args.muon.init_args.lr"),
        (["--seeds", "2", "gpt_muon.yaml", "--seed_everything", "3"], r"set the seeds themselves \(0..N-1\): drop "
                                                                      r"--seed_everything"),
    ],
    ids=["seeds 0", "multiplier 0", "multiplier not a number", "lrs of no config", "no lr", "seed given"],
)
def test_bad_tuning_arguments_stop_before_any_fit(argv, message, tmp_path, monkeypatch, capsys):
    import subprocess

    monkeypatch.chdir(tmp_path)
    (tmp_path / "no_lr.yaml").write_text(NO_LR)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a fit started"))
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *argv, "--out", str(tmp_path / "out")])
    shown = str(exit_info.value.code) + capsys.readouterr().err
    assert re.search(message, shown), shown


@pytest.mark.slow
def test_compare_sweep_end_to_end_then_from_logs(tmp_path, monkeypatch, capsys):
    """Three tiny fits through the real command: the Muon side at two lrs, the AdamW side at its own (x1)."""
    monkeypatch.chdir(tmp_path)
    tiny_configs(tmp_path)
    out = tmp_path / "out"
    main(["compare", "tiny_muon.yaml", "tiny_adamw.yaml", "--sweep", "--multipliers", "1",
          "--lrs", "tiny_muon=0.01,0.04", "--max_steps", "3", "--trainer.limit_val_batches", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "compare: 3 fits (tiny_muon: Muon lr 0.01, 0.04; tiny_adamw: AdamW lr 0.003; at seed 0)" in printed
    progress = [line for line in printed.splitlines() if line.startswith("[")]
    assert [line.split(":")[0] for line in progress] == [
        "[1/3] tiny_muon Muon lr 0.01 seed 0", "[2/3] tiny_muon Muon lr 0.04 seed 0",
        "[3/3] tiny_adamw AdamW lr 0.003 seed 0",
    ]
    assert "left, " in progress[0] and "left" not in progress[-1]

    logs = out / "lightning_logs"
    saved = yaml.safe_load((logs / "tiny_muon" / "lr0.04_seed0" / "config.yaml").read_text())
    assert saved["model"]["init_args"]["muon"]["init_args"]["lr"] == 0.04  # the sweep's lr reached the fit
    assert saved["seed_everything"] == 0 and saved["data"]["init_args"]["seed"] == 0
    assert (logs / "tiny_adamw" / "lr0.003_seed0.out").read_text().startswith("$ lightning-muon fit --config ")

    sides = {s.name: s for s in (load_side(logs / "tiny_muon"), load_side(logs / "tiny_adamw"))}
    best = sides["tiny_muon"].best
    report = (out / "comparison.md").read_text()
    verdict_line = next(line for line in printed.splitlines() if line.startswith("Verdict: "))
    assert verdict_line.startswith(f"Verdict: tiny_muon (lr {best:g}) ")
    assert "the tuned" not in verdict_line  # the baseline was not swept: it is not called tuned
    assert verdict_line in report and "tiny_adamw (baseline)" in report
    assert f"tiny_muon's best lr {best:g} is at the edge of its sweep (the" in report
    assert "- 3 fits took " in report and f"--from-logs {logs / 'tiny_muon'} {logs / 'tiny_adamw'}" in report
    assert f"| tiny_muon | Muon lr (AdamW 0.003 on the rest) | {best:g} **best** |" in report
    png = (out / "comparison.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"

    again = tmp_path / "again"  # the same comparison from the logs, without training
    main(["compare", "--from-logs", str(logs / "tiny_muon"), str(logs / "tiny_adamw"), "--out", str(again)])
    table = report.split("\n\nBaseline:")[0]
    assert (again / "comparison.md").read_text().split("\n\nBaseline:")[0] == table


def test_compare_from_logs_says_what_is_wrong_in_one_line(tmp_path, capsys):
    """A missing directory stops before any fit (argparse's usage error); logs without metrics and a --baseline
    that names none of the runs end in one line naming the fix, not a traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--from-logs", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert f"--from-logs: no directory '{tmp_path / 'nowhere'}'" in capsys.readouterr().err

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"^lightning-muon compare: no metrics.csv in .*empty"):
        main(["compare", "--from-logs", str(tmp_path / "empty"), "--out", str(tmp_path / "out")])

    for name, loss in (("muon", 1.5), ("adamw", 2.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.csv").write_text(f"epoch,step,val_loss\n0,9,{loss}\n")
    with pytest.raises(SystemExit, match=r"^lightning-muon compare: --baseline 'sgd' is none of the runs: muon, adamw"):
        main(["compare", "--from-logs", str(tmp_path / "muon"), str(tmp_path / "adamw"), "--baseline", "sgd",
              "--out", str(tmp_path / "out")])
