"""``lightning-muon compare``: reading logs, the table, fit arguments, one real run of the command."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

from lightning_muon.commands.cli import main
from lightning_muon.commands.compare import (
    CLOCK,
    Run,
    baseline_index,
    fit_arguments,
    load_run,
    markdown_report,
    read_metrics,
    split_overrides,
    steps_to_reach,
    summarize,
    table_cells,
    val_check_interval,
)
from lightning_muon.commands.config_files import shipped_configs

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
    """``--trainer.callbacks+=`` keeps the config's callbacks (MuonMonitor) and adds the clock; logs go to compare."""
    monkeypatch.chdir(tmp_path)  # the shipped configs by name, from a directory without them
    monkeypatch.setattr("sys.argv", ["lightning-muon"])  # arguments given explicitly: no LightningCLI warning
    args = fit_arguments(config.name, tmp_path, config.stem)
    with pytest.raises(SystemExit):
        main(["fit", *args, "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    callbacks = [c["class_path"] for c in printed["trainer"]["callbacks"]]
    assert callbacks == ["lightning_muon.MuonMonitor", CLOCK]
    logger = printed["trainer"]["logger"]
    assert logger["class_path"] == "lightning.pytorch.loggers.CSVLogger"
    assert (logger["init_args"]["save_dir"], logger["init_args"]["version"]) == (str(tmp_path), config.stem)
    assert printed["trainer"]["enable_checkpointing"] is False


# --------------------------------------------------------------------------------------- the real command


@pytest.mark.slow
def test_compare_two_tiny_configs_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny_muon.yaml").write_text(
        "# extends: gpt_muon.yaml\n"  # no such file here: the shipped one
        "trainer: {max_steps: 6, limit_val_batches: 2, log_every_n_steps: 2, enable_progress_bar: false}\n"
        "data:\n  init_args: {block_size: 32, batch_size: 4, max_bytes: 200000, val_batches: 2, "
        f"cache_dir: {tmp_path / 'cache'}}}\n"
        "model:\n  init_args: {n_layer: 1, n_embd: 32, block_size: 32}\n"
    )
    (tmp_path / "tiny_adamw.yaml").write_text("# extends: tiny_muon.yaml\nmodel:\n  init_args:\n    muon: null\n")
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
