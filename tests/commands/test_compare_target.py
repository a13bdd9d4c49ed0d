"""``lightning-muon compare --target``: the steps each side takes to reach a loss, resolved by validating densely
near it.

The pure parts (the crossing and its bracket, the validation schedule, a side's steps over its seeds, the table and
the verdict), the callback that follows the schedule inside a real Trainer (with gradient accumulation: the same
validations as the schedule replayed on a run validated after every update), the order of the fits (a named
target's side first, the others given its loss), and one small run of the real command.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from lightning_muon.commands.cli import main
from lightning_muon.commands.compare import tuned
from lightning_muon.commands.compare.aggregate import Side, outcomes
from lightning_muon.commands.compare.fit import NEAR_TARGET, fit_arguments
from lightning_muon.commands.compare.near_target import NearTargetValidation
from lightning_muon.commands.compare.runs import Run, load_run
from lightning_muon.commands.compare.sweep import SweptLr
from lightning_muon.commands.compare.target import (
    Crossing,
    StepsTo,
    TargetSchedule,
    check_resolution,
    check_target,
    crossing,
    parse_target,
    steps_to,
)
from lightning_muon.commands.compare.target_report import target_table, target_verdict

from helpers import MuonRegression, make_trainer

# ------------------------------------------------------------------------------------------ the pure parts


def test_the_crossing_is_the_first_validation_at_or_below_and_the_one_before():
    assert crossing([10, 20, 25, 30], [3.0, 2.1, 2.0, 1.9], 2.0) == Crossing(25, 20)
    assert crossing([10, 20], [1.0, 0.5], 2.0) == Crossing(10, 0)  # reached at the first validation
    assert crossing([10, 20], [3.0, 2.5], 2.0) is None
    assert Crossing(25, 20).width == 0.2 and Crossing(100, 98).width == 0.02


def test_target_and_resolution_arguments():
    assert parse_target("1.75") == 1.75 and parse_target("2") == 2.0
    assert parse_target("gpt_adamw") == "gpt_adamw" and parse_target("nan") == "nan"  # not a loss: a name
    check_target(1.75, ["a"])
    check_target("a", ["a", "b"])
    with pytest.raises(ValueError, match=r"--target 'c': give a loss \(e.g. --target 1.75\) or a side's name, one "
                                         r"of a, b"):
        check_target("c", ["a", "b"])
    for bad in (0.0, -0.1, 0.6, math.nan):
        with pytest.raises(ValueError, match=r"--resolution is the gap between the last validations before the target"):
            check_resolution(bad)


def replay(schedule: TargetSchedule, curve: dict[int, float], last: int) -> list[int]:
    """The steps ``schedule`` validates at on ``curve`` (loss after each step), steps 1..last."""
    validated = []
    for step in range(1, last + 1):
        if schedule.due(step):
            schedule.record(step, curve[step])
            validated.append(step)
    return validated


GRID = list(range(25, 301, 25))


def test_the_schedule_keeps_the_grid_and_closes_in_on_a_smooth_crossing():
    """An exponential approach crosses 1.3 at step 95: found between 94 and 95 for 12 validations more than the
    grid's 12, closing in from step 50 (where the line through 25 and 50 reaches 1.3 within two grid intervals)."""
    curve = {s: 1 + 2 * math.exp(-s / 50) for s in range(1, 301)}
    assert next(s for s in curve if curve[s] <= 1.3) == 95
    validated = replay(TargetSchedule(1.3, every=25, resolution=0.02), curve, 300)
    assert sorted(set(validated) - set(GRID)) == [56, 62, 68, 74, 81, 86, 89, 91, 92, 93, 94, 95]
    assert set(GRID) <= set(validated)  # the grid, unchanged
    assert crossing(validated, [curve[s] for s in validated], 1.3) == Crossing(95, 94)
    # On the grid alone, the crossing is only known to lie between 75 and 100.
    assert crossing(GRID, [curve[s] for s in GRID], 1.3) == Crossing(100, 75)


def test_the_schedule_resolves_a_crossing_in_an_lr_cooldown():
    """A power-law curve whose lr cools down over the last 60 steps (the loss falls faster there): the crossing
    at step 270 is found between 267 and 272 (1.8%), where the grid alone says between 250 and 275."""
    curve = {s: 2 + 10 * s**-0.5 - (0.3 * (s - 240) / 60 if s > 240 else 0) for s in range(1, 301)}
    validated = replay(TargetSchedule(curve[270], every=25, resolution=0.02), curve, 300)
    assert sorted(set(validated) - set(GRID)) == [56, 256, 262, 267, 272]
    found = crossing(validated, [curve[s] for s in validated], curve[270])
    assert found == Crossing(272, 267) and found.width <= 0.02
    assert crossing(GRID, [curve[s] for s in GRID], curve[270]) == Crossing(275, 250)


def test_a_drop_no_line_foresaw_keeps_the_grids_bracket():
    curve = {s: 3.0 if s < 60 else 1.0 for s in range(1, 101)}  # flat, then past the target at once
    validated = replay(TargetSchedule(2.0, every=25, resolution=0.02), curve, 100)
    assert validated == [25, 50, 75, 100]
    assert crossing(validated, [curve[s] for s in validated], 2.0) == Crossing(75, 50)


def test_a_stall_above_the_target_sends_the_schedule_back_to_the_grid():
    """The descent closes in from step 40, then stalls just above 2.0 (the line no longer reaches it): back on
    the grid, which brackets the later drop."""
    curve = {s: 3.0 - 0.0198 * s for s in range(1, 51)}
    curve |= {s: 2.01 + 0.001 * (s % 7) for s in range(51, 150)}
    curve |= {s: 1.9 for s in range(150, 201)}
    schedule = TargetSchedule(2.0, every=20, resolution=0.05)
    validated = replay(schedule, curve, 200)
    assert validated == [20, 40, 45, 47, 49, 51, 53, 60, 80, 100, 120, 140, 160, 180, 200]
    assert schedule.reached and not schedule.near
    assert crossing(validated, [curve[s] for s in validated], 2.0) == Crossing(160, 140)


def test_a_sides_steps_over_its_seeds():
    seeds = steps_to([[10, 20, 22, 24], [10, 20, 21], [10, 20]], [[3, 2.5, 2.1, 1.9], [3, 2.2, 2.0], [3, 2.5]],
                     [[1.0, 2.0, 2.2, 2.4], None, [1.0, 2.0]], 2.0)
    assert seeds.crossings == (Crossing(24, 22), Crossing(21, 20), None)
    assert seeds.times == (2.4, None, None)
    assert (seeds.mean, seeds.mean_time, seeds.all_reached) == (22.5, 2.4, False)
    assert seeds.width == pytest.approx(2 / 24)
    assert (seeds.text(), seeds.count()) == ("22 ± 2 (21–24)", "2 of 3 seeds")
    assert StepsTo((None,), (None,)).text() == "not reached"
    assert StepsTo((Crossing(5, 4),), (1.0,)).count() == "1 of 1 seed"


def run(name: str, steps: list[int], losses: list[float], wall: float = 10.0, train: float = 8.0) -> Run:
    return Run(name, tuple(steps), tuple(losses), val_time_s=tuple(s / 10 for s in steps), train_s=train,
               elapsed_s=wall, tokens=1000.0)


def two_sides() -> list[Side]:
    """A Muon side (two seeds crossing 2.0 at 48 and 52) and an AdamW side (at 96 and 100), each validated on the
    grid 25, 50, 75, 100 and closer near 2.0."""
    muon = Side("muon", SweptLr("model.init_args.muon.init_args.lr", "Muon", 0.02, 0.003))
    muon.sweep = {0.02: run("m0", [25, 47, 48, 50, 75, 100], [2.5, 2.02, 1.99, 1.98, 1.9, 1.8])}
    muon.seeds = [muon.sweep[0.02], run("m1", [25, 50, 51, 52, 75, 100], [2.6, 2.03, 2.01, 2.0, 1.9, 1.85])]
    adamw = Side("adamw", SweptLr("model.init_args.adamw.init_args.lr", "AdamW", 0.001))
    adamw.sweep = {0.001: run("a0", [25, 50, 75, 94, 96, 100], [3.0, 2.6, 2.2, 2.01, 2.0, 1.98], train=9.0)}
    adamw.seeds = [adamw.sweep[0.001], run("a1", [25, 50, 75, 97, 98, 100], [3.1, 2.7, 2.3, 2.02, 2.01, 2.0],
                                         train=9.0)]
    return [muon, adamw]


def test_the_target_table_and_verdict_give_each_sides_steps_over_its_seeds():
    sides = two_sides()
    target, (muon, adamw) = outcomes(sides, baseline=1, target=2.0)
    assert target == 2.0
    assert (muon.steps.text(), adamw.steps.text()) == ("50 ± 3 (48–52)", "98 ± 3 (96–100)")
    assert (muon.validations, muon.validation_share, adamw.validation_share) == (6.0, pytest.approx(0.2),
                                                                                pytest.approx(0.1))
    table = target_table(target, [muon, adamw])
    assert "| steps to 2.0000 (mean ± std, min–max) | seeds reaching 2.0000 | train time to 2.0000 (s) |" in table
    assert ("| muon | 0.02 | 2 | 1.8250 ± 0.0354 (1.8000–1.8500) | 50 ± 3 (48–52) (0.51x) | 2 of 2 seeds | "
            "5.0 (0.51x) | ≤ 2.1% | 6 (20%) |") in table
    assert ("| adamw (baseline) | 0.001 | 2 | 1.9900 ± 0.0141 (1.9800–2.0000) | 98 ± 3 (96–100) | 2 of 2 seeds | "
            "9.8 | ≤ 2.1% | 6 (10%) |") in table
    (line,) = target_verdict(target, [muon, adamw])
    assert line == ("Verdict: muon (lr 0.02) reaches 2.0000 in 50 ± 3 (48–52) steps (2 of 2 seeds), 0.51x the "
                    "adamw's 98 ± 3 (96–100) (2 of 2 seeds); final val loss 1.8250 against adamw's 1.9900.")


def test_against_the_baselines_own_final_loss_its_last_step_is_the_measure():
    """The target 1.99 is the AdamW side's mean final loss, which one of its seeds never reaches: the ratio is to
    its last step when the target is named after it, and there is none for the bare number."""
    sides = two_sides()
    target, results = outcomes(sides, baseline=1, target=1.99)
    assert results[1].steps.count() == "1 of 2 seeds"
    assert results[0].steps.crossings[1] == Crossing(75, 52)  # passed 1.99 in a grid gap: a wide bracket
    assert "| 62 ± 19 (48–75) (0.61x) | 2 of 2 seeds | 6.2 (0.61x) | ≤ 30.7% |" in target_table(target, results,
                                                                                                "adamw")
    (line,) = target_verdict(target, results, target_side="adamw", sides=sides)
    assert line == ("Verdict: muon (lr 0.02) reaches the adamw's final val loss 1.9900 in 62 ± 19 (48–75) steps "
                    "(2 of 2 seeds), 0.61x the adamw's 100 (its last step); final val loss 1.8250 against adamw's "
                    "1.9900.")
    (line,) = target_verdict(target, results)
    assert line == ("Verdict: muon (lr 0.02) reaches 1.9900 in 62 ± 19 (48–75) steps (2 of 2 seeds); final val "
                    "loss 1.8250 against adamw's 1.9900.")
    target, results = outcomes(sides, baseline=1, target=1.5)
    (line,) = target_verdict(target, results)
    assert line == ("Verdict: muon (lr 0.02) does not reach 1.5000 in 100 steps (0 of 2 seeds reach it): final val "
                    "loss 1.8250 against adamw's 1.9900.")


# ------------------------------------------------------------------------------------------ the callback


class Validated(MuonRegression):
    """`MuonRegression` with a validation set (its training samples)."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def val_dataloader(self):
        return self.train_dataloader()


class Validations(Callback):
    """The update count and the batches seen at every validation, and its loss."""

    def __init__(self) -> None:
        self.batches = 0
        self.seen: list[tuple[int, int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.seen.append((trainer.global_step, self.batches, float(trainer.callback_metrics["val_loss"])))


def test_the_callback_validates_where_the_schedule_says_with_accumulation(tmp_path):
    """40 updates of 2 micro-batches. Validated after every batch, the fit gives the loss after each update; with
    the callback (grid every 10 updates, resolution 10%), it validates exactly where the schedule replayed on that
    curve does, only after whole updates, and never otherwise."""
    every = Validations()
    make_trainer(tmp_path / "every", max_steps=40, val_check_interval=1, check_val_every_n_epoch=None,
                 callbacks=[every]).fit(Validated(samples=64, accumulate_grad_batches=2))
    curve = {step: loss for step, _, loss in every.seen if step}  # between micro-batches: the update's again
    assert sorted(curve) == list(range(1, 41))
    target = curve[27]
    expected = replay(TargetSchedule(target, every=10, resolution=0.1), curve, 40)

    seen = Validations()
    callback = NearTargetValidation(target=target, resolution=0.1)
    make_trainer(tmp_path / "near", max_steps=40, val_check_interval=10, check_val_every_n_epoch=None,
                 callbacks=[callback, seen]).fit(Validated(samples=64, accumulate_grad_batches=2))
    assert [step for step, _, _ in seen.seen] == expected
    assert all(batches == 2 * step for step, batches, _ in seen.seen)  # after whole updates only
    assert [loss for _, _, loss in seen.seen] == [curve[s] for s in expected]  # the same training
    assert len(expected) > 4 and set(range(10, 41, 10)) <= set(expected)  # dense near the target, and the grid
    assert callback.schedule is not None and callback.schedule.reached


def test_the_callback_needs_a_grid_of_steps(tmp_path):
    with pytest.raises(Exception, match=r"NearTargetValidation counts validations in steps: give "
                                        r"Trainer\(val_check_interval=N\) a number of steps"):
        make_trainer(tmp_path, max_steps=4, val_check_interval=0.5, callbacks=[NearTargetValidation(1.0)]).fit(
            Validated())


def test_fit_arguments_add_the_callback_with_its_target(tmp_path):
    args = fit_arguments("gpt_muon.yaml", tmp_path, "run", [], 300, 12, target=1.75, resolution=0.05)
    i = args.index(f"--trainer.callbacks+={NEAR_TARGET}")
    assert args[i + 1: i + 5] == ["--trainer.callbacks.target", "1.75", "--trainer.callbacks.resolution", "0.05"]
    assert args.index("--trainer.callbacks+=lightning_muon.WallClock") < i  # its init_args go to it, added last
    assert f"--trainer.callbacks+={NEAR_TARGET}" not in fit_arguments("gpt_muon.yaml", tmp_path, "run", [], 300)


# ------------------------------------------------------------------------------------------ the command


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "sgd", "gpt_muon.yaml", "gpt_adamw.yaml"],
         r"--target 'sgd': give a loss \(e.g. --target 1.75\) or a side's name, one of gpt_muon, gpt_adamw"),
        (["--target", "1.7", "--resolution", "0", "gpt_muon.yaml"], r"--resolution is the gap between the last"),
    ],
    ids=["no such side", "resolution 0"],
)
def test_bad_target_arguments_stop_before_any_fit(argv, message, tmp_path, monkeypatch, capsys):
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a fit started"))
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *argv, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_named_targets_side_is_tuned_first_and_the_others_get_its_loss(tmp_path, monkeypatch, capsys):
    """The fits replaced by curves: the AdamW side (the target) is fitted first, on the grid; the Muon side with
    the AdamW side's mean final loss as its target."""
    monkeypatch.chdir(tmp_path)
    for name, muon in (("m", "{class_path: lightning_muon.Muon, init_args: {lr: 0.02}}"), ("a", "null")):
        (tmp_path / f"{name}.yaml").write_text(f"# extends: gpt_muon.yaml\nmodel:\n  init_args:\n    muon: {muon}\n")
    calls = []
    curves = {"m": two_sides()[0].seeds, "a": two_sides()[1].seeds}

    def fake_subprocess_fit(log_root, overrides, max_steps, val_points, env=None, target=None, resolution=0.02):
        def fit(spec, lr, seed):
            calls.append((spec.name, seed, target, resolution))
            return curves[spec.name][seed]
        return fit

    monkeypatch.setattr(tuned, "subprocess_fit", fake_subprocess_fit)
    main(["compare", "m.yaml", "a.yaml", "--seeds", "2", "--target", "a", "--resolution", "0.05", "--out", "out"])
    assert calls == [("a", 0, None, 0.02), ("a", 1, None, 0.02), ("m", 0, 1.99, 0.05), ("m", 1, 1.99, 0.05)]
    report = (tmp_path / "out" / "comparison.md").read_text()
    assert "Target: the a's final val loss 1.9900. Baseline: **a** (its model has muon: null)." in report
    assert "a's own fits were made before its final loss was known, on the grid alone." in report
    assert "| m | 0.02 | 2 |" in report and "Verdict: m (lr 0.02) reaches the a's final val loss 1.9900 in" in report
    printed = capsys.readouterr().out
    assert "Cost: validations per fit, the grid's and those near the target: m 6 (20% of its wall time)" in printed


def tiny_configs(directory: Path) -> None:
    """gpt_muon.yaml at one layer of width 32 on 32-byte windows, and its AdamW twin (``muon: null``)."""
    (directory / "tiny_muon.yaml").write_text(
        "# extends: gpt_muon.yaml\n"
        "trainer: {limit_val_batches: 1, log_every_n_steps: 2, enable_progress_bar: false}\n"
        "data:\n  init_args: {block_size: 32, batch_size: 4, max_bytes: 200000, val_batches: 1, "
        f"cache_dir: {directory / 'cache'}}}\n"
        "model:\n  init_args: {n_layer: 1, n_embd: 32, block_size: 32}\n"
    )
    (directory / "tiny_adamw.yaml").write_text("# extends: tiny_muon.yaml\nmodel:\n  init_args:\n    muon: null\n")


@pytest.mark.slow
def test_compare_with_a_named_target_end_to_end(tmp_path, monkeypatch, capsys):
    """Two tiny fits of 24 updates through the real command, the AdamW one first (its final loss is the target):
    the Muon fit validates on the grid (every 6 updates) and closes in on the target, 5% of its steps apart."""
    monkeypatch.chdir(tmp_path)
    tiny_configs(tmp_path)
    out = tmp_path / "out"
    main(["compare", "tiny_muon.yaml", "tiny_adamw.yaml", "--target", "tiny_adamw", "--resolution", "0.05",
          "--max_steps", "24", "--val_points", "4", "--out", str(out)])
    printed = capsys.readouterr().out
    adamw, muon = (load_run(out / "lightning_logs" / n) for n in ("tiny_adamw", "tiny_muon"))
    assert adamw.val_steps == (6, 12, 18, 24)
    saved = yaml.safe_load((out / "lightning_logs" / "tiny_muon" / "config.yaml").read_text())
    (near,) = [c for c in saved["trainer"]["callbacks"] if c["class_path"] == NEAR_TARGET]
    assert near["init_args"]["target"] == adamw.val_loss[-1] and near["init_args"]["resolution"] == 0.05
    assert set(adamw.val_steps) <= set(muon.val_steps)  # the grid, and more near the target
    found = crossing(muon.val_steps, muon.val_loss, adamw.val_loss[-1])
    assert found is not None
    # Resolved to 5%, unless the run passed the target between two grid validations before a line foresaw it.
    assert found.width <= 0.05 or (found.step in adamw.val_steps and found.before in (0, *adamw.val_steps))
    report = (out / "comparison.md").read_text()
    assert f"Target: tiny_adamw's final val loss {adamw.val_loss[-1]:.4f}." in report
    assert report.index("tiny_adamw: `lightning-muon fit") < report.index("tiny_muon: `lightning-muon fit")
    assert f"tiny_muon: reached it after step {found.before} and by step {found.step}" in printed
    assert torch.isfinite(torch.tensor(muon.val_loss)).all()
